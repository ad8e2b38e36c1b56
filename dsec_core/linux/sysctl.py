"""Kernel tunables under ``/proc/sys`` that a node holding thousands of sandboxes needs raised.

Only ever raised, never lowered, and each change is returned so the caller can log it: these are
host-wide settings.
"""

from __future__ import annotations

import resource
from pathlib import Path

__all__ = ["NODE_MINIMUMS", "NOFILE_MINIMUM", "raise_nofile", "raise_to"]

#: What a node of thousands of sandboxes needs at the least. ``kernel.pid_max`` defaults to
#: 32768 on many hosts, and pids are host-wide even across pid namespaces: 2,000 sandboxes of 16
#: processes would use them all. 4194304 is the kernel's limit on 64-bit.
NODE_MINIMUMS = {"kernel.pid_max": 4194304}
#: The node daemon's open-file limit at the least: several descriptors a sandbox for 8,192.
NOFILE_MINIMUM = 65536


def raise_to(minimums: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Raise each sysctl below its minimum; ``{name: (old, new)}`` of what changed. A value that
    cannot be read or written (no such sysctl, a read-only /proc/sys in a container) is left
    alone."""
    changed = {}
    for name, minimum in minimums.items():
        path = Path("/proc/sys") / name.replace(".", "/")
        try:
            old = int(path.read_text().split()[0])
            if old < minimum:
                path.write_text(f"{minimum}\n")
                changed[name] = (old, minimum)
        except (OSError, ValueError, IndexError):
            continue
    return changed


def raise_nofile(minimum: int) -> tuple[int, int] | None:
    """Raise this process's open-file limit (soft and hard) to at least ``minimum``, within
    ``fs.nr_open``: a node keeps a descriptor or two per sandbox (its exit watch, connections).
    ``(old soft, new soft)`` if it changed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= minimum:
        return None
    try:
        ceiling = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        ceiling = hard
    want = min(minimum, ceiling)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (OSError, ValueError):  # not allowed to raise the hard limit: up to it, then
        want = hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return (soft, want) if want != soft else None
