"""The node daemon's HTTP API: the route table (``dsec_core.api.routes``) served over ``Node``.

One generic endpoint per route decodes the path parameters, the typed query and the body (bad
input is ``InvalidSpec``, 422; a body over its route's ``max_body`` is ``RequestTooLarge``, 413;
one that stalls, ``RequestTimeout``, 408), calls the route's handler below, and encodes the
answer. File contents stream both ways in pieces of
``PIECE`` bytes between the client and the sandbox's agent, so what a read or write holds in the
daemon does not grow with the file.
Errors travel as ``{"error": {"type", "message", "context"}}`` with the error's HTTP status, so
the client raises the same ``DsecError`` subclass the node raised. ``require_token`` guards the
TCP listeners with a bearer token; the root-only unix socket needs none.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import hmac
import logging
import os
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route as StarletteRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..api.messages import (
    MAX_READ,
    Closed,
    CreateResult,
    DeviceStatus,
    DirListing,
    ErrorBody,
    InfraEvents,
    InputSent,
    KernelFeature,
    Killed,
    LayerList,
    NodeCapacity,
    NodeProbe,
    NodeStatus,
    PolicyStates,
    PoolStatus,
    PrefetchedLayer,
    PrefetchResult,
    ProcessList,
    ProjectUsage,
    QosSupport,
    Removed,
    SandboxInfo,
    SandboxList,
    SessionList,
    SessionOpened,
    Trajectory,
    Written,
)
from ..api.openapi import openapi_document
from ..api.routes import IDEMPOTENCY_KEY, JSON, RAW, ROUTES, Route, dump_json
from ..api.serving import (
    AnsweredErrors,
    basic_password,
    body_pieces,
    check_declared,
    error_response,
    on_http_error,
    read_json_body,
    unless_disconnected,
)
from ..errors import (
    AdmissionRejected,
    AuthenticationFailed,
    DiskFull,
    DsecError,
    InvalidSpec,
    NotFound,
    SandboxNotRunning,
)
from ..fusion import CodeRun, answer, for_pool, fusion_endpoint
from ..linux import sched
from ..linux.cgroups import cpu_idle
from ..observe import ObservedRequests, exec_outcome
from ..records import CREATE_KEY_LABEL, ExecResult, check_create_key, check_trajectory_name
from .node import Node

__all__ = ["HANDLERS", "PIECE", "error_response", "make_app", "require_token"]

log = logging.getLogger("dsec.api")

#: File contents move between client and agent in pieces of this size (one agent call each).
PIECE = 1 << 20


@dataclass(frozen=True)
class Call:
    """One decoded request: path parameters, the query message and the body."""

    path: Mapping[str, str]
    query: Any
    body: Any
    #: a create's key (``IDEMPOTENCY_KEY``), "" without one
    key: str = ""

    @property
    def sid(self) -> str:
        return self.path["sid"]


Handler = Callable[[Node, Call], Awaitable[Any]]

#: What each route does on the node, by route name; ``make_app`` checks that it covers the table.
HANDLERS: dict[str, Handler] = {}


def _handles(name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        HANDLERS[name] = fn
        return fn

    return register


@_handles("node_info")
async def _node_info(node: Node, c: Call) -> NodeStatus:
    cfg = node.config
    return NodeStatus(
        version=__version__,
        pid=os.getpid(),
        home=os.fspath(cfg.home),
        sandboxes=sum(not sb.warm for sb in node.sandboxes.values()),
        capacity=NodeCapacity(
            cpu=cfg.cpu_capacity, memory=cfg.memory_capacity, sandboxes=cfg.max_sandboxes
        ),
        backends=tuple(sorted(node.registry.backends)),
        layer_sources=tuple(repr(s) for s in node.layer_sources),
        qos=_qos_support(),
        pools=tuple(
            PoolStatus(**{k: v for k, v in p.items() if k != "members"})  # type: ignore[arg-type]
            for p in node.pools.status()
        ),
        devices=tuple(
            DeviceStatus(
                kind=d.kind,
                path=d.path,
                type=d.type,
                major=d.major,
                minor=d.minor,
                share_cap=node.devices.caps.get(d.kind, 1),
                exclusive=tuple(sorted(s for s, m in held.items() if m == "exclusive")),
                shared=tuple(sorted(s for s, m in held.items() if m == "shared")),
            )
            for d, held in node.devices.holdings()
        ),
        warm=node.warm_status(),
        reclaim=node.reclaim.status(),
    )


def _qos_support() -> QosSupport:
    def feature(f: sched.KernelFeature) -> KernelFeature:
        return KernelFeature(available=f.available, detail=f.detail)

    return QosSupport(
        sched_idle=feature(sched.sched_idle()),
        cpu_idle=feature(cpu_idle()),
        core_scheduling=feature(sched.core_scheduling()),
    )


@_handles("probe")
async def _probe(node: Node, c: Call) -> NodeProbe:
    at = time.time()  # before the counts: a sandbox created earlier is in them
    layers, environments = node.warm()
    return NodeProbe(
        at=at,
        name=node.config.node_name or os.fspath(node.config.home),
        version=__version__,
        load=node.load(),
        layers=tuple(layers),
        environments=tuple(environments),
        projects={
            p: ProjectUsage(sandboxes=n, cpu=cpu, memory=memory)
            for p, (n, cpu, memory) in node.project_usage().items()
        },
    )


@_handles("set_ttl")
async def _set_ttl(node: Node, c: Call) -> SandboxInfo:
    return await node.set_ttl(c.sid, c.body.ttl)


@_handles("exec_stream")
async def _exec_stream(node: Node, c: Call) -> AsyncIterator[bytes]:
    """The command's output as NDJSON lines as it comes, then its result or its error (the
    status is 200 once the first line may go; a refusal before that is a typed error)."""
    b = c.body
    if b.trajectory is not None or b.step is not None:
        raise InvalidSpec(
            "exec_stream does not log trajectories: use exec for a trajectory's step",
            field="trajectory",
        )
    t0 = time.perf_counter()
    try:
        stream = node.exec_stream(
            c.sid,
            b.cmd,
            timeout=b.timeout,
            cwd=b.cwd,
            env=b.env,
            stdin=b.stdin,
            max_output=b.max_output,
            background=b.background,
            exclusive=b.exclusive,
        )
    except DsecError:
        node.metrics.observe_exec("stream", "error", time.perf_counter() - t0)
        raise
    encode_result = ROUTES["exec"].encode_response

    async def lines() -> AsyncIterator[bytes]:
        outcome = "error"  # unless a result comes (a client gone mid-stream is one too)
        try:
            async for item in stream:
                if isinstance(item, ExecResult):
                    outcome = exec_outcome(item.exit_code, item.timed_out)
                    yield b'{"result":' + encode_result(item) + b"}\n"
                else:
                    name, data = item
                    yield dump_json({name: base64.b64encode(data).decode()}) + b"\n"
        except DsecError as e:
            yield dump_json({"error": e.to_wire()}) + b"\n"
        finally:
            node.metrics.observe_exec("stream", outcome, time.perf_counter() - t0)
            await stream.aclose()  # type: ignore[attr-defined]

    return lines()


def _pid(c: Call) -> int:
    text = c.path["pid"]
    if not text.isdigit() or not 0 < int(text) < 1 << 31:
        raise NotFound(f"no process {text!r}: a pid is a positive number")
    return int(text)


@_handles("process_start")
async def _process_start(node: Node, c: Call) -> Any:
    b = c.body
    return await node.process_start(
        c.sid,
        b.cmd,
        timeout=b.timeout,
        cwd=b.cwd,
        env=b.env,
        stdin=b.stdin,
        rows=b.rows,
        cols=b.cols,
        background=b.background,
    )


@_handles("processes")
async def _processes(node: Node, c: Call) -> ProcessList:
    return ProcessList(processes=tuple(node.processes_of(c.sid)))


@_handles("process")
async def _process(node: Node, c: Call) -> Any:
    return node.process_get(c.sid, _pid(c))


@_handles("process_output")
async def _process_output(node: Node, c: Call) -> AsyncIterator[bytes]:
    """As ``exec_stream``'s lines: output as it comes, then the result or the error."""
    stream = node.process_output(c.sid, _pid(c), c.body.from_start)
    encode_result = ROUTES["exec"].encode_response

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for item in stream:
                if isinstance(item, ExecResult):
                    yield b'{"result":' + encode_result(item) + b"}\n"
                else:
                    name, data = item
                    yield dump_json({name: base64.b64encode(data).decode()}) + b"\n"
        except DsecError as e:
            yield dump_json({"error": e.to_wire()}) + b"\n"
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    return lines()


