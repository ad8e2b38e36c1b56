"""Observability shared by the node daemon and the apiserver: Prometheus metrics, one JSON
object per log line, and a request id that follows a request from the apiserver to its node.

Metrics live in a ``CollectorRegistry`` of each server's own (``NodeMetrics``,
``ApiserverMetrics``), never in prometheus_client's global one, so several nodes and apiservers
in one process (tests, a Ray worker) keep apart. ``ObservedRequests`` is a plain ASGI
middleware that gives each HTTP request its id (the caller's ``X-Request-Id`` if it is a sane
one, else a new one; echoed in the answer), counts it, writes one access-log line for it, and
serves ``GET /metrics`` in the Prometheus text format. ``JsonLogFormatter`` and
``RequestIdFilter`` put that id on every log record made while the request is served.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from .errors import AuthenticationFailed, DsecError

__all__ = [
    "ACCESS_LOGGER",
    "CREATE_BUCKETS",
    "EXEC_BUCKETS",
    "FORWARD_BUCKETS",
    "OVERFLOW_POOL",
    "QUEUE_WAIT_BUCKETS",
    "REQUEST_ID",
    "REQUEST_ID_HEADER",
    "SANDBOX_STATES",
    "ApiserverMetrics",
    "JsonLogFormatter",
    "NodeMetrics",
    "ObservedRequests",
    "ProbedNode",
    "QueueMetrics",
    "RequestIdFilter",
    "RequestMetrics",
    "current_request_id",
    "exec_outcome",
    "new_request_id",
    "render_metrics",
    "valid_request_id",
]

# --- the request id ----------------------------------------------------------------------------

#: The HTTP header a request id travels in, both ways (lower case, as ASGI gives headers).
REQUEST_ID_HEADER = "x-request-id"
#: The id of the request being served in this context (None outside any request). Set by
#: ``ObservedRequests``; tasks and threads started while serving inherit it.
REQUEST_ID: ContextVar[str | None] = ContextVar("dsec_request_id", default=None)

#: What a caller's request id may be; anything else is replaced, so a log line never carries
#: a client's newline, quote or a megabyte of text.
_VALID_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def new_request_id() -> str:
    """A fresh random request id (16 hex digits)."""
    return secrets.token_hex(8)


def valid_request_id(text: str | None) -> bool:
    """Whether ``text`` may serve as a request id: 1 to 64 of ``[A-Za-z0-9._-]``."""
    return text is not None and _VALID_ID.fullmatch(text) is not None


def current_request_id() -> str | None:
    """The id of the request this code serves, to forward as ``X-Request-Id`` (None outside a
    request)."""
    return REQUEST_ID.get()


# --- logs ------------------------------------------------------------------------------------


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record as ``record.request_id`` (None outside a
    request). Attach it to a handler, so records propagated from any logger get it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


#: The attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_FIELDS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "request_id",
}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, ISO 8601 with milliseconds), ``level``,
    ``logger``, ``msg``, ``request_id`` (when the record was made serving a request), then the
    record's ``extra`` fields (``sandbox``, ``route``, ``status``, ``duration_ms``, ...), then
    ``exc`` with the traceback if there is one. Values JSON cannot hold are written as text.

    A record's line is made once and kept on it: ``RotatingFileHandler`` formats each record
    twice (once to decide whether to rotate), and the access log writes one per request."""

    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        line: str | None = record.__dict__.get("_json_line")
        if line is None:
            line = record.__dict__["_json_line"] = self._line(record)
        return line

    def _line(self, record: logging.LogRecord) -> str:
        created = record.created
        second = int(created)
        if second != self._second:  # one strftime a second, not one a line
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        out: dict[str, Any] = {
            "ts": f"{self._stamp}.{int((created - second) * 1000):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        if rid is not None:
            out["request_id"] = rid
        fields = record.__dict__
        for key in sorted(fields.keys() - _RECORD_FIELDS):  # the extras (a set difference in C)
            if not key.startswith("_"):
                out[key] = fields[key]
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


# --- metrics ---------------------------------------------------------------------------------

#: Create latency buckets, seconds: a warm container in 5 ms up to a cold VM image in a minute.
CREATE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Exec round trips, seconds: ~1 ms for ``true`` up to commands that run for minutes.
EXEC_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
#: An apiserver's hop to a node and a watcher's probe, seconds.
FORWARD_BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)

