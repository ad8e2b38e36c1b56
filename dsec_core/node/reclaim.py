"""Memory given back: every ``DSEC_VM_RECLAIM_INTERVAL`` seconds the node asks each running
sandbox whose backend claims ``Feature.BALLOON`` (the VM backends) for the memory it has not
touched since the last pass (``Backend.give_back``: a VM backend finds its guest's cold RAM and
has the guest reclaim that much, which free page reporting hands to the host), one sandbox at
a time, never leaving one less than its floor, so a busy guest keeps what it uses and is not
starved.

``DSEC_VM_RECLAIM=0`` turns the passes off (a guest's freed memory still goes back through
free page reporting, unless ``DSEC_VM_BALLOON=0``). ``DSEC_VM_RECLAIM_FLOOR``: what a sandbox
always keeps of what it holds, a size (``64M``, the default) or a fraction of its memory
limit (``0.25``).
``ReclaimStatus`` is what ``dsec node status`` shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..api.messages import ReclaimStatus
from ..backend import Feature
from ..errors import DsecError, InvalidSpec
from ..records import parse_size
from ..vm.coldmem import damon_status
from .host import LifecycleHost

__all__ = ["MemoryReclaim", "ReclaimSettings"]

log = logging.getLogger("dsec.node")


@dataclass(frozen=True)
class ReclaimSettings:
    enabled: bool = True
    interval: float = 30.0
    floor_fraction: float = 0.0
    floor_bytes: int = 64 << 20

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReclaimSettings:
        env = os.environ if environ is None else environ
        floor = env.get("DSEC_VM_RECLAIM_FLOOR", "64M")
        try:
            interval = float(env.get("DSEC_VM_RECLAIM_INTERVAL", "30"))
            if not 0.5 <= interval <= 86400:
                raise ValueError(f"an interval of {interval:g}s (0.5 to 86400)")
            if floor.replace(".", "", 1).isdigit() and float(floor) <= 1:
                fraction, size = float(floor), 0
            else:
                fraction, size = 0.0, parse_size(floor, "DSEC_VM_RECLAIM_FLOOR") or 0
        except (ValueError, DsecError) as e:
            raise InvalidSpec(
                f"DSEC_VM_RECLAIM_INTERVAL, DSEC_VM_RECLAIM_FLOOR: {e}", field="reclaim"
            ) from None
        return cls(
            enabled=env.get("DSEC_VM_RECLAIM", "1") != "0",
            interval=interval,
            floor_fraction=fraction,
            floor_bytes=size,
        )

    def floor(self, memory: int) -> int:
        """What a sandbox of ``memory`` bytes always keeps."""
        return min(memory, max(self.floor_bytes, int(memory * self.floor_fraction)))


class MemoryReclaim:
    """The passes over ``host``'s sandboxes, and what they gave back."""

    def __init__(self, host: LifecycleHost, settings: ReclaimSettings | None = None) -> None:
        self.host = host
        self.settings = settings or ReclaimSettings.from_env()
        self.passes = 0
        self.given_back = 0  # bytes, over every pass
        self.last_pass = 0.0  # wall clock
        self.last_given: dict[str, int] = {}  # sandbox -> bytes its last give_back freed
        self._task: asyncio.Task[None] | None = None

    def open(self) -> None:
        if self.settings.enabled:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval)
            await self.one_pass()

    async def one_pass(self) -> int:
        """Ask each running sandbox that can give memory back; the bytes they gave."""
        total = 0
        for sid, sb in list(self.host.sandboxes.items()):
            if Feature.BALLOON not in sb.backend.features or sb.status != "running":
                continue
            if sb.paused or sb.warm:
                continue
            try:
                given = await sb.backend.give_back(
                    sb.rt, sb.backend_state, self.settings.floor(sb.rt.limits.memory)
                )
            except (DsecError, OSError) as e:  # gone meanwhile, or its monitor busy
                log.debug("sandbox %s: giving memory back failed: %s", sid, e)
                continue
            if given:
                self.last_given[sid] = given
                total += given
        for sid in [s for s in self.last_given if s not in self.host.sandboxes]:
            del self.last_given[sid]
        self.passes += 1
        self.given_back += total
        self.last_pass = time.time()
        return total

    def status(self) -> ReclaimStatus:
        damon, why = damon_status()
        return ReclaimStatus(
            enabled=self.settings.enabled,
            interval=self.settings.interval,
            floor=(
                f"{self.settings.floor_fraction:g} of each sandbox's memory"
                if self.settings.floor_fraction
                else f"{self.settings.floor_bytes >> 20} MiB"
            ),
            monitor="referenced bits of each VM's RAM mapping (clear_refs, smaps)",
            damon=damon,
            damon_detail=why,
            passes=self.passes,
            given_back=self.given_back,
            last_pass=self.last_pass,
        )
