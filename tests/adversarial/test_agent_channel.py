"""Attacks on the agent (the sandbox's PID 1) and on the channel between it and the node daemon:
the way sandbox code could forge an exec's result, inflate the daemon, or outlive its command.

Each attack runs as root inside a sandbox, by a static C probe (``agent_probe.c``, compiled at
test time and copied in with ``write_file``) that prints one line per step and exits with the
number of steps that worked. Several run a second time from a user namespace made inside the
sandbox, where the probe holds every capability (of that namespace).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsec_core.agent.rpc import MAX_OUTPUT
from dsec_core.errors import SandboxError
from dsec_core.linux.tools import compile_static

PROBE_SOURCE = Path(__file__).with_name("agent_probe.c")
PROBE = "/probe"


@pytest.fixture(scope="module")
def probe_binary(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("probe") / "agent_probe"
    compile_static([PROBE_SOURCE], out, "the agent probe", flags=["-O2", "-Wall"])
    return out.read_bytes()


@pytest.fixture
def target(dsec_sandboxes, probe_binary):
    """A sandbox with the probe at /probe, without the default seccomp profile: these attacks
    must fail on the agent's own defences, not on a filter that happens to refuse the call
    (the profile refuses pidfd_getfd, for one)."""
    sb = dsec_sandboxes.create(pids=256, policies={"seccomp": {"enabled": False}})
    sb.write_file(PROBE, probe_binary, mode=0o755)
    return sb


def steps(output: bytes) -> dict[str, str]:
    """The probe's "what: outcome" lines."""
    found = {}
    for line in output.decode(errors="replace").splitlines():
        what, sep, outcome = line.partition(": ")
        if sep:
            found[what] = outcome
    return found


def assert_refused(r, *, at_least: int = 1) -> dict[str, str]:
    """Every step of the probe was refused (none says ok), and there were some."""
    seen = steps(r.stdout)
    worked = [w for w, outcome in seen.items() if outcome == "ok"]
    assert r.exit_code == 0 and not worked, f"attack steps that worked: {worked}\n{r.text}"
    assert len(seen) >= at_least, r.text
    return seen


def in_userns(sb, command: str):
    """Run the probe's subcommand from a user namespace made inside the sandbox; skips the
    nested half if no user namespace can be made (a seccomp policy may forbid them)."""
    r = sb.exec(f"{PROBE} userns {command}")
    if "nested user namespace: made" not in r.text:
        return None
    return r


def agent_state(sb) -> tuple[str, int]:
    """PID 1's state letter and the host pid of the sandbox's init, checking it still serves."""
    assert sb.exec("echo serving").stdout == b"serving\n"
    status = sb.exec("cat /proc/1/status").text
    state = next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))
    # running (R) or sleeping (S) are both "serving": a busy machine may catch it at work
    return ("S" if state == "R" else state), sb.refresh().pid


# --- memory, descriptors, ptrace ------------------------------------------------------------
@pytest.mark.attack("ptrace the agent and a handler (root inside, and from a nested userns)")
def test_ptrace_the_agent(target, witness):
    # $PPID of the probe's shell is the handler serving this very exec
    seen = assert_refused(target.exec(f"{PROBE} ptrace 1 $PPID"), at_least=4)
    assert set(seen.values()) <= {"EPERM", "EACCES"}, seen
    nested = in_userns(target, "ptrace 1 $PPID")
    if nested is not None:
        assert_refused(nested, at_least=4)
    assert agent_state(target)[0] in ("S", "R")


@pytest.mark.attack("pidfd_getfd the agent's listening socket and a handler's connection")
def test_pidfd_getfd_the_agents_socket(target, witness):
    r = target.exec(f"{PROBE} getfd 1 $PPID")
    seen = assert_refused(r, at_least=2)
    # pidfd_open works (it is only a handle); taking fds through it does not
    assert any(w.startswith("pidfd_getfd 1 fd 3") for w in seen), r.text
    nested = in_userns(target, "getfd 1 $PPID")
    if nested is not None:
        assert_refused(nested, at_least=2)