#: The sandbox states ``dsec_sandboxes`` always shows (as 0 when none is in one). A dead
#: sandbox leaves the node, so it is in none of them.
SANDBOX_STATES = ("creating", "running", "paused", "stopping")

#: The HTTP methods counted by name; any other is counted as "other", so a client that sends
#: made-up methods cannot grow the number of series.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class RequestMetrics(Protocol):
    """What ``ObservedRequests`` records into: a registry to serve and a request counter."""

    registry: CollectorRegistry

    def observe_request(self, method: str, route: str, code: int, seconds: float) -> None:
        """Count one answered request (``route``: the route's template, not the raw path)."""


def render_metrics(registry: CollectorRegistry) -> tuple[bytes, str]:
    """``registry`` in the Prometheus text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def exec_outcome(exit_code: int, timed_out: bool) -> str:
    """The ``outcome`` label of a command that ran: ``timeout`` if it was killed at its
    timeout, ``ok`` if it exited 0, else ``nonzero``. (``error``: the call itself failed.)"""
    if timed_out:
        return "timeout"
    return "ok" if exit_code == 0 else "nonzero"


class _RequestCounter:
    """A ``<prefix>_requests_total{method,route,code}`` counter whose label children are
    cached: ``labels()`` validates and locks on each call, a dict lookup does not."""

    def __init__(self, name: str, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            name,
            "HTTP requests answered, by method, route template and status code",
            ("method", "route", "code"),
            registry=registry,
        )
        self._children: dict[tuple[str, str, int], Any] = {}

    def inc(self, method: str, route: str, code: int) -> None:
        key = (method, route, code)
        child = self._children.get(key)
        if child is None:
            m = method if method in _METHODS else "other"
            child = self._children[key] = self.counter.labels(m, route, str(code))
        child.inc()


class _NodeState(Collector):
    """What the node holds, read when scraped rather than kept in step by hand: sandboxes by
    state, and the layer cache's hits and misses."""

    def __init__(
        self,
        sandbox_states: Callable[[], Mapping[str, int]],
        layer_cache: Callable[[], Mapping[str, int]],
    ) -> None:
        self.sandbox_states = sandbox_states
        self.layer_cache = layer_cache

    def describe(self) -> Iterable[Metric]:
        # Without this, registering would call collect() before the node is open.
        yield GaugeMetricFamily("dsec_sandboxes", "", labels=("state",))
        yield CounterMetricFamily("dsec_layer_cache", "", labels=("result",))

    def collect(self) -> Iterable[Metric]:
        states = GaugeMetricFamily(
            "dsec_sandboxes", "Sandboxes on this node by state", labels=("state",)
        )
        counts = {**dict.fromkeys(SANDBOX_STATES, 0), **self.sandbox_states()}
        for state, n in sorted(counts.items()):
            states.add_metric((state,), n)
        yield states
        cache = CounterMetricFamily(
            "dsec_layer_cache",
            "Layers taken by creates: hit if the node had the layer mounted already, miss if "
            "it had to mount it (fetching it first from a remote source)",
            labels=("result",),
        )
        got = self.layer_cache()
        for result in ("hit", "miss"):
            cache.add_metric((result,), got.get(result, 0))
        yield cache


def _no_counts() -> Mapping[str, int]:
    return {}


#: Buckets of a queued create's wait, in seconds: from none to minutes.
QUEUE_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class QueueMetrics:
    """A create queue's metrics (the node's and the apiserver's, ``prefix`` apart):

    - ``<prefix>_create_queue_depth{project}``: creates waiting now;
    - ``<prefix>_create_queue_wait_seconds``: how long each create waited for its turn;
    - ``<prefix>_create_starting``: creates let go and not yet ended (a node bounds these);
    - ``<prefix>_create_queue_rejected_total{reason}``: creates refused by the queue (the
      resource that was short, ``starting``, ``turn``), after waiting or at once.
    """

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.depth = Gauge(
            f"{prefix}_create_queue_depth",
            "Creates waiting for room or a start slot, by project",
            ("project",),
            registry=registry,
        )
        self.wait_seconds = Histogram(
            f"{prefix}_create_queue_wait_seconds",
            "Time a create waited in the queue for its turn",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=registry,
        )
        self.starting_now = Gauge(
            f"{prefix}_create_starting",
            "Creates let go by the queue and not yet ended",
            registry=registry,
        )
        self.rejected_total = Counter(
            f"{prefix}_create_queue_rejected",
            "Creates the queue refused, by reason (the resource short, starting, turn)",
            ("reason",),
            registry=registry,
        )
        self._projects: set[str] = set()

    def queued(self, depth: Mapping[str, int]) -> None:
        """The queue's depth by project now (a project no longer waiting shows 0)."""
        for project in self._projects - set(depth):
            self.depth.labels(project).set(0)
        for project, n in depth.items():
            self.depth.labels(project).set(n)
        self._projects |= set(depth)

    def waited(self, seconds: float) -> None:
        self.wait_seconds.observe(seconds)

    def starting(self, n: int) -> None:
        self.starting_now.set(n)

    def rejected(self, reason: str) -> None:
        self.rejected_total.labels(reason).inc()


