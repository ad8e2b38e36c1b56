"""Fair order for creates that wait: who is served next among the creates queued on a node (or
an apiserver), by share rather than by arrival.

The policy is start-time fair queueing at two levels. Each queued item belongs to a project
(the caller's IAM project; on a node without IAM, its ``dsec.project``, ``project`` or
``owner`` label, else ``default``) and, within it, to a batch (one ``create_many`` call, or
the creates that name the same ``batch``; single creates that name none share their
project's default batch).

Among the projects with items queued, the next served is the one with the lowest virtual
start tag; serving a project moves its tag on by ``1 / weight`` (weights default to 1: equal
shares of turns). Every turn counts, also one let through while nothing waited (``charge``):
a project that got in first, before the others' creates arrived, has used its turns. A
project that had nothing queued joins at its own tag, but never more than ``credit`` turns
behind the current virtual time: idling banks at most ``credit`` turns (0: none, classic
start-time fair queueing), and a flood from one project cannot push another's creates behind
it: with two projects backlogged each gets every other turn, whatever their queues' lengths.
A node gives a credit of its start slots, so the creates that got in at once, while the
queue was empty, are given back to those that came a moment later. Projects whose tags tie
go by what they hold for their weight (``held``: live sandboxes, as the caller counts them),
least first, then by who was backlogged first. Shares are of turns, not of room held (a
trainer's share of creates is its share, whatever its episodes' lengths). Within the chosen
project the tags alone pick the batch (no credit), and within a batch items go in arrival
order.

``FairQueue`` is pure bookkeeping (no clock, no I/O); the node's ``CreateQueue`` and the
apiserver's placement queue decide when the item ``peek`` names may go.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["DEFAULT_PROJECT", "FairQueue", "project_of"]

T = TypeVar("T", bound=Hashable)
K = TypeVar("K", bound=Hashable)

#: The project of a create that names none (a node without IAM, a spec without labels).
DEFAULT_PROJECT = "default"
#: Tags kept of flows that wait for nothing, past which those at the floor are forgotten.
MAX_TAGS = 4096
#: Labels that name a create's project on a node without IAM, in order of precedence.
PROJECT_LABELS = ("dsec.project", "project", "owner")


def project_of(labels: Mapping[str, str]) -> str:
    """The project a create is queued under, from its spec's labels."""
    for name in PROJECT_LABELS:
        if labels.get(name):
            return labels[name]
    return DEFAULT_PROJECT


@dataclass
class _Flows(Generic[K, T]):
    """One level of start-time fair queueing: flows (keyed ``K``) of items, each flow with a
    virtual start tag; ``weight`` gives a flow's share (1.0 each by default), ``credit`` how
    many turns a flow may be behind the virtual time when it joins."""

    weight: Callable[[K], float] = lambda _: 1.0
    credit: float = 0.0
    queues: dict[K, deque[T]] = field(default_factory=dict)
    tags: dict[K, float] = field(default_factory=dict)
    since: dict[K, int] = field(default_factory=dict)  # when each flow was last backlogged
    now: float = 0.0  # virtual time: the tag of the last flow served
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def _joining(self, key: K) -> float:
        """The tag of flow ``key`` as it joins: its own, but never more than ``credit``
        turns behind the virtual time."""
        floor = self.now - self.credit
        return max(self.tags.get(key, floor), floor)

    def push(self, key: K, item: T) -> None:
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = deque()
            self.tags[key] = self._joining(key)
            self.since[key] = next(self._seq)
            if len(self.tags) > MAX_TAGS:
                self._forget()
        q.append(item)

    def head(self, held: Mapping[K, float] | None = None) -> K | None:
        """The flow served next, or None if all are empty: the lowest tag, then the one
        holding least for its weight (``held``: what each holds now; none: all alike), then
        the one backlogged first."""
        if not self.queues:
            return None
        if held:
            return min(
                self.queues,
                key=lambda k: (self.tags[k], held.get(k, 0.0) / self._weight(k), self.since[k]),
            )
        return min(self.queues, key=lambda k: (self.tags[k], self.since[k]))

    def _weight(self, key: K) -> float:
        return max(self.weight(key), 1e-9)

    def charge(self, key: K) -> None:
        """One item of flow ``key`` was served (queued, or let through while nothing of it
        waited: that turn counts too)."""
        tag = self.tags[key] if key in self.queues else self._joining(key)
        self.now = max(self.now, tag)
        self.tags[key] = tag + 1.0 / self._weight(key)

    def drop(self, key: K, item: T) -> bool:
        q = self.queues.get(key)
        if q is None or item not in q:
            return False
        q.remove(item)
        self._empty(key)
        return True

    def _empty(self, key: K) -> None:
        if self.queues.get(key):
            return
        self.queues.pop(key, None)
        self.since.pop(key, None)
        if self.tags.get(key, 0.0) <= self.now - self.credit:  # it would rejoin there anyway
            self.tags.pop(key, None)

    def _forget(self) -> None:
        """Drop the tags of flows that wait for nothing and would rejoin at the floor."""
        floor = self.now - self.credit
        for key in [k for k, t in self.tags.items() if k not in self.queues and t <= floor]:
            del self.tags[key]


