"""``dsec build demo``: a task environment built by the scripted driver from a real public
repository, offline, then run as ``dsec demo`` runs a task.

The pieces it is made of are shared with ``bench/build.py``: the sample repository
(``SAMPLE_PROJECT``: pypa/sampleproject, in ``demo_data``), the wheels its dependency comes
from (``index_wheels``: peppercorn, and Debian's own pip wheel for a base without pip) and the
shell command that installs it from a package index (``install_command``).
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import yaml
from rich.console import Console
from rich.table import Table

from dsec_core.catalog.model import Task, default_catalog_file, load_catalog
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.demo import ensure_catalog, run_demo
from dsec_core.errors import DsecError, InvalidSpec, UnknownEnvironment
from dsec_core.layers.store import LayerStore
from dsec_core.records import BUILD_NOTES_DIR, STAGED_PREFIX
from dsec_core.sdk import Client

from .errors import UnknownBuild
from .pkgindex import EgressIndex
from .plan import run_plan
from .policy import BuildPolicy, PackageIndex
from .qa import TaskSpec
from .record import LIVE_STATES
from .session import BuildContext, BuildSession
from .tools import BuildTools

__all__ = [
    "DEMO_BUILD",
    "DEMO_DATA",
    "DEMO_TASK",
    "SAMPLE_PROJECT",
    "WHEELS",
    "DemoResult",
    "demo_cmd",
    "demo_plan",
    "files_of",
    "graded_task",
    "host_pip_wheel",
    "index_wheels",
    "install_command",
    "next_version",
    "print_summary",
    "run_build_demo",
]

DEMO_DATA = Path(__file__).resolve().parent / "demo_data"
#: pypa/sampleproject (MIT; see demo_data/SOURCES.md): ``sample.simple.add_one``, its tests, a
#: pyproject depending on peppercorn
SAMPLE_PROJECT = DEMO_DATA / "sampleproject"
#: The wheels of the sample's dependencies (peppercorn 0.6, from PyPI)
WHEELS = DEMO_DATA / "wheels"
#: Where Debian keeps the pip wheel its venvs bootstrap from (python3-pip-whl, which
#: python3-venv brings)
DEBIAN_WHEELS = Path("/usr/share/python-wheels")


def host_pip_wheel() -> Path:
    """Debian's pip wheel on this machine: a sandbox whose base has python3 but no pip (the
    default ``python`` environment) runs pip straight from it, fetched from the index."""
    found = sorted(DEBIAN_WHEELS.glob("pip-*-py3-none-any.whl"))
    if not found:
        raise InvalidSpec(
            f"no pip wheel in {DEBIAN_WHEELS}: install Debian's python3-pip-whl "
            "(python3-venv brings it)",
            path=str(DEBIAN_WHEELS),
        )
    return found[-1]


def index_wheels(directory: Path) -> Path:
    """Fill ``directory`` with what the demo's index serves: ``WHEELS`` and the host's pip
    wheel. Returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for wheel in [*sorted(WHEELS.glob("*.whl")), host_pip_wheel()]:
        shutil.copyfile(wheel, directory / wheel.name)
    return directory


def install_command(index_url: str, packages: tuple[str, ...] = ("peppercorn",)) -> str:
    """A shell command that pip-installs ``packages`` from the index at ``index_url`` (its
    ``/simple/``) into the system's python3, with the base's pip or, where the base has none,
    Debian's pip wheel fetched from the same index (``index_wheels`` serves it) and run in
    place; it fails fast (no retries) when the index is out of reach."""
    host = urlsplit(index_url).hostname or ""
    files = index_url.rstrip("/").rsplit("/simple", 1)[0] + "/files/"
    fetch = "import sys, urllib.request as u; u.urlretrieve(sys.argv[1], sys.argv[2])"
    return (
        "set -e; "
        "if python3 -m pip --version >/dev/null 2>&1; then pip='python3 -m pip'; else "
        f"python3 -c '{fetch}' {files}{host_pip_wheel().name} /tmp/pip.whl; "
        "pip='python3 /tmp/pip.whl/pip'; fi; "
        "$pip install --no-cache-dir --break-system-packages --disable-pip-version-check "
        f"--retries 0 --timeout 10 --index-url {index_url} --trusted-host {host} "
        f"{' '.join(packages)}; rm -f /tmp/pip.whl"
    )