class NodeMetrics:
    """A node daemon's metrics, in a registry of its own (``registry``, made if not given).

    - ``dsec_create_seconds{backend,outcome}``: each sandbox's create, outcome ok|error;
    - ``dsec_sandboxes{state}``: sandboxes by state, from ``sandbox_states()`` at scrape time;
    - ``dsec_exec_total{kind,outcome}``: commands run, kind exec|stream|session|fncall, outcome
      ok|nonzero|timeout|error (``exec_outcome``; error: the call failed, nothing ran);
    - ``dsec_exec_seconds{kind}``: their round trip inside the node;
    - ``dsec_layer_cache_total{result}``: hit|miss, from ``layer_cache()`` at scrape time;
    - ``dsec_requests_total{method,route,code}``: HTTP requests answered;
    - ``dsec_create_queue_*`` and ``dsec_create_starting``: the create queue (``queue``,
      ``QueueMetrics``).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        sandbox_states: Callable[[], Mapping[str, int]] = _no_counts,
        layer_cache: Callable[[], Mapping[str, int]] = _no_counts,
    ) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        r = self.registry
        self.create_seconds = Histogram(
            "dsec_create_seconds",
            "Time to create one sandbox on this node, by backend and outcome",
            ("backend", "outcome"),
            buckets=CREATE_BUCKETS,
            registry=r,
        )
        self.exec_total = Counter(
            "dsec_exec",
            "Commands run in sandboxes, by kind (exec, stream, session, fncall) and outcome (ok, "
            "nonzero exit, timeout, error: the call failed)",
            ("kind", "outcome"),
            registry=r,
        )
        self.exec_seconds = Histogram(
            "dsec_exec_seconds",
            "Round trip of a command inside the node, by kind",
            ("kind",),
            buckets=EXEC_BUCKETS,
            registry=r,
        )
        self._exec_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._requests = _RequestCounter("dsec_requests", r)
        r.register(_NodeState(sandbox_states, layer_cache))
        self.queue = QueueMetrics("dsec", r)

    def observe_create(self, backend: str, ok: bool, seconds: float) -> None:
        """One sandbox's create took ``seconds`` and succeeded (``ok``) or failed."""
        self.create_seconds.labels(backend, "ok" if ok else "error").observe(seconds)

    def observe_exec(self, kind: str, outcome: str, seconds: float) -> None:
        """One command of ``kind`` ended with ``outcome`` after ``seconds``."""
        children = self._exec_children.get((kind, outcome))
        if children is None:  # labels() validates and locks on each call; a dict lookup not
            children = (self.exec_total.labels(kind, outcome), self.exec_seconds.labels(kind))
            self._exec_children[(kind, outcome)] = children
        children[0].inc()
        children[1].observe(seconds)

    def observe_request(self, method: str, route: str, code: int, seconds: float) -> None:
        self._requests.inc(method, route, code)


#: The pool name of the overflow pool (the node label ``dsec.pool=overflow``).
OVERFLOW_POOL = "overflow"


class ProbedNode(Protocol):
    """The watcher's record of a node, as ``ApiserverMetrics.probed`` reads it."""

    @property
    def name(self) -> str: ...

    @property
    def healthy(self) -> bool: ...


