"""A trainer's ``pip install dsec`` is the client alone. The wheel is built here (offline) and
installed with its ``rl`` extra into a fresh venv from the wheels ``run.sh setup`` keeps in
``.venv/wheelhouse`` (no index is reached); it pulls none of the node side's distributions, and
drives a real node (run from the dev environment) through the SDK and the CLI. The node side's
commands there say what to install instead of failing on an import."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from packaging.requirements import Requirement

from dsec_core.catalog.model import load_catalog
from dsec_core.catalog.store import CatalogStore
from dsec_core.extras import INSTALL_MCP, INSTALL_NODE, NODE_MODULES
from dsec_core.iam import Iam
from dsec_core.layers.store import LayerStore
from dsec_core.testing import KitNode
from dsec_core.testing.apiserver import start_apiserver
from dsec_core.testing.procs import free_port

REPO = Path(__file__).resolve().parent.parent
#: where run.sh setup keeps the client's dependencies as wheels (the dev venv's own directory)
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
#: pip reaching no index, nor PyPI for its own version; and, as root, run in a network namespace
#: of its own with no network in it, so reaching for one fails instead of passing quietly
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
NO_NETWORK = ["unshare", "--net", "--"] if os.geteuid() == 0 else []
#: what the issue names as the server's: none may be in a client-only install
SERVER = ["uvicorn", "starlette", "qemu.qmp", "python-on-whales", "uvloop", "httptools",
          "zstandard", "prometheus-client", "python-multipart"]  # fmt: skip


#: what the wheel's build needs not copied: the repository's other distributions, tests, data
#: (at its top: dsec_core/catalog is the package's own) and build leftovers (anywhere)
NOT_AT_THE_TOP = (".git", ".venv", "build", "plugins", "builders", "tests", "bench", "catalog",
                  "examples", "docs", "site")  # fmt: skip
NOT_ANYWHERE = ("*.egg-info", "__pycache__")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def node_extra() -> list[str]:
    """The distributions of pyproject.toml's ``node`` extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r).name for r in project["optional-dependencies"]["node"]]


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory) -> Path:
    """dsec's wheel, built here from a copy of the repository, offline."""
    if not (WHEELHOUSE.is_dir() and any(WHEELHOUSE.glob("*.whl"))):
        pytest.fail(
            f"no wheels in {WHEELHOUSE}: run `bash run.sh setup`, which keeps the client's "
            "dependencies there (this test installs them without reaching an index)"
        )
    # built from a copy: pip builds in the source tree and would leave build/ behind
    src = tmp_path_factory.mktemp("src") / "dsec"
    anywhere = shutil.ignore_patterns(*NOT_ANYWHERE)

    def ignore(directory: str, names: list[str]) -> set[str]:
        top = set(NOT_AT_THE_TOP) if Path(directory) == REPO else set()
        return anywhere(directory, names) | (top & set(names))

    shutil.copytree(REPO, src, symlinks=True, ignore=ignore)
    wheels = tmp_path_factory.mktemp("wheel")
    build = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src]
    subprocess.run(
        [*NO_NETWORK, sys.executable, "-m", "pip", *build],
        env={**os.environ, **OFFLINE},
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("dsec-*.whl")
    return wheel


def client_venv(tmp_path_factory, wheel: Path, extra: str) -> Path:
    """A fresh venv holding ``wheel`` with ``extra`` and nothing else."""
    env = tmp_path_factory.mktemp(f"slim-{extra}") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True)
    out = pip(env, "install", "-q", "--find-links", WHEELHOUSE, f"{wheel}[{extra}]")
    if out.returncode != 0:
        pytest.fail(
            f"installing the client from {WHEELHOUSE} failed (run `bash run.sh setup` if a "
            f"wheel is missing there):\n{out.stdout}\n{out.stderr}"
        )
    return env


@pytest.fixture(scope="module")
def slim(tmp_path_factory, client_wheel: Path) -> Path:
    """A fresh venv holding dsec's wheel with the ``rl`` extra and nothing else."""
    return client_venv(tmp_path_factory, client_wheel, "rl")


