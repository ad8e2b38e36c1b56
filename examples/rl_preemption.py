#!/usr/bin/env python3
"""A trainer's view of dsec.rl, with a scripted policy (there is no GPU here): episodes in a
gymnasium environment, a fork of an episode into branches, and a rollout that survives the
preemption of its trainer.

    python examples/rl_preemption.py

It starts a node daemon of its own in a temporary DSEC_HOME with a busybox base layer, and
removes everything when it ends.

1. Episodes: the task is to write the number a hint file gives into /answer. The policy reads
   the hint, writes the answer and submits; the reward function checks /answer.
2. Forking: after two steps, the episode forks into three branches (one pack_diff, three
   restores); each branch tries another answer from the same state.
3. Preemption: a trainer process owns an agent sandbox and a worker. A loop in the agent
   sandbox drives the worker through the drive socket, step by step. The trainer is killed
   (SIGKILL) mid-loop: its lease lapses and the node pauses both sandboxes, with a "preempted"
   event on each. A second trainer takes the lease over: the pair resumes and the loop
   completes. The trajectory log shows every command ran once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dsec
from dsec.rl import SandboxEnv, command_reward
from dsec_core.config import NodeConfig
from dsec_core.layers.store import LayerStore
from dsec_core.localnode import ensure_daemon, stop_daemon
from dsec_core.testing import build_busybox_layer

FIELDS = {"layers": ["kit-base@1"], "memory": "64M", "disk": "64M"}
STEPS = 8
# The agent loop, in the agent sandbox: each step asks the worker (through the node's drive
# socket and the agent's bridge) to do a slice of work, and records how far it got.
LOOP = r"""
w=$1; i=0
while [ $i -lt STEPS ]; do
  printf '{"op":"exec","sandbox":"%s","cmd":"echo part%d >> /build.log; sleep 0.3","step":%d}\n' \
    "$w" $i $i | /.dsec/agent drive > /dev/null || exit 1
  i=$((i+1)); echo $i > /progress
