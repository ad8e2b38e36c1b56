"""CPU classes of container sandboxes (``SandboxSpec.qos``), applied to a started container
before anything runs in it.

Best-effort ("be"): every thread of the sandbox's init (the agent) goes under SCHED_IDLE, so
every process it starts inherits it; the sandbox's cpu cgroup gets ``cpu.idle`` where the
controller has it (the group then counts as idle against its siblings), on top of the lowest
``cpu.shares`` the OCI config gave it. Root in the sandbox cannot leave SCHED_IDLE: the kernel
lets a task without CAP_SYS_NICE in the host's user namespace do so only within its
RLIMIT_NICE, which the OCI config pins at 0 (a hard limit it cannot raise without
CAP_SYS_RESOURCE there either), and its cgroup's files are read-only to it.

Latency-sensitive ("ls"): normal scheduling; where the kernel has core scheduling, the init
gets a cookie of its own, so SMT siblings never run another sandbox's tasks beside it.

runc 1.1 has no ``process.scheduler`` (OCI runtime spec 1.2), so the backend does this itself.
"""

from __future__ import annotations

from typing import Any

from dsec_core.backend import SandboxRuntime, cgroup_path
from dsec_core.errors import SandboxError
from dsec_core.linux.cgroups import cpu_cgroup_dir
from dsec_core.linux.sched import core_scheduling, create_core_cookie, set_idle

__all__ = ["BE_SHARES", "apply_qos", "cpu_shares"]

#: cpu.shares of a best-effort sandbox, whatever CPU it asks for: the lowest cgroup v1 takes
#: (runc turns it into cgroup v2's lowest weight). With cpu.idle on, the kernel lowers the
#: group's weight further, and cpu.shares reads 3.
BE_SHARES = 2


def cpu_shares(rt: SandboxRuntime) -> int:
    """The sandbox's cpu.shares: 1024 a core it asks for, or ``BE_SHARES`` if best effort."""
    if rt.spec.qos == "be":
        return BE_SHARES
    return max(2, int(rt.limits.cpu * 1024))


def apply_qos(rt: SandboxRuntime, pid: int) -> dict[str, Any]:
    """Put the started sandbox whose init is host process ``pid`` in its CPU class; returns what
    was done, for the sandbox's state. ``SandboxError`` if the kernel refused."""
    try:
        if rt.spec.qos == "be":
            threads = set_idle(pid)
            idle = cpu_cgroup_dir(cgroup_path(rt.id))
            cpu_idle = idle is not None and (idle / "cpu.idle").exists()
            if cpu_idle:
                assert idle is not None
                (idle / "cpu.idle").write_text("1")
            return {"class": "be", "sched_idle_threads": len(threads), "cpu_idle": cpu_idle}
        core = core_scheduling()
        if core.available:
            create_core_cookie(pid)
        return {"class": "ls", "core_cookie": core.available}
    except OSError as e:
        raise SandboxError(
            f"sandbox {rt.id}: cannot put it in CPU class {rt.spec.qos!r}: {e}",
            sandbox_id=rt.id,
            qos=rt.spec.qos,
        ) from e
