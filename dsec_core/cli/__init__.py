"""The ``dsec`` command line: plugins, layers, catalogs, sandboxes, the node daemon, the demo.

A ``DsecError`` prints ``Error: ...`` and exits 1; any other exception is a bug and keeps its
traceback. The client commands (sandboxes, fncall, judge, trajectories, ``node status``) run in
a client-only install (``pip install dsec``); the node side's (``NODE_SIDE_GROUPS``, ``node
start``, ``demo``, ``plugins``) and the plugins' commands need ``dsec[node]`` and say so
(``NodeSideMissing``) where it is not installed.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from .. import __version__
from ..config import NodeConfig
from ..errors import DsecError
from ..extras import INSTALL_NODE, missing, require_node
from ..localnode import ensure_daemon, ping, stop_daemon
from ..records import COMPARE_MODES, QOS_CLASSES, JudgeCase, JudgeSpec, SandboxSpec
from ..sdk import AsyncClient, Client

__all__ = ["cli", "main"]

console = Console()
#: ``dsec node status``'s lines on the CPU classes: NodeStatus.qos's fields, in words.
QOS_FEATURES = {
    "sched_idle": "best effort, SCHED_IDLE",
    "cpu_idle": "best effort, cgroup cpu.idle",
    "core_scheduling": "latency-sensitive, core scheduling",
}


DEVICE_HELP = (
    "KIND[:COUNT[:MODE]] from the node's DSEC_DEVICES, MODE exclusive (default) or shared, "
    "e.g. gpu or gpu:2:shared; repeat for other kinds."
)


def _dump(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _kv(pairs: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=what)
        out[key] = value
    return out


class LazyGroup(click.Group):
    """A group whose subcommands named in ``lazy`` (name -> ``module:attribute``) are imported
    when first used: a client command does not load the apiserver, the cluster or the builder
    (each ``dsec`` run spent about 0.4 s importing them). Those in ``node_side`` need
    ``dsec[node]``: where it is not installed, each is a ``needs_node_side`` stand-in."""

    def __init__(
        self,
        *args: Any,
        lazy: dict[str, str] | None = None,
        node_side: frozenset[str] = frozenset(),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})
        self.node_side = node_side

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            if cmd_name in self.node_side and missing():
                return needs_node_side(f"dsec {cmd_name}")
            module, _, attribute = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module, __package__), attribute)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            if not missing():
                raise
            # a plugin's command (`dsec build`, say) is not there without the node side
            raise click.UsageError(
                f"{e.message.rstrip('.')}. This install is dsec's client alone: the node "
                f"side's commands and the plugins' come with {INSTALL_NODE}",
                e.ctx,
            ) from None


def needs_node_side(command: str) -> click.Command:
    """A stand-in for ``command`` in a client-only install: it takes any arguments and fails
    with ``NodeSideMissing`` saying what to install."""

    def fail(args: tuple[str, ...]) -> None:
        require_node(command)

    return click.Command(
        command.rpartition(" ")[2],
        callback=fail,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        help=f"(needs dsec's node side: {INSTALL_NODE})",
        add_help_option=False,
    )


#: The subcommand groups kept in modules of their own, imported when used.
LAZY_GROUPS = {
    "layer": ".layers:layer",
    "catalog": ".layers:catalog",
    "plugin": ".plugin:plugin",
    "apiserver": ".apiserver:apiserver",
    "iam": ".iam:iam",
    "cluster": ".cluster:cluster",
    "rollout": ".rollout:rollout",
    "mcp": ".mcp:mcp",
}
#: Those of them that are the node side's: they import what only ``dsec[node]`` installs.
#: (``iam`` is not: over an apiserver's API it is a client, and its store is SQLite's or etcd's
#: HTTP, both standard library.)
NODE_SIDE_GROUPS = frozenset({"layer", "catalog", "plugin", "apiserver", "cluster"})


@click.group(cls=LazyGroup, lazy=LAZY_GROUPS, node_side=NODE_SIDE_GROUPS)
@click.version_option(__version__, prog_name="dsec")
def cli() -> None:
    """dsec: elastic sandboxes for agentic RL on composed EROFS layers."""


# --- plugins -------------------------------------------------------------------------------


@cli.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def plugins_cmd(as_json: bool) -> None:
    """List plugins with their versions, plugin API and hooks, and those that failed, with why
    (they are skipped; everything else works without them)."""
    require_node("dsec plugins")
    from ..plugins import plugin_descriptions, registry  # the node side's (pluggy)

    descs = plugin_descriptions()
    reg = registry()
    provided = {
        "backends": sorted(reg.backends),
        "layer_sources": sorted(reg.layer_sources),
        "security_policies": sorted(reg.security_policies),
    }
    if as_json:
        _dump({"plugins": descs, **provided})
        return
    table = Table(
        "plugin", "version", "distribution", "api", Column("hooks or error", overflow="fold")
    )
    for d in descs:
        shown = ", ".join(d["hooks"]) if d["error"] is None else f"[red]{escape(d['error'])}[/]"
        if d["error"] is not None and d["hooks"]:  # it lost a name but works otherwise
            shown = f"{', '.join(d['hooks'])}\n{shown}"
        table.add_row(d["name"], str(d["version"]), str(d["distribution"]), str(d["api"]), shown)
    console.print(table)
    for key, names in provided.items():
        console.print(f"{key.replace('_', ' ')}: {', '.join(names) or '-'}")
    failed = [d["name"] for d in descs if d["error"] is not None]
    if failed:
        console.print(f"[red]failed[/]: {', '.join(failed)} (skipped, or a name they lost)")


# --- sandboxes -----------------------------------------------------------------------------


@cli.group()
def sandbox() -> None:
    """Create, use and remove sandboxes on the local node."""


@sandbox.command("create")
@click.option("--env", "environment", help="Catalog environment (base + workspaces + toolkits).")
@click.option("--layer", "layers", multiple=True, help="name@version; repeat, top layer first.")
@click.option(
    "--backend",
    default=None,
    help="Backend (container, microvm, ...); default: the environment's, else container.",
)
@click.option("--cpu", type=float, default=1.0, show_default=True, help="CPU cores.")
@click.option("--memory", default="512M", show_default=True)
@click.option("--pids", type=int, default=512, show_default=True)
@click.option("--disk", default="10G", show_default=True, help="Writable layer size (quota).")
@click.option("--ttl", type=float, default=3600.0, show_default=True, help="Lifetime, seconds.")
@click.option(
    "--qos",
    type=click.Choice(QOS_CLASSES),
    default="ls",
    show_default=True,
    help="CPU class: ls (latency-sensitive) or be (best effort: SCHED_IDLE, lowest weight).",
)
@click.option(
    "--runtime",
    default=None,
    help="OCI runtime: runc, or runsc (gVisor); default: the node's (DSEC_RUNTIME).",
)
@click.option("-e", "--setenv", multiple=True, help="KEY=VALUE environment for commands.")
@click.option("--device", "devices", multiple=True, help=DEVICE_HELP)
@click.option("-n", "--count", type=int, default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def sandbox_create(
    environment,
    layers,
    backend,
    cpu,
    memory,
    pids,
    disk,
    ttl,
    qos,
    runtime,
    setenv,
    devices,
    count,
    as_json,
) -> None:
    """Create sandboxes and print their ids."""
    spec = SandboxSpec(
        environment=environment,
        layers=tuple(layers),
        backend=backend,
        cpu=cpu,
        memory=memory,
        pids=pids,
        disk=disk,
        ttl=ttl,
        env=_kv(setenv, "--setenv"),
        qos=qos,
        devices=devices,
        runtime=runtime,
    )
    Client().close()  # starts the node if needed, before the progress bar
    if count == 1:
        with Client() as client:
            infos = [client.create(spec).info]
    else:

        async def many() -> list:
            async with AsyncClient() as client:
                with Progress(
                    TextColumn("creating sandboxes"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=Console(stderr=True),
                ) as bar:
                    task = bar.add_task("create", total=count)

                    async def one():
                        sb = await client.create(spec)
                        bar.advance(task)
                        return sb

                    results = await asyncio.gather(
                        *(one() for _ in range(count)), return_exceptions=True
                    )
                made = [r for r in results if not isinstance(r, BaseException)]
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    await asyncio.gather(*(s.kill() for s in made), return_exceptions=True)
                    raise failed[0]
                return [s.info for s in made]

        infos = asyncio.run(many())
    if as_json:
        _dump([i.to_dict() for i in infos])
    else:
        for info in infos:
            click.echo(info.id)


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=float, default=300.0, show_default=True)
@click.option("--cwd")
@click.option("-e", "--setenv", multiple=True, help="KEY=VALUE")
@click.option("--background", is_flag=True, help="let processes it starts outlive it")
@click.option("--exclusive", is_flag=True, help="kill every other process in the sandbox first")
@click.option("--json", "as_json", is_flag=True)
def sandbox_exec(sandbox_id, command, timeout, cwd, setenv, background, exclusive, as_json) -> None:
    """Run COMMAND in a sandbox (one argument: through /bin/sh -c; several: as argv)."""
    cmd: str | list[str] = command[0] if len(command) == 1 else list(command)
    with Client() as client:
        r = client.exec(
            sandbox_id,
            cmd,
            timeout=timeout,
            cwd=cwd,
            env=_kv(setenv, "--setenv"),
            stdin=None if sys.stdin.isatty() else sys.stdin.buffer.read(),
            background=background,
            exclusive=exclusive,
        )
    if as_json:
        d = r.to_dict()
        d["stdout"], d["stderr"] = (
            r.stdout.decode(errors="replace"),
            r.stderr.decode(errors="replace"),
        )
        _dump(d)
    else:
        sys.stdout.buffer.write(r.stdout)
        sys.stderr.buffer.write(r.stderr)
        if r.truncated:
            click.echo("dsec: output truncated", err=True)
        if r.timed_out:
            click.echo(f"dsec: timed out after {timeout}s", err=True)
    sys.exit(r.exit_code if 0 <= r.exit_code < 256 else 1)


@cli.command("fncall", context_settings={"ignore_unknown_options": True})
@click.argument("environment")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=float, default=300.0, show_default=True)
@click.option("-e", "--setenv", multiple=True, help="KEY=VALUE")
@click.option("-f", "--file", "files", multiple=True, help="NAME=LOCAL_PATH: written first")
@click.option("--cpu", type=float, default=1.0, show_default=True)
@click.option("--memory", default="512M", show_default=True)
@click.option("--device", "devices", multiple=True, help=DEVICE_HELP)
@click.option("--json", "as_json", is_flag=True)
def fncall(environment, command, timeout, setenv, files, cpu, memory, devices, as_json) -> None:
    """Run COMMAND in a warm member of ENVIRONMENT's FnCall pool (one argument: through
    /bin/sh -c; several: as argv)."""
    cmd: str | list[str] = command[0] if len(command) == 1 else list(command)
    contents = {name: Path(local).read_bytes() for name, local in _kv(files, "--file").items()}
    with Client() as client:
        r = client.fncall(
            environment,
            cmd,
            timeout=timeout,
            env=_kv(setenv, "--setenv"),
            stdin=None if sys.stdin.isatty() else sys.stdin.buffer.read(),
            files=contents or None,
            cpu=cpu,
            memory=memory,
            devices=devices,
        )
    if as_json:
        d = r.to_dict()
        d["stdout"], d["stderr"] = (
            r.stdout.decode(errors="replace"),
            r.stderr.decode(errors="replace"),
        )
        _dump(d)
    else:
        sys.stdout.buffer.write(r.stdout)
        sys.stderr.buffer.write(r.stderr)
        if r.error:
            click.echo(f"dsec: {r.error} (member {r.member} replaced)", err=True)
        if r.timed_out:
            click.echo(f"dsec: timed out after {timeout}s", err=True)
    sys.exit(r.exit_code if 0 <= r.exit_code < 256 else 1)


@cli.command("judge")
@click.argument("environment")
@click.option("--run", "run_cmd", required=True, help="how to run the program (through /bin/sh -c)")
@click.option("--compile", "compile_cmd", help="run once before the cases; failing is CE")
@click.option("-f", "--file", "files", multiple=True, help="NAME=LOCAL_PATH: the submission")
@click.option(
    "--cases-dir",
    help="NAME.in/NAME.out inside the environment's working directory [default: cases]",
)
@click.option(
    "--case", "case_files", multiple=True, help="IN_PATH:OUT_PATH, local files (repeatable)"
)
@click.option("--time-limit", type=float, default=2.0, show_default=True, help="CPU s per case")
@click.option("--memory-limit", default="256M", show_default=True, help="per case")
@click.option("--compare", type=click.Choice(COMPARE_MODES), default="lines", show_default=True)
@click.option("--memory", default="1G", show_default=True, help="the member's own limit")
@click.option("--json", "as_json", is_flag=True)
def judge(
    environment,
    run_cmd,
    compile_cmd,
    files,
    cases_dir,
    case_files,
    time_limit,
    memory_limit,
    compare,
    memory,
    as_json,
) -> None:
    """Judge a submission in a warm member of ENVIRONMENT's FnCall pool: compile once, then run
    it on each case with its own time and memory limit. Exits 0 if every case is accepted."""
    contents = {name: Path(local).read_bytes() for name, local in _kv(files, "--file").items()}
    cases = []
    for i, pair in enumerate(case_files, 1):
        given, sep, expected = pair.partition(":")
        if not sep:
            raise click.BadParameter(
                f"expected IN_PATH:OUT_PATH, got {pair!r}", param_hint="--case"
            )
        cases.append(
            JudgeCase(
                Path(given).read_bytes(), Path(expected).read_bytes(), Path(given).stem or str(i)
            )
        )
    spec = JudgeSpec(
        environment=environment,
        run=run_cmd,
        compile=compile_cmd,
        files=contents,
        cases=tuple(cases),
        cases_dir=None if cases else cases_dir or "cases",
        time_limit=time_limit,
        memory_limit=memory_limit,
        compare=compare,
        memory=memory,
    )
    with Client() as client:
        r = client.judge(spec)
    if as_json:
        d = r.to_dict()
        d["compile_output"] = r.compile_output.decode(errors="replace")
        for c in d["cases"]:
            c["stdout"] = c["stdout"].decode(errors="replace")
            c["stderr"] = c["stderr"].decode(errors="replace")
        _dump(d)
    else:
        table = Table(
            "case",
            "verdict",
            "CPU s",
            "wall s",
            "memory",
            "detail",
            title=f"{environment}: {r.verdict} ({r.passed}/{r.total} accepted)",
        )
        for c in r.cases:
            mem = "-" if c.memory is None else f"{c.memory / (1 << 20):.1f} MiB"
            table.add_row(c.name, c.verdict, f"{c.time:.3f}", f"{c.wall:.3f}", mem, c.detail)
        Console().print(table)
        if r.verdict == "CE":
            sys.stderr.buffer.write(r.compile_output)
    sys.exit(0 if r.ok else 1)


@sandbox.command("ls")
@click.option("--json", "as_json", is_flag=True)
def sandbox_ls(as_json) -> None:
    """List sandboxes on the local node."""
    with Client() as client:
        infos = client.list()
    if as_json:
        _dump([i.to_dict() for i in infos])
        return
    table = Table(
        "state", "backend", "environment / layers", "cpu", "qos", "memory", "age", "expires in"
    )
    table.columns.insert(0, Column("id", no_wrap=True))
    now = time.time()
    for i in infos:
        table.add_row(
            i.id,
            i.state,
            i.backend,
            i.environment or ",".join(i.layers),
            str(i.limits.get("cpu")),
            i.qos,
            f"{int(i.limits.get('memory', 0)) >> 20}M",
            f"{now - i.created:.0f}s",
            f"{i.expires - now:.0f}s" if i.expires else "-",
        )
    console.print(table)


@sandbox.command("inspect")
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True)
def sandbox_inspect(sandbox_id, as_json) -> None:
    """Show a sandbox: what it is, what it uses, and its security policies (in force, with
    what they saw, such as denied connections; or why not)."""
    with Client() as client:
        info = client.get(sandbox_id).info
        usage = client.usage(sandbox_id)
        policies = client.policies(sandbox_id)
    if as_json:
        _dump(
            {
                "sandbox": info.to_dict(),
                "usage": usage.to_dict(),
                "policies": [p.to_dict() for p in policies],
            }
        )
        return
    console.print(
        f"sandbox {info.id}: {info.state}, backend {info.backend}, "
        f"{info.environment or ', '.join(info.layers)}"
    )
    console.print(f"usage: memory {usage.memory}, cpu {usage.cpu_seconds} s, pids {usage.pids}")
    if info.devices:
        console.print(f"devices: {', '.join(info.devices)}", highlight=False)
    table = Table("policy", "state", "settings", "seen")
    for p in policies:
        table.add_row(
            p.name,
            p.state,
            json.dumps(dict(p.settings)) if p.settings else "",
            ", ".join(f"{k}={v}" for k, v in p.stats.items()),
        )
    console.print(table)


@sandbox.command("policy")
@click.argument("sandbox_id")
@click.argument("policy")
@click.argument("settings")
def sandbox_policy(sandbox_id, policy, settings) -> None:
    """Change live POLICY of a running sandbox to SETTINGS (a JSON object)."""
    try:
        new = json.loads(settings)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="SETTINGS") from None
    if not isinstance(new, dict):
        raise click.BadParameter("expected a JSON object", param_hint="SETTINGS")
    with Client() as client:
        state = client.set_policy(sandbox_id, policy, new)
    click.echo(f"{state.name}: {state.state} {json.dumps(dict(state.settings))}")


@sandbox.command("pack-diff")
@click.argument("sandbox_id")
@click.option("--name", help="Layer name (default snapshot-<id>).")
@click.option("--version", "version", help="Layer version (default: its digest's first 12 hex).")
@click.option("--exclude", multiple=True, help="A path inside left out; repeat.")
@click.option(
    "--no-scrub", is_flag=True, help="Keep /tmp, caches and shell histories in the snapshot."
)
@click.option("--source", help="Also push it (and the parents it lacks) to this layer source.")
@click.option(
    "--secret",
    "secret_files",
    multiple=True,
    metavar="LABEL=FILE",
    help="Fail (and keep no layer) if FILE's text, or any of its lines of 24+ characters, is "
    "in the snapshot; LABEL names it in the error. Repeat.",
)
@click.option("--json", "as_json", is_flag=True)
def sandbox_pack_diff(
    sandbox_id, name, version, exclude, no_scrub, source, secret_files, as_json
) -> None:
    """Pack a running sandbox's writable layer into a snapshot layer; print its ref."""
    secrets: dict[str, str] = {}
    for item in secret_files:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise click.BadParameter(f"expected LABEL=FILE, got {item!r}", param_hint="--secret")
        try:
            secrets[label] = Path(path).read_text(errors="replace")
        except OSError as e:
            raise click.BadParameter(f"cannot read {path}: {e}", param_hint="--secret") from None
    with Client() as client:
        info = client.pack_diff(
            sandbox_id,
            name=name,
            version=version,
            exclude=exclude,
            scrub=not no_scrub,
            source=source,
            secrets=secrets,
        )
    if as_json:
        _dump(info.to_dict())
    else:
        click.echo(f"{info.ref} {info.digest} {info.size} bytes over {', '.join(info.parents)}")


