"""Preemption-proof rollouts (issue 10, deliverable 4): trajectory logs that a restarted loop
fast-forwards through, the drive socket an agent sandbox drives its worker through, trainer
leases whose lapse pauses the pair, and typed infrastructure events; end to end with real
trainer processes that are killed and replaced."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import dsec
from dsec_core.errors import (
    InvalidSpec,
    LeaseHeld,
    StartTimeout,
    TrajectoryDiverged,
    UnknownLease,
    UnknownSandbox,
)
from dsec_core.node import leases, trajectory
from dsec_core.node.node import Node
from dsec_core.records import ExecResult, SandboxSpec
from dsec_core.testing import node_home, running_kit_node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

BASE = SandboxSpec(layers=("kit-base@1",), memory="64M", disk="64M", ttl=None)

# The agent loop: step i of `steps` asks the worker, through the drive socket, to append a line
# to /ran and wait a little; what the node answers goes to /out.<i>, the count to /progress.
LOOP = r"""
w=$1; steps=$2; i=0
while [ $i -lt $steps ]; do
  printf '{"op":"exec","sandbox":"%s","cmd":"echo step%d >> /ran; sleep 0.2","step":%d}\n' \
    "$w" $i $i | /.dsec/agent drive > /out.$i || exit 1
  i=$((i+1)); echo $i > /progress.new; mv /progress.new /progress
