"""dsec.rollout (issue 22, deliverable 2): the batch runner against a real kit node, on both
client twins: the concurrency limit, rewards per episode, infrastructure failures masked and
retried in fresh sandboxes (an out-of-memory kill, a sandbox killed from outside), retries run
out (masked, never scored), task errors (failed), fork trees, and the JSONL file."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

import dsec
import dsec.rollout
from dsec.rl import AsyncSandboxEnv, SandboxEnv, command_reward
from dsec_core.catalog.model import Task, load_catalog
from dsec_core.catalog.store import CatalogStore
from dsec_core.errors import InvalidSpec
from dsec_core.layers.store import LayerStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

FIELDS = {"layers": ["kit-base@1"], "memory": "64M", "disk": "64M"}
OOM = "dd if=/dev/zero of=/dev/null bs=100M count=1"


@pytest.fixture(scope="module")
def box(dsec_node) -> str:
    """A catalog environment of the kit's busybox base, for catalog tasks."""
    return dsec_node.environment("rollout-box")


def live(client: dsec.Client) -> set[str]:
    return {i.id for i in client.list()}


def test_catalog_tasks_are_scored_per_episode_within_the_limit_and_written_as_jsonl(
    dsec_client, box, tmp_path
):
    tasks = [
        Task(name="passes", environment=box, command="sleep 0.4; test -d /proc"),
        Task(name="fails", environment=box, command="sleep 0.4; exit 3"),
    ]
    before = live(dsec_client)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # how many sandboxes the rollout holds at once, from the node
        with dsec.Client(dsec_client.address) as c:
            while not stop.is_set():
                seen.append(len(live(c) - before))
                time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out = tmp_path / "results.jsonl"
    console = Console(file=io.StringIO(), width=120, record=True)
    try:
        report = dsec.rollout.run(
            dsec_client, 8, tasks=tasks, concurrency=3, out=out, console=console
        )
    finally:
        stop.set()
        watcher.join()
    assert 1 < max(seen) <= 3, seen
    assert [(r.index, r.task, r.reward, r.status) for r in report.results] == [
        (i, ("passes", "fails")[i % 2], (1.0, 0.0)[i % 2], "ok") for i in range(8)
    ]
    assert all(
        r.outcome == ("0", "3")[r.index % 2] and len(r.sandboxes) == 1 for r in report.results
    )
    assert all(r.backend == "container" and r.attempts == 1 for r in report.results)
    assert live(dsec_client) == before  # every sandbox killed
    # one JSON line per episode, nothing else, the same as the report
    lines = out.read_text().splitlines()
    assert len(lines) == 8 and all(json.loads(line)["index"] in range(8) for line in lines)
    assert sorted(dsec.rollout.read_jsonl(out), key=lambda r: r.index) == list(report.results)
    summary = report.summary
    assert (summary["episodes"], summary["ok"], summary["failed"], summary["masked"]) == (
        8,
        8,
        0,
        0,
    )
    assert summary["mean_reward"] == 0.5 and summary["tasks"]["passes"]["mean_reward"] == 1.0
    text = console.export_text()
    assert "dsec rollout: 8 episodes" in text and "passes" in text and "0.500" in text
    assert "ok 8" in text  # the bar's last state


async def test_an_async_episode_function_runs_at_most_concurrency_at_once(dsec_node):
    running, most = 0, 0

    async def episode(client: dsec.AsyncClient, index: int) -> float:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            async with await client.create(**FIELDS) as sb:
                await sb.exec("sleep 0.2")
        finally:
            running -= 1
        return index / 10

    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:
        report = await dsec.rollout.arun(client, 10, episode=episode, concurrency=4, progress=False)
    assert most == 4
    assert report.rewards == [i / 10 for i in range(10)]
    assert {r.task for r in report.results} == {"episode"}


def _answer_policy(address: str, fail: dict[int, str]):
    """Writes 42 and submits; on the first attempt of the episodes in ``fail`` it first does
    what that says: ``oom`` (a command killed for memory) or ``kill`` (the sandbox's init
    killed from outside)."""

    def policy(observation: str, info: dict) -> str:
        if info["step"] == 0 and info["attempt"] == 1 and info["episode"] in fail:
            if fail[info["episode"]] == "kill":
                with dsec.Client(address) as c:
                    os.kill(c.get(info["sandbox_id"]).info.pid, signal.SIGKILL)
                time.sleep(1.5)  # the node notices the death
                return "echo still here"
            return OOM
        if "answered" not in observation:
            return "echo 42 > /answer && echo answered"
        return "submit"

    return policy


