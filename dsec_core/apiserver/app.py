"""The apiserver's HTTP app: the node API's route table, served over many nodes.

Every request carries an API key (``Authorization: Bearer <key>`` or ``X-API-Key``), checked by
IAM. Then, by route:

- routes of one sandbox (``/v1/sandboxes/{sid}/...``) go to the node named by the id's suffix,
  once the sandbox is known to be the caller's project's (its ``dsec.project`` label, looked up
  once and remembered); another project's sandbox, a made-up id, or a node nobody registered
  are all ``UnknownSandbox`` (404), so ids do not leak. The request and the answer stream
  through without being read whole (exec output, file bodies);
- ``create`` sets the caller's project label, checks the project's quotas (and its ancestors')
  against the nodes' probes, places each sandbox with the ``dsec_place`` hook over the healthy
  nodes (the home pool, or the overflow pool for a spec that allows it once the home pool is
  over ``overflow_at``) and sends each node its share at once;
- ``list`` asks every healthy node and keeps the caller's sandboxes;
- builds: only admin and builder keys may create (or restore) a sandbox labelled
  ``dsec.build`` (``BUILD_LABEL``), name a build's staged layer (``staged-*``,
  ``STAGED_PREFIX``) in a create or restore, or pack_diff to a staged name; to every other key
  a build's sandbox is as another project's (404, not listed) and staged layers are not listed;
- leases route by their id's suffix as sandboxes do; fncall, judge and prefetch go where
  placement says; trajectories, memory snapshots and restores go to the node that has them.

The apiserver holds no sandbox state: killed and restarted, it learns everything again from
the nodes, and several run side by side against the same nodes.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route as StarletteRoute

from .. import __version__, plugins
from ..api.messages import (
    CreateRequest,
    CreateResult,
    ErrorBody,
    NodeCapacity,
    NodeStatus,
    SandboxList,
)
from ..api.openapi import openapi_document
from ..api.routes import JSON, ROUTES, Route, dump_json
from ..api.serving import error_response, on_http_error, read_json_body
from ..api.transport import AsyncStreamedResponse, TransportError
from ..errors import (
    AdmissionRejected,
    DsecError,
    InvalidSpec,
    NodeLost,
    NodeUnavailable,
    NotFound,
    PermissionDenied,
    UnknownLease,
    UnknownSandbox,
    UnknownSnapshot,
    error_from_wire,
)
from ..iam import Principal, Usage
from ..observe import ApiserverMetrics, ObservedRequests, current_request_id, new_request_id
from ..records import (
    BUILD_LABEL,
    PROJECT_LABEL,
    SANDBOX_START_MEMORY,
    STAGED_PREFIX,
    NodeLoad,
    SandboxInfo,
    SandboxSpec,
)
from .nodes import NodeEntry, NodeSet

__all__ = [
    "BUILD_ROLES",
    "OVERFLOW_LABEL",
    "Authority",
    "Gateway",
    "Metrics",
    "is_staged",
    "make_app",
    "may_build",
]

log = logging.getLogger("dsec.apiserver")

#: A spec carrying this label with the value ``true`` may run in the overflow pool (DSec's
#: cloud burst) when the home pool is over ``overflow_at`` of its capacity.
OVERFLOW_LABEL = "dsec.overflow"
#: Labels a client may not set: the apiserver sets them.
_RESERVED = (PROJECT_LABEL,)
#: Roles whose keys may make builds: create build sandboxes (``BUILD_LABEL``), see them, and
#: pack to, create from and restore staged layers (``STAGED_PREFIX``).
BUILD_ROLES = ("admin", "builder")
#: A project's scope tag on a name (``scope_tag``), as pack_diff through an apiserver adds it.
_TAG_RE = re.compile(r"^p[0-9a-f]{10}-")
#: How many sandbox -> project answers are remembered (a sandbox's project never changes).
_PROJECT_CACHE = 200_000
#: The request id header, set on every request forwarded to a node.
REQUEST_ID = "x-request-id"


class Authority(Protocol):
    """What the apiserver asks IAM (``dsec_core.iam.Iam``)."""

    def authenticate(self, secret: str | None) -> Principal: ...

    def can_reach(self, principal: Principal, project: str) -> bool: ...

    def check_quota(self, project: str, usage: Mapping[str, Usage], add: Usage) -> None: ...

    def projects(self, under: str | None = None) -> list[Any]: ...


class Metrics(Protocol):
    """What the apiserver reports (``dsec_core.observe.ApiserverMetrics``); None: nothing."""

    def create_done(self, seconds: float, ok: bool) -> None: ...

    def placed(self, node: str, pool: str, overflow: bool) -> None: ...

    def forwarded(self, route: str, seconds: float) -> None: ...


@dataclass
class Gateway:
    """The apiserver's state: its nodes, its IAM, its settings. Nothing here outlives a
    restart but the caches."""

    nodes: NodeSet
    iam: Authority
    overflow_at: float = 0.8
    metrics: Metrics | None = None

    def __post_init__(self) -> None:
        # sandbox id -> (its project, whether it is a build's)
        self._projects: collections.OrderedDict[str, tuple[str | None, bool]] = (
            collections.OrderedDict()
        )
        self._usage: dict[str, tuple[int, float, int]] = {}
        self._usage_version: tuple[int, tuple[str, ...]] | None = None

    # --- who asks, and what they may reach ------------------------------------------------
    def principal(self, request: Request) -> Any:
        header = request.headers.get("authorization")
        secret = None
        if header is not None:
            scheme, _, value = header.partition(" ")
            secret = value.strip() if scheme.lower() == "bearer" else None
        secret = secret or request.headers.get("x-api-key")
        return self.iam.authenticate(secret)

    def node_of(self, resource_id: str, what: str = "sandbox") -> NodeEntry:
        """The registered node a sandbox (or lease) id names, or the not-found error a
        made-up id gets; ``NodeLost`` if that node is not answering."""
        _, sep, name = resource_id.rpartition("-")
        entry = self.nodes.get(name) if sep else None
        if entry is None:
            if what == "lease":
                raise UnknownLease(f"no lease {resource_id!r}", name=resource_id)
            raise UnknownSandbox(f"no sandbox {resource_id!r}", name=resource_id)
        if not entry.healthy:
            raise NodeLost(
                f"node {entry.name}, which holds {what} {resource_id}, is not answering "
                f"({entry.error}); its state is unknown until it is back",
                node=entry.name,
                sandbox=resource_id,
            )
        return entry

    async def owner_of(self, entry: NodeEntry, sid: str) -> tuple[str | None, bool]:
        """The sandbox's project label, and whether it is a build's (``BUILD_LABEL``)."""
        if sid in self._projects:
            self._projects.move_to_end(sid)
            return self._projects[sid]
        r = await self._request(entry, "GET", "/v1/sandboxes/" + quote(sid, safe=""))
        info = ROUTES["get"].decode_response(r)
        project = info.labels.get(PROJECT_LABEL)
        build = BUILD_LABEL in info.labels
        self._remember(sid, project, build)
        return project, build

    def _remember(self, sid: str, project: str | None, build: bool = False) -> None:
        self._projects[sid] = (project, build)
        if len(self._projects) > _PROJECT_CACHE:
            self._projects.popitem(last=False)

    def forget(self, sid: str) -> None:
        self._projects.pop(sid, None)

    def reaches(self, principal: Any, project: str | None) -> bool:
        return project is not None and self.iam.can_reach(principal, project)

    def sees(self, principal: Any, project: str | None, build: bool) -> bool:
        """Whether the caller may see a sandbox of ``project``: one it reaches, and if the
        sandbox is a build's, only with a key of a ``BUILD_ROLES`` role."""
        return self.reaches(principal, project) and (not build or may_build(principal))

    async def sandbox_node(self, principal: Any, sid: str) -> NodeEntry:
        """The node of a sandbox the caller may touch; ``UnknownSandbox`` otherwise."""
        entry = self.node_of(sid)
        if not self.sees(principal, *await self.owner_of(entry, sid)):
            raise UnknownSandbox(f"no sandbox {sid!r}", name=sid)
        return entry

    # --- talking to nodes -----------------------------------------------------------------
    async def _request(
        self,
        entry: NodeEntry,
        method: str,
        target: str,
        body: bytes | None = None,
        timeout: float | None = 60.0,
        request_id: str | None = None,
    ) -> bytes:
        """A small request to a node; its 2xx body, or the node's typed error raised."""
        try:
            async with await entry.transport.stream(
                method,
                target,
                body=body,
                content_type=JSON if body is not None else None,
                headers={REQUEST_ID: request_id} if request_id else None,
                timeout=timeout,
            ) as r:
                content = await r.read()
        except TransportError as e:
            raise self._unreachable(entry, e) from e
        if r.status_code >= 300:
            raise _node_error(entry, r.status_code, content)
        return content

    def _unreachable(self, entry: NodeEntry, e: Exception) -> DsecError:
        return NodeUnavailable(
            f"node {entry.name} did not answer: {e}", node=entry.name, address=entry.address.url
        )

    # --- placement ------------------------------------------------------------------------
    def usage_by_project(self) -> dict[str, Usage]:
        """Every project's live sandboxes over the healthy nodes (last probe plus what was
        placed since), for quotas. The probes' sums are made once per watcher round, not per
        request: at 160 nodes and many projects that is the costly part."""
        healthy = self.nodes.healthy()
        version = (self.nodes.round, tuple(e.name for e in healthy))
        if self._usage_version != version:
            totals: dict[str, tuple[int, float, int]] = {}
            for entry in healthy:
                assert entry.probe is not None
                for p, u in entry.probe.projects.items():
                    n, c, m = totals.get(p, (0, 0.0, 0))
                    totals[p] = (n + u.sandboxes, c + u.cpu, m + u.memory)
            self._usage, self._usage_version = totals, version
        totals = dict(self._usage)
        for entry in healthy:
            for p, (dn, dc, dm) in entry.pending.items():
                n, c, m = totals.get(p, (0, 0.0, 0))
                totals[p] = (n + dn, c + dc, m + dm)
        return {p: Usage(n, c, m) for p, (n, c, m) in totals.items()}

    def place(self, spec: SandboxSpec, count: int) -> tuple[dict[str, int], bool]:
        """How many of ``count`` sandboxes go to each node (by name), and whether they
        overflowed; ``AdmissionRejected`` with each node's reason if some cannot be placed."""
        healthy = self.nodes.healthy()
        home = [e for e in healthy if e.pool != "overflow"]
        burst = [e for e in healthy if e.pool == "overflow"]
        overflow = (
            spec.labels.get(OVERFLOW_LABEL, "").lower() == "true"
            and bool(burst)
            and _utilisation(home) > self.overflow_at
        )
        pools = [burst, home] if overflow else [home]
        loads: dict[str, NodeLoad] = {}
        for entry in healthy:
            load = entry.load()
            if load is not None:
                loads[entry.name] = load
        out: dict[str, int] = {}
        reasons: dict[str, str] = {
            e.name: f"unhealthy: {e.error}" for e in self.nodes.nodes.values() if not e.healthy
        }
        if not overflow:
            reasons.update({e.name: "overflow pool (the spec does not allow it)" for e in burst})
        used_overflow = False
        for _ in range(count):
            chosen = None
            for pool in pools:
                eligible = []
                for entry in pool:
                    refusal = loads[entry.name].refusal(spec) if entry.name in loads else None
                    if entry.name not in loads:
                        reasons[entry.name] = "no probe yet"
                    elif refusal is not None:
                        reasons[entry.name] = str(refusal)
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
    except (ValueError, KeyError, TypeError):
        return NodeUnavailable(
            f"node {entry.name} answered {status}: {content[:300]!r}", node=entry.name
        )
    return error_from_wire(payload)


