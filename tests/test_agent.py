"""The in-sandbox agent, run for real as a host process on a socket the test binds.

Each test gets a fresh agent and a unique marker; commands that must die carry the marker in
their arguments (``sleep 1000.<marker>``), and teardown fails if any such process survives.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest

import dsec_core.agent as agent_mod
from dsec_core.agent import ensure_agent
from dsec_core.agent.rpc import AgentClient
from dsec_core.errors import (
    AgentProtocolError,
    AgentUnresponsive,
    BackendUnavailable,
    InvalidSpec,
    SandboxNotRunning,
    SandboxPathError,
    SessionClosed,
    ToolError,
    UnknownSession,
)
from dsec_core.linux.processes import pids_matching, proc_stat, stop_process
from dsec_core.testing import async_until


# --- helpers -------------------------------------------------------------------------------
def procs_with(token: str) -> list[int]:
    """Pids of live processes (not zombies, not this one) whose command line contains
    ``token``."""
    return [
        pid
        for pid in pids_matching(token)
        if pid != os.getpid() and (stat := proc_stat(pid)) is not None and stat.state != "Z"
    ]


def proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process."""
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        stat = proc_stat(int(entry))
        if stat is not None:
            table[int(entry)] = (stat.ppid, stat.state)
    return table


def descendants(root: int) -> list[int]:
    table = proc_table()
    out, frontier = [], {root}
    while frontier:
        kids = {p for p, (pp, _) in table.items() if pp in frontier}
        out.extend(kids)
        frontier = kids
    return out


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Agent:
    client: AgentClient
    proc: subprocess.Popen
    binary: Path
    socket_path: Path
    marker: str  # "1000.<token>": a sleep argument no other test uses

    @property
    def token(self) -> str:
        """The marker's digits: teardown fails if any process still mentions them."""
        return self.marker.partition(".")[2]

    def pids(self) -> list[int]:
        """The agent's main process and every handler (processes running the agent binary)."""
        own = [self.proc.pid]
        for pid in descendants(self.proc.pid):
            try:
                if os.readlink(f"/proc/{pid}/exe") == str(self.binary):
                    own.append(pid)
            except OSError:
                pass
        return own


def start_agent(binary: Path, sock_dir: Path) -> tuple[subprocess.Popen, Path]:
    path = sock_dir / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(128)
    try:
        proc = subprocess.Popen(
            [str(binary), "--fd", str(listener.fileno())], pass_fds=[listener.fileno()]
        )
    finally:
        listener.close()  # the agent has its own copy; connections queue until it accepts
    return proc, path


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory) -> Path:
    return ensure_agent(tmp_path_factory.mktemp("agent-bin"))


@pytest.fixture
def agent(agent_bin):
    sock_dir = Path(tempfile.mkdtemp(prefix="dsa-", dir="/tmp"))  # short: sun_path is 108 bytes
    proc, path = start_agent(agent_bin, sock_dir)
    marker = f"1000.{int.from_bytes(os.urandom(4), 'big'):010d}"
    a = Agent(AgentClient(path, sandbox_id="t1"), proc, agent_bin, path, marker)
    try:
        yield a
    finally:
        stop_process(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)
        leftovers = procs_with(a.token)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"processes outlived the agent: {leftovers}"


