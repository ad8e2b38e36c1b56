"""FnCall members: container sandboxes made cheap to reset between calls of different callers.

A member is a container sandbox (``ContainerBackend``) with a read-only root filesystem: the
only places a call can write are fresh tmpfs mounts at ``/tmp``, ``/root``, the sandbox's
working directory and ``/dev/shm`` (plus the ``/dev/mqueue`` of its IPC namespace); ``/dev``
itself is made read-only. A reset (``Feature.RESET``) then needs no filesystem copy-up to undo:

1. every process but the agent (PID 1) is killed, from the host, through the sandbox's pids
   cgroup, until only the agent is left (what forks while being killed is killed next round);
2. the work areas are emptied from the host through ``/proc/<init>/root``, descending by
   descriptor without following symbolic links (``shutil.rmtree`` with ``dir_fd``), so a link
   a call left cannot point the wipe at a host path;
3. SysV IPC objects (which outlive every process of their namespace) are removed from a thread
   that joins the sandbox's IPC namespace for the purpose.

What else a call could leave for the next and why it does not carry over: its environment is
per exec; the network is loopback only, and sockets die with their processes; hostname, mounts
and namespaces need capabilities or syscalls the sandbox lacks (no ``CAP_SYS_ADMIN``, seccomp
refuses mount/unshare/setns, keyctl); ``/proc/sys`` and ``/sys`` are read-only.

The OCI config is the container backend's, changed here through the backend's own ``"oci"``
enforcement point (a wrapper around ``rt.enforce``), so ``runc.py`` needs no change.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import os
import shutil
import signal
import stat
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from dsec_backend_container import ContainerBackend

from dsec_core.backend import Feature, SandboxRuntime, cgroup_path
from dsec_core.config import NodeConfig
from dsec_core.errors import SandboxError
from dsec_core.linux.processes import proc_stat
from dsec_core.records import IdMap

__all__ = ["DEV_SHM", "FnCallBackend", "work_areas"]

DEV_SHM = "/dev/shm"
HOME = "/root"
WORK = "/work"
MQUEUE = "/dev/mqueue"
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: How long the killing of a call's processes may take before the member counts as broken.
KILL_TIMEOUT = 5.0
#: tmpfs sizes: a call that fills /tmp gets ENOSPC, not the node's memory (tmpfs pages are
#: charged to the sandbox's memory cgroup as well).
MAX_TMPFS = 1 << 30
IPC_RMID = 0
CLONE_NEWIPC = 0x08000000


def work_areas(spec_workdir: str) -> list[str]:
    """The tmpfs mounts a member gets, hence what a reset empties: ``/tmp``, ``/root`` (HOME:
    tools keep caches there), ``/dev/shm`` and the working directory (``/work`` when it is
    ``/``, which is read-only; none when it is inside one of the others)."""
    areas = ["/tmp", HOME, DEV_SHM]
    wd = os.path.normpath(spec_workdir or "/")
    wd = WORK if wd == "/" else wd
    if wd != "/" and not any(wd == a or wd.startswith(a + "/") for a in areas):
        areas.append(wd)
    return areas


def fncall_config(config: dict[str, Any], rt: SandboxRuntime) -> None:
    """Turn a container sandbox's OCI config into a member's, in place."""
    config["root"]["readonly"] = True
    # half the memory limit each: a full /tmp is ENOSPC for the call, not an OOM kill
    size = max(1 << 20, min(rt.limits.memory // 2, MAX_TMPFS))
    mounts = [m for m in config["mounts"] if m["destination"] != DEV_SHM]
    for area in work_areas(rt.spec.workdir):
        mode = "1777" if area in ("/tmp", DEV_SHM) else "700" if area == HOME else "755"
        mounts.append(
            {
                "destination": area,
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", f"mode={mode}", f"size={size}"],
            }
        )
    config["mounts"] = mounts
    # runc makes /dev a tmpfs with the device nodes and links in it: read-only once they are
    # there (readonlyPaths apply last), so a call can neither add files there nor swap a link
    # such as /dev/fd. Its submounts (/dev/shm, /dev/pts, /dev/mqueue) stay writable.
    config["linux"]["readonlyPaths"].append("/dev")


class FnCallBackend(ContainerBackend):
    """Container sandboxes with a read-only root and tmpfs work areas, reset between calls."""

    name = "fncall"
    features = ContainerBackend.features | {Feature.RESET}
    # No runtimes: members run under the standard runtime (crun, else runc) whatever the node's
    # default (DSEC_RUNTIME): a reset joins the member's namespaces from the host, which a
    # gVisor member does not have (its processes live in the Sentry), and runsc cannot remount
    # the read-only root in a user namespace here.
    runtimes = frozenset[str]()

    def __init__(self, config: NodeConfig) -> None:
        super().__init__(config)
        # Joining a sandbox's IPC namespace, or taking its root's file-system ids, changes the
        # calling thread's: only this thread ever does either, so no other work of the daemon
        # runs in a borrowed namespace or under borrowed ids.
        self._ns_thread = concurrent.futures.ThreadPoolExecutor(1, "dsec-fncall-ns")

    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        state = await super().start(replace(rt, enforce=_members_oci(rt)))
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._ns_thread, _seed_areas, rt, state["pid"])
        except BaseException as e:  # leave nothing running, whatever went wrong
            await asyncio.shield(self.stop(rt, state))
            if not isinstance(e, (OSError, SandboxError)):
                raise
            raise SandboxError(
                f"sandbox {rt.id}: cannot copy the image's files into its work areas: {e}",
                sandbox_id=rt.id,
            ) from e
        return state

    async def alive(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        """The container backend's answer, and not dying: a pool asks just before it checks out a
        member, so an init killed a moment ago (a zombie, or exiting) counts as dead."""
        pid = state.get("pid")
        if not await super().alive(rt, state) or not isinstance(pid, int):
            return False
        stat = proc_stat(pid)
        return stat is not None and not stat.exited

    async def reset(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        pid = state.get("pid")
        if not isinstance(pid, int) or not await self.alive(rt, state):
            raise SandboxError(f"sandbox {rt.id}: not running, cannot reset", sandbox_id=rt.id)
        try:
            await _kill_all_but(rt.id, pid)
            areas = [*work_areas(rt.spec.workdir), MQUEUE]
            await asyncio.to_thread(_empty_areas, rt.id, pid, areas)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._ns_thread, _seed_areas, rt, pid)
            await loop.run_in_executor(self._ns_thread, _remove_sysv_ipc, rt.id, pid)
        except OSError as e:  # the sandbox went away under the reset
            raise SandboxError(f"sandbox {rt.id}: reset failed: {e}", sandbox_id=rt.id) from e


def _members_oci(rt: SandboxRuntime) -> Callable[[str, Any], None]:
    def enforce(target: str, subject: Any) -> None:
        if target == "oci":
            fncall_config(subject, rt)
        rt.enforce(target, subject)

    return enforce


def _procs(sandbox_id: str) -> set[int] | None:
    """The sandbox's processes (host pids), from its pids cgroup (v1) or unified cgroup."""
    for hier in (CGROUP_ROOT / "pids", CGROUP_ROOT / "unified", CGROUP_ROOT):
        try:
            text = (hier / cgroup_path(sandbox_id) / "cgroup.procs").read_text()
        except OSError:
            continue
        return {int(p) for p in text.split()}
    return None


async def _kill_all_but(sandbox_id: str, init: int) -> None:
    """SIGKILL every process of the sandbox but its init until none is left: a process forked
    while we read the list is killed in the next round (the pids limit bounds how many)."""
    deadline = asyncio.get_running_loop().time() + KILL_TIMEOUT
    delay = 0.0005
    while True:
        procs = _procs(sandbox_id)
        if procs is None:
            raise SandboxError(f"sandbox {sandbox_id}: no cgroup to reset", sandbox_id=sandbox_id)
        others = procs - {init}
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if asyncio.get_running_loop().time() > deadline:
            raise SandboxError(
                f"sandbox {sandbox_id}: {len(others)} processes would not die on reset",
                sandbox_id=sandbox_id,
            )
        await asyncio.sleep(delay)  # the agent reaps them; they leave the cgroup as it does
        delay = min(delay * 2, 0.02)


def _open_under(root: int, path: str) -> int | None:
    """A descriptor of directory ``path`` beneath ``root``, reached without following a link;
    None if a component is missing, a link or not a directory."""
    fd = root
    opened: list[int] = []
    try:
        for part in [p for p in path.split("/") if p]:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            opened.append(fd)
        return os.dup(fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symbolic link: not followed, not seeded
            return None
        raise
    finally:
        for f in opened:
            os.close(f)


def _seed_areas(rt: SandboxRuntime, init: int) -> None:
    """Copy what the image has at each work area (a workspace's task files at the working
    directory, dotfiles in /root) into the area's fresh tmpfs, with owners and modes: the
    tmpfs hides the image's directory, and a reset must bring those files back as they were.
    From the host's view of the composed root, by descriptor, links copied as links."""
    if rt.rootfs is None:
        return
    # every descriptor here pins the sandbox's mounts (and so its writable layer's loop
    # device) until closed: each is closed on every path
    with contextlib.ExitStack() as fds:
        src_root = os.open(rt.rootfs, os.O_RDONLY | os.O_DIRECTORY)
        fds.callback(os.close, src_root)
        dst_root = os.open(f"/proc/{init}/root", os.O_RDONLY | os.O_DIRECTORY)
        fds.callback(os.close, dst_root)
        _seed_each(rt, src_root, dst_root)


def _seed_each(rt: SandboxRuntime, src_root: int, dst_root: int) -> None:
    """Copy each work area's image content (see ``_seed_areas``)."""
    for area in work_areas(rt.spec.workdir):
        src = _open_under(src_root, area)
        if src is None:
            continue
        try:
            if not os.listdir(src):
                continue
            dst = _open_under(dst_root, area)
            if dst is None:
                raise SandboxError(f"sandbox {rt.id}: work area {area} is missing")
            try:
                _copy_tree(src, dst, _Owners(rt.idmap))
            finally:
                os.close(dst)
        finally:
            os.close(src)


class _Owners:
    """Owners for copies on a sandbox's tmpfs, which takes only ids its user namespace maps:
    ids the host sees inside the sandbox's range stay, unshifted ones (a layer read without
    the idmapping) are shifted into it, and any other becomes root's inside."""

    def __init__(self, idmap: IdMap) -> None:
        self.base, self.size, self.group = idmap.host_base, idmap.size, idmap.root_gid

    def creating(self) -> _AsSandboxRoot:
        return _AsSandboxRoot(self.base, self.group)

    def uid(self, u: int) -> int:
        if self.base <= u < self.base + self.size:
            return u
        return self.base + u if 0 <= u < self.size else self.base

    def gid(self, g: int) -> int:
        if g == self.group or self.base < g < self.base + self.size:
            return g
        return self.base + g if 0 < g < self.size else self.group


class _AsSandboxRoot:
    """Create inodes as the sandbox's root: a filesystem mounted in a user namespace refuses
    (EOVERFLOW) an inode whose creator's ids it does not map, and host root's are not. Only
    the file-system ids of the calling thread change (setfsuid/setfsgid are per thread), and
    only for the creation; back at 0, chown and chmod work with root's capabilities."""

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid

    def __enter__(self) -> None:
        _libc.setfsgid(self.gid)
        _libc.setfsuid(self.uid)

    def __exit__(self, *exc: object) -> None:
        _libc.setfsuid(0)
        _libc.setfsgid(0)
        if _libc.setfsuid(-1) != 0 or _libc.setfsgid(-1) != 0:  # -1: reads them back
            raise SandboxError("could not return to host root's file-system ids")


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def _copy_tree(src: int, dst: int, owners: _Owners) -> None:
    """Copy the directory ``src`` into the empty directory ``dst``: directories, regular files
    and symbolic links (as links), with owners and modes; other file types are left out."""
    for entry in os.scandir(src):
        name = entry.name
        st = entry.stat(follow_symlinks=False)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            with owners.creating():
                os.mkdir(name, 0o700, dir_fd=dst)
            s = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=src)
            try:
                d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dst)
                try:
                    _copy_tree(s, d, owners)
                finally:
                    os.close(d)
            finally:
                os.close(s)
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=src)
            with owners.creating():
                os.symlink(target, name, dir_fd=dst)
        elif stat.S_ISREG(st.st_mode):
            s = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=src)
            try:
                with owners.creating():
                    d = os.open(name, _CREATE, 0o600, dir_fd=dst)
            except BaseException:
                os.close(s)
                raise
            try:
                left = st.st_size
                while left > 0:
                    n = os.sendfile(d, s, None, min(left, 1 << 30))
                    if n == 0:
                        break
                    left -= n
            finally:
                os.close(s)
                os.close(d)
        else:
            continue
        uid, gid = owners.uid(st.st_uid), owners.gid(st.st_gid)
        os.chown(name, uid, gid, dir_fd=dst, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(name, mode, dir_fd=dst)  # after chown, which clears set-id bits


def _empty_areas(sandbox_id: str, init: int, areas: list[str]) -> None:
    root = os.open(f"/proc/{init}/root", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for area in areas:
            _empty(sandbox_id, root, area)
    finally:
        os.close(root)


def _empty(sandbox_id: str, root: int, area: str) -> None:
    """Remove everything in ``area`` (a path inside the sandbox) without following links."""
    fd = root
    opened = []
    try:
        for part in [p for p in area.split("/") if p]:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            opened.append(fd)
        for name in os.listdir(fd):
            st = os.lstat(name, dir_fd=fd)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        if os.listdir(fd):
            raise SandboxError(
                f"sandbox {sandbox_id}: {area} is not empty after a reset", sandbox_id=sandbox_id
            )
    except OSError as e:
        raise SandboxError(
            f"sandbox {sandbox_id}: cannot empty {area} on reset: {e}", sandbox_id=sandbox_id
        ) from e
    finally:
        for f in opened:
            os.close(f)


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    """setns(2) for an IPC namespace (``os.setns`` is Python 3.12's)."""
    if _libc.setns(fd, CLONE_NEWIPC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _remove_sysv_ipc(sandbox_id: str, init: int) -> None:
    """Remove every SysV shared memory segment, message queue and semaphore set of the
    sandbox's IPC namespace. Runs on the backend's one IPC thread, which joins the namespace
    and goes back to its own before returning (``/proc/sysvipc`` lists the reader's)."""
    own = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY)
    try:
        theirs = os.open(f"/proc/{init}/ns/ipc", os.O_RDONLY)
    except BaseException:
        os.close(own)
        raise
    try:
        _setns(theirs)
        try:
            for kind, rm in (
                ("shm", lambda i: _libc.shmctl(i, IPC_RMID, None)),
                ("msg", lambda i: _libc.msgctl(i, IPC_RMID, None)),
                ("sem", lambda i: _libc.semctl(i, 0, IPC_RMID)),
            ):
                with open(f"/proc/sysvipc/{kind}") as f:
                    rows = f.read().splitlines()[1:]
                for row in rows:
                    ident = int(row.split()[1])
                    if rm(ident) != 0 and ctypes.get_errno() not in (22, 43):  # EINVAL, EIDRM
                        err = ctypes.get_errno()
                        raise SandboxError(
                            f"sandbox {sandbox_id}: cannot remove SysV {kind} {ident}: "
                            f"{os.strerror(err)}",
                            sandbox_id=sandbox_id,
                        )
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(theirs)
