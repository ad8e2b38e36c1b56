"""The one API definition: the route table covers what the daemon serves and what the SDK
calls, the OpenAPI document is valid and complete, messages keep their JSON shapes, bad input
is a typed 422, and the transport's response parser reads what servers send."""

from __future__ import annotations

import base64
import inspect
import json
import os
import re
import socket
import subprocess
import sys

import pytest
from openapi_spec_validator import validate as validate_openapi

import dsec
from dsec_core.api.iam import IAM_ROUTES
from dsec_core.api.messages import MAX_READ, ExecRequest, ReadQuery, WriteQuery
from dsec_core.api.openapi import openapi_document
from dsec_core.api.routes import MAX_BODY, RAW, ROUTES
from dsec_core.api.shapes import decoder, encoder
from dsec_core.api.transport import (
    Address,
    HTTPTransport,
    ResponseParser,
    TransportError,
    TransportTimeout,
)
from dsec_core.config import NodeConfig
from dsec_core.errors import error_from_wire
from dsec_core.node.node import Node
from dsec_core.node.server import HANDLERS, PIECE, make_app
from dsec_core.records import (
    ExecResult,
    FileEntry,
    LayerInfo,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)
from dsec_core.sdk import core

#: Public client methods that are not one route each, and the route they are made of.
COMPOSED = {
    "create_many": "create",
    "upload": "write_file",
    "download": "read_file",
    "close": None,
    "group": None,  # a handle: its methods are list, create, pack_diff+restore, pause, ...
}
#: Routes no SDK method needs: tools read the document.
NOT_IN_SDK = {"openapi"}
#: The SDK core's operation of each route, where it is not named after it.
CORE_OPS = {"list": "list_sandboxes"}


# --- the table covers the server and the SDK -------------------------------------------------


def test_the_server_serves_exactly_the_table(tmp_path):
    app = make_app(Node(NodeConfig(home=tmp_path)))
    served = {(m, r.path) for r in app.routes for m in r.methods if m != "HEAD"}
    # and SandboxFusion's /run_code (dsec_core.fusion), in its own shapes outside the table
    assert served == {(r.method, r.path) for r in ROUTES.values()} | {("POST", "/run_code")}
    assert set(HANDLERS) == set(ROUTES)


@pytest.mark.parametrize("client", [dsec.Client, dsec.AsyncClient])
def test_every_sdk_method_is_a_route(client):
    public = {n for n, v in vars(client).items() if callable(v) and not n.startswith("_")}
    routes = {**ROUTES, **IAM_ROUTES}  # IAM's: an apiserver's own
    assert public == (set(routes) - NOT_IN_SDK) | set(COMPOSED)
    # made from, or running, the core's operation of the route (that it sends the route:
    # tests/test_sdk.py)
    for name in set(routes) - NOT_IN_SDK:
        op, method = CORE_OPS.get(name, name), getattr(client, name)
        made = inspect.unwrap(method) is getattr(core, op)
        assert made or re.search(rf"core\.{op}\(", inspect.getsource(method)), name


def test_route_names_and_paths_are_unique():
    assert len({(r.method, r.path) for r in ROUTES.values()}) == len(ROUTES)
    for route in ROUTES.values():
        assert route.path.startswith("/v1/") and route.summary


# --- the OpenAPI document ---------------------------------------------------------------------


def test_openapi_document_is_valid_and_documents_every_route():
    doc = openapi_document()
    validate_openapi(doc)  # OpenAPI 3.1, with its JSON Schema 2020-12 dialect
    assert doc["openapi"].startswith("3.1")
    for route in ROUTES.values():
        op = doc["paths"][route.path][route.method.lower()]
        assert op["operationId"] == route.name
        assert str(route.status) in op["responses"] and "4XX" in op["responses"]
        params = {p["name"]: p for p in op.get("parameters", [])}
        assert {n for n, p in params.items() if p["in"] == "path"} == set(route.params)
        if route.body is RAW:
            assert "application/octet-stream" in op["requestBody"]["content"]
        elif route.body is not None:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/" + route.body.__name__)
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"]


