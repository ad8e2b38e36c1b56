"""What a rollout gives back: one ``EpisodeResult`` per episode (per branch of a fork tree), a
JSON line each, and the ``RolloutReport`` of a run with its summary and its table."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.table import Table

from ..errors import InvalidSpec

__all__ = ["STATUSES", "EpisodeResult", "RolloutReport", "read_jsonl"]

Status = Literal["ok", "failed", "masked"]
#: ``ok``: scored; ``failed``: the task's or the caller's own error (not retried, not scored);
#: ``masked``: infrastructure failures on every attempt (never scored).
STATUSES: tuple[Status, ...] = ("ok", "failed", "masked")


@dataclass(frozen=True)
class EpisodeResult:
    """One episode of a rollout (or one branch of a fork tree).

    ``reward`` is None unless ``status`` is "ok": a failed or masked episode is never scored.
    ``attempts`` counts its tries (a masked attempt is retried in a fresh sandbox); ``infra`` is
    the kind of the last infrastructure failure it met (``InfraEvent.kind``), ``error`` what
    failed it (``error_type``: the exception's class). ``sandboxes``: every sandbox its attempts
    ran in, in order. A branch of a fork tree has ``parent`` (the sandbox it was forked from)
    and ``branch`` (its number). A catalog task's episode also tells its ``outcome`` (the exit
    code, or the judge's verdict and accepted cases), whether it ``timed_out``, the ``backend``
    it ran on and the judge's ``verdicts`` per case."""

    index: int
    task: str
    reward: float | None
    status: Status
    attempts: int = 1
    infra: str | None = None
    error: str | None = None
    error_type: str | None = None
    duration: float = 0.0
    sandboxes: tuple[str, ...] = ()
    parent: str | None = None
    branch: int | None = None
    steps: int = 0
    outcome: str = ""
    timed_out: bool = False
    backend: str | None = None
    verdicts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise InvalidSpec(
                f"an episode's status is one of {', '.join(STATUSES)}, got {self.status!r}",
                field="status",
            )
        object.__setattr__(self, "sandboxes", tuple(self.sandboxes))
        object.__setattr__(self, "verdicts", tuple(self.verdicts))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sandboxes"], d["verdicts"] = list(self.sandboxes), list(self.verdicts)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpisodeResult:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidSpec(f"unknown episode result fields {unknown}", field=unknown[0])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def read_jsonl(path: str | os.PathLike[str]) -> list[EpisodeResult]:
    """The episode results a rollout wrote to ``path`` (``out=``), in the order they finished."""
    lines = Path(path).read_text().splitlines()
    return [EpisodeResult.from_dict(json.loads(line)) for line in lines if line.strip()]


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class RolloutReport:
    """The results of a rollout, by episode index (and branch), and how long it took."""

    results: tuple[EpisodeResult, ...]
    seconds: float = 0.0
    out: str | None = None  # the JSONL file the results went to, if any

    def __post_init__(self) -> None:
        ordered = sorted(
            self.results, key=lambda r: (r.index, -1 if r.branch is None else r.branch)
        )
        object.__setattr__(self, "results", tuple(ordered))

    @property
    def ok(self) -> list[EpisodeResult]:
        return [r for r in self.results if r.status == "ok"]

    @property
    def failed(self) -> list[EpisodeResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def masked(self) -> list[EpisodeResult]:
        return [r for r in self.results if r.status == "masked"]

    @property
    def rewards(self) -> list[float]:
        """The rewards of the scored (ok) episodes, by index."""
        return [r.reward for r in self.results if r.status == "ok" and r.reward is not None]

    @property
    def mean_reward(self) -> float | None:
        """The mean reward of the scored episodes (None if none was)."""
        return _mean(self.rewards)

    def by_task(self) -> dict[str, list[EpisodeResult]]:
        out: dict[str, list[EpisodeResult]] = {}
        for r in self.results:
            out.setdefault(r.task, []).append(r)
        return out

    @staticmethod
    def _counts(results: list[EpisodeResult]) -> dict[str, Any]:
        rewards = [r.reward for r in results if r.status == "ok" and r.reward is not None]
        return {
            "episodes": len(results),
            **{s: sum(r.status == s for r in results) for s in STATUSES},
            "retried": sum(r.attempts > 1 for r in results),
            "mean_reward": _mean(rewards),
        }

    @property
    def summary(self) -> dict[str, Any]:
        """Counts (episodes, ok, failed, masked, retried), the mean reward of the scored
        episodes, the wall time, and the same per task: JSON-ready."""
        return {
            **self._counts(list(self.results)),
            "seconds": round(self.seconds, 3),
            "tasks": {task: self._counts(rs) for task, rs in self.by_task().items()},
        }

    def table(self, title: str | None = None) -> Table:
        """A rich ``Table``: per task its episodes, ok, failed and masked ones, how many were
        retried, and the mean reward of those scored; then the totals."""
        n = len(self.results)
        table = Table(
            "task",
            "episodes",
            "ok",
            "failed",
            "masked",
            "retried",
            "mean reward",
            title=title or f"dsec rollout: {n} episodes in {self.seconds:.1f}s",
        )
        rows = [(task, self._counts(rs)) for task, rs in sorted(self.by_task().items())]
        rows.append(("total", self._counts(list(self.results))))
        for i, (task, c) in enumerate(rows):
            mean = "-" if c["mean_reward"] is None else f"{c['mean_reward']:.3f}"
            table.add_row(
                task,
                str(c["episodes"]),
                str(c["ok"]),
                f"[red]{c['failed']}[/red]" if c["failed"] else "0",
                f"[yellow]{c['masked']}[/yellow]" if c["masked"] else "0",
                str(c["retried"]),
                mean,
                end_section=i == len(rows) - 2,
            )
        return table
