"""The apiserver's HTTP app: the node API's route table, served over many nodes to many tenants.

Every request carries an API key (``Authorization: Bearer <key>`` or ``X-API-Key``), checked by
IAM before any route runs (``auth.Authenticated``: nothing of a refused request's body is
read). Then every object the request names, in its path or inside its decoded body, is checked
against the caller's reach (``reach``: one rule for sandboxes, layers, memory snapshots,
trajectories, leases, drives, pools and builds); one out of reach answers exactly as one that
does not exist. By route:

- routes of one sandbox (``/v1/sandboxes/{sid}/...``) go to the node named by the id's suffix,
  once the sandbox is known to be one the caller reaches (its ``dsec.project`` label, looked
  up once and remembered). JSON bodies are read within the route's bound and decoded here,
  names in them (a trajectory, a snapshot's name) put in the caller's namespace, and only a
  well-formed body goes on to the node; file bodies and exec output stream through without
  being read whole;
- ``create`` and ``restore`` check the spec (``drives``, ``layers``, the policies a key's role
  may ask for, reserved labels), set the caller's project label, hold room in the project's
  quotas (and its ancestors') and on the nodes before asking them (``nodes.Ledger``), place
  each sandbox with the ``dsec_place`` hook over the healthy nodes (the home pool, or the
  overflow pool for a spec that allows it once the home pool is over ``overflow_at``), and
  give back the room a node refused; a create with ``wait`` that no node has room for waits
  in a fair queue of placements (``waiting``) instead of being refused;
- ``list`` asks every healthy node and keeps what the caller reaches;
- leases route by their id's suffix as sandboxes do, and are the project's whose tag their
  holder carries; fncall and judge go where placement says, in pools of the caller's project;
  trajectories and memory snapshots go to the nodes that have them.

Errors that reach a tenant name only what the tenant sent: no list of other objects, no node
address (those go to the log, with the request id).

The apiserver holds no sandbox state: killed and restarted, it learns everything again from
the nodes, and several run side by side against the same nodes.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route as StarletteRoute

from .. import __version__, plugins
from ..api.iam import IAM_ROUTES
from ..api.messages import (
    CreateResult,
    ErrorBody,
    ExecRequest,
    LayerList,
    LeaseInfo,
    ListQuery,
    MemorySnapshot,
    MemorySnapshotRequest,
    NodeCapacity,
    NodeStatus,
    PackDiffRequest,
    SandboxList,
    Trajectory,
)
from ..api.openapi import openapi_document
from ..api.routes import IDEMPOTENCY_KEY, JSON, RAW, ROUTES, Route, dump_json
from ..api.serving import (
    body_pieces,
    check_declared,
    error_response,
    on_http_error,
    read_json_body,
    request_key,
    unless_disconnected,
)
from ..api.transport import AsyncStreamedResponse, TransportError
from ..errors import (
    AdmissionRejected,
    DsecError,
    InvalidSpec,
    MissingParentLayers,
    NodeLost,
    NodeUnavailable,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    UnknownLayer,
    UnknownSandbox,
    UnknownSource,
    error_from_wire,
)
from ..iam import ROOT, Principal, Usage
from ..observe import ApiserverMetrics, ObservedRequests, current_request_id, new_request_id
from ..records import (
    BUILD_LABEL,
    PROJECT_LABEL,
    SANDBOX_START_MEMORY,
    STAGED_PREFIX,
    NodeLoad,
    SandboxInfo,
    SandboxSpec,
    check_create_key,
    parse_size,
)
from ..security import loosenings
from .auth import PRINCIPAL, Authenticated, Refusal
from .iam_routes import iam_routes
from .nodes import Hold, NodeEntry, NodeSet
from .reach import (
    BUILD_ROLES,
    MEMBER_LABEL,
    Owner,
    Reach,
    is_staged,
    may_build,
    missing,
    scoped,
    strip_tag,
)
from .run_code import run_code_route
from .timing import Stages, stages_of, upstream_total
from .waiting import PlacementQueue

__all__ = ["OVERFLOW_LABEL", "Authority", "Gateway", "Metrics", "make_app"]

log = logging.getLogger("dsec.apiserver")

#: A spec carrying this label with the value ``true`` may run in the overflow pool (DSec's
#: cloud burst) when the home pool is over ``overflow_at`` of its capacity.
OVERFLOW_LABEL = "dsec.overflow"
#: Labels the apiserver sets (a client's value is replaced).
_REPLACED = (PROJECT_LABEL,)
#: Labels only nodes set (a spec carrying one is refused): a pool member's.
_REFUSED = (MEMBER_LABEL,)
#: How many sandbox and lease owners are remembered (an object's owner never changes).
_OWNER_CACHE = 200_000
#: How many recent create bodies are kept decoded (``Gateway.decoded``), and the largest kept.
_DECODED = 256
_DECODED_BYTES = 8 << 10
#: How many keyed creates' nodes an apiserver remembers (``Gateway.create_keys``).
CREATE_KEYS = 65536
#: For how long after it starts an apiserver asks its nodes where a keyed create it does not
#: know went (``Gateway.went_before``): one sent again to it may have gone to a node through
#: the apiserver it took over from. Longer than the SDK's and a trainer's resending.
ASK_FOR_KEYS_S = 120.0
#: The routes most requests take (matched first).
_HOT_ROUTES = frozenset({"create", "get", "kill", "exec"})
#: The request id header, set on every request forwarded to a node.
REQUEST_ID = "x-request-id"
#: What a tenant's error message may not show: a node's URL, a layer source's location
#: (``local:/var/lib/...``, ``s3://bucket``): any ``scheme:/...`` or ``scheme://...``.
_URL_RE = re.compile(r"\b[a-z][a-z0-9+.-]*:/{1,2}[^\s'\")]+")
#: What a node's admission refusal tells a tenant, by its reason: not the numbers (they are
#: the node's load, which other tenants make).
_REFUSALS = {
    "count": "full",
    "cpu": "not enough CPU",
    "memory": "not enough memory",
    "memory-pressure": "under memory pressure",
    "memory-available": "not enough memory available",
    "devices": "not enough devices free",
}


class Authority(Protocol):
    """What the apiserver asks IAM (``dsec_core.iam.Iam``)."""

    def authenticate(self, secret: str | None) -> Principal: ...

    def can_reach(self, principal: Principal, project: str) -> bool: ...

    def can_loosen(self, principal: Principal) -> bool: ...

    def check_quota(self, project: str, usage: Mapping[str, Usage], add: Usage) -> None: ...

    def projects(self, under: str | None = None) -> list[Any]: ...


class Metrics(Protocol):
    """What the apiserver reports (``dsec_core.observe.ApiserverMetrics``); None: nothing."""

    def create_done(self, seconds: float, ok: bool) -> None: ...

    def placed(self, node: str, pool: str, overflow: bool) -> None: ...

    def forwarded(self, route: str, seconds: float) -> None: ...


def open_networks_from_env(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """``DSEC_OPEN_NETWORKS``: comma-separated network modes that keys which may only tighten
    the node's policies (member and agent keys) may still ask for, such as ``internet`` (NAT
    through the node, private ranges and the node's own addresses refused). Empty by default:
    every mode but ``none`` takes an admin or builder key."""
    text = (os.environ if environ is None else environ).get("DSEC_OPEN_NETWORKS", "")
    modes = frozenset(m.strip() for m in text.split(",") if m.strip())
    if "allowlist" in modes:
        raise InvalidSpec(
            "DSEC_OPEN_NETWORKS cannot hold 'allowlist': its rules are what a key would loosen",
            field="DSEC_OPEN_NETWORKS",
        )
    return modes


@dataclass
class Gateway:
    """The apiserver's state: its nodes, its IAM, its settings. Nothing here outlives a
    restart but the caches."""

    nodes: NodeSet
    iam: Authority
    overflow_at: float = 0.8
    metrics: Metrics | None = None
    #: Network modes every key may ask for, not only those that may loosen policies
    #: (``DSEC_OPEN_NETWORKS``, e.g. "internet"; default: none).
    open_networks: frozenset[str] = field(default_factory=open_networks_from_env)

    def __post_init__(self) -> None:
        self.reach = Reach(self.iam.can_reach, lambda: self.iam.projects())
        self._owners: collections.OrderedDict[str, Owner] = collections.OrderedDict()
        self._usage: dict[str, tuple[int, float, int]] = {}
        self._usage_version: tuple[int, int, int] | None = None
        self._policy_classes: Mapping[str, Any] | None = None
        #: (project, environment) -> the node that ran the project's last fncall or judge
        #: call of it: its pool is warm there
        self.pool_homes: dict[tuple[str, str], str] = {}
        #: creates waiting for room on some node (``waiting``)
        self.waiting = PlacementQueue(getattr(self.metrics, "queue", None))
        self._decoded: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        #: (project, create key) -> the node a keyed create went to: one sent again goes there
        #: too, not to a node that would make a second sandbox (``CREATE_KEYS`` of them)
        self.create_keys: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self.started = time.monotonic()
        #: (create body, project, count) -> what the nodes are sent for it (no wait left)
        self._to_node: collections.OrderedDict[tuple[bytes, str, int], bytes] = (
            collections.OrderedDict()
        )

    async def went_before(self, project: str, key: str, rid: str) -> str | None:
        """The node that made (or is making) a create under ``key`` of ``project`` sent
        through the apiserver this one took over from: in its first ``ASK_FOR_KEYS_S``, the
        healthy nodes are asked (a node away then is not waited for). None after that, or if
        none has it."""
        if time.monotonic() - self.started > ASK_FOR_KEYS_S:
            return None
        route = ROUTES["list"]
        target = route.target({}, ListQuery(project=project, create_key=key))
        answers = await _fan_out(self, route, target, rid, timeout=ROUTES["create"].timeout)
        for entry, answer in answers:
            if not isinstance(answer, DsecError) and answer.sandboxes:
                log.info("create key %s: made on node %s before this apiserver", key, entry.name)
                return entry.name
        return None

    def decoded(self, route: Route, raw: bytes) -> Any:
        """``route``'s body ``raw`` decoded (``InvalidSpec`` for a bad one), from memory when
        the same bytes decoded lately: a trainer sends one spec thousands of times, and
        decoding it (the JSON, then each field checked) was a tenth of a create's work. Only
        bodies that decoded are kept (``_DECODED`` of them, each of at most
        ``_DECODED_BYTES``); what they decode to is frozen, and read, never changed."""
        if len(raw) > _DECODED_BYTES:
            return route.decode_body(raw)
        key = route.name.encode() + b" " + raw
        body = self._decoded.get(key)
        if body is None:
            body = self._decoded[key] = route.decode_body(raw)
            if len(self._decoded) > _DECODED:
                self._decoded.popitem(last=False)
        else:
            self._decoded.move_to_end(key)
        return body

    # --- what a key reaches ---------------------------------------------------------------
    def node_of(self, resource_id: str, kind: str = "sandbox") -> NodeEntry:
        """The registered node a sandbox (or lease) id names, or the answer a made-up id gets;
        ``NodeLost`` if that node is not answering (for a made-up id on it too: the id's
        suffix is all that tells them apart, and it names only the node)."""
        _, sep, name = resource_id.rpartition("-")
        entry = self.nodes.get(name) if sep else None
        if entry is None:
            raise missing(kind, resource_id)
        if not entry.healthy:
            raise NodeLost(
                f"node {entry.name}, which holds {kind} {resource_id}, is not answering; its "
                "state is unknown until it is back",
                node=entry.name,
                sandbox=resource_id,
            )
        return entry

    async def owner_of(self, entry: NodeEntry, sid: str) -> Owner | None:
        """Whose sandbox ``sid`` is (its labels, as its node says now), or None if its node
        does not know it."""
        try:
            r = await self._request(entry, "GET", "/v1/sandboxes/" + quote(sid, safe=""))
        except NotFound:
            self.forget(sid)
            return None
        owner = Owner.of_labels(ROUTES["get"].decode_response(r).labels)
        self._remember(sid, owner)
        return owner

    def _remember(self, key: str, owner: Owner) -> None:
        self._owners[key] = owner
        if len(self._owners) > _OWNER_CACHE:
            self._owners.popitem(last=False)

    def forget(self, key: str) -> None:
        self._owners.pop(key, None)

    def _cached(self, key: str, principal: Any) -> bool:
        """Whether ``key``'s remembered owner is one ``principal`` reaches. Only that answer
        comes from memory: a refusal always asks the node, so a real id out of reach costs
        what a made-up one does (no timing tells them apart)."""
        owner = self._owners.get(key)
        if owner is None or not self.reach.allows(principal, owner):
            return False
        self._owners.move_to_end(key)
        return True

    async def sandbox_node(self, principal: Any, sid: str) -> NodeEntry:
        """The node of a sandbox the caller reaches; ``UnknownSandbox`` otherwise, the same
        for one that does not exist."""
        entry = self.node_of(sid)
        if self._cached(sid, principal):
            return entry
        owner = await self.owner_of(entry, sid)
        if owner is None or not self.reach.allows(principal, owner):
            raise missing("sandbox", sid)
        return entry

    async def lease_node(self, principal: Any, lease_id: str) -> NodeEntry:
        """The node of a lease the caller reaches (its holder carries the tag of a project the
        caller reaches; one taken on a node directly, untagged, is nobody's here);
        ``UnknownLease`` otherwise, the same for one that does not exist."""
        entry = self.node_of(lease_id, "lease")
        key = "lease:" + lease_id
        if self._cached(key, principal):
            return entry
        try:
            r = await self._request(entry, "GET", ROUTES["lease_get"].target({"lease": lease_id}))
        except NotFound:
            raise missing("lease", lease_id) from None
        owner = self.reach.owner_of_name(ROUTES["lease_get"].decode_response(r).holder, principal)
        if owner.project is not None:
            self._remember(key, owner)
        if owner.project is None or not self.reach.allows(principal, owner):
            raise missing("lease", lease_id)
        return entry

    def check_layer(self, principal: Any, ref: str, kind: str = "layer") -> None:
        """A layer a request names: a build's staged layer only with a ``BUILD_ROLES`` key
        (``PermissionDenied``, whatever exists), another project's as one that does not
        exist."""
        if is_staged(ref):
            _check_builder(principal, f"use the staged layer {ref!r}")
        self.reach.require(principal, kind, ref, self.reach.owner_of_layer(ref, principal))

    async def memory_snapshot(
        self, principal: Any, name: str, rid: str
    ) -> tuple[NodeEntry, MemorySnapshot]:
        """The node holding memory snapshot ``name`` of a project the caller reaches, and the
        snapshot; ``UnknownSnapshot`` otherwise, the same for one that does not exist."""
        self.reach.require(principal, "snapshot", name, self.reach.owner_of_name(name, principal))
        route = ROUTES["memory_snapshot"]
        for entry in self.nodes.healthy():
            try:
                answer = await self._request(
                    entry, "GET", route.target({"snapshot": name}), request_id=rid
                )
            except NotFound:
                continue
            return entry, route.decode_response(answer)
        raise missing("snapshot", name)

    def memory_overhead(self, backend: str | None) -> int:
        """What a sandbox of ``backend`` takes beyond its memory limit (a VM's emulator), as
        its node counts it against the project's quota; 0 for a backend unknown here."""
        cls = plugins.registry().backends.get(backend or "")
        return int(getattr(cls, "memory_overhead", 0))

    def policy_classes(self) -> Mapping[str, Any]:
        if self._policy_classes is None:
            self._policy_classes = dict(plugins.registry().security_policies)
        return self._policy_classes

    def check_policies(
        self,
        principal: Any,
        policies: Mapping[str, Any],
        network: str,
        runtime: str | None = None,
        live: bool = False,
    ) -> None:
        """``PermissionDenied`` if the key may not loosen policies (``Iam.can_loosen``) and
        these would (``dsec_core.security.loosenings``)."""
        if self.iam.can_loosen(principal):
            return
        why = loosenings(
            policies,
            network,
            self.policy_classes(),
            runtime=runtime,
            live=live,
            open_networks=self.open_networks,
        )
        if why:
            raise PermissionDenied(
                f"a {principal.role} key may only tighten the node's default security "
                f"policies, and this would loosen them: {'; '.join(why)}",
                role=principal.role,
                reasons=why,
            )

    async def admit(self, principal: Any, spec: SandboxSpec) -> tuple[SandboxSpec, str | None]:
        """``spec`` as the nodes get it from this caller: every object it names checked
        (``drives`` are sandboxes the caller reaches, all on one node, which is returned;
        ``layers`` are ones it reaches), its policies within the key's role, its trajectory
        in the caller's namespace, its project label the caller's."""
        if BUILD_LABEL in spec.labels:
            _check_builder(principal, f"create a build sandbox (labelled {BUILD_LABEL})")
        for label in _REFUSED:
            if label in spec.labels:
                raise InvalidSpec(f"label {label} is the node's to set", field="labels")
        for ref in spec.layers:
            self.check_layer(principal, ref)
        self.check_policies(principal, spec.policies, spec.network, spec.runtime)
        nodes = {(await self.sandbox_node(principal, sid)).name for sid in spec.drives}
        if len(nodes) > 1:
            raise InvalidSpec(
                f"a sandbox drives sandboxes of one node; these are on {sorted(nodes)}",
                field="drives",
            )
        labels = {k: v for k, v in spec.labels.items() if k not in _REPLACED}
        labels[PROJECT_LABEL] = principal.project
        trajectory = spec.trajectory and scoped(principal.project, spec.trajectory)
        return spec.relabelled(labels, trajectory), next(iter(nodes), None)

    # --- errors a tenant sees -------------------------------------------------------------
    def scrub(self, principal: Any, err: DsecError) -> DsecError:
        """``err`` as a tenant may see it: what it lists (``known``) cut to what the caller
        reaches (no sandbox ids, no layer sources, only layers it reaches), no URL."""
        known = err.context.get("known")
        if isinstance(err, NotFound) and known:
            if isinstance(err, (UnknownSandbox, UnknownSource)):
                keep: list[str] = []
            elif isinstance(err, UnknownLayer) and not isinstance(err, MissingParentLayers):
                keep = [k for k in known if isinstance(k, str) and self._shows(principal, k)]
            else:
                keep = list(known)
            if keep != known:
                base = re.sub(r" \((known: .*|none known)\)$", "", err.message, flags=re.S)
                context = {k: v for k, v in err.context.items() if k not in ("known", "name")}
                err = type(err)(base, name=err.context.get("name", ""), known=keep, **context)
        if "address" in err.context or _URL_RE.search(err.message):
            context = {k: v for k, v in err.context.items() if k != "address"}
            err = _retyped(err, _URL_RE.sub("<node>", err.message), context)
        return err

    def _shows(self, principal: Any, ref: str) -> bool:
        if is_staged(ref) and not may_build(principal):
            return False
        owner = self.reach.owner_of_layer(ref.split(" ")[0], principal)
        return self.reach.allows(principal, owner)

    # --- talking to nodes -----------------------------------------------------------------
    async def _request(
        self,
        entry: NodeEntry,
        method: str,
        target: str,
        body: bytes | None = None,
        timeout: float | None = 60.0,
        request_id: str | None = None,
        stages: Stages | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> bytes:
        """A small request to a node; its 2xx body, or the node's typed error raised.
        ``stages``: the request's, given the node's own time (the longest, over several);
        ``headers``: more than the request id."""
        sent = {REQUEST_ID: request_id} if request_id else None
        if headers:
            sent = {**(sent or {}), **headers}
        try:
            async with await entry.transport.stream(
                method,
                target,
                body=body,
                content_type=JSON if body is not None else None,
                headers=sent,
                timeout=timeout,
            ) as r:
                content = await r.read()
        except TransportError as e:
            raise self._unreachable(entry, e) from e
        if stages is not None:
            own = upstream_total(r.headers)
            if own is not None and (stages.upstream is None or own > stages.upstream):
                stages.upstream = own
        if r.status_code >= 300:
            raise _node_error(entry, r.status_code, content)
        return content

    def _unreachable(self, entry: NodeEntry, e: Exception) -> DsecError:
        log.warning("node %s (%s) did not answer: %s", entry.name, entry.address.url, e)
        if not entry.healthy:  # the watcher gave it up (and cut what was in flight)
            return NodeLost(
                f"node {entry.name} did not answer: it stopped answering its probes",
                node=entry.name,
            )
        return NodeUnavailable(f"node {entry.name} did not answer", node=entry.name)

    # --- quotas and placement -------------------------------------------------------------
    def usage_by_project(self) -> dict[str, Usage]:
        """Every project's live sandboxes over the healthy nodes (last probe plus what the
        ledger holds), for quotas. The probes' sums are made once per watcher round, not per
        request: at 160 nodes and many projects that is the costly part."""
        version = (self.nodes.round, self.nodes.health, len(self.nodes.nodes))
        if self._usage_version != version:
            totals: dict[str, tuple[int, float, int]] = {}
            for entry in self.nodes.healthy():
                assert entry.probe is not None
                for p, u in entry.probe.projects.items():
                    n, c, m = totals.get(p, (0, 0.0, 0))
                    totals[p] = (n + u.sandboxes, c + u.cpu, m + u.memory)
            self._usage, self._usage_version = totals, version
        totals = dict(self._usage)
        for p, (dn, dc, dm) in self.nodes.ledger.by_project().items():
            n, c, m = totals.get(p, (0, 0.0, 0))
            totals[p] = (n + dn, c + dc, m + dm)
        return {p: Usage(n, c, m) for p, (n, c, m) in totals.items()}

    def check_quota(self, project: str, count: int, cpu: float, memory: int) -> None:
        """``QuotaExceeded`` unless ``count`` more sandboxes of these limits fit ``project``'s
        quotas and its ancestors', counting what is held for requests in flight. Hold the
        room (``Ledger.hold``) before the next ``await``: the check and the hold are then one
        step, whatever else runs."""
        self.iam.check_quota(
            project, self.usage_by_project(), Usage(count, count * cpu, count * memory)
        )

    async def on_pool_node(
        self,
        project: str,
        environment: str,
        cpu: float,
        memory: int,
        request: Callable[[bool], tuple[str, bytes | None]],
        timeout: float | None,
        rid: str,
    ) -> bytes:
        """A call in a pool of ``project``'s (fncall, judge, run_code): on the node that ran
        the project's last call of ``environment`` while placement lets it take one more
        member (its pool is warm there), else where placement says. A pool member counts as
        one sandbox of the project (``cpu``, ``memory``) for as long as it lives; when the
        project's quotas have no room for one more, the call may only use a member one of its
        pools has: it is tried on the node of the pool's last call first, then on each other,
        and a pool with no member free anywhere is the project's ``QuotaExceeded``.
        ``request(start)`` is the node's path and body, ``start`` saying whether the node may
        start a member."""
        full: QuotaExceeded | None = None
        try:
            self.check_quota(project, 1, cpu, memory)
        except QuotaExceeded as e:
            full = e
        target, content = request(full is None)
        home_key = (project, environment)
        home = self.pool_homes.get(home_key)
        if full is None:
            spec = SandboxSpec(environment=environment)
            try:
                shares, _ = self.place(spec, 1, only=home)
            except AdmissionRejected:
                shares, _ = self.place(spec, 1)
            names = list(shares)
        else:  # no member may start: wherever the project's pool may have one
            names = sorted((e.name for e in self.nodes.healthy()), key=lambda n: n != home)
        for name in names:
            hold = None if full else self.nodes.ledger.hold(project, name, 1, cpu, memory)
            try:
                answer = await self._request(
                    self.nodes.nodes[name], "POST", target, content, timeout, request_id=rid
                )
            except AdmissionRejected as e:
                if hold is not None:
                    self.nodes.ledger.settle(hold, 0)
                if full is not None and e.context.get("reason") == "pool-start":
                    continue  # no member of the project's pool there: the next node
                raise
            except BaseException:
                if hold is not None:
                    self.nodes.ledger.settle(hold, 0)
                raise
            if hold is not None:  # it may have started a member: counted until the next probe
                self.nodes.ledger.settle(hold, 1)
            self.pool_homes[home_key] = name
            if len(self.pool_homes) > _POOL_HOMES:
                del self.pool_homes[next(iter(self.pool_homes))]
            return answer
        assert full is not None
        raise full

    def place(
        self, spec: SandboxSpec, count: int, only: str | None = None
    ) -> tuple[dict[str, int], bool]:
        """How many of ``count`` sandboxes go to each node (by name), and whether they
        overflowed; ``AdmissionRejected`` with each node's reason if some cannot be placed.
        ``only``: the one node they may go to (the node of the sandboxes they drive)."""
        if count == 1 and only is None and spec.labels.get(OVERFLOW_LABEL, "").lower() != "true":
            # the common create: the home pool's nodes that fit, kept up to date by the
            # watcher and the ledger (``NodeSet.eligible``); none, or the hook placing none,
            # goes the whole way below, which says why for each node
            eligible = self.nodes.eligible(spec)
            chosen = plugins.place(spec, eligible) if eligible else None
            if chosen is not None:
                return {chosen.node: 1}, False
        healthy = [e for e in self.nodes.healthy() if only is None or e.name == only]
        home = [e for e in healthy if e.pool != "overflow"]
        burst = [e for e in healthy if e.pool == "overflow"]
        overflow = (
            spec.labels.get(OVERFLOW_LABEL, "").lower() == "true"
            and bool(burst)
            and (only is not None or _utilisation(home) > self.overflow_at)
        )
        pools = [burst, home] if overflow else [home]
        held = self.nodes.ledger.by_node()
        loads: dict[str, NodeLoad] = {}
        for entry in healthy:
            load = entry.load(held.get(entry.name, (0, 0.0, 0)))
            if load is not None:
                loads[entry.name] = load
        out: dict[str, int] = {}
        reasons: dict[str, str] = {
            e.name: "unhealthy: " + _URL_RE.sub("<node>", e.error)
            for e in self.nodes.nodes.values()
            if not e.healthy
        }
        if not overflow:
            reasons.update({e.name: "overflow pool (the spec does not allow it)" for e in burst})
        pooled = {e.name for pool in pools for e in pool}
        room = sum(max(0, v.max_sandboxes - v.sandboxes) for k, v in loads.items() if k in pooled)
        if count > room:  # refused at once: placing one by one would cost count steps
            raise AdmissionRejected(
                f"count {count} is over the room the nodes have for {room} more sandboxes",
                reason="count",
                nodes=dict(sorted(reasons.items())),
            )
        used_overflow = False
        for _ in range(count):
            chosen = None
            for pool in pools:
                eligible = []
                for entry in pool:
                    refusal = (
                        entry.refusal(loads[entry.name], spec) if entry.name in loads else None
                    )
                    if entry.name not in loads:
                        reasons[entry.name] = "no probe yet"
                    elif refusal is not None:
                        why = str(refusal.context.get("reason"))
                        reasons[entry.name] = _REFUSALS.get(why, str(refusal))
                    else:
                        eligible.append(loads[entry.name])
                chosen = plugins.place(spec, eligible) if eligible else None
                if chosen is not None:
                    used_overflow = used_overflow or pool is burst
                    break
            if chosen is None:
                raise AdmissionRejected(
                    "no node can take the sandbox: "
                    + "; ".join(f"{n}: {r}" for n, r in sorted(reasons.items()))
                    if reasons
                    else "no node can take the sandbox: no nodes are registered",
                    reason="placement",
                    nodes=dict(sorted(reasons.items())),
                )
            out[chosen.node] = out.get(chosen.node, 0) + 1
            loads[chosen.node] = _with_one_more(loads[chosen.node], spec)
        return out, used_overflow


def _utilisation(entries: Sequence[NodeEntry]) -> float:
    """The home pool's use: the mean load of its healthy nodes (1.0 if it has none)."""
    loads = [e.probe.load.load for e in entries if e.probe is not None]
    return sum(loads) / len(loads) if loads else 1.0


def _with_one_more(load: NodeLoad, spec: SandboxSpec) -> NodeLoad:
    """``load`` once one more sandbox of ``spec`` is placed there: counted as the node counts
    one being created (``SANDBOX_START_MEMORY`` off what is available)."""
    lim = spec.limits
    available = load.memory_available
    return replace(
        load,
        sandboxes=load.sandboxes + 1,
        cpu_committed=load.cpu_committed + (0.0 if spec.qos == "be" else lim.cpu),
        memory_committed=load.memory_committed + lim.memory,
        memory_available=None if available is None else available - SANDBOX_START_MEMORY,
    )


def _node_error(entry: NodeEntry, status: int, content: bytes) -> DsecError:
    try:
        payload = json.loads(content)["error"]
        payload["type"]
    except (ValueError, KeyError, TypeError, RecursionError):
        log.warning("node %s answered %d: %r", entry.name, status, content[:300])
        return NodeUnavailable(f"node {entry.name} answered {status}", node=entry.name)
    return error_from_wire(payload)


def _retyped(err: DsecError, message: str, context: Mapping[str, Any]) -> DsecError:
    out = type(err).__new__(type(err))
    DsecError.__init__(out, message, **context)
    return out


def _check_builder(principal: Any, what: str) -> None:
    if not may_build(principal):
        raise PermissionDenied(
            f"a {principal.role} key cannot {what}: only {' and '.join(BUILD_ROLES)} keys make "
            f"builds (a build's sandboxes are labelled {BUILD_LABEL}, its layers are staged as "
            f"{STAGED_PREFIX}* until they pass QA)",
            role=principal.role,
        )


# --- the HTTP side ---------------------------------------------------------------------------


def _request_id(request: Request) -> str:
    """The request's id: set by ``ObservedRequests`` from a sane ``X-Request-Id`` (else new);
    the same id goes to the node, so one id follows the request."""
    return current_request_id() or new_request_id()


async def _body(request: Request, route: Route) -> tuple[bytes, Any]:
    """A JSON request body, read within the route's bound and decoded (``InvalidSpec`` naming
    the field, never a 500): nothing malformed goes on to a node."""
    raw = await read_json_body(request, route.max_body)
    return raw, route.decode_body(raw)


class _Relay(StreamingResponse):
    """A node's answer passed on as it arrives; the node connection is closed (or pooled)
    when it ends, and a node that breaks off mid-answer breaks ours off too."""

    def __init__(self, upstream: AsyncStreamedResponse, headers: dict[str, str]) -> None:
        self.upstream = upstream
        super().__init__(
            self._pieces(),
            upstream.status_code,
            headers=headers,
            media_type=upstream.headers.get("content-type"),
        )

    async def _pieces(self) -> AsyncIterator[bytes]:
        async with self.upstream:
            async for piece in self.upstream:
                yield piece

    async def stream_response(self, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for piece in self.body_iterator:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        except (TransportError, OSError) as e:
            log.warning("relay cut off: %s", e)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


Handler = Callable[[Gateway, Request, Any, str], Awaitable[Response]]


async def _forward(
    gw: Gateway,
    entry: NodeEntry,
    request: Request,
    route: Route,
    principal: Any,
    request_id: str,
    body: bytes | None = None,
) -> Response:
    """Pass ``request`` to ``entry`` (its body streamed, or ``body`` instead) and its answer
    back (an error answer as the caller may see it). The target is made anew from the route
    and the decoded path and query, never passed on as sent: the node reads exactly what
    was checked here."""
    target = route.target(request.path_params, route.decode_query(request.query_params))
    has_body = request.method in ("POST", "PUT")
    length = None
    if has_body:
        if body is None and route.body is not RAW:
            body = b""
        length = len(body) if body is not None else _upload_length(request, route)
    timeout = None if route.exec_timeout or route.timeout is None else route.timeout + 30
    stages = stages_of(request.scope)
    stages.mark("admit")
    t0 = time.perf_counter()
    try:
        upstream = await entry.transport.stream(
            request.method,
            target,
            body=(body if body is not None else body_pieces(request, route.max_body))
            if has_body
            else None,
            length=length if has_body else None,
            content_type=route.body_type,
            headers={REQUEST_ID: request_id},
            timeout=timeout,
        )
    except TransportError as e:
        raise gw._unreachable(entry, e) from e
    if gw.metrics:
        gw.metrics.forwarded(route.name, time.perf_counter() - t0)
    if upstream.complete or _small(upstream):  # a small answer: passed on whole, unchunked
        async with upstream:
            content = await upstream.read()
        stages.mark("node")
        stages.upstream = upstream_total(upstream.headers)
        if upstream.status_code >= 400:
            raise gw.scrub(principal, _node_error(entry, upstream.status_code, content))
        return Response(
            content,
            upstream.status_code,
            headers={REQUEST_ID: request_id},
            media_type=upstream.headers.get("content-type"),
        )
    stages.mark("node")  # its answer's head: the rest is relayed as it comes
    stages.upstream = upstream_total(upstream.headers)
    return _Relay(upstream, {REQUEST_ID: request_id})


#: An answer of at most this many bytes (by its Content-Length) is read whole and passed on
#: as one, rather than relayed piece by piece: its bytes are on their way already.
_WHOLE = 256 << 10


def _small(upstream: AsyncStreamedResponse) -> bool:
    length = upstream.headers.get("content-length", "")
    return length.isdigit() and int(length) <= _WHOLE


def _upload_length(request: Request, route: Route) -> int | None:
    """A file body's declared length, refused at once when over the route's bound (None:
    chunked, bounded as it streams by ``body_pieces``; a bound found out half-way cuts the
    node's connection, which is then never reused)."""
    text = request.headers.get("content-length", "")
    if not text.isdigit():
        return None
    check_declared(request, route.max_body)
    return int(text)


def _sandbox_handler(route: Route) -> Handler:
    async def handle(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
        sid = request.path_params["sid"]
        entry = await gw.sandbox_node(principal, sid)
        body = None
        if route.body is not None and route.body is not RAW:
            raw, message = await _body(request, route)
            changed = _in_callers_terms(gw, principal, sid, message)
            body = raw if changed is message else route.encode_body(changed)
        response = await _forward(gw, entry, request, route, principal, rid, body)
        if route.name == "kill" and response.status_code < 300:
            gw.forget(sid)
            gw.waiting.room_freed()
        return response

    return handle


def _in_callers_terms(gw: Gateway, principal: Any, sid: str, body: Any) -> Any:
    """A sandbox route's decoded body with the names it gives put in the caller's namespace,
    and what it asks checked against the caller's role; the same object if nothing changed."""
    project = principal.project
    if isinstance(body, ExecRequest) and body.trajectory is not None:
        return replace(body, trajectory=scoped(project, body.trajectory))
    if isinstance(body, PackDiffRequest):
        if body.name is not None and is_staged(body.name):
            _check_builder(principal, f"pack to a staged layer name ({body.name!r})")
        return replace(body, name=scoped(project, body.name or f"snapshot-{sid[:12]}"))
    if isinstance(body, MemorySnapshotRequest):
        return replace(body, name=scoped(project, body.name or f"{sid[:12]}-{int(time.time())}"))
    return body


async def _set_policy(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    route = ROUTES["set_policy"]
    sid, name = request.path_params["sid"], request.path_params["policy"]
    entry = await gw.sandbox_node(principal, sid)
    raw, body = await _body(request, route)
    gw.check_policies(principal, {name: body.settings}, "none", live=True)
    return await _forward(gw, entry, request, route, principal, rid, raw)


async def _create(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    t0 = time.perf_counter()
    route = ROUTES["create"]
    if principal.role not in ("admin", "member", "agent", "builder"):
        raise PermissionDenied(f"role {principal.role!r} cannot create sandboxes")
    raw = await read_json_body(request, route.max_body)
    body = gw.decoded(route, raw)
    stages = stages_of(request.scope)
    key = request.headers.get(IDEMPOTENCY_KEY, "")
    placed = _create_placed(
        gw,
        principal,
        rid,
        body,
        t0,
        time.monotonic(),
        stages,
        raw,
        check_create_key(key) if key else "",
    )
    if body.wait > 0:  # a caller that gives up leaves the queue (and the node's)
        return await unless_disconnected(request, placed)
    return await placed


async def _create_placed(
    gw: Gateway,
    principal: Any,
    rid: str,
    body: Any,
    t0: float,
    t_wait: float,
    stages: Stages,
    raw: bytes = b"",
    create_key: str = "",
) -> Response:
    """Place a create and send it to its nodes. ``create_key`` (``IDEMPOTENCY_KEY``): a
    create sent again goes to the node it went to first, which answers with what it made."""
    route = ROUTES["create"]
    spec, near = await gw.admit(principal, body.spec)
    keyed = (principal.project, create_key)
    went = gw.create_keys.get(keyed) if create_key and near is None else None
    if went is None and create_key and near is None:
        went = await gw.went_before(principal.project, create_key, rid)
    if went is not None and went in gw.nodes.nodes:
        # sent again: where it went first, or nowhere (another node would make a second)
        if not gw.nodes.nodes[went].healthy:
            raise NodeUnavailable(
                f"node {went}, where this create (key {create_key}) went first, does not "
                "answer: send it again later",
                node=went,
            )
        near = went
    stages.mark("admit")
    build = BUILD_LABEL in spec.labels
    lim = spec.limits
    memory = lim.memory + gw.memory_overhead(spec.backend)
    ledger = gw.nodes.ledger

    def place_and_hold() -> tuple[dict[str, int], bool, dict[str, Hold]]:
        # no await from the quota check to the holds: they are one step
        gw.check_quota(principal.project, body.count, lim.cpu, memory)
        shares, overflow = gw.place(spec, body.count, only=near)
        holds = {
            name: ledger.hold(principal.project, name, k, lim.cpu, memory)
            for name, k in shares.items()
        }
        return shares, overflow, holds

    batch = body.batch or (rid if body.count > 1 else "")
    shares, overflow, holds = await gw.waiting.place(
        place_and_hold, principal.project, batch, body.wait
    )
    stages.mark("place")
    if create_key and len(shares) == 1:
        gw.create_keys[keyed] = next(iter(shares))
        gw.create_keys.move_to_end(keyed)
        if len(gw.create_keys) > CREATE_KEYS:
            gw.create_keys.popitem(last=False)
    left = max(0.0, body.wait - (time.monotonic() - t_wait)) if body.wait > 0 else 0.0
    for name in shares:
        if gw.metrics:
            gw.metrics.placed(name, gw.nodes.nodes[name].pool, overflow)

    async def send(name: str, k: int) -> bytes | DsecError:
        entry = gw.nodes.nodes[name]
        # decoded and checked above: encoded without the route's check (a decode over again);
        # what a body the caller's project sent lately became is kept (admitted, it is the
        # same spec again)
        key = (raw, principal.project, k) if raw and not left else None
        content = gw._to_node.get(key) if key else None
        if content is None:
            content = dump_json(replace(body, spec=spec, count=k, wait=left).to_dict())
            if key is not None and len(raw) <= _DECODED_BYTES:
                gw._to_node[key] = content
                if len(gw._to_node) > _DECODED:
                    gw._to_node.popitem(last=False)
        try:
            return await gw._request(
                entry,
                "POST",
                route.path,
                content,
                (route.timeout or 300.0) + left,
                request_id=rid,
                stages=stages,
                headers={IDEMPOTENCY_KEY: create_key} if create_key else None,
            )
        except DsecError as e:
            return e

    try:
        if len(shares) == 1:  # the common create: awaited here, not as a task of its own
            ((name, k),) = shares.items()
            results = [await send(name, k)]
            if create_key and isinstance(results[0], DsecError):
                if not isinstance(results[0], NodeUnavailable):  # the node said no: settled
                    gw.create_keys.pop(keyed, None)
        else:
            results = await asyncio.gather(*(send(n, k) for n, k in shares.items()))
    except BaseException:
        for hold in holds.values():
            ledger.settle(hold, 0)
        raise
    finally:
        gw.waiting.room_freed()  # a refused share gave room back; the probes show the rest
    stages.mark("node")
    if len(results) == 1 and isinstance(results[0], bytes):
        # one node made them all: its answer goes back as it is, read only for the ids
        doc = json.loads(results[0])
        if not doc.get("errors"):
            made_ids = [(i["id"], i["created"]) for i in doc.get("sandboxes", ())]
            (hold,) = holds.values()
            ledger.settle(hold, len(made_ids), created=max((c for _, c in made_ids), default=None))
            for sid, _ in made_ids:
                gw._remember(sid, Owner(principal.project, build=build))
            if gw.metrics:
                gw.metrics.create_done(time.perf_counter() - t0, True)
            return Response(results[0], route.status, media_type=JSON)
    made: list[SandboxInfo] = []
    errors: list[ErrorBody] = []
    for (name, k), result in zip(shares.items(), results, strict=True):
        if isinstance(result, DsecError):
            ledger.settle(holds[name], 0)
            errors += [ErrorBody(**gw.scrub(principal, result).to_wire())] * k
            continue
        answer = route.decode_response(result)
        ledger.settle(holds[name], len(answer.sandboxes), created=_newest(answer.sandboxes))
        made += answer.sandboxes
        errors += [_scrubbed_body(gw, principal, e) for e in answer.errors]
    for info in made:
        gw._remember(info.id, Owner(principal.project, build=build))
    if gw.metrics:
        gw.metrics.create_done(time.perf_counter() - t0, not errors)
    if body.count == 1 and not made:
        first = results[0]
        err = first if isinstance(first, DsecError) else error_from_wire(errors[0].to_dict())
        raise gw.scrub(principal, err)
    merged = CreateResult(sandboxes=tuple(made), errors=tuple(errors))
    return Response(route.encode_response(merged), route.status, media_type=JSON)


def _newest(made: Sequence[SandboxInfo]) -> float | None:
    """When the newest of ``made`` was created, by its node's clock."""
    return max((i.created for i in made), default=None)


def _scrubbed_body(gw: Gateway, principal: Any, e: ErrorBody) -> ErrorBody:
    return ErrorBody(**gw.scrub(principal, error_from_wire(e.to_dict())).to_wire())


async def _fan_out(
    gw: Gateway,
    route: Route,
    target: str,
    rid: str,
    method: str | None = None,
    timeout: float | None = 60.0,
) -> list[tuple[NodeEntry, Any | DsecError]]:
    entries = gw.nodes.healthy()

    async def ask(entry: NodeEntry) -> Any:
        try:
            return route.decode_response(
                await gw._request(
                    entry, method or route.method, target, timeout=timeout, request_id=rid
                )
            )
        except DsecError as e:
            return e

    return list(zip(entries, await asyncio.gather(*(ask(e) for e in entries)), strict=True))


async def _list(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """The sandboxes the caller reaches on every healthy node: each node is asked for the
    caller's project's (with the projects below it, but for an agent key) only."""
    route = ROUTES["list"]
    mine: list[SandboxInfo] = []
    query = ListQuery(project=principal.project, subtree=principal.role != "agent")
    for _entry, answer in await _fan_out(gw, route, route.target({}, query), rid):
        if isinstance(answer, DsecError):
            continue  # a node that stopped answering since its last probe: the watcher tells
        for info in answer.sandboxes:
            owner = Owner.of_labels(info.labels)
            gw._remember(info.id, owner)
            if gw.reach.allows(principal, owner):
                mine.append(info)
    mine.sort(key=lambda i: (i.created, i.id))
    return Response(route.encode_response(SandboxList(tuple(mine))), media_type=JSON)


async def _node_info(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """The apiserver as a node: the sums of its healthy nodes; of sandboxes, those of the
    projects the caller reaches."""
    healthy = [e for e in gw.nodes.healthy() if e.probe is not None]
    loads = [e.probe.load for e in healthy if e.probe is not None]
    usage = gw.usage_by_project()
    status = NodeStatus(
        version=__version__,
        pid=os.getpid(),
        home=f"apiserver:{len(healthy)}/{len(gw.nodes.nodes)} nodes",
        sandboxes=sum(u.sandboxes for p, u in usage.items() if gw.iam.can_reach(principal, p)),
        capacity=NodeCapacity(
            cpu=sum(load.cpu_capacity for load in loads),
            memory=sum(load.memory_capacity for load in loads),
            sandboxes=sum(load.max_sandboxes for load in loads),
        ),
        backends=tuple(sorted({b for load in loads for b in load.backends})),
        layer_sources=(),
    )
    return Response(ROUTES["node_info"].encode_response(status), media_type=JSON)


async def _openapi(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    return Response(dump_json(openapi_document(IAM_ROUTES)), media_type=JSON)


async def _probe(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    raise NotFound(
        "an apiserver has no probe of its own: ask `dsec apiserver nodes`, or a node directly"
    )


# --- leases ----------------------------------------------------------------------------------


def _lease_answer(gw: Gateway, content: bytes) -> Response:
    """A node's ``LeaseInfo`` with the holder as its taker named it (its tag off)."""
    route = ROUTES["lease_get"]
    info: LeaseInfo = route.decode_response(content)
    return Response(
        route.encode_response(replace(info, holder=strip_tag(info.holder))), media_type=JSON
    )


async def _lease(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """A new lease: its sandboxes must all be ones the caller reaches, on one node; its
    holder is put in the caller's namespace, which makes the lease the caller's project's."""
    route = ROUTES["lease"]
    _, body = await _body(request, route)
    nodes = {(await gw.sandbox_node(principal, sid)).name for sid in body.sandboxes}
    if len(nodes) != 1:
        raise InvalidSpec(
            f"a lease's sandboxes must be on one node; these are on {sorted(nodes)}",
            field="sandboxes",
        )
    entry = gw.nodes.nodes[nodes.pop()]
    content = route.encode_body(replace(body, holder=scoped(principal.project, body.holder)))
    answer = await gw._request(entry, "POST", route.path, content, request_id=rid)
    response = _lease_answer(gw, answer)
    response.status_code = route.status
    return response


def _lease_handler(route: Route) -> Handler:
    """get, renew, release: of a lease the caller's project (or one it reaches) took."""

    async def handle(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
        lease_id = request.path_params["lease"]
        entry = await gw.lease_node(principal, lease_id)
        query = route.decode_query(request.query_params) if route.query else None
        target = route.target({"lease": lease_id}, query)
        content = await gw._request(entry, route.method, target, request_id=rid)
        if route.name == "lease_release":
            gw.forget("lease:" + lease_id)
            if query is not None and query.kill:
                for sid in ROUTES["lease_get"].decode_response(content).sandboxes:
                    gw.forget(sid)
        return _lease_answer(gw, content)

    return handle


# --- trajectories and memory snapshots: names a project chose ---------------------------------


async def _trajectory_sources(
    gw: Gateway, principal: Any, name: str
) -> list[tuple[NodeEntry | None, str]]:
    """Where trajectory ``name`` of the caller may be: its own namespace on every node, and,
    when ``name`` is the id of a driving sandbox the caller reaches, that sandbox's own log
    on its node (the node names a driver's log by its id when the spec names none)."""
    out: list[tuple[NodeEntry | None, str]] = [(None, scoped(principal.project, name))]
    _, sep, node = name.rpartition("-")
    if sep and node in gw.nodes.nodes:
        try:
            out.append((await gw.sandbox_node(principal, name), name))
        except DsecError:
            pass
    return out


async def _trajectory(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """A trajectory log, from the node that has it (the longest one, if several do)."""
    route = ROUTES["trajectory"]
    name = request.path_params["trajectory"]
    best: tuple[Any, ...] = ()
    for only, node_name in await _trajectory_sources(gw, principal, name):
        target = route.target({"trajectory": node_name})
        for entry, answer in await _fan_out(gw, route, target, rid):
            if only is not None and entry is not only:
                continue
            if isinstance(answer, DsecError) and not isinstance(answer, NotFound):
                raise gw.scrub(principal, answer)
            if isinstance(answer, Trajectory) and len(answer.entries) > len(best):
                best = answer.entries
    return Response(route.encode_response(Trajectory(name=name, entries=best)), media_type=JSON)


async def _remove_trajectory(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """Remove the caller's trajectory log from every node that has it."""
    route = ROUTES["remove_trajectory"]
    name = request.path_params["trajectory"]
    removed = False
    for only, node_name in await _trajectory_sources(gw, principal, name):
        target = route.target({"trajectory": node_name})
        for entry, answer in await _fan_out(gw, route, target, rid):
            if only is not None and entry is not only:
                continue
            if isinstance(answer, DsecError) and not isinstance(answer, NotFound):
                raise gw.scrub(principal, answer)
            removed = removed or not isinstance(answer, DsecError)
    if not removed:
        raise missing("trajectory", name)
    return Response(dump_json({"removed": name}), media_type=JSON)


async def _remove_memory_snapshot(
    gw: Gateway, request: Request, principal: Any, rid: str
) -> Response:
    """Remove a memory snapshot of a project the caller reaches (named as made: tag and
    all), from the node that holds it."""
    route = ROUTES["remove_memory_snapshot"]
    name = request.path_params["snapshot"]
    owner = gw.reach.owner_of_name(name, principal)
    gw.reach.require(principal, "snapshot", name, owner)
    if not gw.reach.may_change(principal, owner):
        raise PermissionDenied(
            f"memory snapshot {name!r} is shared by every project: only the operator's keys "
            "(an admin key of the root project) remove it",
            role=principal.role,
        )
    for entry in gw.nodes.healthy():
        try:
            answer = await gw._request(
                entry, "DELETE", route.target({"snapshot": name}), None, 60, rid
            )
        except NotFound:
            continue
        return Response(answer, route.status, media_type=JSON)
    raise missing("snapshot", name)


# --- what makes sandboxes besides create: restore, fncall, judge ------------------------------


async def _restore(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """A restore of a snapshot of a project the caller reaches, on the node that holds it
    (the first that does not say it has no such snapshot), the sandboxes it makes counted
    against the caller's quotas (a memory snapshot's at its saved sandbox's limits, which its
    restores take whatever the request says) and labelled with its project."""
    route = ROUTES["restore"]
    _, body = await _body(request, route)
    if is_staged(body.snapshot):
        _check_builder(principal, f"restore the staged layer {body.snapshot!r}")
    gw.check_layer(principal, body.snapshot, "snapshot")
    in_memory = "@" not in body.snapshot  # a memory snapshot's name has no @version
    given = body.spec or SandboxSpec(layers=(body.snapshot if not in_memory else "x@0",))
    spec, _near = await gw.admit(principal, given)
    build = BUILD_LABEL in spec.labels
    entries = gw.nodes.healthy()
    lim = spec.limits
    cpu, memory, backend = lim.cpu, lim.memory, spec.backend
    if in_memory:
        entry, snap = await gw.memory_snapshot(principal, body.snapshot, rid)
        saved = SandboxSpec.from_dict(snap.spec)
        cpu, memory, backend = saved.limits.cpu, saved.limits.memory, snap.backend
        entries = [entry]
    memory += gw.memory_overhead(backend)
    gw.check_quota(principal.project, body.count, cpu, memory)
    node = entries[0].name if in_memory else None
    hold = gw.nodes.ledger.hold(principal.project, node, body.count, cpu, memory)
    raw = route.encode_body(replace(body, spec=spec))
    other: NotFound | None = None  # a node that has the snapshot but lacks something else
    try:
        for entry in entries:
            try:
                answer = await gw._request(entry, "POST", route.path, raw, route.timeout, rid)
            except NotFound as e:
                if e.context.get("name") not in (body.snapshot, body.snapshot.partition("@")[0]):
                    other = other or e
                continue
            made = route.decode_response(answer).sandboxes
            gw.nodes.ledger.settle(
                hold,
                len(made),
                node=entry.name,
                created=_newest(made),
                cpu=sum(float(i.limits.get("cpu") or 0) for i in made),
                memory=sum(
                    int(i.limits.get("memory") or 0) + gw.memory_overhead(i.backend) for i in made
                ),
            )
            for info in made:
                gw._remember(info.id, Owner(principal.project, build=build))
            return Response(answer, route.status, media_type=JSON)
    except BaseException:
        gw.nodes.ledger.settle(hold, 0)
        raise
    gw.nodes.ledger.settle(hold, 0)
    raise gw.scrub(principal, other) if other else missing("snapshot", body.snapshot)


async def _memory_snapshot(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """A memory snapshot of a project the caller reaches, from the node that holds it."""
    _, snap = await gw.memory_snapshot(principal, request.path_params["snapshot"], rid)
    return Response(ROUTES["memory_snapshot"].encode_response(snap), media_type=JSON)


#: How many (project, environment) -> node pool homes are remembered.
_POOL_HOMES = 100_000


def _placed_handler(route: Route) -> Handler:
    """fncall, judge: in a pool of the caller's project (``Gateway.on_pool_node``)."""

    async def handle(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
        _, body = await _body(request, route)
        project = principal.project
        timeout = None if route.timeout is None or route.exec_timeout else route.timeout + 30

        def to_node(start: bool) -> tuple[str, bytes | None]:
            return route.path, route.encode_body(replace(body, project=project, start=start))

        answer = await gw.on_pool_node(
            project,
            body.environment,
            float(body.cpu),
            parse_size(body.memory, "memory") or 0,
            to_node,
            timeout,
            rid,
        )
        return Response(answer, route.status, media_type=JSON)

    return handle


# --- layers ----------------------------------------------------------------------------------


async def _layers(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """Every healthy node's layers, each once, without those the caller does not reach
    (another project's snapshots; staged layers but to ``BUILD_ROLES`` keys)."""
    route = ROUTES["layers"]
    seen: dict[tuple[str, str, str], Any] = {}
    answered = False
    for _entry, answer in await _fan_out(gw, route, route.path, rid):
        if isinstance(answer, DsecError):
            continue
        answered = True
        for info in answer.layers:
            if gw._shows(principal, info.ref):
                seen.setdefault((info.name, info.version, info.digest), info)
    if not answered:
        raise NodeUnavailable("no healthy node to ask")
    kept = tuple(sorted(seen.values(), key=lambda i: (i.name, i.version)))
    return Response(route.encode_response(LayerList(layers=kept)), media_type=JSON)


async def _prefetch(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """Warm layers the caller reaches on every healthy node; the first node's answer is
    returned."""
    route = ROUTES["prefetch"]
    if principal.role == "agent":
        raise PermissionDenied("an agent key cannot prefetch layers")
    raw, body = await _body(request, route)
    for ref in body.refs:
        gw.check_layer(principal, ref)
    answer = await _on_every_node(gw, route, raw, principal, rid, "warm the layers")
    # which kind of source warmed each layer, not where the node keeps it
    result = route.decode_response(answer)
    rows = tuple(replace(r, source=r.source.partition(":")[0]) for r in result.layers)
    content = route.encode_response(replace(result, layers=rows))
    return Response(content, route.status, media_type=JSON)


async def _warm(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """The nodes' warm pools (``dsec_core.node.warm``) are the operator's (an admin key of the
    root project): a read answers with the first healthy node's pools, a change goes to every
    healthy node at once (the first node's answer is returned)."""
    route = ROUTES["set_warm" if request.method == "PUT" else "warm"]
    if principal.project != ROOT or principal.role != "admin":
        raise PermissionDenied(
            "the nodes' warm pools are the operator's: they need an admin key of the root "
            "project (/)",
            role=principal.role,
        )
    raw = (await _body(request, route))[0] if route.body is not None else b""
    answer = await _on_every_node(
        gw, route, raw, principal, rid, "keep sandboxes warm", method=route.method
    )
    return Response(answer, route.status, media_type=JSON)


async def _on_every_node(
    gw: Gateway,
    route: Route,
    raw: bytes,
    principal: Any,
    rid: str,
    what: str,
    method: str = "POST",
) -> bytes:
    """POST ``raw`` to ``route`` on every healthy node at once (what each node must hold, not
    a placement); the first node's answer that came, else the first node's error, scrubbed
    for the caller."""
    entries = gw.nodes.healthy()
    if not entries:
        raise NodeUnavailable(f"no healthy node to {what}")
    answers = await asyncio.gather(
        *(gw._request(e, method, route.path, raw or None, None, rid) for e in entries),
        return_exceptions=True,
    )
    for answer in answers:
        if isinstance(answer, bytes):
            return answer
    first = answers[0]
    raise (
        gw.scrub(principal, first)
        if isinstance(first, DsecError)
        else NodeUnavailable(f"no node could {what}")
    )


async def _resolve_image(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """Make a docker image into a base layer on every healthy node (a template built over it
    may run on any of them); the first node's answer that has it is returned. Builds'
    business: a builder or admin key."""
    route = ROUTES["resolve_image"]
    raw, _body_msg = await _body(request, route)  # a bad body is 422 whoever sends it
    _check_builder(principal, "resolve images into layers")
    answer = await _on_every_node(gw, route, raw, principal, rid, "resolve the image")
    return Response(answer, route.status, media_type=JSON)


_SPECIAL: dict[str, Handler] = {
    "create": _create,
    "list": _list,
    "node_info": _node_info,
    "openapi": _openapi,
    "probe": _probe,
    "restore": _restore,
    "layers": _layers,
    "prefetch": _prefetch,
    "resolve_image": _resolve_image,
    "warm": _warm,
    "set_warm": _warm,
    "lease": _lease,
    "set_policy": _set_policy,
    "trajectory": _trajectory,
    "remove_trajectory": _remove_trajectory,
    "memory_snapshot": _memory_snapshot,
    "remove_memory_snapshot": _remove_memory_snapshot,
}


def _handler(route: Route) -> Handler:
    if route.name in _SPECIAL:
        return _SPECIAL[route.name]
    if "sid" in route.params:
        return _sandbox_handler(route)
    if route.name.startswith("lease_"):
        return _lease_handler(route)
    if route.name in ("fncall", "judge"):
        return _placed_handler(route)
    raise AssertionError(f"route {route.name} has no apiserver handler")


def _endpoint(gw: Gateway, route: Route) -> Callable[[Request], Awaitable[Response]]:
    handler = _handler(route)

    async def endpoint(request: Request) -> Response:
        rid = _request_id(request)
        principal = request.scope[PRINCIPAL]
        try:
            if route.query is not None or request.scope.get("query_string"):
                route.decode_query(request.query_params)  # 422 here, not from a node
            response = await handler(gw, request, principal, rid)
        except DsecError as e:
            return error_response(gw.scrub(principal, e), {REQUEST_ID: rid})
        response.headers.setdefault(REQUEST_ID, rid)
        stages = stages_of(request.scope)
        stages.mark("relay" if "node" in stages.durations else "admit")
        response.headers["server-timing"] = stages.header()
        return response

    return endpoint


class _Direct:
    """The create route's requests go to its endpoint directly, the rest through Starlette's
    stack: what the route table gives a create (its route in the scope, its endpoint's
    answer) without the five layers it takes to find it, each wrapping ``send`` (at a
    thousand creates a second they were a tenth of the apiserver's work). Its endpoint
    answers every ``DsecError`` and an ``HTTPException`` is answered as the router's handler
    would; anything else goes on to the server, as Starlette's error layer passes it on
    (uvicorn answers 500 and logs it)."""

    def __init__(self, app: Any, route: StarletteRoute) -> None:
        self.app = app
        self.route = route
        self.method = next(iter(route.methods or ()), "POST")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = self.route
        if (
            scope["type"] == "http"
            and scope["path"] == route.path
            and scope["method"] == self.method
            and not scope.get("root_path")
        ):
            scope["route"] = route
            scope["endpoint"] = route.endpoint
            scope["path_params"] = {}
            request = Request(scope, receive, send)
            try:
                response = await route.endpoint(request)
            except HTTPException as e:  # as the router's own handler answers it
                response = await on_http_error(request, e)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def make_app(
    gw: Gateway,
    lifespan: Any = None,
    extra_routes: Sequence[Any] = (),
    refusal: Refusal | None = None,
) -> Starlette:
    """The apiserver's ASGI app: every route of the node API, over ``gw``'s nodes, and
    ``GET /metrics`` (for keys of the root project: the operator's) when ``gw.metrics`` is an
    ``ApiserverMetrics``. Every request's key is checked first (``Authenticated``);
    ``refusal`` answers refused requests of ``extra_routes`` in their own shape."""

    # Starlette tries its routes in order: the ones most requests take go first (exec was
    # the 20th), the rest keep theirs. No other route's pattern matches their paths.
    table = sorted(ROUTES.values(), key=lambda r: r.name not in _HOT_ROUTES)
    routes = [StarletteRoute(r.path, _endpoint(gw, r), methods=[r.method]) for r in table]
    (create,) = (r for r, t in zip(routes, table, strict=True) if t.name == "create")
    routes.append(run_code_route(gw))  # SandboxFusion's POST /run_code (dsec_core.fusion)
    app = Starlette(
        routes=[*routes, *iam_routes(gw.iam), *extra_routes],
        lifespan=lifespan,
        exception_handlers={HTTPException: on_http_error},
    )
    app.router.redirect_slashes = False
    metrics = gw.metrics if isinstance(gw.metrics, ApiserverMetrics) else None

    def may_scrape(scope: Any) -> bool:
        # the metrics show every tenant's traffic: the operator's (the root project's) only
        principal = gw.iam.authenticate(request_key(scope["headers"]))
        if principal.project != ROOT:
            raise PermissionDenied(
                "the apiserver's metrics are the operator's: they need a key of the root "
                "project (/)",
                role=principal.role,
            )
        return True

    app.middleware_stack = ObservedRequests(
        Authenticated(_Direct(app.build_middleware_stack(), create), gw.iam.authenticate, refusal),
        logger="dsec.apiserver.access",
        metrics=metrics,
        metrics_allowed=may_scrape,
    )
    return app