@_handles("process_input")
async def _process_input(node: Node, c: Call) -> Any:
    return await node.process_input(c.sid, _pid(c), c.body.stdin, c.body.eof)


@_handles("process_resize")
async def _process_resize(node: Node, c: Call) -> Any:
    return await node.process_resize(c.sid, _pid(c), c.body.rows, c.body.cols)


@_handles("process_signal")
async def _process_signal(node: Node, c: Call) -> Any:
    return await node.process_signal(c.sid, _pid(c), c.body.signal)


@_handles("openapi")
async def _openapi(node: Node, c: Call) -> dict[str, Any]:
    return openapi_document()


@_handles("create")
async def _create(node: Node, c: Call) -> CreateResult:
    b = c.body
    spec, count, wait = b.spec, b.count, b.wait
    cfg = node.config
    if c.key:
        spec = spec.relabelled(
            {**spec.labels, CREATE_KEY_LABEL: check_create_key(c.key)}, spec.trajectory
        )
    # Both refused before any work, not once per slot: each pending create costs memory.
    if count > cfg.max_batch:
        raise InvalidSpec(
            f"count {count} is over this node's limit of {cfg.max_batch} sandboxes per "
            "request (DSEC_MAX_BATCH)",
            field="count",
            limit=cfg.max_batch,
        )
    if count == 1:
        return CreateResult(sandboxes=(await node.create(spec, wait=wait, batch=b.batch),))
    room = cfg.max_sandboxes - node.load().sandboxes
    # with wait, only a count that can never fit is refused at once; the rest queue
    if count > (cfg.max_sandboxes if wait > 0 else room):
        raise AdmissionRejected(
            f"count {count} is over the node's room for {max(room, 0)} more sandboxes "
            f"(of {cfg.max_sandboxes})",
            reason="count",
        )
    results = await node.create_many_settled(spec, count, wait=wait, batch=b.batch)
    return CreateResult(
        sandboxes=tuple(r for r in results if not isinstance(r, DsecError)),
        errors=tuple(ErrorBody(**r.to_wire()) for r in results if isinstance(r, DsecError)),
    )