done
echo done > /finished
"""


async def _node(config) -> Node:
    node = Node(config)
    await node.open()
    return node


def drive(node: Node, sid: str, *requests: dict) -> str:
    """The shell line that sends ``requests`` through the bridge in sandbox ``sid``."""
    lines = "".join(json.dumps(r) + "\n" for r in requests)
    return f"printf '%s' '{lines}' | /.dsec/agent drive"


def answers(stdout: bytes) -> list[dict]:
    return [json.loads(line) for line in stdout.decode().splitlines()]


# --- trajectory logs ---------------------------------------------------------------------------


async def test_a_logged_step_is_answered_from_the_log_not_run_again():
    with node_home("dsec-roll-") as config:
        node = await _node(config)
        try:
            w = (await node.create(BASE)).id
            first = await node.exec(w, "echo x >> /ran; wc -l < /ran", trajectory="t", step=0)
            assert first.stdout == b"1\n" and not first.replayed
            again = await node.exec(w, "echo x >> /ran; wc -l < /ran", trajectory="t", step=0)
            assert again.replayed and again.stdout == b"1\n"
            nxt = await node.exec(w, "echo y >> /ran; wc -l < /ran", trajectory="t")  # step 1
            assert nxt.stdout == b"2\n" and not nxt.replayed
            assert (await node.exec(w, "cat /ran")).stdout == b"x\ny\n"  # each ran once
            with pytest.raises(TrajectoryDiverged) as e:
                await node.exec(w, "rm -rf /", trajectory="t", step=1)
            assert e.value.context["logged"] == "echo y >> /ran; wc -l < /ran"
            with pytest.raises(InvalidSpec, match="gap"):
                await node.exec(w, "true", trajectory="t", step=5)
            with pytest.raises(InvalidSpec, match="trajectory"):
                await node.exec(w, "true", trajectory="../etc/passwd")
            with pytest.raises(InvalidSpec, match="step needs a trajectory"):
                await node.exec(w, "true", step=0)
            log = config.home / "trajectories" / "t.jsonl"
            log.write_bytes(log.read_bytes() + b'{"step": 2, "sandb')  # a crash mid-append
        finally:
            await node.close(kill_all=True)
        node = await _node(config)  # a new daemon reads the log from disk
        try:
            w = (await node.create(BASE)).id
            steps = node.trajectories.entries("t")
            assert [s.step for s in steps] == [0, 1] and steps[1].result.stdout == b"2\n"
            r = await node.exec(w, "echo y >> /ran; wc -l < /ran", trajectory="t", step=1)
            assert r.replayed and r.stdout == b"2\n"
            r = await node.exec(w, "echo z", trajectory="t", step=2)  # the cut step runs
            assert not r.replayed and r.stdout == b"z\n"
            assert node.trajectories.remove("t") and not log.exists()
        finally:
            await node.close(kill_all=True)


# --- the drive socket --------------------------------------------------------------------------


async def test_an_agent_sandbox_drives_its_worker_and_nothing_else():
    with node_home("dsec-roll-") as config:
        node = await _node(config)
        try:
            w = (await node.create(BASE)).id
            other = (await node.create(BASE)).id
            a = (await node.create(SandboxSpec(**{**BASE.to_dict(), "drives": [w]}))).id
            step = {"op": "exec", "sandbox": w, "cmd": "echo hi >> /ran; cat /ran", "step": 0}
            r = await node.exec(a, drive(node, a, {"op": "workers"}, step, step))
            workers, ran, replayed = answers(r.stdout)
            assert workers == {"result": [w]}
            assert ran["result"]["exit_code"] == 0 and not ran["result"]["replayed"]
            assert replayed["result"]["replayed"] and replayed["result"]["stdout"] == "aGkK"
            assert (await node.exec(w, "cat /ran")).stdout == b"hi\n"
            # the log is the agent sandbox's own (named by its id), and readable through it
            r = await node.exec(a, drive(node, a, {"op": "trajectory"}))
            assert [e["command"] for e in answers(r.stdout)[0]["result"]] == [step["cmd"]]
            # a sandbox it does not drive, whether it exists or not, is not there for it
            for target in (other, "nosuchsandbox", a):
                r = await node.exec(
                    a, drive(node, a, {"op": "exec", "sandbox": target, "cmd": "touch /x"})
                )
                assert answers(r.stdout)[0]["error"]["type"] == "UnknownSandbox"
            assert (await node.exec(other, "test -e /x")).exit_code == 1
            bad = await node.exec(a, drive(node, a, {"op": "exec", "sandbox": w}, {"op": "x"}))
            assert [x["error"]["type"] for x in answers(bad.stdout)] == ["InvalidSpec"] * 2
            # a worker drives nothing: the socket is not even there for it
            r = await node.exec(w, drive(node, w, {"op": "workers"}))
            assert r.exit_code == 1 and b"cannot reach" in r.stderr
            # nor does it serve the host's processes (their uid is no sandbox's)
            reader, writer = await asyncio.open_unix_connection(node.drive.socket_path)
            writer.write(b'{"op": "workers"}\n')
            assert b"InvalidSpec" in await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            with pytest.raises(UnknownSandbox):
                await node.create(SandboxSpec(**{**BASE.to_dict(), "drives": ["nosuch"]}))
            await node.kill(a)  # its log, named by its id, goes with it
            assert not (config.home / "trajectories" / f"{a}.jsonl").exists()
        finally:
            await node.close(kill_all=True)


# --- leases and infra events -------------------------------------------------------------------


async def test_a_lapsed_lease_pauses_its_sandboxes_and_a_new_one_resumes_them():
    with node_home("dsec-roll-") as config:
        node = await _node(config)
        try:
            w = (await node.create(BASE)).id
            a = (await node.create(SandboxSpec(**{**BASE.to_dict(), "drives": [w]}))).id
            lease = await node.leases.take([w, a], ttl=0.5, holder="trainer-1")
            for _ in range(3):  # renewed in time, it holds
                await asyncio.sleep(0.25)
                await node.leases.renew(lease.id)
            assert node.sandboxes[a].info().state == "running"
            with pytest.raises(LeaseHeld):
                await node.leases.take([a], ttl=1, holder="trainer-2")
            await asyncio.sleep(0.8)  # no renewal: it lapses
            assert node.leases.get(lease.id).state == "lapsed"
            assert {node.sandboxes[s].info().state for s in (w, a)} == {"paused"}
            for sid in (w, a):
                (event,) = node.events(sid)
                assert event.kind == "preempted" and "trainer-1" in event.detail
            new = await node.leases.take([w, a], ttl=5, holder="trainer-2")
            assert {node.sandboxes[s].info().state for s in (w, a)} == {"running"}
            with pytest.raises(UnknownLease):
                node.leases.get(lease.id)  # handed over whole: the old one is gone
            await node.kill(w)
            assert node.leases.get(new.id).sandboxes == (a,)
            released = await node.leases.release(new.id)
            assert released.sandboxes == (a,) and node.sandboxes[a].info().state == "running"
            with pytest.raises(InvalidSpec, match="ttl"):
                await node.leases.take([a], ttl=0)
        finally:
            await node.close(kill_all=True)


async def test_infrastructure_failures_are_typed_events():
    with node_home("dsec-roll-") as config:
        node = await _node(config)
        try:
            sid = (await node.create(BASE)).id
            r = await node.exec(sid, "dd if=/dev/zero of=/dev/null bs=100M count=1")
            assert r.exit_code != 0 and r.oom_killed
            (event,) = node.events(sid)
            assert event.kind == "out_of_memory"
            ok = await node.exec(sid, "false")  # the task's own failure is no infra event
            assert not ok.oom_killed and len(node.events(sid)) == 1
            with pytest.raises(StartTimeout):
                await node.create(SandboxSpec(**{**BASE.to_dict(), "start_timeout": 1e-6}))
            assert list(node.sandboxes) == [sid]  # the slow one was killed, nothing is left
        finally:
            await node.close(kill_all=True)


# --- end to end: a trainer dies, another takes over ----------------------------------------------


TRAINER_A = """
import sys, time, dsec
c = dsec.Client(sys.argv[1])
w = c.create(layers=["kit-base@1"], memory="64M", ttl=None)
a = c.create(layers=["kit-base@1"], memory="64M", ttl=None, drives=[w.id], trajectory=sys.argv[2])
lease = c.lease([a.id, w.id], ttl=1.0, holder="trainer-a")
c.write_file(a.id, "/loop.sh", sys.stdin.read().encode())
c.exec(a.id, f"sh /loop.sh {w.id} 8 >/dev/null 2>&1 &", background=True)
print(a.id, w.id, flush=True)
time.sleep(120)
"""

TRAINER_B = """
import sys, time, dsec
c = dsec.Client(sys.argv[1])
a, w = sys.argv[2], sys.argv[3]
with c.lease([a, w], ttl=5.0, holder="trainer-b"):
    while c.exec(a, "cat /finished 2>/dev/null").stdout != b"done\\n":
        time.sleep(0.1)