@sandbox.command("snapshot-memory")
@click.argument("sandbox_id")
@click.option("--name", help="The snapshot's name (default <id>-<unix time>).")
@click.option("--json", "as_json", is_flag=True)
def sandbox_snapshot_memory(sandbox_id, name, as_json) -> None:
    """Save a running VM sandbox's memory, devices and disk at one instant (it runs on);
    `dsec sandbox restore NAME -n N` starts N sandboxes from there."""
    with Client() as client:
        snap = client.snapshot_memory(sandbox_id, name)
    if as_json:
        _dump(snap.to_dict())
    else:
        click.echo(f"{snap.name} {snap.bytes} bytes ({snap.backend} sandbox {snap.sandbox_id})")


@sandbox.command("rm-memory-snapshot")
@click.argument("name")
def sandbox_rm_memory_snapshot(name) -> None:
    """Remove a memory snapshot."""
    with Client() as client:
        client.remove_memory_snapshot(name)


@sandbox.command("restore")
@click.argument("snapshot")
@click.option("-n", "--count", type=int, default=1, show_default=True)
@click.option("--memory", default="512M", show_default=True)
@click.option("--cpu", type=float, default=1.0, show_default=True, help="CPU cores.")
@click.option("--disk", default="10G", show_default=True, help="Writable layer size (quota).")
@click.option("--ttl", type=float, default=3600.0, show_default=True, help="Lifetime, seconds.")
@click.option("--json", "as_json", is_flag=True)
def sandbox_restore(snapshot, count, memory, cpu, disk, ttl, as_json) -> None:
    """Create COUNT sandboxes that each start from SNAPSHOT (a snapshot layer's name@version,
    or a memory snapshot's name: then its own limits apply); print their ids."""
    with Client() as client:
        made = client.restore(snapshot, n=count, memory=memory, cpu=cpu, disk=disk, ttl=ttl)
    if as_json:
        _dump([sb.info.to_dict() for sb in made])
    else:
        for sb in made:
            click.echo(sb.id)


