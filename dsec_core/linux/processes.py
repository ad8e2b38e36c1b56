"""Processes, by pid and by ``Popen``: what ``/proc/PID/stat`` says (a start time names one
process even after its pid is reused), waiting for an exit and killing through a pidfd (no
race with pid reuse, no thread), stopping a child politely (SIGTERM, then SIGKILL), and a free
loopback port for a server about to start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
from dataclasses import dataclass

__all__ = [
    "ProcStat",
    "free_port",
    "kill_and_wait",
    "open_pidfd",
    "pids_matching",
    "proc_stat",
    "start_time",
    "still_running",
    "stop_process",
    "terminate_pidfd",
    "wait_child",
    "wait_for_exit",
    "wait_pidfd",
    "wait_readable",
]

#: States of a process that has exited: a zombie not yet reaped, or dead.
EXITED = frozenset("ZXx")


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` dsec reads (clock ticks for times)."""

    state: str
    ppid: int
    utime: int
    stime: int
    start_time: int

    @property
    def exited(self) -> bool:
        """A zombie or dead: it runs no more, though its pid is not free yet."""
        return self.state in EXITED

    @property
    def cpu_seconds(self) -> float:
        """User and system CPU time."""
        return (self.utime + self.stime) / os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> ProcStat | None:
    """``pid``'s stat, None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces and parentheses itself
    fields = data.rsplit(")", 1)[1].split()
    return ProcStat(
        state=fields[0],
        ppid=int(fields[1]),
        utime=int(fields[11]),
        stime=int(fields[12]),
        start_time=int(fields[19]),
    )


def start_time(pid: int, *, zombie: bool = False) -> int | None:
    """``pid``'s start time (clock ticks since boot): with the pid it names one process even
    after the pid is reused. None if it is gone, or has exited unless ``zombie`` (then a zombie
    not yet reaped still has its start time)."""
    stat = proc_stat(pid)
    if stat is None or (stat.exited and not zombie):
        return None
    return stat.start_time


def still_running(pid: object, started: object, *, zombie: bool = False) -> bool:
    """Whether ``pid`` (an int, else False: a state record's field, say) is still the process
    that started at ``started`` (its ``start_time``, with the same ``zombie``)."""
    return isinstance(pid, int) and start_time(pid, zombie=zombie) == started


def open_pidfd(pid: int, started: object, *, zombie: bool = False) -> int | None:
    """A pidfd of ``pid`` if it is still the process that started at ``started`` (a
    ``start_time``), else None; the caller closes it. The check comes after the open, so a pid
    reused in between is never mistaken for the process."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if start_time(pid, zombie=zombie) != started:
        os.close(fd)
        return None
    return fd


def wait_pidfd(pidfd: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds (0: only look) for the process of ``pidfd`` to exit; True
    if it has."""
    return bool(select.select([pidfd], [], [], timeout)[0])  # readable once it has exited


def wait_for_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``pid`` to exit (any process, not only a child);
    True if it has (or was gone already)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return wait_pidfd(pidfd, timeout)
    finally:
        os.close(pidfd)


def terminate_pidfd(pidfd: int, timeout: float) -> bool:
    """SIGTERM through ``pidfd``, then SIGKILL if the process has not exited ``timeout``
    seconds later; True once it has exited (it is not reaped: a parent still waits for it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)
        if wait_pidfd(pidfd, timeout):
            return True
    return False


async def wait_readable(fd: int) -> None:
    """Until ``fd`` is readable, on the running loop (a pidfd is, once its process exits)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def wait_child(pid: int) -> int:
    """Wait for child ``pid`` without a thread, reap it and return its exit code (negative:
    the signal that killed it)."""
    pidfd = os.pidfd_open(pid)
    try:
        await wait_readable(pidfd)
    finally:
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


async def kill_and_wait(pid: int, timeout: float = 10.0, *, reap: bool = False) -> bool:
    """SIGKILL ``pid`` through a pidfd and wait up to ``timeout`` seconds for it to exit; with
    ``reap``, reap it too if it is this process's child. True if it has exited (or was gone).

    An init process of a pid namespace is reported exited only once the kernel has killed
    every process of its namespace."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        await asyncio.wait_for(wait_readable(pidfd), timeout)
    except ProcessLookupError:
        pass
    except TimeoutError:
        return False
    finally:
        os.close(pidfd)
    if reap:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return True


def stop_process(
    proc: subprocess.Popen,
    grace: float = 5.0,
    *,
    sig: int = signal.SIGTERM,
    group: bool = False,
) -> None:
    """Stop a child: ``sig`` (SIGTERM), then SIGKILL after ``grace`` seconds (to its whole
    process group with ``group``, for a child started in a session of its own that has
    children of its own); always reaped. One that has exited already is only reaped."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            if group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` nothing was listening on a moment ago (another process may take
    it before the caller binds it: servers started on one retry with another)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pids_matching(*needles: str) -> list[int]:
    """The pids of the processes whose command line (its arguments joined by spaces) holds
    every one of ``needles``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        line = " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)
        if line and all(n in line for n in needles):
            out.append(int(entry))
    return out
