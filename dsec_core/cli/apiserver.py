"""``dsec apiserver``: run the control plane's entry over a set of nodes."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..apiserver import ApiserverConfig, WatchSettings, serve
from ..apiserver.server import parse_node

__all__ = ["apiserver", "node_token_from"]


def node_token_from(path: Path | None) -> str | None:
    """The nodes' token: the first line of ``path``, else ``DSEC_NODE_TOKEN``, else
    ``DSEC_TOKEN`` (the client's variable, for one machine's own node). A file that other
    users of the host may read gets a warning: the token opens every node."""
    if path is None:
        return os.environ.get("DSEC_NODE_TOKEN") or os.environ.get("DSEC_TOKEN") or None
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as e:
        raise click.BadParameter(
            f"cannot read {path}: {e.strerror}", param_hint="--node-token-file"
        ) from e
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise click.BadParameter(f"{path} is empty", param_hint="--node-token-file")
    if mode & 0o077:
        click.echo(
            f"Warning: {path} can be read by other users of this host (chmod 600 it)", err=True
        )
    return token


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
    "--node-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="DSEC_NODE_TOKEN_FILE",
    help="A file holding the bearer token of the --node daemons (their DSEC_API_TOKEN); "
    "or set DSEC_NODE_TOKEN. Never give the token itself as an argument: every user of the "
    "host can read a process's arguments in /proc/PID/cmdline.",
)
@click.option(
    "--node-token", hidden=True, help="Refused: use DSEC_NODE_TOKEN or --node-token-file."
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
    node_token_file: Path | None,
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
    if node_token is not None:
        raise click.UsageError(
            "--node-token would put the token where every user of this host can read it "
            "(/proc/PID/cmdline): set DSEC_NODE_TOKEN, or write it to a file for "
            "--node-token-file"
        )
    token = node_token_from(node_token_file)
    config = ApiserverConfig(
        listen=listen,
        nodes=tuple(parse_node(n, token) for n in nodes),
        ray_address=ray_address,
        iam=iam,
        watch=WatchSettings(interval=probe_interval, timeout=probe_timeout, misses=probe_misses),
        overflow_at=overflow_at,
        tls_cert=tls_cert,
        tls_key=tls_key,
        e2b=not no_e2b,
    )
    serve(config)