@sandbox.command("rm")
@click.argument("sandbox_ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Remove every sandbox on the node.")
def sandbox_rm(sandbox_ids, all_) -> None:
    """Kill sandboxes and remove everything they left."""
    with Client() as client:
        ids = [i.id for i in client.list()] if all_ else list(sandbox_ids)
        if not ids and not all_:
            raise click.UsageError("name sandbox ids, or --all")
        for sid in ids:
            client.kill(sid)
            click.echo(f"removed {sid}")


@sandbox.command("pause")
@click.argument("sandbox_ids", nargs=-1, required=True)
@click.option("--reclaim", is_flag=True, help="then take back their page cache")
def sandbox_pause(sandbox_ids, reclaim) -> None:
    """Stop every process of the sandboxes where it is (memory, files, sessions stay)."""
    with Client() as client:
        for info in client.pause(list(sandbox_ids), reclaim=reclaim):
            click.echo(f"paused {info.id}")


@sandbox.command("resume")
@click.argument("sandbox_ids", nargs=-1, required=True)
def sandbox_resume(sandbox_ids) -> None:
    """Let paused sandboxes go on where they were."""
    with Client() as client:
        for info in client.resume(list(sandbox_ids)):
            click.echo(f"resumed {info.id}")


@sandbox.command("screenshot")
@click.argument("sandbox_id")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), required=True, help="the PNG file to write"
)
def sandbox_screenshot(sandbox_id, output) -> None:
    """Save a sandbox's display as a PNG image (backends with a screen: vm)."""
    with Client() as client:
        png = client.screenshot(sandbox_id)
    Path(output).write_bytes(png)
    click.echo(f"wrote {output} ({len(png)} bytes)")