def test_openapi_schemas_follow_the_records():
    schemas = openapi_document()["components"]["schemas"]
    spec = schemas["SandboxSpec"]["properties"]
    assert spec["memory"]["anyOf"] == [{"type": "integer", "format": "int64"}, {"type": "string"}]
    assert spec["env"] == {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "default": {},
    }
    assert schemas["ExecResult"]["properties"]["stdout"]["contentEncoding"] == "base64"
    assert schemas["SandboxList"]["properties"]["sandboxes"]["items"] == {
        "$ref": "#/components/schemas/SandboxInfo"
    }
    assert schemas["CreateRequest"]["properties"]["count"]["minimum"] == 1


def test_cli_prints_the_document():
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "node", "openapi"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == json.loads(json.dumps(openapi_document()))


def test_the_daemon_serves_the_document(dsec_node):
    t = HTTPTransport(os.fspath(dsec_node.config.socket_path))
    r = t.request("GET", ROUTES["openapi"].path, timeout=10)
    t.close()
    assert r.status_code == 200 and r.json() == json.loads(json.dumps(openapi_document()))


# --- messages keep the JSON shapes of records and of the old wire ----------------------------

SAMPLES = [
    SandboxSpec(layers=("a@1",), env={"A": "1"}, policies={"p": {"x": [1]}}, memory=64 << 20),
    SandboxInfo(
        id="abc",
        backend="container",
        state="running",
        created=1.5,
        expires=None,
        layers=("a@1", "b@2"),
        environment=None,
        limits={"cpu": 1.0},
        pid=7,
    ),
    ExecResult(
        exit_code=3,
        stdout=b"\x00\xffout",
        stderr=b"err",
        duration=0.25,
        truncated=True,
        command="x",
        sandbox_id="abc",
    ),
    FileEntry(name="f", type="file", size=3, mode=0o644, mtime=2.5),
    LayerInfo(name="a", version="1", kind="base", digest="sha256:" + "0" * 64, size=10),
    SandboxUsage(memory=1, cpu_seconds=0.5, pids=None),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_records_encode_as_their_to_dict_and_round_trip(record):
    wire = encoder(type(record))(record)
    assert wire == json.loads(json.dumps(record.to_dict()))
    assert decoder(type(record))(json.loads(json.dumps(wire)), "x") == record


def test_strings_may_carry_raw_bytes_of_file_names():
    # surrogateescape's U+DC80-U+DCFF stand for bytes that are not UTF-8 (fsdecode)
    assert ExecRequest.from_dict({"cmd": ["cat", "/tmp/\udcff"]}).cmd == ("cat", "/tmp/\udcff")


def test_exec_request_keeps_the_old_wire_shape():
    body = ExecRequest(["echo", "hi"], 5, None, {"A": "b"}, "in", 100).to_dict()
    assert body == {
        "cmd": ["echo", "hi"],
        "timeout": 5,
        "cwd": None,
        "env": {"A": "b"},
        "stdin": base64.b64encode(b"in").decode(),
        "max_output": 100,
        "background": False,
        "exclusive": False,
        "trajectory": None,
        "step": None,
    }
    assert ExecRequest.from_dict(body).stdin == b"in"
    # the shape before background and exclusive still reads, with both off
    old = ExecRequest.from_dict(
        {
            k: v
            for k, v in body.items()
            if k not in ("background", "exclusive", "trajectory", "step")
        }
    )
    assert (old.background, old.exclusive, old.trajectory, old.step) == (False, False, None, None)
    assert (
        ROUTES["write_file"].target({"sid": "a/b"}, WriteQuery("/t x", "755", 0, False))
        == "/v1/sandboxes/a%2Fb/file?path=%2Ft%20x&mode=755&offset=0&truncate=0"
    )


@pytest.mark.parametrize(
    "data, message",
    [
        ({"cmd": 5}, "expected a string or an array"),
        ({"cmd": []}, "cmd"),
        ({"cmd": "x", "timeout": "soon"}, "ExecRequest.timeout"),
        ({"cmd": "x", "timeout": float("nan")}, "finite"),
        ({"cmd": "x", "max_output": -1}, "at least 0"),
        ({"cmd": "x", "max_output": True}, "64-bit integer"),
        ({"cmd": "x", "max_output": 1 << 64}, "64-bit integer"),
        ({"cmd": "x", "stdin": "not base64!"}, "base64"),
        ({"cmd": "x", "background": "yes"}, "ExecRequest.background"),
        ({"cmd": "x", "exclusive": 1}, "ExecRequest.exclusive"),
        ({"cmd": "x", "env": {"A": 1}}, "ExecRequest.env.A"),
        ({"cmd": "echo \ud800"}, "ExecRequest.cmd"),  # a lone surrogate is no text (was a 500)
        ({"cmd": "x", "shell": True}, "unknown field"),
        ({"timeout": 1}, "missing field 'cmd'"),
        ([], "ExecRequest object"),
    ],
)
def test_bad_messages_are_invalid_spec(data, message):
    with pytest.raises(dsec.InvalidSpec, match=message):
        ExecRequest.from_dict(data)


# --- bad input to a real daemon: a typed 422, never a 500 ------------------------------------

BAD_REQUESTS = [
    ("POST", "/v1/sandboxes", b"not json", 422, "InvalidSpec"),
    ("POST", "/v1/sandboxes", b"[]", 422, "InvalidSpec"),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "cpu": "lots"}}',
        422,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "disk": "lots"}}',
        422,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "disk": "1M"}}',
        422,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"]}, "count": 0}',
        422,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "ttl": 1e400}}',
        422,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"]}, "count": 100000}',  # over DSEC_MAX_BATCH
        422,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "workdir": "/a\\u0000b"}}',
        422,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes/x/exec",
        b'{"cmd": "true", "max_output": 16777217}',
        422,
        "InvalidSpec",
    ),
    ("POST", "/v1/sandboxes/x/exec", b'{"cmd": "true", "timeout": 1e12}', 422, "InvalidSpec"),
    ("POST", "/v1/sandboxes/x/exec", b'{"cmd": "true", "timeout": 0}', 422, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/file?path=/a&length=268435457", None, 422, "InvalidSpec"),
    ("PUT", "/v1/sandboxes/x/file?path=/a&mode=999", None, 422, "InvalidSpec"),
    ("PUT", "/v1/sandboxes/x/file?path=/a&mode=1644", None, 422, "InvalidSpec"),  # sticky
    ("POST", "/v1/sandboxes/x/exec", b'{"cmd": 5}', 422, "InvalidSpec"),
    ("POST", "/v1/sandboxes/x/exec", b'{"cmd": "true", "stdin": "%%%"}', 422, "InvalidSpec"),
    ("POST", "/v1/sandboxes/x/exec", b'{"cmd": "true"}', 404, "UnknownSandbox"),
    ("POST", "/v1/sandboxes/x/sessions/y/exec", b'{"cmd": ""}', 422, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/file?path=/a&offset=abc", None, 422, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/file?path=/a&offset=-1", None, 422, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/file", None, 422, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/ls?path=/&colour=1", None, 422, "InvalidSpec"),
    ("PUT", "/v1/sandboxes/x/file?path=/a&mode=999", b"", 422, "InvalidSpec"),
    ("DELETE", "/v1/sandboxes/x/file?path=/a&recursive=maybe", None, 422, "InvalidSpec"),
    ("GET", "/v1/node?x=1", None, 422, "InvalidSpec"),
    ("POST", "/v1/layers/prefetch", b'{"refs": []}', 422, "InvalidSpec"),
    ("GET", "/v1/nothing", None, 404, "NotFound"),
    ("PATCH", "/v1/sandboxes", None, 405, "DsecError"),
    ("GET", "/v1/sandboxes/", None, 404, "NotFound"),
]


