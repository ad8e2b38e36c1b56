"""Judge mode (issue 9, deliverable 6): compile once, then each test case with its own time and
memory limits, a verdict per case, many submissions at once; on real FnCall members.

Submissions are busybox shell scripts: the "compile" copies the source to ``prog`` and checks
its syntax (``sh -n``: a syntax error is a compile error), the run is ``./prog``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fake_host import FakeCatalogs, FakeHost

import dsec
from dsec_core.catalog.model import Catalog, Environment
from dsec_core.catalog.store import CatalogStore
from dsec_core.errors import InvalidSpec, UnknownEnvironment
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.cgroups import close_memory_window, open_memory_window
from dsec_core.node.judge import judge, outputs_match, verdict_of
from dsec_core.node.node import Node
from dsec_core.node.pools import Pools, PoolSettings
from dsec_core.records import ExecResult, JudgeCase, JudgeSpec
from dsec_core.testing import node_home, running_kit_node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

ENV = "judge-bb"  # busybox, cases sent with each request
TASK = "judge-task"  # busybox with a workspace holding cases/ at its working directory
MEMBER = "160M"
COMPILE = "cp solution.sh prog && chmod +x prog && sh -n prog"
SUM = "read a b; echo $((a + b))\n"
CASES = [JudgeCase(f"{a} {b}\n", f"{a + b}\n", f"c{a}") for a, b in ((1, 2), (20, 22), (5, -7))]


@pytest.fixture
def judge_home():
    with node_home("dsec-judge-") as config, tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws" / "srv" / "sum"
        (ws / "cases").mkdir(parents=True)
        for i, (a, b) in enumerate(((3, 4), (100, 1), (-2, 2)), 1):
            (ws / "cases" / f"{i}.in").write_text(f"{a} {b}\n")
            (ws / "cases" / f"{i}.out").write_text(f"{a + b}\n")
        build_layer(
            ws.parent.parent,
            name="judge-ws",
            version="1",
            kind="workspace",
            store=LayerStore(config.layer_dir),
        )
        CatalogStore(config.catalog_dir).save(
            Catalog(
                name="judge",
                environments=(
                    Environment(name=ENV, base="kit-base@1"),
                    Environment(
                        name=TASK, base="kit-base@1", workspaces=("judge-ws@1",), workdir="/srv/sum"
                    ),
                ),
            )
        )
        yield config


async def _node(config, **settings) -> Node:
    node = Node(config)
    node.pools = Pools(node, PoolSettings(**settings))
    await node.open()
    return node


def submission(source: str, **kw) -> JudgeSpec:
    kw.setdefault("cases", CASES)
    return JudgeSpec(
        environment=kw.pop("environment", ENV),
        run="./prog",
        compile=kw.pop("compile", COMPILE),
        files={"solution.sh": source},
        memory=kw.pop("memory", MEMBER),
        memory_limit=kw.pop("memory_limit", "64M"),
        time_limit=kw.pop("time_limit", 1.0),
        **kw,
    )


async def test_a_right_answer_is_accepted_with_its_time_and_memory(judge_home):
    node = await _node(judge_home, max=1)
    try:
        r = await node.judge(submission(SUM))
        assert r.verdict == "AC" and r.ok and (r.passed, r.total) == (3, 3), r
        assert [c.name for c in r.cases] == ["c1", "c20", "c5"]
        assert [c.stdout for c in r.cases] == [b"3\n", b"42\n", b"-2\n"]
        for c in r.cases:
            assert c.verdict == "AC" and c.exit_code == 0 and c.detail == ""
            assert 0 <= c.time < 1.0 and c.wall > 0
            assert c.memory is not None and 100_000 < c.memory < 64 << 20  # a busybox sh
        assert r.member and r.pool.startswith(ENV)
    finally:
        await node.close(kill_all=True)


async def test_each_verdict(judge_home):
    node = await _node(judge_home, max=2)
    try:
        wrong = await node.judge(submission('read a b; [ "$a" = 20 ] && echo 41 || echo $((a+b))'))
        assert wrong.verdict == "WA" and wrong.passed == 2
        assert [c.verdict for c in wrong.cases] == ["AC", "WA", "AC"]
        assert wrong.cases[1].stdout == b"41\n" and wrong.cases[1].detail == "output differs"
        first_only = await node.judge(
            submission('read a b; [ "$a" = 20 ] && echo 41 || echo $((a+b))', stop_on_failure=True)
        )
        assert [c.verdict for c in first_only.cases] == ["AC", "WA", "SKIPPED"]

        spin = await node.judge(submission("while :; do :; done", time_limit=0.5))
        assert spin.verdict == "TLE" and {c.verdict for c in spin.cases} == {"TLE"}
        assert all(c.wall < 3 for c in spin.cases), spin.cases  # killed, not left to run

        sleeper = await node.judge(submission("sleep 30", time_limit=0.3, cases=CASES[:1]))
        assert sleeper.cases[0].verdict == "TLE" and "wall" in sleeper.cases[0].detail

        crash = await node.judge(submission('read a b; [ "$a" = 5 ] && kill -SEGV $$; exit 3'))
        assert [c.verdict for c in crash.cases] == ["RE", "RE", "RE"]
        assert [c.detail for c in crash.cases] == ["exit 3", "exit 3", "killed by SIGSEGV"]

        broken = await node.judge(submission("if then fi"))
        assert broken.verdict == "CE" and broken.cases == () and broken.total == 3
        assert b"syntax error" in broken.compile_output
    finally:
        await node.close(kill_all=True)


async def test_memory_limit_is_per_case_and_enforced(judge_home):
    """The member may use 160M; each case only 64M. A case that wants 100M is killed (MLE)
    while one of 30M in the same member passes, and reports what it used."""
    hog = 'read a b; [ "$a" = 20 ] && dd if=/dev/zero of=/dev/null bs={} count=1 2>/dev/null; '
    hog += "echo $((a + b))"
    node = await _node(judge_home, max=1)
    try:
        r = await node.judge(submission(hog.format("100M")))
        assert [c.verdict for c in r.cases] == ["AC", "MLE", "AC"], r.cases
        # the OOM killer took dd; the script went on and printed the sum, still MLE
        assert r.verdict == "MLE" and r.cases[1].detail.startswith("over 64 MiB")
        ok = await node.judge(submission(hog.format("30M")))
        assert ok.verdict == "AC", ok.cases
        assert ok.cases[1].memory is not None and ok.cases[1].memory > 30 << 20
        assert ok.cases[0].memory is not None and ok.cases[0].memory < 10 << 20
        # the window is closed: the member's own limit is back, and a plain call may use it
        big = await node.fncall(ENV, "dd if=/dev/zero of=/dev/null bs=100M count=1", memory=MEMBER)
        assert big.exit_code == 0, big
    finally:
        await node.close(kill_all=True)


async def test_compile_runs_once_and_its_output_serves_every_case(judge_home):
    node = await _node(judge_home, max=1)
    try:
        spec = submission(
            "wc -l < /tmp/compiles",
            compile=f"echo built >> /tmp/compiles && {COMPILE}",
            cases=[JudgeCase("", "1\n", str(i)) for i in range(4)],
        )
        r = await node.judge(spec)
        assert r.verdict == "AC" and r.passed == 4, r
    finally:
        await node.close(kill_all=True)


async def test_cases_from_the_environment_are_hidden_from_the_submission(judge_home):
    node = await _node(judge_home, max=1)
    try:
        spec = submission(SUM, environment=TASK, cases=(), cases_dir="cases")
        r = await node.judge(spec)
        assert r.verdict == "AC" and [c.name for c in r.cases] == ["1", "2", "3"], r
        # a submission that prints the expected output from the case files finds none
        cheat = await node.judge(
            submission(
                "cat cases/*.out 2>&1; ls cases 2>&1; true",
                environment=TASK,
                cases=(),
                cases_dir="cases",
            )
        )
        assert cheat.verdict == "WA" and b"No such file" in cheat.cases[0].stdout
        # and the next submission in the same (reset) member still gets every case
        again = await node.judge(spec)
        assert again.verdict == "AC" and again.total == 3
    finally:
        await node.close(kill_all=True)


async def test_many_submissions_are_judged_at_once(judge_home):
    node = await _node(judge_home, max=3)
    try:
        sources = {
            "AC": SUM,
            "WA": "read a b; echo 0",
            "RE": "exit 1",
            "CE": "fi fi",
            "TLE": "while :; do :; done",
        }
        kinds = list(sources) * 2
        rs = await asyncio.gather(
            *(node.judge(submission(sources[k], time_limit=0.3)) for k in kinds)
        )
        assert [r.verdict for r in rs] == kinds
        members = {r.member for r in rs}
        assert 1 < len(members) <= 3  # in parallel, within the pool's max
        (pool,) = node.pools.pools.values()
        assert pool.size <= 3
    finally:
        await node.close(kill_all=True)


async def test_a_case_that_kills_everything_it_can_is_a_runtime_error(judge_home):
    node = await _node(judge_home, max=1)
    try:
        r = await node.judge(submission('read a b; [ "$a" = 20 ] && kill -9 -1; echo $((a+b))'))
        assert [c.verdict for c in r.cases] == ["AC", "RE", "AC"], r.cases
        follow = await node.judge(submission(SUM))
        assert follow.verdict == "AC"
    finally:
        await node.close(kill_all=True)


async def test_bad_submissions_are_typed_errors_and_leak_nothing(judge_home):
    node = await _node(judge_home, max=1)
    try:
        with pytest.raises(UnknownEnvironment):
            await node.judge(submission(SUM, environment="no-such-env"))
        with pytest.raises(InvalidSpec, match="cases_dir"):
            await node.judge(submission(SUM, environment=TASK, cases=(), cases_dir="nope"))
        # the member the failed judge checked out went back clean: the next one is judged in it
        r = await node.judge(submission(SUM, environment=TASK, cases=(), cases_dir="cases"))
        assert r.verdict == "AC"
    finally:
        await node.close(kill_all=True)
    for bad in (
        dict(cases=()),  # neither cases nor cases_dir
        dict(cases=(), cases_dir="../etc"),
        dict(cases=(), cases_dir="cases/.."),
        dict(cases_dir="cases"),  # both
        dict(time_limit=0),
        dict(memory_limit="150M"),  # no room above it in a 160M member
        dict(compare="fuzzy"),
    ):
        with pytest.raises(InvalidSpec):
            submission(SUM, **bad)


async def test_judging_on_a_fake_host_compiles_once_and_gives_each_case_a_verdict(tmp_path):
    """The judge's steps without a sandbox: a fake member whose program prints its input plus
    one (``fake_host``), one case right, one wrong, one too slow."""
    host = FakeHost(tmp_path)
    host.catalogs = FakeCatalogs(Environment(name="judge", base="base@1"))

    def answer(sid, cmd, stdin):
        if cmd == ["/bin/sh", "-c", "cc prog.c"]:
            return ExecResult(0, b"", b"compiled", 0.2)
        n = int(stdin)
        return ExecResult(0, b"%d\n" % (n + 1), b"", 0.01, cpu_time=5.0 if n == 9 else 0.01)

    host.answer = answer
    cases = (JudgeCase(b"1\n", b"2\n"), JudgeCase(b"5\n", b"7\n"), JudgeCase(b"9\n", b"10\n"))
    spec = JudgeSpec(
        environment="judge",
        backend="fake",
        files={"prog.c": b"int main;"},
        compile="cc prog.c",
        run="./prog",
        cases=cases,
        time_limit=1.0,
    )
    pools = Pools(host, PoolSettings(max=1))
    result = await judge(host, pools, spec)
    assert [c.verdict for c in result.cases] == ["AC", "WA", "TLE"]
    assert (result.verdict, result.passed, result.total) == ("WA", 1, 3)
    assert result.compile_output == b"compiled" and [c.name for c in result.cases] == [
        "1",
        "2",
        "3",
    ]
    assert host.files[(result.member, "/work/prog.c")] == b"int main;"
    assert sum(1 for _, cmd, _ in host.execs if cmd == ["/bin/sh", "-c", "cc prog.c"]) == 1
    await host.settle()
    assert host.fake.resets == [result.member]  # the member is reset after the submission
    await pools.close()


def test_outputs_compare_by_lines_tokens_or_bytes():
    assert outputs_match(b"1 2  \n3\n\n\n", b"1 2\n3", "lines")
    assert not outputs_match(b"1  2\n3\n", b"1 2\n3\n", "lines")
    assert outputs_match(b"1  2\n3\n", b"1 2 3", "tokens")
    assert not outputs_match(b"3\n", b"3", "exact") and outputs_match(b"3", b"3", "exact")


def test_verdict_order_memory_then_time_then_exit_then_output():
    from dsec_core.backend import MemoryWindowUse

    def run(**kw) -> ExecResult:
        base = dict(exit_code=0, stdout=b"3\n", stderr=b"", duration=0.1, cpu_time=0.1)
        return ExecResult(**{**base, **kw})

    limits = dict(time_limit=1.0, memory_limit=64 << 20)
    oom = MemoryWindowUse(peak=64 << 20, oom_kills=1)
    assert verdict_of(run(exit_code=137), oom, b"3", **limits)[0] == "MLE"
    assert verdict_of(run(timed_out=True, exit_code=137), None, b"3", **limits)[0] == "TLE"
    assert verdict_of(run(cpu_time=1.5), MemoryWindowUse(), b"3", **limits)[0] == "TLE"
    assert verdict_of(run(exit_code=1), MemoryWindowUse(), b"3", **limits) == ("RE", "exit 1")
    assert verdict_of(run(stdout=b"4"), MemoryWindowUse(), b"3", **limits)[0] == "WA"
    assert verdict_of(run(truncated=True), MemoryWindowUse(), b"3", **limits)[0] == "WA"
    assert verdict_of(run(), MemoryWindowUse(), b"3", **limits) == ("AC", "")
    # without a memory window, the peak resident set decides
    assert verdict_of(run(max_rss=65 << 20), None, b"3", **limits)[0] == "MLE"


def test_a_memory_window_lowers_and_restores_a_cgroups_limit(tmp_path):
    """On a real memory cgroup: the limit is the use plus the window, and comes back."""
    from dsec_core.linux.cgroups import memory_cgroup_dir

    rel = f"dsec-test-window-{os.getpid()}"
    base = Path("/sys/fs/cgroup/memory")
    d = base / rel
    d.mkdir()
    try:
        assert memory_cgroup_dir(rel) == d
        (d / "memory.limit_in_bytes").write_text(str(256 << 20))
        w = open_memory_window(d, 8 << 20)
        assert int((d / "memory.limit_in_bytes").read_text()) == w.baseline + (8 << 20) & ~4095
        close_memory_window(w)
        assert int((d / "memory.limit_in_bytes").read_text()) == 256 << 20
        assert w.oom_kills == 0 and w.peak >= 0
    finally:
        d.rmdir()


# --- over the API -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge_node():
    """A kit node of this module's own: judging leaves warm FnCall members behind (they go when
    idle, or with the daemon), which the session's shared kit node must not hold for the
    tests after these."""
    with running_kit_node("dsec-judge-kit-") as kit:
        yield kit


@pytest.fixture
def kit_env(judge_node):
    return judge_node.environment(ENV)


@pytest.fixture
def judge_client(judge_node):
    with judge_node.client() as client:
        yield client


def test_judge_through_the_sdk(judge_client, kit_env):
    r = judge_client.judge(
        kit_env,
        ["sh", "solution.sh"],
        files={"solution.sh": SUM},
        cases=[{"input": "2 2\n", "output": "4\n"}, JudgeCase("1 1\n", "3\n")],
        memory=MEMBER,
        memory_limit="64M",
    )
    assert isinstance(r, dsec.JudgeResult)
    assert r.verdict == "WA" and [c.verdict for c in r.cases] == ["AC", "WA"]
    assert [c.name for c in r.cases] == ["1", "2"] and r.cases[0].stdout == b"4\n"
    with pytest.raises(dsec.UnknownEnvironment):
        judge_client.judge("nope-env", "true", cases=CASES, memory=MEMBER, memory_limit="64M")
    with pytest.raises(dsec.InvalidSpec):
        judge_client.judge(kit_env, "true", memory=MEMBER, memory_limit="64M")


async def test_judge_through_the_async_sdk(judge_node, kit_env):
    async with dsec.AsyncClient(os.fspath(judge_node.config.socket_path)) as client:
        rs = await asyncio.gather(
            *(
                client.judge(
                    submission(SUM if i % 2 else "echo 0", environment=kit_env, time_limit=1.0)
                )
                for i in range(4)
            )
        )
    assert [r.verdict for r in rs] == ["WA", "AC", "WA", "AC"]


def test_judge_through_the_cli(judge_node, kit_env, tmp_path):
    (tmp_path / "solution.sh").write_text(SUM)
    (tmp_path / "a.in").write_text("2 3\n")
    (tmp_path / "a.out").write_text("5\n")
    (tmp_path / "b.in").write_text("1 1\n")
    (tmp_path / "b.out").write_text("3\n")
    env = dict(os.environ, DSEC_HOME=os.fspath(judge_node.home))
    cli = [sys.executable, "-m", "dsec_core.cli", "judge", kit_env, "--memory", MEMBER]
    cli += ["--memory-limit", "64M", "--run", "sh solution.sh", "--compile", "sh -n solution.sh"]
    cli += ["-f", f"solution.sh={tmp_path / 'solution.sh'}"]
    ok = [*cli, "--case", f"{tmp_path / 'a.in'}:{tmp_path / 'a.out'}"]
    out = subprocess.run(ok, env=env, capture_output=True, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and b"AC (1/1 accepted)" in out.stdout, out
    both = [*ok, "--case", f"{tmp_path / 'b.in'}:{tmp_path / 'b.out'}", "--json"]
    out = subprocess.run(both, env=env, capture_output=True, stdin=subprocess.DEVNULL)
    result = json.loads(out.stdout)
    assert out.returncode == 1 and result["verdict"] == "WA", out
    assert [(c["name"], c["verdict"]) for c in result["cases"]] == [("a", "AC"), ("b", "WA")]
    status = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "node", "status"], env=env, capture_output=True
    )
    # the kit's daemon is shared: earlier tests may have grown this pool beyond one member
    pool = rf"fncall pool {kit_env}/fncall/1cpu/160M: \d+ members \(\d+ free".encode()
    assert re.search(pool, status.stdout), status
