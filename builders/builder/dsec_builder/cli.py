"""``dsec build``: open a build session, drive it (exec, any tool, a plan, an MCP server),
finish it (scrub, pack, QA, publish), list and remove builds.

Each command re-attaches to the build by name through its record under
``$DSEC_HOME/builds``; clients come from the environment (``BuildContext.from_env``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import yaml

from dsec_core.errors import DsecError, InvalidSpec
from dsec_core.linux.processes import free_port

from .demo import demo_cmd
from .policy import BuildPolicy
from .qa import DEFAULT_MAX_BYTES, Check
from .session import BuildContext, BuildSession, LayerStore
from .tools import BuildTools

__all__ = ["build"]


def _dump(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@contextlib.contextmanager
def _context() -> Iterator[BuildContext]:
    ctx = BuildContext.from_env()
    try:
        yield ctx
    finally:
        ctx.close()


def _checks(pairs: tuple[str, ...]) -> list[Check]:
    out = []
    for item in pairs:
        name, sep, command = item.partition("=")
        if not sep or not name or not command:
            raise click.BadParameter(f"expected NAME=COMMAND, got {item!r}", param_hint="--check")
        out.append(Check(name, command))
    return out


def _start(ctx: BuildContext, from_env, name, version, policy, checks, **sandbox) -> BuildSession:
    pol = BuildPolicy.load(policy) if policy else BuildPolicy()
    extra = {k: v for k, v in sandbox.items() if v is not None}
    return BuildSession.start(
        ctx, from_env=from_env, name=name, version=version, policy=pol, checks=checks, **extra
    )


_start_options = [
    click.option("--from", "from_env", required=True, help="Environment to start from."),
    click.option("--version", default="1", show_default=True, help="Version to publish as."),
    click.option(
        "--policy",
        type=click.Path(exists=True, dir_okay=False),
        help="YAML: indexes: [{pip: URL}, {apt: URL}] the session may reach (default: none).",
    ),
    click.option("--check", "checks", multiple=True, help="NAME=COMMAND that QA runs; repeat."),
    click.option("--cpu", type=float, default=None, help="Session CPU cores (default 1)."),
    click.option("--memory", default=None, help="Session memory (default 2G)."),
    click.option("--ttl", type=float, default=None, help="Session lifetime, s (default 4h)."),
]


def _with_start_options(fn):
    for opt in reversed(_start_options):
        fn = opt(fn)
    return fn


@click.group()
def build() -> None:
    """Build environments in a sandbox: start, drive, finish (scrub, pack, QA, publish)."""


@build.command("start")
@_with_start_options
@click.option("--name", required=True, help="Name of the new environment (and its layer).")
@click.option("--json", "as_json", is_flag=True, help="Print the build record as JSON.")
def start_cmd(from_env, version, policy, checks, cpu, memory, ttl, name, as_json) -> None:
    """Open a build session: a sandbox of --from, under the builder's account."""
    with _context() as ctx:
        session = _start(
            ctx, from_env, name, version, policy, _checks(checks), cpu=cpu, memory=memory, ttl=ttl
        )
        record = session.record
    if as_json:
        _dump(record.to_dict())
    else:
        click.echo(f"build {record.name}: session {record.sandbox_id} from {record.from_env}")


@build.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--session", "use_session", is_flag=True, help="Run in the build's shell session.")
@click.option("--timeout", type=float, default=300.0, show_default=True)
def exec_cmd(name, command, use_session, timeout) -> None:
    """Run a shell command in build NAME's session; exits with its exit code."""
    with _context() as ctx:
        tools = BuildTools(BuildSession.attach(ctx, name))
        tool = "session_exec" if use_session else "exec"
        r = tools.call(tool, {"command": " ".join(command), "timeout": timeout})
    sys.stdout.write(r["stdout"])
    sys.stderr.write(r["stderr"])
    sys.exit(r["exit_code"])


