"""``dsec build demo`` end to end on a real node: a public repository built into a task
environment offline (a package index on the node's egress side, the scripted driver, scrub,
pack, QA, publish), its task run as ``dsec demo`` runs one, and nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from dsec_builder.demo import DEMO_BUILD, DEMO_TASK, REFERENCE, STUB

from dsec_core.catalog.model import Catalog, Task
from dsec_core.catalog.store import CatalogStore
from dsec_core.layers.store import LayerStore
from dsec_core.linux.netns import NETNS_DIR
from dsec_core.records import BUILD_LABEL, STAGED_PREFIX, SandboxSpec


def dsec(python_node, *args: str) -> subprocess.CompletedProcess:
    """``dsec ARGS`` against the test's node."""
    env = dict(os.environ, DSEC_HOME=os.fspath(python_node.home))
    for var in ("DSEC_ADDRESS", "DSEC_API_KEY", "DSEC_RUNTIME_ADDRESS", "DSEC_RUNTIME_API_KEY"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def build_demo(python_node, *args: str) -> subprocess.CompletedProcess:
    return dsec(python_node, "build", "demo", *args)


def outcome(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    lines = out.stdout.splitlines()
    return json.loads("\n".join(lines[lines.index("{") :]))


def index_namespaces() -> set[str]:
    return {p.name for p in NETNS_DIR.glob("dsec-pkgindex-*")} if NETNS_DIR.is_dir() else set()


def test_build_demo_builds_publishes_and_runs_the_task(python_node):
    before = index_namespaces()
    out = build_demo(python_node, "--json")
    result = outcome(out)
    assert "QA (fresh sandboxes" in out.stdout and "dsec demo rollouts" in out.stdout

    # the dependency came from the index, through the node's egress namespace
    assert result["index_url"].startswith("http://10.78.")
    assert any("/files/peppercorn-0.6-py3-none-any.whl" in r for r in result["index_requests"])
    # QA: declared checks, fail-to-pass with the task's reward function, reproducibility
    report = result["finish"]["report"]
    assert report["passed"], report
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {
        "size", "imports", "notes-scrubbed", "reference-passes", "unmodified-fails",
        "reproducible",
    }  # fmt: skip
    assert checks["reference-passes"]["reward"] == 1.0
    assert checks["unmodified-fails"]["reward"] == 0.5  # 1 of its 2 hidden tests passes
    # the task ran as `dsec demo` runs it, on the shipped (stubbed) workspace
    (rollout,) = result["rollouts"]
    assert rollout["task"] == DEMO_TASK and rollout["reward"] == 0.5 and rollout["ok"]
    assert result["finish"]["layer"]["name"] == DEMO_BUILD and result["version"] == "1"

    # the published environment: the agent's workspace without the secrets or the notes
    with python_node.client() as client:
        sb = client.create(SandboxSpec(environment=DEMO_BUILD, ttl=120))
        try:
            repo = "/workspace/sample"
            assert sb.read_file(f"{repo}/src/sample/simple.py").decode() == STUB
            assert sb.read_file(f"{repo}/TASK.md").startswith(b"# Task: add_one")
            assert sb.exec(f"test ! -e {repo}/tests/test_hidden.py").exit_code == 0
            assert sb.exec("test ! -e /.dsec-build && ! ls /tmp/pip.whl").exit_code == 0
            r = sb.exec("python3 -c 'import peppercorn'")
            assert r.exit_code == 0, r
            listing = sb.exec(f"grep -rl 'return number + 1' {repo} /usr/local || true").text
            assert listing.strip() == "", listing  # the reference is nowhere in it
        finally:
            sb.kill()
        # no build session left running, no staged layer, no index namespace
        assert not [i for i in client.list() if BUILD_LABEL in i.labels]
    assert REFERENCE.strip().endswith("return number + 1")
    layers = LayerStore(python_node.config.layer_dir)
    assert not [i for i in layers.list() if i.name.startswith(STAGED_PREFIX)]
    assert index_namespaces() <= before  # none of its own left (others may have gone meanwhile)

    # `dsec demo --task` runs a task of the node's registered catalogs by name: one over the
    # built environment (its hidden-test task is the build's, for graders: not registered)
    check = "cd /workspace/sample && PYTHONPATH=src python3 -c 'import sample, peppercorn'"
    catalogs = CatalogStore(python_node.config.catalog_dir)
    env = replace(catalogs.environment(DEMO_BUILD), name="sample-check", catalog="")
    catalogs.save(
        Catalog(
            name="demo-check",
            environments=(env,),
            tasks=(Task(name="sample-imports", environment=env.name, command=check, expect=1.0),),
        )
    )
    try:
        out = dsec(python_node, "demo", "--task", "sample-imports", "--json")
        assert out.returncode == 0, out.stderr[-3000:]
        (row,) = json.loads(out.stdout[out.stdout.index("[\n") :])
        assert (row["task"], row["reward"], row["ok"]) == ("sample-imports", 1.0, True)
        out = dsec(python_node, "demo", "--task", DEMO_TASK)
        assert out.returncode == 1 and f"Error: unknown task '{DEMO_TASK}'" in out.stderr
    finally:
        catalogs.remove("demo-check")

    # again: a new version of the same build (layers are immutable), the same outcome
    again = outcome(build_demo(python_node, "--json"))
    assert again["version"] == "2" and again["rollouts"][0]["ok"]
    assert layers.exists(f"{DEMO_BUILD}@1") and layers.exists(f"{DEMO_BUILD}@2")


def test_an_unknown_environment_is_a_typed_error_and_starts_nothing(python_node):
    before = index_namespaces()
    out = build_demo(python_node, "--from", "no-such-env", "--name", "demo-bad")
    assert out.returncode != 0
    assert "Error:" in out.stderr and "no-such-env" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    with python_node.client() as client:
        assert not [i for i in client.list() if BUILD_LABEL in i.labels]
    assert index_namespaces() <= before  # none of its own left (others may have gone meanwhile)


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
