"""The SDK's shape: every route has a method in both clients, the twins (``Client`` and
``AsyncClient``, ``Sandbox`` and ``AsyncSandbox``, ...) have the same methods, signatures and
docstrings, each method is made from its core operation (whose parameters are its messages'
fields), every public method is documented, the core runs without I/O, and mypy reads the
installed package's types (py.typed) so a user's type error is reported."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

import dsec
from dsec_core import sdk
from dsec_core.api.iam import IAM_ROUTES
from dsec_core.api.routes import RAW, ROUTES
from dsec_core.api.transport import Response
from dsec_core.errors import DsecError, NotFound, UnknownLease, UnknownSandbox
from dsec_core.records import LeaseInfo, SandboxInfo, SandboxSpec
from dsec_core.sdk import core

REPO = Path(__file__).resolve().parent.parent
#: Every route an SDK method calls: the node API's, and IAM's (an apiserver's only).
ALL_ROUTES = {**ROUTES, **IAM_ROUTES}

#: Routes no SDK method needs: tools read the document.
NOT_IN_SDK = {"openapi"}
#: The twins: (blocking, asyncio).
TWINS = [
    (sdk.Client, sdk.AsyncClient),
    (sdk.Sandbox, sdk.AsyncSandbox),
    (sdk.Session, sdk.AsyncSession),
    (sdk.Group, sdk.AsyncGroup),
    (sdk.Lease, sdk.AsyncLease),
]
#: Client methods written out rather than made from one core operation of the same name, and
#: why: its own (``close``, a group's handle), one of several operations (one id or many, or a
#: group), or a name the core cannot give a function (``list``).
WRITTEN_OUT = {"close", "group", "pause", "resume", "list"}
OP_NAMES = {"list": "list_sandboxes"}


def _public(cls: type) -> dict[str, Any]:
    """The public methods and properties of ``cls``, its bases' (a handle's ref) included."""
    return {
        n: v
        for k in reversed(cls.__mro__[:-1])
        for n, v in vars(k).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }


def _async_free(text: str) -> str:
    """An annotation of an async twin as its blocking twin writes it."""
    return re.sub(r"\bAsync(?=[A-Z])", "", text)


def _params(fn: Callable[..., Any], drop: int = 1) -> list[tuple[str, Any, Any, str]]:
    """(name, kind, default, annotation) of each parameter, the first ``drop`` left out."""
    ps = list(inspect.signature(fn).parameters.values())[drop:]
    return [(p.name, p.kind, p.default, _async_free(str(p.annotation))) for p in ps]


# --- the route table and the clients ----------------------------------------------------------


@pytest.mark.parametrize("client", [dsec.Client, dsec.AsyncClient])
def test_every_route_has_a_method(client):
    missing = set(ALL_ROUTES) - NOT_IN_SDK - set(_public(client))
    assert not missing, f"routes without an SDK method: {sorted(missing)}"


@pytest.mark.parametrize("sync, aio", TWINS, ids=lambda c: c.__name__)
def test_the_twins_have_the_same_methods_signatures_and_docstrings(sync, aio):
    assert set(_public(sync)) == set(_public(aio))
    assert inspect.getdoc(sync) and inspect.getdoc(aio)
    for name, member in _public(sync).items():
        twin = getattr(aio, name)
        if isinstance(member, property):
            assert isinstance(twin, property) and member.__doc__ == twin.__doc__, name
            continue
        assert inspect.getdoc(member) == inspect.getdoc(twin), f"{sync.__name__}.{name}"
        assert _params(member) == _params(twin), f"{sync.__name__}.{name}"
        ret = inspect.signature(member).return_annotation
        assert _async_free(str(ret)) == _async_free(
            str(inspect.signature(twin).return_annotation)
        ), name
        # what blocks in the one is awaited in the other (a handle's constructor is neither)
        if name != "group":
            assert inspect.iscoroutinefunction(twin), f"{aio.__name__}.{name} is not async"
            assert not inspect.iscoroutinefunction(member), name


@pytest.mark.parametrize("client", [sdk.Client, sdk.AsyncClient])
def test_each_client_method_is_made_from_its_core_operation(client):
    """A route's parameters and docstring are written once, in its core operation: each client
    method is made from it (``methods``), but those written out for a reason."""
    for name, method in _public(client).items():
        if name in WRITTEN_OUT:
            assert not hasattr(method, "__wrapped__"), name
            continue
        op = getattr(core, name)
        assert inspect.unwrap(method) is op, f"{client.__name__}.{name} is not core.{name}"
        assert method.__qualname__ == f"{client.__name__}.{name}"
        assert inspect.getdoc(method) == inspect.getdoc(op)
        assert _params(method) == _params(op, drop=0), name
    for name in WRITTEN_OUT - {"close", "group"}:  # one id (or more) and its operation's options
        op = getattr(core, OP_NAMES.get(name, name))
        assert _params(getattr(client, name))[1:] == _params(op, drop=0)[1:], name


def test_a_sandbox_handle_is_its_clients_methods_with_the_id_filled_in():
    client = _public(sdk.Client)
    for name, method in _public(sdk.Sandbox).items():
        if name in ("refresh", "session"):
            continue
        target = client[name]
        assert next(iter(inspect.signature(target).parameters)) == "self"
        first = list(inspect.signature(target).parameters)[1]
        assert first in ("sandbox_id", "sandboxes"), name
        assert _params(method) == _params(target, drop=2), name
    # every client method on one sandbox has its handle method, but those of a handle of its
    # own (a session's) and ``get`` (``refresh``)
    on_one = {
        n for n, m in client.items() if list(inspect.signature(m).parameters)[1:2] == ["sandbox_id"]
    }
    assert on_one - set(_public(sdk.Sandbox)) == {"get", "session_exec", "session_close"}


#: Fields of a route's messages that are not its operation's parameters, and why.
NOT_PARAMETERS = {
    "fncall": {"project", "start"},  # set by the apiserver for the caller's project
    "create": {"count"},  # create(spec, **fields); create_many(spec, n)
    # the apiserver asks its nodes for a project's own, and where a create key's went
    "list": {"project", "subtree", "create_key"},
    "read_file": {"offset", "length"},  # read in pieces by the SDK
    "write_file": {"offset", "truncate"},  # written in pieces by the SDK
    "exec_stream": {"trajectory", "step"},  # a streamed command is not logged
}
#: Parameters of an operation that are not fields of its messages, but the ids in the route's
#: path (its first): a raw body, what the client does itself (renewing a lease), a header (a
#: create's key).
NOT_FIELDS = {"data", "renew", "key"}
#: A field an operation names otherwise.
RENAMED = {("restore", "count"): "n"}
NO_DEFAULT = inspect.Parameter.empty
#: Where an operation's default is not its message's, and why.
SDK_DEFAULTS = {
    # a command the SDK runs is bounded unless asked otherwise; on the wire null is no bound
    ("exec", "timeout"): 300.0,
    ("exec_stream", "timeout"): 300.0,
    ("session_exec", "timeout"): 300.0,
    ("fncall", "timeout"): 300.0,
    ("set_ttl", "ttl"): NO_DEFAULT,  # None (until killed) is asked for, not assumed
    ("write_file", "mode"): 0o644,  # permission bits, sent as octal text
    ("pack_diff", "secrets"): None,  # None for none: no mutable default
    ("create", "spec"): None,  # made of the keyword arguments when none is given
    ("create_project", "quota"): None,  # None for no bounds: no mutable default
}


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    return NO_DEFAULT if f.default_factory is MISSING else f.default_factory()


@pytest.mark.parametrize("name", sorted(set(ALL_ROUTES) - NOT_IN_SDK - {"judge"}))
def test_each_operation_takes_its_messages_fields(name):
    """An operation's parameters are its route's message fields, in order and with their
    defaults, but where this file says why not (``judge`` takes a ``JudgeSpec``, or its fields
    as keywords that are checked against it)."""
    route, op = ALL_ROUTES[name], getattr(core, OP_NAMES.get(name, name))
    in_path = len(re.findall(r"\{\w+\}", route.path))
    params = [
        (p.name, p.default)
        for p in list(inspect.signature(op).parameters.values())[in_path:]
        if p.kind is not p.VAR_KEYWORD and p.name not in NOT_FIELDS
    ]
    wanted = [
        (RENAMED.get((name, f.name), f.name), SDK_DEFAULTS.get((name, f.name), _default(f)))
        for message in (route.body, route.query)
        if message not in (None, RAW)
        for f in fields(message)
        if f.name not in NOT_PARAMETERS.get(name, ())
    ]
    assert params == wanted


def test_every_public_method_of_the_sdk_is_documented():
    undocumented = []
    for cls in (c for pair in TWINS for c in pair):
        for name, member in _public(cls).items():
            if not (member.__doc__ or "").strip():
                undocumented.append(f"{cls.__name__}.{name}")
    assert not undocumented


def test_no_method_comes_from_getattr():
    for cls in (c for pair in TWINS for c in pair):
        assert "__getattr__" not in {n for k in cls.__mro__ for n in vars(k)}, cls
    assert "__getattr__" not in "".join(
        p.read_text() for p in Path(sdk.__file__).parent.glob("*.py")
    )


def test_the_sdk_imports_nothing_but_the_standard_library():
    # a slim client distribution can then carry the SDK with dsec's api, records and errors
    code = (
        "import sys; before = set(sys.modules); import dsec_core.sdk; "
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before}"
        " - set(sys.stdlib_module_names)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['dsec_core']"


# --- the core without I/O ---------------------------------------------------------------------


def _info(sid: str, **labels: str) -> SandboxInfo:
    return SandboxInfo(sid, "container", "running", 1.0, None, ("base@1",), None, {}, labels)


def test_a_chunked_read_is_a_series_of_calls(monkeypatch):
    monkeypatch.setattr(core, "CHUNK", 4)
    op = core.read_file("sb-1", "/f")
    call = next(op)
    assert call.route.name == "read_file"
    assert call.target == "/v1/sandboxes/sb-1/file?path=%2Ff&offset=0&length=4"
    assert op.send(b"abcd").target.endswith("offset=4&length=4")
    with pytest.raises(StopIteration) as done:
        op.send(b"ef")
    assert done.value.value == b"abcdef"


def test_a_forgotten_lease_is_taken_again_as_it_was():
    info = LeaseInfo("l-1", "trainer", ("a", "b"), 5.0, 0.0, "held", reclaim=True)
    op = core.renew_or_retake(info)
    assert next(op).route.name == "lease_renew"
    again = op.throw(UnknownLease("gone"))
    assert again.route.name == "lease"
    assert json.loads(again.content) == {
        "sandboxes": ["a", "b"],
        "ttl": 5.0,
        "holder": "trainer",
        "reclaim": True,
    }


def test_create_many_kills_what_it_made_when_one_failed():
    op = core.create_many(None, 2, layers=("base@1",))
    assert next(op).route.name == "create"
    made = ROUTES["create"].decode_response(
        json.dumps(
            {
                "sandboxes": [_info("sb-1").to_dict()],
                "errors": [{"type": "AdmissionRejected", "message": "full"}],
            }
        ).encode()
    )
    cleanup = op.send(made)
    assert isinstance(cleanup, core.Batch)
    assert [c.target for c in cleanup.calls] == ["/v1/sandboxes/sb-1"]
    assert all(c.tolerate == (DsecError,) for c in cleanup.calls)
    with pytest.raises(dsec.AdmissionRejected, match="full"):
        op.send([None])


def test_a_group_forks_only_its_own_members():
    op = core.group_fork("g", "sb-1", 2)
    assert next(op).target == "/v1/sandboxes/sb-1"
    with pytest.raises(dsec.InvalidSpec, match="not a member"):
        op.send(_info("sb-1", **{core.GROUP_LABEL: "other"}))
    op = core.group_fork("g", "sb-1", 2, memory="256M")
    next(op)
    assert op.send(_info("sb-1", **{core.GROUP_LABEL: "g"})).route.name == "pack_diff"


def test_a_tolerated_error_is_the_calls_answer():
    call = core.call("kill", sid="gone", tolerate=(UnknownSandbox,))
    body = json.dumps({"error": {"type": "UnknownSandbox", "message": "no"}}).encode()
    assert isinstance(call.answer(Response(404, body, {})), UnknownSandbox)
    with pytest.raises(UnknownSandbox):
        core.call("kill", sid="gone").answer(Response(404, body, {}))


# --- both clients send the same requests ------------------------------------------------------

#: Arguments of each route's method (all of its route's fields set where it has them).
SAMPLES: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "node_info": ((), {}),
    "probe": ((), {}),
    "warm": ((), {}),
    "set_warm": (
        ([(SandboxSpec(layers=("base@1",)), 2)],),
        {"auto": True, "budget": "1G", "window": 30.0},
    ),
    "create": ((), {"layers": ("base@1",), "memory": "256M"}),
    "list": ((), {}),
    "get": (("sb-1",), {}),
    "kill": (("sb-1",), {}),
    "usage": (("sb-1",), {}),
    "pause": (("sb-1",), {"reclaim": True}),
    "resume": (("sb-1",), {}),
    "events": (("sb-1",), {}),
    "lease": (("sb-1",), {"ttl": 5.0, "holder": "t", "reclaim": True, "renew": False}),
    "lease_get": (("l-1",), {}),
    "lease_renew": (("l-1",), {}),
    "lease_release": (("l-1",), {"kill": True}),
    "trajectory": (("traj",), {}),
    "remove_trajectory": (("traj",), {}),
    "policies": (("sb-1",), {}),
    "set_policy": (("sb-1", "egress", {"allow": ["example.com"]}), {}),
    "exec": (
        ("sb-1", ["echo", "hi"]),
        dict(
            timeout=5,
            cwd="/tmp",
            env={"A": "1"},
            stdin="in",
            max_output=10,
            background=True,
            exclusive=True,
            trajectory="traj",
            step=2,
        ),
    ),
    "exec_stream": (("sb-1", "echo hi"), dict(timeout=5, cwd="/tmp", stdin=b"x")),
    "process_start": (
        ("sb-1", ["sh"]),
        dict(timeout=5, cwd="/tmp", env={"A": "1"}, stdin=True, rows=24, cols=80, background=True),
    ),
    "processes": (("sb-1",), {}),
    "process": (("sb-1", 7), {}),
    "process_output": (("sb-1", 7), {"from_start": False}),
    "process_input": (("sb-1", 7, "ls\n"), {"eof": True}),
    "process_resize": (("sb-1", 7, 40, 100), {}),
    "process_signal": (("sb-1", 7, "TERM"), {}),
    "set_ttl": (("sb-1", 60.0), {}),
    "session_open": (("sb-1",), {"cwd": "/tmp", "env": {"A": "1"}}),
    "sessions": (("sb-1",), {}),
    "session_exec": (("sb-1", "ses-1", "ls"), {"timeout": 5, "stdin": b"x", "max_output": 10}),
    "session_close": (("sb-1", "ses-1"), {}),
    "read_file": (("sb-1", "/etc/hosts"), {}),
    "write_file": (("sb-1", "/tmp/f", "data"), {"mode": 0o600}),
    "remove": (("sb-1", "/tmp/f"), {"recursive": True}),
    "screenshot": (("sb-1",), {}),
    "input": (("sb-1", [{"type": "key", "key": "a"}]), {}),
    "list_dir": (("sb-1", "/tmp"), {}),
    "stat": (("sb-1", "/tmp"), {}),
    "fncall": (
        ("env", "echo hi"),
        dict(stdin="x", files={"a.txt": "A"}, timeout=5, env={"A": "1"}, cpu=0.5, memory="256M"),
    ),
    "judge": (
        ("env", "python3 main.py"),
        {"files": {"main.py": "print(1)"}, "cases": [dsec.JudgeCase(b"", b"1\n")]},
    ),
    "pack_diff": (("sb-1",), {"name": "snap", "exclude": ["/x"], "secrets": {"k": "v"}}),
    "snapshot_memory": (("sb-1", "m"), {}),
    "memory_snapshot": (("m",), {}),
    "remove_memory_snapshot": (("m",), {}),
    "restore": (("snap@1", 2), {"memory": "256M"}),
    "layers": ((), {}),
    "prefetch": ((["a@1"],), {}),
    "resolve_image": (("python:3.11-slim-bookworm",), {}),
    "whoami": ((), {}),
    "projects": ((), {"under": "org"}),
    "create_project": (("org/team",), {"quota": {"sandboxes": 2, "memory": "1G"}}),
    "project": (("org/team",), {}),
    "set_quota": (("org/team", dsec.Quota(cpu=2.0)), {}),
    "revoke_project": (("org/team",), {"force": True}),
    "keys": ((), {"project": "org"}),
    "create_key": (("org/team", "agent"), {"name": "sub", "ttl": 60.0}),
    "revoke_key": (("0123456789abcdef",), {}),
}

_MISSING = json.dumps({"error": {"type": "NotFound", "message": "the fake node has none"}})


class _Streamed:
    def __init__(self, r: Response) -> None:
        self.status_code, self.headers, self._content = r.status_code, r.headers, r.content

    def __enter__(self) -> _Streamed:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    async def __aenter__(self) -> _Streamed:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def read(self) -> bytes:
        return self._content


class _AsyncStreamed(_Streamed):
    async def read(self) -> bytes:  # type: ignore[override]
        return self._content


class FakeNode:
    """A node's files in a dict (``files``), and a NotFound for everything else; every request
    kept."""

    def __init__(self, files: bool = True) -> None:
        self.sent: list[tuple[str, str, bytes | None, str | None, float | None, bool]] = []
        self.files: dict[str, bytearray] = {}
        self.has_files = files

    def answer(self, method: str, target: str, body: bytes | None, **kw: Any) -> Response:
        self.sent.append(
            (method, target, body, kw.get("content_type"), kw.get("timeout"), kw.get("idempotent"))
        )
        url = urlsplit(target)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path.endswith("/file") and method == "PUT" and self.has_files:
            f = self.files.setdefault(q["path"], bytearray())
            off = int(q["offset"])
            if q["truncate"] == "true":
                del f[off:]
            f[off : off + len(body or b"")] = body or b""
            return Response(200, json.dumps({"written": len(body or b"")}).encode(), {})
        if url.path.endswith("/file") and q.get("path") in self.files:
            off, n = int(q["offset"]), int(q["length"])
            return Response(200, bytes(self.files[q["path"]][off : off + n]), {})
        return Response(404, _MISSING.encode(), {})


class SyncFake:
    def __init__(self, node: FakeNode) -> None:
        self.node = node

    def request(self, method: str, target: str, *, body: bytes | None = None, **kw: Any):
        return self.node.answer(method, target, body, **kw)

    def stream(self, method: str, target: str, *, body: bytes | None = None, **kw: Any):
        return _Streamed(self.node.answer(method, target, body, **kw))

    def close(self) -> None:
        pass


class AsyncFake(SyncFake):
    async def request(self, method: str, target: str, *, body: bytes | None = None, **kw: Any):  # type: ignore[override]
        return self.node.answer(method, target, body, **kw)

    async def stream(self, method: str, target: str, *, body: bytes | None = None, **kw: Any):  # type: ignore[override]
        return _AsyncStreamed(self.node.answer(method, target, body, **kw))

    async def aclose(self) -> None:
        pass


def _clients(
    tmp_path: Path, files: bool = True
) -> tuple[dsec.Client, dsec.AsyncClient, FakeNode, FakeNode]:
    sync_node, async_node = FakeNode(files), FakeNode(files)
    client = dsec.Client(os.fspath(tmp_path / "none.sock"), retry=0)
    aclient = dsec.AsyncClient(os.fspath(tmp_path / "none.sock"), retry=0)
    client._http = SyncFake(sync_node)  # type: ignore[assignment]
    aclient._http = AsyncFake(async_node)  # type: ignore[assignment]
    return client, aclient, sync_node, async_node


def test_the_samples_cover_every_route():
    assert set(SAMPLES) == set(ALL_ROUTES) - NOT_IN_SDK


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_both_clients_send_each_route_the_same_way(tmp_path, name):
    client, aclient, sync_node, async_node = _clients(tmp_path, files=False)
    args, kw = SAMPLES[name]

    with pytest.raises(NotFound):
        out = getattr(client, name)(*args, **kw)
        list(out)  # exec_stream: a generator sends when it is iterated

    async def run() -> None:
        with pytest.raises(NotFound):
            out = await getattr(aclient, name)(*args, **kw)
            [x async for x in out]  # exec_stream: the lines of its answer

    asyncio.run(run())
    assert sync_node.sent == async_node.sent
    (method, target, body, content_type, timeout, idempotent), *_ = sync_node.sent
    route = ALL_ROUTES[name]
    assert method == route.method
    assert re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", route.path) + r"(\?.*)?", target), target
    if route.body not in (None, RAW):
        assert set(json.loads(body or b"{}")) <= {f.name for f in fields(route.body)}


def test_both_clients_move_files_in_the_same_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "CHUNK", 4)
    client, aclient, sync_node, async_node = _clients(tmp_path)
    local = tmp_path / "up"
    local.write_bytes(b"0123456789")

    client.write_file("sb-1", "/a", b"abcdefghij")
    client.upload("sb-1", local, "/b", mode=0o600)
    assert client.read_file("sb-1", "/a") == b"abcdefghij"
    client.download("sb-1", "/b", tmp_path / "down-sync")

    async def run() -> bytes:
        await aclient.write_file("sb-1", "/a", b"abcdefghij")
        await aclient.upload("sb-1", local, "/b", mode=0o600)
        await aclient.download("sb-1", "/b", tmp_path / "down-async")
        return await aclient.read_file("sb-1", "/a")

    assert asyncio.run(run()) == b"abcdefghij"
    assert (tmp_path / "down-sync").read_bytes() == (tmp_path / "down-async").read_bytes()
    assert (tmp_path / "down-sync").read_bytes() == b"0123456789"
    assert len([s for s in sync_node.sent if s[0] == "PUT"]) == 6  # 3 pieces of each file
    assert sorted(sync_node.sent) == sorted(async_node.sent)


# --- types for users: py.typed and mypy -------------------------------------------------------


def _distributions() -> list[Path]:
    return [REPO, *sorted(REPO.glob("plugins/*/")), *sorted(REPO.glob("builders/*/"))]


@pytest.mark.parametrize("dist", _distributions(), ids=lambda p: p.name)
def test_every_distribution_ships_py_typed(dist):
    project = tomllib.loads((dist / "pyproject.toml").read_text())
    data = project["tool"]["setuptools"]["package-data"]
    packages = [p.name for p in dist.glob("dsec*/__init__.py") for p in [p.parent]]
    assert packages
    for package in packages:
        assert (dist / package / "py.typed").is_file(), package
        assert "py.typed" in data.get(package, []), f"{dist.name}: {package} lacks py.typed"


GOOD = """
    import asyncio

    import dsec


    def main() -> None:
        with dsec.Client("unix:///nowhere.sock", autostart=False) as client:
            with client.create(environment="python", memory="256M") as sb:
                result = sb.exec(["python3", "-c", "print(1)"], timeout=10)
                code: int = result.exit_code
                print(code, result.text, sb.info.state)
                for entry in sb.list_dir("/tmp"):
                    print(entry.name)
                with sb.session() as session:
                    print(session.exec("cd /tmp").ok)
                info: dsec.SandboxInfo = client.pause(sb.id)
                infos: list[dsec.SandboxInfo] = client.resume([sb.id])
                called: dsec.FnCallResult = client.fncall("python", script="print(1)")
                print(info, infos, called.stdout)
            group = client.group("rollout")
            members: list[dsec.Sandbox] = group.create(n=2, environment="python")
            with client.lease([m.id for m in members], ttl=5) as lease:
                print(lease.id, group.fork(members[0], 2)[0].exec("true").ok)


    async def amain() -> None:
        async with dsec.AsyncClient("unix:///nowhere.sock", autostart=False) as client:
            async with await client.create(environment="python") as sb:
                result = await sb.exec("echo hi")
                print(result.stdout.decode())
                async for item in await sb.exec_stream("echo hi"):
                    print(item)
            called: dsec.FnCallResult = await client.fncall("python", "true", timeout=5)
            print(called.exit_code)


    main()
    asyncio.run(amain())
