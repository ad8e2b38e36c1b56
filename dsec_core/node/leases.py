"""Trainer leases: sandboxes that pause when the process that owns them stops renewing.

A trainer takes a lease on its sandboxes (an agent sandbox and its workers, a rollout group)
and renews it well within its ``ttl``. If the trainer dies (a preemption takes its machine, a
crash), the renewals stop; when the ttl runs out the lease lapses and the node pauses every one
of its sandboxes (``Node.pause``, with ``reclaim`` if the lease asked) and records an infra
event "preempted" on each. Nothing is lost: processes stand where they were.

A new trainer takes a lease on the same sandboxes (or the same lease is renewed by a trainer
that was only slow): a lapsed lease's sandboxes are handed over, and those a lapse paused
(``Sandbox.preempted``, kept in their saved state) are resumed, so the loop goes on; sandboxes
the trainer paused itself stay paused. A sandbox held by a live lease of another holder is
``LeaseHeld``. Leases live in the daemon's memory: a restarted daemon knows none (a trainer's
next renewal is ``UnknownLease``, and the SDK takes a new lease on the same sandboxes).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

from ..errors import DsecError, InvalidSpec, LeaseHeld, UnknownLease
from ..records import InfraEvent, LeaseInfo
from .host import LeaseHost

__all__ = ["MAX_TTL", "MIN_TTL", "Leases"]

log = logging.getLogger("dsec.leases")

#: Bounds of a lease's ttl, seconds.
MIN_TTL = 0.2
MAX_TTL = 24 * 3600.0


@dataclass
class _Lease:
    id: str
    holder: str
    sandboxes: list[str]
    ttl: float
    reclaim: bool
    expires: float = 0.0  # Unix time
    state: str = "held"  # "held" | "lapsed"
    timer: asyncio.TimerHandle | None = None
    armed: int = 0  # counts arms: a timer of an earlier one (renewed since) does nothing

    def info(self) -> LeaseInfo:
        return LeaseInfo(
            self.id,
            self.holder,
            tuple(self.sandboxes),
            self.ttl,
            self.expires,
            self.state,
            self.reclaim,
        )


class Leases:
    """The leases on ``host``'s sandboxes."""

    def __init__(self, host: LeaseHost) -> None:
        self.host = host
        self._leases: dict[str, _Lease] = {}
        self._by_sandbox: dict[str, str] = {}

    async def take(
        self, sandboxes: list[str], ttl: float, holder: str = "", reclaim: bool = False
    ) -> LeaseInfo:
        """A new lease on ``sandboxes`` for ``holder``; those a lapsed lease held are handed
        over (and resumed if its lapse paused them)."""
        _check_ttl(ttl)
        if not sandboxes:
            raise InvalidSpec("a lease needs at least one sandbox", field="sandboxes")
        ids = list(dict.fromkeys(sandboxes))
        for sid in ids:
            self.host.sandbox(sid)  # UnknownSandbox
            held = self._leases.get(self._by_sandbox.get(sid, ""))
            if held is not None and held.state == "held":
                raise LeaseHeld(
                    f"sandbox {sid} is held by lease {held.id} of {held.holder or 'a trainer'} "
                    f"until {held.expires:.1f}",
                    sandbox_id=sid,
                    lease=held.id,
                )
        name = self.host.config.node_name  # as sandbox ids: an apiserver routes by the suffix
        lease_id = secrets.token_hex(8) + (f"-{name}" if name else "")
        lease = _Lease(lease_id, holder, ids, float(ttl), reclaim)
        for sid in ids:
            old = self._leases.get(self._by_sandbox.get(sid, ""))
            if old is not None:
                old.sandboxes.remove(sid)
                if not old.sandboxes:
                    self._drop(old)
            self._by_sandbox[sid] = lease.id
        self._leases[lease.id] = lease
        self._arm(lease)
        await self._resume(lease)
        return lease.info()

    async def renew(self, lease_id: str) -> LeaseInfo:
        """Push ``lease_id``'s expiry a ttl ahead; a lapsed lease is held again and what its
        lapse paused is resumed."""
        lease = self._get(lease_id)
        self._arm(lease)
        if lease.state == "lapsed":
            lease.state = "held"
            await self._resume(lease)
        return lease.info()

    async def release(self, lease_id: str, kill: bool = False) -> LeaseInfo:
        """End ``lease_id``: its sandboxes stay as they are (or are killed with ``kill``)."""
        lease = self._get(lease_id)
        self._drop(lease)
        if kill:
            await asyncio.gather(
                *(self.host.kill(sid) for sid in lease.sandboxes), return_exceptions=True
            )
        return lease.info()

    def get(self, lease_id: str) -> LeaseInfo:
        return self._get(lease_id).info()

    def forget(self, sid: str) -> None:
        """``sid`` is gone: no lease holds it any more."""
        lease = self._leases.get(self._by_sandbox.pop(sid, ""))
        if lease is not None:
            lease.sandboxes.remove(sid)
            if not lease.sandboxes:
                self._drop(lease)

    def close(self) -> None:
        for lease in list(self._leases.values()):
            self._drop(lease)

    # ---------------------------------------------------------------------------------------
    def _get(self, lease_id: str) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise UnknownLease(f"no lease {lease_id!r} on this node", lease=lease_id)
        return lease

    def _drop(self, lease: _Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        self._leases.pop(lease.id, None)
        for sid in lease.sandboxes:
            if self._by_sandbox.get(sid) == lease.id:
                del self._by_sandbox[sid]

    def _arm(self, lease: _Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        lease.expires = time.time() + lease.ttl
        lease.armed += 1
        armed = lease.armed
        loop = asyncio.get_running_loop()
        lease.timer = loop.call_later(lease.ttl, lambda: self.host.spawn(self._lapse(lease, armed)))

    async def _lapse(self, lease: _Lease, armed: int) -> None:
        # Not by the clock: the loop may run a timer a hair early, and wall time may step.
        if self._leases.get(lease.id) is not lease or lease.state != "held":
            return
        if armed != lease.armed:  # renewed between the timer and this task
            return
        lease.state = "lapsed"
        log.warning(
            "lease %s of %s lapsed (no renewal in %.1fs): pausing %s",
            lease.id,
            lease.holder or "a trainer",
            lease.ttl,
            ", ".join(lease.sandboxes),
        )
        # drivers first: a loop stops before the workers it drives, so no new command of it
        # meets a paused worker (one in flight is frozen with its worker and goes on after)
        for sid in sorted(lease.sandboxes, key=lambda sid: not self._drives(sid)):
            sb = self.host.sandboxes.get(sid)
            if sb is None or sb.status != "running":
                continue
            if sb.paused:  # paused by its trainer: its trainer resumes it
                continue
            try:
                await self.host.pause(sid, reclaim=lease.reclaim, preempted=True)
            except DsecError as e:
                log.warning("lease %s lapsed, but %s could not be paused: %s", lease.id, sid, e)
                continue
            self.host.record_event(
                InfraEvent(
                    "preempted",
                    sid,
                    time.time(),
                    f"lease {lease.id} of {lease.holder or 'its trainer'} lapsed "
                    f"(no renewal in {lease.ttl:g}s): paused",
                )
            )

    def _drives(self, sid: str) -> bool:
        sb = self.host.sandboxes.get(sid)
        return sb is not None and bool(sb.rt.spec.drives)

    async def _resume(self, lease: _Lease) -> None:
        """Resume those of the lease's sandboxes a lapse paused (``Sandbox.preempted``, kept
        in their state, so this holds across a daemon restart too): workers first."""
        for sid in sorted(lease.sandboxes, key=self._drives):
            sb = self.host.sandboxes.get(sid)
            if sb is None or not sb.preempted:
                continue
            try:
                await self.host.resume(sid)
            except DsecError as e:
                log.warning("lease %s: cannot resume %s: %s", lease.id, sid, e)


def _check_ttl(ttl: float) -> None:
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, (int, float))
        or not (MIN_TTL <= ttl <= MAX_TTL)
    ):
        raise InvalidSpec(
            f"a lease's ttl is {MIN_TTL}-{MAX_TTL:g} seconds, got {ttl!r}", field="ttl"
        )
