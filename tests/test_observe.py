"""Observability: Prometheus metrics of a node, JSON logs, and the request id that follows a
request (``dsec_core.observe``).

The middleware and the metric classes are checked on their own first (an ASGI app in process,
registries side by side), then on a real node daemon with a TCP listener: what ``/metrics``
shows after creates, execs and a pause, and what the daemon's JSON log holds for a request
that carried an ``X-Request-Id``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from dsec_core.errors import DsecError, UnknownLayer
from dsec_core.observe import (
    REQUEST_ID,
    ApiserverMetrics,
    JsonLogFormatter,
    NodeMetrics,
    ObservedRequests,
    RequestIdFilter,
    exec_outcome,
    valid_request_id,
)
from dsec_core.testing import KitNode, free_port, running_kit_node

# --- reading an exposition -------------------------------------------------------------------


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text exposition by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: dict, name: str, **labels: str) -> float:
    """One sample's value (0 if absent: a labelled series appears at its first count)."""
    return got.get((name, frozenset(labels.items())), 0.0)


def total(got: dict, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in got.items() if n == name and want <= ls)


# --- metric classes --------------------------------------------------------------------------


def test_each_metrics_object_has_a_registry_of_its_own():
    a = NodeMetrics(sandbox_states=lambda: {"running": 2}, layer_cache=lambda: {"hit": 5})
    b = NodeMetrics(sandbox_states=lambda: {"paused": 1})  # same names, no clash
    a.observe_exec("exec", "ok", 0.002)
    a.observe_create("container", True, 0.05)
    b.observe_exec("exec", "timeout", 1.0)
    got_a = samples(_render(a.registry))
    got_b = samples(_render(b.registry))
    assert value(got_a, "dsec_exec_total", kind="exec", outcome="ok") == 1
    assert value(got_a, "dsec_exec_total", kind="exec", outcome="timeout") == 0
    assert value(got_b, "dsec_exec_total", kind="exec", outcome="timeout") == 1
    assert value(got_a, "dsec_create_seconds_count", backend="container", outcome="ok") == 1
    assert value(got_a, "dsec_sandboxes", state="running") == 2
    assert value(got_a, "dsec_sandboxes", state="paused") == 0  # every known state is shown
    assert value(got_b, "dsec_sandboxes", state="paused") == 1
    assert value(got_a, "dsec_layer_cache_total", result="hit") == 5
    assert value(got_a, "dsec_layer_cache_total", result="miss") == 0
    # and prometheus_client's global registry holds none of it
    assert REGISTRY.get_sample_value("dsec_exec_total", {"kind": "exec", "outcome": "ok"}) is None
    # the apiserver's metrics, twice in one process too
    for _ in range(2):
        api = ApiserverMetrics()
        api.placed("n1", "home", False, count=3)
        api.placed("n1", "home", True)  # a request that overflowed: its home share is no overflow
        api.placed("n3", "overflow", True, count=2)
        api.probed("n1", 0.003, True)
        api.probed(Probed("n2", healthy=True), 0.5, False)  # one missed probe, still healthy
        api.probed(Probed("n3", healthy=False), 0.5, False)
        api.forwarded("exec", 0.001)
        api.create_done(0.2, False)
        api.observe_request("POST", "/v1/sandboxes", 201, 0.01)
        got = samples(_render(api.registry))
        assert value(got, "dsec_placement_decisions_total", node="n1", pool="home") == 4
        assert value(got, "dsec_placement_decisions_total", node="n3", pool="overflow") == 2
        assert value(got, "dsec_overflow_total") == 2
        assert value(got, "dsec_node_healthy", node="n1") == 1
        assert value(got, "dsec_node_healthy", node="n2") == 1
        assert value(got, "dsec_node_healthy", node="n3") == 0
        assert value(got, "dsec_node_probe_seconds_count", node="n1") == 1
        assert value(got, "dsec_apiserver_forward_seconds_count", route="exec") == 1
        assert value(got, "dsec_apiserver_create_seconds_count", outcome="error") == 1
        assert (
            value(
                got,
                "dsec_apiserver_requests_total",
                method="POST",
                route="/v1/sandboxes",
                code="201",
            )
            == 1
        )
        api.forget_node("n1")
        api.forget_node("n1")  # a node forgotten twice is no error
        assert value(samples(_render(api.registry)), "dsec_node_healthy", node="n1") == 0


@dataclass
class Probed:
    """The watcher's entry for a node, as ApiserverMetrics.probed reads it."""

    name: str
    healthy: bool


