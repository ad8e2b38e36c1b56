"""The node's lxcfs: one FUSE daemon per node whose files show each reader its own cgroup's CPU
and memory limits (``/proc/meminfo``, ``/proc/cpuinfo``, ...), bind-mounted over the kernel's
files in every sandbox.

lxcfs answers a read from the reader's cgroups (the FUSE request carries its pid), so one daemon
serves every sandbox of the node. It is mounted at ``<run_dir>/lxcfs`` on first need and runs
in a session of its own, like the sandboxes it serves: a daemon restart leaves it running and
the next daemon re-adopts it (pid file ``<run_dir>/lxcfs.pid``). A bind mount holds on to the
FUSE connection it was made from, so if lxcfs dies every live sandbox's files fail with
ENOTCONN: the node then starts a new one and mounts its files again in each live sandbox's
mount namespace (``remount_into``). It is stopped, and unmounted, when the node closes with no
sandbox left that needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dsec_core.errors import BackendUnavailable
from dsec_core.linux.mounts import unmount

__all__ = ["LXCFS_FILES", "Lxcfs", "find_lxcfs", "lxcfs_enabled", "lxcfs_mounts"]

log = logging.getLogger("dsec.backend.lxcfs")

#: What lxcfs shows per sandbox, as paths inside it (and under its mount point). Not
#: /proc/slabinfo: the kernel's is root-only and nothing common reads it.
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
#: --enable-cfs: /proc/cpuinfo, /proc/stat and cpu/online show ceil(CFS quota) CPUs, not the
#: cpuset alone; --enable-loadavg: /proc/loadavg counts the sandbox's own tasks (a thread in
#: lxcfs samples the cgroups of sandboxes that read it); --enable-pidfd: no pid reuse races.
LXCFS_OPTIONS = ("--enable-cfs", "--enable-loadavg", "--enable-pidfd")
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0


def lxcfs_enabled() -> bool:
    return os.environ.get("DSEC_LXCFS", "on").strip().lower() not in ("0", "off", "no")


def find_lxcfs() -> str:
    path = shutil.which("lxcfs") or next(
        (p for p in ("/usr/bin/lxcfs", "/usr/sbin/lxcfs") if os.access(p, os.X_OK)), None
    )
    if path is None:
        raise BackendUnavailable(
            "container backend: lxcfs is not installed (apt-get install lxcfs); sandboxes need "
            "it to see their own CPU and memory limits in /proc. DSEC_LXCFS=off runs without "
            "it (sandboxes then see the host's /proc/meminfo, /proc/cpuinfo, ...)",
            missing="lxcfs",
        )
    return path


def lxcfs_mounts(mountpoint: Path) -> list[dict[str, Any]]:
    """The OCI mounts that put lxcfs's files over the kernel's in a sandbox (after /proc and
    /sys are mounted: runc mounts in order)."""
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


def _pidfd_exited(pidfd: int) -> bool:
    import select

    return bool(select.select([pidfd], [], [], 0)[0])


def _live_mount(path: Path) -> bool:
    """Whether a live filesystem (not the directory under it, not a FUSE mount whose daemon
    is gone) answers at ``path``."""
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except OSError:  # ENOTCONN: a dead FUSE mount
        return False


class Lxcfs:
    """The node's lxcfs daemon, mounted at ``<run_dir>/lxcfs``.

    ``live_inits`` lists the (pid, start time) of every live sandbox's init, whose mount
    namespaces get lxcfs's files again if lxcfs has to be started anew under them.
    """

    def __init__(
        self,
        run_dir: Path,
        log_path: Path,
        live_inits: Callable[[], list[tuple[int, int | None]]],
    ) -> None:
        self.mountpoint = run_dir / "lxcfs"
        self.pid_file = run_dir / "lxcfs.pid"
        self.log_path = log_path
        self.live_inits = live_inits
        self.pid: int | None = None
        self._pidfd = -1
        self._child = False  # we started it (and so must reap it)
        self._lock: asyncio.Lock | None = None
        self._watching: asyncio.AbstractEventLoop | None = None
        self._revive: asyncio.Task | None = None
        self.restarts = 0

    # --- state ----------------------------------------------------------------------------
    def running(self) -> bool:
        return self._pidfd >= 0 and not _pidfd_exited(self._pidfd)

    def _argv(self, binary: str) -> list[str]:
        return [binary, *LXCFS_OPTIONS, "-p", os.fspath(self.pid_file), os.fspath(self.mountpoint)]

    def _ours(self, pid: int) -> bool:
        """Whether ``pid`` is an lxcfs serving our mount point (and not a reused pid)."""
        argv = _cmdline(pid)
        return bool(argv) and os.path.basename(argv[0]) == "lxcfs" and argv[-1:] == [
            os.fspath(self.mountpoint)
        ]

    def _recorded_pid(self) -> int | None:
        try:
            text = self.pid_file.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    # --- start, adopt ---------------------------------------------------------------------
    async def ensure(self) -> Path:
        """lxcfs's mount point, with lxcfs serving it: the one running (ours, or a previous
        daemon's), else a new one. ``BackendUnavailable`` if it cannot start."""
        if self.running():
            return self.mountpoint
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self.running():
                await self._start_or_adopt()
        return self.mountpoint

    def adopt(self) -> bool:
        """Take over an lxcfs a previous daemon started, if it still serves; True if so."""
        if self.running():
            return True
        pid = self._recorded_pid()
        if pid is None or not self._ours(pid) or not _live_mount(self.mountpoint):
            return False
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return False
        self._set_process(pid, pidfd, child=False)
        log.info("adopted lxcfs %d at %s", pid, self.mountpoint)
        return True

    def adopt_and_watch(self) -> bool:
        """``adopt``, and notice if it dies from now on."""
        if not self.adopt():
            return False
        self._watch()
        return True

    async def _start_or_adopt(self) -> None:
        if self.adopt():
            self._watch()
            return
        binary = find_lxcfs()
        await asyncio.to_thread(self._clear_stale)
        self.mountpoint.mkdir(mode=0o755, exist_ok=True)
        argv = self._argv(binary)
        out = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # A session of its own: it must outlive this daemon, as the sandboxes do.
            pid = os.posix_spawn(
                binary,
                argv,
                {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
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
        pidfd = os.pidfd_open(pid)
        self._set_process(pid, pidfd, child=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not _live_mount(self.mountpoint):
            if _pidfd_exited(pidfd) or time.monotonic() > deadline:
                await asyncio.to_thread(self.stop_now)
                raise BackendUnavailable(
                    f"container backend: lxcfs did not start at {self.mountpoint}: "
                    f"{self._log_tail()}",
                    command=argv,
                )
            await asyncio.sleep(0.002)
        log.info("started lxcfs %d at %s", pid, self.mountpoint)
        self._watch()

    def _set_process(self, pid: int, pidfd: int, *, child: bool) -> None:
        self._forget()
        self.pid, self._pidfd, self._child = pid, pidfd, child

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-5:]) or "(no output)"

    def _clear_stale(self) -> None:
        """Whatever a dead or unanswering lxcfs left: its process, its (dead) mount."""
        pid = self._recorded_pid()
        if pid is not None and self._ours(pid):
            _kill_and_reap(pid, child=False)
        if self.mountpoint.exists() or os.path.ismount(self.mountpoint):
            unmount(self.mountpoint, lazy=not _live_mount(self.mountpoint))
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()

    # --- death ----------------------------------------------------------------------------
    def _watch(self) -> None:
        """Notice at once when lxcfs exits (its pidfd turns readable)."""
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
        log.warning("lxcfs %s exited; starting it again for the live sandboxes", self.pid)
        self.revive_soon()

    def revive_soon(self) -> None:
        """``revive`` in a task of the running loop (once at a time)."""
        if self._revive is None or self._revive.done():
            self._revive = asyncio.get_running_loop().create_task(self.revive())

    async def revive(self) -> None:
        """Start lxcfs again after it died and put its files back in every live sandbox."""
        try:
            await self.ensure()
            inits = self.live_inits()
            if inits:
                await asyncio.to_thread(remount_into, self.mountpoint, inits)
            self.restarts += 1
        except Exception:
            log.exception("lxcfs could not be revived; sandboxes' /proc files fail with ENOTCONN")

    # --- stop -----------------------------------------------------------------------------
    async def close(self, *, stop: bool) -> None:
        """Stop watching; with ``stop``, also stop lxcfs and unmount it (no sandbox needs
        it any more). Without, it keeps serving the sandboxes for the next daemon."""
        if self._revive is not None:
            self._revive.cancel()
            with contextlib.suppress(BaseException):
                await self._revive
            self._revive = None
        self._unwatch()
        if stop:
            await asyncio.to_thread(self.stop_now)
        else:
            self._forget()

    def stop_now(self) -> None:
        """Stop lxcfs (ours or a previous daemon's) and remove its mount and files."""
        self._unwatch()
        if self.pid is not None and self._pidfd >= 0:
            _terminate(self.pid, self._pidfd, child=self._child)
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
        self.pid, self._pidfd, self._child = None, -1, False


def _terminate(pid: int, pidfd: int, *, child: bool) -> None:
    """SIGTERM (lxcfs unmounts itself), then SIGKILL if it does not go within STOP_TIMEOUT."""
    import select

    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, STOP_TIMEOUT)):
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)
        if select.select([pidfd], [], [], wait)[0]:
            break
    if child:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _kill_and_reap(pid: int, *, child: bool) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        _terminate(pid, pidfd, child=child)
    finally:
        os.close(pidfd)


