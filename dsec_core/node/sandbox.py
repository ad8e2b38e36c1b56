"""What the node tracks of each sandbox (``Sandbox``) and of the security policies in force on it
(``PolicyPlan``): the records the node and its services share."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..agent.rpc import AgentClient
from ..backend import Backend, SandboxRuntime
from ..errors import DsecError, SandboxDied, SandboxNotRunning
from ..records import PROJECT_LABEL, InfraEvent, LayerInfo, SandboxInfo, user_labels
from ..security import SecurityPolicy

__all__ = [
    "LIVE",
    "MAX_EVENTS",
    "POOL_LABEL",
    "PolicyPlan",
    "Sandbox",
    "died_error",
    "in_project",
    "state_counts",
]

#: The label every FnCall pool member carries, its value the pool's name (``pools``).
POOL_LABEL = "dsec.fncall-pool"

#: How many infrastructure events a sandbox keeps (the most recent).
MAX_EVENTS = 100
#: The statuses of a sandbox that holds what admission counts.
LIVE = ("creating", "running")


@dataclass
class PolicyPlan:
    """The security policies of one sandbox: those in force, with their settings, and those
    considered but not in force, with the reason."""

    chosen: list[tuple[SecurityPolicy, dict[str, Any]]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def states(self) -> dict[str, str]:
        return {**{p.name: "enforced" for p, _ in self.chosen}, **self.skipped}

    def find(self, name: str) -> tuple[SecurityPolicy, dict[str, Any]] | None:
        return next(((p, s) for p, s in self.chosen if p.name == name), None)

    def release(self, rt: SandboxRuntime) -> None:
        """The sandbox is gone: each policy in force lets go of what it holds for it."""
        for policy, _ in self.chosen:
            policy.released(rt)


@dataclass
class Sandbox:
    """A sandbox as the daemon tracks it."""

    rt: SandboxRuntime
    backend: Backend
    layers: list[LayerInfo]
    created: float
    expires: float | None
    backend_state: dict[str, Any] = field(default_factory=dict)
    status: str = "creating"  # creating | running | stopping | dead
    ttl_handle: asyncio.TimerHandle | None = None
    agent: AgentClient | None = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    policies: PolicyPlan = field(default_factory=lambda: PolicyPlan())
    exit_fd: int | None = None  # watched by the node's loop (Backend.exit_fd); None: polled
    paused: bool = False  # running, but every process stopped where it was (Feature.PAUSE)
    preempted: bool = False  # paused because its trainer's lease lapsed (resumed on takeover)
    packing: asyncio.Future | None = None  # a pack_diff in flight: kill waits for it
    events: list[InfraEvent] = field(default_factory=list)  # infrastructure failures it met
    oom_kills: int = 0  # the OOM kills its backend reported when last asked
    #: a warm member no create has claimed yet (``warm``): hidden from lists, admission,
    #: placement and projects; a claim makes it a sandbox of its own for good
    warm: bool = False
    #: (kind, cause) once the node found it dead (``Lifecycle.death_of``), while it cleans up
    died: tuple[str, str] | None = None

    @property
    def state(self) -> str:
        """What ``info().state`` says: the status, or "paused" for a paused running one
        ("warm" for an unclaimed warm member, in the node's metrics)."""
        if self.status == "running" and (self.paused or self.warm):
            return "warm" if self.warm else "paused"
        return self.status

    @property
    def live(self) -> bool:
        """Whether it holds what admission counts (creating or running)."""
        return self.status in LIVE

    def info(self) -> SandboxInfo:
        spec = self.rt.spec
        return SandboxInfo(
            id=self.rt.id,
            backend=self.backend.name,
            state=self.state,
            created=self.created,
            expires=self.expires,
            layers=tuple(layer.ref for layer in self.layers),
            environment=spec.environment,
            limits=self.rt.limits.to_dict(),
            labels=user_labels(spec.labels),
            pid=self.backend_state.get("pid"),
            policies=self.policies.states(),
            qos=spec.qos,
            devices=tuple(d.host_path for d in self.rt.devices),
            runtime=self.backend_state.get("runtime"),
            vnc=self.backend_state.get("vnc"),
        )

    def not_running(self) -> DsecError:
        """The error for a request that needs it running: ``SandboxDied`` naming its cause if
        it died (the node is cleaning up after it), else ``SandboxNotRunning``."""
        if self.died is not None:
            return died_error(self.rt.id, *self.died)
        return SandboxNotRunning(f"sandbox {self.rt.id} is {self.status}", sandbox_id=self.rt.id)

    def note(self, event: InfraEvent) -> None:
        """Keep an infrastructure failure that struck it (the latest ``MAX_EVENTS``)."""
        self.events.append(event)
        del self.events[:-MAX_EVENTS]

    def in_project(self, project: str, subtree: bool) -> bool:
        """Whether it is labelled with ``project`` (``PROJECT_LABEL``; or, ``subtree``, with a
        project below it)."""
        return in_project(self.rt.spec.labels.get(PROJECT_LABEL), project, subtree)


def died_error(sid: str, kind: str, cause: str) -> SandboxDied:
    """The error for sandbox ``sid``, which died on its own of ``cause`` (``kind``)."""
    return SandboxDied(
        f"sandbox {sid} died on its own ({kind}): {cause}", sandbox_id=sid, kind=kind, cause=cause
    )


def state_counts(sandboxes: Iterable[Sandbox]) -> dict[str, int]:
    """How many sandboxes are in each state (``Sandbox.state``), for ``dsec_sandboxes``."""
    counts: dict[str, int] = {}
    for sb in sandboxes:
        counts[sb.state] = counts.get(sb.state, 0) + 1
    return counts


def in_project(label: str | None, project: str, subtree: bool) -> bool:
    """Whether a sandbox labelled with project ``label`` is ``project``'s (or, ``subtree``,
    of a project below it; every project is below the root, ``/``)."""
    if label is None:
        return False
    if label == project or (subtree and project == "/"):
        return True
    return subtree and label.startswith(project + "/")