# --- the demo ---------------------------------------------------------------------------------
#: The build the demo makes (its layer, catalog and environment) and its task.
DEMO_BUILD = "sample-add-one"
DEMO_TASK = "add-one"
#: Where the repository goes in the build sandbox.
REPO_DIR = "/workspace/sample"
JUNIT = "/tmp/add-one-junit.xml"

#: The task as the agent sees it (in the workspace).
TASK_TEXT = """\
# Task: add_one

`sample.simple.add_one(number)` must return `number + 1` for any integer. It raises
NotImplementedError today: implement it. Hidden tests check it, and that the project's
dependency (peppercorn) is installed.
"""

#: What the agent is given in place of the repository's own ``simple.py``.
STUB = """\
def add_one(number):
    raise NotImplementedError("add_one: see TASK.md")
"""

#: The reference solution: the repository's own ``simple.py``.
REFERENCE = (SAMPLE_PROJECT / "src" / "sample" / "simple.py").read_text()

#: The hidden tests (secret: never in the published workspace; QA and the graded environment
#: add them). No line of 24+ characters here may also be in the workspace, or the leak scan
#: (rightly) refuses the build: the repository's own test imports add_one by name.
HIDDEN_TEST = '''\
"""Hidden tests of the add-one task built by `dsec build demo`."""

import peppercorn
from sample import simple


def test_add_one_adds_one_to_any_integer():
    cases = (-1, 0, 5, 10**20)
    assert [simple.add_one(n) for n in cases] == [0, 1, 6, 10**20 + 1]


def test_the_dependency_from_the_index_is_installed():
    fields = [("name", "dsec"), ("__start__", "tags:sequence"), ("tag", "a")]
    fields.append(("__end__", "tags:sequence"))
    assert peppercorn.parse(fields) == {"name": "dsec", "tags": ["a"]}
'''

#: The builder's notes, kept under BUILD_NOTES_DIR (scrubbed before packing) and declared
#: secret, so the leak scan fails the build if they reach the packed layer.
NOTES = "builder's notes: add_one stubbed for the task; peppercorn came from the local index\n"

#: Where the builder keeps them in the session (its notes dir: pack_diff leaves it out).
HIDDEN_TEST_FILE = f"{BUILD_NOTES_DIR}/test_hidden.py"
REFERENCE_FILE = f"{BUILD_NOTES_DIR}/simple.py"

#: How the task is run and scored: the JUnit pass rate of the hidden tests.
TASK_COMMAND = (
    f"cd {REPO_DIR} && PYTHONPATH=src python3 -m pytest -q -p no:cacheprovider "
    f"--junitxml={JUNIT} tests/test_hidden.py"
)