@_handles("pack_diff")
async def _pack_diff(node: Node, c: Call) -> Any:
    b = c.body
    return await node.pack_diff(
        c.sid,
        name=b.name,
        version=b.version,
        exclude=b.exclude,
        scrub=b.scrub,
        source=b.source,
        secrets=b.secrets,
    )


@_handles("snapshot_memory")
async def _memory_snapshot(node: Node, c: Call) -> Any:
    return await node.snapshot_memory(c.sid, c.body.name)


@_handles("memory_snapshot")
async def _memory_snapshot_info(node: Node, c: Call) -> Any:
    return node.memory_snapshot(c.path["snapshot"])


@_handles("remove_memory_snapshot")
async def _remove_memory_snapshot(node: Node, c: Call) -> Removed:
    name = c.path["snapshot"]
    node.remove_memory_snapshot(name)
    return Removed(removed=name)


@_handles("restore")
async def _restore(node: Node, c: Call) -> SandboxList:
    count = c.body.count
    if count > node.config.max_batch:
        raise InvalidSpec(
            f"count {count} is over this node's limit of {node.config.max_batch} sandboxes per "
            "request (DSEC_MAX_BATCH)",
            field="count",
            limit=node.config.max_batch,
        )
    made = await node.restore(c.body.snapshot, count, c.body.spec)
    return SandboxList(sandboxes=tuple(made))


@_handles("list")
async def _list(node: Node, c: Call) -> SandboxList:
    project = c.query.project or None
    if c.query.create_key:
        made = await node.made_under_key(c.query.project, check_create_key(c.query.create_key))
        return SandboxList(sandboxes=(made,) if made is not None else ())
    return SandboxList(sandboxes=tuple(node.list_sandboxes(project, c.query.subtree)))


@_handles("warm")
async def _warm(node: Node, c: Call) -> Any:
    return node.warm_status()


@_handles("set_warm")
async def _set_warm(node: Node, c: Call) -> Any:
    return node.set_warm(c.body)


@_handles("get")
async def _get(node: Node, c: Call) -> Any:
    return node.get(c.sid)


@_handles("kill")
async def _kill(node: Node, c: Call) -> Killed:
    await node.kill(c.sid)
    return Killed(killed=c.sid)


@_handles("pause")
async def _pause(node: Node, c: Call) -> Any:
    return await node.pause(c.sid, reclaim=c.query.reclaim)


