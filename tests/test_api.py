"""The one API definition: the route table covers what the daemon serves and what the SDK
calls, the OpenAPI document is valid and complete, messages keep their JSON shapes, bad input
is a typed 400, and the transport's response parser reads what servers send."""

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
from dsec_core.api.messages import ExecRequest, WriteQuery
from dsec_core.api.openapi import openapi_document
from dsec_core.api.routes import RAW, ROUTES
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
from dsec_core.node.server import HANDLERS, make_app
from dsec_core.records import (
    ExecResult,
    FileEntry,
    LayerInfo,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)

#: Public client methods that are not one route each, and the route they are made of.
COMPOSED = {"create_many": "create", "upload": "write_file", "download": "read_file", "close": None}
#: Routes no SDK method needs: tools read the document.
NOT_IN_SDK = {"openapi"}


# --- the table covers the server and the SDK -------------------------------------------------


def test_the_server_serves_exactly_the_table(tmp_path):
    app = make_app(Node(NodeConfig(home=tmp_path)))
    served = {(m, r.path) for r in app.routes for m in r.methods if m != "HEAD"}
    assert served == {(r.method, r.path) for r in ROUTES.values()}
    assert set(HANDLERS) == set(ROUTES)


@pytest.mark.parametrize("client", [dsec.Client, dsec.AsyncClient])
def test_every_sdk_method_is_a_route(client):
    public = {n for n, v in vars(client).items() if callable(v) and not n.startswith("_")}
    assert public == (set(ROUTES) - NOT_IN_SDK) | set(COMPOSED)
    for name in set(ROUTES) - NOT_IN_SDK:  # and calls it through the table, by its own name
        assert re.search(rf'_call\(\s*"{name}"', inspect.getsource(getattr(client, name)))


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
    }
    assert ExecRequest.from_dict(body).stdin == b"in"
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


# --- bad input to a real daemon: a typed 400, never a 500 ------------------------------------

BAD_REQUESTS = [
    ("POST", "/v1/sandboxes", b"not json", 400, "InvalidSpec"),
    ("POST", "/v1/sandboxes", b"[]", 400, "InvalidSpec"),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "cpu": "lots"}}',
        400,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "disk": "lots"}}',
        400,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "disk": "1M"}}',
        400,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"]}, "count": 0}',
        400,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"], "ttl": 1e400}}',
        400,
        "InvalidSpec",
    ),
    (
        "POST",
        "/v1/sandboxes",
        b'{"spec": {"layers": ["kit-base@1"]}, "count": 100000}',
        429,
        "AdmissionRejected",
    ),
    ("POST", "/v1/sandboxes/x/exec", b'{"cmd": 5}', 400, "InvalidSpec"),
    ("POST", "/v1/sandboxes/x/exec", b'{"cmd": "true", "stdin": "%%%"}', 400, "InvalidSpec"),
    ("POST", "/v1/sandboxes/x/exec", b'{"cmd": "true"}', 404, "UnknownSandbox"),
    ("POST", "/v1/sandboxes/x/sessions/y/exec", b'{"cmd": ""}', 400, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/file?path=/a&offset=abc", None, 400, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/file?path=/a&offset=-1", None, 400, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/file", None, 400, "InvalidSpec"),
    ("GET", "/v1/sandboxes/x/ls?path=/&colour=1", None, 400, "InvalidSpec"),
    ("PUT", "/v1/sandboxes/x/file?path=/a&mode=999", b"", 400, "InvalidSpec"),
    ("DELETE", "/v1/sandboxes/x/file?path=/a&recursive=maybe", None, 400, "InvalidSpec"),
    ("GET", "/v1/node?x=1", None, 400, "InvalidSpec"),
    ("POST", "/v1/layers/prefetch", b'{"refs": []}', 400, "InvalidSpec"),
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
        dsec.Client(os.fspath(tmp_path / "no.sock")).list()
    with pytest.raises(dsec.NodeUnavailable):
        dsec.Client("http://127.0.0.1:9", token="t").list()  # discard port: refused
    with socket.socket() as srv:  # accepts, never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        t = HTTPTransport(f"http://127.0.0.1:{srv.getsockname()[1]}")
        with pytest.raises(TransportTimeout):
            t.request("GET", "/v1/node", timeout=0.2)