def test_infrastructure_failures_are_masked_and_retried_in_fresh_sandboxes(dsec_client):
    before = live(dsec_client)
    made: list[int] = []

    def factory(index: int):
        made.append(index)
        env = SandboxEnv(dsec_client, reward=command_reward("grep -qx 42 /answer"), **FIELDS)
        always = index == 3  # never gets through: masked once its retries run out
        policy = _answer_policy(dsec_client.address, {0: "oom", 1: "kill"})
        return env, (lambda obs, info: OOM) if always else policy

    report = dsec.rollout.run(dsec_client, 4, env_factory=factory, retries=1, progress=False)
    r0, r1, r2, r3 = report.results
    assert (r0.status, r0.attempts, r0.infra, r0.reward) == ("ok", 2, "out_of_memory", 1.0)
    assert (r1.status, r1.attempts, r1.infra, r1.reward) == ("ok", 2, "crashed", 1.0)
    assert (r2.status, r2.attempts, r2.infra, r2.reward, r2.steps) == ("ok", 1, None, 1.0, 2)
    assert (r3.status, r3.attempts, r3.infra, r3.reward) == ("masked", 2, "out_of_memory", None)
    for r in (r0, r1, r3):
        assert len(set(r.sandboxes)) == 2  # a fresh sandbox for the retry
    assert sorted(made) == [0, 0, 1, 1, 2, 3, 3]  # the factory made each attempt's env
    assert report.rewards == [1.0, 1.0, 1.0] and report.summary["masked"] == 1
    assert report.summary["mean_reward"] == 1.0  # the masked one is not scored zero
    assert report.summary["retried"] == 3
    assert live(dsec_client) == before


async def test_task_and_caller_errors_fail_the_episode_unretried(dsec_node, box):
    calls: list[int] = []

    async def episode(client, index: int) -> float:
        calls.append(index)
        if index == 1:
            raise ValueError("the policy crashed")
        if index == 2:
            raise dsec.SandboxPaused("paused", sandbox_id="x")  # infra: retried, then masked
        return 1.0

    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:
        report = await dsec.rollout.arun(client, 3, episode=episode, retries=2, progress=False)
        ok, failed, masked = report.results
        assert ok.status == "ok" and ok.reward == 1.0
        assert (failed.status, failed.attempts, failed.reward) == ("failed", 1, None)
        assert failed.error_type == "ValueError" and failed.error == "the policy crashed"
        assert (masked.status, masked.attempts, masked.infra) == ("masked", 3, "preempted")
        assert sorted(calls) == [0, 1, 2, 2, 2]
        missing = Task(name="nowhere", environment="no-such-environment", command="true")
        report = await dsec.rollout.arun(client, tasks=[missing], progress=False)
        (r,) = report.results
        assert (r.status, r.error_type, r.attempts) == ("failed", "UnknownEnvironment", 1)
        assert report.summary["failed"] == 1 and report.mean_reward is None
        with pytest.raises(InvalidSpec, match="one of them"):
            await dsec.rollout.arun(client, 1, tasks=[missing], episode=episode)
        with pytest.raises(InvalidSpec, match="env_factory"):
            await dsec.rollout.arun(client, 1, episode=episode, fork_at=1, n=2)
        with pytest.raises(InvalidSpec, match="concurrency"):
            await dsec.rollout.arun(client, 1, episode=episode, concurrency=0)
        with pytest.raises(InvalidSpec, match="episodes"):
            await dsec.rollout.arun(client, episode=episode)


async def test_a_fork_tree_gives_n_branch_results_linked_to_their_parent(dsec_node):
    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:
        before = {i.id for i in await client.list()}

        def factory(index: int):
            env = AsyncSandboxEnv(client, reward=command_reward("grep -qx 42 /answer"), **FIELDS)

            async def policy(observation: str, info: dict) -> str:
                if info["branch"] is None:  # the trunk: two steps before the fork
                    return ("echo 40 > /answer", "seq 1 100 > /state")[info["step"]]
                if "wrote" not in observation:
                    return f"wc -l < /state >&2; echo 4{info['branch'] + 1} > /answer; echo wrote"
                return "submit"

            return env, policy

        report = await dsec.rollout.arun(
            client, 2, env_factory=factory, fork_at=2, n=3, concurrency=2, progress=False
        )
        assert len(report.results) == 6
        assert [(r.index, r.branch, r.reward) for r in report.results] == [
            (i, j, (0.0, 1.0, 0.0)[j]) for i in range(2) for j in range(3)
        ]
        parents = {r.index: r.parent for r in report.results}
        assert len(set(parents.values())) == 2 and None not in parents.values()
        for r in report.results:
            assert r.status == "ok" and r.steps == 4 and len(r.sandboxes) == 1
            assert r.sandboxes[0] != r.parent
        assert {i.id for i in await client.list()} == before  # trunks and branches gone