@_handles("resume")
async def _resume(node: Node, c: Call) -> Any:
    return await node.resume(c.sid)


@_handles("events")
async def _events(node: Node, c: Call) -> InfraEvents:
    return InfraEvents(events=tuple(node.events(c.sid)))


@_handles("lease")
async def _lease(node: Node, c: Call) -> Any:
    b = c.body
    return await node.leases.take(list(b.sandboxes), b.ttl, b.holder, b.reclaim)


@_handles("lease_get")
async def _lease_get(node: Node, c: Call) -> Any:
    return node.leases.get(c.path["lease"])


@_handles("lease_renew")
async def _lease_renew(node: Node, c: Call) -> Any:
    return await node.leases.renew(c.path["lease"])


@_handles("lease_release")
async def _lease_release(node: Node, c: Call) -> Any:
    return await node.leases.release(c.path["lease"], kill=c.query.kill)


@_handles("trajectory")
async def _trajectory(node: Node, c: Call) -> Trajectory:
    name = c.path["trajectory"]
    check_trajectory_name(name)
    return Trajectory(name=name, entries=tuple(node.trajectories.entries(name)))


@_handles("remove_trajectory")
async def _trajectory_remove(node: Node, c: Call) -> Removed:
    name = c.path["trajectory"]
    if not node.trajectories.remove(name):
        raise NotFound(f"no trajectory log {name!r} on this node", trajectory=name)
    return Removed(removed=name)


@_handles("usage")
async def _usage(node: Node, c: Call) -> Any:
    return node.usage(c.sid)


@_handles("policies")
async def _policies(node: Node, c: Call) -> PolicyStates:
    return PolicyStates(policies=tuple(node.policy_states(c.sid)))


@_handles("set_policy")
async def _set_policy(node: Node, c: Call) -> Any:
    return node.set_policy(c.sid, c.path["policy"], c.body.settings)


async def _counted(node: Node, kind: str, run: Awaitable[Any]) -> Any:
    """The result of command ``run`` of ``kind`` (exec, session, fncall), counted in the
    node's metrics by outcome with its time. (exec_stream counts its own, as "stream".)"""
    t0 = time.perf_counter()
    try:
        result = await run
    except BaseException:
        node.metrics.observe_exec(kind, "error", time.perf_counter() - t0)
        raise
    outcome = exec_outcome(result.exit_code, result.timed_out)
    if getattr(result, "error", ""):  # a FnCall whose pool member died under it
        outcome = "error"
    node.metrics.observe_exec(kind, outcome, time.perf_counter() - t0)
    return result


@_handles("exec")
async def _exec(node: Node, c: Call) -> Any:
    b = c.body
    run = node.exec(
        c.sid,
        b.cmd,
        timeout=b.timeout,
        cwd=b.cwd,
        env=b.env,
        stdin=b.stdin,
        max_output=b.max_output,
        background=b.background,
        exclusive=b.exclusive,
        trajectory=b.trajectory,
        step=b.step,
    )
    return await _counted(node, "exec", run)


@_handles("fncall")
async def _fncall(node: Node, c: Call) -> Any:
    b = c.body
    run = node.fncall(
        b.environment,
        b.cmd,
        script=b.script,
        stdin=b.stdin,
        files=b.files,
        timeout=b.timeout,
        max_output=b.max_output,
        env=b.env,
        backend=b.backend,
        cpu=b.cpu,
        memory=b.memory,
        devices=b.devices,
        project=b.project,
        start=b.start,
    )
    return await _counted(node, "fncall", run)


@_handles("judge")
async def _judge(node: Node, c: Call) -> Any:
    return await node.judge(c.body)


@_handles("session_open")
async def _session_open(node: Node, c: Call) -> SessionOpened:
    return SessionOpened(session=await node.session_open(c.sid, cwd=c.body.cwd, env=c.body.env))


@_handles("sessions")
async def _sessions(node: Node, c: Call) -> SessionList:
    return SessionList(sessions=tuple(await node.sessions(c.sid)))


@_handles("session_exec")
async def _session_exec(node: Node, c: Call) -> Any:
    b = c.body
    run = node.session_exec(
        c.sid, c.path["ses"], b.cmd, timeout=b.timeout, stdin=b.stdin, max_output=b.max_output
    )
    return await _counted(node, "session", run)