@pytest.mark.parametrize("method, target, body, status, kind", BAD_REQUESTS)
def test_bad_input_is_a_typed_error(dsec_node, method, target, body, status, kind):
    t = HTTPTransport(os.fspath(dsec_node.config.socket_path))
    try:
        r = t.request(method, target, body=body, content_type="application/json", timeout=30)
    finally:
        t.close()
    assert r.status_code == status, r.text
    err = error_from_wire(r.json()["error"])
    assert type(err).__name__ == kind and err.http_status in (status, 500)


def test_sdk_raises_the_typed_errors(dsec_client, dsec_sandboxes):
    sb = dsec_sandboxes.create()
    with pytest.raises(dsec.InvalidSpec, match="cmd"):
        sb.exec([])
    with pytest.raises(dsec.InvalidSpec, match="timeout"):
        sb.exec("true", timeout=-1)
    with pytest.raises(dsec.SandboxPathError):
        sb.read_file("/no/such/file")
    with pytest.raises(dsec.InvalidSpec):
        dsec_client.create_many(layers=(sb.info.layers[-1],), n=0)
    assert sb.exec("echo ok", max_output=0).stdout == b""  # 0 is no output, as asked


# --- bad arguments to the SDK: InvalidSpec naming the field, raised before anything is sent --

