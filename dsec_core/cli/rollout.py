"""``dsec rollout``: a batch of episodes over catalog tasks on a running node, with a progress bar
and the summary table (``dsec.rollout``). A client command: it loads no server side."""

from __future__ import annotations

import json

import click
from rich.console import Console

from ..errors import InvalidSpec
from ..rollout import catalog_tasks, run
from ..sdk import Client

__all__ = ["rollout"]


@click.command("rollout")
@click.option("--episodes", type=int, help="How many (default: one per task).")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Episodes at once.")
@click.option("--retries", type=int, default=2, show_default=True, help="Per masked episode.")
@click.option("--tasks", help="Comma-separated task names (default: all the node can serve).")
@click.option("--catalog", "catalog_file", help="Take the tasks from this catalog file.")
@click.option("--out", help="Write one JSON line per episode here.")
@click.option(
    "--address", help="The node or apiserver (default: DSEC_ADDRESS, else the local node)."
)
@click.option("--api-key", envvar="DSEC_API_KEY", help="An apiserver's API key.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON after the table.")
def rollout(
    episodes, concurrency, retries, tasks, catalog_file, out, address, api_key, as_json
) -> None:
    """Run episodes of the default catalog's tasks (those the node can serve) and print the
    table: per task its episodes, ok, failed and masked ones, and the mean reward."""
    console = Console()
    with Client(address, api_key=api_key) as client:
        chosen = catalog_tasks(catalog_file if catalog_file else client)
        if tasks:
            names = [t.strip() for t in tasks.split(",") if t.strip()]
            by_name = {t.name: t for t in chosen}
            missing = [n for n in names if n not in by_name]
            if missing:
                raise InvalidSpec(
                    f"no task {', '.join(missing)} the node can serve here (it can serve "
                    f"{', '.join(sorted(by_name)) or 'none'})",
                    field="tasks",
                )
            chosen = [by_name[n] for n in names]
        report = run(
            client,
            episodes,
            tasks=chosen,
            concurrency=concurrency,
            retries=retries,
            out=out,
            console=console,
        )
    if as_json:
        click.echo(json.dumps(report.summary, indent=2))