@pytest.mark.attack("open /proc/1/mem read-write; /proc/1/{environ,fd,root,cwd,exe}")
def test_agent_memory_and_proc_links(target, witness):
    r = target.exec(f"{PROBE} mem 1 $PPID")
    seen = assert_refused(r, at_least=10)
    assert seen["open /proc/1/mem rw"] in ("EACCES", "EPERM"), r.text
    nested = in_userns(target, "mem 1 $PPID")
    if nested is not None:
        assert_refused(nested, at_least=10)


@pytest.mark.attack("lower the agent's resource limits (prlimit NOFILE) to break later execs")
def test_prlimit_the_agent(target, witness):
    seen = assert_refused(target.exec(f"{PROBE} prlimit 1 $PPID"), at_least=2)
    assert set(seen.values()) == {"EPERM"}, seen
    nested = in_userns(target, "prlimit 1 $PPID")
    if nested is not None:
        assert_refused(nested, at_least=2)
    assert target.exec("echo still runs").stdout == b"still runs\n"


# --- signals --------------------------------------------------------------------------------
@pytest.mark.attack("signal the agent: TERM, INT, HUP, USR1, QUIT, STOP, KILL and forged si_pid")
def test_signal_the_agent(target, witness):
    before = agent_state(target)
    sigs = "TERM INT HUP USR1 QUIT STOP KILL qTERM qINT qHUP"
    r = target.exec(f"{PROBE} signal 1 {sigs}")
    assert r.exit_code == 0, r.text
    assert agent_state(target) == before
    nested = in_userns(target, f"signal 1 {sigs}")
    if nested is not None:
        assert agent_state(target) == before
    with target.session() as sh:  # a session's shell is no better placed
        sh.exec(f"{PROBE} signal 1 {sigs}")
        assert sh.exec("echo still").stdout == b"still\n"
    assert agent_state(target) == before


@pytest.mark.attack("freeze or kill the handler running one's own exec")
def test_stop_or_kill_the_handler(target, witness):
    r = target.exec(f"{PROBE} signal $PPID STOP; sleep 0.3; echo after", timeout=10)
    assert r.stdout.endswith(b"after\n") and r.exit_code == 0, r.text  # main continued it
    # killing it hands the command's processes to PID 1, which kills strangers
    with pytest.raises(SandboxError):
        target.exec("sleep 1000 & setsid sleep 1001 & sleep 0.1; kill -9 $PPID; wait")
    deadline = time.monotonic() + 3
    while b"sleep" in target.exec("cat /proc/[0-9]*/cmdline; true").stdout:
        assert time.monotonic() < deadline, "the orphans of a killed handler live on"
        time.sleep(0.1)


# --- the control channel --------------------------------------------------------------------
@pytest.mark.attack("forge messages on the control channel (every unix socket inside)")
def test_forge_messages_on_the_control_channel(target, dsec_node, witness):
    host_socket = dsec_node.config.runtime_dir / target.id / "agent.sock"
    assert host_socket.exists()
    # a socket of the sandbox's own, to show the search finds sockets and talks to them
    target.exec(f"{PROBE} fakeagent /tmp/decoy.sock header > /dev/null 2>&1 &", background=True)
    time.sleep(0.3)
    r = target.exec(f"{PROBE} sockets {host_socket} /run/dsec-agent.sock @dsec-agent", timeout=60)
    seen = steps(r.stdout)
    assert r.exit_code == 0 and "ANSWERED AS THE AGENT" not in r.text, r.text
    assert seen.get("forge request on /tmp/decoy.sock") == "connected, no agent answer", r.text
    assert seen.get(f"forge request on {host_socket}") == "ENOENT", r.text
    assert seen.get("forge request on /proc/1/fd/3") in ("ENOENT", "EACCES", "ECONNREFUSED")
    # the session machinery's private files are no socket, and no way in either
    with target.session() as sh:
        listing = sh.exec("ls -la /proc/$$/fd; ls -la /run/.dsec-agent-1 2>&1; true").text
        assert "socket:" not in listing, listing


