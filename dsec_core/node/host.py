"""The node as its services see it: ``SandboxHost`` and the narrow protocols each service types
its back-reference with.

``Node`` implements all of them with its public methods; a service never reaches for the node's
private names, and a test of a service implements only what that service's protocol lists (a
small fake host, no daemon). Each protocol says which service it serves:

- ``SandboxHost``: the sandboxes, their events and their end (the base of most of them);
- ``SandboxCommands``: commands and files inside a sandbox, through its agent;
- ``CatalogHost``: the backends and environments sandboxes are made of;
- one protocol per service, made of those and what else it needs: ``AdmissionHost``
  (``admission.Admission``), ``AgentHost`` (``agents.Agents``), ``CommandHost``
  (``judge.judge``), ``DriveHost`` (``drive.DriveServer``), ``LeaseHost`` (``leases.Leases``),
  ``LifecycleHost`` (``lifecycle.Lifecycle``), ``PauseHost`` (``pause.Pauses``), ``PoolHost``
  (``pools.Pools``), ``SnapshotHost`` (``layer_snapshots.LayerSnapshots``,
  ``memory.MemorySnapshots``), ``StateHost`` (``persistence.StateFiles``) and ``WarmHost``
  (``warm.WarmPools``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from ..backend import Backend, SandboxRuntime
from ..catalog.store import CatalogStore
from ..config import NodeConfig
from ..errors import DsecError
from ..records import (
    ExecResult,
    FileEntry,
    IdMap,
    InfraEvent,
    NodeLoad,
    SandboxInfo,
    SandboxSpec,
)
from ..sources.base import LayerSource
from .sandbox import Sandbox
from .trajectory import TrajectoryLogs

__all__ = [
    "AdmissionHost",
    "AgentHost",
    "CatalogHost",
    "CommandHost",
    "DriveHost",
    "LeaseHost",
    "LifecycleHost",
    "PauseHost",
    "PoolHost",
    "SandboxCommands",
    "SandboxHost",
    "SnapshotHost",
    "StateHost",
    "WarmHost",
    "create_all",
]


class SandboxHost(Protocol):
    """The sandboxes of a node, their events and their end: the base of most protocols here."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def sandboxes(self) -> Mapping[str, Sandbox]:
        """Every sandbox the node tracks, by id (read-only to services)."""
        ...

    def sandbox(self, sid: str) -> Sandbox:
        """Sandbox ``sid``; ``UnknownSandbox``, or ``SandboxDied`` naming what it died of."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background; the node waits for it when it closes."""
        ...

    def record_event(self, event: InfraEvent) -> None:
        """Note an infrastructure failure that struck a sandbox (kept in its state)."""
        ...

    async def kill(self, sid: str, reason: str = "request") -> None:
        """Stop sandbox ``sid`` and free everything it held."""
        ...


class SandboxCommands(Protocol):
    """Commands and files inside a running sandbox (through its agent)."""

    async def exec(
        self,
        sid: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
        background: bool = False,
        exclusive: bool = False,
        trajectory: str | None = None,
        step: int | None = None,
    ) -> ExecResult: ...

    async def read_file(self, sid: str, path: str, offset: int = 0, length: int = -1) -> bytes: ...

    async def write_file(
        self,
        sid: str,
        path: str,
        data: bytes,
        mode: int = 0o644,
        offset: int = 0,
        truncate: bool = True,
    ) -> None: ...

    async def list_dir(self, sid: str, path: str) -> list[FileEntry]: ...

    async def remove(self, sid: str, path: str, recursive: bool = False) -> None: ...


class AgentHost(SandboxHost, Protocol):
    """What the agents' side sees: sandboxes and the trajectory logs commands may go to."""

    @property
    def trajectories(self) -> TrajectoryLogs: ...


class CommandHost(SandboxHost, SandboxCommands, Protocol):
    """What judging sees: sandboxes and commands in them."""


class LeaseHost(SandboxHost, Protocol):
    """What trainer leases see: sandboxes, and pausing and resuming them."""

    async def pause(
        self, sid: str, reclaim: bool = False, preempted: bool = False
    ) -> SandboxInfo: ...

    async def resume(self, sid: str) -> SandboxInfo: ...


class PauseHost(SandboxHost, Protocol):
    """What pausing sees: sandboxes, their exit watches and their saved state."""

    def expect_exit(self, sb: Sandbox) -> AbstractContextManager[None]:
        """Inside this block the sandbox's process may end or be replaced (a VM's pause or
        resume): no death; the process it runs in after is watched."""
        ...

    def save(self, sb: Sandbox) -> None:
        """Write the sandbox's state (a restarted daemon reads it back)."""
        ...