def _point(value: str, what: str) -> tuple[int, int]:
    x, sep, y = value.partition(",")
    if not sep or not x.strip().isdigit() or not y.strip().isdigit():
        raise click.BadParameter(f"{value!r} is not X,Y in pixels", param_hint=what)
    return int(x), int(y)


@sandbox.command("input")
@click.argument("sandbox_id")
@click.option("--click", "clicks", multiple=True, metavar="X,Y", help="click (left) at X,Y")
@click.option("--key", "keys", multiple=True, metavar="KEY", help="press a key (QEMU name: a, ret)")
@click.option("--move", "moves", multiple=True, metavar="X,Y", help="move the pointer to X,Y")
@click.option("--button", default="left", show_default=True, help="the button --click presses")
def sandbox_input(sandbox_id, clicks, keys, moves, button) -> None:
    """Send input to a sandbox's display: moves, then clicks, then keys, each in the order
    given (call it again for another order)."""
    events: list[dict[str, Any]] = [
        {"type": "move", "x": x, "y": y} for x, y in (_point(m, "--move") for m in moves)
    ]
    events += [
        {"type": "click", "x": x, "y": y, "button": button}
        for x, y in (_point(c, "--click") for c in clicks)
    ]
    events += [{"type": "key", "key": k} for k in keys]
    if not events:
        raise click.UsageError("say what to send: --click X,Y, --key KEY or --move X,Y")
    with Client() as client:
        sent = client.input(sandbox_id, events)
    click.echo(f"sent {sent} event(s)")