@pytest.mark.attack("a background process answers the daemon's next exec instead of the agent")
def test_background_process_cannot_answer_for_the_agent(target, witness):
    target.exec(f"{PROBE} hijack 6 > /tmp/hijack.log 2>&1 &", background=True).check()
    time.sleep(0.5)
    results = []
    for i in range(15):  # the trainer's exec("judge") while the hijacker works
        r = target.exec(f"echo REAL judge {i}; exit 3", timeout=20)
        results.append((r.exit_code, r.stdout))
        time.sleep(0.2)
    assert results == [(3, f"REAL judge {i}\n".encode()) for i in range(15)]
    deadline = time.monotonic() + 10
    while b"hijack:" not in (log := target.read_file("/tmp/hijack.log")):
        assert time.monotonic() < deadline, log
        time.sleep(0.3)
    line = next(x for x in log.decode().splitlines() if x.startswith("hijack:"))
    rounds, footholds = int(line.split()[1]), int(line.split()[3])
    assert rounds > 100 and footholds == 0, line
    assert agent_state(target)[0] in ("S", "R")


@pytest.mark.attack("tamper with a later verifier from a background process (exclusive=True)")
def test_exclusive_verifier_cannot_be_tampered_with(target, witness):
    judge = "sh -c 'sleep 0.5; echo REAL; exit 3' judge"
    target.exec(f"{PROBE} tamper judge 60 > /dev/null 2>&1 &", background=True).check()
    time.sleep(0.3)
    # What exclusive is for: without it, code that ran earlier can reach a later command's
    # output (the command is the sandbox's own process), though never the agent's answer. (A
    # policy that scopes /proc access between commands would stop this part by itself.)
    plain = target.exec(judge, timeout=20)
    assert plain.exit_code == 3, plain
    injected = plain.stdout.count(b"all cases passed")
    print(f"\nwithout exclusive: {injected} injected lines in the judge's stdout")
    exclusive = target.exec(judge, timeout=20, exclusive=True)
    assert (exclusive.exit_code, exclusive.stdout) == (3, b"REAL\n"), exclusive
    assert b"tamper" not in target.exec("cat /proc/[0-9]*/cmdline; true").stdout


# --- processes that outlive their command ---------------------------------------------------
@pytest.mark.attack("a fork bomb outliving its command")
def test_fork_bomb_does_not_outlive_its_command(dsec_sandboxes, witness):
    sb = dsec_sandboxes.create(pids=128)
    # every process forks another every 0.1 s, forever: it fills the pids limit within a
    # second and holds it, so the sandbox could run nothing else if it outlived its command
    r = sb.exec("b() { while :; do b & sleep 0.1; done; }; b & sleep 1.5; echo spawned", timeout=30)
    assert r.stdout.endswith(b"spawned\n"), r
    start = time.monotonic()
    assert sb.exec("echo next").stdout == b"next\n"  # at once, not once the bomb runs dry
    took = time.monotonic() - start
    deadline = time.monotonic() + 3
    while (pids := sb.usage().pids) is None or pids > 2:
        assert time.monotonic() < deadline, f"{pids} processes left after the bomb's exec"
        time.sleep(0.1)
    assert took < 2.0, took
    print(f"\nfork bomb: next exec after {took * 1000:.0f} ms, pids back to {pids}")


