"""Catalog tasks as a rollout's episodes: which of a catalog's tasks a node can serve, and one
episode of a task (a sandbox of its environment, its command, the reward from the exit code or
the JUnit pass rate; a judge task in judge mode), written once as an operation of client calls
(``dsec_core.rl.calls``) that either client twin runs.

The catalog's model and rewards load when a catalog is first read: they bring the layer store
and the schema checker, which a rollout of other episodes does not need.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DsecError, InvalidSpec
from ..records import DEFAULT_BACKEND, SandboxSpec
from ..rl.calls import Op, Use, adrive, drive
from ..rl.errors import InfraFailure
from ..rl.infra import infra_event

if TYPE_CHECKING:
    from ..catalog.model import Catalog, Task

__all__ = [
    "Played",
    "acatalog_tasks",
    "catalog_tasks",
    "default_catalog",
    "read_catalog",
    "servable",
    "task_episode",
]


@dataclass(frozen=True)
class Played:
    """What one attempt of an episode gave: its reward and what a catalog task tells."""

    reward: float
    steps: int = 0
    outcome: str = ""
    timed_out: bool = False
    backend: str | None = None
    verdicts: tuple[str, ...] = ()


def default_catalog() -> Catalog:
    """The catalog shipped with dsec, as its file says (``dsec catalog build`` builds it)."""
    from ..catalog.model import default_catalog_file, load_catalog

    return load_catalog(default_catalog_file())


def servable(catalog: Catalog, layers: set[str], backends: set[str] | None) -> list[Task]:
    """The tasks of ``catalog`` whose environment's layers (``name@version``) are all in
    ``layers`` and whose backend is in ``backends`` (None: any)."""
    out = []
    for task in catalog.tasks:
        env = catalog.environment(task.environment)
        backend = env.backend or DEFAULT_BACKEND
        if set(env.layer_refs()) <= layers and (backends is None or backend in backends):
            out.append(task)
    return out


def read_catalog(path: str | os.PathLike[str]) -> Catalog:
    """The catalog file at ``path``, as a client reads it: its environments may name layers
    the node has (the node resolves them at create time), and its imports are not followed."""
    import yaml

    from ..catalog.model import parse_catalog

    where = Path(path)
    try:
        doc = yaml.safe_load(where.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InvalidSpec(f"cannot read catalog {where}: {e}", field="catalog") from e
    return parse_catalog(
        doc, where=os.fspath(where), root=where.parent, check_sources=False, check_layers=False
    )


def _catalog(source: Any) -> Catalog | None:
    if isinstance(source, (str, os.PathLike)):
        return read_catalog(source)
    if hasattr(source, "tasks") and hasattr(source, "environment"):
        return source
    return None


def node_can_serve() -> Op[tuple[set[str], set[str] | None]]:
    """The layers (``name@version``) a node's layer sources hold and its backends (None if
    it does not say: an apiserver)."""
    layers = {info.ref for info in (yield Use("layers"))}
    try:
        info = yield Use("node_info")
    except DsecError:
        return layers, None
    return layers, set(info.get("backends") or ()) or None


def catalog_tasks(source: Any = None) -> list[Task]:
    """The tasks a rollout runs: of a ``Catalog``, of a catalog file (a path), or, given a
    ``Client``, those of the default catalog the node can serve (the layers of their
    environment are in its layer sources, and its backend is one of the node's). An
    ``AsyncClient``'s are ``await acatalog_tasks(client)``."""
    catalog = _catalog(source)
    if catalog is not None:
        return list(catalog.tasks)
    if source is None:
        return list(default_catalog().tasks)
    layers, backends = drive(source, node_can_serve())
    return servable(default_catalog(), layers, backends)


async def acatalog_tasks(client: Any) -> list[Task]:
    """``catalog_tasks`` of an ``AsyncClient``: the default catalog's tasks its node can
    serve."""
    layers, backends = await adrive(client, node_can_serve())
    return servable(default_catalog(), layers, backends)


def resolve(tasks: Sequence[Any]) -> list[Task]:
    """``tasks`` as ``Task`` records: each a ``Task`` or the name of a task of the default
    catalog (``InvalidSpec`` naming the ones it has not)."""
    named = [t for t in tasks if isinstance(t, str)]
    known = {t.name: t for t in default_catalog().tasks} if named else {}
    unknown = [t for t in named if t not in known]
    if unknown:
        raise InvalidSpec(
            f"no task {', '.join(unknown)} in the default catalog (it has "
            f"{', '.join(sorted(known))})",
            field="tasks",
        )
    return [known[t] if isinstance(t, str) else t for t in tasks]


def task_episode(
    task: Task, files: Mapping[str, str | bytes] | None, sandboxes: list[str]
) -> Op[Played]:
    """One episode of ``task``: ``files`` ({absolute path: content}, a grader's hidden tests)
    are written into its sandbox first, then its command runs alone there and is scored;
    the sandbox is killed after. A judge task goes to judge mode instead. An out-of-memory kill
    raises ``InfraFailure``; ``sandboxes`` gets the id of each sandbox it makes."""
    from ..catalog.rewards import compute_reward

    if task.judge is not None:
        judged = task.judge_spec()
        r = yield Use("judge", (judged,))
        sandboxes.append(r.member)
        return Played(
            compute_reward(task, r),
            outcome=f"{r.verdict} {r.passed}/{r.total}",
            backend=judged.backend,
            verdicts=tuple(c.verdict for c in r.cases),
        )
    # ten minutes, one core, 512 MiB: what the demo always gave a task
    spec = SandboxSpec(environment=task.qualified_environment, ttl=600, cpu=1.0, memory="512M")
    sb = yield Use("create", (spec,))
    sandboxes.append(sb.id)
    try:
        for path, data in (files or {}).items():
            yield Use("exec", (sb.id, ["mkdir", "-p", posixpath.dirname(path)]), {"timeout": 30})
            yield Use("write_file", (sb.id, path, data))
        # the reward comes from this result: run it as a verifier should, alone in the sandbox
        result = yield Use(
            "exec", (sb.id, task.command), {"timeout": task.timeout, "exclusive": True}
        )
        event = infra_event(result, sb.id)
        if event is not None:
            raise InfraFailure(event)
        report = None
        if task.report:
            try:
                report = yield Use("read_file", (sb.id, task.report))
            except DsecError:  # a missing report scores zero; compute_reward handles None
                report = None
        reader = (lambda _path: report) if report is not None else None
        reward = compute_reward(task, result, reader)
    finally:
        try:
            yield Use("kill", (sb.id,))
        except DsecError:  # gone already (a crash, a lost node): nothing to kill
            pass
    return Played(
        reward,
        outcome=str(result.exit_code),
        timed_out=result.timed_out,
        backend=sb.info.backend,
    )