def test_a_branch_masked_after_the_fork_is_retried_from_the_fork_point(dsec_client):
    def factory(index: int):
        env = SandboxEnv(dsec_client, reward=command_reward("grep -qx 42 /answer"), **FIELDS)

        def policy(observation: str, info: dict) -> str:
            if info["branch"] is None:
                return "echo 42 > /answer"
            if info["branch"] == 1 and info["attempt"] == 1:
                return OOM
            return "submit"

        return env, policy

    report = dsec.rollout.run(dsec_client, 1, env_factory=factory, fork_at=1, n=2, progress=False)
    b0, b1 = report.results
    assert (b0.attempts, b0.reward) == (1, 1.0)
    assert (b1.attempts, b1.infra, b1.reward, b1.status) == (2, "out_of_memory", 1.0, "ok")
    assert b0.parent == b1.parent and len(set(b1.sandboxes)) == 2


def test_run_works_from_inside_an_event_loop(dsec_client):
    async def inside() -> dsec.rollout.RolloutReport:
        return dsec.rollout.run(dsec_client, 2, episode=lambda c, i: 0.5, progress=False)

    report = asyncio.run(inside())
    assert report.rewards == [0.5, 0.5]


def test_the_cli_runs_a_rollout_and_prints_its_table(dsec_node, box, tmp_path):
    catalog = tmp_path / "tasks.yaml"
    catalog.write_text(
        "name: rollout-cli\n"
        f"environments: [{{name: cli-box, base: {dsec_node.layer.ref}}}]\n"
        "tasks:\n"
        "  - {name: good, environment: cli-box, command: 'true', reward: exit_code}\n"
        "  - {name: bad, environment: cli-box, command: 'false', reward: exit_code}\n"
    )
    # registered on the node, as `dsec catalog add` would
    CatalogStore(dsec_node.config.catalog_dir).save(
        load_catalog(catalog, store=LayerStore(dsec_node.config.layer_dir))
    )
    out = tmp_path / "r.jsonl"
    env = dict(os.environ, DSEC_HOME=os.fspath(dsec_node.home))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsec_core.cli",
            "rollout",
            "--episodes",
            "6",
            "--concurrency",
            "3",
            "--catalog",
            os.fspath(catalog),
            "--out",
            os.fspath(out),
            "--address",
            os.fspath(dsec_node.config.socket_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "dsec rollout: 6 episodes" in run.stdout and "0.500" in run.stdout, run.stdout
    assert len(Path(out).read_text().splitlines()) == 6
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsec_core.cli",
            "rollout",
            "--tasks",
            "nosuchtask",
            "--address",
            os.fspath(dsec_node.config.socket_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("Error: no task nosuchtask")


def test_rollout_imports_without_the_server_or_gymnasium():
    probe = (
        "import sys, dsec.rollout\n"
        "heavy = ('starlette', 'uvicorn', 'qemu', 'python_on_whales', 'gymnasium', 'numpy',\n"
        "         'dsec_core.node', 'dsec_core.apiserver', 'dsec_core.demo', 'dsec_core.catalog',\n"
        "         'yaml', 'jsonschema', 'zstandard')\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_episode_results_refuse_what_they_cannot_be():
    with pytest.raises(InvalidSpec, match="status"):
        dsec.rollout.EpisodeResult(0, "t", None, "lost")  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec, match="unknown"):
        dsec.rollout.EpisodeResult.from_dict(
            {"index": 0, "task": "t", "reward": 1.0, "status": "ok", "colour": "red"}
        )


def test_the_example_runs_a_batch_with_a_masked_retry_and_a_fork_tree():
    example = Path(__file__).parent.parent / "examples" / "rollout_batch.py"
    out = subprocess.run(
        [sys.executable, os.fspath(example), "--episodes", "8", "--concurrency", "4"],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    text = out.stdout
    assert "8 episodes: 8 ok, 0 masked, 1 retried; mean reward 0.750; 8 lines" in text, text
    assert "episode 1: out_of_memory on attempt 1, ok on attempt 2" in text
    assert text.count("reward 1.0") == 2 and text.count("reward 0.0") == 4
    assert "hint_task" in text and text.endswith("done\n")
    assert not Path(text.splitlines()[0].removeprefix("node home: ")).exists()
