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
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import NodeUnavailable
from .sched import KernelFeature

__all__ = [
    "CGROUP_ROOT",
    "ConfinedCgroups",
    "MemoryWindow",
    "cgroup2_root",
    "close_memory_window",
    "confine_self",
    "cpu_cgroup_dir",
    "cpu_hierarchy",
    "cpu_idle",
    "freeze",
    "frozen",
    "hierarchies",
    "kill_members",
    "memory_cgroup_dir",
    "memory_limit",
    "oom_kills",
    "open_memory_window",
    "place_process",
    "place_process_cpu",
    "place_process_v2",
    "reclaim_memory",
    "release_self",
    "remove_cgroups",
    "thaw",
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


def memory_cgroup_dir(relative: str) -> Path | None:
    """``<memory hierarchy>/<relative>`` if that cgroup exists: the v1 ``memory`` hierarchy,
    or the v2 one where its memory controller is on."""
    for d in (CGROUP_ROOT / "memory" / relative, CGROUP_ROOT / relative):
        if (d / "memory.limit_in_bytes").exists() or (d / "memory.max").exists():
            return d
    return None


@dataclass
class MemoryWindow:
    """A cgroup's memory limit lowered, for a while, to what it uses at the start plus
    ``extra`` bytes, and what happened in that while: the peak above the start's use
    (``peak``, bytes, page cache included) and how many processes the OOM killer took
    (``oom_kills``). ``open_memory_window`` starts one, ``close_memory_window`` ends it."""

    dir: Path
    extra: int
    limit_before: str  # the limit file's text, written back at the close
    baseline: int
    oom_before: int
    v2: bool
    peak_fd: int | None = None  # cgroup v2: memory.peak, reset through (and read from) this fd
    peak: int = 0
    oom_kills: int = 0


def _read(d: Path, name: str) -> str:
    return (d / name).read_text()


def _oom_kills(d: Path, v2: bool) -> int:
    text = _read(d, "memory.events" if v2 else "memory.oom_control")
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def oom_kills(relative: str) -> int | None:
    """How many processes the OOM killer has killed in memory cgroup ``relative`` (None if the
    cgroup is gone or does not say)."""
    d = memory_cgroup_dir(relative)
    if d is None:
        return None
    try:
        return _oom_kills(d, not (d / "memory.limit_in_bytes").exists())
    except (OSError, ValueError):
        return None


def open_memory_window(d: Path, extra: int) -> MemoryWindow:
    """Lower the limit of memory cgroup ``d`` to its use now plus ``extra`` bytes (never above
    the limit it has) and start measuring its peak afresh: what runs in it from here gets
    ``extra`` bytes, and the OOM killer takes it when it asks for more. OSError if the cgroup
    is gone or will not take the limit."""
    v2 = not (d / "memory.limit_in_bytes").exists()
    limit_file, usage_file = (
        ("memory.max", "memory.current")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    before = _read(d, limit_file).strip()
    baseline = int(_read(d, usage_file))
    cap = None if before == "max" or int(before) >= 1 << 62 else int(before)
    limit = baseline + extra if cap is None else min(baseline + extra, cap)
    w = MemoryWindow(d, extra, before, baseline, _oom_kills(d, v2), v2)
    if v2:  # a write resets the peak as seen through the same open file (Linux 6.12)
        w.peak_fd = os.open(d / "memory.peak", os.O_RDWR | os.O_CLOEXEC)
        try:
            os.write(w.peak_fd, b"reset\n")
        except OSError:
            os.close(w.peak_fd)
            w.peak_fd = None
            raise
    else:
        (d / "memory.max_usage_in_bytes").write_text("0")
    try:
        (d / limit_file).write_text(str(limit))
    except OSError:
        if w.peak_fd is not None:
            os.close(w.peak_fd)
        raise
    return w


def close_memory_window(w: MemoryWindow) -> MemoryWindow:
    """Read what happened in the window into ``w`` and give the cgroup its limit back. OSError
    if the cgroup went away meanwhile."""
    v2 = w.v2
    try:
        if w.peak_fd is not None:
            peak = int(os.pread(w.peak_fd, 64, 0))
        else:
            peak = int(_read(w.dir, "memory.max_usage_in_bytes"))
        w.peak = max(0, peak - w.baseline)
        w.oom_kills = _oom_kills(w.dir, v2) - w.oom_before
        (w.dir / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(w.limit_before)
    finally:
        if w.peak_fd is not None:
            os.close(w.peak_fd)
            w.peak_fd = None
    return w


def _freezer(relative: str) -> tuple[Path, bool] | None:
    """Where cgroup ``relative`` is frozen: its cgroup v2 directory (``cgroup.freeze``, which
    lets fatal signals through, so a frozen cgroup can still be killed) where the host has that
    hierarchy, else its v1 ``freezer`` directory; ``(dir, is_v2)``, None if neither exists."""
    root = cgroup2_root()
    if root is not None and (root / relative / "cgroup.freeze").exists():
        return root / relative, True
    d = CGROUP_ROOT / "freezer" / relative
    if (d / "freezer.state").exists():
        return d, False
    return None


def frozen(relative: str) -> bool:
    """Whether cgroup ``relative`` is frozen (or freezing); False if it has no freezer."""
    where = _freezer(relative)
    if where is None:
        return False
    d, v2 = where
    try:
        if v2:
            return (d / "cgroup.freeze").read_text().strip() == "1"
        return (d / "freezer.state").read_text().strip() != "THAWED"
    except OSError:
        return False


def freeze(relative: str, timeout: float = 5.0) -> None:
    """Freeze every process of cgroup ``relative`` and return once they all are. OSError if
    the cgroup has no freezer or is gone; TimeoutError if it does not settle in ``timeout``
    seconds (it is thawed again then)."""
    _set_frozen(relative, True, timeout)


def thaw(relative: str, timeout: float = 5.0) -> None:
    """Let the processes of cgroup ``relative`` run again (a no-op if it is not frozen)."""
    _set_frozen(relative, False, timeout)


def _set_frozen(relative: str, on: bool, timeout: float) -> None:
    where = _freezer(relative)
    if where is None:
        raise FileNotFoundError(errno.ENOENT, f"no freezer for cgroup {relative}")
    d, v2 = where
    if v2:
        (d / "cgroup.freeze").write_text("1" if on else "0")
    else:
        (d / "freezer.state").write_text("FROZEN" if on else "THAWED")
    deadline = time.monotonic() + timeout
    delay = 0.0002
    while not _settled(d, v2, on):
        if time.monotonic() > deadline:
            if on:  # leave it running rather than half frozen
                _set_frozen(relative, False, timeout)
            raise TimeoutError(f"cgroup {relative} did not {'freeze' if on else 'thaw'}")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _settled(d: Path, v2: bool, on: bool) -> bool:
    if v2:
        events = dict(line.split(" ", 1) for line in (d / "cgroup.events").read_text().splitlines())
        return events.get("frozen", "0").strip() == ("1" if on else "0")
    return (d / "freezer.state").read_text().strip() == ("FROZEN" if on else "THAWED")


def reclaim_memory(d: Path) -> int:
    """Have the kernel reclaim what it can of memory cgroup ``d`` (v1 ``memory.force_empty``,
    v2 ``memory.reclaim``): page cache, and anonymous memory only where there is swap. Returns
    the bytes it freed (0 if the cgroup has neither file, or the kernel refused)."""
    v2 = not (d / "memory.limit_in_bytes").exists()
    usage_file = "memory.current" if v2 else "memory.usage_in_bytes"
    try:
        before = int(_read(d, usage_file))
    except OSError:
        return 0
    try:
        if v2:
            (d / "memory.reclaim").write_text(str(before))
        else:
            (d / "memory.force_empty").write_text("0")
    except OSError:  # EAGAIN from memory.reclaim when it could not take all it was asked
        pass
    try:
        return max(0, before - int(_read(d, usage_file)))
    except OSError:
        return 0


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


def place_process_cpu(pid: int, relative: str, cpus: float, period: int = 100_000) -> Path:
    """Move process ``pid`` into ``relative`` of the cpu controller's hierarchy, made if
    missing, with a CFS quota of ``cpus`` cores. ``NodeUnavailable`` without a cpu
    controller or if the kernel refuses."""
    hier = cpu_hierarchy()
    if hier is None:
        raise NodeUnavailable("no cpu cgroup controller", cgroup=relative)
    cg = hier / relative
    quota = max(1000, int(cpus * period))
    try:
        cg.mkdir(parents=True, exist_ok=True)
        if hier == cgroup2_root():
            (cg / "cpu.max").write_text(f"{quota} {period}")
        else:
            (cg / "cpu.cfs_period_us").write_text(str(period))
            (cg / "cpu.cfs_quota_us").write_text(str(quota))
        (cg / "cgroup.procs").write_text(str(pid))
    except OSError as e:
        raise NodeUnavailable(
            f"cannot put process {pid} into cpu cgroup {relative}: {e}", cgroup=relative
        ) from e
    return cg


def place_process_v2(pid: int, relative: str) -> Path | None:
    """Move process ``pid`` into ``relative`` of the cgroup v2 hierarchy too, made if missing:
    on a hybrid host, where ``place_process`` uses v1's memory and pids hierarchies, the
    directory cgroup BPF attaches to and whose inode number is the cgroup's id. The directory,
    or None without a v2 hierarchy. ``NodeUnavailable`` if the kernel refuses."""
    root = cgroup2_root()
    if root is None:
        return None
    cg = root / relative
    try:
        cg.mkdir(parents=True, exist_ok=True)
        (cg / "cgroup.procs").write_text(str(pid))
    except OSError as e:
        raise NodeUnavailable(
            f"cannot put process {pid} into cgroup {cg}: {e}", cgroup=relative
        ) from e
    return cg


def remove_cgroups(relative: str) -> list[Path]:
    """Remove ``<hierarchy>/<relative>`` of the memory and pids hierarchies (and of the cpu
    controller's, where ``place_process_cpu`` made one, and of the v2 hierarchy, where
    ``place_process_v2`` did), and their parent once empty; returns those that could not go
    (still holding processes)."""
    return [cg for cg in (h / relative for h in _sandbox_places()) if not _remove_cgroup(cg)]


def _sandbox_places() -> list[Path]:
    """The hierarchies a sandbox's cgroups may be in: the memory and pids ones, the cpu
    controller's and the v2 one."""
    places = list(hierarchies())
    for extra in (cpu_hierarchy(), cgroup2_root()):
        if extra is not None and extra not in places:
            places.append(extra)
    return places


def kill_members(relative: str) -> list[int]:
    """SIGKILL every process in ``<hierarchy>/<relative>`` of the hierarchies
    ``remove_cgroups`` removes from: those a record does not name (a VM's QEMU that a daemon
    started and died before it noted its pid). The pids signalled; their exits are the
    caller's to wait for (``remove_cgroups`` until it removes them all)."""
    killed: set[int] = set()
    for cg in (h / relative for h in _sandbox_places()):
        try:
            pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
        except (FileNotFoundError, ValueError):
            continue
        for pid in pids:
            if pid not in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
    return sorted(killed)


def _remove_cgroup(cg: Path) -> bool:
    """Remove cgroup ``cg`` (gone already is fine), then its parent if that is now empty;
    False if ``cg`` still holds processes and stays."""
    try:
        cg.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
            raise
        return False
    finally:
        with contextlib.suppress(OSError):  # the shared parent, once its last child is gone
            cg.parent.rmdir()
    return True


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
        if not _remove_cgroup(cg):
            kept.append(cg)
    return kept
