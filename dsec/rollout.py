"""dsec.rollout: the batch runner (``dsec_core.rollout``): N episodes on a ``Client`` or an
``AsyncClient`` with a concurrency limit, a progress bar, infrastructure failures masked and
retried, fork trees, results as JSON lines and a summary table."""

from dsec_core.rollout import (
    STATUSES,
    EnvFactory,
    EpisodeFn,
    EpisodeResult,
    RolloutReport,
    acatalog_tasks,
    arun,
    catalog_tasks,
    read_jsonl,
    run,
)

__all__ = [
    "STATUSES",
    "EnvFactory",
    "EpisodeFn",
    "EpisodeResult",
    "RolloutReport",
    "acatalog_tasks",
    "arun",
    "catalog_tasks",
    "read_jsonl",
    "run",
]