_L = ("kit-base@1",)
#: (method, positional arguments, keyword arguments, the field the error names)
BAD_CALLS = [
    ("create", (), dict(layers=_L, cpu="abc"), "cpu"),
    ("create", (), dict(layers=_L, cpu=float("nan")), "cpu"),
    ("create", (), dict(layers=_L, cpu=True), "cpu"),
    ("create", (), dict(layers=_L, memory=1.5), "memory"),
    ("create", (), dict(layers=_L, memory=1 << 70), "memory"),
    ("create", (), dict(layers=_L, pids="x"), "pids"),
    ("create", (), dict(layers=_L, ttl=float("inf")), "ttl"),
    ("create", (), dict(layers=_L, env={"A": 1}), "env.A"),
    ("create", (), dict(layers=_L, labels=["a"]), "labels"),
    ("create", (), dict(layers=_L, workdir="relative"), "workdir"),
    ("create", (), dict(layers="kit-base@1"), "layers"),
    ("create", (), dict(layers=[5]), "layers[0]"),
    ("create", (), dict(layers=_L, policies={"p": 5}), "policies"),
    ("create", (), dict(layers=_L, policies={"p": {"x": float("nan")}}), None),
    ("create", (), dict(layers=_L, colour="red"), None),
    ("create", ("kit-base@1",), {}, "spec"),
    ("create_many", (), dict(layers=_L, n=0), "count"),
    ("create_many", (), dict(layers=_L, n=-3), "count"),
    ("create_many", (), dict(layers=_L, n="2"), "count"),
    ("create_many", (), dict(layers=_L, n=True), "count"),
    ("create_many", (), dict(layers=_L, n=1 << 64), "count"),
    ("exec", ("s", ["echo", 5]), {}, "cmd"),
    ("exec", ("s", None), {}, "cmd"),
    ("exec", ("s", 5), {}, "cmd"),
    ("exec", ("s", "true"), dict(timeout="x"), "timeout"),
    ("exec", ("s", "true"), dict(timeout=-1), "timeout"),
    ("exec", ("s", "true"), dict(timeout=float("inf")), "timeout"),
    ("exec", ("s", "true"), dict(timeout=1e12), "timeout"),
    ("exec", ("s", "true"), dict(stdin=5), "stdin"),
    ("exec", ("s", "true"), dict(env={"A": 1}), "env.A"),
    ("exec", ("s", "true"), dict(env="A=1"), "env"),
    ("exec", ("s", "true"), dict(cwd=5), "cwd"),
    ("exec", ("s", "true"), dict(max_output=1 << 40), "max_output"),
    ("exec", ("s", "true"), dict(max_output=-1), "max_output"),
    ("exec", (5, "true"), {}, "sandbox_id"),
    ("exec", ("", "true"), {}, "sandbox_id"),
    ("session_open", ("s",), dict(env={"A": None}), "env.A"),
    ("session_exec", ("s", "ses", ["ls"]), {}, "cmd"),
    ("session_exec", ("s", 5, "true"), {}, "session_id"),
    ("session_exec", ("s", "ses", "true"), dict(timeout=0), "timeout"),
    ("write_file", ("s", "/f", b"d"), dict(mode=999), "mode"),  # 0o1747: decimal by mistake
    ("write_file", ("s", "/f", b"d"), dict(mode="644"), "mode"),
    ("write_file", ("s", "/f", b"d"), dict(mode=-1), "mode"),
    ("write_file", ("s", "/f", b"d"), dict(mode=0o10000), "mode"),
    ("write_file", ("s", "/f", 5), {}, "data"),
    ("write_file", ("s", 5, b"d"), {}, "path"),
    ("write_file", ("s", "", b"d"), {}, "path"),
    ("read_file", ("s", None), {}, "path"),
    ("download", ("s", 5, "/dev/null"), {}, "path"),
    ("download", ("s", "/etc/hosts", 1), {}, "local"),  # not a file descriptor
    ("upload", ("s", "/no/such/local/file", "/r"), {}, "local"),
    ("upload", ("s", "/", "/r"), {}, "local"),
    ("upload", ("s", None, "/r"), {}, "local"),
    ("upload", ("s", "/etc/hostname", "/r"), dict(mode=999), "mode"),
    ("list_dir", ("s", 5), {}, "path"),
    ("stat", ("s", b"/etc"), {}, "path"),
    ("remove", ("s", "/f"), dict(recursive="yes"), "recursive"),
    ("get", (5,), {}, "sandbox_id"),
    ("kill", (None,), {}, "sandbox_id"),
    ("usage", ("a\ud800",), {}, "sandbox_id"),
    ("set_policy", ("s", "p", 5), {}, "settings"),
    ("set_policy", ("s", "p", {"x": {1, 2}}), {}, None),
    ("set_policy", ("s", "p", {"x": float("nan")}), {}, None),
    ("prefetch", ("kit-base@1",), {}, "refs"),
    ("prefetch", ([5],), {}, "refs[0]"),
    ("prefetch", ([],), {}, "refs"),
]


