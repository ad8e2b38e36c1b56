"""The stock ``e2b`` SDK, unmodified, against dsec's E2B app (``dsec_core.e2b``) served on
loopback over a real node: lifecycle, commands (streaming, exit codes, timeouts, background),
files, paging and filters, pause and connect, errors; sync ``Sandbox`` and ``AsyncSandbox``."""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import uvicorn

e2b = pytest.importorskip("e2b")

from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    InvalidArgumentException,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
    TemplateException,
    TimeoutException,
)

from dsec_core.e2b import Templates, make_app  # noqa: E402
from dsec_core.errors import AuthenticationFailed, QuotaExceeded  # noqa: E402
from dsec_core.sdk import AsyncClient  # noqa: E402
from dsec_core.testing import KitNode, free_port  # noqa: E402

KEY = "e2b-test-key"

BAD_KEY = "revoked-key"
OVER_QUOTA_KEY = "over-quota-key"


class Served:
    """The E2B app on a loopback port, its node, and the kit environment templates map to."""

    def __init__(self, node: KitNode, url: str, environment: str) -> None:
        self.node, self.url, self.environment = node, url, environment


@pytest.fixture(scope="module")
def served(dsec_node: KitNode) -> Iterator[Served]:
    environment = dsec_node.environment("e2b-kit")
    socket = os.fspath(dsec_node.config.socket_path)

    def connect(key: str) -> AsyncClient:
        if key == BAD_KEY:  # what the apiserver's connect raises for a revoked key
            raise AuthenticationFailed("the API key is revoked")
        if key == OVER_QUOTA_KEY:  # what it raises for a project at its quota
            raise QuotaExceeded(
                "project org/a is at its sandbox quota", project="org/a", resource="sandboxes"
            )
        return AsyncClient(socket, autostart=False)

    app = make_app(connect, Templates({"base": environment}))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, name="e2b-app", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the E2B app did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    spooled = set(Path(tempfile.gettempdir()).glob("dsec-e2b-*"))
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=KEY)
    try:
        yield Served(dsec_node, url, environment)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()
    # the app spools file bodies through temporary files; none is left behind
    assert set(Path(tempfile.gettempdir()).glob("dsec-e2b-*")) == spooled
    with dsec_node.client() as c:  # every sandbox the tests made through E2B is gone
        assert [i.id for i in c.list() if "e2b.template" in i.labels and i.state != "dead"] == []


@pytest.fixture
def sandboxes(served: Served) -> Iterator[list[Sandbox]]:
    """Sandboxes a test made; killed at its end (the SDK's own kill: False if gone already)."""
    made: list[Sandbox] = []
    yield made
    for sb in made:
        Sandbox.kill(sb.sandbox_id)


def test_create_maps_template_metadata_envs_and_timeout(served, sandboxes):
    sb = Sandbox.create(metadata={"run": "r1"}, envs={"GREETING": "hello"}, timeout=120)
    sandboxes.append(sb)
    info = sb.get_info()
    assert info.sandbox_id == sb.sandbox_id
    assert info.template_id == served.environment and info.name == "base"
    assert info.metadata == {"run": "r1"}
    assert info.state == SandboxState.RUNNING
    assert 110 <= (info.end_at - info.started_at).total_seconds() <= 130
    assert (info.cpu_count, info.memory_mb) == (1, 512)  # dsec's default spec
    assert sb.commands.run("echo $GREETING").stdout == "hello\n"
    assert sb.is_running()
    # the labels are dsec's, for dsec's own filters
    with served.node.client() as c:
        labels = c.get(sb.sandbox_id).info.labels
    assert labels["e2b.meta.run"] == "r1" and labels["e2b.template"] == "base"


def test_unknown_template_is_the_sdks_not_found(served):
    with pytest.raises(SandboxException) as e:
        Sandbox.create(template="no-such-template")
    assert e.value.status_code == 404 and "no-such-template" in str(e.value)


