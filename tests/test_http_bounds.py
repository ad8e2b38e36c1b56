"""What a request may cost a server, against a real node daemon on loopback TCP and a real
``dsec apiserver`` (with its E2B API) over it: a request head over ``DSEC_MAX_HEADER_BYTES`` is
431 ``HeadersTooLarge`` and one trickled past ``DSEC_HEADER_TIMEOUT`` is 408, each closing the
connection, with the server's memory not grown by what was sent; a JSON body nested 100k deep
is 422 ``InvalidSpec`` on every JSON route, never 500; a body over its route's ``max_body`` is
413 before it is all sent, one that stalls 408; the E2B control plane and envd's uploads are
bounded the same way, and leave no spool behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import dsec
from dsec_core.api.messages import WriteQuery
from dsec_core.api.routes import JSON, MAX_DEPTH, MAX_SPEC_BODY, RAW, ROUTES, load_json
from dsec_core.api.routes import MAX_UPLOAD as TABLE_MAX_UPLOAD
from dsec_core.e2b.lifecycle import E2B_MAX_BODY
from dsec_core.errors import InvalidSpec
from dsec_core.iam import Iam
from dsec_core.localnode import daemon_pid
from dsec_core.testing.apiserver import NamedNode, named_nodes, running_apiserver

#: The servers' environment here: short timeouts, so the tests wait little, and a small upload
#: limit, so going over it costs little.
ENV = {"DSEC_HEADER_TIMEOUT": "1", "DSEC_BODY_TIMEOUT": "1", "DSEC_MAX_UPLOAD": "4M"}
MAX_UPLOAD = 4 << 20
DEEP = 100_000

root = pytest.mark.skipif(os.geteuid() != 0, reason="a dsec node needs root")


# --- the depth-bounded loader, on its own --------------------------------------------------


def _nested(depth: int, kind: str = "[") -> bytes:
    if kind == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def test_load_json_bounds_nesting_without_recursing():
    assert load_json(_nested(MAX_DEPTH), "X") is not None
    assert load_json(_nested(MAX_DEPTH, "{"), "X") is not None
    assert load_json(b'{"a": [1, 2, {"b": null}], "c": "[[[[["}', "X")["c"] == "[[[[["
    for body in (
        _nested(MAX_DEPTH + 1),
        _nested(MAX_DEPTH + 1, "{"),
        _nested(500),  # loads (under the recursion limit), then measured
        _nested(DEEP),  # json.loads stops it at the recursion limit
        _nested(DEEP, "{"),
        b'{"spec": {"policies": {"p": ' + _nested(300) + b"}}}",
    ):
        with pytest.raises(InvalidSpec, match="more than 64 levels deep") as e:
            load_json(body, "CreateRequest")
        assert e.value.context == {"field": "body", "limit": MAX_DEPTH}
    with pytest.raises(InvalidSpec, match="not JSON"):
        load_json(b"[1,", "X")
    t0 = time.monotonic()
    with pytest.raises(InvalidSpec):
        load_json(b"[" * (64 << 20), "X")  # a whole MAX_BODY of it
    assert time.monotonic() - t0 < 2
    # a wide body is measured in one pass per level, not one Python step per item
    assert len(load_json(b"[" + b"[0,1,2,3]," * 200_000 + b"[]]", "X")) == 200_001


def test_the_route_table_bounds_every_body():
    for r in ROUTES.values():
        if r.body is None:
            assert r.max_body == 0
        elif r.body is RAW:
            assert r.max_body == TABLE_MAX_UPLOAD
        else:
            assert 0 < r.max_body <= 64 << 20
    assert ROUTES["create"].max_body == MAX_SPEC_BODY
    assert ROUTES["exec"].max_body == 64 << 20


# --- raw HTTP on a socket ------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool  # the server closed the connection after the answer
    sent: int  # bytes of the request sent when the answer came
    elapsed: float  # seconds from connecting to the answer's first byte

    def error(self) -> dict:
        return json.loads(self.body)["error"]


def _exchange(url: str, pieces: Iterable[bytes], pace: float = 0.0, linger: float = 0.0) -> Answer:
    """Send ``pieces`` on a fresh connection (from a thread, ``pace`` seconds apart, stopping
    once an answer comes) while reading the one answer; then wait for the server to close
    the connection, up to 5 s if the answer said it would, else up to ``linger`` s."""
    u = urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port))
    answered = threading.Event()
    sent = [0]

    def send() -> None:
        with contextlib.suppress(OSError):
            for piece in pieces:
                if answered.is_set():
                    return
                sock.sendall(piece)
                sent[0] += len(piece)
                if pace:
                    answered.wait(pace)

    sender = threading.Thread(target=send, daemon=True)
    t0 = time.monotonic()
    sender.start()
    sock.settimeout(30)
    data, elapsed, at_answer = b"", 0.0, 0
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(1 << 16)
            assert chunk, f"closed without an answer after {data!r}"
            if not elapsed:
                elapsed, at_answer = time.monotonic() - t0, sent[0]
                answered.set()
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        chunked = headers.get("transfer-encoding") == "chunked"
        length = int(headers.get("content-length", 0))
        while not body.endswith(b"0\r\n\r\n") if chunked else len(body) < length:
            chunk = sock.recv(1 << 16)
            assert chunk, "closed mid-answer"
            body += chunk
        if chunked:
            body = _unchunk(body)
        closed = False
        wait = 5.0 if headers.get("connection") == "close" else linger
        if wait:
            sock.settimeout(wait)
            try:
                closed = sock.recv(1 << 16) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                pass
    finally:
        answered.set()
        sock.close()
        sender.join(10)
    return Answer(int(lines[0].split()[1]), headers, body, closed, at_answer, elapsed)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while True:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if not n:
            return out
        out, data = out + data[:n], data[n + 2 :]


def _head(method: str, target: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "host: x", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunked(total: int, piece: int = 1 << 20, fill: bytes = b" ") -> Iterator[bytes]:
    data = fill * piece
    for _ in range(total // piece):
        yield b"%x\r\n%s\r\n" % (piece, data)
    yield b"0\r\n\r\n"


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of process ``pid``, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


# --- the servers ---------------------------------------------------------------------------


@dataclass
class Servers:
    node: NamedNode
    node_pid: int
    api_url: str
    api_pid: int
    key: str
    sid: str  # a sandbox of the key's project, through the apiserver
    spool: Path  # the apiserver's TMPDIR
    operator_key: str  # an admin key of the root project, for the operator's routes

    def node_auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.node.token}"}

    def api_auth(self, route: str = "") -> dict[str, str]:
        """The member key's header; the operator's for a route only it may call (which
        refuses a member before reading a body)."""
        key = self.operator_key if route in OPERATOR_ROUTES else self.key
        return {"authorization": f"Bearer {key}"}


#: Routes the apiserver serves to an admin key of the root project only.
OPERATOR_ROUTES = {"warm", "set_warm"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[Servers]:
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    iam.create_project("bounds")
    key = iam.create_key("bounds", "member")[1]
    operator_key = iam.create_key("/", "admin")[1]
    spool = tmp_path_factory.mktemp("spool")
    with named_nodes({"b1": {}}, env=ENV) as nodes, pytest.MonkeyPatch.context() as mp:
        for k, v in {**ENV, "TMPDIR": os.fspath(spool)}.items():
            mp.setenv(k, v)
        with running_apiserver(nodes, iam_url) as api:
            mp.undo()
            pid = daemon_pid(nodes[0].node.config)
            assert pid is not None
            with dsec.Client(api.url, api_key=key) as c:
                spec = dsec.SandboxSpec(layers=(nodes[0].node.layer.ref,), memory="64M", cpu=0.5)
                with c.create(spec) as sb:
                    yield Servers(
                        nodes[0], pid, api.url, api.proc.pid, key, sb.id, spool, operator_key
                    )
    iam.close()


# --- request heads -------------------------------------------------------------------------


@root
@pytest.mark.parametrize("size", [1 << 20, 64 << 20])
def test_a_huge_header_is_431_and_costs_the_server_nothing(servers, size):
    for url, pid, auth in (
        (servers.node.url, servers.node_pid, servers.node_auth()),
        (servers.api_url, servers.api_pid, servers.api_auth()),
    ):
        before = _status(pid)
        head = _head("GET", "/v1/node", auth).removesuffix(b"\r\n")
        filler = (b"a" * (1 << 20) for _ in range(size >> 20))
        a = _exchange(url, [head, b"x-big: ", *filler, b"\r\n\r\n"])
        after = _status(pid)
        assert a.status == 431, a
        assert a.error()["type"] == "HeadersTooLarge"
        assert a.error()["context"] == {"field": "headers", "limit": 64 << 10}
        assert a.headers["connection"] == "close" and a.closed
        # the server's memory did not grow by what was sent, and never peaked with it
        assert after["VmRSS"] - before["VmRSS"] < 8 << 20, (before, after)
        assert after["VmHWM"] - before["VmHWM"] < 8 << 20, (before, after)
        # and it serves on
        ok = _exchange(url, [_head("GET", "/v1/node", auth)])
        assert ok.status == 200


@root
def test_a_head_trickled_or_never_sent_is_408_within_the_bound(servers):
    head = _head("GET", "/v1/node", servers.node_auth())
    for url in (servers.node.url, servers.api_url):
        trickled = _exchange(url, (head[i : i + 1] for i in range(len(head))), pace=0.1)
        assert trickled.status == 408 and trickled.error()["type"] == "RequestTimeout"
        assert 0.9 < trickled.elapsed < 2.0 and trickled.closed
        assert trickled.error()["context"]["timeout"] == 1.0
        silent = _exchange(url, [])
        assert silent.status == 408 and 0.9 < silent.elapsed < 2.0 and silent.closed


@root
def test_keep_alive_and_pipelining_still_work(servers):
    get = _head("GET", "/v1/node", servers.node_auth())
    post = _head(
        "POST",
        "/v1/layers/prefetch",
        {**servers.node_auth(), "content-type": JSON, "content-length": "2"},
    )
    u = urlsplit(servers.node.url)
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(get + post + b"{}" + get)  # three requests in one write
        s.settimeout(10)
        data = b""
        while data.count(b"HTTP/1.1 ") < 3 or not data.endswith(b"}"):
            data += s.recv(1 << 16)
        time.sleep(1.5)  # idle past the header timeout: an idle connection is kept
        s.sendall(get)
        again = s.recv(1 << 16)
    statuses = re.findall(rb"HTTP/1.1 (\d+)", data)
    assert statuses == [b"200", b"422", b"200"]  # prefetch needs refs: read, decoded in turn
    assert again.startswith(b"HTTP/1.1 200")


# --- JSON bodies ---------------------------------------------------------------------------


def _json_routes() -> list:
    return [r for r in ROUTES.values() if r.body is not None and r.body is not RAW]


@root
@pytest.mark.parametrize("where", ["node", "apiserver"])
def test_a_deeply_nested_body_is_422_on_every_json_route(servers, where):
    url, auth = (
        (servers.node.url, servers.node_auth())
        if where == "node"
        else (servers.api_url, servers.api_auth())
    )
    deep = _nested(DEEP)
    for route in _json_routes():
        target = route.target({p: servers.sid if p == "sid" else "x1" for p in route.params})
        if where == "apiserver":
            auth = servers.api_auth(route.name)
        headers = {**auth, "content-type": JSON, "content-length": str(len(deep))}
        a = _exchange(url, [_head(route.method, target, headers), deep])
        assert a.status == 422, (route.name, a)
        assert a.error()["type"] == "InvalidSpec", (route.name, a)
        assert "more than 64 levels deep" in a.error()["message"]
    # nested within a valid body, in a free-form value, too
    body = b'{"spec": {"layers": ["x@1"], "policies": {"p": ' + _nested(200) + b"}}}"
    headers = {**auth, "content-type": JSON, "content-length": str(len(body))}
    a = _exchange(url, [_head("POST", "/v1/sandboxes", headers), body])
    assert a.status == 422 and "more than 64 levels" in a.error()["message"]
    assert _exchange(url, [_head("GET", "/v1/node", auth)]).status == 200


@root
@pytest.mark.parametrize("where", ["node", "apiserver"])
def test_a_body_over_its_route_limit_is_413_before_it_is_all_sent(servers, where):
    url, auth = (
        (servers.node.url, servers.node_auth())
        if where == "node"
        else (servers.api_url, servers.api_auth())
    )
    limit = ROUTES["create"].max_body
    # declared: refused on the head alone
    headers = {**auth, "content-type": JSON, "content-length": str(limit + 1)}
    a = _exchange(url, [_head("POST", "/v1/sandboxes", headers)], linger=3)
    assert a.status == 413 and a.error()["type"] == "RequestTooLarge"
    assert a.error()["context"]["limit"] == limit
    # the body it said it would send never came: the connection is closed in body_timeout
    assert a.closed
    # undeclared (chunked): refused once past the limit, long before the 64 MiB are sent
    headers = {**auth, "content-type": JSON, "transfer-encoding": "chunked"}
    a = _exchange(url, [_head("POST", "/v1/sandboxes", headers), *_chunked(64 << 20)], linger=3)
    assert a.status == 413 and a.error()["context"]["limit"] == limit
    assert a.sent < 16 << 20 and a.closed


@root
def test_a_raw_upload_over_max_upload_is_413(servers):
    target = ROUTES["write_file"].target({"sid": servers.sid}, WriteQuery("/tmp/f"))
    for url, auth in (
        (servers.node.url, servers.node_auth()),
        (servers.api_url, servers.api_auth()),
    ):
        node = url == servers.node.url
        headers = {**auth, "content-type": "application/octet-stream"}
        declared = {**headers, "content-length": str(MAX_UPLOAD + 1)}
        # both refuse on the head, before a byte of the body is read
        a = _exchange(url, [_head("PUT", target, declared)])
        assert a.status == 413 and a.error()["context"]["limit"] == MAX_UPLOAD
        chunked = {**headers, "transfer-encoding": "chunked"}
        total = 64 << 20 if node else 8 << 20
        a = _exchange(url, [_head("PUT", target, chunked), *_chunked(total)])
        assert a.status == 413 and a.error()["context"]["limit"] == MAX_UPLOAD, a
        if node:  # refused as the count passed the limit, not at the end
            assert a.sent < 32 << 20
        # the apiserver streams it on and cuts it off as the count passes the limit: the
        # node's connection goes, and the apiserver serves on
        assert _exchange(url, [_head("GET", "/v1/node", auth)]).status == 200
        fits = {**headers, "content-length": str(MAX_UPLOAD)}
        a = _exchange(url, [_head("PUT", target, fits), b"z" * MAX_UPLOAD])
        assert a.status == 200 and json.loads(a.body) == {"written": MAX_UPLOAD}


@root
def test_a_body_that_stalls_is_408(servers):
    for url, auth in (
        (servers.node.url, servers.node_auth()),
        (servers.api_url, servers.api_auth()),
    ):
        headers = {**auth, "content-type": JSON, "content-length": "100"}
        a = _exchange(url, [_head("POST", "/v1/layers/prefetch", headers), b'{"refs": '])
        assert a.status == 408 and a.error()["type"] == "RequestTimeout", a
        assert a.elapsed < 2.0 and a.closed
    target = ROUTES["write_file"].target({"sid": servers.sid}, WriteQuery("/tmp/g"))
    headers = {**servers.node_auth(), "content-length": "100"}
    a = _exchange(servers.node.url, [_head("PUT", target, headers), b"half"])
    assert a.status == 408 and a.closed
    # a sandbox route's body: the apiserver reads and decodes it before the node sees it,
    # so it is refused at DSEC_BODY_TIMEOUT, and the apiserver serves on
    target = ROUTES["set_ttl"].target({"sid": servers.sid})
    headers = {**servers.api_auth(), "content-type": JSON, "content-length": "100"}
    a = _exchange(servers.api_url, [_head("PUT", target, headers), b'{"ttl": '])
    assert a.status == 408 and a.error()["type"] == "RequestTimeout", a
    assert a.elapsed < 3.5 and a.closed
    # a file body the apiserver streams on to the node: the same bound, as it streams
    target = ROUTES["write_file"].target({"sid": servers.sid}, WriteQuery("/tmp/h"))
    headers = {**servers.api_auth(), "content-length": "100"}
    a = _exchange(servers.api_url, [_head("PUT", target, headers), b"half"])
    assert a.status == 408 and a.error()["type"] == "RequestTimeout", a
    assert a.elapsed < 3.5 and a.closed
    assert _exchange(servers.api_url, [_head("GET", "/v1/node", servers.api_auth())]).status == 200


# --- the E2B API ---------------------------------------------------------------------------


@root
def test_e2b_create_over_its_limit_is_413_unread(servers):
    headers = {"x-api-key": servers.key, "content-type": JSON}
    declared = {**headers, "content-length": str(100_000_000)}
    a = _exchange(servers.api_url, [_head("POST", "/sandboxes", declared), b"{"], linger=3)
    assert a.status == 413 and a.sent < 1 << 10 and a.closed
    assert json.loads(a.body)["code"] == 413
    chunked = {**headers, "transfer-encoding": "chunked"}
    a = _exchange(servers.api_url, [_head("POST", "/v2/sandboxes", chunked), *_chunked(100 << 20)])
    assert a.status == 413 and a.sent < E2B_MAX_BODY + (16 << 20)
    deep = _nested(DEEP)
    body = {**headers, "content-length": str(len(deep))}
    a = _exchange(servers.api_url, [_head("POST", "/sandboxes", body), deep])
    assert a.status == 400 and "levels deep" in json.loads(a.body)["message"]
    # a Connect call's message is bounded the same way
    envd = {"x-access-token": servers.key, "e2b-sandbox-id": servers.sid, **body}
    a = _exchange(servers.api_url, [_head("POST", "/filesystem.Filesystem/Stat", envd), deep])
    assert a.status == 400 and json.loads(a.body)["code"] == "invalid_argument"


def _multipart(boundary: str, files: Iterable[tuple[str, bytes]]) -> bytes:
    out = b""
    for name, data in files:
        out += (
            (
                f'--{boundary}\r\ncontent-disposition: form-data; name="file"; '
                f'filename="{name}"\r\ncontent-type: application/octet-stream\r\n\r\n'
            ).encode()
            + data
            + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode()


@root
def test_envd_uploads_over_max_upload_are_413_and_leave_no_spool(servers):
    envd = {"x-access-token": servers.key, "e2b-sandbox-id": servers.sid}
    octets = {**envd, "content-type": "application/octet-stream"}
    declared = {**octets, "content-length": str(5 << 30)}
    a = _exchange(servers.api_url, [_head("POST", "/files?path=/tmp/u", declared)], linger=3)
    assert a.status == 413 and a.closed and json.loads(a.body)["code"] == 413
    chunked = {**octets, "transfer-encoding": "chunked"}
    a = _exchange(
        servers.api_url, [_head("POST", "/files?path=/tmp/u", chunked), *_chunked(32 << 20)]
    )
    # refused as the count passed the limit, not at the end: the server says at what count
    # (what the client had sent by the time it read the answer depends on how fast its
    # reader ran: the server reads and drops a refused body for a while, LINGER)
    assert a.status == 413, a
    counted = re.search(r"has (\d+) bytes or more", json.loads(a.body)["message"])
    assert counted is not None and int(counted.group(1)) < 16 << 20, a.body
    form = {**envd, "content-type": "multipart/form-data; boundary=BOUND"}
    big = _multipart("BOUND", [("/tmp/a", b"a" * (3 << 20)), ("/tmp/b", b"b" * (3 << 20))])
    pieces = [b"%x\r\n%s\r\n" % (len(big), big), b"0\r\n\r\n"]
    head = _head("POST", "/files", {**form, "transfer-encoding": "chunked"})
    a = _exchange(servers.api_url, [head, *pieces])
    assert a.status == 413, a
    # within the limit, both kinds land
    small = _multipart("BOUND", [("/tmp/m1", b"one"), ("/tmp/m2", b"two" * 1000)])
    a = _exchange(
        servers.api_url,
        [_head("POST", "/files", {**form, "content-length": str(len(small))}), small],
    )
    assert a.status == 200, a
    assert [w["path"] for w in json.loads(a.body)] == ["/tmp/m1", "/tmp/m2"]
    with dsec.Client(servers.api_url, api_key=servers.key) as c:
        assert c.read_file(servers.sid, "/tmp/m2") == b"two" * 1000
    assert list(servers.spool.glob("dsec-e2b-*")) == []
