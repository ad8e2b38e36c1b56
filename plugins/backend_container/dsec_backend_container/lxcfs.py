"""The node's lxcfs: one FUSE daemon per node whose files show each reader its own cgroup's CPU
and memory limits (``/proc/meminfo``, ``/proc/cpuinfo``, ...), bind-mounted over the kernel's
files in every sandbox.

lxcfs answers a read from the reader's cgroups (the FUSE request carries its pid), so one daemon
serves every sandbox of a node. It is mounted at ``<run_dir>/lxcfs`` on first need, runs in a
session and cgroups of its own (``<memory and pids hierarchy>/dsec-lxcfs/<12 hex of
sha256(home)>``) and outlives the node daemon, as the sandboxes it serves do: the next daemon
re-adopts it (pid file ``<run_dir>/lxcfs.pid``). A bind mount holds on to the FUSE connection it
was made from, so if lxcfs dies, every live sandbox's files fail with ENOTCONN: the node then
starts a new one and mounts its files again in each such sandbox's mount namespace
(``remount_into``). It is stopped and unmounted when the node closes with no sandbox left.

One process holds one ``Lxcfs`` per node (``Lxcfs.shared``): the container backend and the
backends built on it (FnCall) serve sandboxes of the same node, and two objects would each start
an lxcfs at the same mount point, the second killing and unmounting the first's under a create
that was binding its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

from dsec_core.errors import BackendUnavailable, DsecError
from dsec_core.linux.cgroups import place_process, remove_cgroups
from dsec_core.linux.mounts import unmount
from dsec_core.linux.processes import wait_pidfd

__all__ = ["LXCFS_FILES", "Lxcfs", "find_lxcfs", "lxcfs_enabled", "lxcfs_mounts", "remount_into"]

log = logging.getLogger("dsec.backend.lxcfs")

#: What lxcfs shows per sandbox, as paths inside it (and under its mount point). Not
#: /proc/slabinfo: the kernel's is root's alone and lxcfs's would be the host's anyway.
LXCFS_FILES = (
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/stat",
    "/proc/uptime",
    "/proc/loadavg",
    "/proc/diskstats",
    "/proc/swaps",
    "/sys/devices/system/cpu/online",
)
#: --enable-cfs: /proc/cpuinfo, /proc/stat and cpu/online count ceil(CFS quota) CPUs, not the
#: cpuset alone; --enable-loadavg: /proc/loadavg counts the sandbox's own tasks (a thread of
#: lxcfs samples the cgroups of the sandboxes that read it); --enable-pidfd: no pid reuse races.
LXCFS_OPTIONS = ("--enable-cfs", "--enable-loadavg", "--enable-pidfd")
#: lxcfs's own memory limit: it holds a few MiB; past this something is wrong, and a new one
#: is started.
LXCFS_MEMORY = 256 << 20
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0


def lxcfs_enabled() -> bool:
    """``DSEC_LXCFS``: ``on`` (the default: ``lxcfs`` on PATH), ``off``, or the binary's path."""
    return os.environ.get("DSEC_LXCFS", "on").strip().lower() not in ("0", "off", "no", "false")


def find_lxcfs() -> str:
    """The lxcfs binary (``DSEC_LXCFS`` if it names one); ``BackendUnavailable`` if none."""
    setting = os.environ.get("DSEC_LXCFS", "on").strip()
    named = setting if "/" in setting else None
    path = (named if named and os.access(named, os.X_OK) else None) or (
        None if named else shutil.which("lxcfs")
    )
    if path is None:
        raise BackendUnavailable(
            f"container backend: lxcfs is not installed{f' at {named}' if named else ''} "
            "(apt-get install lxcfs); sandboxes need it to see their own CPU and memory limits "
            "in /proc. DSEC_LXCFS=off runs without it: sandboxes then see the host's "
            "/proc/meminfo, /proc/cpuinfo, /proc/stat, ...",
            missing="lxcfs",
        )
    return path


def lxcfs_mounts(mountpoint: Path) -> list[dict[str, Any]]:
    """The OCI mounts that put lxcfs's files over the kernel's in a sandbox (after /proc and
    /sys in the list: runc mounts in order)."""
    return [
        {
            "destination": f,
            "type": "bind",
            "source": os.fspath(mountpoint) + f,
            "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
        }
        for f in LXCFS_FILES
    ]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def _mountinfo_path(path: str) -> str:
    """``path`` as mountinfo writes it (octal escapes for blanks and backslashes)."""
    for ch, esc in (("\\", "\\134"), (" ", "\\040"), ("\t", "\\011"), ("\n", "\\012")):
        path = path.replace(ch, esc)
    return path


