"""``dsec mcp``, driven by the official ``mcp`` client as an agent would: over stdio (the client
spawns the server) through a node, and over streamable HTTP on loopback through an apiserver
with an API key. The tools have schemas, exec streams its output as progress notifications
before the result, files move, a fork sees its source's files, errors are typed tool errors
that leave the server serving, and nothing is left behind."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

import dsec
from dsec_core.cli.mcp_server import SCOPE_LABEL, TOOL_NAMES
from dsec_core.extras import INSTALL_MCP
from dsec_core.iam import Iam
from dsec_core.testing.apiserver import ApiserverProcess, named_nodes, running_apiserver
from dsec_core.testing.procs import stop_process

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

#: what the server's environment must not bring from the test's: where it connects is the
#: test's choice
CONNECTION_ENV = ("DSEC_ADDRESS", "DSEC_TOKEN", "DSEC_API_KEY")


@dataclass
class Site:
    """One node (``url`` with its ``token``) and an apiserver over it with a member ``key``."""

    url: str
    token: str
    layer: str
    api: ApiserverProcess
    key: str

    def node_env(self) -> dict[str, str]:
        return {"DSEC_ADDRESS": self.url, "DSEC_TOKEN": self.token}

    def sandboxes(self) -> list[str]:
        with dsec.Client(self.url, token=self.token) as c:
            return [i.id for i in c.list()]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    try:
        with named_nodes({"n1": {}}) as nodes, running_apiserver(nodes, iam_url) as api:
            iam.create_project("agents")
            node = nodes[0]
            yield Site(
                node.url,
                node.token,
                node.node.layer.ref,
                api,
                iam.create_key("agents", "member")[1],
            )
    finally:
        iam.close()


@pytest.fixture(autouse=True)
def nothing_left_behind(site: Site) -> Iterator[None]:
    yield
    left = site.sandboxes()
    with dsec.Client(site.url, token=site.token) as c:
        for sid in left:  # so that one test's failure is not every next one's
            c.kill(sid)
    assert left == []
    assert _servers() == []


def _servers() -> list[int]:
    """This process's children that are ``dsec mcp`` servers still running."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        state = stat.rpartition(")")[2].split()[0]
        if ppid == os.getpid() and state != "Z" and cmd[1:4] == [b"-m", b"dsec_core.cli", b"mcp"]:
            found.append(int(entry.name))
    return found


def _server_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONNECTION_ENV}
    return {**env, **extra}


