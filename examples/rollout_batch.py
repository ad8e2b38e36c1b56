#!/usr/bin/env python3
"""A batch of RL episodes with dsec.rollout, a scripted policy standing in for the model (there
is no GPU here): a concurrency limit, a progress bar, rewards per episode, infrastructure
failures masked and retried, a fork tree, and the results as JSON lines.

    python examples/rollout_batch.py [--episodes 24] [--concurrency 8]

It starts a node daemon of its own in a temporary DSEC_HOME with a busybox base layer, and
removes everything when it ends.

1. A batch: the task is to write the number a hint file gives into /answer. Each episode's
   environment writes its hint (42, or 7 for every fourth episode, whose policy then answers
   wrong); the policy reads it, answers and submits. One episode's first attempt runs out of
   memory: the runner masks it and runs the episode again in a fresh sandbox.
2. A fork tree: each episode runs two steps, then forks into three branches (one pack_diff;
   each branch restored when it has a slot), and each branch tries another answer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import dsec
import dsec.rollout
from dsec.rl import SandboxEnv, command_reward
from dsec_core.config import NodeConfig
from dsec_core.layers.store import LayerStore
from dsec_core.localnode import ensure_daemon, stop_daemon
from dsec_core.testing import build_busybox_layer

FIELDS = {"layers": ["kit-base@1"], "memory": "64M", "disk": "64M"}
REWARD = command_reward("grep -qx 42 /answer")


def batch(client: dsec.Client, episodes: int, concurrency: int, out: Path) -> None:
    print("== 1. a batch of episodes")

    def hint_task(index: int) -> tuple[SandboxEnv, Any]:
        """Episode ``index``'s environment and policy (the table names the task after it)."""
        hint = 7 if index % 4 == 3 else 42

        def policy(observation: str, info: dict[str, Any]) -> str:
            if info["step"] == 0:
                if index == 1 and info["attempt"] == 1:  # a command killed for memory
                    return "dd if=/dev/zero of=/dev/null bs=100M count=1"
                return f"echo {hint} > /hint && cat /hint"
            if info["step"] == 1:
                return f"echo {observation.strip()} > /answer && echo answered"
            return "submit"

        return SandboxEnv(client, reward=REWARD, max_steps=5, **FIELDS), policy

    report = dsec.rollout.run(
        client, episodes, env_factory=hint_task, concurrency=concurrency, out=out, seed=0
    )
    s = report.summary
    print(
        f"   {s['episodes']} episodes: {s['ok']} ok, {s['masked']} masked, {s['retried']} "
        f"retried; mean reward {s['mean_reward']:.3f}; {len(out.read_text().splitlines())} "
        f"lines in {out.name}"
    )
    for r in report.failed:  # the task's or the policy's own error, not the platform's
        print(f"   episode {r.index} failed: {r.error_type}: {r.error}")
    retried = [r for r in report.results if r.attempts > 1]
    for r in retried:
        print(f"   episode {r.index}: {r.infra} on attempt 1, {r.status} on attempt {r.attempts}")


def fork_tree(client: dsec.Client) -> None:
    print("== 2. a fork tree: 2 steps, then 3 branches")

    def guess_task(index: int) -> tuple[SandboxEnv, Any]:
        def policy(observation: str, info: dict[str, Any]) -> str:
            if info["branch"] is None:  # the trunk, before the fork
                return ("echo 42 > /hint", "seq 1 1000 > /work.state")[info["step"]]
            if "guessed" not in observation:
                return f"echo {41 + info['branch']} > /answer && echo guessed"
            return "submit"

        return SandboxEnv(client, reward=REWARD, **FIELDS), policy

    report = dsec.rollout.run(
        client, 2, env_factory=guess_task, fork_at=2, n=3, concurrency=4, progress=False
    )
    for r in report.results:
        print(f"   episode {r.index} branch {r.branch} (from {r.parent}): reward {r.reward}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dsec-example-"))
    print(f"node home: {home}", flush=True)
    config = NodeConfig(home=home)
    os.environ["DSEC_HOME"] = os.fspath(home)
    try:
        config.ensure_dirs()
        build_busybox_layer(LayerStore(config.layer_dir))
        ensure_daemon(config)
        with dsec.Client(os.fspath(config.socket_path)) as client:
            try:
                batch(client, args.episodes, args.concurrency, home / "results.jsonl")
                fork_tree(client)
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