@dataclass(frozen=True)
class _Where:
    project: str
    batch: str


class FairQueue(Generic[T]):
    """Items waiting to be served, by project and batch (see the module's docstring).
    ``weights``: a project's share relative to the others' (1.0 when not named)."""

    def __init__(self, weights: Mapping[str, float] | None = None, credit: float = 0.0) -> None:
        w = dict(weights or {})
        self._projects: _Flows[str, str] = _Flows(weight=lambda p: w.get(p, 1.0), credit=credit)
        self._batches: dict[str, _Flows[str, T]] = {}
        self._where: dict[T, _Where] = {}
        self._depth: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: object) -> bool:
        return item in self._where

    def push(self, item: T, project: str, batch: str = "") -> None:
        """Queue ``item`` (each item at most once) under ``project`` and ``batch``."""
        if item in self._where:
            raise ValueError(f"{item!r} is queued already")
        self._where[item] = _Where(project, batch)
        self._depth[project] = self._depth.get(project, 0) + 1
        flows = self._batches.get(project)
        if flows is None:
            flows = self._batches[project] = _Flows()
        flows.push(batch, item)
        if project not in self._projects.queues:
            self._projects.push(project, project)

    def peek(self, held: Mapping[str, float] | None = None) -> T | None:
        """The item served next, or None if nothing waits. ``held``: what each project holds
        now (live sandboxes); then the project that holds least for its weight goes first."""
        project = self._projects.head(held)
        if project is None:
            return None
        flows = self._batches[project]
        batch = flows.head()
        assert batch is not None
        return flows.queues[batch][0]

    def pop(self, held: Mapping[str, float] | None = None) -> T | None:
        """Serve the item ``peek(held)`` names: it leaves the queue, its project and batch are
        charged one turn."""
        item = self.peek(held)
        if item is None:
            return None
        where = self._where.pop(item)
        flows = self._batches[where.project]
        flows.charge(where.batch)
        flows.queues[where.batch].popleft()
        flows._empty(where.batch)
        self._projects.charge(where.project)
        self._settle(where.project)
        return item

    def charge(self, project: str, batch: str = "") -> None:
        """An item of ``project`` and ``batch`` was served without waiting (nothing waited
        before it): the turn counts all the same."""
        self._projects.charge(project)
        flows = self._batches.get(project)
        if flows is None:
            flows = self._batches[project] = _Flows()
        flows.charge(batch)
        if not flows.queues and len(flows.tags) > MAX_TAGS:
            flows._forget()

    def remove(self, item: T) -> bool:
        """Take ``item`` out without serving it (its caller gave up); False if not queued."""
        where = self._where.pop(item, None)
        if where is None:
            return False
        self._batches[where.project].drop(where.batch, item)
        self._settle(where.project)
        return True

    def _settle(self, project: str) -> None:
        self._depth[project] -= 1
        if not self._depth[project]:
            del self._depth[project]
        flows = self._batches[project]
        if not flows.queues:  # nothing left in the project: it leaves the project level
            self._projects.queues.pop(project, None)
            self._projects._empty(project)
            if not flows.tags:
                del self._batches[project]

    def depth(self) -> dict[str, int]:
        """How many items wait, by project."""
        return dict(self._depth)

    def order(self, held: Mapping[str, float] | None = None) -> list[T]:
        """Every queued item in the order they would be served if nothing else came and
        nothing held were given back (each served item then holds one more)."""
        # the fair order is a function of the tags and holdings alone: replay it on copies
        projects = _copy(self._projects)
        batches = {p: _copy(f) for p, f in self._batches.items()}
        holding = dict(held or {})
        out: list[T] = []
        while True:
            project = projects.head(holding)
            if project is None:
                return out
            flows = batches[project]
            batch = flows.head()
            assert batch is not None
            out.append(flows.queues[batch].popleft())
            if held is not None:
                holding[project] = holding.get(project, 0.0) + 1
            flows.charge(batch)
            flows._empty(batch)
            projects.charge(project)
            if not flows.queues:
                projects.queues.pop(project, None)
                projects._empty(project)

    def position(self, item: T, held: Mapping[str, float] | None = None) -> int | None:
        """How many items would be served before ``item`` (0: it is next); None if not
        queued."""
        if item not in self._where:
            return None
        return self.order(held).index(item)


def _copy(flows: _Flows[K, T]) -> _Flows[K, T]:
    return _Flows(
        weight=flows.weight,
        credit=flows.credit,
        queues={k: deque(q) for k, q in flows.queues.items()},
        tags=dict(flows.tags),
        since=dict(flows.since),
        now=flows.now,
    )
