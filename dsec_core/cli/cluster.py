"""``dsec cluster up|down|ls``: dsec node daemons on every node of a Ray cluster.

See ``dsec_core.cluster``: one detached actor per Ray node keeps that node's daemon. The Ray
cluster's address comes from ``--address`` or ``RAY_ADDRESS``; dsec never starts Ray itself.
"""

from __future__ import annotations

import json
import os
import time

import click
from rich.console import Console
from rich.table import Table

from ..cluster import DEFAULT_HOME_ROOT, ClusterPlan, down, status, up
from ..cluster.endpoint import NodeEndpoint, format_labels

__all__ = ["cluster"]

console = Console()

ADDRESS_HELP = "The Ray cluster: its head's GCS host:port (default: RAY_ADDRESS)."


def _env_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--env")
        out[key] = value
    return out


def _endpoint_json(e: NodeEndpoint, with_token: bool) -> dict:
    out = {
        "name": e.name,
        "url": e.url,
        "labels": dict(e.labels),
        "ray_node_id": e.ray_node_id,
        "alive": e.alive,
    }
    if with_token:
        out["token"] = e.token
    return out


@click.group()
def cluster() -> None:
    """Run dsec node daemons on a Ray cluster (one per Ray node)."""


@cluster.command("up")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option(
    "--home-root",
    default=DEFAULT_HOME_ROOT,
    show_default=True,
    help="Node homes go to HOME_ROOT/<name> on each node's machine.",
)
@click.option(
    "--layer-sources",
    default=None,
    help="Comma-separated layer source URLs for every node "
    "(default: DSEC_LAYER_SOURCES, else each node's own store).",
)
@click.option("--uid-base", type=int, default=100000, show_default=True)
@click.option(
    "--uid-ranges",
    type=int,
    default=4096,
    show_default=True,
    help="Uid ranges (of 65536 ids) per node; nodes on one host get disjoint ones.",
)
@click.option("-e", "--env", "env", multiple=True, help="KEY=VALUE for every daemon; repeat.")
@click.option("--json", "as_json", is_flag=True, help="Print the endpoints (tokens included).")
def cluster_up(address, home_root, layer_sources, uid_base, uid_ranges, env, as_json) -> None:
    """Start a dsec node daemon on every Ray node (again where one died) and list them."""
    sources = layer_sources if layer_sources is not None else os.environ.get("DSEC_LAYER_SOURCES")
    plan = ClusterPlan(
        home_root=home_root,
        uid_base=uid_base,
        uid_ranges=uid_ranges,
        layer_sources=tuple(s.strip() for s in (sources or "").split(",") if s.strip()),
        env=_env_pairs(env),
    )
    t0 = time.monotonic()
    endpoints = up(address, plan)
    if as_json:
        click.echo(json.dumps([_endpoint_json(e, True) for e in endpoints], indent=2))
        return
    table = Table("name", "url", "labels", "alive")
    for e in endpoints:
        table.add_row(e.name, e.url, format_labels(e.labels), "yes" if e.alive else "NO")
    console.print(table)
    console.print(
        f"{len(endpoints)} nodes up in {time.monotonic() - t0:.1f}s; "
        "`dsec cluster ls --json --tokens` prints their tokens"
    )


@cluster.command("ls")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--json", "as_json", is_flag=True)
@click.option("--tokens", is_flag=True, help="Include each node's API token (with --json).")
def cluster_ls(address, as_json, tokens) -> None:
    """List the cluster's node daemons: name, URL, labels, pid, alive."""
    if tokens and not as_json:
        raise click.UsageError("--tokens needs --json")
    states = status(address)
    if as_json:
        rows = []
        for s in states:
            row = s.to_dict()
            if tokens:
                row["token"] = s.endpoint.token
            rows.append(row)
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table("name", "url", "labels", "pid", "alive", "home")
    for s in states:
        e = s.endpoint
        table.add_row(
            e.name,
            e.url,
            format_labels(e.labels),
            str(s.pid or "-"),
            "yes" if e.alive else "NO",
            s.home,
        )
    console.print(table)


@cluster.command("down")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--node", "names", multiple=True, help="Only this node (repeat); default: all.")
@click.option("--purge", is_flag=True, help="Also remove each node's home (layers, caches).")
@click.option("--json", "as_json", is_flag=True)
def cluster_down(address, names, purge, as_json) -> None:
    """Kill every sandbox of the cluster's nodes, stop their daemons, remove their actors."""
    results = down(address, purge=purge, names=names)
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    for r in results:
        click.echo(f"{r['name']}: daemon {r['pid'] or '-'} stopped, {r['killed']} sandboxes killed")
    if not results:
        click.echo("no dsec nodes on this Ray cluster")