def test_bad_or_missing_key_is_the_sdks_authentication_error(served):
    with pytest.raises(AuthenticationException) as e:
        Sandbox.create(api_key=BAD_KEY)
    assert "401" in str(e.value) and "revoked" in str(e.value)
    r = httpx.get(f"{served.url}/v2/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == 401 and "X-API-KEY" in r.json()["message"]
    r = httpx.get(f"{served.url}/files", params={"path": "/x"}, headers={"E2b-Sandbox-Id": "x"})
    assert r.status_code == 401 and "X-Access-Token" in r.json()["message"]


def test_commands_exit_codes_envs_cwd(served, sandboxes):
    sb = Sandbox.create()
    sandboxes.append(sb)
    r = sb.commands.run("echo out; echo err >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "out\n", "err\n")
    with pytest.raises(CommandExitException) as e:
        sb.commands.run("echo partial; echo oops >&2; exit 3")
    assert (e.value.exit_code, e.value.stdout, e.value.stderr) == (3, "partial\n", "oops\n")
    assert sb.commands.run("echo $A-$B", envs={"A": "x", "B": "y"}).stdout == "x-y\n"
    assert sb.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    # more than dsec's default 1 MiB cap of exec output
    assert len(sb.commands.run("head -c 3000000 /dev/zero | tr '\\0' a").stdout) == 3_000_000
    # what a command leaves running lives on, as under envd
    sb.commands.run("sleep 45 > /dev/null 2>&1 &")
    assert "sleep 45" in sb.commands.run("ps -o args || ps").stdout


def test_output_streams_while_the_command_runs(served, sandboxes):
    sb = Sandbox.create()
    sandboxes.append(sb)
    seen: list[tuple[float, str]] = []
    errs: list[str] = []
    r = sb.commands.run(
        "echo first; sleep 1; echo second; echo late >&2",
        on_stdout=lambda s: seen.append((time.monotonic(), s)),
        on_stderr=errs.append,
    )
    end = time.monotonic()
    assert "".join(s for _, s in seen) == "first\nsecond\n" == r.stdout
    assert errs == ["late\n"]
    assert end - seen[0][0] >= 0.8  # the first line came a second before the command ended


def _envelopes(body: bytes) -> list[tuple[int, dict]]:
    out = []
    while body:
        flags, n = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5 : 5 + n])))
        body = body[5 + n :]
    return out