class ApiserverMetrics:
    """An apiserver's metrics, in a registry of its own (``registry``, made if not given).

    - ``dsec_apiserver_create_seconds{outcome}``: a create through the apiserver, placement
      and the node's create included;
    - ``dsec_apiserver_requests_total{method,route,code}``: HTTP requests answered;
    - ``dsec_placement_decisions_total{node,pool}``: sandboxes placed on each node;
    - ``dsec_overflow_total``: sandboxes placed in the overflow pool because the home pool was
      over its threshold;
    - ``dsec_node_healthy{node}``: 1 while the watcher finds the node healthy, else 0;
    - ``dsec_node_probe_seconds{node}``: the watcher's probes;
    - ``dsec_apiserver_forward_seconds{route}``: requests forwarded to a node, until its
      answer's head (``route``: the route's name);
    - ``dsec_apiserver_create_queue_*``: creates waiting for a node with room (``queue``,
      ``QueueMetrics``).

    The method names are those the apiserver's ``Metrics`` protocol calls, so an instance is
    passed to it as is.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        r = self.registry
        self.create_seconds = Histogram(
            "dsec_apiserver_create_seconds",
            "Time to create sandboxes through the apiserver, placement included, by outcome",
            ("outcome",),
            buckets=CREATE_BUCKETS,
            registry=r,
        )
        self._requests = _RequestCounter("dsec_apiserver_requests", r)
        self.placement_decisions = Counter(
            "dsec_placement_decisions",
            "Sandboxes placed, by node and pool",
            ("node", "pool"),
            registry=r,
        )
        self.overflow = Counter(
            "dsec_overflow",
            "Sandboxes placed in the overflow pool past the home pool's threshold",
            registry=r,
        )
        self.node_healthy = Gauge(
            "dsec_node_healthy",
            "1 if the watcher finds the node healthy, else 0",
            ("node",),
            registry=r,
        )
        self.node_probe_seconds = Histogram(
            "dsec_node_probe_seconds",
            "Time of the watcher's probe of a node",
            ("node",),
            buckets=FORWARD_BUCKETS,
            registry=r,
        )
        self.forward_seconds = Histogram(
            "dsec_apiserver_forward_seconds",
            "Time from forwarding a request to a node to the head of its answer, by route name",
            ("route",),
            buckets=FORWARD_BUCKETS,
            registry=r,
        )
        self.queue = QueueMetrics("dsec_apiserver", r)
        #: (family, labels) -> its child: ``labels()`` validates and locks on each call, a
        #: dict lookup does not (every create reaches three of them)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def _child(self, family: Any, *labels: str) -> Any:
        child = self._children.get((family, labels))
        if child is None:
            child = self._children[(family, labels)] = family.labels(*labels)
        return child

    def observe_request(self, method: str, route: str, code: int, seconds: float) -> None:
        self._requests.inc(method, route, code)

    def create_done(self, seconds: float, ok: bool) -> None:
        """A create request took ``seconds`` and succeeded (``ok``) or failed."""
        self._child(self.create_seconds, "ok" if ok else "error").observe(seconds)

    def placed(self, node: str, pool: str, overflow: bool = False, count: int = 1) -> None:
        """Placement put ``count`` sandboxes on ``node`` of ``pool``; with ``overflow`` (the
        request went past its home pool) those in the overflow pool count as overflow too."""
        self._child(self.placement_decisions, node, pool).inc(count)
        if overflow and pool == OVERFLOW_POOL:
            self.overflow.inc(count)

    def forwarded(self, route: str, seconds: float) -> None:
        """A request of ``route`` (its name in the route table) was forwarded to a node and
        its answer's head came back after ``seconds``."""
        self._child(self.forward_seconds, route).observe(seconds)

    def probed(self, node: str | ProbedNode, seconds: float, ok: bool) -> None:
        """The watcher probed ``node`` (a name, or the watcher's entry for it, whose
        ``healthy`` then says the health: one missed probe need not make a node unhealthy)
        in ``seconds``; ``ok``: it answered."""
        if isinstance(node, str):
            name, healthy = node, ok
        else:
            name, healthy = node.name, node.healthy
        self._child(self.node_probe_seconds, name).observe(seconds)
        self._child(self.node_healthy, name).set(1 if healthy else 0)

    def forget_node(self, node: str) -> None:
        """Drop a node's series (it left the cluster), so they do not linger at their last
        values."""
        for family in (self.node_healthy, self.node_probe_seconds):
            self._children.pop((family, (node,)), None)
            try:
                family.remove(node)
            except KeyError:
                pass


# --- the middleware --------------------------------------------------------------------------

#: The logger ``ObservedRequests`` writes its line per request to, by default.
ACCESS_LOGGER = "dsec.access"

ASGIApp = Callable[..., Any]