def demo_plan(index_url: str) -> list[dict[str, Any]]:
    """The demo's build plan (the steps the scripted driver replays, tool by tool): copy the
    repository in, stub ``add_one`` and describe the task, install the dependency from the
    index at ``index_url``, keep notes (scrubbed), and finish with the task, its hidden tests,
    reference solution and the notes (all three secret) and two declared checks."""
    files = files_of(SAMPLE_PROJECT)
    dirs = sorted({posixpath.dirname(f"{REPO_DIR}/{p}") for p in files})
    steps: list[dict[str, Any]] = [
        {
            "tool": "exec",
            "args": {"command": "mkdir -p " + " ".join([*dirs, BUILD_NOTES_DIR])},
            "expect_exit": 0,
        }
    ]
    for path, text in files.items():
        steps.append({"tool": "write", "args": {"path": f"{REPO_DIR}/{path}", "content": text}})
    steps += [
        {"tool": "write", "args": {"path": f"{REPO_DIR}/src/sample/simple.py", "content": STUB}},
        {"tool": "write", "args": {"path": f"{REPO_DIR}/TASK.md", "content": TASK_TEXT}},
        {"tool": "exec", "args": {"command": install_command(index_url)}, "expect_exit": 0},
        {
            "tool": "exec",
            "args": {"command": "python3 -c 'import peppercorn'", "cwd": REPO_DIR},
            "expect_exit": 0,
        },
        # the builder's own files: notes, the hidden tests and the reference solution, kept
        # in the notes dir (never packed) and handed to finish by path
        {"tool": "write", "args": {"path": f"{BUILD_NOTES_DIR}/NOTES.md", "content": NOTES}},
        {"tool": "write", "args": {"path": HIDDEN_TEST_FILE, "content": HIDDEN_TEST}},
        {"tool": "write", "args": {"path": REFERENCE_FILE, "content": REFERENCE}},
        {"tool": "list", "args": {"path": REPO_DIR}},
        {
            "tool": "finish",
            "args": {
                "checks": [
                    {
                        "name": "imports",
                        "command": f"cd {REPO_DIR} && PYTHONPATH=src python3 -c "
                        "'import sample.simple, peppercorn'",
                    },
                    {"name": "notes-scrubbed", "command": f"test ! -e {BUILD_NOTES_DIR}"},
                ],
                "task": {
                    "name": DEMO_TASK,
                    "description": "Implement sample.simple.add_one (pypa/sampleproject).",
                    "command": TASK_COMMAND,
                    "reward": "pass_rate",
                    "report": JUNIT,
                    "timeout": 120,
                    "tests": {f"{REPO_DIR}/tests/test_hidden.py": {"file": HIDDEN_TEST_FILE}},
                    "reference": {f"{REPO_DIR}/src/sample/simple.py": {"file": REFERENCE_FILE}},
                    # the notes are the builder's only: a hit would fail the build
                    "secrets": [NOTES],
                },
            },
        },
    ]
    return steps