def _mount_devices(mountinfo: str, targets: set[str]) -> dict[str, str]:
    """``{mount point: "major:minor"}`` of the topmost mount at each of ``targets``, from a
    mountinfo file (never a stat: that would ask a FUSE daemon, which may hang)."""
    found = {}
    try:
        with open(mountinfo) as f:
            for line in f:
                fields = line.split(" ", 5)
                if fields[4] in targets:
                    found[fields[4]] = fields[2]
    except OSError:
        pass
    return found


class Lxcfs:
    """The node's lxcfs daemon, mounted at ``<run_dir>/lxcfs``, and the sandboxes it serves:
    ``add`` each live one's init (pid, start time), ``discard`` it when it stops."""

    #: this process's instance per mount point, while a backend holds it
    _shared: ClassVar[weakref.WeakValueDictionary[Path, Lxcfs]] = weakref.WeakValueDictionary()

    @classmethod
    def shared(cls, home: Path, run_dir: Path) -> Lxcfs:
        """This process's one ``Lxcfs`` for the node at ``home``, one more user of it: each
        user's ``close`` counts down, and the last one's acts."""
        key = (run_dir / "lxcfs").absolute()
        instance = cls._shared.get(key)
        if instance is None:
            instance = cls._shared[key] = cls(home, run_dir)
        instance._users += 1
        return instance

    def __init__(self, home: Path, run_dir: Path) -> None:
        self._users = 0
        self.mountpoint = run_dir / "lxcfs"
        self.pid_file = run_dir / "lxcfs.pid"
        self.log_path = home / "lxcfs.log"
        digest = hashlib.sha256(os.fsencode(os.path.abspath(home))).hexdigest()[:12]
        self.cgroup = f"dsec-lxcfs/{digest}"
        self.pid: int | None = None
        self.device: str | None = None  # "major:minor" of the mount it serves
        self.sandboxes: dict[str, tuple[int, int | None]] = {}
        self._stale: dict[str, tuple[int, int | None]] = {}  # binds of a dead lxcfs
        self._pidfd = -1
        self._child = False  # this process started it, and so must reap it
        self._lock: asyncio.Lock | None = None
        self._watching: asyncio.AbstractEventLoop | None = None
        self._revive: asyncio.Task | None = None

    # --- the sandboxes it serves ----------------------------------------------------------
    def add(self, sandbox_id: str, pid: int, start_time: int | None) -> None:
        self.sandboxes[sandbox_id] = (pid, start_time)

    def discard(self, sandbox_id: str) -> None:
        self.sandboxes.pop(sandbox_id, None)
        self._stale.pop(sandbox_id, None)

    def adopt_sandbox(self, sandbox_id: str, pid: int, start_time: int | None) -> None:
        """A live sandbox a previous daemon started with lxcfs's files: take over lxcfs (at the
        first), and if the sandbox's files are a dead lxcfs's, put the live one's back."""
        self.add(sandbox_id, pid, start_time)
        if self.adopt():
            self._watch()
            binds = _mount_devices(f"/proc/{pid}/mountinfo", set(LXCFS_FILES))
            if binds and set(binds.values()) == {self.device}:
                return
        self._stale[sandbox_id] = (pid, start_time)
        self._revive_soon()

    # --- the daemon -----------------------------------------------------------------------
    def running(self) -> bool:
        """Whether lxcfs serves its mount: started or adopted, mounted, and alive. A start in
        progress does not count (its process runs before its mount is up), so a create that
        comes meanwhile waits for it in ``ensure`` instead of binding files not there yet."""
        return self._pidfd >= 0 and self.device is not None and not wait_pidfd(self._pidfd, 0)

    def _ours(self, pid: int) -> bool:
        """Whether ``pid`` is an lxcfs serving our mount point (and not a reused pid)."""
        argv = _cmdline(pid)
        return argv[-1:] == [os.fspath(self.mountpoint)] and "-p" in argv

    def _recorded_pid(self) -> int | None:
        try:
            text = self.pid_file.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def _device(self) -> str | None:
        where = _mountinfo_path(os.fspath(self.mountpoint))
        return _mount_devices("/proc/self/mountinfo", {where}).get(where)

    async def ensure(self) -> Path:
        """lxcfs's mount point, with lxcfs serving it: the one running (ours, or a previous
        daemon's), else a new one. ``BackendUnavailable`` if it cannot start."""
        if self.running():
            return self.mountpoint
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self.adopt():
                await self._start()
            self._watch()
        if self._stale:  # sandboxes a revive that failed earlier left with dead files
            self._revive_soon()
        return self.mountpoint

    def adopt(self) -> bool:
        """Take over an lxcfs a previous daemon started, if it still serves; True if one
        serves (this daemon's included)."""
        if self.running():
            return True
        pid = self._recorded_pid()
        if pid is None or not self._ours(pid):
            return False
        device = self._device()
        if device is None:
            return False
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return False
        self._set_process(pid, pidfd, child=False, device=device)
        log.info("adopted lxcfs %d at %s", pid, self.mountpoint)
        return True

    async def _start(self) -> None:
        binary = find_lxcfs()
        await asyncio.to_thread(self._clear_stale)
        self.mountpoint.mkdir(mode=0o755, exist_ok=True)
        argv = [binary, *LXCFS_OPTIONS, "-p", os.fspath(self.pid_file), os.fspath(self.mountpoint)]
        out = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # A session of its own: it outlives this daemon, as the sandboxes do.
            pid = os.posix_spawn(
                binary,
                argv,
                {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, devnull, 0),
                    (os.POSIX_SPAWN_DUP2, out, 1),
                    (os.POSIX_SPAWN_DUP2, out, 2),
                ],
                setsid=True,
            )
        finally:
            os.close(out)
            os.close(devnull)
        self._set_process(pid, os.pidfd_open(pid), child=True, device=None)
        try:
            # Out of the daemon's cgroups, whose limit is the daemon's and which go with it.
            place_process(pid, self.cgroup, LXCFS_MEMORY)
            deadline = time.monotonic() + START_TIMEOUT
            while (device := self._device()) is None:
                if wait_pidfd(self._pidfd, 0) or time.monotonic() > deadline:
                    raise BackendUnavailable(
                        f"container backend: lxcfs did not start at {self.mountpoint}: "
                        f"{self._log_tail()}",
                        command=argv,
                    )
                await asyncio.sleep(0.002)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self.stop_now))
            raise
        self.device = device
        log.info("started lxcfs %d at %s", pid, self.mountpoint)

    def _set_process(self, pid: int, pidfd: int, *, child: bool, device: str | None) -> None:
        self._forget()
        self.pid, self._pidfd, self._child, self.device = pid, pidfd, child, device

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-5:]) or "(it printed nothing)"

    def _clear_stale(self) -> None:
        """Whatever a dead or unanswering lxcfs left: its process, its (dead) mount, its pid
        file and cgroups."""
        pid = self._recorded_pid()
        if pid is not None and self._ours(pid):
            _kill(pid, child=False, mounted=self._device)
        if self._device() is not None:
            unmount(self.mountpoint, lazy=True)  # a dead FUSE mount cannot be unmounted busy
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()
        with contextlib.suppress(OSError):
            remove_cgroups(self.cgroup)

    # --- death ----------------------------------------------------------------------------
    def _watch(self) -> None:
        """Notice at once when lxcfs exits: its pidfd turns readable."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._watching is loop or self._pidfd < 0:
            return
        loop.add_reader(self._pidfd, self._died)
        self._watching = loop

    def _unwatch(self) -> None:
        if self._watching is not None and self._pidfd >= 0:
            with contextlib.suppress(Exception):
                self._watching.remove_reader(self._pidfd)
        self._watching = None

    def _died(self) -> None:
        self._unwatch()
        log.warning(
            "lxcfs %s exited; starting another for %d live sandboxes", self.pid, len(self.sandboxes)
        )
        self._stale.update(self.sandboxes)
        self._revive_soon()

    def _revive_soon(self) -> None:
        if self._revive is None or self._revive.done():
            self._revive = asyncio.get_running_loop().create_task(self._revive_stale())

    async def _revive_stale(self) -> None:
        """Start lxcfs again and put its files back in every sandbox that has a dead one's."""
        try:
            await self.ensure()
            while self._stale:
                batch = dict(self._stale)
                failed = await asyncio.to_thread(remount_into, self.mountpoint, batch.values())
                for sid, init in batch.items():
                    if self._stale.get(sid) == init:
                        del self._stale[sid]
                if failed:
                    log.warning("lxcfs files not put back in some sandboxes: %s", failed)
        except (DsecError, OSError, subprocess.SubprocessError) as e:
            log.error("lxcfs could not be started again (sandboxes' /proc files fail): %s", e)

    # --- stop -----------------------------------------------------------------------------
    async def close(self, *, stop: bool) -> None:
        """Stop watching; with ``stop``, also stop lxcfs and unmount it (no sandbox needs
        it any more). Without, it keeps serving the sandboxes for the next daemon."""
        self._users = max(0, self._users - 1)
        if self._users:  # another backend of the node still uses it
            return
        if self._shared.get(self.mountpoint.absolute()) is self:
            del self._shared[self.mountpoint.absolute()]
        if self._revive is not None:
            self._revive.cancel()
            with contextlib.suppress(BaseException):
                await self._revive
            self._revive = None
        if stop:
            await asyncio.to_thread(self.stop_now)
        else:
            self._forget()

    def stop_now(self) -> None:
        """Stop lxcfs (ours or a previous daemon's) and remove its mount, files and cgroups."""
        self._unwatch()
        if self.pid is not None and self._pidfd >= 0:
            _terminate(self.pid, self._pidfd, child=self._child, mounted=self._device)
        self._forget()
        self._clear_stale()
        with contextlib.suppress(OSError):
            self.mountpoint.rmdir()

    def _forget(self) -> None:
        self._unwatch()
        if self._pidfd >= 0:
            if self._child:  # a child that died on its own is a zombie until reaped
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid or -1, os.WNOHANG)
            os.close(self._pidfd)
        self.pid, self._pidfd, self._child, self.device = None, -1, False, None


