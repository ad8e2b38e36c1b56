"""dsec.rl (issue 10, deliverable 5): the gymnasium environment over real sandboxes of a kit
node, forking an episode from its state, infrastructure failures typed in ``info``, and the
drive socket's Python client speaking to a real node as a sandbox's uid."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gymnasium
import pytest

import dsec
from dsec.rl import (
    INFRA_KINDS,
    AsyncSandboxEnv,
    EnvClosed,
    EnvError,
    EnvNotReset,
    EpisodeEnded,
    InfraFailure,
    InvalidAction,
    SandboxEnv,
    command_reward,
    drive_client_source,
    infra_event,
)
from dsec_core.config import NodeConfig
from dsec_core.errors import (
    NodeUnavailable,
    SandboxDied,
    SandboxPaused,
    SourceUnavailable,
    StartTimeout,
    UnknownSandbox,
)
from dsec_core.localnode import stop_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

FIELDS = {"layers": ["kit-base@1"], "memory": "64M", "disk": "64M"}


def make_env(client, **kw) -> SandboxEnv:
    return SandboxEnv(client, reward=command_reward("grep -q 42 /answer"), **{**FIELDS, **kw})


def test_an_episode_steps_through_commands_and_is_scored_on_submit(dsec_client):
    env = make_env(dsec_client, max_steps=4)
    assert isinstance(env, gymnasium.Env)
    try:
        obs, info = env.reset()
        assert obs == "" and info["infra"] is None
        first = info["sandbox_id"]
        obs, reward, terminated, truncated, info = env.step("echo 41 > /answer; cat /answer")
        assert (obs, reward, terminated, truncated) == ("41\n", 0.0, False, False)
        assert env.observation_space.contains(obs) and info["exit_code"] == 0
        obs, reward, terminated, _, _ = env.step("submit")
        assert reward == 0.0 and terminated  # 41 is wrong
        env.reset()  # a fresh sandbox: the old one is gone
        with pytest.raises(UnknownSandbox):
            dsec_client.get(first)
        env.step("echo 42 > /answer")
        obs, reward, terminated, _, _ = env.step("submit")
        assert reward == 1.0 and terminated and "reward 1" in obs
        env.reset()
        results = [env.step("true") for _ in range(4)]
        assert [r[3] for r in results] == [False, False, False, True]  # max_steps
        with pytest.raises(EpisodeEnded):
            env.step("true")
        env.reset()
        _, _, _, _, info = env.step("printf '\\001\\377x'")
        assert info["exit_code"] == 0
        obs, *_ = env.step("printf 'a\\001b'")
        assert obs == "a?b"  # outside the observation space's charset
    finally:
        env.close()


def test_a_fork_goes_on_from_the_state_in_sandboxes_of_its_own(dsec_client):
    env = make_env(dsec_client, group="rl-fork")
    kids: list[SandboxEnv] = []
    try:
        env.reset()
        env.step("echo 40 > /answer")
        kids = env.fork(3)
        assert len({k.sandbox_id for k in kids} | {env.sandbox_id}) == 4
        for i, kid in enumerate(kids):
            obs, *_ = kid.step(f"cat /answer; echo 4{i + 1} > /answer")
            assert obs == "40\n"  # the state at the fork
        scores = [kid.step("submit")[1] for kid in kids]
        assert scores == [0.0, 1.0, 0.0]  # each wrote its own answer
        assert env.step("cat /answer")[0] == "40\n"  # the parent went on untouched
        group = {i.id for i in dsec_client.group("rl-fork").members()}
        assert group == {env.sandbox_id, *(k.sandbox_id for k in kids)}
    finally:
        for kid in kids:
            kid.close()
        env.close()


def test_infrastructure_failures_are_typed_in_info_and_masked(dsec_client):
    env = make_env(dsec_client)
    try:
        env.reset()
        sid = env.sandbox_id
        dsec_client.pause(sid)  # a lease lapsed, say
        obs, reward, terminated, truncated, info = env.step("echo hi")
        assert info["infra"].kind == "preempted" and info["masked"]
        assert (reward, terminated, truncated) == (0.0, False, True)
        with pytest.raises(EpisodeEnded):  # truncated: the episode is over
            env.step("echo hi")
        env.reset()
        sid = env.sandbox_id
        obs, reward, _, truncated, info = env.step("dd if=/dev/zero of=/dev/null bs=100M count=1")
        assert info["infra"].kind == "out_of_memory" and truncated and info["masked"]
        assert [e.kind for e in dsec_client.events(sid)] == ["out_of_memory"]
        env.reset()
        _, _, _, truncated, info = env.step("exit 3")  # the task's own failure: no event
        assert info["infra"] is None and info["exit_code"] == 3 and not truncated
    finally:
        env.close()
    slow = make_env(dsec_client, start_timeout=1e-6)
    obs, info = slow.reset()
    assert info["infra"].kind == "start_timeout" and slow.sandbox_id is None
    lost = make_env(dsec.Client("/nonexistent/dsec.sock", autostart=False, retry=0.2))
    obs, info = lost.reset()
    assert info["infra"].kind == "node_lost"


def test_an_env_used_out_of_turn_raises_the_typed_error_saying_how(dsec_client):
    env = make_env(dsec_client, max_steps=2)
    with pytest.raises(EnvNotReset, match="reset"):
        env.step("true")
    with pytest.raises(EnvNotReset):
        env.fork(2)
    env.reset()
    sid = env.sandbox_id
    for bad in ("", "   ", 42, "echo \u00e9", "x" * (1 << 16 + 1)):
        with pytest.raises(InvalidAction) as e:
            env.step(bad)  # type: ignore[arg-type]
        assert isinstance(e.value, EnvError) and isinstance(e.value, dsec.DsecError)
        assert e.value.sandbox_id == sid and e.value.step == 0
    assert env.step("echo ok")[0] == "ok\n"  # a refused action took no step
    assert env.step("submit")[2]  # terminated
    with pytest.raises(EpisodeEnded, match="ended"):
        env.step("true")
    with pytest.raises(EpisodeEnded):
        env.fork(1)
    with pytest.raises(dsec.InvalidSpec):
        SandboxEnv(dsec_client)  # nothing to make a sandbox of
    env.close()
    env.close()  # closing twice is no error
    with pytest.raises(UnknownSandbox):
        dsec_client.get(sid)  # its sandbox went with it
    for use in (env.reset, lambda: env.step("true"), lambda: env.fork(1)):
        with pytest.raises(EnvClosed):
            use()
    # a reset that met an infrastructure failure leaves nothing to step
    slow = make_env(dsec_client, start_timeout=1e-6)
    assert slow.reset()[1]["masked"]
    with pytest.raises(EpisodeEnded):
        slow.step("true")


async def test_the_async_twin_runs_the_same_episode_and_forks(dsec_node):
    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:

        async def checked(c, sid: str) -> float:  # an async reward of the async client
            return 1.0 if (await c.exec(sid, "grep -q 42 /answer")).ok else 0.0

        env = AsyncSandboxEnv(client, reward=checked, max_steps=5, **FIELDS)
        kids: list[AsyncSandboxEnv] = []
        try:
            with pytest.raises(EnvNotReset):
                await env.step("true")
            obs, info = await env.reset(seed=3)
            assert obs == "" and info["infra"] is None and env.np_random is not None
            obs, reward, terminated, truncated, info = await env.step("echo 40 > /answer; echo hi")
            assert (obs, reward, terminated, truncated) == ("hi\n", 0.0, False, False)
            with pytest.raises(InvalidAction):
                await env.step("")
            kids = await env.fork(2)
            lazy = await env.fork(1, start=False)  # its sandbox comes at its reset
            assert lazy[0].sandbox_id is None and lazy[0].phase == "new"
            kids += lazy
            await lazy[0].reset()
            assert lazy[0].steps == 1  # counted from the fork point
            for i, kid in enumerate(kids):
                obs, *_ = await kid.step(f"cat /answer; echo 4{i + 1} > /answer")
                assert obs == "40\n"
            scores = [(await kid.step("submit"))[1] for kid in kids]
            assert scores == [0.0, 1.0, 0.0]
            # the blocking command_reward works on the async client too
            env.reward_fn = command_reward("grep -q 40 /answer")
            assert (await env.step("submit"))[1:3] == (1.0, True)
            with pytest.raises(EpisodeEnded):
                await env.step("true")
            await env.reset()
            sid = env.sandbox_id
            _, _, _, truncated, info = await env.step(
                "dd if=/dev/zero of=/dev/null bs=100M count=1"
            )
            assert truncated and info["infra"].kind == "out_of_memory" and info["masked"]
            assert [e.kind for e in await client.events(sid)] == ["out_of_memory"]
        finally:
            for kid in kids:
                await kid.close()
            await env.close()
        with pytest.raises(EnvClosed):
            await env.reset()
        assert not [i for i in await client.list() if i.id in {sid, *(k.sandbox_id for k in kids)}]


def test_the_twins_have_the_same_methods_one_blocking_one_awaited():
    for name in ("reset", "step", "fork", "close"):
        blocking, awaited = getattr(SandboxEnv, name), getattr(AsyncSandboxEnv, name)
        assert not inspect.iscoroutinefunction(blocking) and inspect.iscoroutinefunction(awaited)
        assert list(inspect.signature(blocking).parameters) == list(
            inspect.signature(awaited).parameters
        ), name
    # what they do is the shared core's, not a copy in either twin
    own = {n for n in vars(SandboxEnv) | vars(AsyncSandboxEnv) if n.endswith("_op")}
    assert own == set()


def test_an_infra_failure_raised_as_an_error_keeps_its_event():
    event = dsec.rl.InfraEvent("out_of_memory", "s1", 1.0, "dd")
    err = InfraFailure(event)
    assert infra_event(err) is event and isinstance(err, dsec.DsecError)
    assert "out_of_memory" in str(err) and err.sandbox_id == "s1"


def test_infra_event_classifies_errors_not_the_task_s_own():
    assert {
        infra_event(e).kind  # type: ignore[union-attr]
        for e in (
            NodeUnavailable("x"),
            StartTimeout("x"),
            SandboxPaused("x", sandbox_id="s"),
            SandboxDied("x", sandbox_id="s", kind="guest_panic", cause="..."),
            SourceUnavailable("x", source="s3://bucket"),
        )
    } == {"node_lost", "start_timeout", "preempted", "crashed", "source_unavailable"}
    assert infra_event(UnknownSandbox("x")) is None
    assert infra_event(dsec.ExecResult(1, b"", b"", 0.1)) is None
    oom = infra_event(dsec.ExecResult(137, b"", b"", 0.1, oom_killed=True), "s")
    assert oom is not None and oom.kind == "out_of_memory" and oom.sandbox_id == "s"
    assert set(INFRA_KINDS) == {
        "preempted",
        "out_of_memory",
        "start_timeout",
        "node_lost",
        "crashed",
        "disk_full",
        "source_unavailable",
    }


def test_the_python_drive_client_drives_a_worker_as_the_sandbox_s_uid(dsec_node, dsec_client):
    worker = dsec_client.create(**FIELDS)
    agent = dsec_client.create(**FIELDS, drives=[worker.id], trajectory="py-client")
    try:
        # a process of the agent sandbox's host uid, as its loop would be (python is not in
        # the busybox base, so the client runs on the host under that uid)
        uid = int(
            next(
                line.split()[1]
                for line in Path(f"/proc/{agent.info.pid}/status").read_text().splitlines()
                if line.startswith("Uid:")
            )
        )
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o755)
            (Path(tmp) / "drive.py").write_text(drive_client_source())
            loop = (
                "import json, sys\n"
                "from drive import Drive, DriveError\n"
                "d = Drive(sys.argv[1])\n"
                "(w,) = d.workers()\n"
                "out = [d.exec(w, 'echo ran >> /ran; wc -l < /ran')['stdout'] for _ in range(2)]\n"
                "try:\n"
                "    d.exec('elsewhere', 'true')\n"
                "except DriveError as e:\n"
                "    out.append(e.type)\n"
                "print(json.dumps(out))\n"
            )
            sock = dsec_node.config.run_dir / "drive" / "drive.sock"
            gid = dsec_node.config.sandbox_gid

            def as_sandbox() -> None:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)

            python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
            assert python is not None
            run = lambda: subprocess.run(  # noqa: E731
                [python, "-c", loop, os.fspath(sock)],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=60,
                preexec_fn=as_sandbox,
            )
            first = run()
            assert first.returncode == 0, first.stderr
            assert json.loads(first.stdout) == ["1\n", "2\n", "UnknownSandbox"]
            again = run()  # a restarted loop: both steps come back from the log
            assert json.loads(again.stdout) == ["1\n", "2\n", "UnknownSandbox"]
        assert dsec_client.exec(worker.id, "cat /ran").stdout == b"ran\nran\n"
        assert [e.step for e in dsec_client.trajectory("py-client")] == [0, 1]
    finally:
        agent.kill()
        worker.kill()
        with contextlib.suppress(dsec.NotFound):
            dsec_client.remove_trajectory("py-client")


def test_the_example_runs_episodes_a_fork_and_a_preemption():
    example = Path(__file__).parent.parent / "examples" / "rl_preemption.py"
    try:
        out = subprocess.run(
            [sys.executable, os.fspath(example)], capture_output=True, text=True, timeout=200
        )
    except subprocess.TimeoutExpired as e:  # say where it stood (pytest's own timeout would not)
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        if text.startswith("node home: "):  # killed, it could not stop its node: stop it here
            home = Path(text.splitlines()[0].removeprefix("node home: "))
            socket = os.fspath(NodeConfig(home=home).socket_path)
            with contextlib.suppress(dsec.DsecError), dsec.Client(socket, autostart=False) as c:
                for info in c.list():
                    c.kill(info.id)
            stop_daemon(NodeConfig(home=home))
            shutil.rmtree(home, ignore_errors=True)
        pytest.fail(f"the example did not finish: stdout {e.stdout!r}, stderr {e.stderr!r}")
    assert out.returncode == 0, (out.stdout, out.stderr)
    text = out.stdout
    assert "episode 0: reward 1.0" in text and "episode 1: reward 0.0" in text
    assert "guessed 42, reward 1.0, state 1000" in text
    assert text.count("event preempted") == 2 and "resumed: running, running" in text
    assert "8 steps logged, the worker ran 8 parts" in text and text.endswith("done\n")
    assert not Path(text.splitlines()[0].removeprefix("node home: ")).exists()
