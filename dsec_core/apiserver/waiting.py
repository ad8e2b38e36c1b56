"""Creates that wait at the apiserver for room on some node, served in fair order
(``dsec_core.fairqueue``: by the caller's IAM project, then by batch).

Why a queue here and not only on the nodes: placement is the apiserver's, over every node, so
a create that waits should wait for room *anywhere*, not on the one node placement would have
picked while all were full (that node may stay full while another frees up). A create whose
placement is refused for room (``count``, ``cpu``, ``memory``..., or ``placement``: no
eligible node) and that may ``wait`` is queued; the queue retries placement for its head
whenever room may have freed: each ``TICK`` while anything waits (the nodes' probes bring kills
and ends in) and when the apiserver itself saw a create end or a kill (``room_freed``). The
attempt places *and* holds the room in the ledger in one step, as an unqueued create does, and
then the create goes to its nodes with what is left of its ``wait``, where the node's own queue
bounds how many start at once. A quota refusal is not waited on: a quota is a limit the
project chose, not room that frees. A create without ``wait`` is placed (or refused) at once,
as before the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from ..errors import AdmissionRejected
from ..fairqueue import FairQueue

__all__ = ["WAITABLE", "PlacementQueue"]

T = TypeVar("T")

#: Placement's refusals that room freeing up may lift.
WAITABLE = frozenset(
    {"count", "cpu", "memory", "memory-pressure", "memory-available", "devices", "placement"}
)
#: Turns a project that had nothing queued may be behind the others (``FairQueue``'s credit).
CREDIT = 16
#: Seconds between two attempts at the head's placement while anything waits.
TICK = 0.2


class QueueMetrics(Protocol):
    def queued(self, depth: dict[str, int]) -> None: ...

    def waited(self, seconds: float) -> None: ...

    def rejected(self, reason: str) -> None: ...


@dataclass(eq=False)
class _Waiter(Generic[T]):
    attempt: Callable[[], T]
    project: str
    deadline: float
    queued: float
    future: asyncio.Future[T] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    last: AdmissionRejected | None = None


def _waitable(e: AdmissionRejected) -> bool:
    return e.context.get("reason") in WAITABLE


class PlacementQueue:
    """Creates waiting for placement, in fair order."""

    def __init__(self, metrics: QueueMetrics | None = None) -> None:
        self.metrics = metrics
        self.waiting: FairQueue[_Waiter[Any]] = FairQueue(credit=CREDIT)
        self._ticker: asyncio.Task[None] | None = None

    async def place(self, attempt: Callable[[], T], project: str, batch: str, wait: float) -> T:
        """``attempt()``'s result (it places and holds, or raises ``AdmissionRejected``): at
        once if it succeeds with no one waiting ahead, else once it succeeds in its turn
        within ``wait`` seconds; ``AdmissionRejected`` naming the last refusal and the wait
        if the deadline passes first. Cancelled: out of the queue."""
        if wait <= 0 or not self.waiting:
            try:
                value = attempt()
                self.waiting.charge(project, batch)  # its turn, taken at once
                return value
            except AdmissionRejected as e:
                if wait <= 0 or not _waitable(e):
                    raise
                first: AdmissionRejected | None = e
        else:
            first = None
        now = time.monotonic()
        w: _Waiter[T] = _Waiter(attempt, project, now + wait, now, last=first)
        self.waiting.push(w, project, batch)
        self._changed()
        self.pump()
        try:
            return await asyncio.wait_for(asyncio.shield(w.future), max(0.0, w.deadline - now))
        except TimeoutError:
            if w.future.done():
                return w.future.result()
            raise self._too_late(w) from None
        finally:
            if self.waiting.remove(w):
                self._changed()
                self.pump()

    def room_freed(self) -> None:
        if self.waiting:
            self.pump()

    def pump(self) -> None:
        """Attempt the head's placement, in fair order, until one must wait."""
        while (w := self.waiting.peek()) is not None:
            try:
                value = w.attempt()
            except AdmissionRejected as e:
                w.last = e
                if _waitable(e) and time.monotonic() < w.deadline:
                    break
                self.waiting.pop()
                if not w.future.done():
                    w.future.set_exception(self._explained(w, e, 0))
                continue
            except Exception as e:  # a typed error of its own (a quota reached meanwhile)
                self.waiting.pop()
                if not w.future.done():
                    w.future.set_exception(e)
                continue
            self.waiting.pop()
            if self.metrics:
                self.metrics.waited(time.monotonic() - w.queued)
            if not w.future.done():
                w.future.set_result(value)
        self._changed()
        if self.waiting and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _tick(self) -> None:
        while self.waiting:
            await asyncio.sleep(TICK)
            self.pump()

    def _changed(self) -> None:
        if self.metrics:
            self.metrics.queued(self.waiting.depth())

    def _too_late(self, w: _Waiter[Any]) -> AdmissionRejected:
        position = self.waiting.position(w)
        last = w.last or AdmissionRejected(
            "creates ahead of it in fair order held the room", reason="turn"
        )
        return self._explained(w, last, position)

    def _explained(
        self, w: _Waiter[Any], refusal: AdmissionRejected, position: int | None
    ) -> AdmissionRejected:
        waited = time.monotonic() - w.queued
        reason = str(refusal.context.get("reason", "placement"))
        if self.metrics:
            self.metrics.rejected(reason)
        where = "" if position is None else f", {position} creates ahead of it in the queue"
        return AdmissionRejected(
            f"waited {waited:.1f}s of its {w.deadline - w.queued:g}s for room on a node "
            f"(project {w.project!r}{where}): {refusal}",
            **{
                **refusal.context,
                "reason": reason,
                "waited": round(waited, 3),
                "position": position,
                "project": w.project,
                "depth": len(self.waiting),
            },
        )