def _named(err: dsec.InvalidSpec, field: str | None) -> bool:
    """Whether the error names ``field`` (as the SDK's argument or the message's path)."""
    if field is None:
        return True
    named = str(err.context.get("field", ""))
    return named == field or named.endswith("." + field) or named.endswith(field)


@pytest.mark.parametrize("method, args, kw, field", BAD_CALLS, ids=lambda v: repr(v)[:40])
def test_bad_sdk_arguments_are_invalid_spec_before_sending(tmp_path, method, args, kw, field):
    # A client of no node at all: an InvalidSpec (not NodeUnavailable) was raised client-side.
    with dsec.Client(os.fspath(tmp_path / "none.sock"), retry=0) as client:
        with pytest.raises(dsec.InvalidSpec) as caught:
            getattr(client, method)(*args, **kw)
        assert _named(caught.value, field), (caught.value, caught.value.context)
        with pytest.raises(dsec.NodeUnavailable):  # the control: a good call is sent
            client.get("s")


@pytest.mark.parametrize("method, args, kw, field", BAD_CALLS, ids=lambda v: repr(v)[:40])
async def test_bad_async_sdk_arguments_are_invalid_spec(tmp_path, method, args, kw, field):
    async with dsec.AsyncClient(os.fspath(tmp_path / "none.sock"), retry=0) as client:
        with pytest.raises(dsec.InvalidSpec) as caught:
            await getattr(client, method)(*args, **kw)
        assert _named(caught.value, field), (caught.value, caught.value.context)
        with pytest.raises(dsec.NodeUnavailable):
            await client.get("s")


def test_bad_client_arguments_are_invalid_spec(monkeypatch):
    for kw in (dict(address=5), dict(address=b"/x.sock"), dict(address="", retry=0)):
        with pytest.raises(dsec.InvalidSpec):
            dsec.Client(**kw)
    with pytest.raises(dsec.InvalidSpec, match="token"):
        dsec.Client("http://127.0.0.1:9", token=5)
    with pytest.raises(dsec.InvalidSpec, match="retry"):
        dsec.AsyncClient("/x.sock", retry=-1)
    monkeypatch.setenv("DSEC_RETRY_TIMEOUT", "soon")
    with pytest.raises(dsec.InvalidSpec, match="DSEC_RETRY_TIMEOUT"):
        dsec.Client("/x.sock")


def test_batch_counts_are_refused_before_any_work(dsec_client, dsec_sandboxes, dsec_node):
    layer = dsec_node.layer.ref
    before = {i.id for i in dsec_client.list()}
    for n in (0, -1):
        with pytest.raises(dsec.InvalidSpec, match="count"):
            dsec_client.create_many(layers=(layer,), memory="64M", n=n)
    cap = dsec_node.config.max_batch
    rss = dsec_node.daemon_rss()
    with pytest.raises(dsec.InvalidSpec, match="DSEC_MAX_BATCH") as caught:
        dsec_client.create_many(layers=(layer,), memory="64M", n=cap + 1)
    assert caught.value.context["limit"] == cap
    with pytest.raises(dsec.InvalidSpec, match="DSEC_MAX_BATCH"):
        dsec_client.create_many(layers=(layer,), memory="64M", n=(1 << 63) - 1)
    assert dsec_node.daemon_rss() - rss < 8 << 20
    assert {i.id for i in dsec_client.list()} == before  # nothing was made, nothing is left
    made = dsec_sandboxes.create_many(2, memory="64M")
    assert len(made) == 2


