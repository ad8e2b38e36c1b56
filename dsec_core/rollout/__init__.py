"""dsec.rollout: a batch runner for RL rollouts on dsec. N episodes (catalog tasks, an env factory,
or a caller's episode function) on a ``Client`` or an ``AsyncClient``, at most ``concurrency``
at once, infrastructure failures masked and retried in fresh sandboxes, optional fork trees, a
progress bar, per-episode results as JSON lines and a summary table.

    report = dsec.rollout.run(client, episodes=64, concurrency=8, out="results.jsonl")
    print(report.summary["mean_reward"])       # the default catalog's tasks the node can serve

    report = await dsec.rollout.arun(
        aclient, 32, env_factory=lambda i: (AsyncSandboxEnv(aclient, ...), policy),
        fork_at=3, n=4,                        # 3 steps, then 4 branches each
    )

It needs only the client's dependencies; catalog tasks also read the catalog (its schema and
layer recipes), loaded when first used.
"""

from .report import STATUSES, EpisodeResult, RolloutReport, read_jsonl
from .runner import EnvFactory, EpisodeFn, arun, run
from .tasks import Played, acatalog_tasks, catalog_tasks, default_catalog, servable

__all__ = [
    "STATUSES",
    "EnvFactory",
    "EpisodeFn",
    "EpisodeResult",
    "Played",
    "RolloutReport",
    "acatalog_tasks",
    "arun",
    "catalog_tasks",
    "default_catalog",
    "read_jsonl",
    "run",
    "servable",
]