done
echo done > /finished
""".replace("STEPS", str(STEPS))


def policy(observation: str, hint: int | None) -> str:
    """The scripted policy: read the hint, then answer it, then submit."""
    if hint is None:
        return "cat /hint"
    if "answered" not in observation:
        return f"echo {hint} > /answer && echo answered"
    return "submit"


def episodes(client: dsec.Client) -> None:
    print("== 1. episodes")
    env = SandboxEnv(client, reward=command_reward("grep -qx 42 /answer"), max_steps=6, **FIELDS)
    try:
        for episode in range(2):
            obs, info = env.reset()
            env.step("echo 42 > /hint" if episode == 0 else "echo 7 > /hint")
            hint = None
            while True:
                action = policy(obs, hint)
                obs, reward, terminated, truncated, info = env.step(action)
                print(f"   episode {episode} step {info['step']}: {action!r} -> {obs.strip()!r}")
                if action == "cat /hint":
                    hint = int(obs)
                if terminated or truncated:
                    print(f"   episode {episode}: reward {reward}")
                    break
    finally:
        env.close()


def forking(client: dsec.Client) -> None:
    print("== 2. forking an episode into branches")
    env = SandboxEnv(client, reward=command_reward("grep -qx 42 /answer"), **FIELDS)
    branches: list[SandboxEnv] = []
    try:
        env.reset()
        env.step("echo 42 > /hint")
        env.step("mkdir -p /work && seq 1 1000 > /work/state")  # the expensive part, say
        t0 = time.perf_counter()
        branches = env.fork(3)
        print(f"   forked into 3 in {time.perf_counter() - t0:.2f}s")
        for guess, branch in zip((41, 42, 43), branches, strict=True):
            branch.step(f"echo {guess} > /answer")
            state = branch.step("wc -l < /work/state")[0].strip()
            _, reward, *_ = branch.step("submit")  # the episode ends here
            print(f"   branch {branch.sandbox_id}: guessed {guess}, reward {reward}, state {state}")
    finally:
        for branch in branches:
            branch.close()
        env.close()


def trainer(address: str, trajectory: str) -> None:
    """The first trainer (run as its own process): the pair, the lease, the loop."""
    client = dsec.Client(address)
    worker = client.create(**FIELDS, ttl=None)
    agent = client.create(**FIELDS, ttl=None, drives=[worker.id], trajectory=trajectory)
    client.lease([agent.id, worker.id], ttl=1.0, holder="trainer-1")
    client.write_file(agent.id, "/loop.sh", LOOP.encode())
    client.exec(agent.id, f"sh /loop.sh {worker.id} >/dev/null 2>&1 &", background=True)
    print(agent.id, worker.id, flush=True)
    time.sleep(3600)  # training... until the preemption


def wait_for(what: str, ready, timeout: float = 60.0) -> None:
    """Poll ``ready()`` until it is true; RuntimeError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def preemption(client: dsec.Client, address: str) -> None:
    print("== 3. a rollout that survives its trainer's preemption")
    first = subprocess.Popen(
        [sys.executable, __file__, "--trainer", address, "example-rollout"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert first.stdout is not None
    line = first.stdout.readline()
    if not line:
        raise RuntimeError(f"trainer-1 exited ({first.wait()}) before it started the loop")
    agent, worker = line.split()
    progress = lambda: client.exec(agent, "cat /progress 2>/dev/null || echo 0").text.strip()  # noqa: E731
    wait_for("the loop's third step", lambda: int(progress()) >= 3)
    print(f"   trainer-1 (pid {first.pid}) is at step {progress()}: preempting it (SIGKILL)")
    first.send_signal(signal.SIGKILL)
    first.wait()
    states = lambda: {client.get(agent).info.state, client.get(worker).info.state}  # noqa: E731
    wait_for("the pair to pause", lambda: states() == {"paused"})
    for sid in (agent, worker):
        (event,) = client.events(sid)
        print(f"   {sid}: {client.get(sid).info.state}, event {event.kind}: {event.detail}")
    print("   trainer-2 takes the lease over")
    with client.lease([agent, worker], ttl=5.0, holder="trainer-2"):
        print(f"   resumed: {client.get(agent).info.state}, {client.get(worker).info.state}")
        finished = lambda: client.exec(agent, "cat /finished 2>/dev/null").text == "done\n"  # noqa: E731
        wait_for("the loop to complete", finished)
    ran = client.exec(worker, "cat /build.log").text.split()
    log = client.trajectory("example-rollout")
    print(f"   the loop completed: {len(log)} steps logged, the worker ran {len(ran)} parts")
    assert ran == [f"part{i}" for i in range(STEPS)], ran  # each once, in order
    client.remove_trajectory("example-rollout")
    for sid in (agent, worker):
        client.kill(sid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", nargs=2, metavar=("ADDRESS", "TRAJECTORY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer:
        trainer(*args.trainer)
        return
    home = Path(tempfile.mkdtemp(prefix="dsec-example-"))
    print(f"node home: {home}", flush=True)
    config = NodeConfig(home=home)
    os.environ["DSEC_HOME"] = os.fspath(home)
    try:
        config.ensure_dirs()
        build_busybox_layer(LayerStore(config.layer_dir))
        ensure_daemon(config)
        address = os.fspath(config.socket_path)
        with dsec.Client(address) as client:
            try:
                episodes(client)
                forking(client)
                preemption(client, address)
            except Exception:
                if config.log_path.exists():  # what the node saw, for the report
                    tail = config.log_path.read_text().splitlines()[-40:]
                    print("node log:", *tail, sep="\n", file=sys.stderr)
                raise
            finally:
                for info in client.list():
                    client.kill(info.id)
    finally:
        stop_daemon(config)
        shutil.rmtree(home, ignore_errors=True)
    print("done")


if __name__ == "__main__":
    main()