# --- file contents stream through the daemon in pieces ----------------------------------------


def _raw(sock_path, head: bytes, body: bytes = b"") -> tuple[bytes, bytes]:
    """One request on a fresh unix connection; the answer's head and body as they came."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        try:
            s.sendall(head + b"\r\n\r\n" + body)
        except BrokenPipeError:  # the node answered and closed before taking all of it
            pass
        data = b""
        while chunk := s.recv(1 << 20):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def test_files_stream_in_pieces_both_ways(dsec_node, dsec_sandboxes):
    sb = dsec_sandboxes.create()
    t = HTTPTransport(os.fspath(dsec_node.config.socket_path))
    blob = bytes(range(251)) * ((3 * PIECE + 7) // 251 + 1)  # crosses pieces, no period of 2^k
    try:
        target = ROUTES["write_file"].target({"sid": sb.id}, WriteQuery("/tmp/b", "600", 0, True))
        r = t.request("PUT", target, body=b"head", content_type="application/octet-stream")
        assert r.json() == {"written": 4}
        # one request of several pieces at an offset, the file not truncated
        target = ROUTES["write_file"].target({"sid": sb.id}, WriteQuery("/tmp/b", "600", 2, False))
        r = t.request("PUT", target, body=blob, content_type="application/octet-stream")
        assert r.status_code == 200 and r.json() == {"written": len(blob)}
        whole = b"he" + blob
        assert sb.stat("/tmp/b").size == len(whole) and sb.stat("/tmp/b").mode == 0o600
        for offset, length in [(0, -1), (1, 2 * PIECE), (PIECE - 1, PIECE + 2), (7, 0), (5, 3)]:
            target = ROUTES["read_file"].target({"sid": sb.id}, ReadQuery("/tmp/b", offset, length))
            r = t.request("GET", target, timeout=60)
            end = None if length < 0 else offset + length
            assert r.status_code == 200 and r.content == whole[offset:end], (offset, length)
        # a long answer streams (chunked) rather than being built whole first
        sock = os.fspath(dsec_node.config.socket_path)
        head, _ = _raw(
            sock,
            f"GET /v1/sandboxes/{sb.id}/file?path=/tmp/b HTTP/1.1\r\nhost: x\r\n"
            "connection: close".encode(),
        )
        assert b"transfer-encoding: chunked" in head.lower()
        # -1 stops at MAX_READ, also on a file larger than that
        sb.exec(f"truncate -s {MAX_READ + PIECE} /tmp/sparse").check()
        target = ROUTES["read_file"].target({"sid": sb.id}, ReadQuery("/tmp/sparse"))
        r = t.request("GET", target, timeout=120)
        assert r.status_code == 200 and len(r.content) == MAX_READ
    finally:
        t.close()


def test_a_read_cut_off_mid_stream_is_incomplete_not_short(dsec_node, dsec_sandboxes):
    """The sandbox dies while its file streams out: the answer ends without its last chunk, so
    no client can take what came for the whole file."""
    sb = dsec_sandboxes.create()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.fspath(dsec_node.config.socket_path))
        s.sendall(
            f"GET /v1/sandboxes/{sb.id}/file?path=/dev/zero HTTP/1.1\r\nhost: x\r\n\r\n".encode()
        )
        data = s.recv(1 << 16)
        assert data.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in data
        sb.kill()
        while chunk := s.recv(1 << 20):
            data += chunk
    assert len(data) < MAX_READ and not data.endswith(b"\r\n0\r\n\r\n")
    parser = ResponseParser()
    assert parser.feed(data) is None
    with pytest.raises(TransportError, match="mid-response"):
        parser.eof()


def test_upload_and_download_stream_files(dsec_sandboxes, tmp_path):
    sb = dsec_sandboxes.create()
    local = tmp_path / "in.bin"
    local.write_bytes(os.urandom(9 << 20))  # more than one SDK CHUNK
    local.chmod(0o1750)  # the sticky bit means nothing on a file: it stays behind
    sb.upload(local, "/tmp/in.bin")
    assert sb.stat("/tmp/in.bin").mode == 0o750
    sb.download("/tmp/in.bin", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == local.read_bytes()
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    with pytest.raises(dsec.SandboxPathError):
        sb.download("/no/such/file", keep)
    assert keep.read_text() == "mine"


def test_json_bodies_over_the_limit_are_refused_unread(dsec_node):
    sock = os.fspath(dsec_node.config.socket_path)
    rss = dsec_node.daemon_rss()
    # declared too large: refused at once, with nothing of the body sent
    head, body = _raw(
        sock,
        b"POST /v1/sandboxes HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d" % (1 << 40),
    )
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["type"] == "RequestTooLarge"
    # chunked, with no length said: refused once past the limit (exec's, the largest)
    assert ROUTES["exec"].max_body == MAX_BODY
    piece = b" " * (1 << 20)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range((MAX_BODY >> 20) + 2))
    head, body = _raw(
        sock,
        b"POST /v1/sandboxes/nosuch/exec HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ntransfer-encoding: chunked",
        chunks + b"0\r\n\r\n",
    )
    assert head.startswith(b"HTTP/1.1 413"), head
    error = json.loads(body.split(b"\r\n")[1] if b"chunked" in head.lower() else body)["error"]
    assert error["type"] == "RequestTooLarge" and error["context"]["limit"] == MAX_BODY
    assert dsec_node.daemon_rss() - rss < 2 * MAX_BODY  # what it read is freed... or bounded


@pytest.mark.parametrize(
    "spec",
    [dict(pids=1 << 31), dict(env={"": "x"}), dict(env={"A=B": "x"}), dict(env={"A": "a\0b"})],
)
def test_specs_runc_would_refuse_are_invalid(dsec_sandboxes, spec):
    # found by fuzzing: these used to reach runc and come back as a 500 ToolError
    with pytest.raises(dsec.InvalidSpec):
        dsec_sandboxes.create(**spec)


# --- the transport's sans-IO parser -----------------------------------------------------------


def _feed_bytewise(data: bytes):
    p = ResponseParser()
    out = None
    for i in range(len(data)):
        out = p.feed(data[i : i + 1])
        if out is not None:
            assert i == len(data) - 1
    return p, out


def test_parser_reads_content_length_chunked_and_interim_answers():
    _, r = _feed_bytewise(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello")
    assert (r.status_code, r.content, r.headers["x-a"], r.keep_alive) == (200, b"hello", "b", True)
    _, r = _feed_bytewise(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        b"3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\n"
    )
    assert (r.status_code, r.content, r.keep_alive) == (201, b"abcde", False)
    _, r = _feed_bytewise(b"HTTP/1.1 204 No Content\r\n\r\n")
    assert r.content == b""


def test_parser_close_delimited_and_broken_answers():
    p = ResponseParser()
    assert p.feed(b"HTTP/1.0 200 OK\r\n\r\npart one, ") is None
    assert p.feed(b"part two") is None
    r = p.eof()
    assert r.content == b"part one, part two" and not r.keep_alive
    with pytest.raises(TransportError, match="without an answer"):
        ResponseParser().eof()
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")
    with pytest.raises(TransportError, match="mid-response"):
        p.eof()
    with pytest.raises(TransportError, match="status line"):
        ResponseParser().feed(b"SPDY/9 what\r\n\r\n")


def test_addresses():
    assert Address.parse("/run/x.sock") == Address("unix", path="/run/x.sock")
    assert Address.parse("unix:///run/x.sock") == Address("unix", path="/run/x.sock")
    assert Address.parse("http://127.0.0.1:8400") == Address("http", "127.0.0.1", 8400)
    assert str(Address.parse("https://[::1]:9")) == "https://[::1]:9"
    assert Address.parse("https://node.example").port == 443
    for bad in ("ftp://x:1", "http://", "http://h:99999", "http://h:1/prefix", ""):
        with pytest.raises(dsec.InvalidSpec):
            Address.parse(bad)


def test_unreachable_and_slow_nodes(tmp_path):
    with pytest.raises(dsec.NodeUnavailable):
        dsec.Client(os.fspath(tmp_path / "no.sock"), retry=0).list()
    with pytest.raises(dsec.NodeUnavailable):
        dsec.Client("http://127.0.0.1:9", token="t", retry=0).list()  # discard port: refused
    with socket.socket() as srv:  # accepts, never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        t = HTTPTransport(f"http://127.0.0.1:{srv.getsockname()[1]}")
        with pytest.raises(TransportTimeout):
            t.request("GET", "/v1/node", timeout=0.2)