# --- the HTTP side ---------------------------------------------------------------------------


def _request_id(request: Request) -> str:
    """The request's id: set by ``ObservedRequests`` from a sane ``X-Request-Id`` (else new);
    the same id goes to the node, so one id follows the request."""
    return current_request_id() or new_request_id()


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
    request_id: str,
    body: bytes | None = None,
    path: str | None = None,
) -> Response:
    """Pass ``request`` to ``entry`` (its body streamed, or ``body`` instead; at ``path``
    instead of its own) and its answer back."""
    raw = request.scope.get("raw_path")
    target = path or (raw.decode("latin-1") if raw else quote(request.url.path))
    if request.url.query:
        target += "?" + request.url.query
    length_text = request.headers.get("content-length")
    has_body = request.method in ("POST", "PUT")
    length = int(length_text) if length_text and length_text.isdigit() else None
    if body is not None:
        length = len(body)
    timeout = None if route.exec_timeout or route.timeout is None else route.timeout + 30
    t0 = time.perf_counter()
    try:
        upstream = await entry.transport.stream(
            request.method,
            target,
            body=(body if body is not None else request.stream()) if has_body else None,
            length=length if has_body else None,
            content_type=request.headers.get("content-type"),
            headers={REQUEST_ID: request_id},
            timeout=timeout,
        )
    except TransportError as e:
        raise gw._unreachable(entry, e) from e
    if gw.metrics:
        gw.metrics.forwarded(route.name, time.perf_counter() - t0)
    if upstream.complete:  # a small answer, all in already: pass it on whole (no chunking)
        async with upstream:
            content = await upstream.read()
        return Response(
            content,
            upstream.status_code,
            headers={REQUEST_ID: request_id},
            media_type=upstream.headers.get("content-type"),
        )
    return _Relay(upstream, {REQUEST_ID: request_id})


