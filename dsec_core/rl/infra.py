"""The typing of infrastructure failures a trainer masks: which errors and which command results
are the infrastructure's doing (a preemption, an out-of-memory kill, a slow start, a lost node, a
crash) rather than the task's or the policy's."""

from __future__ import annotations

import time

from ..errors import (
    AgentUnresponsive,
    DiskFull,
    DsecError,
    NodeUnavailable,
    SandboxDied,
    SandboxPaused,
    SourceUnavailable,
    StartTimeout,
    StepInterrupted,
)
from ..records import ExecResult, InfraEvent
from .errors import InfraFailure

__all__ = ["infra_event"]

#: The errors that are infrastructure failures, and their ``InfraEvent`` kinds.
INFRA_ERRORS: dict[type[DsecError], str] = {
    NodeUnavailable: "node_lost",
    StartTimeout: "start_timeout",
    SandboxPaused: "preempted",
    SandboxDied: "crashed",
    AgentUnresponsive: "crashed",
    DiskFull: "disk_full",
    SourceUnavailable: "source_unavailable",
    StepInterrupted: "node_lost",
}


def infra_event(error: BaseException | ExecResult, sandbox_id: str = "") -> InfraEvent | None:
    """The infrastructure failure ``error`` is (a dsec error raised by a call, or a command's
    result), or None if it is not one (then it is the task's or the caller's own)."""
    now = time.time()
    if isinstance(error, ExecResult):
        if error.oom_killed:
            return InfraEvent("out_of_memory", error.sandbox_id or sandbox_id, now, error.command)
        return None
    if isinstance(error, InfraFailure):
        return error.event
    for cls, name in INFRA_ERRORS.items():
        if isinstance(error, cls):
            sid = getattr(error, "context", {}).get("sandbox_id") or sandbox_id
            return InfraEvent(name, sid, now, str(error))
    return None