"""

BAD = """
    import dsec

    with dsec.Client("unix:///nowhere.sock", autostart=False) as client:
        sb = client.create(environment="python")
        sb.exec(5)
        print(sb.exec("ls").exit_status)
        client.fncall("python", script=1)
        code: int = client.fncall("python", script="print(1)")
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A Python environment with dsec installed from its wheel (not the source tree), so mypy
    reads it as a user's would: through py.typed, or not at all."""
    src = tmp_path_factory.mktemp("src") / "dsec"
    shutil.copytree(
        REPO,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "*.egg-info",
            "__pycache__",
            "plugins",
            "builders",
            "tests",
            "bench",
            "catalog",
            "examples",
        ),
    )
    wheels = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("dsec-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert {"dsec/py.typed", "dsec_core/py.typed"} <= set(z.namelist())
    env = tmp_path_factory.mktemp("env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True)
    site = next(env.glob("lib/python*/site-packages"))
    subprocess.run(
        [*pip, "install", "--no-deps", "-q", "--target", site, wheel],
        check=True,
        capture_output=True,
    )
    return env / "bin" / "python"


def _mypy(python: Path, where: Path, script: str) -> list[str]:
    (where / "user.py").write_text(textwrap.dedent(script).lstrip())
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-executable",
            python,
            "--no-incremental",
            "--strict",
            "--no-error-summary",
            "--hide-error-context",
            "user.py",
        ],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out.stdout.splitlines()


def test_mypy_reads_the_installed_sdk_and_finds_a_users_type_errors(installed, tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    assert _mypy(installed, good, GOOD) == []
    assert _mypy(installed, bad, BAD) == [
        'user.py:5: error: Argument 1 has incompatible type "int"; '
        'expected "str | Sequence[str]"  [arg-type]',
        'user.py:6: error: "ExecResult" has no attribute "exit_status"  [attr-defined]',
        'user.py:7: error: Argument "script" has incompatible type "int"; '
        'expected "str | None"  [arg-type]',
        "user.py:8: error: Incompatible types in assignment (expression has type "
        '"FnCallResult", variable has type "int")  [assignment]',
    ]
