"""``dsec apiserver``: run the control plane's entry over a set of nodes."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..apiserver import ApiserverConfig, WatchSettings, serve
from ..apiserver.server import parse_node

__all__ = ["apiserver"]


@click.command("apiserver")
@click.option(
    "--listen",
    default="http://127.0.0.1:8500",
    show_default=True,
    help="http:// or https:// address to serve.",
)
@click.option(
    "--node",
    "nodes",
    multiple=True,
    help="NAME=URL of a node daemon (its DSEC_NODE_NAME and DSEC_LISTEN address); repeat.",
)
@click.option(
    "--node-token",
    envvar="DSEC_NODE_TOKEN",
    help="The bearer token of the --node daemons (their DSEC_API_TOKEN).",
)
@click.option("--ray", "ray_address", help="Find the nodes through Ray (dsec cluster up).")
@click.option("--iam", envvar="DSEC_IAM", help="IAM store: sqlite:///path or etcd://host:port.")
@click.option("--probe-interval", type=float, default=1.0, show_default=True)
@click.option("--probe-timeout", type=float, default=1.0, show_default=True)
@click.option(
    "--probe-misses",
    type=int,
    default=2,
    show_default=True,
    help="Missed probes in a row before a node is marked lost.",
)
@click.option(
    "--overflow-at",
    type=float,
    default=0.8,
    show_default=True,
    help="Home-pool use above which specs labelled dsec.overflow=true go to the overflow pool.",
)
@click.option("--tls-cert", type=click.Path(path_type=Path))
@click.option("--tls-key", type=click.Path(path_type=Path))
@click.option("--no-e2b", is_flag=True, help="Do not serve the E2B-compatible API.")
def apiserver(
    listen: str,
    nodes: tuple[str, ...],
    node_token: str | None,
    ray_address: str | None,
    iam: str | None,
    probe_interval: float,
    probe_timeout: float,
    probe_misses: int,
    overflow_at: float,
    tls_cert: Path | None,
    tls_key: Path | None,
    no_e2b: bool,
) -> None:
    """Serve the node API over many nodes: one entry, API keys checked by IAM, sandboxes
    placed best-of-k, nodes watched. Runs in the foreground until SIGTERM/SIGINT."""
    config = ApiserverConfig(
        listen=listen,
        nodes=tuple(parse_node(n, node_token or os.environ.get("DSEC_TOKEN")) for n in nodes),
        ray_address=ray_address,
        iam=iam,
        watch=WatchSettings(interval=probe_interval, timeout=probe_timeout, misses=probe_misses),
        overflow_at=overflow_at,
        tls_cert=tls_cert,
        tls_key=tls_key,
        e2b=not no_e2b,
    )
    serve(config)