class CatalogHost(Protocol):
    """The backends and the environments sandboxes are made of."""

    @property
    def catalogs(self) -> CatalogStore: ...

    def backend(self, name: str) -> Backend:
        """The node's instance of backend ``name`` (``UnknownBackend``, ``BackendUnavailable``)."""
        ...


class AdmissionHost(CatalogHost, Protocol):
    """What admission sees: the node's settings, its sandboxes, backends and environments."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def sandboxes(self) -> Mapping[str, Sandbox]: ...


class PoolHost(CommandHost, CatalogHost, Protocol):
    """What FnCall pools see: sandboxes to create, reset and run commands in, the backends
    that serve them and the environments they are made of."""

    async def create(self, spec: SandboxSpec, saved: Path | None = None) -> SandboxInfo: ...

    async def reset(self, sid: str) -> None: ...


class WarmHost(SandboxHost, CatalogHost, Protocol):
    """What warm pools see: sandboxes, the node's load and create queue as far as room goes,
    members to start, and the TTL a claim sets."""

    def load(self, warm: bool = False) -> NodeLoad:
        """The node's load; warm members counted only with ``warm``."""
        ...

    def waiting_creates(self) -> int:
        """Creates waiting in the create queue (for room or a start slot)."""
        ...

    def creates_waiting_for_room(self) -> int:
        """Creates waiting in the create queue while start slots are free: for room."""
        ...

    def pending_creates(self) -> Sequence[SandboxSpec]:
        """Specs of creates let go by the queue and not yet admitted."""
        ...

    def start_slots_spare(self) -> bool:
        """Whether a background start may take a start slot (fewer than half are taken)."""
        ...

    async def start_warm(self, spec: SandboxSpec) -> SandboxInfo:
        """Admit and start a warm member of ``spec`` (marked, hidden) outside the queue's
        fair order; ``AdmissionRejected`` if creates wait or no start slot is free."""
        ...

    async def set_ttl(self, sid: str, ttl: float | None) -> SandboxInfo:
        """Give sandbox ``sid`` ``ttl`` seconds from now (None: until killed); saves it."""
        ...


class DriveHost(CommandHost, AgentHost, Protocol):
    """What the drive socket sees: sandboxes, commands in them and the trajectory logs."""


class SnapshotHost(SandboxHost, Protocol):
    """What snapshots see: sandboxes to save and to make from a snapshot, and the node's
    layer sources (a snapshot's parents, where a snapshot is pushed)."""

    @property
    def layer_sources(self) -> Sequence[LayerSource]: ...

    async def create_many_settled(
        self, spec: SandboxSpec, n: int, saved: Path | None = None
    ) -> list[SandboxInfo | DsecError]:
        """Create ``n`` sandboxes; each slot holds its sandbox or its typed error."""
        ...

    def expect_exit(self, sb: Sandbox) -> AbstractContextManager[None]:
        """Inside this block the sandbox's process may end (a VM saved or paused): no death."""
        ...


class LifecycleHost(Protocol):
    """What TTLs and exit watches see: the sandboxes, and the kill that ends one."""

    @property
    def sandboxes(self) -> Mapping[str, Sandbox]: ...

    async def kill(self, sid: str, reason: str = "request") -> None: ...


class StateHost(Protocol):
    """What reading a sandbox's state back needs: the node's settings, its backends, and the
    runtime record it gives a sandbox."""

    @property
    def config(self) -> NodeConfig: ...

    def backend(self, name: str) -> Backend: ...

    def runtime(
        self, sid: str, spec: SandboxSpec, backend: Backend, idmap: IdMap
    ) -> SandboxRuntime:
        """A sandbox's runtime record before its root filesystem is prepared."""
        ...


async def create_all(
    host: SnapshotHost, spec: SandboxSpec, n: int, saved: Path | None = None
) -> list[SandboxInfo]:
    """``n`` sandboxes of ``spec``, all or nothing: if one create fails, those made are killed
    and its error raised."""
    results = await host.create_many_settled(spec, n, saved)
    made = [r for r in results if isinstance(r, SandboxInfo)]
    failed = [r for r in results if not isinstance(r, SandboxInfo)]
    if failed:
        await asyncio.gather(*(host.kill(i.id) for i in made), return_exceptions=True)
        raise failed[0]
    return made