@_handles("session_close")
async def _session_close(node: Node, c: Call) -> Closed:
    await node.session_close(c.sid, c.path["ses"])
    return Closed(closed=c.path["ses"])


@_handles("read_file")
async def _read_file(node: Node, c: Call) -> bytes | AsyncIterator[bytes]:
    """The first piece is read before answering, so a bad path is a typed error, not a broken
    stream; the rest streams one piece at a time, as fast as the client takes it."""
    q = c.query
    left = MAX_READ if q.length < 0 else q.length
    first = await node.read_file(c.sid, q.path, q.offset, min(PIECE, left))
    if len(first) < PIECE or left <= PIECE:
        return first

    async def pieces() -> AsyncIterator[bytes]:
        piece, pos, rest = first, q.offset, left
        while True:
            yield piece
            pos, rest = pos + len(piece), rest - len(piece)
            want = min(PIECE, rest)
            if len(piece) < PIECE or want == 0:
                return
            # An error from here on breaks the answer off (the client sees it incomplete).
            piece = await node.read_file(c.sid, q.path, pos, want)

    return pieces()


@_handles("screenshot")
async def _screenshot(node: Node, c: Call) -> bytes:
    return await node.screenshot(c.sid)


@_handles("input")
async def _input(node: Node, c: Call) -> InputSent:
    return InputSent(sent=await node.input(c.sid, c.body.events))


@_handles("write_file")
async def _write_file(node: Node, c: Call) -> Written:
    q = c.query
    mode, pos, first = int(q.mode, 8), q.offset, True
    async for piece in _pieces(c.body):
        await node.write_file(
            c.sid, q.path, piece, mode=mode, offset=pos, truncate=q.truncate and first
        )
        pos, first = pos + len(piece), False
    return Written(written=pos - q.offset)