@sandbox.command("events")
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per event")
def sandbox_events(sandbox_id, as_json) -> None:
    """The infrastructure failures that struck a sandbox (preempted, out of memory, ...)."""
    with Client() as client:
        for event in client.events(sandbox_id):
            if as_json:
                click.echo(json.dumps(event.to_dict()))
            else:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.at))
                click.echo(f"{when}  {event.kind:<14} {event.detail}")


@cli.group()
def trajectory() -> None:
    """Trajectory logs: the commands a rollout loop ran, which a restarted loop replays."""


@trajectory.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per step")
def trajectory_show(name, as_json) -> None:
    """Every step of trajectory NAME: the command and how it ended."""
    with Client() as client:
        for e in client.trajectory(name):
            r = e.result
            if as_json:
                row = {"step": e.step, "sandbox_id": e.sandbox_id, "command": e.command}
                row |= {"exit_code": r.exit_code, "timed_out": r.timed_out}
                row |= {"stdout": r.stdout.decode("utf-8", "replace")}
                click.echo(json.dumps(row | {"stderr": r.stderr.decode("utf-8", "replace")}))
            else:
                end = "timed out" if r.timed_out else f"exit {r.exit_code}"
                click.echo(f"{e.step:>5}  {e.sandbox_id}  {end:<10} {e.command}")