def test_apiserver_metrics_take_the_calls_the_apiserver_makes():
    from dsec_core.apiserver.app import Metrics
    from dsec_core.apiserver.nodes import NodeAddress, NodeEntry

    for name in ("create_done", "placed", "forwarded"):
        wanted = list(inspect.signature(getattr(Metrics, name)).parameters)
        have = list(inspect.signature(getattr(ApiserverMetrics, name)).parameters)
        assert have[: len(wanted)] == wanted, name
    api = ApiserverMetrics()
    entry = NodeEntry(NodeAddress("n7", "http://127.0.0.1:1"))  # the watcher's on_probe
    api.probed(entry, 0.01, False)
    got = samples(_render(api.registry))
    assert value(got, "dsec_node_healthy", node="n7") == 0
    assert value(got, "dsec_node_probe_seconds_count", node="n7") == 1


def _render(registry: CollectorRegistry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def test_exec_outcomes():
    assert exec_outcome(0, False) == "ok"
    assert exec_outcome(3, False) == "nonzero"
    assert exec_outcome(-9, True) == "timeout"
    assert exec_outcome(0, True) == "timeout"


@pytest.mark.parametrize(
    "text, ok",
    [
        ("abc-DEF_0.9", True),
        ("x" * 64, True),
        ("x" * 65, False),
        ("", False),
        ("a b", False),
        ("a\nb", False),
        ('a"b', False),
        ("é", False),
        (None, False),
    ],
)
def test_which_request_ids_are_taken(text, ok):
    assert valid_request_id(text) is ok


# --- JSON log lines --------------------------------------------------------------------------


def _format(emit: Callable[[logging.Logger], None], rid: str | None = None) -> dict:
    """The JSON object of the one record ``emit`` logs, while serving request ``rid``."""
    logger = logging.getLogger("dsec.test-observe")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonLogFormatter())
    logger.addHandler(handler)
    logger.propagate = False
    token = REQUEST_ID.set(rid)
    try:
        emit(logger)
    finally:
        REQUEST_ID.reset(token)
        logger.removeHandler(handler)
        logger.propagate = True
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_a_log_record_is_one_json_object_with_its_extra_fields():
    out = _format(
        lambda log: log.warning(
            "killing %s", "sb1", extra={"sandbox": "sb1", "duration_ms": 1.5, "where": Path("/x")}
        ),
        rid="req-1",
    )
    assert out["level"] == "WARNING" and out["logger"] == "dsec.test-observe"
    assert out["msg"] == "killing sb1"
    assert out["request_id"] == "req-1"
    assert out["sandbox"] == "sb1" and out["duration_ms"] == 1.5
    assert out["where"] == "/x"  # what JSON cannot hold is written as text
    assert out["ts"].endswith("Z") and time.strptime(out["ts"][:19], "%Y-%m-%dT%H:%M:%S")
    # none of LogRecord's own attributes leak in
    assert not {"args", "levelno", "pathname", "thread", "msecs"} & set(out)


def test_a_record_outside_a_request_has_no_request_id_and_keeps_its_traceback():
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        out = _format(lambda log: log.exception("failed"))
    assert "request_id" not in out
    assert "ValueError: boom" in out["exc"] and "\n" in out["exc"]  # escaped inside one line


# --- the middleware, in process --------------------------------------------------------------


@dataclass
class Served:
    app: Starlette
    metrics: NodeMetrics
    records: list[logging.LogRecord]


@pytest.fixture
def served() -> Iterator[Served]:
    inner_log = logging.getLogger("dsec.test-inner")

    async def sandbox(request: Request) -> JSONResponse:
        inner_log.warning("serving %s", request.path_params["sid"])
        return JSONResponse({"rid": REQUEST_ID.get()})

    async def fail(request: Request) -> JSONResponse:
        raise RuntimeError("handler bug")

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        inner_log.error("internal error: %s", exc)
        return JSONResponse({"error": "internal"}, 500)

    metrics = NodeMetrics()
    # as the node's make_app does: outermost, around Starlette's error middleware
    app = Starlette(
        routes=[Route("/v1/sandboxes/{sid}", sandbox), Route("/fail", fail)],
        exception_handlers={Exception: on_error},
    )
    app.middleware_stack = ObservedRequests(
        app.build_middleware_stack(), logger="dsec.test-access", metrics=metrics
    )
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    keep.addFilter(RequestIdFilter())
    loggers = [logging.getLogger("dsec.test-access"), inner_log]
    for lg in loggers:
        lg.addHandler(keep)
        lg.setLevel(logging.INFO)
    try:
        yield Served(app, metrics, records)
    finally:
        for lg in loggers:
            lg.removeHandler(keep)
            lg.setLevel(logging.NOTSET)


