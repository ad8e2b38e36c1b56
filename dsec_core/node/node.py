"""The node: owns every sandbox on this machine, from admission to cleanup, and survives restarts.

A create checks the security policies the sandbox asks for, admits it (the node's ``NodeLoad``
through the placement plugins), resolves its layers, prepares its root filesystem in the form
its backend asks for (mounted layers and an overlay, or the image files and a writable disk),
and asks the backend to start it; each step is undone if a later one fails. Every sandbox's
state is written to ``$DSEC_HOME/run/sandboxes/<id>/state.json`` (a tmpfs) so a restarted
daemon re-adopts what is still running and cleans up what is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import plugins
from ..agent import ensure_agent
from ..agent.rpc import AgentClient
from ..backend import (
    Backend,
    DeviceNode,
    Feature,
    LayerImage,
    RootfsForm,
    SandboxRuntime,
    cgroup_path,
)
from ..catalog.store import CatalogStore
from ..config import NodeConfig
from ..errors import (
    AdmissionRejected,
    BackendUnavailable,
    DsecError,
    FeatureUnavailable,
    InvalidSpec,
    MissingParentLayers,
    PolicyUnavailable,
    SandboxDied,
    SandboxNotRunning,
    SandboxPaused,
    StartTimeout,
    UnknownSandbox,
    UnknownSnapshot,
    UnknownSource,
)
from ..inputs import InputEvent, parse_inputs
from ..layers.store import LayerStore
from ..linux import sysctl
from ..linux.files import write_atomic
from ..linux.hostmem import meminfo, pressure
from ..linux.mounts import ensure_tmpfs, mounted_under, unmount
from ..observe import NodeMetrics
from ..records import (
    DEFAULT_BACKEND,
    PROJECT_LABEL,
    SANDBOX_START_MEMORY,
    ExecResult,
    FileEntry,
    FnCallResult,
    IdMap,
    InfraEvent,
    JudgeResult,
    LayerInfo,
    LayerRef,
    MemorySnapshot,
    NodeLoad,
    PolicyState,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)
from ..security import NODE_SETTINGS, SecurityPolicy
from ..sources.base import LayerSource
from ..sources.chain import find_layer
from .devices import DevicePool
from .disks import WritableDisks
from .drive import DriveServer
from .idpool import UidPool
from .judge import JudgeSpec, judge
from .leases import Leases
from .mounts import MountCache, OverlayStack
from .ondemand import OnDemandLayers
from .pools import POOL_LABEL, Pools
from .snapshots import exclude_paths, pack_upper, recover_packs, scrub_env, secret_needles
from .trajectory import TrajectoryLogs

__all__ = ["Node"]

log = logging.getLogger("dsec.node")

STATE_FILE = "state.json"
#: In a sandbox's runtime dir while a pack_diff may hold it frozen (names its cgroup).
PACK_MARKER = "packing"


#: Seconds a policy's ``check_available`` answer is kept: it runs before every create that
#: names the policy, and what it checks (tools, kernel features) rarely changes.
AVAILABILITY_TTL = 5.0


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

    @property
    def state(self) -> str:
        """What ``info().state`` says: the status, or "paused" for a paused running one."""
        return "paused" if self.paused and self.status == "running" else self.status

    def info(self) -> SandboxInfo:
        spec = self.rt.spec
        return SandboxInfo(
            id=self.rt.id,
            backend=self.backend.name,
            state="paused" if self.paused and self.status == "running" else self.status,
            created=self.created,
            expires=self.expires,
            layers=tuple(layer.ref for layer in self.layers),
            environment=spec.environment,
            limits=self.rt.limits.to_dict(),
            labels=dict(spec.labels),
            pid=self.backend_state.get("pid"),
            policies=self.policies.states(),
            qos=spec.qos,
            devices=tuple(d.host_path for d in self.rt.devices),
            runtime=self.backend_state.get("runtime"),
            vnc=self.backend_state.get("vnc"),
        )

    def state_doc(self) -> dict[str, Any]:
        return {
            "id": self.rt.id,
            "spec": self.rt.spec.to_dict(),
            "backend": self.backend.name,
            "created": self.created,
            "expires": self.expires,
            "status": self.status,
            "paused": self.paused,
            "preempted": self.preempted,
            "events": [e.to_dict() for e in self.events],
            "oom_kills": self.oom_kills,
            "layers": [layer.to_dict() for layer in self.layers],
            "backend_state": self.backend_state,
            "idmap": [self.rt.idmap.host_base, self.rt.idmap.size, self.rt.idmap.group],
            "rootfs": None if self.rt.rootfs is None else os.fspath(self.rt.rootfs),
            "images": [
                [i.ref, i.digest, os.fspath(i.image), i.device and os.fspath(i.device)]
                for i in self.rt.images
            ],
            "disk": None if self.rt.disk is None else os.fspath(self.rt.disk),
            "disk_size": self.rt.disk_size,
            "kernel": self.rt.kernel,
            "devices": [d.to_dict() for d in self.rt.devices],
            "policy_plan": {
                "chosen": {p.name: s for p, s in self.policies.chosen},
                "skipped": self.policies.skipped,
            },
        }


#: A memory snapshot's name (a directory under ``<home>/memory-snapshots``).
_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: How many dead sandboxes' causes of death the node remembers (the most recent).
MAX_DEATHS = 1024
#: How many infrastructure events a sandbox keeps (the most recent).
MAX_EVENTS = 100


def _in_project(label: str | None, project: str, subtree: bool) -> bool:
    """Whether a sandbox labelled with project ``label`` is ``project``'s (or, ``subtree``,
    of a project below it; every project is below the root, ``/``)."""
    if label is None:
        return False
    if label == project or (subtree and project == "/"):
        return True
    return subtree and label.startswith(project + "/")


class Node:
    """Everything one node does; the HTTP API and the tests drive this class."""

    def __init__(self, config: NodeConfig | None = None) -> None:
        self.config = config or NodeConfig.from_env()
        self.registry = plugins.registry()
        cfg = self.config
        self.uids = UidPool(cfg.uid_base, cfg.uid_size, cfg.uid_ranges, cfg.sandbox_gid)
        self.devices = DevicePool()  # the inventory, checked in open()
        self.sandboxes: dict[str, Sandbox] = {}
        #: sandbox id -> (kind, cause) of those that died on their own, the latest MAX_DEATHS
        self.deaths: dict[str, tuple[str, str]] = {}
        self._backends: dict[str, Backend] = {}
        self._tasks: set[asyncio.Task] = set()
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._watch: asyncio.Task | None = None
        self._warming: asyncio.Future | None = None
        self._policies: dict[str, SecurityPolicy] = {}
        # policy name -> (monotonic time checked, why it is unavailable or None)
        self._available: dict[str, tuple[float, PolicyUnavailable | None]] = {}
        self.mounts: MountCache | None = None
        self._mounted_refs: dict[str, str] = {}  # layer digest -> name@version, once mounted
        self.ondemand: OnDemandLayers | None = None
        self.catalogs = CatalogStore(self.config.catalog_dir)
        self.disks = WritableDisks(self.config.disk_dir, self.config.disk_fs)
        self.agent_binary: Path | None = None
        self.layer_sources: list[LayerSource] = []
        self.pools = Pools(self)
        self.leases = Leases(self)
        self.trajectories = TrajectoryLogs(self.config.home / "trajectories")
        self.drive = DriveServer(self, self.config.run_dir / "drive")
        self.metrics = NodeMetrics(
            sandbox_states=self.state_counts, layer_cache=self.layer_cache_counts
        )

    # --- life of the node -----------------------------------------------------------------
    async def open(self) -> None:
        cfg = self.config
        # first: a bad inventory (a missing or non-device path) stops the node before it
        # mounts or starts anything
        self.devices = DevicePool.probe(cfg)
        cfg.ensure_dirs()
        ensure_tmpfs(cfg.run_dir, mode=0o710, gid=cfg.sandbox_gid)
        cfg.on_sandbox_path(cfg.run_dir)  # a tmpfs a daemon before this change mounted 0711
        cfg.runtime_dir.mkdir(exist_ok=True)
        cfg.on_sandbox_path(cfg.runtime_dir)
        self.agent_binary = ensure_agent(cfg.bin_dir)
        for name, (old, new) in sysctl.raise_to(sysctl.NODE_MINIMUMS).items():
            log.info("raised %s from %d to %d for a node of many sandboxes", name, old, new)
        raised = sysctl.raise_nofile(sysctl.NOFILE_MINIMUM)
        if raised:
            log.info("raised the daemon's open-file limit from %d to %d", *raised)
        self.mounts = MountCache(cfg.mount_dir, cfg.layer_linger)
        self.ondemand = OnDemandLayers(cfg, self.registry)
        if self.ondemand.keeper_socket.exists():  # a previous daemon served on-demand layers
            await asyncio.to_thread(self.ondemand.ensure_open)
        self.layer_sources = self.registry.node_sources(cfg)
        await self._adopt()
        await self._drop_pool_members()
        await self.drive.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def close(self, kill_all: bool = False, release_runtime: bool = True) -> None:
        """Stop serving. Sandboxes keep running unless ``kill_all``; with none left and
        ``release_runtime``, the runtime tmpfs goes too (the daemon does that itself, last)."""
        if self._watch:
            self._watch.cancel()
        self.leases.close()
        await self.drive.close()
        await self.pools.close()
        if kill_all:
            await asyncio.gather(
                *(self.kill(sid) for sid in list(self.sandboxes)), return_exceptions=True
            )
        for sb in self.sandboxes.values():
            self._unwatch_exit(sb)
            if sb.ttl_handle:
                sb.ttl_handle.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for be in self._backends.values():
            try:
                await be.close()
            except Exception:  # as for policies: the node still closes
                log.exception("closing backend %s", be.name)
        for policy in self._policies.values():
            try:
                policy.close()
            except Exception:  # one policy's failure must not keep the node from closing
                log.exception("closing security policy %s", policy.name)
        if self.mounts:
            self.mounts.close()
        if self.ondemand and not self.sandboxes:
            self.ondemand.close()  # after the layer mounts that read through it
        if self._warming is not None:
            await self._warming
        self.uids.close()
        if release_runtime:
            self.release_runtime()

    def release_runtime(self, lazy: bool = False) -> None:
        """Unmount the runtime tmpfs if no sandbox needs it any more."""
        if not self.sandboxes and os.path.ismount(self.config.run_dir):
            unmount(self.config.run_dir, lazy=lazy)

    def backend(self, name: str) -> Backend:
        be = self._backends.get(name)
        if be is None:
            cls = self.registry.backend(name)
            cls.check_available()
            be = self._backends[name] = cls(self.config)
        return be

    # --- security policies ----------------------------------------------------------------
    def _policy(self, name: str) -> SecurityPolicy:
        """The node's instance of policy ``name`` (``UnknownPolicy``); whether this host can
        run it is ``_enforceable``'s question."""
        policy = self._policies.get(name)
        if policy is None:
            policy = self._policies[name] = self.registry.security_policy(name)()
        return policy

    def policies_for(self, spec: SandboxSpec, backend: Backend) -> PolicyPlan:
        """The policies for a sandbox of ``spec`` on ``backend``: those it asks for and the
        ``default`` ones, each checked to be enforceable there; ``spec.network`` must be
        enforced by the backend ("none") or by one of them. Raises before anything is set up:
        ``UnknownPolicy``, ``InvalidSpec`` (settings) or ``PolicyUnavailable`` (unless the
        policy is a default or ``best_effort``: then it is skipped, with the reason)."""
        plan = PolicyPlan()
        requested = {n: dict(s) for n, s in spec.policies.items()}
        defaults = {n for n, c in self.registry.security_policies.items() if c.default}
        for name in sorted(defaults - set(requested)):
            requested[name] = {}
        for name, raw in requested.items():
            settings = {k: v for k, v in raw.items() if k not in NODE_SETTINGS}
            if raw.get("enabled", True) is False:
                plan.skipped[name] = "off: the sandbox's spec turned it off"
                continue
            policy = self._policy(name)
            try:
                # Settings first: bad ones are the caller's mistake on any host, best effort
                # or not (InvalidSpec); a validate that finds the host lacking what these
                # settings need raises PolicyUnavailable like the checks after it.
                policy.validate(settings)
                self._enforceable(policy, backend)
            except PolicyUnavailable as e:
                if name in spec.policies and not raw.get("best_effort", False):
                    raise
                plan.skipped[name] = f"skipped: {e}"
                continue
            plan.chosen.append((policy, settings))
        self._check_network(spec, backend, plan)
        return plan

    def _enforceable(self, policy: SecurityPolicy, backend: Backend) -> None:
        """``PolicyUnavailable`` unless this host can run ``policy`` on ``backend``."""
        name = policy.name
        checked, why = self._available.get(name, (-AVAILABILITY_TTL, None))
        now = time.monotonic()
        if now - checked >= AVAILABILITY_TTL:
            try:
                policy.check_available()
                why = None
            except PolicyUnavailable as e:
                why = e
            self._available[name] = (now, why)
        if why is not None:
            raise why.with_traceback(None)
        if not policy.enforceable_on(type(backend)):
            raise PolicyUnavailable(
                f"security policy {name!r} cannot be enforced on backend {backend.name!r}: "
                f"it works through {sorted(policy.targets) or 'nothing'}, the backend "
                f"offers {sorted(backend.policy_targets) or 'nothing'}",
                policy=name,
                backend=backend.name,
            )

    def _check_network(self, spec: SandboxSpec, backend: Backend, plan: PolicyPlan) -> None:
        if spec.network == "none":
            if Feature.NET_NAMESPACE not in backend.features:
                raise PolicyUnavailable(
                    f"backend {backend.name!r} does not isolate the network, so network='none' "
                    "(loopback only) cannot be enforced",
                    policy="network",
                    backend=backend.name,
                )
        elif not any(spec.network in p.network_modes for p, _ in plan.chosen):
            able = sorted(
                n
                for n, c in self.registry.security_policies.items()
                if spec.network in c.network_modes
            )
            raise PolicyUnavailable(
                f"network mode {spec.network!r} needs a security policy that enforces it in the "
                f"sandbox's policies ({', '.join(able) or 'no loaded policy does'})",
                policy="network",
                backend=backend.name,
                network=spec.network,
                able=able,
            )

    def _enforcer(self, sid: str) -> Callable[[str, Any], None]:
        """``SandboxRuntime.enforce`` of sandbox ``sid``: apply its policies at a target."""

        def enforce(target: str, subject: Any) -> None:
            sb = self._get(sid)
            for policy, settings in sb.policies.chosen:
                if target in policy.targets:
                    policy.apply(target, sb.rt, settings, subject)

        return enforce

    # --- layers ---------------------------------------------------------------------------
    def resolve_layers(self, refs: Sequence[str]) -> list[tuple[LayerSource, LayerInfo]]:
        """(source, layer) for each ``name@version``, from the first source that has it."""
        return [find_layer(self.layer_sources, text) for text in refs]

    # --- create ---------------------------------------------------------------------------
    def load(self) -> NodeLoad:
        """This node as placement sees it: capacity and what live sandboxes reserve."""
        live = [s for s in self.sandboxes.values() if s.status in ("creating", "running")]
        creating = sum(1 for s in live if s.status == "creating")
        cfg = self.config
        mem = meminfo("MemTotal", "MemAvailable")
        return NodeLoad(
            node=cfg.node_name or os.fspath(cfg.home),
            labels=cfg.node_labels,
            backends=tuple(sorted(self.registry.backends)),
            cpu_capacity=cfg.cpu_capacity,
            # best-effort sandboxes take only idle CPU, paused ones none at all
            cpu_committed=sum(
                s.rt.limits.cpu for s in live if s.rt.spec.qos != "be" and not s.paused
            ),
            memory_capacity=cfg.memory_capacity,
            memory_committed=sum(s.rt.limits.memory + s.backend.memory_overhead for s in live),
            sandboxes=len(live),
            max_sandboxes=cfg.max_sandboxes,
            memory_total=mem.get("MemTotal", 0),
            memory_available=(
                max(0, mem["MemAvailable"] - creating * SANDBOX_START_MEMORY)
                if "MemAvailable" in mem
                else None
            ),
            memory_reserve=cfg.memory_reserve,
            memory_pressure=pressure("memory").get("some_avg10", 0.0),
            memory_pressure_limit=cfg.memory_pressure_limit,
            devices=self.devices.usage(),
        )

    def warm(self) -> tuple[list[str], list[str]]:
        """What a create here would find mounted: the layers (``name@version``) that live
        sandboxes use or that linger after their last user, and the environments all of whose
        layers are among them (placement prefers such a node)."""
        live = [s for s in self.sandboxes.values() if s.status in ("creating", "running")]
        held = self.mounts.refcounts() if self.mounts else {}
        layers = {info.ref for sb in live for info in sb.layers}
        layers |= {ref for digest, ref in self._mounted_refs.items() if digest in held}
        environments = []
        with contextlib.suppress(DsecError):  # a broken catalog leaves the answer without
            for env in self.catalogs.environments():
                refs = env.layer_refs()
                if refs and all(r in layers for r in refs):
                    # a create may name it either way (placement compares the text)
                    environments += [env.name, env.qualified]
        return sorted(layers), sorted(environments)

    def project_usage(self) -> dict[str, tuple[int, float, int]]:
        """Live sandboxes by project (``PROJECT_LABEL``): how many, and their CPU and memory
        limits summed (with what their backend takes beyond the limit: a VM's emulator)."""
        out: dict[str, tuple[int, float, int]] = {}
        for sb in self.sandboxes.values():
            project = sb.rt.spec.labels.get(PROJECT_LABEL)
            if project is None or sb.status not in ("creating", "running"):
                continue
            n, cpu, memory = out.get(project, (0, 0.0, 0))
            charged = sb.rt.limits.memory + sb.backend.memory_overhead
            out[project] = (n + 1, cpu + sb.rt.limits.cpu, memory + charged)
        return out

    async def set_ttl(self, sid: str, ttl: float | None) -> SandboxInfo:
        """Give a running sandbox ``ttl`` more seconds from now (None: until killed)."""
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        if ttl is not None and not 0 < ttl < float("inf"):
            raise InvalidSpec(f"ttl must be a positive number of seconds, got {ttl}", field="ttl")
        if sb.ttl_handle:
            sb.ttl_handle.cancel()
            sb.ttl_handle = None
        sb.expires = None if ttl is None else time.time() + ttl
        if sb.expires is not None:
            self._arm_ttl(sb)
        self._write_state(sb)
        return sb.info()

    def new_sandbox_id(self) -> str:
        """A fresh sandbox id: 12 hex digits, then ``-<node name>`` on a named node (an
        apiserver routes the id to its node by that suffix)."""
        sid = secrets.token_hex(6)
        return f"{sid}-{self.config.node_name}" if self.config.node_name else sid

    def _admit(self, spec: SandboxSpec) -> None:
        """Local admission: this node is the one eligible node if ``spec`` fits, and the
        placement plugins must take it (the control plane asks the same plugins across many)."""
        load = self.load()
        refusal = load.refusal(spec)
        if refusal is not None:
            raise refusal
        if plugins.place(spec, [load]) is None:
            raise AdmissionRejected(
                f"placement declined node {load.node}", reason="placement", node=load.node
            )

    def resolve_spec(self, spec: SandboxSpec) -> tuple[SandboxSpec, str | None]:
        """``spec`` with its environment applied (the environment's env under the spec's, its
        workdir unless the spec names one, its backend unless the spec names one, else
        ``DEFAULT_BACKEND``), and the kernel the environment asks a VM backend to boot."""
        if not spec.environment:
            return replace(spec, backend=spec.backend or DEFAULT_BACKEND), None
        environment = self.catalogs.environment(spec.environment)
        return replace(
            spec,
            env={**dict(environment.env or {}), **spec.env},
            workdir=spec.workdir if spec.workdir != "/" else (environment.workdir or "/"),
            backend=spec.backend or environment.backend or DEFAULT_BACKEND,
        ), environment.kernel

    async def create(self, spec: SandboxSpec, saved: Path | None = None) -> SandboxInfo:
        """Create a sandbox (``saved``: from a memory snapshot's directory, ``restore``); its
        time goes into ``metrics`` (``dsec_create_seconds``) whether it succeeds or fails."""
        t0 = time.perf_counter()
        try:
            info = await self._admit_and_create(spec, saved)
        except BaseException:
            self.metrics.observe_create(self._backend_label(spec), False, time.perf_counter() - t0)
            raise
        self.metrics.observe_create(info.backend, True, time.perf_counter() - t0)
        return info

    def _backend_label(self, spec: SandboxSpec) -> str:
        """The backend a failed create would have used, for its metric ("unknown" if even
        that failed)."""
        try:
            return self.resolve_spec(spec)[0].backend or "unknown"
        except DsecError:
            return "unknown"

    def state_counts(self) -> dict[str, int]:
        """How many sandboxes are in each state (``Sandbox.state``), for ``dsec_sandboxes``."""
        counts: dict[str, int] = {}
        for sb in self.sandboxes.values():
            counts[sb.state] = counts.get(sb.state, 0) + 1
        return counts

    def layer_cache_counts(self) -> dict[str, int]:
        """The layer mount cache's hits and misses since the node opened."""
        if self.mounts is None:
            return {}
        return {"hit": self.mounts.hits, "miss": self.mounts.misses}

    async def _admit_and_create(self, spec: SandboxSpec, saved: Path | None) -> SandboxInfo:
        t0 = time.perf_counter()
        spec, kernel = self.resolve_spec(spec)
        assert spec.backend is not None  # resolve_spec names one
        backend = self.backend(spec.backend)
        if backend.shares_host_kernel():
            # a create that named a container backend over a VM environment: the environment's
            # kernel means nothing there
            kernel = None
        if spec.runtime is not None and spec.runtime not in backend.runtimes:
            known = ", ".join(sorted(backend.runtimes)) or "none: it takes no runtime"
            raise InvalidSpec(
                f"backend {backend.name!r} has no runtime {spec.runtime!r} (its runtimes: {known})",
                field="runtime",
                backend=backend.name,
            )
        if spec.devices and Feature.DEVICES not in backend.features:
            raise BackendUnavailable(
                f"backend {backend.name!r} cannot pass devices into a sandbox (it does not "
                f"claim Feature.DEVICES); the spec asks for {', '.join(map(str, spec.devices))}",
                backend=backend.name,
            )
        if spec.drives:
            self._check_drives(spec, backend)
        plan = self.policies_for(spec, backend)
        self.devices.check(spec.devices)  # before the load's counts: this names the holders
        self._admit(spec)
        sid = self.new_sandbox_id()
        idmap = self.uids.allocate()
        try:
            devices = self.devices.allocate(sid, spec.devices)
        except BaseException:
            self.uids.release(idmap)
            raise
        try:
            return await self._create(sid, spec, kernel, backend, plan, idmap, devices, t0, saved)
        except BaseException:
            # nothing of the sandbox is left (_create undid it all)
            self.uids.release(idmap)
            self.devices.release(sid)
            raise

    async def _create(
        self,
        sid: str,
        spec: SandboxSpec,
        kernel: str | None,
        backend: Backend,
        plan: PolicyPlan,
        idmap: IdMap,
        devices: tuple[DeviceNode, ...],
        t0: float,
        saved: Path | None = None,
    ) -> SandboxInfo:
        self._warm_uids()
        refs = list(spec.layers)  # explicit layers go on top of the environment's
        if spec.environment:
            refs += self.catalogs.environment(spec.environment).layer_refs()
        sources = self.resolve_layers(refs)
        layers = [info for _, info in sources]
        rt = replace(self._runtime(sid, spec, backend, idmap), devices=devices, kernel=kernel)
        rt.dir.mkdir(mode=0o700)
        self.config.on_sandbox_path(rt.dir)  # runc's init passes it to reach rootfs/
        now = time.time()
        sb = Sandbox(
            rt=rt,
            backend=backend,
            layers=layers,
            created=now,
            expires=now + spec.ttl if spec.ttl else None,
            policies=plan,
        )
        self.sandboxes[sid] = sb  # counted by admission from here on
        taken: list[str] = []
        t_prep = time.perf_counter()
        try:
            self._write_state(sb)  # first, so a crash from here on leaves a trace to clean
            sb.rt = rt = await self._prepare_rootfs(rt, backend, sources, taken)
            t_layers = time.perf_counter()
            sb.backend_state = await (
                backend.start(rt) if saved is None else backend.start_from(rt, saved)
            )
            t_start = time.perf_counter()
            if spec.start_timeout is not None and t_start - t0 > spec.start_timeout:
                await backend.stop(rt, sb.backend_state)  # the undo below takes the rest
                raise StartTimeout(
                    f"sandbox {sid} took {t_start - t0:.2f}s to start, over its start_timeout "
                    f"of {spec.start_timeout:g}s: killed",
                    sandbox_id=sid,
                    seconds=round(t_start - t0, 3),
                    start_timeout=spec.start_timeout,
                )
            sb.status = "running"
            if spec.ttl:  # a sandbox's life counts from when it runs (a VM boots for seconds)
                sb.expires = time.time() + spec.ttl
            self._write_state(sb)
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
            await asyncio.shield(self._undo_create(taken, rt, plan))
            raise
        if sb.expires:
            self._arm_ttl(sb)
        self._watch_exit(sb)
        return sb.info()

    def _check_drives(self, spec: SandboxSpec, backend: Backend) -> None:
        """A sandbox that drives others: its backend passes the drive socket in, and each
        sandbox it names runs on this node."""
        if Feature.DRIVE not in backend.features:
            raise BackendUnavailable(
                f"backend {backend.name!r} cannot pass the drive socket in (it does not claim "
                "Feature.DRIVE): its sandboxes cannot drive others",
                backend=backend.name,
            )
        for sid in spec.drives:
            sb = self.sandboxes.get(sid)
            if sb is None or sb.status not in ("running", "creating"):
                raise UnknownSandbox(
                    f"drives names sandbox {sid!r}, which does not run on this node",
                    sandbox_id=sid,
                )

    def record_event(self, event: InfraEvent) -> None:
        """Note an infrastructure failure that struck a sandbox (``events``)."""
        sb = self.sandboxes.get(event.sandbox_id)
        log.warning("sandbox %s: %s: %s", event.sandbox_id, event.kind, event.detail)
        if sb is not None:
            sb.events.append(event)
            del sb.events[:-MAX_EVENTS]  # the most recent ones
            self._write_state(sb)

    def events(self, sid: str) -> list[InfraEvent]:
        """The infrastructure failures that struck sandbox ``sid``, oldest first."""
        return list(self._get(sid).events)

    def _warm_uids(self) -> None:
        """Make the next uid range's user namespace in the background (2 ms of a create
        otherwise)."""
        if self._warming is None or self._warming.done():
            self._warming = asyncio.ensure_future(asyncio.to_thread(self._warm))

    def _warm(self) -> None:
        try:
            self.uids.warm()
        except DsecError as e:  # the create that needs it will make it, and say what fails
            log.warning("making the next uid range's user namespace: %s", e)

    def _runtime(
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
            enforce=self._enforcer(sid),
            targets=backend.policy_targets,
            drive_dir=self.drive.directory if spec.drives else None,
        )

    async def _prepare_rootfs(
        self,
        rt: SandboxRuntime,
        backend: Backend,
        sources: list[tuple[LayerSource, LayerInfo]],
        taken: list[str],
    ) -> SandboxRuntime:
        """What the backend asks for: mounted layers under an overlay (``COMPOSED``; each
        layer mount taken is appended to ``taken``), or the image files and a writable disk
        (``IMAGES``: nothing is mounted)."""
        files = [await self._layer_files(source, info) for source, info in sources]
        size = self.disks.size_of(rt.limits.disk)
        if backend.rootfs is RootfsForm.IMAGES:  # the disk's size is its quota
            images = tuple(
                LayerImage(info.ref, info.digest, image, device)
                for (_, info), (image, device) in zip(sources, files, strict=True)
            )
            disk = _sparse_disk(rt.data_dir, size)
            return replace(rt, images=images, disk=disk, disk_size=size)
        if not self.disks.ready(size):  # mkfs once per size, off the event loop
            await self._once(("disk-template", str(size)), self.disks.template, size)
        # Inline, as the mounts are (a few ms): in a thread, a cancelled create could undo
        # itself before the thread had mounted what it then leaves behind.
        self.disks.mount(rt.id, size, rt.data_dir)
        assert self.mounts is not None
        mounts = []
        for (_, info), (image, device) in zip(sources, files, strict=True):
            mounts.append(self.mounts.acquire(info.digest, image, device))
            taken.append(info.digest)
            self._mounted_refs[info.digest] = info.ref
        rootfs = rt.dir / "rootfs"
        userns = self.uids.namespace(rt.idmap)
        try:
            OverlayStack(rt.data_dir, rootfs).mount(
                mounts, owner=(rt.idmap.host_base, rt.idmap.root_gid), userns=userns
            )
        finally:
            userns.close()  # the overlay's layer clones hold the namespace
        return replace(rt, rootfs=rootfs)

    async def _layer_files(self, source: LayerSource, info: LayerInfo) -> tuple[Path, Path | None]:
        """What to mount for a layer: (image, None) for a whole image, or (metadata image,
        data blob) to load it on demand."""
        if source.local:
            return source.image_path(info), None
        if self.config.ondemand:
            assert self.ondemand is not None
            prepared = await self._once(("lazy", info.digest), self.ondemand.prepare, source, info)
            if prepared is not None:
                return prepared
        return await self._once(("image", info.digest), source.image_path, info), None

    async def _once(self, key: tuple[str, str], fn, *args):
        """Run blocking ``fn(*args)`` in a thread, once for all concurrent callers with the same
        ``key``: a burst of sandboxes of one image fetches it once."""
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            self._inflight[key] = fut
            fut.add_done_callback(lambda _f: self._inflight.pop(key, None))
        return await asyncio.shield(fut)

    async def prefetch(self, refs: Sequence[str]) -> list[dict[str, Any]]:
        """Warm layers on this node: every chunk of on-demand layers, whole remote images."""
        out = []
        for source, info in self.resolve_layers(refs):
            if source.local:
                out.append({"layer": info.ref, "source": source.url, "fetched": 0, "mode": "local"})
                continue
            image, device = await self._layer_files(source, info)
            form = source.lazy_form(info) if device is not None else None
            if form is None:
                out.append(
                    {"layer": info.ref, "source": source.url, "mode": "whole", "fetched": info.size}
                )
                continue
            assert self.ondemand is not None
            n = await asyncio.to_thread(self.ondemand.prefetch, form.index.blob_digest)
            out.append(
                {
                    "layer": info.ref,
                    "source": source.url,
                    "mode": "on-demand",
                    "fetched": n,
                    "chunks": len(form.index.chunks),
                }
            )
        return out

    async def _undo_create(
        self,
        taken: list[str],
        rt: SandboxRuntime,
        plan: PolicyPlan,
    ) -> None:
        try:
            OverlayStack(rt.data_dir, rt.dir / "rootfs").unmount()  # no-op if never mounted
        finally:
            assert self.mounts is not None
            for digest in taken:
                self.mounts.release(digest)
            await asyncio.to_thread(self._remove_dirs, rt)
            for policy, _ in plan.chosen:
                policy.released(rt)

    def _remove_dirs(self, rt: SandboxRuntime) -> None:
        """Blocking, so called in a thread: unmounting the writable layer's filesystem writes
        back what the sandbox wrote in the last seconds (up to its memory's dirty share)."""
        self.disks.remove(rt.id, rt.data_dir)
        shutil.rmtree(rt.dir, ignore_errors=True)

    async def create_many_settled(
        self, spec: SandboxSpec, n: int, saved: Path | None = None
    ) -> list[SandboxInfo | DsecError]:
        """Create ``n`` sandboxes concurrently; each slot holds its sandbox or its typed error."""
        results = await asyncio.gather(
            *(self.create(spec, saved) for _ in range(n)), return_exceptions=True
        )
        out: list[SandboxInfo | DsecError] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, DsecError):
                raise r
            out.append(r)
        return out

    def _arm_ttl(self, sb: Sandbox) -> None:
        loop = asyncio.get_running_loop()
        delay = max(0.0, (sb.expires or 0) - time.time())
        sid = sb.rt.id
        sb.ttl_handle = loop.call_later(delay, lambda: self._spawn(self.kill(sid, reason="ttl")))

    def _watch_exit(self, sb: Sandbox) -> None:
        """Have the loop notice when the sandbox stops on its own, if its backend can say so
        through a descriptor; the watch loop polls the others."""
        fd = sb.backend.exit_fd(sb.rt, sb.backend_state)
        if fd is None:
            return
        sb.exit_fd = fd
        sid = sb.rt.id

        def exited() -> None:
            self._unwatch_exit(sb)
            if self.sandboxes.get(sid) is sb and sb.status == "running":
                log.warning("sandbox %s died on its own; cleaning up", sid)
                self._spawn(self.kill(sid, reason="died"))

        asyncio.get_running_loop().add_reader(fd, exited)

    def _unwatch_exit(self, sb: Sandbox) -> None:
        fd, sb.exit_fd = sb.exit_fd, None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- lookup ---------------------------------------------------------------------------
    def _get(self, sid: str) -> Sandbox:
        sb = self.sandboxes.get(sid)
        if sb is None and sid in self.deaths:
            kind, cause = self.deaths[sid]
            raise SandboxDied(
                f"sandbox {sid} died on its own ({kind}): {cause}",
                sandbox_id=sid,
                kind=kind,
                cause=cause,
            )
        if sb is None:
            # the others are not listed: an id is all it takes to drive a sandbox
            raise UnknownSandbox(f"no sandbox {sid!r} on this node", name=sid)
        return sb

    def get(self, sid: str) -> SandboxInfo:
        return self._get(sid).info()

    def list_sandboxes(
        self, project: str | None = None, subtree: bool = False
    ) -> list[SandboxInfo]:
        """Every sandbox, oldest first; or those labelled with ``project`` (and, ``subtree``,
        with a project below it)."""
        sandboxes = sorted(self.sandboxes.values(), key=lambda s: s.created)
        if project is not None:
            sandboxes = [
                s
                for s in sandboxes
                if _in_project(s.rt.spec.labels.get(PROJECT_LABEL), project, subtree)
            ]
        return [sb.info() for sb in sandboxes]

    def usage(self, sid: str) -> SandboxUsage:
        sb = self._get(sid)
        return sb.backend.usage(sb.rt, sb.backend_state)

    def policy_states(self, sid: str) -> list[PolicyState]:
        """Every policy considered for the sandbox: in force (with its settings and what it
        saw so far) or not (with the reason)."""
        sb = self._get(sid)
        out = [
            PolicyState(name=p.name, state="enforced", settings=dict(s), stats=dict(p.stats(sb.rt)))
            for p, s in sb.policies.chosen
        ]
        out += [PolicyState(name=n, state=r) for n, r in sb.policies.skipped.items()]
        return sorted(out, key=lambda p: p.name)

    def set_policy(self, sid: str, name: str, settings: Mapping[str, Any]) -> PolicyState:
        """Change the settings of a ``live`` policy in force on a running sandbox."""
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        found = sb.policies.find(name)
        if found is None:
            raise PolicyUnavailable(
                f"security policy {name!r} is not in force on sandbox {sid} (in force: "
                f"{', '.join(p.name for p, _ in sb.policies.chosen) or 'none'})",
                policy=name,
                sandbox_id=sid,
            )
        policy, _ = found
        if not policy.live:
            raise PolicyUnavailable(
                f"security policy {name!r} cannot change on a running sandbox",
                policy=name,
                sandbox_id=sid,
            )
        new = {k: v for k, v in settings.items() if k not in NODE_SETTINGS}
        policy.validate(new)
        policy.update(sb.rt, new)
        sb.policies.chosen = [(p, new if p is policy else s) for p, s in sb.policies.chosen]
        self._write_state(sb)
        return PolicyState(
            name=name, state="enforced", settings=new, stats=dict(policy.stats(sb.rt))
        )

    # --- kill -----------------------------------------------------------------------------
    async def kill(self, sid: str, reason: str = "request") -> None:
        sb = self._get(sid)
        if sb.status == "stopping":
            await sb.stopped.wait()
            return
        sb.status = "stopping"
        self.leases.forget(sid)
        if sb.rt.spec.drives and not sb.rt.spec.trajectory:  # its own log, named by its id
            self.trajectories.remove(sid)
        if sb.packing is not None:  # its thread thaws the sandbox; kill after that
            await asyncio.gather(asyncio.shield(sb.packing), return_exceptions=True)
        self._unwatch_exit(sb)
        if sb.ttl_handle:
            sb.ttl_handle.cancel()
        if reason == "died":  # what it died of, while what the backend left still tells
            try:
                said = sb.backend.death_cause(sb.rt, sb.backend_state)
            except Exception:  # a cause is a courtesy; the cleanup must go on
                log.exception("sandbox %s: asking its backend why it died", sid)
                said = None
            kind, cause = said or ("crashed", "its init or runtime stopped")
            self.deaths[sid] = (kind, cause)
            while len(self.deaths) > MAX_DEATHS:
                self.deaths.pop(next(iter(self.deaths)))
            self.record_event(InfraEvent("crashed", sid, time.time(), f"{kind}: {cause}"))
        log.info("killing sandbox %s (%s)", sid, reason)
        try:
            await self._teardown(sb)
            # fully gone: its ids and devices may serve again (if the teardown failed, a
            # process of it may still hold them: they stay taken, as its uid range does)
            self.uids.release(sb.rt.idmap)
            self.devices.release(sid)
        finally:
            self.sandboxes.pop(sid, None)
            sb.status = "dead"
            sb.stopped.set()

    async def _teardown(self, sb: Sandbox) -> None:
        """Stop the backend, unmount, release layers, delete the sandbox directory."""
        t0 = time.perf_counter()
        await sb.backend.stop(sb.rt, sb.backend_state)
        t_stop = time.perf_counter()
        if sb.rt.rootfs is not None:
            OverlayStack(sb.rt.data_dir, sb.rt.rootfs).unmount()
            assert self.mounts is not None
            for info in sb.layers:
                self.mounts.release(info.digest)
        t_unmount = time.perf_counter()
        await asyncio.to_thread(self._remove_dirs, sb.rt)
        t_dirs = time.perf_counter()
        for policy, _ in sb.policies.chosen:
            policy.released(sb.rt)
        log.debug(
            "removed %s: backend %.1f ms, overlay %.1f ms, disk and dirs %.1f ms, total %.1f ms",
            sb.rt.id,
            1e3 * (t_stop - t0),
            1e3 * (t_unmount - t_stop),
            1e3 * (t_dirs - t_unmount),
            1e3 * (time.perf_counter() - t0),
        )

    # --- snapshots (pack_diff) ------------------------------------------------------------
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
        """Pack the running sandbox's writable layer into a ``snapshot`` layer of the node's
        store over the sandbox's layers (``node.snapshots``): ``name`` (default
        ``snapshot-<id>``), ``version`` (default: its digest's first 12 hex digits). Paths in
        ``exclude``, and with ``scrub`` the usual scratch (``SCRUBBED``: /tmp, caches, shell
        histories, credentials), are left out: a restored sandbox sees the layers below for
        them, and the environment it records leaves out mirrors, proxies and credentials
        (``SCRUBBED_ENV``). The sandbox is frozen while the layer is read. ``secrets``
        (label -> text): the packed layer and the environment it records are scanned for each
        (``snapshots.scan_image``); a hit keeps no layer and raises ``LeakFound`` naming the
        paths and labels. ``SandboxNotRunning`` if it is not running. ``source``: the URL of
        one of the node's layer sources to push the snapshot to, after those of its parents
        it lacks, so other nodes of that source can restore it."""
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(
                f"sandbox {sid} is {sb.status}: only a running sandbox can be packed",
                sandbox_id=sid,
            )
        if sb.rt.rootfs is None:
            raise BackendUnavailable(
                f"backend {sb.backend.name!r} keeps its writable layer in a disk image; "
                "pack_diff packs overlay upper layers only",
                backend=sb.backend.name,
            )
        if sb.packing is not None:
            raise InvalidSpec(f"sandbox {sid} is being packed already", sandbox_id=sid)
        needles = secret_needles(secrets or {})
        paths = exclude_paths(exclude, scrub)
        env = scrub_env(sb.rt.spec.env) if scrub else dict(sb.rt.spec.env)
        target = None if source is None else self._source(source)
        parents = list(sb.layers)
        t0 = time.perf_counter()
        sb.packing = asyncio.ensure_future(
            asyncio.to_thread(
                pack_upper,
                sb.rt.data_dir / "upper",
                sb.rt.idmap,
                cgroup_path(sid),
                LayerStore(self.config.layer_dir),
                name=name or f"snapshot-{sid}",
                version=version,
                parents=parents,
                exclude=paths,
                source=f"pack_diff of sandbox {sid}",
                env=[f"{k}={v}" for k, v in sorted(env.items())],
                workdir=sb.rt.spec.workdir,
                marker=sb.rt.dir / PACK_MARKER,
                paused=sb.paused,
                needles=needles,
            )
        )
        sb.packing.add_done_callback(lambda _f: setattr(sb, "packing", None))
        info, frozen = await asyncio.shield(sb.packing)
        log.info(
            "packed sandbox %s as %s: %d bytes, %.1f ms (frozen %.1f ms)",
            sid,
            info.ref,
            info.size,
            1e3 * (time.perf_counter() - t0),
            1e3 * frozen,
        )
        if target is not None:
            await asyncio.to_thread(self._push_layers, target, [*reversed(parents), info])
        return info

    def _source(self, url: str) -> LayerSource:
        """The node's layer source at ``url``; ``UnknownSource`` naming them if none is."""
        for source in self.layer_sources:
            if url == source.url:
                return source
        raise UnknownSource(
            f"{url!r} is none of this node's layer sources "
            f"({', '.join(s.url for s in self.layer_sources)})",
            name=url,
            known=[s.url for s in self.layer_sources],
        )

    def _push_layers(self, target: LayerSource, layers: Sequence[LayerInfo]) -> None:
        """Push each of ``layers`` (in order: parents before the snapshot over them) that
        ``target`` does not hold yet with the same digest. Blocking."""
        for info in layers:
            there = target.resolve(LayerRef.parse(info.ref))
            if there is not None and there.digest == info.digest:
                continue
            origin, _ = find_layer(self.layer_sources, info.ref)
            target.push(info, origin.image_path(info))

    def checked_snapshot(self, snapshot: str) -> LayerInfo:
        """The snapshot layer ``snapshot``, once its parents are checked: a restored sandbox
        stacks it over them. ``MissingParentLayers`` naming each parent no source has (or has
        with other content), ``InvalidSpec`` if the layer is not a snapshot."""
        _, info = find_layer(self.layer_sources, snapshot)
        if info.kind != "snapshot":
            raise InvalidSpec(
                f"layer {info.ref} is a {info.kind} layer, not a snapshot", field="snapshot"
            )
        if not info.parents:  # a copy that lost them (made by a tool that predates snapshots)
            raise InvalidSpec(
                f"snapshot {info.ref} records no parent layers: it cannot be restored",
                field="snapshot",
            )
        missing = []
        for ref, digest in zip(info.parents, info.parent_digests, strict=True):
            try:
                _, found = find_layer(self.layer_sources, ref)
            except DsecError:
                found = None
            if found is None or found.digest != digest:
                missing.append((ref, digest))
        if missing:
            raise MissingParentLayers(
                f"snapshot {info.ref}: parent layer(s) missing: "
                + ", ".join(f"{ref} ({digest})" for ref, digest in missing),
                name=info.ref,
                missing=[f"{ref} {digest}" for ref, digest in missing],
                digests=[digest for _, digest in missing],
            )
        return info

    async def restore(
        self, snapshot: str, n: int = 1, spec: SandboxSpec | None = None
    ) -> list[SandboxInfo]:
        """``n`` new sandboxes that each start from ``snapshot``'s state, each with its own
        writable layer over the same shared layer mounts. ``spec`` gives the rest (limits,
        labels; its layers and environment are replaced); the snapshot's env and workdir
        apply under the spec's own. All or nothing: if one create fails, those made are
        killed and its error raised."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
            raise InvalidSpec(f"n must be an integer in [1, 1024], got {n!r}", field="n")
        if self._memory_snapshot_dir(snapshot, must_exist=False).is_dir():
            return await self._restore_memory(snapshot, n, spec)
        info = self.checked_snapshot(snapshot)
        fields = spec.to_dict() if spec is not None else {}
        saved_env = dict(item.partition("=")[::2] for item in info.env)
        workdir = fields.get("workdir", "/")
        if workdir == "/":  # the spec's default: the snapshot's (as for an environment's)
            workdir = info.workdir or "/"
        spec = SandboxSpec(
            **{
                **fields,
                "environment": None,
                "layers": (info.ref, *info.parents),
                "env": {**saved_env, **fields.get("env", {})},
                "workdir": workdir,
            }
        )
        results = await self.create_many_settled(spec, n)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if not isinstance(r, SandboxInfo)]
        if failed:
            await asyncio.gather(*(self.kill(i.id) for i in made), return_exceptions=True)
            raise failed[0]
        return made

    # --- memory snapshots (VM forks) -------------------------------------------------------
    def _memory_snapshot_dir(self, name: str, must_exist: bool = True) -> Path:
        if not isinstance(name, str) or not _SNAPSHOT_NAME.fullmatch(name):
            if not must_exist:  # not a memory snapshot's name: maybe a layer's
                return self.config.home / "memory-snapshots" / ".none"
            raise InvalidSpec(
                f"memory snapshot name {name!r}: 1-64 of letters, digits, '.', '_', '-'",
                field="name",
            )
        d = self.config.home / "memory-snapshots" / name
        if must_exist and not (d / "meta.json").is_file():
            raise UnknownSnapshot(f"no memory snapshot {name!r} on this node", name=name)
        return d

    async def snapshot_memory(self, sid: str, name: str | None = None) -> MemorySnapshot:
        """Save a running sandbox's memory, devices and writable disk at one instant
        (``Feature.MEMORY_SNAPSHOT``: VM backends); it runs on. ``restore(name, n)`` then
        starts n sandboxes from that instant."""
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        if sb.paused:
            raise SandboxPaused(f"sandbox {sid} is paused; resume it first", sandbox_id=sid)
        if Feature.MEMORY_SNAPSHOT not in sb.backend.features:
            raise FeatureUnavailable(
                f"backend {sb.backend.name!r} cannot save a sandbox's memory (only VM "
                "backends can; pack_diff saves any sandbox's files)",
                backend=sb.backend.name,
                feature=Feature.MEMORY_SNAPSHOT.value,
            )
        name = name or f"{sid}-{int(time.time())}"
        d = self._memory_snapshot_dir(name, must_exist=False)
        if d.exists():
            raise InvalidSpec(f"memory snapshot {name!r} exists already", field="name")
        d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._unwatch_exit(sb)  # the guest stops for the save: not a death
        try:
            await sb.backend.save(sb.rt, sb.backend_state, d)
        except FileExistsError:
            raise InvalidSpec(f"memory snapshot {name!r} exists already", field="name") from None
        finally:
            self._watch_exit(sb)
        snap = MemorySnapshot(
            name=name,
            sandbox_id=sid,
            backend=sb.backend.name,
            created=time.time(),
            bytes=sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file()),
            spec=sb.rt.spec.to_dict(),
        )
        write_atomic(d / "meta.json", json.dumps(snap.to_dict()).encode(), 0o600)
        return snap

    def memory_snapshot(self, name: str) -> MemorySnapshot:
        d = self._memory_snapshot_dir(name)
        return MemorySnapshot.from_dict(json.loads((d / "meta.json").read_text()))

    def remove_memory_snapshot(self, name: str) -> None:
        d = self._memory_snapshot_dir(name)
        shutil.rmtree(d)

    async def _restore_memory(
        self, name: str, n: int, spec: SandboxSpec | None
    ) -> list[SandboxInfo]:
        """n sandboxes from memory snapshot ``name``: its spec, but ``spec``'s ttl and
        labels (a VM must have the saved one's RAM and vCPUs to load its state)."""
        snap = self.memory_snapshot(name)
        fields = dict(snap.spec)
        if spec is not None:
            fields.update(ttl=spec.ttl, labels={**fields.get("labels", {}), **spec.labels})
        made_spec = SandboxSpec(**fields)
        results = await self.create_many_settled(
            made_spec, n, saved=self._memory_snapshot_dir(name)
        )
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if not isinstance(r, SandboxInfo)]
        if failed:
            await asyncio.gather(*(self.kill(i.id) for i in made), return_exceptions=True)
            raise failed[0]
        return made

    # --- FnCall pools ---------------------------------------------------------------------
    async def pause(self, sid: str, reclaim: bool = False, preempted: bool = False) -> SandboxInfo:
        """Stop every process of a running sandbox where it is (``Feature.PAUSE``): memory,
        open files and sessions stay; its CPU no longer counts toward admission. ``reclaim``
        then has the kernel take back what of its memory it can (``Backend.pause``). Pausing
        a paused sandbox changes nothing."""
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        if Feature.PAUSE not in sb.backend.features:
            raise BackendUnavailable(
                f"backend {sb.backend.name!r} cannot pause sandboxes", backend=sb.backend.name
            )
        if POOL_LABEL in sb.rt.spec.labels:
            raise InvalidSpec(f"sandbox {sid} is an FnCall pool member: pools pause nothing")
        await self._packed(sb)
        if not sb.paused:
            t0 = time.perf_counter()
            # a VM's pause ends its process (its state goes to a file): not a death
            self._unwatch_exit(sb)
            try:
                await sb.backend.pause(sb.rt, sb.backend_state, reclaim=reclaim)
            finally:
                self._watch_exit(sb)
            sb.paused, sb.preempted = True, preempted
            self._write_state(sb)
            log.debug("paused %s in %.1f ms", sid, 1e3 * (time.perf_counter() - t0))
        return sb.info()

    async def resume(self, sid: str) -> SandboxInfo:
        """Let a paused sandbox's processes go on where they were; a no-op if it is not paused."""
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        await self._packed(sb)
        if sb.paused:
            await sb.backend.resume(sb.rt, sb.backend_state)
            self._unwatch_exit(sb)  # a VM resumes in a new process: watch that one
            self._watch_exit(sb)
            sb.paused = sb.preempted = False
            self._write_state(sb)
        return sb.info()

    @staticmethod
    async def _packed(sb: Sandbox) -> None:
        """Wait for a pack_diff of ``sb`` in flight: it thaws what it froze when done."""
        if sb.packing is not None:
            with contextlib.suppress(Exception):  # the pack's caller gets its error
                await asyncio.shield(sb.packing)

    async def reset(self, sid: str) -> None:
        """Return a running sandbox of a ``Feature.RESET`` backend to how it started."""
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        await sb.backend.reset(sb.rt, sb.backend_state)

    async def fncall(self, environment: str, cmd: Any = None, **kw: Any) -> FnCallResult:
        """Run one call in a warm member of the environment's pool (``Pools.call``): the pool
        of ``project`` (a keyword; None: the node's shared pools), and with ``start=False``
        one that may not start a member for the call."""
        return await self.pools.call(environment, cmd, **kw)

    async def judge(self, spec: JudgeSpec) -> JudgeResult:
        """Judge one submission in a warm member of the environment's pool of ``spec.project``
        (``judge.judge``)."""
        return await judge(self, self.pools, spec)

    async def _drop_pool_members(self) -> None:
        """Pool members a previous daemon left are nobody's: kill them."""
        left = [s.rt.id for s in self.sandboxes.values() if POOL_LABEL in s.rt.spec.labels]
        if left:
            log.info("killing %d FnCall pool members a previous daemon left", len(left))
        await asyncio.gather(*(self.kill(sid, reason="stale pool member") for sid in left))

    # --- inside the sandbox ---------------------------------------------------------------
    def agent(self, sid: str) -> AgentClient:
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        if sb.paused:  # its agent is frozen too: a request would wait until the resume
            raise SandboxPaused(f"sandbox {sid} is paused; resume it first", sandbox_id=sid)
        if sb.agent is None:
            sb.agent = AgentClient(sb.rt.agent_socket, sandbox_id=sid)
        return sb.agent

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
    ) -> ExecResult:
        """Run a command in the sandbox (see ``AgentClient.exec``): what it leaves running is
        killed when it exits unless ``background``; ``exclusive`` kills everything else first.
        With ``trajectory``, the command is ``step`` of that trajectory log (default: the next
        step): a step logged already is answered from the log without running
        (``TrajectoryLogs.run``). A command the OOM killer struck is ``oom_killed``."""
        sb = self._get(sid)
        merged = {**sb.rt.spec.env, **(env or {})} or None
        cwd = cwd or sb.rt.spec.workdir or "/"

        async def run() -> ExecResult:
            result = await self.agent(sid).exec(
                cmd,
                timeout=timeout,
                cwd=cwd,
                env=merged,
                stdin=stdin,
                max_output=max_output,
                background=background,
                exclusive=exclusive,
            )
            if result.exit_code != 0 or result.timed_out:
                result = self._note_oom(sb, result)
            return result

        if trajectory is None:
            if step is not None:
                raise InvalidSpec("step needs a trajectory", field="step")
            return await run()
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        return await self.trajectories.run(trajectory, step, sid, command, run)

    def exec_stream(
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
    ) -> AsyncIterator[tuple[str, bytes] | ExecResult]:
        """``exec`` with the output as it comes (``AgentClient.exec_stream``): a sandbox that
        is not there or not running is refused now; what goes wrong later ends the stream."""
        sb = self._get(sid)
        agent = self.agent(sid)
        merged = {**sb.rt.spec.env, **(env or {})} or None
        cwd = cwd or sb.rt.spec.workdir or "/"

        async def run() -> AsyncIterator[tuple[str, bytes] | ExecResult]:
            stream = agent.exec_stream(
                cmd,
                timeout=timeout,
                cwd=cwd,
                env=merged,
                stdin=stdin,
                max_output=max_output,
                background=background,
                exclusive=exclusive,
            )
            try:
                async for item in stream:
                    if isinstance(item, ExecResult) and (item.exit_code != 0 or item.timed_out):
                        item = self._note_oom(sb, item)
                    yield item
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

        return run()

    def _note_oom(self, sb: Sandbox, result: ExecResult) -> ExecResult:
        """``result`` marked ``oom_killed`` if the sandbox's OOM kills grew while it ran (an
        infra event is recorded then)."""
        if Feature.CGROUPS not in sb.backend.features:
            return result
        kills = sb.backend.usage(sb.rt, sb.backend_state).oom_kills
        if kills is None or kills <= sb.oom_kills:
            return result
        sb.oom_kills = kills
        self.record_event(
            InfraEvent(
                "out_of_memory",
                sb.rt.id,
                time.time(),
                f"the OOM killer struck while {result.command or 'a command'} ran "
                f"(memory limit {sb.rt.limits.memory} bytes)",
            )
        )
        return replace(result, oom_killed=True)

    async def session_open(
        self, sid: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> str:
        sb = self._get(sid)
        return await self.agent(sid).session_open(
            cwd=cwd or sb.rt.spec.workdir or "/", env={**sb.rt.spec.env, **(env or {})} or None
        )

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
        return await self.agent(sid).session_exec(
            session, cmd, timeout=timeout, stdin=stdin, max_output=max_output
        )

    async def session_close(self, sid: str, session: str) -> None:
        await self.agent(sid).session_close(session)

    async def sessions(self, sid: str) -> list[str]:
        return await self.agent(sid).sessions()

    async def read_file(self, sid: str, path: str, offset: int = 0, length: int = -1) -> bytes:
        return await self.agent(sid).read_file(path, offset, length)

    async def write_file(
        self,
        sid: str,
        path: str,
        data: bytes,
        mode: int = 0o644,
        offset: int = 0,
        truncate: bool = True,
    ) -> None:
        await self.agent(sid).write_file(path, data, mode=mode, offset=offset, truncate=truncate)

    async def list_dir(self, sid: str, path: str) -> list[FileEntry]:
        return await self.agent(sid).list_dir(path)

    async def stat(self, sid: str, path: str) -> FileEntry:
        return await self.agent(sid).stat(path)

    async def remove(self, sid: str, path: str, recursive: bool = False) -> None:
        await self.agent(sid).remove(path, recursive=recursive)

    # --- the screen (Feature.SCREEN) -------------------------------------------------------
    def _screen(self, sid: str) -> Sandbox:
        """A running, unpaused sandbox whose backend has a screen."""
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        if sb.paused:
            raise SandboxPaused(f"sandbox {sid} is paused; resume it first", sandbox_id=sid)
        if Feature.SCREEN not in sb.backend.features:
            raise FeatureUnavailable(
                f"sandbox {sid} has no screen: backend {sb.backend.name!r} does not claim "
                f"Feature.SCREEN (the 'vm' backend does)",
                sandbox_id=sid,
                backend=sb.backend.name,
                feature=Feature.SCREEN.value,
            )
        return sb

    async def screenshot(self, sid: str) -> bytes:
        """The sandbox's display now, as PNG bytes."""
        sb = self._screen(sid)
        return await sb.backend.screenshot(sb.rt, sb.backend_state)

    async def input(self, sid: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send key presses, pointer moves and clicks to the sandbox's display, in order
        (``dsec_core.inputs``: a bad event is ``InvalidSpec`` before any is sent); returns how
        many were sent."""
        checked = parse_inputs(events)
        sb = self._screen(sid)
        await sb.backend.input(sb.rt, sb.backend_state, checked)
        return len(checked)

    # --- persistence and adoption ---------------------------------------------------------
    def _write_state(self, sb: Sandbox) -> None:
        path = sb.rt.dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        # 0600: the directory admits the sandboxes' group (runc's way to rootfs/), the state
        # is root's alone
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(sb.state_doc(), f)
        os.replace(tmp, path)

    async def _adopt(self) -> None:
        """Take over sandboxes a previous daemon left running; clean up the rest."""
        in_use: dict[str, int] = {}
        runtime = self.config.runtime_dir
        # first: a pack that died holds a view of a writable layer and may leave it frozen
        markers = list(runtime.glob(f"*/{PACK_MARKER}")) if runtime.exists() else []
        await asyncio.to_thread(recover_packs, LayerStore(self.config.layer_dir), markers)
        for sdir in sorted(runtime.iterdir()) if runtime.exists() else []:
            try:
                sb = self._load(sdir)
            except Exception as e:  # unreadable state: nothing to adopt, only to clean
                log.warning("sandbox dir %s: %s; removing", sdir, e)
                await self._scrub_dir(sdir)
                continue
            alive = sb.status == "running" and await sb.backend.alive(sb.rt, sb.backend_state)
            if alive and (sb.expires is None or sb.expires > time.time()):
                self.sandboxes[sb.rt.id] = sb
                for policy, settings in sb.policies.chosen:
                    policy.adopted(sb.rt, settings)
                for info in sb.layers if sb.rt.rootfs is not None else ():
                    in_use[info.digest] = in_use.get(info.digest, 0) + 1
            else:
                log.info("sandbox %s is gone or expired; cleaning up", sb.rt.id)
                try:
                    await sb.backend.stop(sb.rt, sb.backend_state)
                except DsecError as e:
                    log.warning("stopping %s: %s", sb.rt.id, e)
                await self._scrub_dir(sdir)
                for policy, _ in sb.policies.chosen:  # pinned objects, devices it made
                    try:
                        policy.released(sb.rt)
                    except DsecError as e:
                        log.warning("releasing policy %s of %s: %s", policy.name, sb.rt.id, e)
        # Writable layers with no runtime state (after a reboot, or a crash mid-create).
        for ddir in sorted(self.config.sandbox_dir.iterdir()):
            if ddir.name not in self.sandboxes:
                self.disks.remove(ddir.name, ddir)
        self.disks.sweep(set(self.sandboxes))
        self.uids.adopt(sb.rt.idmap for sb in self.sandboxes.values())
        for sb in self.sandboxes.values():
            self.devices.adopt(sb.rt.id, sb.rt.spec.devices, sb.rt.devices)
        assert self.mounts is not None  # open() made it
        self.mounts.adopt(in_use)
        for sb in self.sandboxes.values():
            if sb.expires:
                self._arm_ttl(sb)
            self._watch_exit(sb)

    def _load(self, sdir: Path) -> Sandbox:
        doc = json.loads((sdir / STATE_FILE).read_text())
        spec = SandboxSpec.from_dict(doc["spec"])
        backend = self.backend(doc["backend"])
        layers = [LayerInfo.from_dict(d) for d in doc["layers"]]
        sid = doc["id"]
        # State written before runtimes recorded their form: a composed root is at rootfs/.
        composed = os.fspath(sdir / "rootfs") if backend.rootfs is RootfsForm.COMPOSED else None
        rootfs = doc.get("rootfs", composed)
        rt = replace(
            self._runtime(sid, spec, backend, IdMap(*doc["idmap"])),
            rootfs=Path(rootfs) if rootfs else None,
            images=tuple(
                LayerImage(ref, digest, Path(image), Path(device) if device else None)
                for ref, digest, image, device in doc.get("images", [])
            ),
            disk=Path(doc["disk"]) if doc.get("disk") else None,
            disk_size=int(doc.get("disk_size") or 0),
            devices=tuple(DeviceNode.from_dict(d) for d in doc.get("devices") or ()),
            kernel=doc.get("kernel"),
        )
        plan = self._load_plan(sid, doc, spec, backend)
        sb = Sandbox(
            rt=rt,
            backend=backend,
            layers=layers,
            created=doc["created"],
            expires=doc["expires"],
            backend_state=doc.get("backend_state") or {},
            status=doc.get("status", "creating"),
            policies=plan,
            events=[InfraEvent.from_dict(e) for e in doc.get("events") or ()],
            oom_kills=int(doc.get("oom_kills") or 0),
            preempted=bool(doc.get("preempted")),
            # the freezer is the truth: a pause or resume may have been cut short by a crash
            paused=Feature.PAUSE in backend.features
            and backend.paused(rt, doc.get("backend_state") or {}),
        )
        sb.preempted = sb.preempted and sb.paused  # a crash between freezer and record
        return sb

    def _load_plan(
        self, sid: str, doc: dict[str, Any], spec: SandboxSpec, backend: Backend
    ) -> PolicyPlan:
        """The policies a sandbox started with, as its state recorded them."""
        saved = doc.get("policy_plan")
        try:
            if saved is None:  # state written before plans were recorded
                return self.policies_for(spec, backend)
            plan = PolicyPlan(skipped=dict(saved.get("skipped") or {}))
            for name, settings in (saved.get("chosen") or {}).items():
                plan.chosen.append((self._policy(name), dict(settings)))
            return plan
        except DsecError as e:  # it ran with them and keeps running, but cannot release them
            log.warning("sandbox %s: its security policies are not all here any more: %s", sid, e)
            return PolicyPlan()

    async def _scrub_dir(self, sdir: Path) -> None:
        for mp in mounted_under(sdir):
            unmount(mp)
        shutil.rmtree(sdir, ignore_errors=True)

    async def _watch_loop(self) -> None:
        """Notice sandboxes whose processes died on their own, and sweep idle layer mounts."""
        while True:
            await asyncio.sleep(1.0)
            try:
                assert self.mounts is not None
                self.mounts.sweep()
                for sid, sb in list(self.sandboxes.items()):
                    if sb.exit_fd is not None:
                        continue  # the loop hears of its end (_watch_exit)
                    if sb.status == "running" and not await sb.backend.alive(
                        sb.rt, sb.backend_state
                    ):
                        log.warning("sandbox %s died on its own; cleaning up", sid)
                        self._spawn(self.kill(sid, reason="died"))
            except Exception:  # the watcher must not die; log and go on
                log.exception("watch loop")


def _sparse_disk(data_dir: Path, size: int) -> Path:
    """A new sparse, unformatted file of ``size`` bytes: an ``IMAGES`` backend's writable disk."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    disk = data_dir / "disk.raw"
    with open(disk, "xb") as f:
        f.truncate(size)
    return disk