def pip(env: Path, *args: object) -> subprocess.CompletedProcess:
    """This environment's pip, acting on ``env`` (which has no pip of its own), offline."""
    return subprocess.run(
        [
            *NO_NETWORK,
            sys.executable,
            "-m",
            "pip",
            "--python",
            env / "bin" / "python",
            *map(str, args),
        ],
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=300,
    )


def run(
    env: Path, program: str, *args: str, cwd: Path | None = None, **extra: str
) -> subprocess.CompletedProcess:
    """``program`` of the slim venv, seeing nothing of the dev environment or a node unless
    ``extra`` (environment variables) says where one is."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "DSEC_ADDRESS", "DSEC_TOKEN", "DSEC_HOME", "DSEC_PLUGINS")
    }
    return subprocess.run(
        [env / "bin" / program, *args],
        env={**clean, "PYTHONNOUSERSITE": "1", **extra},
        # not the repository: `python -c` puts the working directory first on sys.path, where
        # the source tree's dsec_core would stand in for the wheel's
        cwd=cwd or env.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_node_extra_is_the_table_the_client_checks():
    """``dsec_core.extras.NODE_MODULES`` names each distribution of the node extra and the
    module it installs (here, where the node side is installed)."""
    assert sorted(map(_normalized, NODE_MODULES)) == sorted(map(_normalized, node_extra()))
    owners = importlib.metadata.packages_distributions()
    for dist, module in NODE_MODULES.items():
        assert importlib.util.find_spec(module) is not None, module
        top = module.split(".")[0]
        assert _normalized(dist) in map(_normalized, owners.get(top, [])), (dist, module)
    assert {_normalized(s) for s in SERVER} <= set(map(_normalized, node_extra()))


def test_the_client_path_imports_nothing_of_the_node_side():
    """Even where the node side is installed, the SDK, dsec.rl and the CLI's module load none
    of it."""
    code = (
        "import sys; import dsec, dsec.rl, dsec.rollout, dsec_core.cli; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", f"import json; {code}"],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = set(json.loads(out.stdout))
    node = {m.split(".")[0] for m in NODE_MODULES.values()}
    assert loaded & node == set()


def test_the_client_installs_alone(slim):
    listed = pip(slim, "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    installed = {_normalized(p["name"]): p["version"] for p in json.loads(listed.stdout)}
    print("the client pulled:", ", ".join(f"{n} {v}" for n, v in sorted(installed.items())))
    assert {"dsec", "click", "rich", "pyyaml", "jsonschema", "gymnasium"} <= set(installed)
    assert set(installed) & set(map(_normalized, node_extra())) == set()
    assert set(installed) & set(map(_normalized, SERVER)) == set()
    checked = pip(slim, "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    imported = run(
        slim,
        "python",
        "-c",
        "import dsec, dsec.rl, dsec.rollout, dsec_core; print(dsec.__version__); "
        "print(dsec_core.__file__)",
    )
    assert imported.returncode == 0, imported.stderr
    version, where = imported.stdout.split()
    assert version == installed["dsec"]
    assert Path(where).is_relative_to(slim)  # the wheel's, not the source tree's


ROUND_TRIP = """
    import json, sys
    import dsec, dsec.rl

    with dsec.Client(sys.argv[1]) as client:
        before = {i.id for i in client.list()}  # the kit's node is the worker's: others' too
        with client.create(layers=[sys.argv[2]], memory="64M", disk="64M") as sb:
            result = sb.exec("echo from the slim client; cat /proc/1/comm")
            listed = [i.id for i in client.list()]
            sid = sb.id
        gone = sid not in [i.id for i in client.list()]
        env = dsec.rl.SandboxEnv(client, reward=dsec.rl.command_reward("test -f /answer"),
                                 layers=[sys.argv[2]], memory="64M", disk="64M")
        try:
            env.reset()
            env.step("touch /answer")
            _, reward, terminated, _, _ = env.step("submit")
        finally:
            env.close()
        drive = dsec.rl.drive_client_source()
    print(json.dumps({"out": result.text, "code": result.exit_code, "listed": sid in listed,
                      "gone": gone, "reward": reward, "terminated": terminated,
                      "drive": "class Drive" in drive,
                      "left": sorted({i.id for i in client.list()} - before)}))
