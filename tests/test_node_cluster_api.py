"""What a node offers the control plane: a name that ends its sandbox ids, labels, the probe
(load, warm layers, usage by project), a ttl that can be changed, and exec output streamed
as it comes, over the unix socket and over TCP (sync and async)."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Iterator

import pytest

import dsec
from dsec_core.errors import InvalidSpec, SandboxPathError, UnknownSandbox
from dsec_core.records import PROJECT_LABEL, ExecOutput, ExecResult
from dsec_core.testing.fixtures import KitNode, running_kit_node
from dsec_core.testing.procs import free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture(scope="module")
def named_node() -> Iterator[tuple[KitNode, str, str]]:
    token = secrets.token_urlsafe(16)
    address = f"http://127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSEC_NODE_NAME", "n7")
        mp.setenv("DSEC_NODE_LABELS", "dsec.pool=overflow,zone=a")
        mp.setenv("DSEC_LISTEN", address)
        mp.setenv("DSEC_API_TOKEN", token)
        with running_kit_node("dsec-named-") as node:
            yield node, address, token


@pytest.fixture
def client(named_node) -> Iterator[dsec.Client]:
    node, address, token = named_node
    with dsec.Client(address, token=token) as c:
        yield c


def _spec(named_node, **kw):
    return dsec.SandboxSpec(layers=(named_node[0].layer.ref,), memory="64M", **kw)


def test_ids_end_with_the_node_name_and_probe_reports_load_labels_layers_projects(
    named_node, client
):
    spec = _spec(named_node, cpu=0.5, labels={PROJECT_LABEL: "org/team"})
    with client.create(spec) as a, client.create(spec) as b, client.create(_spec(named_node)):
        for sb in (a, b):
            head, tail = sb.id.rsplit("-", 1)
            assert tail == "n7" and len(head) == 12 and int(head, 16) >= 0
            assert sb.exec("hostname").stdout == f"dsec-{head}\n".encode()
        probe = client.probe()
        assert probe.name == "n7" and probe.load.node == "n7"
        assert probe.load.labels == {"dsec.pool": "overflow", "zone": "a"}
        assert probe.load.sandboxes == 3
        assert named_node[0].layer.ref in probe.layers
        usage = probe.projects["org/team"]
        assert (usage.sandboxes, usage.cpu, usage.memory) == (2, 1.0, 2 * (64 << 20))
        assert set(probe.projects) == {"org/team"}  # the unlabelled one is nobody's
    assert client.probe().projects == {}


def test_set_ttl_extends_shortens_and_clears(named_node, client):
    with client.create(_spec(named_node, ttl=600)) as sb:
        info = sb.set_ttl(3600)
        assert info.expires is not None and 3590 < info.expires - time.time() <= 3600
        assert client.get(sb.id).info.expires == info.expires
        assert sb.set_ttl(None).expires is None
        with pytest.raises(InvalidSpec) as e:
            sb.set_ttl(-1)
        assert e.value.field == "TtlRequest.ttl"
        sb.set_ttl(1)
        deadline = time.monotonic() + 15
        while sb.id in {i.id for i in client.list()} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sb.id not in {i.id for i in client.list()}
    with pytest.raises(UnknownSandbox):
        client.set_ttl("000000000000-n7", 10)


def test_exec_stream_gives_output_while_the_command_runs(named_node, client):
    with client.create(_spec(named_node)) as sb:
        t0 = time.monotonic()
        seen: list[tuple[float, object]] = []
        for item in sb.exec_stream("echo one; echo err >&2; sleep 1.5; echo two; exit 3"):
            seen.append((time.monotonic() - t0, item))
        outputs = [i for _, i in seen if isinstance(i, ExecOutput)]
        result = seen[-1][1]
        assert isinstance(result, ExecResult)
        assert (result.exit_code, result.stdout, result.stderr) == (3, b"", b"")
        assert b"".join(o.data for o in outputs if o.stream == "stdout") == b"one\ntwo\n"
        assert b"".join(o.data for o in outputs if o.stream == "stderr") == b"err\n"
        first = next(t for t, i in seen if isinstance(i, ExecOutput))
        assert first < 1.0 < seen[-1][0], seen  # the first line came before the sleep ended


def test_exec_stream_timeout_cap_stdin_and_errors(named_node, client):
    with client.create(_spec(named_node)) as sb:
        items = list(sb.exec_stream("echo start; sleep 30", timeout=1))
        assert items[0] == ExecOutput("stdout", b"start\n")
        assert items[-1].timed_out and items[-1].exit_code == 137
        items = list(sb.exec_stream("head -c 100000 /dev/zero", max_output=1000))
        assert sum(len(i.data) for i in items[:-1]) == 1000 and items[-1].truncated
        items = list(sb.exec_stream(["cat"], stdin=b"fed in"))
        assert items[0].data == b"fed in"
        with pytest.raises(SandboxPathError):
            list(sb.exec_stream("true", cwd="/no/such/dir"))
        with pytest.raises(InvalidSpec):
            list(sb.exec_stream(""))
    with pytest.raises(UnknownSandbox):
        list(client.exec_stream("000000000000-n7", "true"))


def test_leaving_an_exec_stream_kills_the_command(named_node, client):
    with client.create(_spec(named_node)) as sb:
        stream = sb.exec_stream("echo go; exec sleep 300")
        assert next(stream) == ExecOutput("stdout", b"go\n")
        stream.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if b"sleep 300" not in sb.exec("ps -o args").stdout:
                break
            time.sleep(0.1)
        assert b"sleep 300" not in sb.exec("ps -o args").stdout
        assert sb.exec("echo still here").stdout == b"still here\n"  # the connection pool too


def test_async_exec_stream(named_node):
    node, address, token = named_node

    async def main() -> None:
        async with dsec.AsyncClient(address, token=token) as client:
            sb = await client.create(_spec(named_node))
            try:
                got = [item async for item in await sb.exec_stream("echo a; sleep 0.3; echo b")]
                assert [i.data for i in got[:-1]] == [b"a\n", b"b\n"]
                assert got[-1].exit_code == 0
                # many at once share the pool
                outs = await asyncio.gather(*(_collect(sb, f"echo {k}") for k in range(5)))
                assert outs == [f"{k}\n".encode() for k in range(5)]
                assert (await sb.exec("echo ok")).stdout == b"ok\n"
            finally:
                await sb.kill()

    asyncio.run(main())


async def _collect(sb, cmd: str) -> bytes:
    stream = await sb.exec_stream(cmd)
    return b"".join([i.data async for i in stream if isinstance(i, ExecOutput)])
