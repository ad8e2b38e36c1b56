"""Admission: whether a node takes a sandbox, the figures placement reads to decide, and the
uid ranges and devices an admitted sandbox holds until it is gone.

``Admission.admit`` runs every check before anything of a sandbox is made and hands back an
``Admitted`` (its id, resolved spec, backend, policies, uid range and devices). The checks
are functions that read the records they are handed and change nothing: ``resolve_spec`` (a
spec with its environment applied), ``check_backend`` and ``check_drives`` (what a spec asks
of its backend and of the node's other sandboxes), ``node_load`` (the node as placement sees
it: capacity and what live sandboxes reserve) and ``admit`` (the local decision: the node is
the one eligible node, and the placement plugins must take it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from .. import plugins
from ..backend import Backend, DeviceNode, Feature
from ..catalog.store import CatalogStore
from ..config import NodeConfig
from ..errors import AdmissionRejected, BackendUnavailable, DsecError, InvalidSpec, UnknownSandbox
from ..linux import sysctl
from ..linux.hostmem import meminfo, pressure
from ..plugins import Registry
from ..records import (
    DEFAULT_BACKEND,
    PROJECT_LABEL,
    SANDBOX_START_MEMORY,
    IdMap,
    NodeLoad,
    SandboxSpec,
)
from .devices import DevicePool
from .host import AdmissionHost
from .idpool import UidPool
from .policies import PolicyPlanner
from .sandbox import PolicyPlan, Sandbox

__all__ = [
    "Admission",
    "Admitted",
    "admit",
    "backend_label",
    "check_backend",
    "check_drives",
    "node_load",
    "project_usage",
    "resolve_spec",
    "warm",
    "with_created",
]

log = logging.getLogger("dsec.node")


@dataclass(frozen=True)
class Admitted:
    """A sandbox the node admitted, before anything of it is made: its id, its spec with its
    environment applied, the kernel a VM backend boots, its backend and security policies,
    and the uid range and devices taken for it (``Admission.release`` gives them back)."""

    sid: str
    spec: SandboxSpec
    layers: tuple[str, ...]  # name@version, top first: the spec's, then its environment's
    kernel: str | None
    backend: Backend
    plan: PolicyPlan
    idmap: IdMap
    devices: tuple[DeviceNode, ...]


class Admission:
    """Admission on ``host``'s node: ``planner`` plans policies, ``uids`` and ``devices`` (the
    inventory ``open`` probes) hand out what each sandbox holds."""

    def __init__(
        self, host: AdmissionHost, registry: Registry, planner: PolicyPlanner, uids: UidPool
    ) -> None:
        self.host = host
        self.registry = registry
        self.planner = planner
        self.uids = uids
        self.devices = DevicePool()  # the inventory, checked in open()
        self._warming: asyncio.Future | None = None

    def open(self) -> None:
        """Probe the device inventory (a missing or non-device path stops the node), and
        raise the kernel's limits a node of many sandboxes needs."""
        self.devices = DevicePool.probe(self.host.config)
        for name, (old, new) in sysctl.raise_to(sysctl.NODE_MINIMUMS).items():
            log.info("raised %s from %d to %d for a node of many sandboxes", name, old, new)
        raised = sysctl.raise_nofile(sysctl.NOFILE_MINIMUM)
        if raised:
            log.info("raised the daemon's open-file limit from %d to %d", *raised)

    def load(self, warm: bool = False) -> NodeLoad:
        """This node as placement sees it: capacity and what live sandboxes reserve (warm
        members left out, as room they give back at need, unless ``warm``)."""
        sandboxes: Iterable[Sandbox] = self.host.sandboxes.values()
        if not warm:
            sandboxes = (s for s in sandboxes if not s.warm)
        return node_load(self.host.config, self.registry.backends, sandboxes, self.devices.usage())

    def new_sandbox_id(self) -> str:
        """A fresh sandbox id: 12 hex digits, then ``-<node name>`` on a named node (an
        apiserver routes the id to its node by that suffix)."""
        sid = secrets.token_hex(6)
        name = self.host.config.node_name
        return f"{sid}-{name}" if name else sid

    def admit(self, spec: SandboxSpec) -> Admitted:
        """Admit a sandbox of ``spec``, or raise why not (``InvalidSpec``, ``PolicyUnavailable``,
        ``BackendUnavailable``, ``AdmissionRejected``...) with nothing taken."""
        spec, kernel = resolve_spec(spec, self.host.catalogs)
        assert spec.backend is not None  # resolve_spec names one
        layers = tuple(spec.layers)  # explicit layers go on top of the environment's
        if spec.environment:
            layers += tuple(self.host.catalogs.environment(spec.environment).layer_refs())
        backend = self.host.backend(spec.backend)
        if backend.shares_host_kernel():
            # a create that named a container backend over a VM environment: the environment's
            # kernel means nothing there
            kernel = None
        check_backend(spec, backend)
        check_drives(spec, backend, self.host.sandboxes)
        plan = self.planner.plan(spec, backend)
        self.devices.check(spec.devices)  # before the load's counts: this names the holders
        admit(spec, self.load())
        sid = self.new_sandbox_id()
        idmap = self.uids.allocate()
        try:
            devices = self.devices.allocate(sid, spec.devices)
        except BaseException:
            self.uids.release(idmap)
            raise
        self._warm_uids()
        return Admitted(sid, spec, layers, kernel, backend, plan, idmap, devices)

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

    def release(self, sid: str, idmap: IdMap) -> None:
        """Sandbox ``sid`` is fully gone: its uid range and devices may serve again."""
        self.uids.release(idmap)
        self.devices.release(sid)

    async def close(self) -> None:
        """Wait for the uid range being warmed, then let the uid pool go."""
        if self._warming is not None:
            await self._warming
        self.uids.close()

    def adopt(self, sandboxes: Iterable[Sandbox]) -> None:
        """After a restart: the uid ranges and devices of ``sandboxes`` are taken."""
        sandboxes = list(sandboxes)
        self.uids.adopt(sb.rt.idmap for sb in sandboxes)
        for sb in sandboxes:
            self.devices.adopt(sb.rt.id, sb.rt.spec.devices, sb.rt.devices)


