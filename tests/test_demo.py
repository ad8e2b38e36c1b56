"""The main job end to end: ``dsec demo`` on the embedded default, with the real default catalog
(debootstrap base), a daemon it starts itself, and nothing left behind afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsec_core.catalog import default_catalog_file, load_catalog
from dsec_core.localnode import daemon_pid, stop_daemon
from dsec_core.node.pools import POOL_LABEL
from dsec_core.sdk import Client
from dsec_core.testing import leftovers

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


def test_demo_runs_every_task_and_scores_them(demo_home):
    env = dict(os.environ, DSEC_HOME=os.fspath(demo_home.home))
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "demo", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dsec demo rollouts" in out.stdout
    results = json.loads(out.stdout[out.stdout.index("[\n") :])
    tasks = load_catalog(default_catalog_file()).tasks
    assert {r["task"] for r in results} == {t.name for t in tasks}
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