# --- putting the files back in live sandboxes -----------------------------------------------

_REMOUNT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, AT_RECURSIVE = 1, 0o2000000, 0x8000
MOVE_MOUNT_F_EMPTY_PATH, CLONE_NEWNS, MNT_DETACH, UMOUNT_NOFOLLOW = 4, 0x20000, 2, 8
root, files, inits = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
failed = 0
for item in inits:
    pid, start = item.split(":")
    try:
        ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        continue
    with open(f"/proc/{pid}/stat") as f:
        if start != "-" and f.read().rsplit(")", 1)[1].split()[19] != start:
            os.close(ns)
            continue
    trees = []
    for path in files:
        fd = libc.syscall(SYS_OPEN_TREE, -100, (root + path).encode(),
                          OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"open_tree {root + path}")
        trees.append(fd)
    if libc.setns(ns, CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), f"setns into {pid}")
    # The sandbox cannot mount (no CAP_SYS_ADMIN) and cannot move its /proc or /sys (mount
    # points), so these paths are the kernel's and the dead binds over them.
    for path, fd in zip(files, trees):
        libc.umount2(path.encode(), MNT_DETACH | UMOUNT_NOFOLLOW)
        if libc.syscall(SYS_MOVE_MOUNT, fd, b"", -100, path.encode(), MOVE_MOUNT_F_EMPTY_PATH):
            print(f"{pid} {path}: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            failed += 1
        os.close(fd)
    if libc.setns(host, CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "setns back")
    os.close(ns)
sys.exit(1 if failed else 0)
"""


def remount_into(mountpoint: Path, inits: Iterable[tuple[int, int | None]]) -> None:
    """Bind lxcfs's files (under ``mountpoint``) over the ones in the mount namespace of each
    init (pid, start time), replacing binds of a dead lxcfs. One helper process does them all:
    entering a mount namespace (setns) needs a single-threaded process, which the daemon is
    not."""
    args = [f"{pid}:{'-' if start is None else start}" for pid, start in inits]
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _REMOUNT, os.fspath(mountpoint), ",".join(LXCFS_FILES)]
        + args,
        capture_output=True,
        text=True,
        timeout=60 + len(args),
    )
    if done.returncode != 0:
        errs = done.stderr.strip().splitlines()[-5:]
        raise OSError(errno.EIO, f"remounting lxcfs files in sandboxes: {' | '.join(errs)}")