def node_load(
    config: NodeConfig,
    backends: Iterable[str],
    sandboxes: Iterable[Sandbox],
    devices: Mapping[str, Mapping[str, int]],
) -> NodeLoad:
    """The node as placement sees it: ``config``'s capacity, what its live ``sandboxes``
    reserve, the host's memory now, and ``devices``' usage (``DevicePool.usage``)."""
    live = [s for s in sandboxes if s.live]
    creating = sum(1 for s in live if s.status == "creating")
    mem = meminfo("MemTotal", "MemAvailable")
    return NodeLoad(
        node=config.node_name or os.fspath(config.home),
        labels=config.node_labels,
        backends=tuple(sorted(backends)),
        cpu_capacity=config.cpu_capacity,
        # best-effort sandboxes take only idle CPU, paused ones none at all
        cpu_committed=sum(s.rt.limits.cpu for s in live if s.rt.spec.qos != "be" and not s.paused),
        memory_capacity=config.memory_capacity,
        memory_committed=sum(s.rt.limits.memory + s.backend.memory_overhead for s in live),
        sandboxes=len(live),
        max_sandboxes=config.max_sandboxes,
        memory_total=mem.get("MemTotal", 0),
        memory_available=(
            max(0, mem["MemAvailable"] - creating * SANDBOX_START_MEMORY)
            if "MemAvailable" in mem
            else None
        ),
        memory_reserve=config.memory_reserve,
        memory_pressure=pressure("memory").get("some_avg10", 0.0),
        memory_pressure_limit=config.memory_pressure_limit,
        devices=devices,
    )


def with_created(load: NodeLoad, specs: Iterable[SandboxSpec]) -> NodeLoad:
    """``load`` with sandboxes of ``specs`` counted as being created (as ``node_load`` counts
    one: its limits reserved, ``SANDBOX_START_MEMORY`` off what is available)."""
    for spec in specs:
        lim = spec.limits
        available = load.memory_available
        load = replace(
            load,
            sandboxes=load.sandboxes + 1,
            cpu_committed=load.cpu_committed + (0.0 if spec.qos == "be" else lim.cpu),
            memory_committed=load.memory_committed + lim.memory,
            memory_available=None if available is None else available - SANDBOX_START_MEMORY,
        )
    return load


