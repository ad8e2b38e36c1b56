"""dsec backend plugin ``oldbox``: sandboxes in fresh pid, network, ipc, uts and mount namespaces
around a chroot of the root filesystem the daemon composes, with ``dsec-agent`` as PID 1.

Migrated from dsec's first plugin contract by dsec's guide "Migrating a plugin written
before this change" (docs/plugins/migrating.md): plugin API 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import socket
from collections.abc import Mapping
from typing import Any

from dsec_core.backend import (
    AGENT_PATH,
    AgentChannel,
    Backend,
    Feature,
    RootfsForm,
    SandboxRuntime,
)
from dsec_core.errors import BackendUnavailable, SandboxError
from dsec_core.hookspecs import hookimpl
from dsec_core.records import SandboxUsage

DSEC_PLUGIN_API = 2

__all__ = ["OldboxBackend"]

AGENT_FD = 3
DEVICES = ("null", "zero", "full", "random", "urandom")
TOOLS = ("unshare", "chroot", "mount", "sh")
STOP_WITHIN = 10.0
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class OldboxBackend(Backend):
    """Sandboxes as namespaces around a chroot; no user namespace, no cgroups."""

    name = "oldbox"
    features = frozenset({Feature.PID_NAMESPACE, Feature.NET_NAMESPACE, Feature.SHARED_KERNEL})
    rootfs = RootfsForm.COMPOSED
    agent_channel = AgentChannel.UNIX
    policy_targets: frozenset[str] = frozenset()

    @classmethod
    def check_available(cls) -> None:
        if os.geteuid() != 0:
            raise BackendUnavailable("backend oldbox needs root (namespaces, mounts, chroot)")
        for tool in TOOLS:
            if shutil.which(tool, path=PATH) is None:
                raise BackendUnavailable(f"backend oldbox needs {tool}", missing=tool)

    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        assert rt.rootfs is not None  # RootfsForm.COMPOSED
        agent = rt.rootfs / AGENT_PATH.lstrip("/")
        agent.parent.mkdir(exist_ok=True)
        agent.touch()
        for d in ("dev", "proc"):
            (rt.rootfs / d).mkdir(exist_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            rt.agent_socket.unlink(missing_ok=True)
            listener.bind(os.fspath(rt.agent_socket))
            listener.listen(1024)
            pid = _spawn(launch_argv(rt), listener.fileno(), rt)
        except OSError as e:
            raise SandboxError(f"sandbox {rt.id}: cannot start: {e}", sandbox_id=rt.id) from e
        finally:
            listener.close()
        return {"pid": pid, "start_time": _start_time(pid)}

    async def alive(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        return _running(state)

    async def stop(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        pid = state.get("pid")
        if not _running(state):
            return
        pidfds = []
        for target in (int(pid), *_children(int(pid))):
            with contextlib.suppress(ProcessLookupError):
                pidfds.append(os.pidfd_open(target))
        try:
            for fd in pidfds:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.gather(*(_exited(fd) for fd in pidfds)), STOP_WITHIN)
            except TimeoutError:
                raise SandboxError(
                    f"sandbox {rt.id}: still there after SIGKILL", sandbox_id=rt.id
                ) from None
        finally:
            for fd in pidfds:
                os.close(fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(int(pid), os.WNOHANG)

    def usage(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> SandboxUsage:
        return SandboxUsage()  # no cgroups: nothing to read


def launch_argv(rt: SandboxRuntime) -> list[str]:
    """The agent as PID 1 of new namespaces, chrooted into the daemon's overlay."""
    assert rt.rootfs is not None
    root = shlex.quote(os.fspath(rt.rootfs))
    steps = [
        f"echo dsec-{rt.id[:12]} > /proc/sys/kernel/hostname",
        f"mount -t tmpfs -o size=1m,mode=755,nosuid tmpfs {root}/dev",
    ]
    for dev in DEVICES:
        steps += [f"touch {root}/dev/{dev}", f"mount --bind /dev/{dev} {root}/dev/{dev}"]
    steps += [
        f"ln -s /proc/self/fd {root}/dev/fd",
        f"mount --bind {shlex.quote(os.fspath(rt.agent_binary))} {root}{AGENT_PATH}",
        f"exec chroot {root} {AGENT_PATH} --fd {AGENT_FD}",
    ]
    return [
        "unshare",
        "--pid",
        "--net",
        "--ipc",
        "--uts",
        "--mount",
        "--fork",
        "--kill-child",
        f"--mount-proc={rt.rootfs}/proc",
        "sh",
        "-c",
        " && ".join(steps),
    ]


def _spawn(argv: list[str], listener: int, rt: SandboxRuntime) -> int:
    log = os.open(
        rt.dir / "launch.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
    )
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.posix_spawnp(
            argv[0],
            argv,
            {"PATH": PATH},
            setsid=True,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull, 0),
                (os.POSIX_SPAWN_DUP2, log, 1),
                (os.POSIX_SPAWN_DUP2, log, 2),
                (os.POSIX_SPAWN_DUP2, listener, AGENT_FD),
            ],
        )
    finally:
        os.close(log)
        os.close(devnull)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[1]


def _running(state: Mapping[str, Any]) -> bool:
    """Same pid, same start time, not a zombie; our own exited child is reaped first."""
    pid = state.get("pid")
    if not pid:
        return False
    with contextlib.suppress(ChildProcessError):
        os.waitpid(int(pid), os.WNOHANG)
    stat = _stat(int(pid))
    return stat is not None and stat[1] == state.get("start_time") and stat[0] != "Z"


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


async def _exited(pidfd: int) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)


@hookimpl
def dsec_register_backends(register):
    register(OldboxBackend)