def _terminate(pid: int, pidfd: int, *, child: bool, mounted: Callable[[], object]) -> None:
    """SIGTERM, then SIGKILL once lxcfs's mount is gone (or STOP_TIMEOUT passed). On SIGTERM
    lxcfs ends its FUSE loop and unmounts at once, then joins its loadavg thread, which sleeps
    up to 5 s between samples: with nothing of it serving any more, the kill spares every
    node's close that wait."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while not wait_pidfd(pidfd, 0.005) and mounted() and time.monotonic() < deadline:
        pass
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    wait_pidfd(pidfd, STOP_TIMEOUT)
    if child:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _kill(pid: int, *, child: bool, mounted: Callable[[], object]) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        _terminate(pid, pidfd, child=child, mounted=mounted)
    finally:
        os.close(pidfd)


# --- putting the files back in live sandboxes -----------------------------------------------

# Run by a fresh interpreter (-I -S): entering a mount namespace needs a single-threaded
# process, which the daemon is not. Per sandbox: clone each lxcfs file's mount here
# (open_tree), enter the sandbox's mount namespace, detach the dead bind at each path and
# attach the clone there, come back. The sandbox cannot mount (no CAP_SYS_ADMIN) nor move its
# /proc or /sys (mount points), so these paths are the kernel's with the dead binds on them.
_REMOUNT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, 0o2000000
MOVE_MOUNT_F_EMPTY_PATH, CLONE_NEWNS, MNT_DETACH, UMOUNT_NOFOLLOW = 4, 0x20000, 2, 8

def check(ret, what):
    if ret < 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")
    return ret

root, files, inits = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
failed = 0
for item in inits:
    pid, start = item.split(":")
    trees, ns = [], -1
    try:
        ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        with open(f"/proc/{pid}/stat") as f:
            if start != "-" and f.read().rsplit(")", 1)[1].split()[19] != start:
                continue  # gone, its pid reused
        for path in files:
            trees.append(check(libc.syscall(SYS_OPEN_TREE, -100, (root + path).encode(),
                                            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC), "open_tree"))
        check(libc.setns(ns, CLONE_NEWNS), "setns")
        try:
            for path, fd in zip(files, trees):
                libc.umount2(path.encode(), MNT_DETACH | UMOUNT_NOFOLLOW)
                check(libc.syscall(SYS_MOVE_MOUNT, fd, b"", -100, path.encode(),
                                   MOVE_MOUNT_F_EMPTY_PATH), f"move_mount {path}")
        finally:
            check(libc.setns(host, CLONE_NEWNS), "setns back")
    except FileNotFoundError:
        continue  # gone
    except OSError as e:
        print(f"{pid}: {e}", file=sys.stderr)
        failed += 1
    finally:
        for fd in trees:
            os.close(fd)
        if ns >= 0:
            os.close(ns)
sys.exit(1 if failed else 0)
"""


def remount_into(mountpoint: Path, inits: Iterable[tuple[int, int | None]]) -> str:
    """Bind lxcfs's files (under ``mountpoint``) over the ones in the mount namespace of each
    sandbox init (pid, start time), in place of a dead lxcfs's; '' or what failed."""
    args = [f"{pid}:{'-' if start is None else start}" for pid, start in inits]
    if not args:
        return ""
    files = ",".join(LXCFS_FILES)
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _REMOUNT, os.fspath(mountpoint), files, *args],
        capture_output=True,
        text=True,
        timeout=60 + len(args),
    )
    return "" if done.returncode == 0 else " | ".join(done.stderr.strip().splitlines()[-5:])
