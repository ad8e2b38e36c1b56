"""The in-sandbox agent: a C program (``src/``) that runs as each sandbox's init and serves exec,
shell sessions and file operations; ``ensure_agent`` compiles it once per source version.

The sources are split by concern: ``wire.c`` (the wire protocol, whose full table opens that
file), ``proctree.c``, ``exec.c``, ``sessions.c``, ``files.c``, ``guard.c`` (what keeps the
sandbox's code away from the agent), ``main.c`` (with the architecture notes), ``alloc.c``
(memory and buffers), ``io.c`` (descriptors and time) and the shared header ``agent.h``. The
binary is static (glibc, no NSS) so it runs in any root filesystem, and it is named by a digest
over every source file, so a changed agent never reuses a stale build.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import BackendUnavailable
from ..linux.tools import compile_static

__all__ = ["AGENT_SOURCE_DIR", "agent_sources", "ensure_agent"]

AGENT_SOURCE_DIR = Path(__file__).with_name("src")


def agent_sources(source_dir: Path = AGENT_SOURCE_DIR) -> list[Path]:
    """The agent's source files (``*.c`` and ``*.h`` in ``source_dir``), sorted by name."""
    source_dir = Path(source_dir)
    return sorted(
        (p for p in source_dir.iterdir() if p.suffix in (".c", ".h") and p.is_file()),
        key=lambda p: p.name,
    )


def _digest(sources: list[Path]) -> str:
    """First 12 hex digits of a sha256 over every file's name, length and bytes, in order.

    Names and lengths are part of it so renaming a file or moving code from one file to the
    next changes the digest even when the concatenated bytes would not.
    """
    h = hashlib.sha256()
    for path in sources:
        data = path.read_bytes()
        name = path.name.encode()
        h.update(len(name).to_bytes(8, "little") + name + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:12]


def ensure_agent(bin_dir: Path, source_dir: Path = AGENT_SOURCE_DIR) -> Path:
    """Return ``bin_dir/dsec-agent-<digest>``, compiling it first if it is missing.

    Compiles every ``*.c`` in ``source_dir`` together (with ``-I source_dir``); the digest covers
    the headers too. ``compile_static`` builds it under a temporary name and renames it into
    place, so concurrent callers (several daemons, parallel tests) never see a half-written
    binary. No gcc is a ``BackendUnavailable``, a failed build a ``ToolError``.
    """
    source_dir = Path(source_dir)
    sources = agent_sources(source_dir)
    digest = _digest(sources)
    bin_dir = Path(bin_dir)
    target = bin_dir / f"dsec-agent-{digest}"
    if target.exists():
        return target
    return compile_static(
        [p for p in sources if p.suffix == ".c"],
        target,
        "the sandbox agent",
        flags=["-O2", "-Wall", "-Werror", "-I", os.fspath(source_dir)],
        missing=BackendUnavailable,
    )
