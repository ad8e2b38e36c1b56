"""A node without a node, for the unit tests of its services (``dsec_core.node.host``).

``FakeHost`` implements the host protocols the services see (``SandboxHost`` and its kin) over
plain records: sandboxes are ``Sandbox`` records of a ``FakeBackend`` that keeps its state in
memory, commands are answered by ``FakeHost.answer``, files live in a dict. Nothing is mounted
or started, so a service's logic runs in milliseconds and without root.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dsec_core.backend import Backend, Feature, SandboxRuntime
from dsec_core.catalog.model import Environment
from dsec_core.config import NodeConfig
from dsec_core.errors import DsecError, SandboxError, UnknownEnvironment, UnknownSandbox
from dsec_core.node.admission import node_load
from dsec_core.node.sandbox import PolicyPlan, Sandbox
from dsec_core.node.trajectory import TrajectoryLogs
from dsec_core.records import (
    ExecResult,
    FileEntry,
    IdMap,
    InfraEvent,
    LayerInfo,
    NodeLoad,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)

ALL_FEATURES = frozenset(
    {
        Feature.CGROUPS,
        Feature.NET_NAMESPACE,
        Feature.RESET,
        Feature.PAUSE,
        Feature.DEVICES,
        Feature.DRIVE,
        Feature.MEMORY_SNAPSHOT,
        Feature.SCREEN,
    }
)


class FakeBackend(Backend):
    """A backend whose sandboxes are entries in its sets: started, paused, dead."""

    name = "fake"
    features = ALL_FEATURES
    policy_targets = frozenset({"oci"})
    runtimes = frozenset({"runc"})

    def __init__(self, config: NodeConfig | None = None) -> None:
        self.config = config  # type: ignore[assignment]
        self.dead: set[str] = set()
        self.paused_ids: set[str] = set()
        self.stopped: list[str] = []
        self.resets: list[str] = []
        self.failing_resets: set[str] = set()
        self.oom_kills: dict[str, int] = {}
        self.inputs: list[Any] = []
        self.cause: tuple[str, str] | None = ("oom", "the OOM killer took its init")
        self.exit_fds: dict[str, int] = {}  # sandbox id -> the fd exit_fd hands out

    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        return {"pid": 1}

    async def alive(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        return rt.id not in self.dead

    async def stop(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        self.stopped.append(rt.id)

    def death_cause(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> tuple[str, str] | None:
        return self.cause

    def exit_fd(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> int | None:
        fd = self.exit_fds.get(rt.id)
        return None if fd is None else os.dup(fd)

    def usage(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> SandboxUsage:
        return SandboxUsage(oom_kills=self.oom_kills.get(rt.id, 0))

    async def pause(
        self, rt: SandboxRuntime, state: Mapping[str, Any], reclaim: bool = False
    ) -> None:
        self.paused_ids.add(rt.id)

    async def resume(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        self.paused_ids.discard(rt.id)

    def paused(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        return rt.id in self.paused_ids

    async def reset(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        self.resets.append(rt.id)
        if rt.id in self.failing_resets:
            raise SandboxError(f"cannot reset {rt.id}", sandbox_id=rt.id)

    async def save(self, rt: SandboxRuntime, state: Mapping[str, Any], to: Path) -> None:
        to.mkdir()
        (to / "memory").write_bytes(b"\1" * 8192)

    async def screenshot(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bytes:
        return b"\x89PNG fake"

    async def input(self, rt: SandboxRuntime, state: Mapping[str, Any], events: list) -> None:
        self.inputs.extend(events)


class PlainBackend(FakeBackend):
    """A backend that claims no feature at all."""

    name = "plain"
    features = frozenset()
    runtimes = frozenset()


class FakeCatalogs:
    """``CatalogStore``'s reading side, over a dict of environments."""

    def __init__(self, *environments: Environment) -> None:
        self.by_name = {e.name: e for e in environments}

    def environment(self, name: str) -> Environment:
        env = self.by_name.get(name.rpartition("/")[2])
        if env is None:
            raise UnknownEnvironment(f"no environment {name!r}", name=name)
        return env

    def environments(self) -> list[Environment]:
        return list(self.by_name.values())


def layer(ref: str, **kw: Any) -> LayerInfo:
    name, _, version = ref.partition("@")
    return LayerInfo(name, version, kw.pop("kind", "base"), f"sha256:{ref}", 1, **kw)


