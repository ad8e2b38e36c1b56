"""Record read profiles: run a catalog's tasks once over on-demand layers and keep what they read.

It runs a private in-process node, so it sits above the node in dsec's floors.

``profile_catalog`` publishes the catalog's layers (in their original order) to a private
``posix:`` source in a temporary directory, starts a private in-process node over it with
``trace_reads`` on, runs the chosen tasks one after another (sequentially, so the first-read
order does not depend on scheduling), and saves one ``ReadProfile`` per layer that was read
into the author's layer store. ``push_layer`` then stores each data blob in that order
(``lazy.layout``), so a sandbox running similar work touches a few consecutive chunks instead
of one chunk per scattered page. Everything temporary (node home, mounts, the source
directory) is removed, on failure too.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .catalog.model import Catalog, parse_catalog
from .catalog.store import CatalogStore
from .config import NodeConfig
from .errors import ExecTimeout
from .layers.store import LayerStore
from .lazy.layout import ReadProfile
from .node.node import Node
from .plugins import registry
from .records import LayerRef, SandboxSpec

__all__ = ["ProfiledLayer", "profile_catalog"]

Report = Callable[[str], None]


@dataclass(frozen=True)
class ProfiledLayer:
    ref: str
    profile: ReadProfile

    @property
    def fraction(self) -> float:
        return self.profile.read_bytes / max(1, self.profile.blob_size)


def _layers_of(catalog: Catalog, task_names: Sequence[str]) -> list[str]:
    refs: dict[str, None] = {}
    for name in task_names:
        for ref in catalog.environment(catalog.task(name).environment).layer_refs():
            refs.setdefault(ref, None)
    return list(refs)


def profile_catalog(
    catalog: Catalog, author: NodeConfig, tasks: Sequence[str] = (), report: Report | None = None
) -> list[ProfiledLayer]:
    """Run ``tasks`` (default: all) of ``catalog`` on on-demand layers; save their profiles.

    The layers must be built in ``author``'s store. A task that does not finish in its timeout
    raises ``ExecTimeout`` (its profile would be partial); a task that exits non-zero is fine
    (wrong answers read files too). Returns the saved profiles, one per layer that was read.
    """
    names = list(tasks) or [t.name for t in catalog.tasks]
    for name in names:
        catalog.task(name)  # UnknownEnvironment naming the known tasks
    store = LayerStore(author.layer_dir)
    refs = _layers_of(catalog, names)
    infos = {ref: store.resolve(LayerRef.parse(ref)) for ref in refs}
    src_dir = Path(tempfile.mkdtemp(prefix="dsec-profile-src-"))
    home = Path(tempfile.mkdtemp(prefix="dsec-profile-node-"))
    try:
        url = f"posix:{src_dir}"
        source = registry().open_source(url, author)
        source.compression = ""  # read once, locally: not worth compressing
        for ref, info in infos.items():
            if report:
                report(f"splitting {ref}")
            source.push(info, store.image_path(info))  # original order: no profile
        config = replace(
            NodeConfig(home=home),
            layer_sources=(url,),
            ondemand=True,
            trace_reads=True,
            layer_linger=0.0,
        )
        config.ensure_dirs()
        CatalogStore(config.catalog_dir).save(
            parse_catalog(catalog.to_document(), check_sources=False, check_layers=False)
        )
        profiles = asyncio.run(_run_tasks(config, catalog, names, report))
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(src_dir, ignore_errors=True)
    by_digest = {info.digest: ref for ref, info in infos.items()}
    saved = []
    for profile in profiles:
        layer_ref = by_digest.get(profile.layer_digest)
        if layer_ref is None:
            continue
        store.save_profile(profile)
        saved.append(ProfiledLayer(layer_ref, profile))
        if report:
            report(
                f"profiled {layer_ref}: read {profile.read_bytes / 1e6:.1f} of "
                f"{profile.blob_size / 1e6:.1f} MB ({saved[-1].fraction:.1%})"
            )
    return saved


async def _run_tasks(
    config: NodeConfig, catalog: Catalog, names: list[str], report: Report | None
) -> list[ReadProfile]:
    node = Node(config)
    await node.open()
    try:
        for name in names:
            task = catalog.task(name)
            if task.judge is not None:  # judge mode reads what a rollout of it reads
                judged = await node.judge(task.judge_spec())
                if report:
                    report(f"judged {name} ({judged.verdict} {judged.passed}/{judged.total})")
                continue
            info = await node.create(SandboxSpec(environment=task.qualified_environment, ttl=600))
            try:
                result = await node.exec(info.id, task.command, timeout=task.timeout)
            finally:
                await node.kill(info.id)
            if result.timed_out:
                raise ExecTimeout(
                    f"profiling task {name} did not finish in {task.timeout}s", task=name
                )
            if report:
                report(f"ran {name} (exit {result.exit_code})")
        workload = f"catalog {catalog.name}: " + ", ".join(names)
        return node.lazy_layers.profiles(workload) if node.lazy_layers else []
    finally:
        await node.close(kill_all=True)
