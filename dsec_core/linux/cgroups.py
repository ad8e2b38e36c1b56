"""Putting the calling process into cgroups of its own with a memory limit, and taking it out
again: how the node daemon keeps a sandbox that misbehaves from inflating it without bound.
Also where the cpu controller is, and whether its cgroups can be made idle (``cpu.idle``).

Works on cgroup v1 (one hierarchy per controller under ``/sys/fs/cgroup``, as on this project's
hosts) and on a pure cgroup v2 host (one hierarchy; the root's ``cgroup.subtree_control`` must
enable ``memory`` and ``pids``, as systemd does). Sandboxes are never in these cgroups: runc
places each in ``dsec/<id>`` by absolute path, whatever cgroup its caller is in.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import NodeUnavailable
from .sched import KernelFeature

__all__ = [
    "CGROUP_ROOT",
    "ConfinedCgroups",
    "cgroup2_root",
    "confine_self",
    "cpu_cgroup_dir",
    "cpu_hierarchy",
    "cpu_idle",
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


def _controllers(root: Path, name: str = "cgroup.controllers") -> list[str]:
    try:
        return (root / name).read_text().split()
    except OSError:
        return []


def cpu_hierarchy() -> Path | None:
    """The hierarchy that holds the cpu controller: the cgroup v2 one if it lists ``cpu``
    (a v2 host; a hybrid host's ``unified`` mount only if cpu was moved there), else the v1
    ``cpu`` hierarchy; None without one."""
    root2 = cgroup2_root()
    if root2 is not None and "cpu" in _controllers(root2):
        return root2
    v1 = CGROUP_ROOT / "cpu"
    return v1 if (v1 / "cgroup.procs").exists() else None


def cpu_cgroup_dir(relative: str) -> Path | None:
    """Cgroup ``relative`` (e.g. ``dsec/<id>``) in the cpu controller's hierarchy, if there
    is one (whether the directory exists is the caller's question)."""
    hier = cpu_hierarchy()
    return None if hier is None else hier / relative


def cpu_idle() -> KernelFeature:
    """Whether cgroups of the cpu controller can be made idle (``cpu.idle``, Linux 5.15): their
    tasks then count as SCHED_IDLE against sibling cgroups. Cgroup v1 shows the file in every
    cgroup, the root included; cgroup v2 in every cgroup below a root whose
    ``cgroup.subtree_control`` enables ``cpu``."""
    name = "cpu_idle"
    hier = cpu_hierarchy()
    root2 = cgroup2_root()
    v2 = f"cgroup v2 at {root2} has no cpu controller" if root2 is not None else "no cgroup v2"
    if hier is None:
        return KernelFeature(name, False, f"no cpu controller: no cgroup v1 cpu hierarchy, {v2}")
    if hier == root2:
        if "cpu" not in _controllers(hier, "cgroup.subtree_control"):
            return KernelFeature(
                name, False, f"cgroup v2 at {hier} does not enable cpu in cgroup.subtree_control"
            )
        if _kernel_version() < (5, 15) and not _any_cpu_idle(hier):
            return KernelFeature(name, False, "the kernel has no cpu.idle (Linux 5.15 added it)")
        return KernelFeature(name, True, f"cgroup v2 cpu controller at {hier}")
    if not (hier / "cpu.idle").exists():
        return KernelFeature(
            name, False, f"the cgroup v1 cpu hierarchy at {hier} has no cpu.idle (kernel < 5.15)"
        )
    return KernelFeature(name, True, f"cgroup v1 cpu controller at {hier} ({v2})")


def _kernel_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _any_cpu_idle(root: Path) -> bool:
    return any((d / "cpu.idle").exists() for d in root.iterdir() if d.is_dir())


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