@trajectory.command("rm")
@click.argument("name")
def trajectory_rm(name) -> None:
    """Remove trajectory log NAME."""
    with Client() as client:
        client.remove_trajectory(name)
    click.echo(f"removed {name}")


# --- node ----------------------------------------------------------------------------------


@cli.group()
def node() -> None:
    """Start, stop and inspect the local node daemon."""


@node.command("start")
@click.option("--foreground", is_flag=True, help="Run in this process (logs to stderr).")
def node_start(foreground) -> None:
    """Start the node daemon (no-op if it runs)."""
    require_node("dsec node start")
    if foreground:
        # Imported here: the daemon (uvicorn, starlette, the node) adds a quarter of a second
        # to every other command's start-up.
        from ..node.daemon import serve

        serve(foreground=True)
        return
    info = ensure_daemon()
    click.echo(
        f"node daemon {info['pid']} serving {NodeConfig.from_env().socket_path} "
        f"({info['sandboxes']} sandboxes)"
    )


@node.command("stop")
def node_stop() -> None:
    """Stop the node daemon; sandboxes keep running and are re-adopted on the next start."""
    pid = stop_daemon()
    click.echo(f"stopped node daemon {pid}" if pid else "no node daemon running")


@node.command("status")
@click.option("--json", "as_json", is_flag=True)
def node_status(as_json) -> None:
    """Show whether the daemon runs and what it holds."""
    info = ping(NodeConfig.from_env())
    if as_json:
        _dump(info or {"running": False})
    elif info is None:
        click.echo("node daemon: not running")
    else:
        click.echo(
            f"node daemon: running (pid {info['pid']}), home {info['home']}, "
            f"{info['sandboxes']} sandboxes, backends {', '.join(info['backends'])}"
        )
        for name, what in QOS_FEATURES.items():
            feature = (info.get("qos") or {}).get(name)
            if feature is not None:
                state = "available" if feature["available"] else "unavailable"
                click.echo(f"{what}: {state}: {feature['detail']}")
        for pool in info.get("pools") or ():
            # a shared pool (no project: the node's direct callers) keeps the line it had
            owner = f" (project {pool['project']})" if pool.get("project") else ""
            click.echo(
                f"fncall pool {pool['name']}{owner}: {pool['size']} members ({pool['free']} free, "
                f"min {pool['min']}, max {pool['max']}), {pool['waiting']} calls waiting, "
                f"{pool['replaced']} replaced"
            )
        for dev in info.get("devices") or ():
            click.echo(_device_line(dev))
        for line in _warm_lines(info.get("warm") or {}):
            click.echo(line)
        reclaim = info.get("reclaim")
        if reclaim:
            click.echo(_reclaim_line(reclaim))
    if info is None:
        sys.exit(3)


