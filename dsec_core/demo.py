"""``dsec demo``: one RL rollout per catalog task, in parallel, rewarded from native signals.

Builds the default catalog if missing, starts the embedded node if none runs, then for each
task creates a sandbox of its environment, runs its command, computes the reward from the exit
code or the JUnit pass rate, and kills the sandbox; a judge task goes to judge mode instead (a
warm FnCall member compiles once and runs each case with its own limits; reward 1.0 if every
case is accepted). Tasks whose environment names another backend (a microVM) run after the
container ones, or are skipped with one line saying why where that backend cannot run here
(no QEMU, say).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .catalog.build import build_catalog
from .catalog.model import default_catalog_file, load_catalog
from .catalog.rewards import compute_reward
from .catalog.store import CatalogStore
from .config import NodeConfig
from .errors import BackendUnavailable, DsecError, UnknownBackend
from .layers.store import LayerStore
from .plugins import registry
from .records import DEFAULT_BACKEND, SandboxSpec
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


async def _rollout(client: AsyncClient, task) -> dict[str, Any]:
    if task.judge is not None:
        return await _judged(client, task)
    started = time.monotonic()
    sb = await client.create(
        SandboxSpec(environment=task.qualified_environment, ttl=600, cpu=1.0, memory="512M")
    )
    try:
        # the reward comes from this result: run it as a verifier should, alone in the sandbox
        result = await sb.exec(task.command, timeout=task.timeout, exclusive=True)

        async def read(path: str) -> bytes:
            return await sb.read_file(path)

        report = None
        if getattr(task, "report", None):
            try:
                report = await read(task.report)
            except Exception:  # a missing report scores zero; compute_reward handles None
                report = None
        reward = compute_reward(task, result, (lambda _p: report) if report is not None else None)
    finally:
        await sb.kill()
    row = _row(
        task,
        reward,
        started,
        sb.id,
        str(result.exit_code),
        result.duration,
        timed_out=result.timed_out,
    )
    row["backend"] = sb.info.backend  # the environment's, resolved by the node
    return row


async def _judged(client: AsyncClient, task) -> dict[str, Any]:
    """A judge task: judge mode in a warm FnCall member (compile once, each case with its own
    limits), rewarded 1.0 if every case is accepted."""
    started = time.monotonic()
    r = await client.judge(task.judge_spec())
    outcome = f"{r.verdict} {r.passed}/{r.total}"
    row = _row(task, compute_reward(task, r), started, r.member, outcome, r.duration)
    row["verdicts"] = [c.verdict for c in r.cases]
    row["backend"] = task.judge_spec().backend
    return row


def _row(
    task,
    reward: float,
    started: float,
    sandbox: str,
    outcome: str,
    run_seconds: float,
    timed_out: bool = False,
) -> dict[str, Any]:
    expect = getattr(task, "expect", None)
    return {
        "task": task.name,
        "environment": task.environment,
        "reward": reward,
        "expect": expect,
        "ok": expect is None or abs(reward - expect) < 1e-9,
        "outcome": outcome,  # the exit code, or the judge's verdict and accepted cases
        "timed_out": timed_out,
        "exec_seconds": round(run_seconds, 3),
        "seconds": round(time.monotonic() - started, 3),
        "sandbox": sandbox,
    }


def _unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here (what is missing and how to install it), or None."""
    try:
        registry().backend(backend).check_available()
    except DsecError as e:
        return str(e)
    return None


def run_demo(catalog_file: str | None = None, console: Console | None = None) -> list[dict]:
    console = console or Console()
    config = NodeConfig.from_env()
    path = Path(catalog_file) if catalog_file else default_catalog_file()
    catalog = ensure_catalog(path, config, console)
    Client().close()  # start the embedded node if none runs
    backends = {t.name: catalog.environment(t.environment).backend for t in catalog.tasks}
    # the container tasks in parallel first; then each task on another backend (a microVM),
    # alone, as its guest boots on the same cores
    first = [t for t in catalog.tasks if backends[t.name] in (None, DEFAULT_BACKEND)]
    later = [t for t in catalog.tasks if t not in first]
    skipped: list[str] = []

    async def on_own_backend(client: AsyncClient, task) -> dict[str, Any] | None:
        backend = backends[task.name] or DEFAULT_BACKEND
        why = _unavailable(backend)
        if why is None:
            try:
                return await _rollout(client, task)
            except (UnknownBackend, BackendUnavailable) as e:  # the node's own check said no
                why = str(e)
        skipped.append(f"skipped task {task.name} on backend {backend}: {why}")
        return None

    async def all_rollouts() -> list[dict]:
        async with AsyncClient() as client:
            done = list(await asyncio.gather(*(_rollout(client, t) for t in first)))
            for task in later:
                row = await on_own_backend(client, task)
                if row is not None:
                    done.append(row)
            return done

    started = time.monotonic()
    results = asyncio.run(all_rollouts())
    wall = time.monotonic() - started
    table = Table(
        "task", "reward", "expected", "exit / verdict", "duration", title="dsec demo rollouts"
    )
    for r in results:
        mark = "" if r["ok"] else " [red](mismatch)[/red]"
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