def _sandbox_handler(route: Route) -> Handler:
    async def handle(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
        sid = request.path_params["sid"]
        entry = await gw.sandbox_node(principal, sid)
        body = None
        if route.name in _SCOPED_BODIES:
            body = await _scope_body(gw, route, request, principal, sid)
        response = await _forward(gw, entry, request, route, rid, body)
        if route.name == "kill" and response.status_code < 300:
            gw.forget(sid)
        return response

    return handle


# --- what a project names on a node: snapshots and trajectories ------------------------------
#
# Layers, memory snapshots and trajectory logs are named by their makers, and nodes have no
# projects: through an apiserver, a project's names get its tag in front (``scope_tag``), so
# another project can neither restore its snapshots nor read or replay its trajectories,
# guessed names included. The tag is a digest, not the path: names stay short.

#: Routes whose JSON body names something of the caller's project.
_SCOPED_BODIES = ("exec", "pack_diff", "snapshot_memory")


def scope_tag(project: str) -> str:
    """The short tag of ``project`` that prefixes what it names on nodes."""
    return "p" + hashlib.sha256(project.encode()).hexdigest()[:10]


def _scoped(project: str, name: str) -> str:
    return f"{scope_tag(project)}-{name}"


async def _scope_body(
    gw: Gateway, route: Route, request: Request, principal: Any, sid: str
) -> bytes:
    """The request's JSON body with the names it gives scoped to the caller's project (the
    body is small: it is read whole, up to ``MAX_BODY``)."""
    raw = await read_json_body(request)
    if route.name == "exec" and b'"trajectory"' not in raw:
        return raw  # the hot path: nothing named
    body = route.decode_body(raw)
    project = principal.project
    if route.name == "exec" and body.trajectory is not None:
        body = replace(body, trajectory=_scoped(project, body.trajectory))
    elif route.name == "pack_diff":
        if body.name is not None and is_staged(body.name):
            _check_builder(principal, f"pack to a staged layer name ({body.name!r})")
        body = replace(body, name=_scoped(project, body.name or f"snapshot-{sid[:12]}"))
    elif route.name == "snapshot_memory":
        body = replace(body, name=_scoped(project, body.name or f"{sid[:12]}-{int(time.time())}"))
    encoded = route.encode_body(body)
    assert encoded is not None
    return encoded


def _owner_reachable(gw: Gateway, principal: Any, name: str) -> bool:
    """Whether ``name`` (a snapshot's, as scoped) was made by a project the caller reaches."""
    tag = name.partition("-")[0]
    if principal.role == "agent":
        return tag == scope_tag(principal.project)
    projects = [p.path for p in gw.iam.projects(under=principal.project)]
    return tag in {scope_tag(p) for p in (*projects, principal.project)}


def may_build(principal: Any) -> bool:
    """Whether ``principal``'s key may make builds (``BUILD_ROLES``)."""
    return principal.role in BUILD_ROLES


def is_staged(name: str) -> bool:
    """Whether layer ``name`` (or ``name@version``) is a build's staged output: its name, as
    given or as an apiserver scoped it (``scope_tag``), starts with ``STAGED_PREFIX``."""
    bare = _TAG_RE.sub("", name.partition("@")[0], count=1)
    return bare.startswith(STAGED_PREFIX)


def _check_builder(principal: Any, what: str) -> None:
    if not may_build(principal):
        raise PermissionDenied(
            f"a {principal.role} key cannot {what}: only {' and '.join(BUILD_ROLES)} keys make "
            f"builds (a build's sandboxes are labelled {BUILD_LABEL}, its layers are staged as "
            f"{STAGED_PREFIX}* until they pass QA)",
            role=principal.role,
        )


def _check_build_spec(principal: Any, spec: SandboxSpec) -> None:
    """``PermissionDenied`` unless the caller may make builds, for a spec labelled
    ``BUILD_LABEL`` or naming a staged layer."""
    if BUILD_LABEL in spec.labels:
        _check_builder(principal, f"create a build sandbox (labelled {BUILD_LABEL})")
    for ref in spec.layers:
        if is_staged(ref):
            _check_builder(principal, f"use the staged layer {ref!r}")


async def _create(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    t0 = time.perf_counter()
    route = ROUTES["create"]
    if principal.role not in ("admin", "member", "agent", "builder"):
        raise PermissionDenied(f"role {principal.role!r} cannot create sandboxes")
    raw_body = await read_json_body(request)
    body: CreateRequest = route.decode_body(raw_body)  # 422 with the field's path
    _check_build_spec(principal, body.spec)
    build = BUILD_LABEL in body.spec.labels
    labels = {k: v for k, v in body.spec.labels.items() if k not in _RESERVED}
    labels[PROJECT_LABEL] = principal.project
    spec = replace(body.spec, labels=labels)
    # what goes to the nodes: the body as sent, its labels replaced (checked above already)
    doc = json.loads(raw_body)
    doc["spec"]["labels"] = labels
    lim = spec.limits
    gw.iam.check_quota(
        principal.project,
        gw.usage_by_project(),
        Usage(body.count, body.count * lim.cpu, body.count * lim.memory),
    )
    shares, overflow = gw.place(spec, body.count)
    for name, k in shares.items():
        entry = gw.nodes.nodes[name]
        entry.placed(principal.project, k, lim.cpu, lim.memory)
        if gw.metrics:
            gw.metrics.placed(name, entry.pool, overflow)

    async def send(name: str, k: int) -> bytes | DsecError:
        entry = gw.nodes.nodes[name]
        content = dump_json({**doc, "count": k})
        try:
            return await gw._request(
                entry, "POST", route.path, content, route.timeout, request_id=rid
            )
        except DsecError as e:
            return e

    t_sent = time.perf_counter()
    results = await asyncio.gather(*(send(n, k) for n, k in shares.items()))
    t_back = time.perf_counter()
    if len(results) == 1 and isinstance(results[0], bytes):
        # one node made them: its answer goes back as it is, read only for the ids
        raw = json.loads(results[0])
        for info in raw.get("sandboxes", ()):
            gw._remember(info["id"], principal.project, build)
        if gw.metrics:
            gw.metrics.create_done(time.perf_counter() - t0, not raw.get("errors"))
        return Response(
            results[0],
            route.status,
            headers={"server-timing": _server_timing(t0, t_sent, t_back)},
            media_type=JSON,
        )
    made: list[SandboxInfo] = []
    errors: list[ErrorBody] = []
    for (_name, k), result in zip(shares.items(), results, strict=True):
        if isinstance(result, DsecError):
            errors += [ErrorBody(**result.to_wire())] * k
        else:
            answer = route.decode_response(result)
            made += answer.sandboxes
            errors += answer.errors
    for info in made:
        gw._remember(info.id, principal.project, build)
    if gw.metrics:
        gw.metrics.create_done(time.perf_counter() - t0, not errors)
    if body.count == 1 and not made:
        first = results[0]
        raise first if isinstance(first, DsecError) else error_from_wire(errors[0].to_dict())
    merged = CreateResult(sandboxes=tuple(made), errors=tuple(errors))
    return Response(route.encode_response(merged), route.status, media_type=JSON)


def _server_timing(t0: float, t_sent: float, t_back: float) -> str:
    """``Server-Timing`` of a create: the apiserver's own work (before sending to the nodes
    and after their answers) and the wait for the nodes, in ms."""
    own = (t_sent - t0) + (time.perf_counter() - t_back)
    return f"apiserver;dur={own * 1e3:.3f}, nodes;dur={(t_back - t_sent) * 1e3:.3f}"


async def _fan_out(
    gw: Gateway, route: Route, target: str, rid: str
) -> list[tuple[NodeEntry, Any | DsecError]]:
    entries = gw.nodes.healthy()

    async def ask(entry: NodeEntry) -> Any:
        try:
            return route.decode_response(
                await gw._request(entry, route.method, target, request_id=rid)
            )
        except DsecError as e:
            return e

    return list(zip(entries, await asyncio.gather(*(ask(e) for e in entries)), strict=True))


async def _list(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    route = ROUTES["list"]
    mine: list[SandboxInfo] = []
    for _entry, answer in await _fan_out(gw, route, route.path, rid):
        if isinstance(answer, DsecError):
            continue  # a node that stopped answering since its last probe: the watcher tells
        for info in answer.sandboxes:
            project = info.labels.get(PROJECT_LABEL)
            build = BUILD_LABEL in info.labels
            gw._remember(info.id, project, build)
            if gw.sees(principal, project, build):
                mine.append(info)
    mine.sort(key=lambda i: (i.created, i.id))
    return Response(route.encode_response(SandboxList(tuple(mine))), media_type=JSON)


async def _node_info(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """The apiserver as a node: the sums of its healthy nodes."""
    healthy = [e for e in gw.nodes.healthy() if e.probe is not None]
    loads = [e.probe.load for e in healthy if e.probe is not None]
    status = NodeStatus(
        version=__version__,
        pid=os.getpid(),
        home=f"apiserver:{len(healthy)}/{len(gw.nodes.nodes)} nodes",
        sandboxes=sum(load.sandboxes for load in loads),
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
    return Response(dump_json(openapi_document()), media_type=JSON)


async def _probe(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    raise NotFound(
        "an apiserver has no probe of its own: ask `dsec apiserver nodes`, or a node directly"
    )


def _lease_handler(route: Route) -> Handler:
    async def handle(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
        if "lease" in request.path_params:
            entry = gw.node_of(request.path_params["lease"], "lease")
            return await _forward(gw, entry, request, route, rid)
        # a new lease: its sandboxes must all be the caller's, on one node
        raw = await read_json_body(request)
        body = route.decode_body(raw)
        nodes = {(await gw.sandbox_node(principal, sid)).name for sid in body.sandboxes}
        if len(nodes) != 1:
            raise InvalidSpec(
                f"a lease's sandboxes must be on one node; these are on {sorted(nodes)}",
                field="sandboxes",
            )
        entry = gw.nodes.nodes[nodes.pop()]
        answer = await gw._request(entry, "POST", route.path, raw, request_id=rid)
        return Response(answer, route.status, media_type=JSON)

    return handle


def _anywhere_handler(route: Route) -> Handler:
    """Routes of something a node holds under the caller's scoped name (a trajectory log, a
    memory snapshot): asked of each healthy node in turn until one knows it."""

    async def handle(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
        (param,) = route.params
        name = request.path_params[param]
        if route.name == "remove_memory_snapshot":
            if not _owner_reachable(gw, principal, name):
                raise UnknownSnapshot(f"no memory snapshot {name!r}", name=name)
            scoped = name
        else:  # a trajectory: the caller's own name, scoped
            scoped = _scoped(principal.project, name)
        path = route.target({param: scoped})
        last: DsecError = NotFound(f"not found on any node: {name}")
        for entry in gw.nodes.healthy():
            try:
                answer = await gw._request(entry, request.method, path, request_id=rid)
            except NotFound as e:
                last = e
                continue
            if route.name == "trajectory":  # under the name the caller gave it
                answer = dump_json({**json.loads(answer), "name": name})
            return Response(answer, route.status, media_type=JSON)
        if isinstance(last, NotFound) and not isinstance(last, UnknownSnapshot):
            last = NotFound(last.message.replace(scoped, name), name=name)
        raise last

    return handle


async def _placed_call(gw: Gateway, request: Request, route: Route, rid: str) -> Response:
    """fncall, judge: to a node placement picks for the environment."""
    raw = await read_json_body(request)
    body = route.decode_body(raw)
    spec = SandboxSpec(environment=body.environment)
    shares, _ = gw.place(spec, 1)
    entry = gw.nodes.nodes[next(iter(shares))]
    timeout = None if route.timeout is None or route.exec_timeout else route.timeout + 30
    answer = await gw._request(entry, "POST", route.path, raw, timeout, request_id=rid)
    return Response(answer, route.status, media_type=JSON)


def _placed_handler(route: Route) -> Handler:
    async def handle(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
        return await _placed_call(gw, request, route, rid)

    return handle


async def _restore(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """A restore of a snapshot the caller's project (or one it reaches) made, on the node that
    holds it (the first that does not say it has no such snapshot), the sandboxes it makes
    labelled with the caller's project."""
    route = ROUTES["restore"]
    body = route.decode_body(await read_json_body(request))
    if not _owner_reachable(gw, principal, body.snapshot):
        raise UnknownSnapshot(f"no snapshot {body.snapshot!r}", name=body.snapshot)
    if is_staged(body.snapshot):
        _check_builder(principal, f"restore the staged layer {body.snapshot!r}")
    if body.spec is not None:
        _check_build_spec(principal, body.spec)
    build = body.spec is not None and BUILD_LABEL in body.spec.labels
    # a memory snapshot (a name without @version) takes only ttl and labels from the spec
    spec = body.spec or SandboxSpec(layers=(body.snapshot if "@" in body.snapshot else "x@0",))
    labels = {k: v for k, v in spec.labels.items() if k not in _RESERVED}
    spec = replace(spec, labels={**labels, PROJECT_LABEL: principal.project})
    lim = spec.limits
    gw.iam.check_quota(
        principal.project,
        gw.usage_by_project(),
        Usage(body.count, body.count * lim.cpu, body.count * lim.memory),
    )
    raw = route.encode_body(replace(body, spec=spec))
    last: DsecError = UnknownSnapshot(f"no node holds snapshot {body.snapshot!r}")
    for entry in gw.nodes.healthy():
        try:
            answer = await gw._request(entry, "POST", route.path, raw, route.timeout, rid)
        except (UnknownSnapshot, NotFound) as e:
            last = e
            continue
        made = route.decode_response(answer)
        for info in made.sandboxes:
            gw._remember(info.id, principal.project, build)
        return Response(answer, route.status, media_type=JSON)
    raise last


async def _layers(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """A node's layers; without a ``BUILD_ROLES`` key, staged layers left out."""
    route = ROUTES["layers"]
    for entry in gw.nodes.healthy():
        answer = await gw._request(entry, "GET", route.path, request_id=rid)
        if may_build(principal):
            return Response(answer, media_type=JSON)
        listing = route.decode_response(answer)
        kept = tuple(i for i in listing.layers if not is_staged(i.name))
        return Response(route.encode_response(replace(listing, layers=kept)), media_type=JSON)
    raise NodeUnavailable("no healthy node to ask")


async def _prefetch(gw: Gateway, request: Request, principal: Any, rid: str) -> Response:
    """Warm the layers on every healthy node; the first node's answer is returned."""
    route = ROUTES["prefetch"]
    if principal.role == "agent":
        raise PermissionDenied("an agent key cannot prefetch layers")
    raw = await read_json_body(request)
    route.decode_body(raw)
    entries = gw.nodes.healthy()
    if not entries:
        raise NodeUnavailable("no healthy node to warm")
    answers = await asyncio.gather(
        *(gw._request(e, "POST", route.path, raw, None, rid) for e in entries),
        return_exceptions=True,
    )
    for answer in answers:
        if isinstance(answer, bytes):
            return Response(answer, route.status, media_type=JSON)
    first = answers[0]
    raise first if isinstance(first, DsecError) else NodeUnavailable(str(first))


_SPECIAL: dict[str, Handler] = {
    "create": _create,
    "list": _list,
    "node_info": _node_info,
    "openapi": _openapi,
    "probe": _probe,
    "restore": _restore,
    "layers": _layers,
    "prefetch": _prefetch,
}


def _handler(route: Route) -> Handler:
    if route.name in _SPECIAL:
        return _SPECIAL[route.name]
    if "sid" in route.params:
        return _sandbox_handler(route)
    if route.name.startswith("lease"):
        return _lease_handler(route)
    if route.name in ("fncall", "judge"):
        return _placed_handler(route)
    return _anywhere_handler(route)  # trajectories, memory snapshots


def _endpoint(gw: Gateway, route: Route) -> Callable[[Request], Awaitable[Response]]:
    handler = _handler(route)

    async def endpoint(request: Request) -> Response:
        rid = _request_id(request)
        try:
            principal = gw.principal(request)
            if route.query is not None:
                route.decode_query(request.query_params)  # 422 here, not from a node
            response = await handler(gw, request, principal, rid)
        except DsecError as e:
            return error_response(e, {REQUEST_ID: rid})
        response.headers.setdefault(REQUEST_ID, rid)
        return response

    return endpoint


def make_app(gw: Gateway, lifespan: Any = None, extra_routes: Sequence[Any] = ()) -> Starlette:
    """The apiserver's ASGI app: every route of the node API, over ``gw``'s nodes, and
    ``GET /metrics`` (for any valid key) when ``gw.metrics`` is an ``ApiserverMetrics``."""

    routes = [StarletteRoute(r.path, _endpoint(gw, r), methods=[r.method]) for r in ROUTES.values()]
    app = Starlette(
        routes=[*routes, *extra_routes],
        lifespan=lifespan,
        exception_handlers={HTTPException: on_http_error},
    )
    app.router.redirect_slashes = False
    metrics = gw.metrics if isinstance(gw.metrics, ApiserverMetrics) else None

    def may_scrape(scope: Any) -> bool:
        try:
            gw.principal(Request(scope))
        except DsecError:
            return False
        return True

    app.middleware_stack = ObservedRequests(
        app.build_middleware_stack(),
        logger="dsec.apiserver.access",
        metrics=metrics,
        metrics_allowed=may_scrape,
    )
    return app