def _reclaim_line(r: dict[str, Any]) -> str:
    """``vm memory reclaim: on, every 30s, floor 0.25 of ...; 12 passes gave back 310 MiB;
    cold memory by ...; DAMON: ...``"""
    if not r["enabled"]:
        return "vm memory reclaim: off (DSEC_VM_RECLAIM=0)"
    damon = "free, unused" if r["damon"] else "unavailable"
    return (
        f"vm memory reclaim: on, every {r['interval']:g}s, floor {r['floor']}; "
        f"{r['passes']} passes gave back {r['given_back'] >> 20} MiB; cold memory by "
        f"{r['monitor']}; DAMON {damon}: {r['damon_detail']}"
    )


def _warm_lines(warm: dict[str, Any]) -> list[str]:
    """``warm pool kit-base@1/container/1cpu/512M#3fa2c1 (api): 8 ready of 8, ...`` per pool,
    then the automatic mode's line when it is on."""
    lines = [
        f"warm pool {p['name']} ({', '.join(p['sources']) or 'draining'}): {p['ready']} ready "
        f"of {p['target']}, {p['starting']} starting, {p['claimed']} claimed, {p['missed']} "
        f"missed, {p['memory'] >> 20} MiB"
        for p in warm.get("pools") or ()
    ]
    if warm.get("auto"):
        lines.append(
            f"warm auto: on, budget {warm['budget'] >> 20} MiB over creates of the last "
            f"{warm['window']:g}s; {warm.get('evicted', 0)} members evicted"
        )
    return lines


