"""The node: owns every sandbox on this machine, from admission to cleanup, and survives restarts.

A create checks the security policies the sandbox asks for, admits it (the node's ``NodeLoad``
through the placement plugins), resolves its layers, prepares its root filesystem in the form
its backend asks for (mounted layers and an overlay, or the image files and a writable disk),
and asks the backend to start it; each step is undone if a later one fails. Every sandbox's
state is written to ``$DSEC_HOME/run/sandboxes/<id>/state.json`` (a tmpfs) so a restarted
daemon re-adopts what is still running and cleans up what is not.

``Node`` is the face: it keeps the sandboxes and the order of the steps, and hands each
concern to a service of its own module that sees the node only through a protocol of
``host`` (``SandboxHost`` and its kin), never through the face's private names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from .. import plugins
from ..agent import ensure_agent
from ..api.messages import WarmSettings, WarmStatus
from ..backend import Backend, SandboxRuntime
from ..catalog.store import CatalogStore
from ..config import NodeConfig
from ..errors import AdmissionRejected, DsecError, InvalidSpec, SandboxDied, SandboxNotRunning
from ..fairqueue import project_of
from ..fusion import CodeRun, CodeRunResult
from ..linux.mounts import unmount
from ..observe import NodeMetrics
from ..records import (
    CREATE_KEY_LABEL,
    PROJECT_LABEL,
    ExecResult,
    FileEntry,
    FnCallResult,
    IdMap,
    InfraEvent,
    JudgeResult,
    LayerInfo,
    MemorySnapshot,
    NodeLoad,
    PolicyState,
    ResolvedImage,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)
from ..screen_input import InputEvent
from ..sources.base import LayerSource
from . import admission
from .admission import Admission, Admitted
from .agents import Agents
from .coderun import run_code
from .create_queue import CreateQueue, Ticket
from .devices import DevicePool
from .disks import WritableDisks
from .drive import DriveServer
from .idpool import UidPool
from .images import Images
from .judge import JudgeSpec, judge
from .layer_snapshots import LayerSnapshots
from .lazy_layers import LazyLayers
from .leases import Leases
from .lifecycle import Lifecycle
from .memory import MemorySnapshots
from .mounts import MountCache
from .pause import Pauses
from .persistence import StateFiles, write_state
from .policies import PolicyPlan, PolicyPlanner, enforcer
from .pools import Pools
from .processes import Processes
from .reclaim import MemoryReclaim
from .rootfs import RootFilesystems
from .sandbox import Sandbox, state_counts
from .screen import Screens
from .trajectory import TrajectoryLogs
from .warm import WarmPools

__all__ = ["Node", "PolicyPlan", "Sandbox"]

log = logging.getLogger("dsec.node")

#: How long a request whose sandbox's agent did not answer waits for the node to see whether
#: the sandbox died (``Node.unreachable``).
DEATH_GRACE = 1.0


P = ParamSpec("P")
R = TypeVar("R")


class _Delegated(Generic[P, R]):
    """A method of the face that is a service's own (``Node.exec`` is ``node.agents.exec``):
    its signature, defaults and docstring stay where they are written, and mypy sees them."""

    def __init__(self, service: str, method: Callable[Concatenate[Any, P], R]) -> None:
        self.service, self.name, self.__doc__ = service, method.__name__, method.__doc__

    def __get__(self, node: Any, owner: type | None = None) -> Callable[P, R]:
        if node is None:  # on the class (help, inspect): the descriptor itself
            return self  # type: ignore[return-value]
        bound: Callable[P, R] = getattr(getattr(node, self.service), self.name)
        return bound


class Node:
    """Everything one node does; the HTTP API and the tests drive this class."""

    def __init__(self, config: NodeConfig | None = None) -> None:
        self.config = config or NodeConfig.from_env()
        self.registry = plugins.registry()
        cfg = self.config
        self.uids = UidPool(cfg.uid_base, cfg.uid_size, cfg.uid_ranges, cfg.sandbox_gid)
        self.sandboxes: dict[str, Sandbox] = {}
        #: (project, create key) -> the outcome of the create under way under it: a second
        #: one with the key awaits it
        self._keyed_creates: dict[tuple[str, str], asyncio.Future[SandboxInfo]] = {}
        #: the live sandboxes that have a create key, by (project, key)
        self._by_create_key: dict[tuple[str, str], str] = {}
        self._backends: dict[str, Backend] = {}
        self.catalogs = CatalogStore(cfg.catalog_dir)
        self.agent_binary: Path | None = None
        self.layer_sources: list[LayerSource] = []
        self.planner = PolicyPlanner(self.registry)
        self.admission = Admission(self, self.registry, self.planner, self.uids)
        self.rootfs = RootFilesystems(cfg, self.uids)
        self.lifecycle = Lifecycle(
            self, sweep=self.rootfs.sweep, deaths_file=cfg.run_dir / "deaths.json"
        )
        self.states = StateFiles(self, self.planner)
        self.agents = Agents(self)
        self.processes = Processes(self.agents)
        self.screens = Screens(self)
        self.pauses = Pauses(self)
        self.layer_snapshots = LayerSnapshots(self)
        self.images = Images(self)
        self.memory = MemorySnapshots(self)
        self.pools = Pools(self)
        self.warm_pools = WarmPools(self)
        self.reclaim = MemoryReclaim(self)
        self.leases = Leases(self)
        self.trajectories = TrajectoryLogs(cfg.home / "trajectories")
        self.drive = DriveServer(self, cfg.run_dir / "drive")
        self.metrics = NodeMetrics(
            sandbox_states=lambda: state_counts(self.sandboxes.values()),
            layer_cache=self.rootfs.counts,
        )
        self.queue = CreateQueue(self._fits, cfg.max_starting, self.metrics.queue, self._held)

    @property
    def devices(self) -> DevicePool:
        return self.admission.devices

    @property
    def disks(self) -> WritableDisks:
        return self.rootfs.disks

    @property
    def mounts(self) -> MountCache | None:
        return self.rootfs.mounts

    @property
    def lazy_layers(self) -> LazyLayers | None:
        return self.rootfs.lazy_layers

    # --- life of the node -----------------------------------------------------------------
    async def open(self) -> None:
        cfg = self.config
        # first: a bad inventory (a missing or non-device path) stops the node before it
        # mounts or starts anything; then the kernel's limits for many sandboxes
        self.admission.open()
        cfg.ensure_dirs()
        self.states.open()
        self.lifecycle.open()
        self.rootfs.bind_parents()
        try:
            self.agent_binary = ensure_agent(cfg.bin_dir)
            self.layer_sources = self.registry.node_sources(cfg)
            await self.rootfs.open(self.registry, self.layer_sources)
            await self._adopt()
        except BaseException:  # a node refused (a bad layer source...) leaves no mount
            if not self.sandboxes:
                self.rootfs.release_parents()
            raise
        await self.pools.drop_left()
        self.warm_pools.open()
        self.reclaim.open()
        await self.drive.start()
        self.lifecycle.start()

    async def _adopt(self) -> None:
        """Take over the sandboxes a previous daemon left running, and what they hold."""
        adopted = await self.states.recover(died=self.lifecycle.death_of)
        self.sandboxes.update((sb.rt.id, sb) for sb in adopted)
        for sb in adopted:
            if keyed := _create_key_of(sb.rt.spec.labels):
                self._by_create_key[keyed] = sb.rt.id
        self.rootfs.adopt(adopted)
        self.admission.adopt(adopted)
        for sb in adopted:
            self.lifecycle.watch(sb)
        lost = self.lazy_layers.lost_layers if self.lazy_layers else set()
        for sb in adopted:
            if lost & {info.digest for info in sb.layers}:
                # its file system reads through a FUSE connection that died with its keeper
                # and a daemon: it cannot read its layers again, so it is dead
                self.record_event(
                    self.lifecycle.note_death(
                        sb.rt.id,
                        "crashed",
                        "its on-demand layers' connection was lost while no daemon ran",
                    )
                )
                await self.kill(sb.rt.id, reason="layers lost")
        if lost and self.mounts is not None:
            self.mounts.drop_idle(lost)  # not to be found lingering by the next create

    async def close(self, kill_all: bool = False, release_runtime: bool = True) -> None:
        """Stop serving. Sandboxes keep running unless ``kill_all``; with none left and
        ``release_runtime``, the runtime tmpfs goes too (the daemon does that itself, last)."""
        self.lifecycle.stop()
        self.leases.close()
        await self.drive.close()
        await self.processes.close()  # their agent connections: the commands end
        await self.pools.close()
        await self.warm_pools.close()
        await self.reclaim.close()
        if kill_all:
            await asyncio.gather(
                *(self.kill(sid) for sid in list(self.sandboxes)), return_exceptions=True
            )
        await self.lifecycle.close()
        for be in self._backends.values():
            try:
                await be.close()
            except Exception:  # as for policies: the node still closes
                log.exception("closing backend %s", be.name)
        self.planner.close()
        self.rootfs.close(keep_lazy_layers=bool(self.sandboxes))
        await self.queue.close()
        await self.admission.close()
        if release_runtime:
            self.release_runtime()

    def release_runtime(self, lazy: bool = False) -> None:
        """Unmount the runtime tmpfs (and the sandboxes' mount parents, ``bind_parents``) if no
        sandbox needs it any more."""
        if not self.sandboxes:
            self.rootfs.release_parents()
        if not self.sandboxes and os.path.ismount(self.config.run_dir):
            unmount(self.config.run_dir, lazy=lazy)

    def backend(self, name: str) -> Backend:
        be = self._backends.get(name)
        if be is None:
            cls = self.registry.backend(name)
            cls.check_available()
            be = self._backends[name] = cls(self.config)
        return be

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background; ``close`` waits for it."""
        self.lifecycle.spawn(coro)

    def expect_exit(self, sb: Sandbox) -> contextlib.AbstractContextManager[None]:
        """Inside this block the sandbox's process may end or be replaced: no death."""
        return self.lifecycle.expect_exit(sb)

    def save(self, sb: Sandbox) -> None:
        """Write the sandbox's state (``persistence.write_state``)."""
        write_state(sb)

    # --- what placement sees --------------------------------------------------------------
    def load(self, warm: bool = False) -> NodeLoad:
        """This node as placement sees it: capacity and what live sandboxes reserve (warm
        members too with ``warm``; ``Admission.load``)."""
        return self.admission.load(warm)

    def warm(self) -> tuple[list[str], list[str]]:
        """The layers and environments a create here finds mounted (``admission.warm``)."""
        return admission.warm(self.sandboxes.values(), self.rootfs.lingering(), self.catalogs)

    def project_usage(self) -> dict[str, tuple[int, float, int]]:
        """Live sandboxes by project: how many, CPU and memory (``admission.project_usage``)."""
        return admission.project_usage(self.sandboxes.values())

    # --- create ---------------------------------------------------------------------------
    async def create(
        self, spec: SandboxSpec, saved: Path | None = None, *, wait: float = 0.0, batch: str = ""
    ) -> SandboxInfo:
        """Create a sandbox (``saved``: from a memory snapshot's directory, ``restore``); its
        time goes into ``metrics`` (``dsec_create_seconds``) whether it succeeds or fails.

        It waits its turn in the create queue (``create_queue``) for a start slot, and up to
        ``wait`` seconds for room if admission cannot take it now, under its project and
        ``batch``. Cancelled while it waits, it leaves the queue; cancelled once it starts, it
        runs to its end in the background and the sandbox it made is killed.

        First, a create that matches a warm member claims it (``WarmPools.claim``). A spec
        with a create key (``CREATE_KEY_LABEL``) that a live sandbox of its project already
        has, or a create under way, is answered with that sandbox: creates sent again are
        made once."""
        key = spec.labels.get(CREATE_KEY_LABEL)
        if key:
            return await self._create_once(key, spec, saved, wait, batch)
        return await self._queued_create(spec, saved, wait, batch)

    async def _create_once(
        self, key: str, spec: SandboxSpec, saved: Path | None, wait: float, batch: str
    ) -> SandboxInfo:
        """``create`` under create key ``key``: the sandbox it already made, or its own. The
        first request makes it itself (no task of its own: a keyed create costs what an
        unkeyed one does); one sent again meanwhile waits for that one's outcome, and makes
        its own if that one's caller left (its create called off, what it made killed)."""
        mine = (spec.labels.get(PROJECT_LABEL, ""), key)
        while (under_way := self._keyed_creates.get(mine)) is not None:
            try:
                return await asyncio.shield(under_way)
            except asyncio.CancelledError:
                if not under_way.cancelled():
                    raise  # this caller left
        made = self._made_under(mine)
        if made is not None:
            log.info("create key %s: sandbox %s made it already", key, made.rt.id)
            return made.info()
        outcome: asyncio.Future[SandboxInfo] = asyncio.get_running_loop().create_future()
        self._keyed_creates[mine] = outcome
        try:
            info = await self._queued_create(spec, saved, wait, batch)
        except asyncio.CancelledError:
            outcome.cancel()
            raise
        except BaseException as e:
            outcome.set_exception(e)
            outcome.exception()  # those who wait raise it; nobody waiting is no warning
            raise
        else:
            self._by_create_key[mine] = info.id
            outcome.set_result(info)
            return info
        finally:
            self._keyed_creates.pop(mine, None)

    async def _queued_create(
        self, spec: SandboxSpec, saved: Path | None, wait: float, batch: str
    ) -> SandboxInfo:
        t0 = time.perf_counter()
        if saved is None:
            claimed = await self.warm_pools.claim(spec)
            if claimed is not None:
                self.metrics.observe_create(claimed.backend, True, time.perf_counter() - t0)
                return claimed
        try:
            ticket = await self.queue.enter(spec, project_of(spec.labels), batch, wait)
            t0 = time.perf_counter()  # the create's own time, not its wait in the queue
            task = asyncio.get_running_loop().create_task(
                self._admit_and_create(spec, saved, ticket)
            )
            try:
                info = await asyncio.shield(task)
            except asyncio.CancelledError:
                self.spawn(self._discard(task))
                raise
        except BaseException:
            label = admission.backend_label(spec, self.catalogs)
            self.metrics.observe_create(label, False, time.perf_counter() - t0)
            raise
        self.metrics.observe_create(info.backend, True, time.perf_counter() - t0)
        return info

    async def _discard(self, task: asyncio.Task[SandboxInfo]) -> None:
        """The sandbox a create whose caller left is making: killed once it runs."""
        with contextlib.suppress(Exception):
            info = await task
            await self.kill(info.id, reason="caller gone")

    async def create_many_settled(
        self,
        spec: SandboxSpec,
        n: int,
        saved: Path | None = None,
        *,
        wait: float = 0.0,
        batch: str = "",
    ) -> list[SandboxInfo | DsecError]:
        """Create ``n`` sandboxes concurrently, one batch of the create queue (``batch``; a
        fresh one if empty); each slot holds its sandbox or its typed error."""
        batch = batch or f"batch-{secrets.token_hex(6)}"
        key = spec.labels.get(CREATE_KEY_LABEL)
        specs = [spec] * n
        if key and n > 1:  # one key a member: each is made once, and they are n
            specs = [
                spec.relabelled({**spec.labels, CREATE_KEY_LABEL: f"{key}.{i}"}, spec.trajectory)
                for i in range(n)
            ]
        results = await asyncio.gather(
            *(self.create(s, saved, wait=wait, batch=batch) for s in specs),
            return_exceptions=True,
        )
        out: list[SandboxInfo | DsecError] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, DsecError):
                raise r
            out.append(r)
        return out

    def _fits(self, spec: SandboxSpec, pending: Sequence[SandboxSpec]) -> AdmissionRejected | None:
        """Admission's refusal of ``spec`` now, with ``pending`` (let go by the queue, not yet
        admitted) counted as created; None if it would take it."""
        load = admission.with_created(self.load(), pending)
        try:
            self.devices.check(spec.devices)  # first, as admission does: this names the holders
            admission.admit(spec, load)
        except AdmissionRejected as e:
            return e
        return None

    def _held(self) -> dict[str, int]:
        """Live sandboxes by the create queue's project (``fairqueue.project_of``)."""
        out: dict[str, int] = {}
        for sb in self.sandboxes.values():
            if sb.live and not sb.warm:
                project = project_of(sb.rt.spec.labels)
                out[project] = out.get(project, 0) + 1
        return out

    async def _admit_and_create(
        self,
        spec: SandboxSpec,
        saved: Path | None,
        ticket: Ticket | None = None,
        warm: bool = False,
    ) -> SandboxInfo:
        t0 = time.perf_counter()
        try:
            try:
                a = self.admission.admit(spec)
            finally:  # counted by admission from here on (no await until _create adds it)
                if ticket is not None:
                    ticket.admitted()
            try:
                return await self._create(a, t0, saved, warm)
            except BaseException:  # nothing of the sandbox is left (_create undid it all)
                self.admission.release(a.sid, a.idmap)
                raise
        finally:
            if ticket is not None:
                ticket.done()

    async def _create(
        self, a: Admitted, t0: float, saved: Path | None, warm: bool = False
    ) -> SandboxInfo:
        sid, spec, backend = a.sid, a.spec, a.backend
        sources = self.rootfs.resolve(a.layers)
        rt = replace(self.runtime(sid, spec, backend, a.idmap), devices=a.devices, kernel=a.kernel)
        rt.dir.mkdir(mode=0o700)
        self.config.on_sandbox_path(rt.dir)  # runc's init passes it to reach rootfs/
        now = time.time()
        sb = Sandbox(
            rt=rt,
            backend=backend,
            layers=[info for _, info in sources],
            created=now,
            expires=now + spec.ttl if spec.ttl else None,
            policies=a.plan,
            warm=warm,
        )
        self.sandboxes[sid] = sb  # counted by admission from here on
        taken: list[str] = []
        t_prep = time.perf_counter()
        try:
            write_state(sb)  # first, so a crash from here on leaves a trace to clean
            sb.rt = rt = await self.rootfs.prepare(rt, backend, sources, taken)
            t_layers = time.perf_counter()
            sb.backend_state = await (
                backend.start(rt) if saved is None else backend.start_from(rt, saved)
            )
            t_start = time.perf_counter()
            await self.lifecycle.check_start(sb, t_start - t0)  # the undo below takes the rest
            sb.status = "running"
            if spec.ttl:  # a sandbox's life counts from when it runs (a VM boots for seconds)
                sb.expires = time.time() + spec.ttl
            write_state(sb)
            log.debug(
                "created %s: prepare %.1f ms, layers %.1f ms, backend %.1f ms, total %.1f ms",
                sid,
                1e3 * (t_prep - t0),
                1e3 * (t_layers - t_prep),
                1e3 * (t_start - t_layers),
                1e3 * (time.perf_counter() - t0),
            )
        except BaseException:
            self.sandboxes.pop(sid, None)
            await asyncio.shield(self._undo_create(taken, rt, a.plan))
            raise
        self.lifecycle.watch(sb)
        return sb.info()

    async def _undo_create(self, taken: list[str], rt: SandboxRuntime, plan: PolicyPlan) -> None:
        try:
            await self.rootfs.undo(taken, rt)
        finally:
            plan.release(rt)

    def runtime(
        self, sid: str, spec: SandboxSpec, backend: Backend, idmap: IdMap
    ) -> SandboxRuntime:
        """A sandbox's runtime record before its root filesystem is prepared."""
        sdir = self.config.runtime_dir / sid
        assert self.agent_binary is not None, "Node.open() first"
        return SandboxRuntime(
            id=sid,
            spec=spec,
            limits=spec.limits,
            dir=sdir,
            data_dir=self.config.sandbox_dir / sid,
            agent_socket=sdir / "agent.sock",
            agent_binary=self.agent_binary,
            idmap=idmap,
            enforce=enforcer(lambda: self.sandbox(sid)),
            targets=backend.policy_targets,
            drive_dir=self.drive.directory if spec.drives else None,
        )

    async def prefetch(self, refs: Sequence[str]) -> list[dict[str, Any]]:
        """Warm layers on this node: every chunk of on-demand layers, whole remote images."""
        return await self.rootfs.prefetch(refs)

    async def resolve_image(self, image: str) -> ResolvedImage:
        """Make docker image ``image`` (as ``FROM`` names it) into a base layer of this node's
        store (``Images.resolve``)."""
        return await self.images.resolve(image)

    # --- the sandboxes --------------------------------------------------------------------
    def sandbox(self, sid: str) -> Sandbox:
        """Sandbox ``sid``; ``UnknownSandbox``, or ``SandboxDied`` naming what it died of."""
        sb = self.sandboxes.get(sid)
        if sb is None:
            raise self.lifecycle.missing(sid)
        return sb

    def get(self, sid: str) -> SandboxInfo:
        return self.sandbox(sid).info()

    async def made_under_key(self, project: str, key: str) -> SandboxInfo | None:
        """The live sandbox a create under create key ``key`` of ``project`` made (waited for
        while one is being made), or None."""
        mine = (project, key)
        under_way = self._keyed_creates.get(mine)
        if under_way is not None:  # its outcome is its own caller's to raise
            await asyncio.wait({under_way})
        made = self._made_under(mine)
        return made.info() if made is not None else None

    def _made_under(self, mine: tuple[str, str]) -> Sandbox | None:
        """The live sandbox made under (project, create key) ``mine``, if there is one."""
        made = self.sandboxes.get(self._by_create_key.get(mine, ""))
        return made if made is not None and made.status != "stopping" else None

    def list_sandboxes(
        self, project: str | None = None, subtree: bool = False
    ) -> list[SandboxInfo]:
        """Every sandbox, oldest first; or those labelled with ``project`` (and, ``subtree``,
        with a project below it)."""
        sandboxes = sorted(
            (s for s in self.sandboxes.values() if not s.warm), key=lambda s: s.created
        )
        if project is not None:
            sandboxes = [s for s in sandboxes if s.in_project(project, subtree)]
        return [sb.info() for sb in sandboxes]

    def usage(self, sid: str) -> SandboxUsage:
        sb = self.sandbox(sid)
        return sb.backend.usage(sb.rt, sb.backend_state)

    def record_event(self, event: InfraEvent) -> None:
        """Note an infrastructure failure that struck a sandbox (``events``)."""
        sb = self.sandboxes.get(event.sandbox_id)
        log.warning("sandbox %s: %s: %s", event.sandbox_id, event.kind, event.detail)
        if sb is not None:
            sb.note(event)
            write_state(sb)

    def events(self, sid: str) -> list[InfraEvent]:
        """The infrastructure failures that struck sandbox ``sid``, oldest first."""
        return list(self.sandbox(sid).events)

    async def set_ttl(self, sid: str, ttl: float | None) -> SandboxInfo:
        """Give a running sandbox ``ttl`` more seconds from now (None: until killed)."""
        sb = self.sandbox(sid)
        self.lifecycle.set_ttl(sb, ttl)
        write_state(sb)
        return sb.info()

    def policy_states(self, sid: str) -> list[PolicyState]:
        """Every policy considered for the sandbox (``PolicyPlanner.states``)."""
        return self.planner.states(self.sandbox(sid))

    def set_policy(self, sid: str, name: str, settings: Mapping[str, Any]) -> PolicyState:
        """Change the settings of a ``live`` policy in force on a running sandbox."""
        sb = self.sandbox(sid)
        state = self.planner.change(sb, name, settings)
        write_state(sb)
        return state

    async def unreachable(self, e: SandboxNotRunning) -> DsecError:
        """What a request whose sandbox's agent did not answer (``e``) is answered:
        ``SandboxDied`` if the sandbox died, else ``e``. The agent's connection closes just
        before its process ends, so the node may see the death a moment after the request
        does: up to ``DEATH_GRACE`` seconds are given for it."""
        sid = e.context.get("sandbox_id")
        if not isinstance(sid, str) or "socket" not in e.context:
            return e  # not an agent that did not answer
        deadline = time.monotonic() + DEATH_GRACE
        while True:
            sb = self.sandboxes.get(sid)
            if sb is None:
                gone = self.lifecycle.missing(sid)
                return gone if isinstance(gone, SandboxDied) else e
            if sb.died is not None:
                return sb.not_running()
            if sb.status != "running" or time.monotonic() > deadline:
                return e
            await asyncio.sleep(0.02)

    # --- kill -----------------------------------------------------------------------------
    async def kill(self, sid: str, reason: str = "request") -> None:
        sb = self.sandbox(sid)
        if sb.status == "stopping":
            await sb.stopped.wait()
            return
        # what it died of, while what the backend left still tells, and before requests see it
        # stopping (they are SandboxDied from now on)
        death = self.lifecycle.death_of(sb) if reason == "died" else None
        sb.status = "stopping"
        self.leases.forget(sid)
        if keyed := _create_key_of(sb.rt.spec.labels):
            self._by_create_key.pop(keyed, None)
        if sb.rt.spec.drives and not sb.rt.spec.trajectory:  # its own log, named by its id
            self.trajectories.remove(sid)
        if sb.packing is not None:  # its thread thaws the sandbox; kill after that
            await asyncio.gather(asyncio.shield(sb.packing), return_exceptions=True)
        self.lifecycle.unwatch(sb)
        await self.processes.drop(sid)
        if death is not None:
            self.record_event(death)
        log.info("killing sandbox %s (%s)", sid, reason)
        try:
            t0 = time.perf_counter()
            await sb.backend.stop(sb.rt, sb.backend_state)
            t_stop = time.perf_counter()
            overlay, dirs = await self.rootfs.remove(sb)
            sb.policies.release(sb.rt)
            log.debug(
                "removed %s: backend %.1f ms, overlay %.1f ms, disk and dirs %.1f ms, "
                "total %.1f ms",
                sid,
                1e3 * (t_stop - t0),
                1e3 * overlay,
                1e3 * dirs,
                1e3 * (time.perf_counter() - t0),
            )
            # fully gone: its ids and devices may serve again (if the teardown failed, a
            # process of it may still hold them: they stay taken, as its uid range does)
            self.admission.release(sid, sb.rt.idmap)
        finally:
            self.sandboxes.pop(sid, None)
            sb.status = "dead"
            sb.stopped.set()
            self.queue.room_freed()

    # --- snapshots ------------------------------------------------------------------------
    async def pack_diff(
        self,
        sid: str,
        name: str | None = None,
        version: str | None = None,
        exclude: Sequence[str] = (),
        scrub: bool = True,
        source: str | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> LayerInfo:
        """Pack the running sandbox's writable layer into a ``snapshot`` layer over its layers
        (``LayerSnapshots.pack_diff``)."""
        return await self.layer_snapshots.pack_diff(
            sid, name, version, exclude, scrub, source, secrets
        )

    async def restore(
        self, snapshot: str, n: int = 1, spec: SandboxSpec | None = None
    ) -> list[SandboxInfo]:
        """``n`` new sandboxes from ``snapshot``, all or nothing: a memory snapshot of that name
        (``MemorySnapshots.restore``), else a snapshot layer (``LayerSnapshots.restore``)."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
            raise InvalidSpec(f"n must be an integer in [1, 1024], got {n!r}", field="n")
        if self.memory.exists(snapshot):
            return await self.memory.restore(snapshot, n, spec)
        return await self.layer_snapshots.restore(snapshot, n, spec)

    async def snapshot_memory(self, sid: str, name: str | None = None) -> MemorySnapshot:
        """Save a running sandbox's memory at one instant (``MemorySnapshots.save``)."""
        return await self.memory.save(sid, name)

    def memory_snapshot(self, name: str) -> MemorySnapshot:
        return self.memory.get(name)

    def remove_memory_snapshot(self, name: str) -> None:
        self.memory.remove(name)

    # --- pause, resume, reset -------------------------------------------------------------
    async def pause(self, sid: str, reclaim: bool = False, preempted: bool = False) -> SandboxInfo:
        """Stop every process of a running sandbox where it is (``Pauses.pause``)."""
        return await self.pauses.pause(sid, reclaim, preempted)

    async def resume(self, sid: str) -> SandboxInfo:
        """Let a paused sandbox's processes go on where they were; a no-op if it is not paused."""
        return await self.pauses.resume(sid)

    async def reset(self, sid: str) -> None:
        """Return a running sandbox of a ``Feature.RESET`` backend to how it started."""
        sb = self.sandbox(sid)
        if sb.status != "running":
            raise sb.not_running()
        await sb.backend.reset(sb.rt, sb.backend_state)

    # --- warm pools (``warm.WarmPools``) ---------------------------------------------------
    def warm_status(self) -> WarmStatus:
        """The warm pools: targets, members ready and starting, claims and misses."""
        return self.warm_pools.status()

    def set_warm(self, settings: WarmSettings) -> WarmStatus:
        """Set the API's warm targets and the automatic mode (``WarmPools.configure``)."""
        return self.warm_pools.configure(settings)

    async def start_warm(self, spec: SandboxSpec) -> SandboxInfo:
        """Admit and start a warm member of ``spec`` with a start slot of the queue, only
        while no create waits there (``AdmissionRejected`` otherwise)."""
        if self.queue.waiting or not self.start_slots_spare():
            raise AdmissionRejected("creates are waiting: no warm member now", reason="turn")
        ticket = await self.queue.enter(spec, "", "dsec.warm", 0.0)
        return await self._admit_and_create(spec, None, ticket, warm=True)

    def waiting_creates(self) -> int:
        return len(self.queue.waiting)

    def creates_waiting_for_room(self) -> int:
        q = self.queue
        return len(q.waiting) if q.starting < q.max_starting else 0

    def pending_creates(self) -> tuple[SandboxSpec, ...]:
        return self.queue.pending()

    def start_slots_spare(self) -> bool:
        return 2 * self.queue.starting < self.queue.max_starting

    # --- FnCall pools ---------------------------------------------------------------------
    async def fncall(self, environment: str, cmd: Any = None, **kw: Any) -> FnCallResult:
        """Run one call in a warm member of the environment's pool of ``project`` (a keyword;
        None: the node's shared pools), ``Pools.call``."""
        return await self.pools.call(environment, cmd, **kw)

    async def judge(self, spec: JudgeSpec) -> JudgeResult:
        """Judge one submission in a warm member of its pool (``judge.judge``)."""
        return await judge(self, self.pools, spec)

    async def run_code(self, spec: CodeRun) -> CodeRunResult:
        """Run one SandboxFusion ``/run_code`` request in a warm member of its pool
        (``coderun.run_code``)."""
        return await run_code(self, self.pools, spec)

    # --- inside the sandbox ---------------------------------------------------------------
    # the service's own methods, their parameters and docstrings written once, in Agents
    exec = _Delegated("agents", Agents.exec)
    exec_stream = _Delegated("agents", Agents.exec_stream)

    async def session_open(
        self, sid: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> str:
        return await self.agents.session_open(sid, cwd, env)

    # interactive processes, held by the node between clients (``processes.Processes``)
    process_start = _Delegated("processes", Processes.start)
    processes_of = _Delegated("processes", Processes.list)
    process_get = _Delegated("processes", Processes.get)
    process_output = _Delegated("processes", Processes.output)
    process_input = _Delegated("processes", Processes.send)
    process_resize = _Delegated("processes", Processes.resize)
    process_signal = _Delegated("processes", Processes.signal)

    async def session_exec(
        self,
        sid: str,
        session: str,
        cmd: str,
        *,
        timeout: float | None = None,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
    ) -> ExecResult:
        return await self.agents.agent(sid).session_exec(
            session, cmd, timeout=timeout, stdin=stdin, max_output=max_output
        )

    async def session_close(self, sid: str, session: str) -> None:
        await self.agents.agent(sid).session_close(session)

    async def sessions(self, sid: str) -> list[str]:
        return await self.agents.agent(sid).sessions()

    async def read_file(self, sid: str, path: str, offset: int = 0, length: int = -1) -> bytes:
        return await self.agents.agent(sid).read_file(path, offset, length)

    async def write_file(
        self,
        sid: str,
        path: str,
        data: bytes,
        mode: int = 0o644,
        offset: int = 0,
        truncate: bool = True,
    ) -> None:
        await self.agents.agent(sid).write_file(
            path, data, mode=mode, offset=offset, truncate=truncate
        )

    async def list_dir(self, sid: str, path: str) -> list[FileEntry]:
        return await self.agents.agent(sid).list_dir(path)

    async def stat(self, sid: str, path: str) -> FileEntry:
        return await self.agents.agent(sid).stat(path)

    async def remove(self, sid: str, path: str, recursive: bool = False) -> None:
        await self.agents.agent(sid).remove(path, recursive=recursive)

    # --- the screen (Feature.SCREEN) ------------------------------------------------------
    async def screenshot(self, sid: str) -> bytes:
        """The sandbox's display now, as PNG bytes."""
        return await self.screens.screenshot(sid)

    async def input(self, sid: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send input events to the sandbox's display (``Screens.input``); how many were sent."""
        return await self.screens.input(sid, events)


def _create_key_of(labels: Mapping[str, str]) -> tuple[str, str] | None:
    """(project, create key) of a sandbox's labels, None without a key."""
    key = labels.get(CREATE_KEY_LABEL)
    return (labels.get(PROJECT_LABEL, ""), key) if key else None
