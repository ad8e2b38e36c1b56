"""``dsec demo``: one RL rollout per catalog task, in parallel, rewarded from native signals.

Builds the default catalog if missing, starts the embedded node if none runs, then runs one
episode per task through ``dsec.rollout``'s runner: a sandbox of its environment, its command,
the reward from the exit code or the JUnit pass rate, the sandbox killed; a judge task goes to
judge mode instead (a warm FnCall member compiles once and runs each case with its own limits;
reward 1.0 if every case is accepted). An infrastructure failure is retried as the runner
does; a row then says how many attempts it took. Tasks whose environment names another
backend (a microVM) run after the container ones, or are skipped with one line saying why
where that backend cannot run here (no QEMU, say).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .catalog.build import build_catalog
from .catalog.model import Task, default_catalog_file, load_catalog
from .catalog.store import CatalogStore
from .config import NodeConfig
from .errors import DsecError
from .layers.store import LayerStore
from .plugins import registry
from .records import DEFAULT_BACKEND
from .rollout import EpisodeResult, arun
from .sdk import AsyncClient, Client

__all__ = ["ensure_catalog", "run_demo"]


def ensure_catalog(path: Path, config: NodeConfig, console: Console | None = None):
    """Build the catalog's missing layers (with a progress bar) and register it."""
    catalog_store = CatalogStore(config.catalog_dir)
    catalog = load_catalog(path, registered=catalog_store.catalog)
    layer_store = LayerStore(config.layer_dir)
    have = {i.ref for i in layer_store.list()}
    missing = [r for r in catalog.layers if f"{r.name}@{r.version}" not in have]
    known_envs = {e.qualified for e in catalog_store.environments()}
    if not missing and all(e.qualified in known_envs for e in catalog.environments):
        return catalog
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task(f"building catalog {catalog.name}", total=1.0)

        def progress(stage: str, fraction: float | None) -> None:
            bar.update(
                task,
                description=f"catalog {catalog.name}: {stage}",
                completed=fraction if fraction is not None else None,
            )

        build_catalog(catalog, layer_store, catalog_store, progress=progress)
        bar.update(task, completed=1.0, description=f"catalog {catalog.name}: built")
    return catalog


def _row(task: Task, r: EpisodeResult) -> dict[str, Any]:
    """The demo's row of one episode: its reward against the task's ``expect``."""
    expect = task.expect
    reward = r.reward if r.reward is not None else 0.0
    row: dict[str, Any] = {
        "task": task.name,
        "environment": task.environment,
        "reward": reward,
        "expect": expect,
        "ok": r.status == "ok" and (expect is None or abs(reward - expect) < 1e-9),
        "status": r.status,  # ok, failed (the error says why) or masked (infrastructure)
        # the exit code, or the judge's verdict and accepted cases; else what went wrong
        "outcome": r.outcome or r.error or f"masked ({r.infra})",
        "timed_out": r.timed_out,
        "attempts": r.attempts,
        "seconds": r.duration,
        "sandbox": r.sandboxes[-1] if r.sandboxes else "",
        "backend": r.backend,
    }
    if task.judge is not None:
        row["verdicts"] = list(r.verdicts)
    return row


def _unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here (what is missing and how to install it), or None."""
    try:
        registry().backend(backend).check_available()
    except DsecError as e:
        return str(e)
    return None


def run_demo(
    catalog_file: str | None = None,
    console: Console | None = None,
    tasks: Sequence[str | Task] = (),
    files: Mapping[str, Mapping[str, str | bytes]] | None = None,
) -> list[dict]:
    """One rollout per task of the catalog file (default: the shipped catalog, built if
    missing) or, with ``tasks``, of those tasks (names of the node's registered catalogs' tasks,
    as ``CatalogStore.task`` takes them, or ``Task`` records: one ``dsec build`` checked, say).
    ``files`` (task name -> {absolute path: content}) are written into that task's sandbox
    before its command, as a grader adds hidden tests the environment does not hold. Prints a
    table and returns one row per rollout."""
    console = console or Console()
    files = files or {}
    config = NodeConfig.from_env()
    if tasks:
        store = CatalogStore(config.catalog_dir)
        chosen = [t if isinstance(t, Task) else store.task(t) for t in tasks]
        backends = {t.name: store.environment(t.qualified_environment).backend for t in chosen}
    else:
        path = Path(catalog_file) if catalog_file else default_catalog_file()
        catalog = ensure_catalog(path, config, console)
        chosen = list(catalog.tasks)
        backends = {t.name: catalog.environment(t.environment).backend for t in chosen}
    Client().close()  # start the embedded node if none runs
    # the container tasks in parallel first; then each task on another backend (a microVM),
    # alone, as its guest boots on the same cores
    first = [t for t in chosen if backends[t.name] in (None, DEFAULT_BACKEND)]
    later = [t for t in chosen if t not in first]
    skipped: list[str] = []

    async def rollouts(client: AsyncClient, tasks: list[Task], at_once: int) -> list:
        report = await arun(
            client,
            len(tasks),
            tasks=tasks,
            concurrency=max(1, at_once),
            files=files,
            progress=False,
        )
        return [(t, r) for t, r in zip(tasks, report.results, strict=True)]

    async def all_rollouts() -> list[tuple[Task, EpisodeResult]]:
        async with AsyncClient() as client:
            done = await rollouts(client, first, len(first)) if first else []
            for task in later:  # each alone: its guest boots on the same cores
                backend = backends[task.name] or DEFAULT_BACKEND
                why = _unavailable(backend)
                if why is None:
                    ((_, r),) = await rollouts(client, [task], 1)
                    if r.error_type not in ("UnknownBackend", "BackendUnavailable"):
                        done.append((task, r))
                        continue
                    why = r.error or ""  # the node's own check said no
                skipped.append(f"skipped task {task.name} on backend {backend}: {why}")
            return done

    started = time.monotonic()
    results = [_row(t, r) for t, r in asyncio.run(all_rollouts())]
    wall = time.monotonic() - started
    table = Table(
        "task", "reward", "expected", "exit / verdict", "duration", title="dsec demo rollouts"
    )
    for r in results:
        mark = "" if r["ok"] else " [red](mismatch)[/red]"
        if r["status"] != "ok":
            mark = f" [red]({r['status']})[/red]"
        table.add_row(
            r["task"],
            f"{r['reward']:.2f}{mark}",
            "-" if r["expect"] is None else f"{r['expect']:.2f}",
            r["outcome"] + (" (timeout)" if r["timed_out"] else ""),
            f"{r['seconds']:.2f}s",
        )
    console.print(table)
    for line in skipped:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"{len(results)} rollouts in parallel in {wall:.2f}s wall; mean reward "
        f"{sum(r['reward'] for r in results) / max(1, len(results)):.3f}"
    )
    return results