class ObservedRequests:
    """ASGI middleware for HTTP requests: gives each its request id (``REQUEST_ID``, from a
    valid ``X-Request-Id`` or new, echoed in the answer's ``X-Request-Id``), counts it in
    ``metrics`` by route template and status, and writes one line for it to ``logger`` at INFO
    (method, route, status, duration_ms, request id, and the sandbox id when the route has the
    path parameter ``sandbox_param``). ``GET metrics_path`` answers ``metrics``' registry in
    the Prometheus text format (pass ``metrics_path=None`` to serve none), to whoever
    ``metrics_allowed(scope)`` lets through (default: everyone who reached the middleware; the
    node's TCP listeners check their token before it), else 401 ``AuthenticationFailed`` (or
    the ``DsecError`` the check raised, with its status). Every answer's ``Server-Timing``
    gets ``total``: the server's time from the request's head to the answer's head, in ms
    (an apiserver reads a node's to tell the node's own time from the hop to it).

    A plain ASGI callable, not Starlette's BaseHTTPMiddleware, so it adds a few microseconds to
    a request rather than a task and a queue. Requests that match no route are counted as
    route ``unmatched``, so stray paths cannot grow the number of series.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        logger: str | logging.Logger = ACCESS_LOGGER,
        metrics: RequestMetrics | None = None,
        metrics_path: str | None = "/metrics",
        sandbox_param: str = "sid",
        metrics_allowed: Callable[[Any], bool] | None = None,
    ) -> None:
        self.app = app
        self.log = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.metrics = metrics
        self.metrics_path = metrics_path if metrics is not None else None
        self.sandbox_param = sandbox_param
        self.metrics_allowed = metrics_allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid: str | None = None
        for key, value in scope["headers"]:
            if key == b"x-request-id":
                rid = value.decode("latin-1")
                break
        if rid is None or _VALID_ID.fullmatch(rid) is None:
            rid = new_request_id()
        token = REQUEST_ID.set(rid)
        id_header = (b"x-request-id", rid.encode())
        status = 500  # if the app fails before it answers, the server's answer is a 500
        t0 = time.perf_counter()

        async def observed_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append(id_header)
                # the server's time from the request's head to its answer's head
                total = b"total;dur=%.3f" % ((time.perf_counter() - t0) * 1e3)
                for i, (k, v) in enumerate(headers):
                    if k.lower() == b"server-timing":
                        headers[i] = (k, v + b", " + total)
                        break
                else:
                    headers.append((b"server-timing", total))
                message = {**message, "headers": headers}
            await send(message)

        route: str | None = None
        try:
            if scope["path"] == self.metrics_path and scope["method"] in ("GET", "HEAD"):
                route = self.metrics_path
                await self._serve_metrics(scope, observed_send)
            else:
                await self.app(scope, receive, observed_send)
        finally:
            seconds = time.perf_counter() - t0
            # the router put the matched route into the scope (Starlette: scope["route"])
            route = route or getattr(scope.get("route"), "path", None)
            self._record(scope, route, status, seconds)
            REQUEST_ID.reset(token)

    def _record(self, scope: Any, route: str | None, status: int, seconds: float) -> None:
        route = route or "unmatched"
        method = scope["method"]
        if self.metrics is not None:
            self.metrics.observe_request(method, route, status, seconds)
        if self.log.isEnabledFor(logging.INFO):
            ms = round(seconds * 1e3, 3)
            extra: dict[str, Any] = {
                "method": method,
                "route": route,
                "status": status,
                "duration_ms": ms,
            }
            sandbox = scope.get("path_params", {}).get(self.sandbox_param)
            if sandbox is not None:
                extra["sandbox"] = sandbox
            # makeRecord + handle is log.info without its walk up the stack for the caller's
            # file and line, which an access line does not need and which costs microseconds
            line = (method, route, status, ms)
            record = self.log.makeRecord(
                self.log.name,
                logging.INFO,
                __file__,
                0,
                "%s %s %d %.3f ms",
                line,
                None,
                None,
                extra,
            )
            self.log.handle(record)

    async def _serve_metrics(self, scope: Any, send: Any) -> None:
        assert self.metrics is not None
        err: DsecError | None = None
        if self.metrics_allowed is not None:
            try:
                if not self.metrics_allowed(scope):
                    err = AuthenticationFailed(
                        f"{self.metrics_path} needs a credential this server takes"
                    )
            except DsecError as e:  # the check's own answer: 403 for a key that may not
                err = e
        if err is not None:
            body = json.dumps({"error": err.to_wire()}).encode()
            content_type, status = "application/json", err.http_status
        else:
            body, content_type = render_metrics(self.metrics.registry)
            status = 200
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )
