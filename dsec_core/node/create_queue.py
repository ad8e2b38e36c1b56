"""The node's create queue: a create that admission cannot take now may wait for room (its
``wait`` seconds), and every create waits for one of the node's start slots
(``DSEC_MAX_STARTING``); both are served in fair order (``dsec_core.fairqueue``: by project,
then by batch, not first come first served).

``CreateQueue.enter`` hands a create its ``Ticket`` once it is its turn, a start slot is free
and admission would take it; the create then admits itself at once (``Ticket.admitted``) and
gives the slot back when its sandbox runs or its create failed (``Ticket.done``). The check
``fits`` counts the creates let go but not yet admitted, so several may go in one round.
The fair order goes by turns (``dsec_core.fairqueue``; a turn taken at once counts), ties
going to the project holding least of the node (``held``). The head of the fair order that
does not fit holds the others back (a large create is not starved by small ones behind it)
until room frees: a kill, a create that ends, or the ticker that looks again while anything
waits (memory in use changes without an event).

A create without ``wait`` is refused at once when admission refuses it (as before the queue),
but still waits for a start slot in fair order. One that waits past its deadline is refused
with ``AdmissionRejected`` naming what was short (``reason``: the resource, ``starting`` for
start slots, ``turn`` when others were ahead), how long it waited and its place in the queue.
Cancelling the waiting caller (its HTTP request gone) takes it out of the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import AdmissionRejected
from ..fairqueue import FairQueue
from ..records import SandboxSpec

__all__ = ["WAITABLE", "CreateQueue", "QueueMetrics", "Ticket"]

#: Admission's refusals that room freeing up may lift (``NodeLoad.refusal``'s reasons, and a
#: placement plugin that declines); the others (a backend the node lacks) never lift.
WAITABLE = frozenset(
    {"count", "cpu", "memory", "memory-pressure", "memory-available", "devices", "placement"}
)
#: Seconds between two looks at a blocked queue's head when no event says room freed.
TICK = 0.2

Fits = Callable[[SandboxSpec, Sequence[SandboxSpec]], AdmissionRejected | None]


class QueueMetrics(Protocol):
    """What the queue reports (``dsec_core.observe.QueueMetrics``)."""

    def queued(self, depth: dict[str, int]) -> None: ...

    def waited(self, seconds: float) -> None: ...

    def starting(self, n: int) -> None: ...

    def rejected(self, reason: str) -> None: ...


@dataclass(eq=False)
class Ticket:
    """A create's place in the queue, then its start slot."""

    spec: SandboxSpec
    project: str
    batch: str
    deadline: float
    queued: float
    queue: CreateQueue
    future: asyncio.Future[None] | None = None
    granted: bool = False
    pending: bool = False  # let go, not yet admitted (counted by ``fits``)
    finished: bool = False
    seq: int = field(default=0)

    def __hash__(self) -> int:
        return self.seq

    def admitted(self) -> None:
        """The create has admitted itself (or failed to): admission counts it from here."""
        self.queue._admitted(self)

    def done(self) -> None:
        """The create ended (its sandbox runs, or it failed): its start slot is free."""
        self.queue._done(self)


class CreateQueue:
    """Creates waiting on one node. ``fits(spec, pending)`` is admission's refusal of
    ``spec`` on the node with ``pending`` specs counted as created (None: it fits);
    ``max_starting`` bounds the creates between their turn and their end; ``held()`` counts
    the node's live sandboxes by project (of projects whose turns tie, who holds least goes
    first)."""

    def __init__(
        self,
        fits: Fits,
        max_starting: int,
        metrics: QueueMetrics | None = None,
        held: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.fits = fits
        self.held = held
        self.max_starting = max_starting
        self.metrics = metrics
        # a credit of the start slots: what the fast path may let through before a queue forms
        self.waiting: FairQueue[Ticket] = FairQueue(credit=max_starting)
        self.starting = 0
        self._pending: dict[Ticket, SandboxSpec] = {}
        self._seq = itertools.count(1)
        self._ticker: asyncio.Task[None] | None = None

    def depth(self) -> dict[str, int]:
        """Creates waiting, by project."""
        return self.waiting.depth()

    def pending(self) -> tuple[SandboxSpec, ...]:
        """The specs of creates let go but not yet admitted (``fits`` counts them)."""
        return tuple(self._pending.values())

    async def enter(self, spec: SandboxSpec, project: str, batch: str, wait: float) -> Ticket:
        """Wait for the turn of a create of ``spec``: a start slot, room, and no one ahead in
        fair order; ``AdmissionRejected`` at once if admission refuses and ``wait`` is 0, or
        once ``wait`` seconds passed without room. Cancelled: out of the queue."""
        now = time.monotonic()
        t = Ticket(spec, project, batch, now + max(wait, 0.0), now, self, seq=next(self._seq))
        refusal = self._refusal(spec)
        if refusal is not None and wait <= 0:
            self._reject(refusal.context.get("reason", "admission"))
            raise refusal
        if refusal is None and not self.waiting and self.starting < self.max_starting:
            self.waiting.charge(project, batch)  # its turn, taken at once
            self._grant(t)  # the common case: nothing waits, no await
            return t
        t.future = asyncio.get_running_loop().create_future()
        self.waiting.push(t, project, batch)
        self._changed()
        self.pump()
        try:
            if t.future.done():
                t.future.result()
            elif wait > 0:
                await asyncio.wait_for(asyncio.shield(t.future), max(0.0, t.deadline - now))
            else:
                await t.future
        except TimeoutError:
            if t.future.done() and not t.future.cancelled() and t.future.exception():
                # the ticker refused it as its deadline passed, just before the timer fired:
                # its refusal (which knows where it stood) is the answer
                raise t.future.exception() from None  # type: ignore[misc]
            if not t.granted:
                raise self._too_late(t) from None
        except BaseException:  # cancelled: out of the queue, and any slot it got back
            self._leave(t)
            raise
        return t

    def room_freed(self) -> None:
        """A sandbox went away (or anything else that may make room): look at the queue."""
        if self.waiting:
            self.pump()

    def _refusal(self, spec: SandboxSpec) -> AdmissionRejected | None:
        """Admission's refusal of ``spec`` now if room may lift it; one that room never
        lifts (a backend the node lacks) is the create's own to raise, typed as its admission
        says (``UnknownBackend``...), so the queue lets it through."""
        refusal = self.fits(spec, tuple(self._pending.values()))
        if refusal is None or refusal.context.get("reason") not in WAITABLE:
            return None
        return refusal

    def _holdings(self) -> dict[str, float]:
        """What each project holds: its live sandboxes, and its creates let go but not yet
        admitted (not among them yet)."""
        held: dict[str, float] = dict(self.held())
        for t in self._pending:
            held[t.project] = held.get(t.project, 0) + 1
        return held

    def pump(self) -> None:
        """Let go, in fair order, every create that may go now."""
        held = self._holdings() if self.waiting else {}
        while self.waiting and self.starting < self.max_starting:
            t = self.waiting.peek(held)
            assert t is not None
            refusal = self._refusal(t.spec)
            if refusal is not None:
                reason = refusal.context.get("reason")
                if time.monotonic() < t.deadline:
                    break  # the head waits for room; the ticker looks again
                self.waiting.pop(held)
                self._reject(str(reason or "admission"))
                assert t.future is not None
                if not t.future.done():
                    t.future.set_exception(self._explained(t, refusal, position=0))
                continue
            self.waiting.pop(held)
            held[t.project] = held.get(t.project, 0) + 1
            self._grant(t)
            assert t.future is not None
            if not t.future.done():
                t.future.set_result(None)
        self._changed()
        if self.waiting and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    # --- inside -----------------------------------------------------------------------------
    def _grant(self, t: Ticket) -> None:
        t.granted = t.pending = True
        self._pending[t] = t.spec
        self.starting += 1
        if self.metrics:
            self.metrics.waited(time.monotonic() - t.queued)
            self.metrics.starting(self.starting)

    def _admitted(self, t: Ticket) -> None:
        if t.pending:
            t.pending = False
            self._pending.pop(t, None)

    def _done(self, t: Ticket) -> None:
        self._admitted(t)
        if t.granted and not t.finished:
            t.finished = True
            self.starting -= 1
            if self.metrics:
                self.metrics.starting(self.starting)
            self.pump()

    def _leave(self, t: Ticket) -> None:
        if self.waiting.remove(t):
            self._changed()
            self.pump()  # it may have been the head that held the others back
        elif t.granted:
            self._done(t)

    async def _tick(self) -> None:
        while self.waiting:
            await asyncio.sleep(TICK)
            self.pump()

    def _changed(self) -> None:
        if self.metrics:
            self.metrics.queued(self.waiting.depth())

    def _reject(self, reason: str) -> None:
        if self.metrics:
            self.metrics.rejected(reason)

    def _too_late(self, t: Ticket) -> AdmissionRejected:
        """The refusal of ``t``, whose deadline passed in the queue (it leaves it)."""
        position = self.waiting.position(t, self._holdings())
        self.waiting.remove(t)
        self._changed()
        refusal = self._refusal(t.spec)
        if refusal is not None:
            err = self._explained(t, refusal, position)
        elif self.starting >= self.max_starting:
            err = self._explained(
                t,
                AdmissionRejected(
                    f"all {self.max_starting} start slots were busy (DSEC_MAX_STARTING)",
                    reason="starting",
                ),
                position,
            )
        else:
            err = self._explained(
                t,
                AdmissionRejected("creates ahead of it in fair order held the room", reason="turn"),
                position,
            )
        self._reject(str(err.context.get("reason")))
        self.pump()
        return err

    def _explained(
        self, t: Ticket, refusal: AdmissionRejected, position: int | None = None
    ) -> AdmissionRejected:
        waited = time.monotonic() - t.queued
        where = "" if position is None else f", {position} creates ahead of it in the queue"
        return AdmissionRejected(
            f"waited {waited:.1f}s of its {max(0.0, t.deadline - t.queued):g}s for room "
            f"(project {t.project!r}{where}): {refusal}",
            **{
                **refusal.context,
                "reason": refusal.context.get("reason", "admission"),
                "waited": round(waited, 3),
                "position": position,
                "project": t.project,
                "depth": len(self.waiting),
            },
        )
