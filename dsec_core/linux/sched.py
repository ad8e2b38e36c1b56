"""The CPU scheduler, from outside a process: SCHED_IDLE for every thread of one, a core
scheduling cookie for one (``prctl(PR_SCHED_CORE)``), and what this kernel offers of both.

Both are per task and inherited by every thread and child a task makes afterwards, so applying
them to a sandbox's init before anything runs in it covers everything that ever runs there.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import gzip
import os
import threading
from dataclasses import dataclass

__all__ = [
    "KernelFeature",
    "core_scheduling",
    "create_core_cookie",
    "sched_idle",
    "set_idle",
    "thread_ids",
]

PR_SCHED_CORE = 62
PR_SCHED_CORE_GET = 0
PR_SCHED_CORE_CREATE = 1
PIDTYPE_PID = 0
PIDTYPE_TGID = 1
#: How often ``set_idle`` walks a process's threads looking for ones started meanwhile.
MAX_PASSES = 50


@dataclass(frozen=True)
class KernelFeature:
    """Whether this host offers a kernel feature, and how that was found out (or why not)."""

    name: str
    available: bool
    detail: str

    def __str__(self) -> str:
        return f"{'available' if self.available else 'unavailable'}: {self.detail}"


def thread_ids(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (``ProcessLookupError`` if it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"no process {pid}") from None


def set_idle(pid: int) -> list[int]:
    """Put every thread of process ``pid`` under SCHED_IDLE; returns their ids.

    ``sched_setscheduler`` sets one thread, and a thread started from one not yet set would
    miss it, so the threads are walked until a pass finds none new. Threads and children
    started afterwards inherit the policy (SCHED_RESET_ON_FORK does not reset SCHED_IDLE).
    """
    done: set[int] = set()
    for _ in range(MAX_PASSES):
        new = [t for t in thread_ids(pid) if t not in done]
        if not new:
            return sorted(done)
        for tid in new:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # the thread exited meanwhile
                pass
            done.add(tid)
    raise OSError(errno.EAGAIN, f"process {pid} kept starting threads while set to SCHED_IDLE")


def _prctl(option: int, arg2: int, arg3: int, arg4: int, arg5: int) -> int:
    """prctl(2); the errno on failure, 0 on success."""
    libc = ctypes.CDLL(None, use_errno=True)
    ul = ctypes.c_ulong
    rc = libc.prctl(ctypes.c_int(option), ul(arg2), ul(arg3), ul(arg4), ul(arg5))
    return ctypes.get_errno() if rc != 0 else 0


def _config(option: str) -> str | None:
    """``option``'s line in the running kernel's config (/proc/config.gz), if it is readable."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            for line in f:
                if line.startswith((f"{option}=", f"# {option} ")):
                    return line.strip()
    except OSError:
        pass
    return None


@functools.cache
def core_scheduling() -> KernelFeature:
    """Whether ``prctl(PR_SCHED_CORE)`` works here, found by asking for this process's cookie
    (``PR_SCHED_CORE_GET``) and reading the errno: EINVAL, a kernel without CONFIG_SCHED_CORE
    (it does not know the option); ENODEV, a kernel with it on CPUs without SMT, where there is
    no sibling thread to keep apart."""
    cookie = ctypes.c_ulong(0)
    err = _prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PIDTYPE_PID, ctypes.addressof(cookie))
    name = "core_scheduling"
    if err == 0:
        return KernelFeature(name, True, "prctl(PR_SCHED_CORE) answers on this kernel")
    if err == errno.EINVAL:
        config = _config("CONFIG_SCHED_CORE")
        return KernelFeature(
            name,
            False,
            "prctl(PR_SCHED_CORE_GET) fails with EINVAL: this kernel is built without core "
            f"scheduling ({config or 'CONFIG_SCHED_CORE'})",
        )
    if err == errno.ENODEV:
        return KernelFeature(
            name,
            False,
            "prctl(PR_SCHED_CORE_GET) fails with ENODEV: the kernel has core scheduling but the "
            "CPUs have no SMT siblings to keep apart",
        )
    return KernelFeature(
        name,
        False,
        f"prctl(PR_SCHED_CORE_GET) fails with {errno.errorcode.get(err, err)}: {os.strerror(err)}",
    )


def create_core_cookie(pid: int) -> None:
    """Give process ``pid`` (all its threads) a core scheduling cookie of its own: its threads
    then share a core's SMT siblings only with tasks of the same cookie, which it passes to its
    children. ``OSError`` if the kernel refuses (see ``core_scheduling``)."""
    err = _prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, pid, PIDTYPE_TGID, 0)
    if err:
        raise OSError(err, f"prctl(PR_SCHED_CORE_CREATE) on process {pid}: {os.strerror(err)}")


@functools.cache
def sched_idle() -> KernelFeature:
    """SCHED_IDLE (Linux 2.6.23): whether ``sched_setscheduler`` takes it here, tried on a
    throwaway thread of this process so nothing of ours changes class."""
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    t = threading.Thread(target=probe, name="dsec-sched-idle-probe")
    t.start()
    t.join()
    if outcome and outcome[0] is None:
        return KernelFeature("sched_idle", True, "sched_setscheduler(SCHED_IDLE) works")
    return KernelFeature("sched_idle", False, f"sched_setscheduler(SCHED_IDLE) fails: {outcome}")