async def _pieces(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A request body in pieces of ``PIECE`` bytes (the last shorter; one empty piece for an
    empty body), as it arrives."""
    buf = bytearray()
    sent = False
    async for data in stream:
        buf += data
        while len(buf) >= PIECE:
            yield bytes(buf[:PIECE])
            del buf[:PIECE]
            sent = True
    if buf or not sent:
        yield bytes(buf)


@_handles("remove")
async def _remove(node: Node, c: Call) -> Removed:
    await node.remove(c.sid, c.query.path, recursive=c.query.recursive)
    return Removed(removed=c.query.path)


@_handles("list_dir")
async def _list_dir(node: Node, c: Call) -> DirListing:
    return DirListing(entries=tuple(await node.list_dir(c.sid, c.query.path)))


@_handles("stat")
async def _stat(node: Node, c: Call) -> Any:
    return await node.stat(c.sid, c.query.path)


@_handles("layers")
async def _layers(node: Node, c: Call) -> LayerList:
    return LayerList(layers=tuple(i for s in node.layer_sources for i in s.list()))


@_handles("prefetch")
async def _prefetch(node: Node, c: Call) -> PrefetchResult:
    rows = await node.prefetch(c.body.refs)
    return PrefetchResult(layers=tuple(PrefetchedLayer(**row) for row in rows))


@_handles("resolve_image")
async def _resolve_image(node: Node, c: Call) -> Any:
    return await node.resolve_image(c.body.image)


# --- the generic endpoint ----------------------------------------------------------------------


class _Streamed(StreamingResponse):
    """A streamed answer that, when a later piece cannot be had (the sandbox died mid-read),
    ends without the final chunk: the client sees the answer cut off, never a short one that
    looks whole. One warning is logged rather than a traceback."""

    async def stream_response(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for piece in self.body_iterator:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        except DsecError as e:
            log.warning("answer cut off: %s", e)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _endpoint(
    route: Route, handler: Handler, node: Node
) -> Callable[[Request], Awaitable[Response]]:
    status, media_type = route.status, route.response_type

    async def endpoint(request: Request) -> Response:
        try:
            query = route.decode_query(request.query_params)  # before any of the body is read
            if route.body is None:
                body = None
            elif route.body is RAW:
                # the handler takes it piece by piece, within the route's limit and in time
                check_declared(request, route.max_body)  # refused before the handler starts
                body = body_pieces(request, route.max_body)
            else:
                body = route.decode_body(await read_json_body(request, route.max_body))
            key = request.headers.get(IDEMPOTENCY_KEY, "") if route.name == "create" else ""
            call = handler(node, Call(request.path_params, query, body, key))
            if (
                route.name == "create" and getattr(body, "wait", 0) > 0
            ):  # a caller gone leaves the queue
                answer = await unless_disconnected(request, call)
            else:
                answer = await call
        except SandboxNotRunning as e:  # SandboxDied if it died: the fault, named
            return error_response(await node.unreachable(e))
        except DsecError as e:
            return error_response(e)
        if route.response is RAW and not isinstance(answer, bytes):
            return _Streamed(answer, status, media_type=media_type)
        return Response(route.encode_response(answer), status, media_type=media_type)

    return endpoint


def internal_error(exc: BaseException) -> DsecError:
    """What an exception no handler expected is on the wire: ``DiskFull`` for a write the
    node's disk had no room for (ENOSPC, EDQUOT: any of its writes, wherever it came from),
    else a plain ``DsecError`` naming it (a bug)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" ({exc.filename})" if exc.filename else ""
        return DiskFull(f"the node's disk is full{where}: {exc.strerror}", path=exc.filename)
    return DsecError(f"internal error in the node daemon: {type(exc).__name__}: {exc}")


def make_app(node: Node, lifespan: Any = None) -> Starlette:
    """The ASGI app of every route in the table, over ``node``."""
    if set(HANDLERS) != set(ROUTES):
        raise RuntimeError(
            f"routes without a handler: {sorted(set(ROUTES) - set(HANDLERS))}; "
            f"handlers without a route: {sorted(set(HANDLERS) - set(ROUTES))}"
        )

    async def on_other_error(request: Request, exc: Exception) -> Response:
        log.error(
            "internal error on %s %s\n%s",
            request.method,
            request.url.path,
            "".join(traceback.format_exception(exc)),
        )
        err = internal_error(exc)
        return Response(dump_json({"error": err.to_wire()}), err.http_status, media_type=JSON)

    routes = [
        StarletteRoute(r.path, _endpoint(r, HANDLERS[r.name], node), methods=[r.method])
        for r in ROUTES.values()
    ]
    # SandboxFusion's /run_code (dsec_core.fusion): not a route of the table, its shapes are
    # SandboxFusion's
    routes.append(StarletteRoute("/run_code", _fusion_run(node), methods=["POST"]))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: on_http_error, Exception: on_other_error},
    )
    app.router.redirect_slashes = False  # a 307 to another path is no answer an API client wants
    # Request ids, the access log, dsec_requests_total and GET /metrics (not a route of the
    # table: it answers Prometheus' text, and sits behind the token like the rest). Outermost,
    # around Starlette's own error middleware, so an internal error's 500 carries the request
    # id and so does the line on_other_error logs.
    app.middleware_stack = ObservedRequests(
        AnsweredErrors(app.build_middleware_stack()), metrics=node.metrics
    )
    return app


def _fusion_run(node: Node) -> Callable[[Request], Awaitable[Response]]:
    """``POST /run_code`` over the node's FnCall pools. An apiserver that places a request
    here names the caller's project in the query (``?project=P&start=0|1``, as it does in an
    FnCall's body); a direct caller uses the node's shared pools."""

    async def run(request: Request, raw: bytes, spec: CodeRun) -> bytes:
        q = request.query_params
        spec = for_pool(spec, q.get("project") or None, q.get("start", "1") != "0")
        return answer(await node.run_code(spec))

    return fusion_endpoint(run)


def require_token(app: ASGIApp, token: str) -> ASGIApp:
    """``app`` behind a bearer token: any HTTP request without ``Authorization: Bearer
    <token>`` (or HTTP Basic auth with the token as its password, any user name: what a URL
    ``http://dsec:TOKEN@host/`` sends) gets a 401 ``AuthenticationFailed``. Compared as SHA-256
    digests in constant time, so neither the token nor its length leaks through timing."""
    if not token:
        raise InvalidSpec("a TCP listener needs a non-empty API token")
    expected = hashlib.sha256(f"Bearer {token}".encode()).digest()

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            password = basic_password(given) if given is not None else None
            if password is not None:
                given = b"Bearer " + password.encode("latin-1", "replace")
            if given is None or not hmac.compare_digest(hashlib.sha256(given).digest(), expected):
                why = "no bearer token" if given is None else "a wrong bearer token"
                err = AuthenticationFailed(
                    f"the request carried {why}; send Authorization: Bearer <token> (DSEC_TOKEN)"
                )
                await error_response(err, {"www-authenticate": "Bearer"})(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded
