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
import ctypes
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

    def __init__(self, config: NodeConfig) -> None:
        super().__init__(config)
        # Joining a sandbox's IPC namespace changes the calling thread's: only this thread
        # ever does it, so no other work runs in a borrowed namespace.
        self._ipc_thread = concurrent.futures.ThreadPoolExecutor(1, "dsec-fncall-ipc")

    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        return await super().start(replace(rt, enforce=_members_oci(rt)))

    async def reset(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        pid = state.get("pid")
        if not isinstance(pid, int) or not await self.alive(rt, state):
            raise SandboxError(f"sandbox {rt.id}: not running, cannot reset", sandbox_id=rt.id)
        try:
            await _kill_all_but(rt.id, pid)
            areas = [*work_areas(rt.spec.workdir), MQUEUE]
            await asyncio.to_thread(_empty_areas, rt.id, pid, areas)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._ipc_thread, _remove_sysv_ipc, rt.id, pid)
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
    theirs = os.open(f"/proc/{init}/ns/ipc", os.O_RDONLY)
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