print("finished", flush=True)
"""


def _state(client: dsec.Client, sid: str) -> str:
    return client.get(sid).info.state


def test_a_preempted_trainer_s_pair_pauses_and_a_new_trainer_completes_the_loop():
    with running_kit_node("dsec-roll-") as kit, kit.client() as client:
        address = os.fspath(kit.config.socket_path)
        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER_A, address, "rollout-7"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert trainer.stdin and trainer.stdout
        trainer.stdin.write(LOOP)
        trainer.stdin.close()
        a, w = trainer.stdout.readline().split()
        rootfs = kit.config.runtime_dir / a / "rootfs"
        deadline = time.monotonic() + 30
        while not (rootfs / "progress").exists() or int((rootfs / "progress").read_text()) < 2:
            assert time.monotonic() < deadline and trainer.poll() is None
            time.sleep(0.05)
        trainer.send_signal(signal.SIGKILL)  # the preemption
        trainer.wait()
        deadline = time.monotonic() + 10
        while {_state(client, a), _state(client, w)} != {"paused"}:
            assert time.monotonic() < deadline, "the pair did not pause"
            time.sleep(0.1)
        for sid in (a, w):
            assert [e.kind for e in client.events(sid)] == ["preempted"]
        at = int((rootfs / "progress").read_text())
        time.sleep(0.6)
        assert int((rootfs / "progress").read_text()) == at < 8  # paused: the loop stands
        done = subprocess.run(
            [sys.executable, "-c", TRAINER_B, address, a, w],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.stdout.strip() == "finished", done.stderr
        ran = client.exec(w, "cat /ran").stdout.decode().split()
        assert ran == [f"step{i}" for i in range(8)]  # each once, in order
        log = client.trajectory("rollout-7")
        assert [e.step for e in log] == list(range(8)) and not any(e.result.replayed for e in log)
        # a loop restarted from its first step (in the same sandbox here) fast-forwards:
        # the eight logged steps come back from the log, and only the ninth runs
        r = client.exec(a, f"rm /finished; sh /loop.sh {w} 9 && cat /out.0 /out.7 /out.8")
        assert r.exit_code == 0, r.stderr
        out = [json.loads(line)["result"] for line in r.stdout.decode().splitlines()]
        assert [o["replayed"] for o in out] == [True, True, False]
        assert client.exec(w, "cat /ran").stdout.decode().split() == [f"step{i}" for i in range(9)]
        client.remove_trajectory("rollout-7")
        for sid in (a, w):
            client.kill(sid)


def test_lease_through_the_sdk_and_its_typed_errors(dsec_client):
    sb = dsec_client.create(layers=["kit-base@1"], memory="64M")
    try:
        with dsec_client.lease(sb.id, ttl=0.6, holder="sdk") as lease:
            time.sleep(1.5)  # its thread renews it
            assert dsec_client.get(sb.id).info.state == "running"
            assert dsec_client.lease_get(lease.id).state == "held"
            with pytest.raises(LeaseHeld):
                dsec_client.lease(sb.id, renew=False)
        with pytest.raises(UnknownLease):
            dsec_client.lease_get(lease.id)
        lease = dsec_client.lease([sb.id], ttl=0.3, renew=False)
        time.sleep(1.0)
        assert dsec_client.get(sb.id).info.state == "paused"
        assert dsec_client.lease_renew(lease.id).state == "held"  # a slow trainer is back
        assert dsec_client.get(sb.id).info.state == "running"
        lease.release()
        # a node that forgot a lease (a restart): renewing takes it again, as it was asked for
        lease = dsec_client.lease([sb.id], ttl=5, reclaim=True, renew=False)
        first = lease.id
        dsec_client.lease_release(first)
        again = lease.renew()
        assert again.id != first and again.reclaim and again.sandboxes == (sb.id,)
        lease.release(kill=True)
        with pytest.raises(UnknownSandbox):
            dsec_client.get(sb.id)
    finally:
        with pytest.raises(UnknownSandbox):
            dsec_client.kill(sb.id)
    with pytest.raises(InvalidSpec):
        dsec_client.trajectory("../x")
    with pytest.raises(dsec.DsecError):
        dsec_client.remove_trajectory("never-made")


def test_events_and_trajectories_through_the_cli(dsec_client, dsec_node):
    env = dict(os.environ, DSEC_HOME=os.fspath(dsec_node.home))

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [sys.executable, "-m", "dsec_core.cli", *args], env=env, capture_output=True, text=True
        )
        assert (out.returncode == 0) == ok, out
        return out

    with dsec_client.create(layers=(dsec_node.layer.ref,), memory="64M", disk="64M") as sb:
        sb.exec("dd if=/dev/zero of=/dev/null bs=100M count=1")
        sb.exec("echo one", trajectory="cli-traj")
        sb.exec("exit 4", trajectory="cli-traj")
        assert "out_of_memory" in run("sandbox", "events", sb.id).stdout
        (event,) = [
            json.loads(x) for x in run("sandbox", "events", sb.id, "--json").stdout.split("\n") if x
        ]
        assert event["kind"] == "out_of_memory" and event["sandbox_id"] == sb.id
    lines = run("trajectory", "show", "cli-traj").stdout.splitlines()
    assert len(lines) == 2 and "exit 4" in lines[1] and lines[0].endswith("echo one")
    rows = [
        json.loads(x) for x in run("trajectory", "show", "cli-traj", "--json").stdout.splitlines()
    ]
    assert [(r["step"], r["stdout"], r["exit_code"]) for r in rows] == [(0, "one\n", 0), (1, "", 4)]
    assert run("trajectory", "rm", "cli-traj").stdout.strip() == "removed cli-traj"
    assert run("trajectory", "rm", "cli-traj", ok=False).stderr.startswith("Error: ")


async def test_a_takeover_after_a_daemon_restart_resumes_what_the_lapse_paused():
    with node_home("dsec-roll-") as config:
        node = await _node(config)
        try:
            w = (await node.create(BASE)).id
            own = (await node.create(BASE)).id
            await node.pause(own)  # its trainer paused this one itself
            await node.leases.take([w, own], ttl=0.3, holder="trainer-1")
            await asyncio.sleep(0.8)
            assert node.sandboxes[w].info().state == "paused"
            assert [e.kind for e in node.events(w)] == ["preempted"] and not node.events(own)
            await node.close()  # the daemon goes; the sandboxes stay, paused
            node = await _node(config)  # a new daemon knows no lease
            assert node.sandboxes[w].preempted and not node.sandboxes[own].preempted
            await node.leases.take([w, own], ttl=5, holder="trainer-2")
            assert node.sandboxes[w].info().state == "running"
            assert node.sandboxes[own].info().state == "paused"  # left as its trainer left it
            assert (await node.exec(w, "echo on")).stdout == b"on\n"
        finally:
            await node.close(kill_all=True)


async def test_an_async_lease_renews_from_a_task(dsec_node):
    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:
        sb = await client.create(layers=["kit-base@1"], memory="64M")
        try:
            async with await client.lease(sb.id, ttl=0.5, holder="async") as lease:
                await asyncio.sleep(1.2)
                assert (await client.get(sb.id)).info.state == "running"
                assert (await client.lease_get(lease.id)).state == "held"
            with pytest.raises(UnknownLease):
                await client.lease_get(lease.id)
        finally:
            await client.kill(sb.id)


async def test_trajectories_beyond_the_cache_are_read_back_from_their_files(tmp_path, monkeypatch):
    monkeypatch.setattr(trajectory, "CACHED", 1)
    logs = trajectory.TrajectoryLogs(tmp_path)
    ran: list[str] = []

    def execute(name: str):
        async def run() -> ExecResult:
            ran.append(name)
            return ExecResult(0, name.encode(), b"", 0.01, command="c")

        return run

    for name in ("a", "b", "a", "b"):  # each pushes the other out of the cache
        r = await logs.run(name, 0, "sb", "c", execute(name))
        assert r.stdout == name.encode()
    assert ran == ["a", "b"]  # the second time, from the files
    assert len(logs._entries) == 1


async def test_a_lease_lapses_on_time_whatever_the_wall_clock_does(monkeypatch):
    # The lapse once compared time.time() to the expiry: a timer the loop ran a hair early,
    # or a wall clock stepped back, made it believe in a renewal and never lapse.
    with node_home("dsec-roll-") as config:
        node = await _node(config)
        try:
            sid = (await node.create(BASE)).id
            lease = await node.leases.take([sid], ttl=0.3)
            real = time.time
            monkeypatch.setattr(leases.time, "time", lambda: real() - 3600)  # stepped back
            await asyncio.sleep(0.8)
            assert node.leases.get(lease.id).state == "lapsed"
            assert node.sandboxes[sid].info().state == "paused"
        finally:
            await node.close(kill_all=True)


def test_a_step_a_dead_daemon_was_running_is_never_run_again():
    """Found by the chaos soak: a daemon killed while a trajectory step ran left no entry, so
    the step sent again ran a second time (its line twice in the sandbox's file). The step is
    marked before it runs: sent again, it is StepInterrupted (masked as node_lost), and the
    command has run once."""
    from dsec_core.localnode import daemon_pid, ensure_daemon
    from dsec_core.rl import infra_event
    from dsec_core.testing import until

    with running_kit_node("dsec-step-") as node, node.client() as c:
        sb = c.create(layers=(node.layer.ref,), memory="64M")
        assert c.exec(sb.id, "echo 0 >> /ran", trajectory="walk", step=0).exit_code == 0
        outcome: list[object] = []

        def step_1() -> None:
            try:
                outcome.append(c.exec(sb.id, "echo 1 >> /ran; sleep 30", trajectory="walk", step=1))
            except dsec.DsecError as e:
                outcome.append(e)

        runner = threading.Thread(target=step_1)
        runner.start()
        with node.client() as other:
            until(lambda: other.exec(sb.id, "cat /ran").stdout == b"0\n1\n", timeout=10)
        pid = daemon_pid(node.config)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        runner.join(timeout=30)
        assert isinstance(outcome[0], dsec.NodeUnavailable), outcome
        until(lambda: daemon_pid(node.config) is None, timeout=10)
        ensure_daemon(node.config)
        with node.client() as again:
            for _ in range(2):  # and again: it stays interrupted
                with pytest.raises(dsec.StepInterrupted) as e:
                    again.exec(sb.id, "echo 1 >> /ran; sleep 30", trajectory="walk", step=1)
                assert e.value.context["step"] == 1
                assert infra_event(e.value).kind == "node_lost"
            assert again.exec(sb.id, "cat /ran").stdout == b"0\n1\n"  # once
            # the step before is still answered from the log
            assert again.exec(sb.id, "echo 0 >> /ran", trajectory="walk", step=0).replayed
            again.remove_trajectory("walk")
            again.kill(sb.id)