def _client(app: Starlette) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def test_the_request_id_is_taken_echoed_and_on_every_log_line(served: Served):
    async with _client(served.app) as c:
        r = await c.get("/v1/sandboxes/abc", headers={"X-Request-Id": "trainer-7.step_3"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trainer-7.step_3"
    assert r.json() == {"rid": "trainer-7.step_3"}  # the handler saw it
    inner = [x for x in served.records if x.name == "dsec.test-inner"]
    access = [x for x in served.records if x.name == "dsec.test-access"]
    assert [x.request_id for x in inner] == ["trainer-7.step_3"]
    (line,) = access
    assert line.request_id == "trainer-7.step_3"
    assert line.route == "/v1/sandboxes/{sid}"
    assert line.status == 200 and line.method == "GET"
    assert line.sandbox == "abc"
    assert 0 <= line.duration_ms < 1000
    assert REQUEST_ID.get() is None  # reset once the request is over


@pytest.mark.parametrize("sent", [None, "x" * 65, "bad id", "a\tb", "é".encode()])
async def test_a_missing_or_bad_request_id_is_replaced_by_a_new_one(served: Served, sent):
    headers = {} if sent is None else {"X-Request-Id": sent}
    async with _client(served.app) as c:
        r1 = await c.get("/v1/sandboxes/abc", headers=headers)
        r2 = await c.get("/v1/sandboxes/abc", headers=headers)
    rid = r1.headers["x-request-id"]
    assert valid_request_id(rid) and rid != sent
    assert r1.json() == {"rid": rid}
    assert r2.headers["x-request-id"] != rid  # one per request


async def test_requests_are_counted_by_route_template_and_metrics_are_served(served: Served):
    async with _client(served.app) as c:
        for sid in ("a", "b", "c"):
            await c.get(f"/v1/sandboxes/{sid}")
        assert (await c.get("/no/such/path")).status_code == 404
        assert (await c.get("/fail")).status_code == 500
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)
    assert (
        value(got, "dsec_requests_total", method="GET", route="/v1/sandboxes/{sid}", code="200")
        == 3
    )
    # raw paths never become labels: a stray path is "unmatched"
    assert value(got, "dsec_requests_total", method="GET", route="unmatched", code="404") == 1
    assert value(got, "dsec_requests_total", method="GET", route="/fail", code="500") == 1
    assert not any("/v1/sandboxes/a" in str(labels) for _, labels in got)
    access = [x for x in served.records if x.name == "dsec.test-access"]
    assert [(x.route, x.status) for x in access][3:] == [
        ("unmatched", 404),
        ("/fail", 500),
        ("/metrics", 200),
    ]
    async with _client(served.app) as c:
        got = samples((await c.get("/metrics")).text)
    assert value(got, "dsec_requests_total", method="GET", route="/metrics", code="200") == 1


async def test_an_internal_error_is_logged_and_answered_with_the_request_id(served: Served):
    async with _client(served.app) as c:
        r = await c.get("/fail", headers={"X-Request-Id": "oops-1"})
    assert r.status_code == 500 and r.json() == {"error": "internal"}
    assert r.headers["x-request-id"] == "oops-1"
    (err,) = [x for x in served.records if x.name == "dsec.test-inner"]
    assert err.getMessage() == "internal error: handler bug" and err.request_id == "oops-1"
    (line,) = [x for x in served.records if x.name == "dsec.test-access"]
    assert (line.route, line.status, line.request_id) == ("/fail", 500, "oops-1")


async def test_made_up_methods_do_not_grow_the_series(served: Served):
    async with _client(served.app) as c:
        for verb in ("FOO", "BAR", "BAZ"):
            await c.request(verb, "/v1/sandboxes/x")
        got = samples((await c.get("/metrics")).text)
    assert total(got, "dsec_requests_total", method="other") == 3
    assert not any(dict(ls).get("method") in ("FOO", "BAR") for _, ls in got)


# --- a real node daemon ----------------------------------------------------------------------


@dataclass
class ObservedNode:
    node: KitNode
    http: str
    token: str

    def metrics(self) -> dict:
        with self.raw() as c:
            r = c.get("/metrics")
        assert r.status_code == 200, r.text
        return samples(r.text)

    def raw(self) -> httpx.Client:
        """Requests on the node's unix socket (no token there), with headers of our own."""
        transport = httpx.HTTPTransport(uds=os.fspath(self.node.config.socket_path))
        return httpx.Client(transport=transport, base_url="http://node", timeout=30)

    def log_lines(self) -> list[dict]:
        return [json.loads(x) for x in (self.node.home / "dsecd.log").read_text().splitlines()]

    def wait_for_log(self, pred, timeout: float = 5.0) -> list[dict]:
        """The log's lines once one matches ``pred`` (the access line is written just after
        the answer is sent)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.log_lines()
            if any(pred(x) for x in lines) or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)


@pytest.fixture(scope="module")
def observed_node() -> Iterator[ObservedNode]:
    """A node of this module's own (fresh metrics, a log of its own, no layer mounted yet),
    on its unix socket and on loopback TCP behind a token."""
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    token = secrets.token_urlsafe(16)
    http = f"http://127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        # what the daemon reads as it starts; the rest of the session must not see it
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DSEC_LISTEN", http)
            mp.setenv("DSEC_API_TOKEN", token)
            node = stack.enter_context(running_kit_node("dsec-observe-"))
        yield ObservedNode(node, http, token)


def test_metrics_follow_creates_execs_and_states(observed_node: ObservedNode):
    on = observed_node
    environment = on.node.environment("observe-env")  # the kit's busybox layer alone
    before = on.metrics()
    assert value(before, "dsec_layer_cache_total", result="miss") == 0  # nothing mounted yet
    with on.node.client() as client, contextlib.ExitStack() as stack:
        a = client.create(environment=environment, memory="64M", ttl=120)
        stack.callback(_kill, client, a.id)
        after_a = on.metrics()
        # the first sandbox of the environment mounted its layer; the second finds it mounted
        assert value(after_a, "dsec_layer_cache_total", result="miss") == 1
        assert value(after_a, "dsec_layer_cache_total", result="hit") == 0
        b = client.create(environment=environment, memory="64M", ttl=120)
        stack.callback(_kill, client, b.id)
        with pytest.raises(UnknownLayer):
            client.create(layers=("no-such-layer@1",), memory="64M", ttl=120)

        assert a.exec("true").exit_code == 0
        assert a.exec("exit 3").exit_code == 3
        assert a.exec("sleep 5", timeout=0.3).timed_out
        ses = a.session()
        assert ses.exec("echo hi").exit_code == 0
        *_, streamed = a.exec_stream("echo hi; exit 4")
        assert streamed.exit_code == 4
        b.pause()
        with pytest.raises(DsecError):  # a paused sandbox's agent is frozen: the call fails
            b.exec("true")

        got = on.metrics()
        assert value(got, "dsec_layer_cache_total", result="hit") == 1
        assert value(got, "dsec_layer_cache_total", result="miss") == 1
        grew = total(got, "dsec_create_seconds_count", outcome="ok") - total(
            before, "dsec_create_seconds_count", outcome="ok"
        )
        assert grew == 2
        assert value(got, "dsec_create_seconds_count", backend="container", outcome="ok") >= 2
        assert (
            total(got, "dsec_create_seconds_count", outcome="error")
            - total(before, "dsec_create_seconds_count", outcome="error")
            == 1
        )
        assert value(got, "dsec_sandboxes", state="running") == 1
        assert value(got, "dsec_sandboxes", state="paused") == 1
        assert value(got, "dsec_sandboxes", state="creating") == 0
        for outcome, n in (("ok", 1), ("nonzero", 1), ("timeout", 1), ("error", 1)):
            assert value(got, "dsec_exec_total", kind="exec", outcome=outcome) == n, outcome
        assert value(got, "dsec_exec_total", kind="session", outcome="ok") == 1
        assert value(got, "dsec_exec_total", kind="stream", outcome="nonzero") == 1
        assert value(got, "dsec_exec_seconds_count", kind="exec") == 4
        # the timed-out command's 0.3 s went into the histogram
        assert value(got, "dsec_exec_seconds_sum", kind="exec") >= 0.3
        assert (
            value(
                got,
                "dsec_requests_total",
                method="POST",
                route="/v1/sandboxes/{sid}/exec",
                code="200",
            )
            >= 3
        )
        ses.close()
        b.resume()
    got = on.metrics()
    assert value(got, "dsec_sandboxes", state="running") == 0
    assert value(got, "dsec_sandboxes", state="paused") == 0


def _kill(client, sid: str) -> None:
    with contextlib.suppress(DsecError):
        client.kill(sid)


def test_the_request_id_follows_a_request_into_the_daemon_log(observed_node: ObservedNode):
    on = observed_node
    with on.node.client() as client:
        sb = client.create(layers=(on.node.layer.ref,), memory="64M", ttl=120)
    rid = f"trainer-{secrets.token_hex(4)}.kill"
    with on.raw() as c:
        r = c.delete(f"/v1/sandboxes/{sb.id}", headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid

    def access(x: dict) -> bool:
        return x.get("logger") == "dsec.access" and x.get("request_id") == rid

    lines = on.wait_for_log(access)
    mine = [x for x in lines if x.get("request_id") == rid]
    # the node's own line about the kill carries the id, and so does the access line
    assert any(
        x["logger"] == "dsec.node" and f"killing sandbox {sb.id}" in x["msg"] for x in mine
    ), mine
    (line,) = [x for x in mine if access(x)]
    assert line["route"] == "/v1/sandboxes/{sid}" and line["method"] == "DELETE"
    assert line["status"] == 200 and line["sandbox"] == sb.id
    assert line["duration_ms"] > 0 and line["level"] == "INFO"
    # every line of the daemon's log is a JSON object (json.loads above read them all)
    assert all({"ts", "level", "logger", "msg"} <= set(x) for x in lines)


def test_a_bad_request_id_is_replaced_on_the_node(observed_node: ObservedNode):
    on = observed_node
    bad = "x" * 65
    with on.raw() as c:
        r = c.get("/v1/sandboxes", headers={"X-Request-Id": bad})
        r2 = c.get("/v1/no/such/route", headers={"X-Request-Id": "line\\nbreak"})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert rid != bad and valid_request_id(rid)
    assert r2.status_code == 404 and valid_request_id(r2.headers["x-request-id"])
    lines = on.wait_for_log(lambda x: x.get("request_id") == rid)
    assert any(x.get("route") == "/v1/sandboxes" for x in lines if x.get("request_id") == rid)
    assert not any(bad in json.dumps(x) for x in lines)


def test_metrics_over_tcp_need_the_token(observed_node: ObservedNode):
    on = observed_node
    with httpx.Client(base_url=on.http, timeout=10) as c:
        r = c.get("/metrics")
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "AuthenticationFailed"
        r = c.get("/metrics", headers={"Authorization": f"Bearer {on.token}"})
    assert r.status_code == 200
    assert "dsec_sandboxes" in r.text and "# TYPE dsec_create_seconds histogram" in r.text


def test_the_access_log_can_be_switched_off(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    monkeypatch.setenv("DSEC_ACCESS_LOG", "off")
    with running_kit_node("dsec-observe-quiet-") as node:
        transport = httpx.HTTPTransport(uds=os.fspath(node.config.socket_path))
        with httpx.Client(transport=transport, base_url="http://node", timeout=30) as c:
            sid = c.post(
                "/v1/sandboxes", json={"spec": {"layers": [node.layer.ref], "memory": "64M"}}
            ).json()["sandboxes"][0]["id"]
            r = c.delete(f"/v1/sandboxes/{sid}", headers={"X-Request-Id": "quiet-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "quiet-1"
            assert c.get("/metrics").status_code == 200  # metrics stay
        lines = [json.loads(x) for x in (node.home / "dsecd.log").read_text().splitlines()]
    assert not [x for x in lines if x["logger"] == "dsec.access"]
    # the node's own lines still carry the request's id
    assert any(x.get("request_id") == "quiet-1" and "killing sandbox" in x["msg"] for x in lines)


async def test_metrics_can_be_guarded():
    metrics = ApiserverMetrics()

    async def nothing(scope, receive, send):
        raise AssertionError("not reached: /metrics is the middleware's")

    def allowed(scope) -> bool:
        return (b"authorization", b"Bearer scraper") in scope["headers"]

    app = ObservedRequests(nothing, metrics=metrics, metrics_allowed=allowed)
    async with _client(app) as c:
        r = await c.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationFailed"
        assert "x-request-id" in r.headers
        r = await c.get("/metrics", headers={"Authorization": "Bearer scraper"})
        assert r.status_code == 200 and "dsec_apiserver_create_seconds" in r.text
        got = samples(r.text)
    assert value(got, "dsec_apiserver_requests_total", method="GET", route="/metrics", code="401")