"""


def test_a_create_exec_kill_round_trip_and_an_episode_through_the_slim_sdk(
    slim, dsec_node: KitNode
):
    socket = os.fspath(dsec_node.config.socket_path)
    out = run(slim, "python", "-c", textwrap.dedent(ROUND_TRIP), socket, dsec_node.layer.ref)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["code"] == 0 and got["out"].startswith("from the slim client\n")
    assert got["listed"] and got["gone"]
    assert (got["reward"], got["terminated"], got["drive"]) == (1.0, True, True)  # dsec.rl
    assert got["left"] == []


def test_the_slim_cli_drives_a_node(slim, dsec_node: KitNode):
    at = {"DSEC_ADDRESS": os.fspath(dsec_node.config.socket_path)}
    made = run(slim, "dsec", "sandbox", "create", "--layer", dsec_node.layer.ref,
               "--memory", "64M", "--disk", "64M", **at)  # fmt: skip
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    try:
        ran = run(slim, "dsec", "sandbox", "exec", sid, "echo", "from the slim cli", **at)
        assert (ran.returncode, ran.stdout) == (0, "from the slim cli\n"), ran.stderr
        failed = run(slim, "dsec", "sandbox", "exec", sid, "exit 3", **at)
        assert failed.returncode == 3
        status = run(slim, "dsec", "node", "status", DSEC_HOME=os.fspath(dsec_node.home))
        assert status.returncode == 0 and "node daemon: running" in status.stdout, status.stderr
    finally:
        removed = run(slim, "dsec", "sandbox", "rm", sid, **at)
    assert removed.returncode == 0 and f"removed {sid}" in removed.stdout, removed.stderr
    with dsec_node.client() as client:
        assert sid not in [i.id for i in client.list()]


@pytest.mark.parametrize(
    "command",
    [
        ["node", "start"],
        ["node", "start", "--foreground"],
        ["apiserver", "serve", "--node", "unix:///nowhere.sock"],
        ["demo"],
        ["plugins"],
        ["cluster", "up"],
        ["layer", "ls"],
        ["catalog", "ls"],
        ["plugin", "new", "source", "vault"],
        ["build", "start"],  # a plugin's command (dsec-builder): not there without the node side
    ],
    ids=" ".join,
)
def test_the_node_sides_commands_say_what_to_install(slim, tmp_path, command):
    out = run(slim, "dsec", *command, DSEC_HOME=os.fspath(tmp_path / "home"), cwd=tmp_path)
    assert out.returncode in (1, 2), out.stdout + out.stderr
    assert INSTALL_NODE in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("Error: ") == 1
    assert not (tmp_path / "home").exists() and not list(tmp_path.iterdir())  # nothing started


def test_a_client_that_would_start_a_node_says_what_to_install(slim, tmp_path):
    code = textwrap.dedent("""
        import dsec
        try:
            dsec.Client()
        except dsec.NodeSideMissing as e:
            print(e.install)
            print(e)
    """)
    out = run(slim, "python", "-c", code, DSEC_HOME=os.fspath(tmp_path / "home"))
    assert out.returncode == 0, out.stderr
    install, message = out.stdout.splitlines()
    assert install == INSTALL_NODE and "DSEC_ADDRESS" in message
    assert not (tmp_path / "home").exists()  # nothing was started, nor made
    helped = run(slim, "dsec", "--help")
    assert helped.returncode == 0 and "sandbox" in helped.stdout
    assert f"(needs dsec's node side: {INSTALL_NODE})" in helped.stdout


def test_the_slim_client_runs_a_catalogs_tasks(slim, dsec_node: KitNode, tmp_path):
    """dsec.rollout reads catalogs (the default one shipped in the wheel, or a file) without
    the node side, and `dsec rollout` runs a catalog's tasks against a node and prints the
    table."""
    listed = run(slim, "python", "-c", "import dsec.rollout as r; print(len(r.catalog_tasks()))")
    assert listed.returncode == 0, listed.stderr
    assert int(listed.stdout) >= 6  # the default catalog's tasks, read from the wheel
    catalog = tmp_path / "tasks.yaml"
    catalog.write_text(
        "name: slim-rollout\n"
        f"environments: [{{name: slim-box, base: {dsec_node.layer.ref}}}]\n"
        "tasks:\n"
        "  - {name: good, environment: slim-box, command: 'true', reward: exit_code}\n"
        "  - {name: bad, environment: slim-box, command: 'false', reward: exit_code}\n"
    )
    # registered on the node, as its operator's `dsec catalog add` would (the node side)
    CatalogStore(dsec_node.config.catalog_dir).save(
        load_catalog(catalog, store=LayerStore(dsec_node.config.layer_dir))
    )
    out = tmp_path / "r.jsonl"
    ran = run(slim, "dsec", "rollout", "--episodes", "4", "--concurrency", "2",
              "--catalog", os.fspath(catalog), "--out", os.fspath(out),
              "--address", os.fspath(dsec_node.config.socket_path))  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert "dsec rollout: 4 episodes" in ran.stdout and "0.500" in ran.stdout, ran.stdout
    assert len(out.read_text().splitlines()) == 4


def test_the_slim_cli_manages_iam_through_an_apiserver(slim, tmp_path):
    """`dsec iam` with an address is a client of the apiserver's IAM API: an admin's key,
    given to the slim CLI, makes a project and mints a narrower key for an agent."""
    url = f"sqlite://{tmp_path / 'iam.db'}"
    iam = Iam.open(url, cache_ttl=0)
    api = start_apiserver([], url, args=["--node", f"n0=http://127.0.0.1:{free_port()}"])
    try:
        _, root = iam.create_key("/", "admin", "slim-root")
        at = {"DSEC_ADDRESS": api.url, "DSEC_API_KEY": root}
        made = run(slim, "dsec", "iam", "project", "create", "slim", **at)
        assert made.returncode == 0, made.stderr
        minted = run(slim, "dsec", "iam", "key", "create", "--project", "slim",
                     "--role", "agent", "--name", "slim-agent", **at)  # fmt: skip
        assert minted.returncode == 0, minted.stderr
        who = run(slim, "dsec", "iam", "whoami", **at)
        assert who.returncode == 0 and "slim-root" in who.stdout, who.stdout + who.stderr
        assert [k.name for k in iam.keys("slim")] == ["slim-agent"]  # in the store
    finally:
        api.stop()
        api.log.unlink(missing_ok=True)
        iam.close()


def test_dsec_mcp_in_the_client_alone_says_what_to_install(slim, tmp_path):
    out = run(slim, "dsec", "mcp", DSEC_HOME=os.fspath(tmp_path / "home"), cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert INSTALL_MCP in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "home").exists()  # nothing was started


async def test_the_client_with_the_mcp_extra_serves_mcp(
    tmp_path_factory, client_wheel: Path, dsec_node: KitNode
):
    """``pip install 'dsec[mcp]'`` is a client: the mcp package and what it brings, none of the
    node side's own distributions, and ``dsec mcp`` serves a node's sandboxes from there."""
    env = client_venv(tmp_path_factory, client_wheel, "mcp")
    listed = pip(env, "list", "--format", "json")
    installed = {_normalized(p["name"]) for p in json.loads(listed.stdout)}
    assert {"dsec", "mcp"} <= installed
    # starlette, uvicorn and python-multipart come with mcp; the rest is the node side's alone
    node_only = {"pluggy", "python-on-whales", "zstandard", "qemu-qmp", "uvloop", "httptools",
                 "prometheus-client"}  # fmt: skip
    assert installed & node_only == set()
    params = StdioServerParameters(
        command=os.fspath(env / "bin" / "dsec"),
        args=["mcp"],
        env={"DSEC_ADDRESS": os.fspath(dsec_node.config.socket_path), "PYTHONNOUSERSITE": "1"},
        cwd=env.parent,
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as mcp:
        await mcp.initialize()
        assert "exec" in {t.name for t in (await mcp.list_tools()).tools}
        made = await mcp.call_tool("create", {"layers": [dsec_node.layer.ref], "memory": "64M"})
        assert not made.is_error, made
        sid = made.structured_content["id"]
        try:
            r = await mcp.call_tool("exec", {"sandbox_id": sid, "command": "echo slim mcp"})
            assert r.structured_content["stdout"] == "slim mcp\n"
        finally:
            killed = await mcp.call_tool("kill", {"sandbox_id": sid})
        assert not killed.is_error
    with dsec_node.client() as client:
        assert sid not in [i.id for i in client.list()]