def test_start_stream_wire_format_with_keepalives(served, sandboxes):
    """The Connect framing itself: enveloped events, a keepalive on a quiet stream, and the
    end-of-stream envelope (flags 0x02) last."""
    sb = Sandbox.create()
    sandboxes.append(sb)
    request = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "sleep 3.5; echo x"]}}
    data = json.dumps(request).encode()
    r = httpx.post(
        f"{served.url}/process.Process/Start",
        content=struct.pack(">BI", 0, len(data)) + data,
        headers={
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            "X-Access-Token": KEY,
            "E2b-Sandbox-Id": sb.sandbox_id,
            "Keepalive-Ping-Interval": "1",
        },
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/connect+json"
    frames = _envelopes(r.content)
    kinds = [next(iter(m["event"])) if flags == 0 else "END" for flags, m in frames]
    assert kinds[0] == "start" and frames[0][1]["event"]["start"]["pid"] > 0
    assert "keepalive" in kinds and kinds.index("keepalive") < kinds.index("data")
    assert frames[kinds.index("data")][1]["event"]["data"] == {"stdout": "eAo="}  # "x\n"
    assert kinds[-2:] == ["end", "END"] and frames[-1] == (2, {})
    assert frames[-2][1]["event"]["end"]["exitCode"] == 0
    # an error is the end-of-stream envelope's, under a 200
    r = httpx.post(
        f"{served.url}/process.Process/Start",
        content=struct.pack(">BI", 0, len(data)) + data,
        headers={"Content-Type": "application/connect+json", "E2b-Sandbox-Id": "nope"},
    )
    [(flags, end)] = _envelopes(r.content)
    assert r.status_code == 200 and flags == 2 and end["error"]["code"] == "unauthenticated"


def test_command_timeout_is_the_sdks_timeout(served, sandboxes):
    sb = Sandbox.create()
    sandboxes.append(sb)
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sb.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t0 < 10
    # nothing of it is left running: killed when the SDK gives up at its deadline (the SDK's
    # clock starts a request before the node's, so allow the kill that moment to land)
    for _ in range(30):
        running = sb.commands.run("ps -o args || ps").stdout
        if "sleep 30" not in running:
            break
        time.sleep(0.1)
    assert "sleep 30" not in running


def test_background_command_wait_and_kill(served, sandboxes):
    sb = Sandbox.create()
    sandboxes.append(sb)
    h = sb.commands.run("sleep 0.3; echo done", background=True)
    assert h.pid > 0
    assert h.wait().stdout == "done\n"
    h = sb.commands.run("sleep 60", background=True)
    assert h.kill() is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code != 0
    assert sb.commands.kill(h.pid) is False  # gone already
    # as under envd, a command runs on when its client lets go, until it is killed
    h = sb.commands.run("sleep 77", background=True)
    assert h.pid in {p.pid for p in sb.commands.list()}
    h.disconnect()
    time.sleep(0.3)
    assert h.pid in {p.pid for p in sb.commands.list()}
    assert sb.commands.kill(h.pid) is True
    assert h.pid not in {p.pid for p in sb.commands.list()}


def test_commands_list_shows_running_commands(served, sandboxes):
    sb = Sandbox.create()
    sandboxes.append(sb)
    h = sb.commands.run("sleep 60", background=True, cwd="/tmp")
    listed = {p.pid: p for p in sb.commands.list()}
    assert h.pid in listed
    # its argv now (the shell has become the command), where it runs
    assert " ".join([listed[h.pid].cmd, *listed[h.pid].args]).endswith("sleep 60")
    assert listed[h.pid].cwd == "/tmp"
    assert h.kill() is True
    assert h.pid not in {p.pid for p in sb.commands.list()}


def test_unsupported_features_fail_with_the_sdks_errors(served, sandboxes):
    sb = Sandbox.create()
    sandboxes.append(sb)
    with pytest.raises(InvalidArgumentException, match="gzip"):
        sb.files.write("/x.txt", "data", gzip=True)
    with pytest.raises(TemplateException):  # the SDK's own check against envd's version
        sb.files.write("/x.txt", "data", metadata={"k": "v"})
    with pytest.raises(SandboxException) as e:
        Sandbox.create(network={"deny_out": ["0.0.0.0/0"]})
    assert e.value.status_code == 400 and "network" in str(e.value)


def test_allow_internet_access_reaches_a_server_outside_the_node(served, sandboxes, tmp_path):
    """``allow_internet_access=True`` is ``network="internet"``: out through the node's NAT to
    a server on a TEST-NET address in a namespace the test links to the host's; without it (or
    with False) the sandbox stays loopback-only, as before."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    testing = pytest.importorskip("dsec_security_ebpf.testing")
    with testing.HostServerNamespace(served.node.home, tmp_path, "203.0.113.0/24") as ns:
        ns.serve(tcp=[8080])
        sb = Sandbox.create(allow_internet_access=True)
        sandboxes.append(sb)
        assert sb.commands.run(f"echo hello | nc -w 2 {ns.address} 8080").exit_code == 0
        # cloud metadata stays out of reach
        r = sb.commands.run("nc -w 2 169.254.169.254 80 </dev/null 2>&1; echo rc=$?")
        assert "rc=0" not in r.stdout
        for allow in (False, None):
            off = Sandbox.create(allow_internet_access=allow)
            sandboxes.append(off)
            with pytest.raises(CommandExitException):
                off.commands.run(f"echo no | nc -w 2 {ns.address} 8080")
        assert [r.data for r in ns.received()] == ["hello\n"]


def test_over_quota_is_the_sdks_rate_limit_error_without_retries(served):
    t0 = time.monotonic()
    with pytest.raises(RateLimitException) as e:
        Sandbox.create(api_key=OVER_QUOTA_KEY)
    assert "429" in str(e.value) and "QuotaExceeded" in str(e.value)
    assert time.monotonic() - t0 < 2  # Should-Retry: false, so no backoff


def test_files_write_read_list_exists_remove(served, sandboxes):
    sb = Sandbox.create()
    sandboxes.append(sb)
    info = sb.files.write("/work/dir/hello.txt", "hi there\n")  # parents are made
    assert (info.name, info.path) == ("hello.txt", "/work/dir/hello.txt")
    assert sb.files.read("/work/dir/hello.txt") == "hi there\n"
    blob = bytes(range(256)) * 40_000  # 10 MB, more than one piece each way
    sb.files.write("/work/blob.bin", blob)
    assert sb.files.read("/work/blob.bin", format="bytes") == bytearray(blob)
    assert b"".join(sb.files.read("/work/blob.bin", format="stream")) == blob
    # a file object goes as one streamed octet-stream body, not multipart
    sb.files.write("/work/streamed.bin", io.BytesIO(blob[:3_000_000]))
    assert sb.files.read("/work/streamed.bin", format="bytes") == bytearray(blob[:3_000_000])
    sb.files.remove("/work/streamed.bin")
    assert sb.commands.run("cat /work/dir/hello.txt").stdout == "hi there\n"
    entries = {e.name: e for e in sb.files.list("/work")}
    assert set(entries) == {"dir", "blob.bin"}
    assert entries["blob.bin"].type.value == "file" and entries["blob.bin"].size == len(blob)
    assert entries["dir"].type.value == "dir" and entries["dir"].path == "/work/dir"
    assert sb.files.exists("/work/dir/hello.txt") and not sb.files.exists("/work/nope")
    assert sb.files.make_dir("/work/new") is True and sb.files.make_dir("/work/new") is False
    moved = sb.files.rename("/work/dir/hello.txt", "/work/new/hello.txt")
    assert (moved.path, moved.type.value, moved.size) == ("/work/new/hello.txt", "file", 9)
    got = sb.files.get_info("/work/new/hello.txt")
    assert got.permissions == "-rw-r--r--" and got.modified_time.year >= 2024
    # into a directory that does not exist yet: envd makes it
    moved = sb.files.rename("/work/new/hello.txt", "/work/fresh/deeper/hello.txt")
    assert moved.path == "/work/fresh/deeper/hello.txt"
    assert sb.files.read("/work/fresh/deeper/hello.txt") == "hi there\n"
    sb.files.rename("/work/fresh/deeper/hello.txt", "/work/dir/hello.txt")
    sb.files.remove("/work/dir")
    assert not sb.files.exists("/work/dir/hello.txt")
    with pytest.raises(FileNotFoundException):
        sb.files.read("/work/dir/hello.txt")


def _collect(handle, until, timeout=10.0):
    """The events of a sync ``WatchHandle`` as (type, name) pairs, polled until ``until`` is
    among them."""
    seen = []
    deadline = time.monotonic() + timeout
    while until not in seen:
        assert time.monotonic() < deadline, f"no {until} in {seen}"
        seen += [(e.type.value, e.name) for e in handle.get_new_events()]
        time.sleep(0.05)
    return seen


def test_watch_dir_reports_envds_events(served, sandboxes):
    sb = Sandbox.create()
    sandboxes.append(sb)
    sb.files.make_dir("/work/w/d")
    h = sb.files.watch_dir("/work/w")
    sb.commands.run(
        "echo one > /work/w/a.txt && chmod 600 /work/w/a.txt && mv /work/w/a.txt /work/w/b.txt"
        " && echo x > /work/w/d/inner && mkdir /work/w/e && rm /work/w/b.txt"
    )
    seen = _collect(h, ("remove", "b.txt"))
    assert seen == [
        ("create", "a.txt"),
        ("write", "a.txt"),
        ("chmod", "a.txt"),
        ("rename", "a.txt"),
        ("create", "b.txt"),
        ("create", "e"),
        ("remove", "b.txt"),
    ]  # d/inner is not in it: not recursive
    h.stop()
    with pytest.raises(SandboxException):
        h.get_new_events()  # stopped
    # recursive: what happens under it, in directories made after the watch began too
    h = sb.files.watch_dir("/work/w", recursive=True)
    sb.files.write("/work/w/d/deep.txt", "deep")
    sb.commands.run("mkdir -p /work/w/n/m")
    sb.commands.run("echo f > /work/w/n/m/f && rm -r /work/w/d")
    seen = _collect(h, ("remove", "d"))
    assert ("create", "d/deep.txt") in seen and ("create", "n/m/f") in seen
    assert ("remove", "d/inner") in seen and ("create", "n") in seen
    listing = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
    assert "/.dsec/agent watch -r /work/w" in sb.commands.run(listing).stdout
    h.stop()  # the watching command goes with it
    deadline = time.monotonic() + 5
    while "/.dsec/agent watch" in sb.commands.run(listing).stdout:
        assert time.monotonic() < deadline, "the watcher still runs"
        time.sleep(0.05)
    with pytest.raises(SandboxException, match="not found"):
        sb.files.watch_dir("/work/nope")
    with pytest.raises(SandboxException, match="not a directory"):
        sb.files.watch_dir("/etc/passwd")


def test_kill_get_info_and_connect_after_kill(served):
    sb = Sandbox.create()
    sid = sb.sandbox_id
    assert sb.kill() is True
    assert Sandbox.kill(sid) is False
    assert not sb.is_running()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sid)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sid)
    with pytest.raises(NotFoundException):
        sb.set_timeout(60)
    # envd's paths answer as E2B's proxy does for a gone sandbox
    with pytest.raises(SandboxNotRunningException):
        sb.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        sb.files.read("/etc/passwd")
    with pytest.raises(SandboxNotRunningException):
        sb.files.list("/")


def test_list_pages_and_filters(served, sandboxes):
    run = uuid.uuid4().hex
    for i in range(3):
        sandboxes.append(Sandbox.create(metadata={"run": run, "i": str(i)}))
    ids = {sb.sandbox_id for sb in sandboxes}
    pager = Sandbox.list(query=SandboxQuery(metadata={"run": run}), limit=2)
    first = pager.next_items()
    assert len(first) == 2 and pager.has_next
    second = pager.next_items()
    assert len(second) == 1 and not pager.has_next
    assert {s.sandbox_id for s in first + second} == ids
    assert all(s.metadata["run"] == run for s in first + second)
    only = Sandbox.list(query=SandboxQuery(metadata={"run": run, "i": "1"})).next_items()
    assert [s.metadata["i"] for s in only] == ["1"]
    assert Sandbox.list(query=SandboxQuery(metadata={"run": "other"})).next_items() == []
    # newest first, filtered by template too, pages the same way
    q = SandboxQuery(metadata={"run": run}, template="base")
    pager = Sandbox.list(query=q, limit=1, order="desc")
    newest = [pager.next_items()[0].sandbox_id for _ in range(3)]
    assert not pager.has_next
    assert newest == [sb.sandbox_id for sb in reversed(sandboxes)]
    q = SandboxQuery(metadata={"run": run}, template="not-this-one")
    assert Sandbox.list(query=q).next_items() == []
    r = httpx.get(f"{served.url}/v2/sandboxes?nextToken=junk", headers={"X-API-KEY": KEY})
    assert r.status_code == 400 and "nextToken" in r.json()["message"]


def test_metadata_filters_match_keys_and_values_exactly(served, sandboxes):
    """Keys and values with spaces, ``&``, ``=``, ``/``, ``+``, ``%`` and non-ASCII match
    exactly as E2B matches them, and a near miss matches nothing."""
    run = uuid.uuid4().hex
    odd = {"run": run, "a key&x=1": "v/w & z=é+%20ü", "ключ": "日本 語"}
    sb = Sandbox.create(metadata=odd)
    plain = Sandbox.create(metadata={"run": run, "a key&x=1": "v/w & z=e+%20u"})
    sandboxes += [sb, plain]
    assert sb.get_info().metadata == odd

    def found(metadata):
        q = SandboxQuery(metadata=metadata)
        return {s.sandbox_id for s in Sandbox.list(query=q).next_items()}

    assert found(odd) == {sb.sandbox_id}
    assert found({"ключ": "日本 語"}) == {sb.sandbox_id}
    assert found({"run": run}) == {sb.sandbox_id, plain.sandbox_id}
    assert found({"a key&x=1": "v/w & z=e+%20u"}) == {plain.sandbox_id}
    assert found({"a key": "v/w"}) == set()
    assert found({"ключ": "日本+語"}) == set()


def test_pause_then_connect_resumes(served, sandboxes):
    run = uuid.uuid4().hex
    sb = Sandbox.create(metadata={"run": run})
    other = Sandbox.create(metadata={"run": run})
    sandboxes += [sb, other]
    sb.files.write("/kept.txt", "still here")
    assert sb.pause() is True
    assert sb.get_info().state == SandboxState.PAUSED
    assert sb.pause() is False  # already paused

    def listed(state):
        q = SandboxQuery(metadata={"run": run}, state=[state])
        return {s.sandbox_id for s in Sandbox.list(query=q).next_items()}

    assert listed(SandboxState.PAUSED) == {sb.sandbox_id}
    assert listed(SandboxState.RUNNING) == {other.sandbox_id}
    again = Sandbox.connect(sb.sandbox_id)
    assert again.get_info().state == SandboxState.RUNNING
    assert again.files.read("/kept.txt") == "still here"


def test_set_timeout_moves_the_end(served, sandboxes):
    sb = Sandbox.create(timeout=60)
    sandboxes.append(sb)
    before = sb.get_info().end_at
    sb.set_timeout(900)
    after = sb.get_info().end_at
    assert (after - before).total_seconds() > 800
    assert abs((after - datetime.now(after.tzinfo)).total_seconds() - 900) < 30


async def test_async_sandbox_core_flows(served):
    sb = await AsyncSandbox.create(metadata={"mode": "async"}, envs={"V": "1"})
    try:
        chunks: list[tuple[float, str]] = []
        r = await sb.commands.run(
            "echo a$V; sleep 1; echo b",
            on_stdout=lambda s: chunks.append((time.monotonic(), s)),
        )
        assert r.stdout == "a1\nb\n"
        assert time.monotonic() - chunks[0][0] >= 0.8
        with pytest.raises(CommandExitException) as e:
            await sb.commands.run("echo no >&2; exit 7")
        assert (e.value.exit_code, e.value.stderr) == (7, "no\n")
        with pytest.raises(TimeoutException):
            await sb.commands.run("sleep 30", timeout=1)
        h = await sb.commands.run("sleep 60", background=True)
        assert await h.kill() is True
        with pytest.raises(CommandExitException):
            await h.wait()
        await sb.set_timeout(900)
        end = (await sb.get_info()).end_at
        assert abs((end - datetime.now(end.tzinfo)).total_seconds() - 900) < 30
        await sb.files.write("/a/b.txt", b"bytes\x00here")
        assert await sb.files.read("/a/b.txt", format="bytes") == bytearray(b"bytes\x00here")
        assert [e.name for e in await sb.files.list("/a")] == ["b.txt"]
        info = await sb.get_info()
        assert info.metadata == {"mode": "async"}
        assert await sb.pause() is True
        again = await AsyncSandbox.connect(sb.sandbox_id)
        assert (await again.commands.run("cat /a/b.txt")).stdout == "bytes\x00here"
        found = await AsyncSandbox.list(query=SandboxQuery(metadata={"mode": "async"})).next_items()
        assert [s.sandbox_id for s in found] == [sb.sandbox_id]
    finally:
        assert await sb.kill() is True
    assert await AsyncSandbox.kill(sb.sandbox_id) is False
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(sb.sandbox_id)
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(api_key=BAD_KEY)
    with pytest.raises(SandboxException) as e:
        await AsyncSandbox.create(template="no-such-template")
    assert e.value.status_code == 404


async def test_async_watch_dir_streams_events_until_stopped_or_killed(served):
    sb = await AsyncSandbox.create()
    try:
        await sb.files.make_dir("/work/w")
        got: list[tuple[str, str]] = []
        exits: list[object] = []
        h = await sb.files.watch_dir(
            "/work/w",
            on_event=lambda e: got.append((e.type.value, e.name)),
            on_exit=exits.append,
            recursive=True,
        )
        # two commands: inotify says nothing of what a new directory held before its watch,
        # and the watcher watches it once it hears of it (before it tells)
        await sb.commands.run("mkdir /work/w/s")
        deadline = time.monotonic() + 10
        while ("create", "s") not in got:
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.01)
        await sb.commands.run("echo hi > /work/w/s/x && rm /work/w/s/x")
        while ("remove", "s/x") not in got:
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.05)
        assert got == [("create", "s"), ("create", "s/x"), ("write", "s/x"), ("remove", "s/x")]
        await h.stop()
        assert exits == [None]
        # a watch whose sandbox is killed ends
        h = await sb.files.watch_dir("/work/w", on_event=lambda e: None, on_exit=exits.append)
    finally:
        assert await sb.kill() is True
    deadline = time.monotonic() + 10
    while len(exits) < 2:
        assert time.monotonic() < deadline, "the watch did not end with its sandbox"
        await asyncio.sleep(0.05)
