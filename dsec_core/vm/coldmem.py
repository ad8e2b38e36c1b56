"""How much of a VM's RAM its guest has not touched lately, seen from the host: the referenced
bits of the pages QEMU maps as the guest's RAM.

``ColdProbe.sample(pid, size)`` reads ``/proc/<pid>/smaps`` for the mapping of ``size`` bytes
(the guest's RAM: anonymous, or the saved RAM file a restored VM maps) and returns its resident
bytes and those not referenced since the previous sample, then clears the process's referenced
bits (``/proc/<pid>/clear_refs``) for the next one. Under TCG the guest's accesses are QEMU's own
and set the bits; under KVM a guest's accesses go through the second-level page tables, which
this does not read (DAMON's physical-address mode does; ``damon_status`` says whether this
node could run it).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from ..linux.processes import cpu_demand_seconds

__all__ = ["ColdProbe", "RamSample", "damon_status", "ram_mapping"]

DAMON_ADMIN = Path("/sys/kernel/mm/damon/admin/kdamonds")


@dataclass(frozen=True)
class RamSample:
    """One sample of a guest's RAM: resident bytes, those not referenced since the last
    sample, and the share of a core QEMU wanted since then (how busy the guest is: what its
    threads ran plus what they waited runnable, so a busy guest on a loaded host counts as
    busy though it got less)."""

    resident: int
    cold: int
    busy: float = 0.0


class ColdProbe:
    """Samples of each VM's RAM mapping; the first sample of a process has nothing to compare
    with and reports nothing cold."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[float, float]] = {}  # pid -> (monotonic, CPU seconds wanted)

    def sample(self, pid: int, size: int) -> RamSample | None:
        """``pid``'s guest RAM (the mapping of exactly ``size`` bytes) now, or None if the
        process or the mapping is gone."""
        try:
            text = Path(f"/proc/{pid}/smaps").read_text()
        except OSError:
            self._seen.pop(pid, None)
            return None
        found = ram_mapping(text, size)
        if found is None:
            return None
        rss, referenced = found
        now, cpu = time.monotonic(), _cpu_seconds(pid)
        last = self._seen.get(pid)
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("1\n")
            self._seen[pid] = (now, cpu)
        if last is None:
            return RamSample(resident=rss, cold=0)
        busy = (cpu - last[1]) / max(now - last[0], 1e-3)
        return RamSample(resident=rss, cold=max(0, rss - referenced), busy=busy)

    def forget(self, pid: int) -> None:
        self._seen.pop(pid, None)


def _cpu_seconds(pid: int) -> float:
    return cpu_demand_seconds(pid) or 0.0


def ram_mapping(smaps: str, size: int) -> tuple[int, int] | None:
    """(Rss, Referenced) in bytes of the first mapping of ``size`` bytes in ``smaps``."""
    inside = False
    rss = None
    for line in smaps.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, _, end = head.partition("-")
            try:
                inside = int(end, 16) - int(start, 16) == size
            except ValueError:
                inside = False
            continue
        if not inside:
            continue
        key, _, value = line.partition(":")
        if key == "Rss":
            rss = int(value.split()[0]) << 10
        elif key == "Referenced" and rss is not None:
            return rss, int(value.split()[0]) << 10
    return None


def damon_status() -> tuple[bool, str]:
    """Whether this node could run DAMON of its own through the sysfs interface, and why not:
    the interface changes its number of kdamonds only while none runs, so a host whose own
    DAMON (a platform's proactive reclaim, say) runs leaves no room for another user."""
    nr = DAMON_ADMIN / "nr_kdamonds"
    if not nr.is_file():
        return False, "no DAMON sysfs interface (CONFIG_DAMON_SYSFS)"
    running = []
    for d in sorted(DAMON_ADMIN.iterdir()):
        with contextlib.suppress(OSError):
            if d.is_dir() and (d / "state").read_text().strip() == "on":
                running.append(d.name)
    if running:
        return False, (
            f"DAMON's sysfs interface is held: kdamond {', '.join(running)} runs for another "
            "user of this host, and nr_kdamonds cannot change while one does"
        )
    return True, "DAMON's sysfs interface is free"