@node.group("warm", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def node_warm(ctx, as_json) -> None:
    """Show (or set, with a subcommand) the sandboxes the node keeps warm for creates of the
    same shape to claim."""
    if ctx.invoked_subcommand is not None:
        return
    with Client() as client:
        status = client.warm()
    if as_json:
        _dump(status.to_dict())
        return
    lines = _warm_lines(status.to_dict())
    click.echo("\n".join(lines) if lines else "no warm pools")


def _shape_options(f: Any) -> Any:
    """The options of a warm target's shape (a create's defaults), on command ``f``."""
    options: list[tuple[str, dict[str, Any]]] = [
        ("--backend", {"default": None}),
        ("--cpu", {"type": float, "default": 1.0, "show_default": True}),
        ("--memory", {"default": "512M", "show_default": True}),
        ("--pids", {"type": int, "default": 512, "show_default": True}),
        ("--disk", {"default": "10G", "show_default": True}),
        ("--network", {"default": "none", "show_default": True}),
        ("--qos", {"type": click.Choice(QOS_CLASSES), "default": "ls"}),
        ("--runtime", {"default": None}),
        ("--layer", {"multiple": True, "help": "a layer on top (name@version)"}),
    ]
    for decl, kw in reversed(options):
        f = click.option(decl, **kw)(f)
    return f


@node_warm.command("set")
@click.argument("environment")
@click.argument("count", type=click.IntRange(0))
@_shape_options
def node_warm_set(environment, count, layer, **shape) -> None:
    """Keep COUNT sandboxes of ENVIRONMENT (and the shape the options give, a create's
    defaults otherwise) warm; 0 removes that target. Other targets set before stay."""
    spec = SandboxSpec(environment=environment, layers=layer, ttl=None, **shape)
    with Client() as client:
        kept = [t for t in client.warm().targets if t.spec != spec]
        status = client.set_warm(kept + ([(spec, count)] if count else []))
    click.echo("\n".join(_warm_lines(status.to_dict())) or "no warm pools")


@node_warm.command("clear")
def node_warm_clear() -> None:
    """Remove every target set through the API (a catalog's warm entries stay)."""
    with Client() as client:
        status = client.set_warm([])
    click.echo("\n".join(_warm_lines(status.to_dict())) or "no warm pools")


@node_warm.command("auto")
@click.argument("state", type=click.Choice(["on", "off"]))
@click.option("--budget", default=None, help="members' memory limits at most, e.g. 4G")
@click.option("--window", type=float, default=None, help="seconds of recent creates to learn from")
def node_warm_auto(state, budget, window) -> None:
    """Switch the automatic mode: keep as many members of each shape as creates of it came in
    the last WINDOW seconds, the most asked-for first, within BUDGET."""
    with Client() as client:
        kept = client.warm().targets
        status = client.set_warm(kept, auto=state == "on", budget=budget, window=window)
    click.echo("\n".join(_warm_lines(status.to_dict())) or "no warm pools")


def _device_line(dev: dict[str, Any]) -> str:
    """``gpu /dev/nvidia0 (c 195:0): exclusive to 3f2a9c1b0d4e`` and the like."""
    where = f"{dev['kind']} {dev['path']} ({dev['type']} {dev['major']}:{dev['minor']})"
    if dev.get("exclusive"):
        return f"device {where}: exclusive to {', '.join(dev['exclusive'])}"
    shared = dev.get("shared") or []
    if shared:
        return f"device {where}: shared by {len(shared)} of {dev['share_cap']}: {', '.join(shared)}"
    return f"device {where}: free (shared by up to {dev['share_cap']})"


@node.command("openapi")
def node_openapi() -> None:
    """Print the node API's OpenAPI 3.1 document (JSON), e.g. for schemathesis."""
    from ..api.openapi import openapi_document  # the node's whole API: loaded when asked

    _dump(openapi_document())


# --- demo ----------------------------------------------------------------------------------


@cli.command("demo")
@click.option(
    "--catalog",
    "catalog_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Catalog file (default: the shipped catalog/default.yaml).",
)
@click.option(
    "--task",
    "tasks",
    multiple=True,
    help="Run only this task of the node's registered catalogs (one `dsec build` published, "
    "say) instead of a catalog file's; repeat for more.",
)
@click.option("--json", "as_json", is_flag=True, help="Also print the results as JSON.")
def demo_cmd(catalog_file, tasks, as_json) -> None:
    """Build the default catalog if missing, run one rollout per task in parallel, score them."""
    if catalog_file and tasks:
        raise click.UsageError("--catalog and --task do not go together")
    require_node("dsec demo")
    from ..demo import run_demo  # the demo and its catalog builder: loaded when run

    results = run_demo(catalog_file, console=console, tasks=tasks)
    if as_json:
        _dump(results)
    failed = [r for r in results if not r["ok"]]
    if failed:
        which = "; ".join(
            f"{r.get('task')} on {r.get('backend')}: {r.get('status')}, {r.get('outcome')}, "
            f"reward {r.get('reward')} (expected {r.get('expect')})"
            for r in failed
        )
        raise DsecError(f"some rollouts did not give the reward their task expects ({which})")


def _add_plugin_commands() -> None:
    if missing():
        return  # a client-only install loads no plugins: each needs dsec[node]
    from ..plugins import register_commands  # the node side's (pluggy, the plugin floors)

    register_commands(cli)  # each plugin's on its own: one that fails adds nothing


def main(argv: list[str] | None = None) -> None:
    try:
        _add_plugin_commands()
        cli.main(args=argv, prog_name="dsec", standalone_mode=False)
    except DsecError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
