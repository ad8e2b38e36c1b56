"""The main job end to end: ``dsec demo`` on the embedded default, with the real default catalog
(debootstrap base), a daemon it starts itself, and nothing left behind afterwards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsec_core.catalog import default_catalog_file, load_catalog
from dsec_core.localnode import daemon_pid, stop_daemon
from dsec_core.node.pools import POOL_LABEL
from dsec_core.sdk import Client
from dsec_core.testing import leftovers
from dsec_core.vm.qemu import QEMU

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


@pytest.fixture
def demo_home(built_catalog_config):
    # The persistent home where run.sh test built the default catalog before the suite.
    config = built_catalog_config
    if daemon_pid(config):
        stop_daemon(config)
    yield config
    if daemon_pid(config):
        stop_daemon(config)
    left = leftovers(config.home)
    assert not any(left.values()), left


@pytest.mark.skipif(shutil.which(QEMU) is None, reason="QEMU is not installed")
def test_demo_runs_every_task_and_scores_them(demo_home):
    env = dict(os.environ, DSEC_HOME=os.fspath(demo_home.home))
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "demo", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:  # whole, as captured output: an assert's message is cut short
        print(out.stdout[-4000:], "\n--- stderr:\n", out.stderr[-6000:])
    assert out.returncode == 0, "dsec demo failed: its output is under Captured stdout"
    assert "dsec demo rollouts" in out.stdout
    results = json.loads(out.stdout[out.stdout.index("[\n") :])
    catalog = load_catalog(default_catalog_file())
    tasks = catalog.tasks
    assert {r["task"] for r in results} == {t.name for t in tasks}, out.stdout + out.stderr
    # the microVM task ran after the container ones, on its environment's backend and kernel
    on_vm = [t.name for t in tasks if catalog.environment(t.environment).backend == "microvm"]
    assert on_vm and [r["task"] for r in results][-len(on_vm) :] == on_vm
    assert {r["backend"] for r in results if r["task"] in on_vm} == {"microvm"}
    assert {r["backend"] for r in results if r["task"] not in on_vm} <= {"container", "fncall"}
    for r in results:
        assert r["ok"], r
    rewards = {r["reward"] for r in results}
    assert 1.0 in rewards and 0.0 in rewards  # right and wrong programs told apart
    assert any(0 < r["reward"] < 1 for r in results)  # a partial pass rate from JUnit XML
    judged = {r["task"]: r for r in results if "verdicts" in r}
    assert set(judged) == {t.name for t in tasks if t.judge is not None} and judged
    assert judged["sum-pairs"]["outcome"].startswith("AC") and judged["sum-pairs"]["verdicts"]
    assert "WA" in judged["reverse-words"]["verdicts"]
    # the demo's sandboxes are all gone but the judge's warm FnCall members, which stay in
    # their pools until idle; the daemon it started stays up (embedded default)
    assert daemon_pid(demo_home) is not None
    with Client(os.fspath(demo_home.socket_path)) as client:
        left = client.list()
    assert left and all(POOL_LABEL in s.labels for s in left), left
    assert len(leftovers(demo_home.home)["sandbox_dirs"]) == len(left)


def _path_without(tmp_path: Path, program: str) -> str:
    """A PATH of one directory linking every program on this one's but ``program``."""
    farm = tmp_path / "bin"
    farm.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            link = farm / name
            if name != program and not link.exists():
                link.symlink_to(os.path.join(directory, name))
    return os.fspath(farm)


def test_demo_without_qemu_skips_the_microvm_task_saying_why(demo_home, tmp_path):
    env = dict(os.environ, DSEC_HOME=os.fspath(demo_home.home), PATH=_path_without(tmp_path, QEMU))
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "demo", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-3000:])
    skipped = [line for line in out.stdout.splitlines() if line.startswith("skipped task")]
    assert skipped == [
        f"skipped task fizzbuzz-vm on backend microvm: {QEMU} is not installed "
        "(apt-get install qemu-system-x86)"
    ], out.stdout
    results = json.loads(out.stdout[out.stdout.index("[\n") :])
    assert "fizzbuzz-vm" not in {r["task"] for r in results}
    assert results and all(r["ok"] for r in results)