# --- building ------------------------------------------------------------------------------
def test_ensure_agent_builds_once(agent_bin, tmp_path):
    assert (
        agent_bin.name.startswith("dsec-agent-") and len(agent_bin.name) == len("dsec-agent-") + 12
    )
    assert os.access(agent_bin, os.X_OK)
    assert ensure_agent(agent_bin.parent) == agent_bin
    assert not [p for p in agent_bin.parent.iterdir() if p.name.endswith(".tmp")]
    out = subprocess.run([str(agent_bin), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("dsec-agent ")


def test_ensure_agent_reports_compiler_errors(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.c").write_text("int main(void) { return undefined_thing; }\n")
    with pytest.raises(ToolError) as info:
        ensure_agent(tmp_path / "bin", source_dir=src)
    assert info.value.exit_code != 0 and "undefined_thing" in info.value.stderr
    assert "gcc" in info.value.command[0] or "cc" in info.value.command[0]
    assert not list((tmp_path / "bin").iterdir())  # no temp file left behind
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no compiler on PATH
    with pytest.raises(BackendUnavailable):
        ensure_agent(tmp_path / "bin2", source_dir=src)


def test_a_second_home_copies_the_agent_from_the_build_cache(tmp_path, monkeypatch):
    """What one node home compiled, the next copies from the machine's build cache: a fresh
    node does not spend seconds in gcc (the suite opens dozens). A gcc that logs each run
    counts the compiles."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.c").write_text("int main(void) { return 0; }\n")
    tools, log = tmp_path / "tools", tmp_path / "gcc.log"
    tools.mkdir()
    real = shutil.which("gcc")
    assert real is not None
    (tools / "gcc").write_text(f'#!/bin/sh\necho run >> {log}\nexec {real} "$@"\n')
    (tools / "gcc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setenv("DSEC_BUILD_CACHE", os.fspath(tmp_path / "cache"))
    first = ensure_agent(tmp_path / "one", source_dir=src)
    second = ensure_agent(tmp_path / "two", source_dir=src)
    assert log.read_text().count("run") == 1
    assert second.name == first.name and second.read_bytes() == first.read_bytes()
    assert subprocess.run([second]).returncode == 0
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and cached[0].name.endswith(first.name)
    # a changed compiler (an upgrade changes its size or mtime) is a new build
    os.utime(tools / "gcc", ns=(0, 0))
    ensure_agent(tmp_path / "three", source_dir=src)
    assert log.read_text().count("run") == 2
    # off: every home compiles its own
    monkeypatch.setenv("DSEC_BUILD_CACHE", "off")
    ensure_agent(tmp_path / "four", source_dir=src)
    assert log.read_text().count("run") == 3 and len(list((tmp_path / "cache").iterdir())) == 2
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_agent_sources_cover_every_file():
    names = [p.name for p in agent_mod.agent_sources()]
    assert names == sorted(names) and "agent.h" in names and "main.c" in names
    assert set(names) == {
        p.name for p in agent_mod.AGENT_SOURCE_DIR.iterdir() if p.suffix in (".c", ".h")
    }


@pytest.mark.parametrize("changed", ["files.c", "agent.h"])
def test_any_source_change_renames_the_agent(agent_bin, tmp_path, changed):
    src = tmp_path / "src"
    shutil.copytree(agent_mod.AGENT_SOURCE_DIR, src)
    # the digest depends on the sources, not where they are: this finds the existing build
    assert ensure_agent(agent_bin.parent, source_dir=src) == agent_bin
    with open(src / changed, "a") as f:
        f.write("/* a change */\n")
    other = ensure_agent(tmp_path / "bin", source_dir=src)
    assert other.name != agent_bin.name and other.name.startswith("dsec-agent-")
    assert subprocess.run([str(other), "--version"], capture_output=True).returncode == 0


def test_moving_code_between_files_renames_the_agent(tmp_path):
    # Same bytes in the same order, split differently: names and lengths are in the digest.
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x.c").write_text("int x;\nint y;\n")
    (a / "y.c").write_text("int z;\n")
    (b / "x.c").write_text("int x;\n")
    (b / "y.c").write_text("int y;\nint z;\n")
    digest = agent_mod._digest
    assert digest(agent_mod.agent_sources(a)) != digest(agent_mod.agent_sources(b))


MAX_FUNCTION_LINES = 85


def function_lengths(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function defined in C source ``text``.

    Made for the agent's style: a definition starts at column 0 with its return type and name,
    may continue on indented lines, and its body's ``{`` ends the signature's last line or
    stands alone at column 0; the body ends at the next ``}`` at column 0. Prototypes and
    one-line bodies are skipped. The length counts from the line with the opening brace to the
    closing brace, both included.
    """
    lines = text.splitlines()
    start = re.compile(r"^(?:static\s+|inline\s+)*[A-Za-z_][\w\s\*]*?\b(\w+)\s*\(")
    found, i = [], 0
    while i < len(lines):
        m = start.match(lines[i])
        if not m:
            i += 1
            continue
        j = i
        while (
            not lines[j].rstrip().endswith(("{", "}", ";"))
            and j + 1 < len(lines)
            and lines[j + 1].startswith((" ", "\t", "{"))
        ):
            j += 1
        if not lines[j].rstrip().endswith("{"):  # a prototype, a one-line body, an attribute
            i = j + 1
            continue
        k = j + 1
        while k < len(lines) and not lines[k].startswith("}"):
            k += 1
        assert k < len(lines), f"no closing brace for {m.group(1)} (line {i + 1})"
        found.append((m.group(1), i + 1, k - j + 1))
        i = k + 1
    return found


def test_function_length_scanner_sees_functions():
    text = (
        "static int f(int a,\n"
        "             int b)\n"
        "{\n" + "    a++;\n" * 3 + "    return a;\n}\n\n"
        "void g(void) {\n    if (x) {\n        y();\n    }\n}\n"
        "static int h(void) { return 1; }\n"
        "struct s {\n    int a;\n};\n"
        "int proto(int);\n"
    )
    assert function_lengths(text) == [("f", 1, 6), ("g", 10, 5)]


def test_agent_functions_are_short():
    sources = sorted(agent_mod.AGENT_SOURCE_DIR.glob("*.c"))
    assert len(sources) >= 6
    lengths = [(src.name, *f) for src in sources for f in function_lengths(src.read_text())]
    names = {name for _, name, _, _ in lengths}
    assert {"main", "op_exec", "op_session_exec", "op_session_open", "req_parse"} <= names
    too_long = [
        f"{file}:{line} {name} ({n} lines)"
        for file, name, line, n in lengths
        if n > MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


# --- exec ----------------------------------------------------------------------------------
async def test_ping(agent):
    info = await agent.client.ping()
    assert info["pid"] == agent.proc.pid and info["version"] and info["sessions"] == 0


async def test_exec_string_argv_env_cwd(agent):
    c = agent.client
    r = await c.exec("echo out; echo err >&2; pwd")
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"out\n/\n", b"err\n")
    assert r.command == "echo out; echo err >&2; pwd" and r.sandbox_id == "t1"
    assert 0 < r.duration < 5 and not r.truncated and not r.timed_out
    r = await c.exec(["printf", "%s|", "a b", "'q'", "$HOME"])
    assert r.stdout == b"a b|'q'|$HOME|"
    assert r.command == "printf '%s|' 'a b' ''\"'\"'q'\"'\"'' '$HOME'"
    env = dict(line.split("=", 1) for line in (await c.exec(["env"])).text.splitlines())
    assert env == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
    }
    r = await c.exec("echo $HOME $FOO $LANG", env={"FOO": "bar baz", "HOME": "/tmp"})
    assert r.stdout == b"/tmp bar baz C.UTF-8\n"
    assert (await c.exec(["pwd"], cwd="/tmp")).stdout == b"/tmp\n"


async def test_exec_exit_codes(agent, tmp_path):
    c = agent.client
    assert (await c.exec("exit 7")).exit_code == 7
    r = await c.exec(["no-such-command-xyz"])
    assert r.exit_code == 127 and b"no-such-command-xyz" in r.stderr
    assert (await c.exec("no-such-command-xyz")).exit_code == 127
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    r = await c.exec([str(script)])
    assert r.exit_code == 126 and b"Permission denied" in r.stderr
    assert (await c.exec("kill -TERM $$")).exit_code == 128 + signal.SIGTERM
    assert (await c.exec("kill -KILL $$")).exit_code == 137
    with pytest.raises(SandboxPathError) as info:
        await c.exec(["true"], cwd="/no/such/dir")
    assert info.value.path == "/no/such/dir" and info.value.errno == errno.ENOENT
    assert str(info.value) == "sandbox t1: /no/such/dir: No such file or directory"


async def test_exec_stdin(agent):
    c = agent.client
    data = os.urandom(4 << 20)  # far more than a pipe holds: needs writing while reading
    r = await c.exec(["cat"], stdin=data, max_output=8 << 20)
    assert r.stdout == data and r.exit_code == 0
    r = await c.exec("wc -c; cat >&2", stdin=b"abc")
    assert r.stdout.split() == [b"3"] and r.stderr == b""
    start = time.monotonic()
    r = await c.exec(["cat"], timeout=5)  # None: /dev/null, so cat ends at once
    assert r.stdout == b"" and not r.timed_out and time.monotonic() - start < 2
    assert (await c.exec(["cat"], stdin=b"")).stdout == b""
    r = await c.exec("head -c 10", stdin=data)  # stops reading early: no deadlock, no error
    assert r.stdout == data[:10] and r.exit_code == 0


async def test_output_cap_and_timeout_keep_memory_small(agent):
    c = agent.client
    task = asyncio.create_task(c.exec(["yes"], timeout=1.5, max_output=1000))
    await asyncio.sleep(1.0)
    rss = {pid: rss_kib(pid) for pid in agent.pids()}
    start = time.monotonic()
    r = await task
    assert time.monotonic() - start < 1.5  # returns right after the 1.5 s timeout
    assert r.truncated and r.timed_out and r.exit_code == 137
    assert r.stdout == b"y\n" * 500
    print(f"\nagent RSS while `yes` runs (KiB): {rss}")
    assert len(rss) >= 2 and max(rss.values()) < 16 << 10, rss  # KiB: output is dropped, not kept
    r = await c.exec("head -c 300000 /dev/zero; head -c 5000 /dev/zero >&2", max_output=1000)
    assert r.truncated and not r.timed_out and r.exit_code == 0
    assert (len(r.stdout), len(r.stderr)) == (1000, 1000)
    r = await c.exec("printf 12345", max_output=5)
    assert r.stdout == b"12345" and not r.truncated


async def test_timeout_kills_the_whole_tree(agent):
    m = agent.marker
    start = time.monotonic()
    r = await agent.client.exec(
        f"setsid sleep {m} & (sleep {m} &); sh -c 'sleep {m} & exec sleep {m}' & echo started; "
        f"sleep {m}",
        timeout=0.5,
    )
    assert time.monotonic() - start < 2.5
    assert r.timed_out and r.exit_code == 137 and r.stdout == b"started\n"
    assert procs_with(m) == []


async def test_background_processes_do_not_hold_exec(agent):
    m = agent.marker
    start = time.monotonic()
    r = await agent.client.exec(f"sleep {m} & echo bg", background=True)
    assert r.exit_code == 0 and r.stdout == b"bg\n" and time.monotonic() - start < 1
    # allowed to keep running; the fixture's teardown checks it dies with the agent
    await async_until(lambda: len(procs_with(m)) == 1, timeout=3.0)
    # its handler stays as the keeper (subreaper) of what it left, and goes with it
    (sleeper,) = procs_with(m)
    keeper = proc_table()[sleeper][0]
    assert keeper in agent.pids() and keeper != agent.proc.pid
    os.kill(sleeper, signal.SIGKILL)
    await async_until(lambda: keeper not in proc_table(), timeout=3.0)


async def test_exec_kills_what_it_left_running(agent):
    m = agent.marker
    r = await agent.client.exec(
        f"setsid sleep {m} & (sleep {m} &); sh -c 'sleep {m} & exec sleep {m}' & echo left"
    )
    assert r.exit_code == 0 and r.stdout == b"left\n" and not r.timed_out
    assert procs_with(m) == []  # gone before the answer came back
    # the handler itself exits right after answering, and main reaps it
    await async_until(lambda: descendants(agent.proc.pid) == [], timeout=3.0)


async def test_a_command_that_kills_its_handler_leaves_no_orphans(agent):
    """SIGKILL to its own handler would hand a command's processes to main; main kills
    children it did not start."""
    m = agent.marker
    with pytest.raises(SandboxNotRunning):
        await agent.client.exec(f"sleep {m} & setsid sleep {m} & sleep 0.1; kill -9 $PPID; wait")
    await async_until(lambda: not procs_with(m), timeout=3.0)
    assert (await agent.client.exec("echo fine")).stdout == b"fine\n"
    await async_until(lambda: descendants(agent.proc.pid) == [], timeout=3.0)


async def test_a_stopped_handler_is_continued(agent):
    start = time.monotonic()
    r = await agent.client.exec("kill -STOP $PPID; sleep 0.2; echo after", timeout=10)
    assert r.stdout == b"after\n" and r.exit_code == 0 and time.monotonic() - start < 3


async def test_exclusive_kills_every_other_process(agent):
    c, m = agent.client, agent.marker
    sid = await c.session_open()
    await c.session_exec(sid, f"sleep {m} &")
    await c.exec(f"sleep {m} > /dev/null &", background=True)
    other = asyncio.create_task(c.exec(["sleep", m]))
    await async_until(lambda: len(procs_with(m)) == 3, timeout=3.0)
    r = await c.exec(["sh", "-c", "echo alone"], exclusive=True)
    assert r.stdout == b"alone\n"
    assert procs_with(m) == []
    with pytest.raises(SandboxNotRunning):  # its handler died with it
        await other
    with pytest.raises(SessionClosed):
        await c.session_exec(sid, "true")
    await async_until(lambda: descendants(agent.proc.pid) == [], timeout=3.0)


async def test_concurrent_execs_run_in_parallel(agent):
    start = time.monotonic()
    results = await asyncio.gather(*(agent.client.exec(["sleep", "0.5"]) for _ in range(8)))
    assert all(r.exit_code == 0 for r in results)
    assert time.monotonic() - start < 2.0


async def test_cancelled_call_kills_its_command(agent):
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(agent.client.exec(f"sleep {agent.marker}"), 0.3)
    await async_until(lambda: not procs_with(agent.marker), timeout=3.0)


async def test_commands_cannot_reach_agent_fds(agent):
    c = agent.client
    r = await c.exec("ls /proc/$$/fd; :")  # the shell's own fds, listed by a child
    assert r.stdout.split() == [b"0", b"1", b"2"]
    sid = await c.session_open()
    r = await c.session_exec(sid, "sh -c 'ls /proc/$$/fd; :'")
    assert r.stdout.split() == [b"0", b"1", b"2"]
    r = await c.session_exec(sid, "echo forged >&3")  # the marker pipe is closed for commands
    assert r.exit_code != 0
    assert (await c.session_exec(sid, "echo still here")).stdout == b"still here\n"


async def test_zombies_are_reaped(agent):
    await agent.client.exec("(sleep 0.2 &); true")
    await asyncio.sleep(0.6)
    table = proc_table()
    zombies = [p for p, (pp, st) in table.items() if pp == agent.proc.pid and st == "Z"]
    assert zombies == []


async def test_exec_roundtrip_latency(agent):
    c = agent.client
    for _ in range(5):
        await c.exec(["true"])
    times = []
    for _ in range(50):
        start = time.perf_counter()
        r = await c.exec(["true"])
        times.append(time.perf_counter() - start)
        assert r.exit_code == 0
    median = statistics.median(times)
    print(
        f"\nexec(['true']) round trip: median {median * 1000:.2f} ms, "
        f"max {max(times) * 1000:.2f} ms"
    )
    assert median < 0.010


# --- agent lifecycle and transport ---------------------------------------------------------
async def test_default_fd_and_bad_fd(agent_bin, tmp_path):
    sock_dir = Path(tempfile.mkdtemp(prefix="dsa-", dir="/tmp"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_dir / "a.sock"))
    listener.listen(8)
    fd = listener.fileno()
    proc = subprocess.Popen(
        ["/bin/bash", "-c", f'exec "$0" 3<&{fd} {fd}<&-', str(agent_bin)], pass_fds=[fd]
    )
    listener.close()
    try:
        info = await AgentClient(sock_dir / "a.sock").ping()
        assert info["pid"] == proc.pid
    finally:
        stop_process(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)
    bad = subprocess.run(
        [str(agent_bin), "--fd", "0"], stdin=subprocess.DEVNULL, capture_output=True, timeout=5
    )
    assert bad.returncode == 2 and b"not a listening socket" in bad.stderr


async def test_an_agent_that_never_answers_is_agent_unresponsive(tmp_path, monkeypatch):
    """An agent that takes a request and never answers (its VM stopped, its sandbox frozen)
    is ``AgentUnresponsive`` after the command's timeout and the grace, an infrastructure
    failure a trainer masks, not a bare ``SandboxError``."""
    from dsec_core.agent import rpc
    from dsec_core.rl import infra_event

    monkeypatch.setattr(rpc, "_TIMEOUT_SLACK", 0.3)
    path = tmp_path / "mute.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(os.fspath(path))
    server.listen(4)
    try:
        with pytest.raises(AgentUnresponsive) as e:
            await AgentClient(path, sandbox_id="mute").exec(["true"], timeout=0.1)
        assert e.value.sandbox_id == "mute" and e.value.http_status == 504
        event = infra_event(e.value)
        assert event is not None and event.kind == "crashed"
    finally:
        server.close()


async def test_agent_gone_raises_sandbox_not_running(agent, tmp_path):
    with pytest.raises(SandboxNotRunning):
        await AgentClient(tmp_path / "nothing.sock", sandbox_id="x").ping()
    sid = await agent.client.session_open()
    await agent.client.session_exec(sid, "true")
    busy = asyncio.create_task(agent.client.exec(["sleep", "30"]))
    await asyncio.sleep(0.2)
    children = descendants(agent.proc.pid)
    assert len(children) >= 3  # the shell, the exec handler and its sleep
    agent.proc.kill()
    agent.proc.wait()
    with pytest.raises(SandboxNotRunning):
        await busy
    with pytest.raises(SandboxNotRunning) as info:
        await agent.client.exec(["true"])
    assert info.value.sandbox_id == "t1"

    def all_gone() -> bool:  # shells, handlers and their commands die with the agent
        table = proc_table()
        return not [p for p in children if p in table and table[p][1] != "Z"]

    await async_until(all_gone, timeout=3.0)


async def test_oversize_frames_are_refused(agent):
    async def raw(data: bytes) -> dict[str, bytes]:
        reader, writer = await asyncio.open_unix_connection(str(agent.socket_path))
        writer.write(data)
        await writer.drain()
        (n,) = struct.unpack("<I", await reader.readexactly(4))
        payload = await reader.readexactly(n)
        writer.close()
        fields, i = {}, 0
        while i < n:
            kl = payload[i]
            key = payload[i + 1 : i + 1 + kl].decode()
            (vl,) = struct.unpack_from("<I", payload, i + 1 + kl)
            fields[key] = payload[i + 5 + kl : i + 5 + kl + vl]
            i += 5 + kl + vl
        return fields

    before = rss_kib(agent.proc.pid)
    reply = await raw(struct.pack("<I", 1 << 30))  # claims a 1 GiB header
    assert reply["error"] == b"bad_request" and b"limit" in reply["message"]
    body = b"\x02op\x04\x00\x00\x00ping\x08body_len\x09\x00\x00\x00999999999"
    reply = await raw(struct.pack("<I", len(body)) + body)
    assert reply["error"] == b"bad_request"
    reply = await raw(struct.pack("<I", 3) + b"\x05ab")  # truncated field
    assert reply["error"] == b"bad_request"
    assert rss_kib(agent.proc.pid) - before < 4096
    assert (await agent.client.ping())["pid"] == agent.proc.pid
    with pytest.raises(InvalidSpec):
        await agent.client.exec(["cat"], stdin=b"x" * ((16 << 20) + 1))


def _frame(*fields: tuple[str, bytes]) -> bytes:
    payload = b"".join(
        struct.pack("<B", len(k)) + k.encode() + struct.pack("<I", len(v)) + v for k, v in fields
    )
    return struct.pack("<I", len(payload)) + payload


class ForgedAgent:
    """A socket the test owns that answers every request with ``reply``, whatever it asked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reply = b""
        self.client = AgentClient(path, sandbox_id="forged")

    async def _answer(self, reader, writer) -> None:
        await reader.read(65536)
        writer.write(self.reply)
        await writer.drain()
        writer.close()

    async def start(self) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._answer, path=str(self.path))


@pytest.fixture
def forged_agent():
    sock_dir = Path(tempfile.mkdtemp(prefix="dsf-", dir="/tmp"))  # short: sun_path
    yield ForgedAgent(sock_dir / "f.sock")
    shutil.rmtree(sock_dir, ignore_errors=True)


OK = ("ok", b"1")


@pytest.mark.parametrize(
    ("call", "reply", "says"),
    [
        ("ping", struct.pack("<I", 512 << 20), "536870912 byte reply header"),
        ("ping", _frame(OK, ("body_len", b"10")), "10 byte reply body to ping (at most 0)"),
        ("exec", _frame(OK, ("body_len", str(3 << 20).encode())), "at most 2000"),
        ("exec", _frame(OK, ("stdout_len", b"9"), ("body_len", b"4")) + b"abcd", "as stdout"),
        ("exec", _frame(OK, ("exit_code", b"zero")), "not a number"),
        ("exec", _frame(OK, ("exit_code", b"1" * 30)), "not a number"),
        ("exec", struct.pack("<I", 8) + b"\x02ok\xff\xff\xff\x7f1", "past the header's end"),
        ("read", _frame(OK, ("body_len", b"101")) + b"x" * 101, "at most 100"),
        ("list", _frame(OK, ("entry", b"garbage")), "malformed directory entry"),
        ("ping", _frame(OK, ("body_len", b"-5")), "-5 byte reply body"),
    ],
)
async def test_forged_replies_are_refused(forged_agent, call, reply, says):
    """The daemon's client trusts nothing the agent sends beyond what the request allows."""
    server = await forged_agent.start()
    forged_agent.reply = reply
    c = forged_agent.client
    calls = {
        "ping": lambda: c.ping(),
        "exec": lambda: c.exec(["true"], max_output=1000, timeout=5),
        "read": lambda: c.read_file("/x", length=100),
        "list": lambda: c.list_dir("/"),
    }
    try:
        with pytest.raises(AgentProtocolError) as info:
            await calls[call]()
        assert says in str(info.value) and info.value.sandbox_id == "forged"
    finally:
        server.close()


async def test_a_forged_huge_reply_allocates_nothing(forged_agent):
    server = await forged_agent.start()
    forged_agent.reply = _frame(OK, ("body_len", str(32 << 20).encode())) + b"A" * (1 << 20)
    tracemalloc.start()
    try:
        # max_output 16 MiB: a 32 MiB body is allowed, so it is read, but as it arrives
        with pytest.raises(SandboxNotRunning):  # only 1 MiB of it ever comes
            await forged_agent.client.exec(["true"], max_output=16 << 20, timeout=5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        server.close()
    assert peak < 8 << 20, peak


# --- sessions ------------------------------------------------------------------------------
async def test_session_state_persists(agent):
    c = agent.client
    sid = await c.session_open(env={"GREETING": "hello"})
    other = await c.session_open(cwd="/tmp")
    assert sorted(await c.sessions()) == sorted([sid, other])
    for cmd in ["cd /tmp", "X=5", "f() { echo fn$1; }", "export Y=7"]:
        r = await c.session_exec(sid, cmd)
        assert (r.exit_code, r.stdout, r.stderr) == (0, b"", b"")
    r = await c.session_exec(sid, "pwd; echo $X; f 1; sh -c 'echo $Y $GREETING'")
    assert r.stdout == b"/tmp\n5\nfn1\n7 hello\n" and r.command.startswith("pwd;")
    assert (await c.session_exec(other, "pwd; echo x${X}x")).stdout == b"/tmp\nxx\n"
    assert (await c.session_exec(sid, "false")).exit_code == 1
    assert (await c.session_exec(sid, "(exit 42)")).exit_code == 42
    assert (await c.session_exec(sid, "printf 'no newline'")).stdout == b"no newline"
    assert (await c.session_exec(sid, "echo err >&2")).stderr == b"err\n"
    r = await c.session_exec(sid, "cat; echo", stdin=b"in\x00put")
    assert r.stdout == b"in\x00put\n"
    start = time.monotonic()
    assert (await c.session_exec(sid, "cat")).stdout == b""  # /dev/null, not the control pipe
    assert time.monotonic() - start < 2
    assert (await c.session_exec(sid, "echo 'unterminated")).exit_code != 0
    assert (await c.session_exec(sid, "echo $X")).stdout == b"5\n"
    r = await c.session_exec(sid, "yes | head -c 100000", max_output=1000)
    assert r.truncated and len(r.stdout) == 1000
    with pytest.raises(SandboxPathError):
        await c.session_open(cwd="/no/such/dir")
    with pytest.raises(UnknownSession) as info:
        await c.session_exec("nope", "true")
    assert info.value.name == "nope" and sorted(info.value.known) == sorted([sid, other])


async def test_session_exit_closes_it(agent):
    c = agent.client
    sid = await c.session_open()
    r = await c.session_exec(sid, "echo bye; exit 3")
    assert r.exit_code == 3 and r.stdout == b"bye\n" and not r.timed_out
    with pytest.raises(SessionClosed):
        await c.session_exec(sid, "true")
    assert sid not in await c.sessions()
    await c.session_close(sid)
    with pytest.raises(UnknownSession):
        await c.session_exec(sid, "true")
    with pytest.raises(UnknownSession):
        await c.session_close(sid)


async def test_session_timeout_kills_children_and_keeps_shell(agent):
    c, m = agent.client, agent.marker
    sid = await c.session_open()
    await c.session_exec(sid, "X=kept")
    start = time.monotonic()
    r = await c.session_exec(
        sid, f"setsid sleep {m} & (sleep {m} &); echo going; sleep {m}", timeout=0.5
    )
    assert time.monotonic() - start < 2
    assert r.timed_out and r.exit_code == 137 and r.stdout == b"going\n"
    assert procs_with(m) == []
    assert (await c.session_exec(sid, "echo $X")).stdout == b"kept\n"


async def test_session_timeout_spares_earlier_background_jobs(agent):
    c, m = agent.client, agent.marker
    server = f"1001.{agent.token}"
    sid = await c.session_open()
    # a "server" from an earlier command that keeps forking workers; the loop ends (and the
    # server with it) as soon as one of its sleeps is killed
    await c.session_exec(sid, f"sh -c 'while sleep 0.05; do :; done' {server} &")
    await async_until(lambda: len(procs_with(server)) == 1, timeout=3.0)
    r = await c.session_exec(sid, f"sleep {m} & sleep {m}", timeout=0.3)
    assert r.timed_out and procs_with(m) == []
    await asyncio.sleep(0.2)
    assert len(procs_with(server)) == 1  # it and its workers were spared
    await c.session_close(sid)
    await async_until(lambda: not procs_with(server), timeout=3.0)


async def test_session_stuck_shell_is_killed(agent):
    c = agent.client
    sid = await c.session_open()
    start = time.monotonic()
    r = await c.session_exec(sid, "while :; do :; done", timeout=0.3)
    assert r.timed_out and r.exit_code == 137 and time.monotonic() - start < 3
    with pytest.raises(SessionClosed):
        await c.session_exec(sid, "true")


async def test_session_timeout_in_a_loop_of_children_keeps_shell(agent):
    c, m = agent.client, agent.marker
    sid = await c.session_open()
    r = await c.session_exec(
        sid, f"for i in 1 2 3 4; do sleep {m}; done; echo loop-done", timeout=0.3
    )
    assert r.timed_out and r.stdout == b"loop-done\n" and procs_with(m) == []
    assert (await c.session_exec(sid, "echo alive")).stdout == b"alive\n"


async def test_session_commands_are_serialized(agent, tmp_path):
    c = agent.client
    sid = await c.session_open()
    log = tmp_path / "order"
    tasks = []
    for n in range(3):
        tasks.append(
            asyncio.create_task(
                c.session_exec(
                    sid, f"echo start {n} >> {log}; sleep 0.2; echo end {n} >> {log}; echo {n}"
                )
            )
        )
        await asyncio.sleep(0.03)
    start = time.monotonic()
    results = await asyncio.gather(*tasks)
    assert [r.stdout for r in results] == [b"0\n", b"1\n", b"2\n"]
    assert log.read_text().split("\n")[:-1] == [
        f"{w} {n}" for n in range(3) for w in ("start", "end")
    ]
    assert time.monotonic() - start > 0.45


async def test_session_close_kills_descendants(agent):
    c, m = agent.client, agent.marker
    sid = await c.session_open()
    await c.session_exec(sid, f"setsid sleep {m} & sleep {m} &")
    await async_until(lambda: len(procs_with(m)) == 2, timeout=3.0)  # both have exec'd sleep
    await c.session_close(sid)
    await async_until(lambda: not procs_with(m), timeout=3.0)
    assert await c.sessions() == []
    with pytest.raises(UnknownSession):
        await c.session_exec(sid, "true")


# --- files ---------------------------------------------------------------------------------
async def test_file_operations(agent, tmp_path):
    c = agent.client
    base = tmp_path / "files"
    f = base / "a" / "b" / "c.txt"
    await c.write_file(f, b"hello world", mode=0o600)
    assert f.read_bytes() == b"hello world" and (f.stat().st_mode & 0o777) == 0o600
    assert (base / "a").stat().st_mode & 0o777 == 0o755
    assert await c.read_file(f) == b"hello world"
    assert await c.read_file(f, offset=6) == b"world"
    assert await c.read_file(f, offset=2, length=3) == b"llo"
    assert await c.read_file(f, offset=100) == b""
    assert await c.read_file(f, length=0) == b""
    await c.write_file(f, b"W", offset=6, truncate=False)
    assert f.read_bytes() == b"hello World"
    await c.write_file(f, b"!", offset=5)  # truncate cuts at the offset
    assert f.read_bytes() == b"hello!"
    await c.write_file(f, b"")
    assert f.read_bytes() == b""
    with pytest.raises(SandboxPathError) as info:
        await c.write_file(base / "new" / "x", b"x", make_parents=False)
    assert info.value.errno == errno.ENOENT

    (base / "dir").mkdir()
    os.symlink("a/b/c.txt", base / "link")
    (base / "sp ace\nname").write_bytes(b"12345")
    entries = {e.name: e for e in await c.list_dir(base)}
    assert set(entries) == {"a", "dir", "link", "sp ace\nname"}
    assert (entries["a"].type, entries["dir"].type, entries["link"].type) == (
        "dir",
        "dir",
        "symlink",
    )
    e = entries["sp ace\nname"]
    assert (e.type, e.size) == ("file", 5)
    assert abs(e.mtime - (base / "sp ace\nname").stat().st_mtime) < 1e-3
    st = await c.stat(base / "link")
    assert (st.name, st.type) == ("link", "symlink")
    st = await c.stat(f)
    assert (st.name, st.type, st.size, st.mode) == ("c.txt", "file", 0, 0o600)
    assert (await c.stat("/")).type == "dir"
    dev = await c.stat("/dev/null")
    assert dev.type == "other"

    with pytest.raises(SandboxPathError):
        await c.read_file("/etc/nope", length=0)
    with pytest.raises(SandboxPathError) as info:
        await c.read_file("/etc/nope")
    err = info.value
    assert (err.path, err.errno, err.sandbox_id) == ("/etc/nope", errno.ENOENT, "t1")
    assert str(err) == "sandbox t1: /etc/nope: No such file or directory"
    for call, code in [
        (c.read_file(base), errno.EISDIR),
        (c.list_dir(f), errno.ENOTDIR),
        (c.write_file(f / "x", b""), errno.ENOTDIR),
        (c.stat(base / "gone"), errno.ENOENT),
        (c.remove(base / "a"), errno.ENOTEMPTY),
        (c.remove(base / "gone"), errno.ENOENT),
    ]:
        with pytest.raises(SandboxPathError) as info:
            await call
        assert info.value.errno == code

    await c.remove(base / "link")
    assert f.exists() and not (base / "link").exists()
    await c.remove(base / "dir")
    await c.remove(base / "a", recursive=True)
    assert sorted(os.listdir(base)) == ["sp ace\nname"]


async def test_large_file_roundtrip_is_chunked(agent, tmp_path):
    c = agent.client
    data = os.urandom(20 << 20)
    path = tmp_path / "big.bin"
    await c.write_file(path, data)
    assert path.stat().st_size == len(data)
    assert await c.read_file(path) == data
    assert await c.read_file(path, offset=7 << 20, length=3 << 20) == data[7 << 20 : 10 << 20]
    assert await c.read_file(path, offset=(20 << 20) - 5) == data[-5:]
    await c.write_file(path, data[: 9 << 20], offset=1, truncate=False)
    assert path.read_bytes() == data[:1] + data[: 9 << 20] + data[(9 << 20) + 1 :]


# --- the policy document (--policy-fd) --------------------------------------------------------
AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
NR_UNAME_X86_64 = 63
NR_LANDLOCK_CREATE_RULESET = 444


def deny_one_call(nr: int, err: int) -> bytes:
    """A classic BPF seccomp program: ``nr`` on x86_64 fails with ``err``, all else passes."""
    insns = [
        (0x20, 0, 0, 4),  # ld arch
        (0x15, 0, 3, AUDIT_ARCH_X86_64),  # not x86_64: allow
        (0x20, 0, 0, 0),  # ld nr
        (0x15, 0, 1, nr),
        (0x06, 0, 0, SECCOMP_RET_ERRNO | err),
        (0x06, 0, 0, SECCOMP_RET_ALLOW),
    ]
    return b"".join(struct.pack("=HBBI", *i) for i in insns)


def start_agent_with_policy(
    binary: Path, sock_dir: Path, document: bytes, preexec_fn=None
) -> tuple[subprocess.Popen, Path, bytes]:
    """The agent as the container backend starts it: the listener, the document in a sealed
    memfd and the answer pipe; returns the process, its socket and its answer."""
    path = sock_dir / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(128)
    memfd = os.memfd_create("policy", os.MFD_ALLOW_SEALING)
    os.write(memfd, document)
    os.lseek(memfd, 0, os.SEEK_SET)
    answer_r, answer_w = os.pipe()
    fds = [listener.fileno(), memfd, answer_w]
    argv = [
        str(binary),
        "--fd",
        str(fds[0]),
        "--policy-fd",
        str(memfd),
        "--status-fd",
        str(answer_w),
    ]
    try:
        proc = subprocess.Popen(argv, pass_fds=fds, preexec_fn=preexec_fn)
    finally:
        listener.close()
        os.close(memfd)
        os.close(answer_w)
    with os.fdopen(answer_r, "rb") as f:
        answer = f.read()
    return proc, path, answer


def document(*fields: tuple[bytes, bytes]) -> bytes:
    return b"DSECPOL1" + b"".join(
        bytes([len(k)]) + k + len(v).to_bytes(4, "little") + v for k, v in fields
    )


@pytest.mark.parametrize(
    "raw, says",
    [
        (b"not a document", b"does not start with DSECPOL1"),
        (document((b"frobnicate", b"1")), b"unknown key: frobnicate"),
        (document((b"landlock.scope", b"everything")), b"unknown landlock.scope"),
        (document((b"landlock.hidden", b"relative/path")), b"not an absolute path"),
        (document((b"seccomp", b"1234567")), b"1 to 4096 instructions"),
        (document((b"landlock.hidden", b"/x"))[:-1], b"truncated field value"),
    ],
)
async def test_a_bad_policy_document_is_refused_and_nothing_is_served(
    agent_bin, tmp_path, raw, says
):
    sock_dir = Path(tempfile.mkdtemp(prefix="dsa-", dir="/tmp"))
    try:
        proc, path, answer = start_agent_with_policy(agent_bin, sock_dir, raw)
        assert answer.startswith(b"error document: ") and says in answer, answer
        assert proc.wait(5) == 3
        with pytest.raises(SandboxNotRunning):
            await AgentClient(path).ping()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the test's filter is for x86_64")
async def test_the_documents_seccomp_filter_binds_the_agent_and_its_commands(agent_bin):
    sock_dir = Path(tempfile.mkdtemp(prefix="dsa-", dir="/tmp"))
    proc, path, answer = start_agent_with_policy(
        agent_bin, sock_dir, document((b"seccomp", deny_one_call(NR_UNAME_X86_64, errno.EPERM)))
    )
    try:
        assert answer == b"ok\n"
        c = AgentClient(path)
        r = await c.exec(["uname", "-s"])
        assert r.exit_code != 0 and b"Operation not permitted" in r.stderr, r
        assert (await c.exec(["echo", "still serving"])).stdout == b"still serving\n"
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert "Seccomp:\t2" in status and "NoNewPrivs:\t1" in status
        assert (await c.read_file("/proc/self/status")).count(b"Seccomp:\t2") == 1  # handlers
    finally:
        stop_process(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def no_landlock_here():
    """A preexec_fn: a filter under which landlock_create_ruleset fails with ENOSYS, as on a
    kernel without Landlock. Everything it needs is made before the fork."""
    libc = ctypes.CDLL(None, use_errno=True)
    prog = deny_one_call(NR_LANDLOCK_CREATE_RULESET, errno.ENOSYS)
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))

    def install() -> None:
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
            os._exit(99)

    install.keep = (buf, fprog)  # type: ignore[attr-defined]
    return install


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the test's filter is for x86_64")
async def test_landlock_is_refused_where_the_kernel_has_none(agent_bin, tmp_path):
    sock_dir = Path(tempfile.mkdtemp(prefix="dsa-", dir="/tmp"))
    try:
        proc, _, answer = start_agent_with_policy(
            agent_bin,
            sock_dir,
            document((b"landlock.read_only", str(tmp_path).encode())),
            preexec_fn=no_landlock_here(),
        )
        assert answer == b"error landlock: this kernel has no Landlock (Function not implemented)\n"
        assert proc.wait(5) == 3
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


async def test_landlock_rules_bind_commands_not_the_agents_own_file_operations(agent_bin, tmp_path):
    """The agent as a host process, with the file policy of a sandbox over a test directory:
    its commands and session shells are refused what the rules deny, while the node's file
    operations (served outside the Landlock domain) still read and write there."""
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "tool").write_text("#!/bin/sh\necho tool\n")
    os.chmod(tmp_path / "ro" / "tool", 0o755)
    (tmp_path / "hid").mkdir()
    (tmp_path / "hid" / "answer").write_text("42\n")
    (tmp_path / "open").mkdir()
    doc = document(
        (b"landlock.read_only", str(tmp_path / "ro").encode()),
        (b"landlock.hidden", str(tmp_path / "hid").encode()),
        (b"landlock.scope", b"signal"),
    )
    sock_dir = Path(tempfile.mkdtemp(prefix="dsa-", dir="/tmp"))
    proc, path, answer = start_agent_with_policy(agent_bin, sock_dir, doc)
    try:
        assert answer == b"ok\n"
        c = AgentClient(path)

        async def sh(cmd: str):
            return await c.exec(["/bin/sh", "-c", cmd], cwd=str(tmp_path))

        assert (await sh("cat hid/answer")).exit_code != 0
        assert (await sh("ls hid")).exit_code != 0
        assert (await sh("echo x > ro/tool")).exit_code != 0
        assert (await sh("echo x > ro/new")).exit_code != 0
        assert (await sh("ro/tool")).stdout == b"tool\n"  # reading and running stay allowed
        assert (await sh("echo x > open/f && cat open/f")).stdout == b"x\n"  # a sibling
        assert (await sh("touch beside")).exit_code != 0  # new entries in an ancestor: no
        sid = await c.session_open(cwd=str(tmp_path))
        assert (await c.session_exec(sid, "cat hid/answer")).exit_code != 0
        assert (await c.session_exec(sid, "cat ro/tool")).exit_code == 0
        # the agent (outside the domain) cannot be signalled; sandbox processes can, across
        # calls: all of them share one domain
        r = await sh(f"kill -0 {proc.pid}")
        assert r.exit_code != 0 and b"ermitted" in r.stderr, r
        await c.exec(
            ["/bin/sh", "-c", "sleep 1000 & echo $! > open/pid"], cwd=str(tmp_path), background=True
        )
        r = await sh("kill $(cat open/pid) && echo killed")
        assert r.stdout == b"killed\n", r
        # the node's own file operations are not under the rules
        assert await c.read_file(tmp_path / "hid" / "answer") == b"42\n"
        await c.write_file(tmp_path / "ro" / "harness", b"installed")
        assert (tmp_path / "ro" / "harness").read_bytes() == b"installed"
        assert {e.name for e in await c.list_dir(tmp_path / "hid")} == {"answer"}
    finally:
        stop_process(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)


async def test_one_socket_can_carry_the_document_and_the_answer(agent_bin, tmp_path):
    """As a VM backend would hand it over a stream: the document, a half-close, the answer."""
    sock_dir = Path(tempfile.mkdtemp(prefix="dsa-", dir="/tmp"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_dir / "agent.sock"))
    listener.listen(8)
    ours, theirs = socket.socketpair()
    fds = [listener.fileno(), theirs.fileno()]
    argv = [
        str(agent_bin),
        "--fd",
        str(fds[0]),
        "--policy-fd",
        str(fds[1]),
        "--status-fd",
        str(fds[1]),
    ]
    proc = subprocess.Popen(argv, pass_fds=fds)
    listener.close()
    theirs.close()
    try:
        ours.sendall(document((b"landlock.read_only", str(tmp_path).encode())))
        ours.shutdown(socket.SHUT_WR)
        assert ours.makefile("rb").read() == b"ok\n"
        r = await AgentClient(sock_dir / "agent.sock").exec(["touch", str(tmp_path / "x")])
        assert r.exit_code != 0 and b"Permission denied" in r.stderr
    finally:
        ours.close()
        stop_process(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)
