"""Pausing sandboxes (``Feature.PAUSE``): every process stopped where it is, memory, open files
and sessions kept, until a resume lets them go on. A paused sandbox's CPU no longer counts
toward admission; ``reclaim`` has the kernel take back what of its memory it can.

A pause or resume waits for a pack_diff in flight (it thaws what it froze when done), and
pool members are never paused (a pool resets them between calls instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ..backend import Feature
from ..errors import BackendUnavailable, InvalidSpec
from ..records import SandboxInfo
from .host import PauseHost
from .sandbox import POOL_LABEL, Sandbox

__all__ = ["Pauses"]

log = logging.getLogger("dsec.node")


class Pauses:
    """Pause and resume of ``host``'s sandboxes."""

    def __init__(self, host: PauseHost) -> None:
        self.host = host

    def _running(self, sid: str) -> Sandbox:
        sb = self.host.sandbox(sid)
        if sb.status != "running":
            raise sb.not_running()
        return sb

    async def pause(self, sid: str, reclaim: bool = False, preempted: bool = False) -> SandboxInfo:
        """Stop every process of a running sandbox where it is (``Feature.PAUSE``): memory,
        open files and sessions stay; its CPU no longer counts toward admission. ``reclaim``
        then has the kernel take back what of its memory it can (``Backend.pause``);
        ``preempted``: paused because its trainer's lease lapsed (a takeover resumes it).
        Pausing a paused sandbox changes nothing."""
        sb = self._running(sid)
        if Feature.PAUSE not in sb.backend.features:
            raise BackendUnavailable(
                f"backend {sb.backend.name!r} cannot pause sandboxes", backend=sb.backend.name
            )
        if POOL_LABEL in sb.rt.spec.labels:
            raise InvalidSpec(f"sandbox {sid} is an FnCall pool member: pools pause nothing")
        await packed(sb)
        if not sb.paused:
            t0 = time.perf_counter()
            # a VM's pause ends its process (its state goes to a file): not a death
            with self.host.expect_exit(sb):
                await sb.backend.pause(sb.rt, sb.backend_state, reclaim=reclaim)
            sb.paused, sb.preempted = True, preempted
            self.host.save(sb)
            log.debug("paused %s in %.1f ms", sid, 1e3 * (time.perf_counter() - t0))
        return sb.info()

    async def resume(self, sid: str) -> SandboxInfo:
        """Let a paused sandbox's processes go on where they were; a no-op if it is not paused."""
        sb = self._running(sid)
        await packed(sb)
        if sb.paused:
            # a VM resumes in a new process: the watch moves to that one
            with self.host.expect_exit(sb):
                await sb.backend.resume(sb.rt, sb.backend_state)
            sb.paused = sb.preempted = False
            self.host.save(sb)
        return sb.info()


async def packed(sb: Sandbox) -> None:
    """Wait for a pack_diff of ``sb`` in flight: it thaws what it froze when done."""
    if sb.packing is not None:
        with contextlib.suppress(Exception):  # the pack's caller gets its error
            await asyncio.shield(sb.packing)