def files_of(tree: Path) -> dict[str, str]:
    """A tree's files as {path relative to it: text} (the sample repository is all text)."""
    return {
        p.relative_to(tree).as_posix(): p.read_text()
        for p in sorted(tree.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@dataclass
class DemoResult:
    """What ``run_build_demo`` did: the build, the index and what it served, the plan's
    steps, ``finish``'s result (layer, environment, QA report) and the task's rollout."""

    build: str
    version: str
    from_env: str
    index_url: str
    index_requests: list[str]
    plan_file: str
    steps: list[dict[str, Any]]
    finish: dict[str, Any]
    rollouts: list[dict[str, Any]]
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def next_version(store: LayerStore, name: str) -> str:
    """One past the highest integer version of ``name``'s layers (staged and tests layers
    included): a layer's version is immutable, so each demo run publishes a new one."""
    names = {name, STAGED_PREFIX + name, f"{name}-tests"}
    versions = [int(i.version) for i in store.list() if i.name in names and i.version.isdigit()]
    return str(max(versions, default=0) + 1)


def _forget_unfinished(ctx: BuildContext, name: str) -> None:
    """A build of this name a previous run left open (interrupted): kill its session and drop
    its staged layer and record, as ``dsec build rm`` does."""
    try:
        record = ctx.store.get(name)
    except UnknownBuild:
        return
    if record.state not in LIVE_STATES:
        return
    BuildSession.attach(ctx, name).kill()
    store = LayerStore(ctx.config.layer_dir)
    if record.staged and store.exists(record.staged):
        store.remove(record.staged)
    ctx.store.remove(name)


def run_build_demo(
    *, name: str = DEMO_BUILD, from_env: str = "python", console: Console | None = None
) -> DemoResult:
    """Build the demo's task environment through the builder and run its task, on the local
    node (``DSEC_HOME``; ``DSEC_ADDRESS`` is refused).

    Builds the default catalog if ``from_env`` is not registered and starts the embedded node
    if none runs (as ``dsec demo`` does); serves ``index_wheels`` as a package index attached
    to the node's egress namespace; opens build ``name`` from ``from_env`` with a policy
    granting only that index; replays ``demo_plan`` through the scripted driver (its last
    step, ``finish``, scrubs, packs, runs QA and publishes catalog ``name``); then runs the
    published task as ``dsec demo`` runs its tasks. A failure at any step raises its typed
    error; the index and the build session are gone either way."""
    console = console or Console()
    if os.environ.get("DSEC_ADDRESS"):
        raise InvalidSpec(
            "dsec build demo runs on the local node (DSEC_HOME): its package index is attached "
            "to that node's egress namespace; unset DSEC_ADDRESS",
            field="DSEC_ADDRESS",
        )
    config = NodeConfig.from_env()
    config.ensure_dirs()
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        CatalogStore(config.catalog_dir).environment(from_env)
    except UnknownEnvironment:
        # one of the default catalog's, not built yet: build it; any other is an error
        shipped = load_catalog(default_catalog_file())
        if from_env not in {e.name for e in shipped.environments}:
            raise
        ensure_catalog(default_catalog_file(), config, console)
    Client().close()  # start the embedded node if none runs
    ctx = BuildContext.from_env()
    try:
        _forget_unfinished(ctx, name)
        version = next_version(LayerStore(config.layer_dir), name)
        with tempfile.TemporaryDirectory(prefix="dsec-build-demo-") as tmp:
            wheels = index_wheels(Path(tmp) / "wheels")
            with EgressIndex(config.home, wheels, Path(tmp) / "index.jsonl") as index:
                served = ", ".join(sorted(p.name for p in wheels.iterdir()))
                console.print(
                    f"package index {index.url} ({served}), reachable from the node's egress "
                    f"namespace only; build {name}@{version} from {from_env}, granted it",
                    markup=False,
                    highlight=False,
                )
                plan = demo_plan(index.url)
                policy = BuildPolicy((PackageIndex("pip", index.url),))
                seconds["setup"] = round(time.monotonic() - t0, 2)
                t = time.monotonic()
                session = BuildSession.start(
                    ctx, from_env=from_env, name=name, version=version, policy=policy
                )
                try:
                    plan_file = ctx.store.root / name / "plan.yaml"
                    plan_file.write_text(yaml.safe_dump(plan, sort_keys=False, width=100))
                    results = run_plan(plan_file, BuildTools(session))
                finally:
                    session.kill()  # finish ended it already when it published
                seconds["build"] = round(time.monotonic() - t, 2)
                requests = [f"{q.status} {q.method} {q.path}" for q in index.requests()]
                url = index.url
        result = DemoResult(
            build=name,
            version=version,
            from_env=from_env,
            index_url=url,
            index_requests=requests,
            plan_file=os.fspath(plan_file),
            steps=[
                {"tool": s["tool"], "summary": _summary(s, r)}
                for s, r in zip(plan, results, strict=True)
            ],
            finish=results[-1],
            rollouts=[],
        )
        print_summary(result, console)
        t = time.monotonic()
        task, hidden = graded_task(ctx, name, result.finish)
        result.rollouts = run_demo(tasks=[task], files={task.name: hidden}, console=console)
        seconds["rollout"] = round(time.monotonic() - t, 2)
    finally:
        ctx.close()
    seconds["total"] = round(time.monotonic() - t0, 2)
    result.seconds = seconds
    console.print(
        "times: " + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items()),
        markup=False,
        highlight=False,
    )
    return result


def graded_task(
    ctx: BuildContext, name: str, finish: Mapping[str, Any]
) -> tuple[Task, dict[str, str]]:
    """The task build ``name`` checked, as a grader runs it: the ``Task`` in the published
    environment, expecting the reward QA measured for the unmodified workspace, and its hidden
    tests ({absolute path: text}), which the environment does not hold (the build keeps them
    for graders, in its ``task.json``)."""
    doc = ctx.store.task(name)
    if doc is None:
        raise UnknownBuild(f"build {name} kept no task", name=name)
    environment = finish["environment"]
    spec = TaskSpec.from_dict(doc, environment)
    (unmodified,) = [c for c in finish["report"]["checks"] if c["name"] == "unmodified-fails"]
    workdir = CatalogStore(ctx.config.catalog_dir).environment(environment).workdir
    hidden = {posixpath.join(workdir, p): text for p, text in spec.tests.items()}
    return replace(spec.task, expect=unmodified["reward"]), hidden


def _summary(step: dict[str, Any], result: Any) -> str:
    args = step.get("args") or {}
    tool = step["tool"]
    if tool == "write":
        return f"{args['path']} ({result['bytes']} bytes)"
    if tool in ("exec", "session_exec"):
        command = args["command"]
        shown = command if len(command) <= 70 else command[:67] + "..."
        return f"exit {result['exit_code']}: {shown}"
    if tool == "list":
        return f"{args.get('path', '/')}: " + " ".join(e["name"] for e in result["entries"])
    if tool == "finish":
        layer = result.get("layer") or {}
        return f"published {layer.get('name')}@{layer.get('version')}"
    return ""


def print_summary(result: DemoResult, console: Console) -> None:
    """The demo's outcome, readably: the build's steps, QA's checks, where the task went."""
    steps = Table("#", "tool", "what", title=f"build {result.build} from {result.from_env}")
    for i, s in enumerate(result.steps):
        steps.add_row(str(i), s["tool"], s["summary"])
    console.print(steps)
    report = result.finish["report"]
    qa = Table(
        "check", "passed", "detail", title="QA (fresh sandboxes, runtime identity, no network)"
    )
    for c in report["checks"]:
        detail = ""
        if "reward" in c:
            detail = f"reward {c['reward']}"
        elif "rewards" in c:
            detail = f"rewards {c['rewards']}"
        elif c["kind"] == "size":
            detail = f"{c['size']} of {c['max_bytes']} bytes"
        elif "command" in c:
            detail = c["command"]
        qa.add_row(c["name"], "yes" if c["passed"] else "[red]no[/red]", detail)
    console.print(qa)
    layer = result.finish["layer"] or {}
    fetched = [r for r in result.index_requests if "/files/" in r]
    lines = [
        f"index {result.index_url}: {len(result.index_requests)} requests, fetched "
        + ", ".join(r.rsplit("/", 1)[-1] for r in fetched),
        f"published layer {layer.get('name')}@{layer.get('version')} "
        f"({layer.get('size')} bytes) and catalog {result.build}: environment "
        f"{result.finish['environment']}; QA report {result.finish['report_path']}",
        f"plan replayed by the scripted driver: {result.plan_file}",
        "now the task, as `dsec demo` runs one, with the hidden tests a grader adds (the "
        "workspace as shipped: add_one is a stub, so the reward expected is QA's unmodified one)",
    ]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


@click.command("demo")
@click.option("--name", default=DEMO_BUILD, show_default=True, help="The build's name.")
@click.option(
    "--from",
    "from_env",
    default="python",
    show_default=True,
    help="Environment to build from (one with pip, such as dev, uses its own pip).",
)
@click.option("--json", "as_json", is_flag=True, help="Also print the outcome as JSON.")
def demo_cmd(name: str, from_env: str, as_json: bool) -> None:
    """Build a task environment from a public repository offline (a local package index, the
    scripted driver, scrub, pack, QA, publish), then run its task as `dsec demo` does."""
    result = run_build_demo(name=name, from_env=from_env)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    if any(not r["ok"] for r in result.rollouts):
        raise DsecError("the built task did not give the reward QA measured for it")