# --- the daemon's memory --------------------------------------------------------------------
_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys
    from dsec_core.agent.rpc import AgentClient
    from dsec_core.errors import AgentProtocolError

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    async def main():
        client = AgentClient(sys.argv[1], sandbox_id="forged")
        before = hwm()
        try:
            await client.exec(["true"], max_output=1 << 20, timeout=10)
            outcome = "accepted"
        except AgentProtocolError as e:
            outcome = "refused: " + str(e)
        print(json.dumps({"outcome": outcome, "before_kib": before, "after_kib": hwm()}))

    asyncio.run(main())
    """
)


@pytest.mark.attack("a forged reply claiming a 512 MiB header or body to the daemon's client")
@pytest.mark.parametrize("claim", ["header", "body"])
def test_forged_oversized_reply(target, claim, witness):
    """The sandbox serves a forged agent; the daemon's client (``AgentClient``, in a process
    of its own so its peak memory can be read) is pointed at it and must refuse the reply
    without allocating what it claims."""
    sock = f"/tmp/fake-{claim}.sock"
    target.exec(f"{PROBE} fakeagent {sock} {claim} > /dev/null 2>&1 &", background=True).check()
    host_path = f"/proc/{target.refresh().pid}/root{sock}"
    deadline = time.monotonic() + 5
    while not os.path.exists(host_path):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT, host_path], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["outcome"].startswith("refused"), report
    assert "536870912" in report["outcome"], report
    growth = report["after_kib"] - report["before_kib"]
    print(f"\nforged {claim}: {report['outcome']!r}; client peak RSS grew {growth} KiB")
    assert growth < 8 << 10, report  # KiB: nowhere near the 512 MiB it claimed


def _daemon_cgroup_file(dsec_node, name: str) -> Path:
    return Path("/sys/fs/cgroup/memory") / dsec_node.config.daemon_cgroup / name


@pytest.mark.attack("inflate the daemon with `yes` floods at the largest output cap")
def test_floods_do_not_inflate_the_daemon(dsec_sandboxes, dsec_node, witness):
    if not _daemon_cgroup_file(dsec_node, "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy to read the daemon's usage from")
    limit = int(_daemon_cgroup_file(dsec_node, "memory.limit_in_bytes").read_text())
    assert limit == dsec_node.config.daemon_memory
    _daemon_cgroup_file(dsec_node, "memory.max_usage_in_bytes").write_text("0")
    pid = witness.daemon_pid
    before = _rss_kib(pid)
    sbs = [dsec_sandboxes.create() for _ in range(2)]
    for _ in range(2):  # two rounds of two floods at once, each as big as a call can get
        with cf.ThreadPoolExecutor(2) as pool:
            floods = list(
                pool.map(lambda sb: sb.exec("yes", timeout=3.0, max_output=MAX_OUTPUT), sbs)
            )
        assert all(f.truncated and len(f.stdout) == MAX_OUTPUT for f in floods)
    peak = int(_daemon_cgroup_file(dsec_node, "memory.max_usage_in_bytes").read_text())
    time.sleep(0.5)
    after = _rss_kib(pid)
    print(f"\ndaemon RSS {before >> 10} -> {after >> 10} MiB; cgroup peak {peak >> 20} MiB")
    # the daemon holds a call's capped output while it answers (16 MiB per stream, base64 in
    # the JSON answer), and lets go of it afterwards
    assert peak < limit and peak < 800 << 20, peak
    assert after - before < 128 << 10, (before, after)  # KiB


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.attack("reach the agent from a session shell (ptrace, fds, memory, signals)")
def test_session_shell_cannot_reach_the_agent(target, witness):
    with target.session() as sh:
        shell = sh.exec("echo $$").text.strip()
        assert_refused(sh.exec(f"{PROBE} ptrace 1"), at_least=2)
        assert_refused(sh.exec(f"{PROBE} getfd 1"), at_least=1)
        assert_refused(sh.exec(f"{PROBE} mem 1"), at_least=8)
        fds = sh.exec(f"ls -l /proc/{shell}/fd").text
        assert "socket:" not in fds, fds  # the shell holds pipes of its own, no agent socket
        sh.exec(f"{PROBE} signal 1 TERM INT HUP STOP qTERM")
        assert sh.exec("echo alive").stdout == b"alive\n"
    assert agent_state(target)[0] in ("S", "R")


def test_probe_detects_what_works(target):
    """The probe is no blind reporter: a command may trace its own child, and then it says
    so and exits non-zero, as each attack test would if the agent were reachable."""
    r = target.exec(f"sleep 5 & {PROBE} ptrace $!; s=$?; kill $!; exit $s")
    assert r.exit_code == 2 and list(steps(r.stdout).values()) == ["ok", "ok"], r.text
    r = target.exec(f"sleep 5 & {PROBE} getfd $!; s=$?; kill $!; exit $s")
    assert r.exit_code >= 3, r.text  # its stdin, stdout and stderr at least
    r = target.exec(f"sleep 5 & {PROBE} prlimit $!; s=$?; kill $!; exit $s")
    assert r.exit_code == 1 and steps(r.stdout) == {f"prlimit {r.text.split()[1]} NOFILE 16": "ok"}
    r = target.exec(f"sleep 5 & {PROBE} mem $!; s=$?; kill $!; exit $s")
    seen = steps(r.stdout)
    assert r.exit_code > 5 and seen[next(w for w in seen if w.endswith("/mem rw"))] == "ok"