class FakeHost:
    """The host protocols of ``dsec_core.node.host`` over records, for one test."""

    def __init__(self, tmp: Path, backend: FakeBackend | None = None, **config: Any) -> None:
        self.tmp = tmp
        self.config = NodeConfig(home=tmp / "home", **config)
        self.sandboxes: dict[str, Sandbox] = {}
        self.fake = backend or FakeBackend()
        self.backends: dict[str, Backend] = {self.fake.name: self.fake}
        self.catalogs = FakeCatalogs()
        self.trajectories = TrajectoryLogs(tmp / "trajectories")
        self.layer_sources: list[Any] = []
        self.recorded: list[InfraEvent] = []
        self.killed: list[tuple[str, str]] = []
        self.saves: list[str] = []
        self.quiet: list[str] = []  # sandboxes whose exit was expected (expect_exit)
        self.created: list[tuple[SandboxSpec, Path | None]] = []
        self.failing_creates = 0  # so many of the next creates fail
        self.execs: list[tuple[str, Any, dict[str, Any]]] = []
        self.files: dict[tuple[str, str], bytes] = {}
        self.tasks: set[asyncio.Task] = set()
        self._n = 0

    # --- records --------------------------------------------------------------------------
    def add(
        self,
        sid: str | None = None,
        spec: SandboxSpec | None = None,
        status: str = "running",
        backend: Backend | None = None,
        idmap: IdMap | None = None,
        **fields: Any,
    ) -> Sandbox:
        """A sandbox record, tracked."""
        self._n += 1
        sid = sid or f"sb{self._n}"
        spec = spec or SandboxSpec(layers=("base@1",))
        backend = backend or self.fake
        rt = self.runtime(sid, spec, backend, idmap or IdMap(100000 * self._n, 65536))
        fields.setdefault("layers", [layer(r) for r in spec.layers])
        fields.setdefault("created", float(self._n))
        fields.setdefault("expires", None)
        sb = Sandbox(rt=rt, backend=backend, **fields)
        sb.status = status
        self.sandboxes[sid] = sb
        return sb

    def runtime(
        self, sid: str, spec: SandboxSpec, backend: Backend, idmap: IdMap
    ) -> SandboxRuntime:
        sdir = self.config.runtime_dir / sid
        return SandboxRuntime(
            id=sid,
            spec=spec,
            limits=spec.limits,
            dir=sdir,
            data_dir=self.config.sandbox_dir / sid,
            agent_socket=sdir / "agent.sock",
            agent_binary=self.tmp / "agent",
            idmap=idmap,
            targets=backend.policy_targets,
        )

    def backend(self, name: str) -> Backend:
        return self.backends[name]

    # --- SandboxHost ----------------------------------------------------------------------
    def sandbox(self, sid: str) -> Sandbox:
        sb = self.sandboxes.get(sid)
        if sb is None:
            raise UnknownSandbox(f"no sandbox {sid!r}", name=sid)
        return sb

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def settle(self) -> None:
        """Wait for what ``spawn`` started, and what that started."""
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def record_event(self, event: InfraEvent) -> None:
        self.recorded.append(event)

    async def kill(self, sid: str, reason: str = "request") -> None:
        self.sandbox(sid)
        self.killed.append((sid, reason))
        del self.sandboxes[sid]

    # --- lifecycle of sandboxes -----------------------------------------------------------
    async def create(self, spec: SandboxSpec, saved: Path | None = None) -> SandboxInfo:
        self.created.append((spec, saved))
        if self.failing_creates:
            self.failing_creates -= 1
            raise SandboxError("the fake create failed")
        return self.add(spec=spec).info()

    async def create_many_settled(
        self, spec: SandboxSpec, n: int, saved: Path | None = None
    ) -> list[SandboxInfo | DsecError]:
        out: list[SandboxInfo | DsecError] = []
        for _ in range(n):
            try:
                out.append(await self.create(spec, saved))
            except DsecError as e:
                out.append(e)
        return out

    async def reset(self, sid: str) -> None:
        sb = self.sandbox(sid)
        await sb.backend.reset(sb.rt, sb.backend_state)

    async def pause(self, sid: str, reclaim: bool = False, preempted: bool = False) -> SandboxInfo:
        sb = self.sandbox(sid)
        sb.paused, sb.preempted = True, preempted
        return sb.info()

    async def resume(self, sid: str) -> SandboxInfo:
        sb = self.sandbox(sid)
        sb.paused = sb.preempted = False
        return sb.info()

    @contextlib.contextmanager
    def expect_exit(self, sb: Sandbox) -> Iterator[None]:
        self.quiet.append(sb.rt.id)
        yield

    def save(self, sb: Sandbox) -> None:
        self.saves.append(sb.rt.id)

    # --- WarmHost -------------------------------------------------------------------------
    def load(self, warm: bool = False) -> NodeLoad:
        live = [s for s in self.sandboxes.values() if warm or not s.warm]
        return node_load(self.config, self.backends, live, {})

    def waiting_creates(self) -> int:
        return 0

    def creates_waiting_for_room(self) -> int:
        return 0

    def pending_creates(self) -> tuple[SandboxSpec, ...]:
        return ()

    def start_slots_spare(self) -> bool:
        return True

    async def start_warm(self, spec: SandboxSpec) -> SandboxInfo:
        self.created.append((spec, None))
        return self.add(spec=spec, warm=True).info()

    async def set_ttl(self, sid: str, ttl: float | None) -> SandboxInfo:
        sb = self.sandbox(sid)
        sb.expires = None if ttl is None else time.time() + ttl
        self.save(sb)
        return sb.info()

    # --- commands and files ---------------------------------------------------------------
    def answer(self, sid: str, cmd: Any, stdin: bytes | None) -> ExecResult:
        """What a command prints: override per test. By default, its stdin, exit 0."""
        return ExecResult(0, stdin or b"", b"", 0.01, command=str(cmd), sandbox_id=sid)

    async def exec(self, sid: str, cmd: str | Sequence[str], **kw: Any) -> ExecResult:
        self.sandbox(sid)
        self.execs.append((sid, cmd, kw))
        return self.answer(sid, cmd, kw.get("stdin"))

    async def read_file(self, sid: str, path: str, offset: int = 0, length: int = -1) -> bytes:
        return self.files[(sid, path)]

    async def write_file(self, sid: str, path: str, data: bytes, **kw: Any) -> None:
        self.files[(sid, path)] = data

    async def list_dir(self, sid: str, path: str) -> list[FileEntry]:
        return [
            FileEntry(name=p.rpartition("/")[2], type="file", size=len(d), mode=0o644, mtime=0.0)
            for (s, p), d in self.files.items()
            if s == sid and p.rpartition("/")[0] == path
        ]

    async def remove(self, sid: str, path: str, recursive: bool = False) -> None:
        for key in [k for k in self.files if k[0] == sid and k[1].startswith(path + "/")]:
            del self.files[key]


def plan_of(*chosen: tuple[Any, dict[str, Any]], **skipped: str) -> PolicyPlan:
    return PolicyPlan(chosen=list(chosen), skipped=dict(skipped))