@build.command("call")
@click.argument("name")
@click.argument("tool")
@click.argument("args", default="{}")
def call_cmd(name, tool, args) -> None:
    """Call one tool of build NAME with ARGS (a JSON object); prints its result."""
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="ARGS") from e
    if not isinstance(parsed, dict):
        raise click.BadParameter("a JSON object", param_hint="ARGS")
    with _context() as ctx:
        _dump(BuildTools(BuildSession.attach(ctx, name)).call(tool, parsed))


@build.command("finish")
@click.argument("name")
@click.option(
    "--spec",
    type=click.Path(exists=True, dir_okay=False),
    help="YAML: checks: [{name, command}], task: {...}, max_bytes.",
)
@click.option("--publish", "source", help="Also publish to this layer source (posix:, s3://...).")
@click.option("--max-bytes", default=None, help=f"Size budget (default {DEFAULT_MAX_BYTES}).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def finish_cmd(name, spec, source, max_bytes, as_json) -> None:
    """Scrub, pack (staged), QA and publish build NAME."""
    args: dict[str, Any] = {}
    if spec:
        doc = yaml.safe_load(Path(spec).read_text()) or {}
        if not isinstance(doc, dict):
            raise InvalidSpec(f"{spec}: expected a mapping of checks, task, max_bytes")
        args.update(doc)
    if max_bytes is not None:
        args["max_bytes"] = max_bytes
    if source:
        args["publish"] = source
    with _context() as ctx:
        done = BuildTools(BuildSession.attach(ctx, name)).call("finish", args)
    if as_json:
        _dump(done)
    else:
        click.echo(
            f"published {done['layer']['name']}@{done['layer']['version']}: "
            f"environment {done['environment']}, report {done['report_path']}"
        )


@build.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ls_cmd(as_json) -> None:
    """List builds: name, state, session sandbox, what they became."""
    with _context() as ctx:
        records = ctx.store.list()
    if as_json:
        _dump([r.to_dict() for r in records])
        return
    for r in records:
        what = r.published or r.staged or "-"
        click.echo(f"{r.name}\t{r.state}\t{r.sandbox_id}\t{r.from_env}\t{what}\t{r.error}")


@build.command("rm")
@click.argument("name")
def rm_cmd(name) -> None:
    """Remove build NAME: kill its session, drop its staged layer and its record."""
    with _context() as ctx:
        session = BuildSession.attach(ctx, name)
        record = session.record
        session.kill()
        if record.staged:
            store = LayerStore(ctx.config.layer_dir)
            with contextlib.suppress(DsecError):
                store.remove(record.staged)
        ctx.store.remove(name)
    click.echo(f"removed build {name}")


@build.command("mcp")
@click.option("--name", required=True, help="The build whose session to serve.")
@click.option("--http", is_flag=True, help="Streamable HTTP on 127.0.0.1 instead of stdio.")
@click.option("--port", type=int, default=0, help="HTTP port (default: a free one).")
def mcp_cmd(name, http, port) -> None:
    """Serve build NAME's tools as an MCP server (stdio, or --http on loopback)."""
    from .mcp_server import serve

    with _context() as ctx:
        tools = BuildTools(BuildSession.attach(ctx, name))
        if http:
            port = port or free_port()
            click.echo(f"MCP server of build {name}: http://127.0.0.1:{port}/mcp", err=True)
        serve(tools, http=http, port=port)


@build.command("run")
@click.argument("plan", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", required=True, help="The build (started here if --from is given).")
@click.option("--from", "from_env", default=None, help="Start a new build from this environment.")
@click.option("--version", default="1", show_default=True)
@click.option("--policy", type=click.Path(exists=True, dir_okay=False))
def run_cmd(plan, name, from_env, version, policy) -> None:
    """Replay PLAN (a YAML list of {tool, args}) in build NAME; prints each step's result."""
    from .plan import run_plan

    with _context() as ctx:
        if from_env:
            session = _start(ctx, from_env, name, version, policy, [])
        else:
            session = BuildSession.attach(ctx, name)
        _dump(run_plan(Path(plan), BuildTools(session)))


# `dsec build demo`: the whole path on a public repository, offline (dsec_builder.demo)
build.add_command(demo_cmd)
