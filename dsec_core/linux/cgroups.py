"""Putting the calling process into cgroups of its own with a memory limit, and taking it out
again: how the node daemon keeps a sandbox that misbehaves from inflating it without bound.

Works on cgroup v1 (one hierarchy per controller under ``/sys/fs/cgroup``, as on this project's
hosts) and on a pure cgroup v2 host (one hierarchy; the root's ``cgroup.subtree_control`` must
enable ``memory`` and ``pids``, as systemd does). Sandboxes are never in these cgroups: runc
places each in ``dsec/<id>`` by absolute path, whatever cgroup its caller is in.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import NodeUnavailable

__all__ = [
    "CGROUP_ROOT",
    "ConfinedCgroups",
    "cgroup2_root",
    "confine_self",
    "hierarchies",
    "memory_limit",
    "place_process",
    "release_self",
    "remove_cgroups",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")
_CONTROLLERS = ("memory", "pids")


@dataclass(frozen=True)
class ConfinedCgroups:
    """Where ``confine_self`` put the process: ``(hierarchy, cgroup dir, cgroup it came
    from)`` per controller hierarchy (one entry on cgroup v2)."""

    places: tuple[tuple[Path, Path, str], ...]

    @property
    def dirs(self) -> tuple[Path, ...]:
        return tuple(d for _, d, _ in self.places)


def _unified() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted: ``/sys/fs/cgroup`` on a v2 host, its
    ``unified`` mount on a hybrid one (runc places containers there too); None without one.
    cgroup BPF programs attach to directories of this hierarchy."""
    for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        if (root / "cgroup.controllers").exists():
            return root
    return None


def hierarchies() -> list[Path]:
    """The hierarchies that hold the memory and pids controllers (one on cgroup v2)."""
    if _unified():
        return [CGROUP_ROOT]
    return [CGROUP_ROOT / c for c in _CONTROLLERS if (CGROUP_ROOT / c / "cgroup.procs").exists()]


def _own_cgroup(hierarchy: Path) -> str:
    """The calling process's cgroup in ``hierarchy``, from /proc/self/cgroup."""
    unified = hierarchy == CGROUP_ROOT
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (unified and controllers == "") or hierarchy.name in controllers.split(","):
                return path
    return "/"


def memory_limit(cgroup_dir: Path) -> int | None:
    """The memory limit of a cgroup in bytes (None: unlimited or unreadable)."""
    for name in ("memory.limit_in_bytes", "memory.max"):
        try:
            text = (cgroup_dir / name).read_text().strip()
        except OSError:
            continue
        return None if text == "max" or int(text) >= 1 << 62 else int(text)
    return None


def confine_self(relative: str, memory: int) -> ConfinedCgroups:
    """Move this process (all its threads) into ``<hierarchy>/<relative>`` of the memory and
    pids hierarchies, made if missing, with ``memory`` bytes as the memory limit (0: none).

    Call it before starting threads or children that must be confined too (children inherit
    the cgroup). ``NodeUnavailable`` if the kernel or permissions do not allow it.
    """
    places = []
    try:
        for hierarchy in hierarchies():
            cg = _make(hierarchy, relative, memory)
            origin = _own_cgroup(hierarchy)
            (cg / "cgroup.procs").write_text(str(os.getpid()))
            places.append((hierarchy, cg, origin))
    except OSError as e:
        release_self(ConfinedCgroups(tuple(places)))
        raise NodeUnavailable(
            f"cannot put the process into cgroup {relative} (memory limit {memory}): {e}",
            cgroup=relative,
        ) from e
    if not places:
        raise NodeUnavailable("no memory or pids cgroup hierarchy under /sys/fs/cgroup")
    return ConfinedCgroups(tuple(places))


def _make(hierarchy: Path, relative: str, memory: int) -> Path:
    cg = hierarchy / relative
    cg.mkdir(parents=True, exist_ok=True)
    if hierarchy.name == "memory" and memory:
        (cg / "memory.limit_in_bytes").write_text(str(memory))
    elif hierarchy == CGROUP_ROOT and memory:
        (cg / "memory.max").write_text(str(memory))
    return cg


def place_process(pid: int, relative: str, memory: int) -> tuple[Path, ...]:
    """Move process ``pid`` (all its threads) into ``<hierarchy>/<relative>`` of the memory
    and pids hierarchies, made if missing, with ``memory`` bytes as the limit (0: none): a
    helper daemon that must not stay in its starter's cgroups. ``NodeUnavailable`` if the
    kernel or permissions do not allow it."""
    dirs = []
    try:
        for hierarchy in hierarchies():
            cg = _make(hierarchy, relative, memory)
            (cg / "cgroup.procs").write_text(str(pid))
            dirs.append(cg)
    except OSError as e:
        raise NodeUnavailable(
            f"cannot put process {pid} into cgroup {relative}: {e}", cgroup=relative
        ) from e
    return tuple(dirs)


def remove_cgroups(relative: str) -> list[Path]:
    """Remove ``<hierarchy>/<relative>`` of the memory and pids hierarchies, and their parent
    once empty; returns those that could not go (still holding processes)."""
    kept = []
    for hierarchy in hierarchies():
        cg = hierarchy / relative
        try:
            cg.rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise
            kept.append(cg)
        with contextlib.suppress(OSError):
            cg.parent.rmdir()
    return kept


def release_self(confined: ConfinedCgroups) -> list[Path]:
    """Move this process back where it came from and remove the cgroups it was confined to;
    returns those that could not go (still holding processes, such as a child that outlives
    us), which stay for the next ``confine_self`` to reuse."""
    kept = []
    for hierarchy, cg, origin in confined.places:
        back = hierarchy / origin.lstrip("/")
        for target in (back, hierarchy):
            try:
                (target / "cgroup.procs").write_text(str(os.getpid()))
                break
            except OSError:
                continue
        try:
            cg.rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise
            kept.append(cg)
        with contextlib.suppress(OSError):  # the shared parent, once its last child is gone
            cg.parent.rmdir()
    return kept