def admit(spec: SandboxSpec, load: NodeLoad) -> None:
    """Local admission: this node is the one eligible node if ``spec`` fits ``load``, and the
    placement plugins must take it (the control plane asks the same plugins across many)."""
    refusal = load.refusal(spec)
    if refusal is not None:
        raise refusal
    if plugins.place(spec, [load]) is None:
        raise AdmissionRejected(
            f"placement declined node {load.node}", reason="placement", node=load.node
        )


def check_backend(spec: SandboxSpec, backend: Backend) -> None:
    """What ``spec`` asks of its backend that the backend does not offer: a runtime it lacks
    (``InvalidSpec``), devices without ``Feature.DEVICES`` (``BackendUnavailable``)."""
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


def check_drives(spec: SandboxSpec, backend: Backend, sandboxes: Mapping[str, Sandbox]) -> None:
    """A sandbox that drives others: its backend passes the drive socket in, and each
    sandbox it names runs on this node (is among ``sandboxes``, live)."""
    if not spec.drives:
        return
    if Feature.DRIVE not in backend.features:
        raise BackendUnavailable(
            f"backend {backend.name!r} cannot pass the drive socket in (it does not claim "
            "Feature.DRIVE): its sandboxes cannot drive others",
            backend=backend.name,
        )
    for sid in spec.drives:
        sb = sandboxes.get(sid)
        if sb is None or not sb.live:
            raise UnknownSandbox(
                f"drives names sandbox {sid!r}, which does not run on this node",
                sandbox_id=sid,
            )


def project_usage(sandboxes: Iterable[Sandbox]) -> dict[str, tuple[int, float, int]]:
    """Live sandboxes by project (``PROJECT_LABEL``): how many, and their CPU and memory
    limits summed (with what their backend takes beyond the limit: a VM's emulator)."""
    out: dict[str, tuple[int, float, int]] = {}
    for sb in sandboxes:
        project = sb.rt.spec.labels.get(PROJECT_LABEL)
        if project is None or not sb.live:
            continue
        n, cpu, memory = out.get(project, (0, 0.0, 0))
        charged = sb.rt.limits.memory + sb.backend.memory_overhead
        out[project] = (n + 1, cpu + sb.rt.limits.cpu, memory + charged)
    return out


def warm(
    sandboxes: Iterable[Sandbox], lingering: Iterable[str], catalogs: CatalogStore
) -> tuple[list[str], list[str]]:
    """What a create would find mounted: the layers (``name@version``) that live sandboxes
    use or that linger after their last user (``lingering``), and the environments all of
    whose layers are among them (placement prefers such a node)."""
    layers = {info.ref for sb in sandboxes if sb.live for info in sb.layers}
    layers |= set(lingering)
    environments: list[str] = []
    with contextlib.suppress(DsecError):  # a broken catalog leaves the answer without
        for env in catalogs.environments():
            refs: Sequence[str] = env.layer_refs()
            if refs and all(r in layers for r in refs):
                # a create may name it either way (placement compares the text)
                environments += [env.name, env.qualified]
    return sorted(layers), sorted(environments)


def resolve_spec(spec: SandboxSpec, catalogs: CatalogStore) -> tuple[SandboxSpec, str | None]:
    """``spec`` with its environment applied (the environment's env under the spec's, its
    workdir unless the spec names one, its backend unless the spec names one, else
    ``DEFAULT_BACKEND``), and the kernel the environment asks a VM backend to boot."""
    if not spec.environment:
        return replace(spec, backend=spec.backend or DEFAULT_BACKEND), None
    environment = catalogs.environment(spec.environment)
    return replace(
        spec,
        env={**dict(environment.env or {}), **spec.env},
        workdir=spec.workdir if spec.workdir != "/" else (environment.workdir or "/"),
        backend=spec.backend or environment.backend or DEFAULT_BACKEND,
    ), environment.kernel


def backend_label(spec: SandboxSpec, catalogs: CatalogStore) -> str:
    """The backend a create of ``spec`` would use, for a failed create's metric ("unknown" if
    even that fails)."""
    try:
        return resolve_spec(spec, catalogs)[0].backend or "unknown"
    except DsecError:
        return "unknown"