@asynccontextmanager
async def over_stdio(env: dict[str, str], *args: str) -> AsyncIterator[ClientSession]:
    """An MCP client session with ``dsec mcp ARGS`` that the client spawned (stdio)."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "dsec_core.cli", "mcp", *args], env=_server_env(env)
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@asynccontextmanager
async def over_http(env: dict[str, str], *args: str) -> AsyncIterator[tuple[ClientSession, str]]:
    """An MCP client session with ``dsec mcp --http ARGS`` on a loopback port it chose, and
    the server's URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec_core.cli", "mcp", "--http", *args],
        env=_server_env(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "http://127.0.0.1:" in line, line + proc.stderr.read()
        url = line[line.index("http://") :].strip()
        assert url.endswith("/mcp") and proc.pid in _servers()
        async with streamable_http_client(url) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            yield s, url
    finally:
        stop_process(proc, 10)
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGTERM  # it ends as SIGTERM does, once it cleaned up


def _post(url: str, headers: dict[str, str]) -> int:
    """The status of an MCP initialize POSTed to ``url`` with ``headers``."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}})
    request = urllib.request.Request(
        url,
        data=body.encode(),
        headers={
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            **headers,
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _error(result: Any) -> tuple[str, str]:
    """A tool error's dsec type (structured content) and its text."""
    assert result.is_error, result
    text = result.content[0].text
    return result.structured_content["type"], text


async def test_the_tools_and_their_schemas(site: Site):
    async with over_stdio(site.node_env()) as mcp:
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
    assert list(tools) == list(TOOL_NAMES)
    for tool in tools.values():
        assert tool.description and len(tool.description) > 40, tool.name
        assert tool.input_schema["type"] == "object"
    exec_ = tools["exec"].input_schema
    assert exec_["required"] == ["sandbox_id", "command"]
    assert "ctx" not in exec_["properties"]
    assert {"timeout", "cwd", "env", "stdin"} <= set(exec_["properties"])
    assert {"environment", "layers", "cpu", "memory", "ttl", "labels", "network"} <= set(
        tools["create"].input_schema["properties"]
    )
    events = tools["input"].input_schema["$defs"]["InputEvent"]["properties"]["type"]
    assert events["enum"] == ["key", "move", "click"]
    assert tools["read_file"].annotations.read_only_hint
    assert tools["kill"].annotations.destructive_hint


async def test_create_exec_files_fork_kill_over_stdio_through_a_node(site: Site):
    async with over_stdio(site.node_env()) as mcp:

        async def call(name: str, **args: Any) -> Any:
            r = await mcp.call_tool(name, args)
            assert not r.is_error, r
            return r.structured_content

        info = await call("create", layers=[site.layer], memory="64M", cpu=0.5, labels={"a": "b"})
        sid = info["id"]
        assert info["labels"] == {"a": "b", SCOPE_LABEL: "default"}

        progress: list[tuple[float, float, str | None]] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append((time.monotonic(), done, message))

        t0 = time.monotonic()
        r = await mcp.call_tool(
            "exec",
            {"sandbox_id": sid, "command": "echo first; sleep 1.5; echo second >&2; exit 3"},
            progress_callback=on_progress,
        )
        ended = time.monotonic()
        assert not r.is_error, r
        done = r.structured_content
        assert (done["exit_code"], done["stdout"], done["stderr"]) == (3, "first\n", "second\n")
        assert [m for _, _, m in progress] == ["stdout: first\n", "stderr: second\n"]
        assert [d for _, d, _ in progress] == [6, 13]  # bytes so far
        # the first line came while the command still ran: well before the result
        assert progress[0][0] - t0 < 1.2 and ended - progress[0][0] > 1.0

        r = await call("exec", sandbox_id=sid, command=["sh", "-c", "cat; mkdir /work; pwd"],
                       cwd="/tmp", stdin="in ")  # fmt: skip
        assert r["stdout"] == "in /tmp\n"

        await call("write_file", sandbox_id=sid, path="/work/notes.txt", content="héllo\n")
        binary = bytes(range(256))
        encoded = base64.b64encode(binary).decode()
        await call("write_file", sandbox_id=sid, path="/work/run.bin", content=encoded,
                   encoding="base64", mode="755")  # fmt: skip
        read = await call("read_file", sandbox_id=sid, path="/work/notes.txt")
        assert (read["content"], read["encoding"], read["size"]) == ("héllo\n", "utf-8", 7)
        read = await call("read_file", sandbox_id=sid, path="/work/run.bin")
        assert (read["content"], read["encoding"]) == (encoded, "base64")
        listed = await call("list_files", sandbox_id=sid, path="/work")
        assert [(e["name"], e["type"], e["mode"]) for e in listed["entries"]] == [
            ("notes.txt", "file", "644"),
            ("run.bin", "file", "755"),
        ]

        forked = await call("fork", sandbox_id=sid, n=2, exclude=["/work/run.bin"])
        kids = [k["id"] for k in forked["sandboxes"]]
        assert len(set(kids)) == 2 and sid not in kids and forked["snapshot"]
        for kid in kids:
            r = await call("exec", sandbox_id=kid, command="cat /work/notes.txt; ls /work")
            assert r["stdout"] == "héllo\nnotes.txt\n"
        listed = await call("list_sandboxes")
        assert {i["id"] for i in listed["sandboxes"]} == {sid, *kids}
        assert all(i["labels"][SCOPE_LABEL] == "default" for i in listed["sandboxes"])

        # a call the client gives up on is cancelled, and its command killed in the sandbox
        with pytest.raises(Exception) as gave_up:
            await mcp.call_tool(
                "exec", {"sandbox_id": sid, "command": "sleep 37"}, read_timeout_seconds=1
            )
        assert "timed out" in str(gave_up.value)
        deadline = time.monotonic() + 10
        while True:
            shown = (await call("exec", sandbox_id=sid, command="ps -o args"))["stdout"]
            assert "ps -o args" in shown  # ps works: it lists itself
            if "sleep 37" not in shown:
                break
            assert time.monotonic() < deadline, "the cancelled command still runs"
            await anyio.sleep(0.2)
        print(f"killed {time.monotonic() - deadline + 10:.1f}s after the timeout")

        for s in (sid, *kids):
            assert await call("kill", sandbox_id=s) == {"killed": s}
        assert (await call("list_sandboxes", all=True))["sandboxes"] == []


async def test_errors_are_typed_tool_errors_and_the_server_carries_on(site: Site):
    with dsec.Client(site.url, token=site.token) as c:
        other = c.create(layers=(site.layer,), memory="64M", cpu=0.5)
    try:
        async with over_stdio(site.node_env(), "--scope", "mine") as mcp:
            r = await mcp.call_tool("exec", {"sandbox_id": "sb-nope", "command": "true"})
            kind, text = _error(r)
            assert kind == "UnknownSandbox" and text.startswith("UnknownSandbox: ")
            assert "sb-nope" in text
            r = await mcp.call_tool("kill", {"sandbox_id": "sb-nope"})
            assert _error(r)[0] == "UnknownSandbox"
            # a container has no screen
            kind, text = _error(await mcp.call_tool("screenshot", {"sandbox_id": other.id}))
            assert kind == "FeatureUnavailable" and "screen" in text.lower()
            kind, _ = _error(
                await mcp.call_tool(
                    "input", {"sandbox_id": other.id, "events": [{"type": "key", "key": "a"}]}
                )
            )
            assert kind == "FeatureUnavailable"
            r = await mcp.call_tool("read_file", {"sandbox_id": other.id, "path": "/no/such"})
            assert _error(r)[0] == "SandboxPathError"
            r = await mcp.call_tool("create", {"layers": ["no-such-layer@1"], "memory": "64M"})
            assert _error(r)[0] == "UnknownLayer"
            r = await mcp.call_tool(
                "write_file", {"sandbox_id": other.id, "path": "/x", "content": "a", "mode": "9"}
            )
            assert _error(r)[0] == "InvalidSpec"
            r = await mcp.call_tool("exec", {"sandbox_id": other.id, "command": 5})
            assert r.is_error and "command" in r.content[0].text  # the schema's check
            # the scope: a sandbox made elsewhere is listed only when all are asked for
            mine = await mcp.call_tool("list_sandboxes", {})
            assert mine.structured_content["sandboxes"] == []
            every = await mcp.call_tool("list_sandboxes", {"all": True})
            assert [i["id"] for i in every.structured_content["sandboxes"]] == [other.id]
            r = await mcp.call_tool("exec", {"sandbox_id": other.id, "command": "echo alive"})
            assert r.structured_content["stdout"] == "alive\n"
    finally:
        other.kill()


async def test_over_http_through_an_apiserver_with_a_key(site: Site):
    env = {"DSEC_API_KEY": site.key}
    async with over_http(env, "--address", site.api.url, "--kill-on-exit") as (mcp, url):
        # a page elsewhere that a browser on this machine opens cannot reach it through DNS
        # rebinding: a Host or Origin other than loopback's is refused
        assert _post(url, {"Host": "evil.example"}) == 421
        assert _post(url, {"Origin": "http://evil.example"}) == 403
        info = (
            await mcp.call_tool("create", {"layers": [site.layer], "memory": "64M", "cpu": 0.5})
        ).structured_content
        sid = info["id"]
        assert info["labels"]["dsec.project"] == "agents"
        messages: list[str | None] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            messages.append(message)

        r = await mcp.call_tool(
            "exec", {"sandbox_id": sid, "command": "echo a; echo b"}, progress_callback=on_progress
        )
        assert r.structured_content["stdout"] == "a\nb\n"
        assert all(m and m.startswith("stdout: ") for m in messages)
        assert "".join(m[len("stdout: ") :] for m in messages if m) == "a\nb\n"
        r = await mcp.call_tool("write_file", {"sandbox_id": sid, "path": "/f", "content": "x"})
        forked = await mcp.call_tool("fork", {"sandbox_id": sid})
        assert not forked.is_error, forked
        (kid,) = forked.structured_content["sandboxes"]
        r = await mcp.call_tool("read_file", {"sandbox_id": kid["id"], "path": "/f"})
        assert r.structured_content["content"] == "x"
        # a second client of the same server, at the same time: one scope, one key
        async with (
            streamable_http_client(url) as (read, write),
            ClientSession(read, write) as second,
        ):
            await second.initialize()
            listed = await second.call_tool("list_sandboxes", {})
        assert {i["id"] for i in listed.structured_content["sandboxes"]} == {sid, kid["id"]}
        assert not (await mcp.call_tool("kill", {"sandbox_id": sid})).is_error
    # SIGTERM stopped the server, which killed the fork it made first (--kill-on-exit)
    assert site.sandboxes() == []
    # a wrong key: the server starts, and each call says why it cannot serve
    async with over_stdio({"DSEC_API_KEY": "dsec-wrong"}, "--address", site.api.url) as mcp:
        kind, _ = _error(await mcp.call_tool("list_sandboxes", {}))
        assert kind == "AuthenticationFailed"


async def test_kill_on_exit_kills_what_the_server_made(site: Site):
    with dsec.Client(site.url, token=site.token) as c:
        other = c.create(layers=(site.layer,), memory="64M", cpu=0.5)
    try:
        async with over_stdio(site.node_env(), "--kill-on-exit") as mcp:
            spec = {"layers": [site.layer], "memory": "64M", "cpu": 0.5}
            made = [(await mcp.call_tool("create", spec)).structured_content["id"] for _ in "ab"]
            assert not (await mcp.call_tool("kill", {"sandbox_id": made[0]})).is_error
            assert sorted(site.sandboxes()) == sorted([other.id, made[1]])
        # when its client closed its stdin, the server killed the one it made and left alive,
        # and nothing it did not make
        assert site.sandboxes() == [other.id]
    finally:
        other.kill()


def test_without_the_mcp_package_it_says_what_to_install():
    code = (
        "import sys; sys.modules['mcp'] = None\n"  # as if not installed
        "from dsec_core.cli import main\n"
        "main(['mcp'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert INSTALL_MCP in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("Error: dsec mcp needs the mcp package")


def test_port_without_http_is_a_usage_error():
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "mcp", "--port", "8000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--port goes with --http" in out.stderr


def test_the_cli_loads_the_mcp_package_only_to_serve():
    """``dsec --help`` lists ``mcp`` and ``dsec mcp --help`` explains it, neither importing the
    mcp package (pydantic, starlette: a third of a second of every command)."""
    probe = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from dsec_core.cli import cli\n"
        "top = CliRunner().invoke(cli, ['--help']).output\n"
        "own = CliRunner().invoke(cli, ['mcp', '--help']).output\n"
        "print('  mcp ' in top, '--http' in own and '--api-key' in own)\n"
        "print(sorted({m for m in sys.modules if m.split('.')[0] in ('mcp', 'pydantic')}))\n"
        "print('dsec_core.cli.mcp_server' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == ["True True", "[]", "False"], out
