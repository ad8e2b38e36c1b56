"""The ``dsec`` CLI against a real node: sandboxes, node control, and errors without tracebacks."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsec_core.linux.sched import core_scheduling

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def dsec(node, *args: str, input: bytes | None = None, check: bool = True):
    env = dict(os.environ, DSEC_HOME=os.fspath(node.home))
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", *args],
        env=env,
        capture_output=True,
        input=input,
        timeout=120,
    )
    if check and out.returncode != 0:
        raise AssertionError(
            f"dsec {' '.join(args)} exited {out.returncode}:\n{out.stderr.decode()}"
        )
    return out


def test_sandbox_lifecycle(dsec_node):
    layer = dsec_node.layer.ref
    sid = (
        dsec(
            dsec_node,
            "sandbox",
            "create",
            "--layer",
            layer,
            "--memory",
            "64M",
            "--disk",
            "64M",
            "-e",
            "GREETING=hello",
        )
        .stdout.decode()
        .strip()
    )
    try:
        out = dsec(
            dsec_node, "sandbox", "exec", sid, "echo $GREETING; echo err >&2; exit 7", check=False
        )
        assert out.returncode == 7
        assert out.stdout == b"hello\n" and out.stderr == b"err\n"
        out = dsec(dsec_node, "sandbox", "exec", sid, "--", "cat", input=b"piped in")
        assert out.stdout == b"piped in"
        listed = json.loads(dsec(dsec_node, "sandbox", "ls", "--json").stdout)
        assert sid in {s["id"] for s in listed}
        assert next(s for s in listed if s["id"] == sid)["limits"]["disk"] == 64 << 20
        table = dsec(dsec_node, "sandbox", "ls").stdout.decode()
        assert sid in table
    finally:
        dsec(dsec_node, "sandbox", "rm", sid)
    listed = json.loads(dsec(dsec_node, "sandbox", "ls", "--json").stdout)
    assert sid not in {s["id"] for s in listed}


def test_batch_create_with_progress_and_rm_all(dsec_node):
    out = dsec(
        dsec_node,
        "sandbox",
        "create",
        "--layer",
        dsec_node.layer.ref,
        "-n",
        "4",
        "--memory",
        "64M",
        "--json",
    )
    ids = [s["id"] for s in json.loads(out.stdout)]
    assert len(set(ids)) == 4
    assert b"creating sandboxes" in out.stderr  # the progress bar
    removed = dsec(dsec_node, "sandbox", "rm", "--all").stdout.decode()
    for sid in ids:
        assert f"removed {sid}" in removed


def test_errors_are_one_line_without_traceback(dsec_node):
    out = dsec(dsec_node, "sandbox", "create", "--layer", "nope@1", check=False)
    assert out.returncode == 1
    err = out.stderr.decode()
    assert err.startswith("Error: unknown layer 'nope@1'") and "Traceback" not in err
    assert dsec_node.layer.ref in err  # names what exists
    out = dsec(dsec_node, "sandbox", "exec", "deadbeef0000", "true", check=False)
    assert out.returncode == 1 and b"Error: no sandbox 'deadbeef0000'" in out.stderr
    out = dsec(
        dsec_node,
        "sandbox",
        "create",
        "--layer",
        dsec_node.layer.ref,
        "--memory",
        "9T",
        check=False,
    )
    assert out.returncode == 1 and b"Error: not enough memory" in out.stderr
    out = dsec(
        dsec_node,
        "sandbox",
        "create",
        "--layer",
        dsec_node.layer.ref,
        "--backend",
        "nope",
        check=False,
    )
    assert out.returncode == 1 and b"known: container" in out.stderr


def test_node_status(dsec_node):
    status = json.loads(dsec(dsec_node, "node", "status", "--json").stdout)
    assert status["home"] == os.fspath(dsec_node.home) and "container" in status["backends"]
    assert "running" in dsec(dsec_node, "node", "status").stdout.decode()


def test_node_status_reports_the_cpu_classes(dsec_node):
    core = core_scheduling()
    status = json.loads(dsec(dsec_node, "node", "status", "--json").stdout)
    assert status["qos"]["core_scheduling"] == {"available": core.available, "detail": core.detail}
    assert status["qos"]["sched_idle"]["available"] is True
    text = dsec(dsec_node, "node", "status").stdout.decode()
    line = next(x for x in text.splitlines() if x.startswith("latency-sensitive, core sched"))
    assert line.endswith(str(core))
    if _kernel_config("CONFIG_SCHED_CORE") == "# CONFIG_SCHED_CORE is not set":  # as here
        assert "unavailable" in line and "EINVAL" in line and "built without" in line


def _kernel_config(option: str) -> str | None:
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return next((line.strip() for line in f if option in line), None)
    except OSError:
        return None


def test_node_start_stop():
    home = Path(tempfile.mkdtemp(prefix="dsec-cli-"))  # a sandbox's uid must enter DSEC_HOME
    env = dict(os.environ, DSEC_HOME=os.fspath(home))

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "dsec_core.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert run("node", "status").returncode == 3
    started = run("node", "start")
    assert started.returncode == 0 and "serving" in started.stdout
    assert run("node", "start").returncode == 0  # no-op when running
    assert run("node", "status").returncode == 0
    assert "stopped node daemon" in run("node", "stop").stdout
    assert run("node", "status").returncode == 3
    assert "no node daemon" in run("node", "stop").stdout
    with open("/proc/self/mountinfo") as f:
        assert os.fspath(home) not in f.read()
    shutil.rmtree(home)


def test_unenterable_home_is_a_clear_error(tmp_path):
    env = dict(os.environ, DSEC_HOME=os.fspath(tmp_path / "home"))
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "node", "start"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        out.returncode == 1 and "Error: DSEC_HOME" in out.stderr and "Traceback" not in out.stderr
    )


def test_the_cli_loads_its_server_side_only_when_asked():
    """Importing the CLI (what every ``dsec`` run does) loads neither the apiserver, the
    cluster, the demo nor the OpenAPI document; ``dsec --help`` still lists their commands,
    and naming one loads it."""
    server_side = (
        "dsec_core.apiserver",
        "dsec_core.cluster",
        "dsec_core.demo",
        "dsec_core.api.openapi",
    )
    probe = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from dsec_core.cli import cli\n"
        f"names = {server_side!r}\n"
        "print([n for n in names if n in sys.modules])\n"
        "out = CliRunner().invoke(cli, ['--help']).output\n"
        "groups = ('apiserver', 'cluster', 'iam', 'layer', 'catalog')\n"
        "print(all(f'  {c} ' in out for c in groups))\n"
        "print(CliRunner().invoke(cli, ['apiserver', '--help']).exit_code)\n"
        "print('dsec_core.apiserver' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:4] == ["[]", "True", "0", "True"], out
