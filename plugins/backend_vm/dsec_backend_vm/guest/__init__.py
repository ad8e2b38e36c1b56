"""Small static C programs that run inside a VM guest (``clickpad.c``: a button on the
framebuffer that reports clicks and keys), and ``ensure_guest_program``, which compiles one
once per version of its source.

A program is named by a digest of its source, as the sandbox agent is
(``dsec_core.agent.ensure_agent``), so a changed source never reuses a stale build; it is
linked statically so it runs in an initramfs with nothing but busybox.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dsec_core.errors import BackendUnavailable, InvalidSpec
from dsec_core.linux.tools import compile_static

__all__ = ["GUEST_SOURCE_DIR", "ensure_guest_program"]

GUEST_SOURCE_DIR = Path(__file__).parent


def ensure_guest_program(name: str, bin_dir: Path, source_dir: Path = GUEST_SOURCE_DIR) -> Path:
    """Return ``bin_dir/<name>-<digest>``, built from ``source_dir/<name>.c`` first if missing.

    The digest is the first 12 hex digits of a sha256 over the source. ``compile_static``
    builds it under a temporary name in ``bin_dir`` that is renamed into place, so concurrent
    callers never see a half-written binary. An unknown ``name`` is an ``InvalidSpec``; no gcc is a
    ``BackendUnavailable``; a failed build is a ``ToolError`` with gcc's output.
    """
    source = Path(source_dir) / f"{name}.c"
    if "/" in name or not source.is_file():
        raise InvalidSpec(f"no guest program {name!r} in {source_dir}", name=name)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    bin_dir = Path(bin_dir)
    target = bin_dir / f"{name}-{digest}"
    if target.exists():
        return target
    return compile_static([source], target, f"the guest program {name}", missing=BackendUnavailable)
