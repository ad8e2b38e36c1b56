"""The ends a sandbox meets without a request: its start takes too long, its time runs out
(TTL), or its processes die on their own. ``Lifecycle`` arms the timers, watches each
sandbox's exit descriptor (and polls those without one), remembers what the dead died of, and
runs the node's background tasks; each end is a kill it asks of its host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from ..errors import (
    InvalidSpec,
    StartTimeout,
    UnknownSandbox,
)
from ..records import InfraEvent
from .host import LifecycleHost
from .sandbox import Sandbox, died_error

__all__ = ["MAX_DEATHS", "Lifecycle"]

log = logging.getLogger("dsec.node")

#: How many dead sandboxes' causes of death the node remembers (the most recent).
MAX_DEATHS = 1024
#: Seconds between two rounds of the watch loop.
WATCH_PERIOD = 1.0


class Lifecycle:
    """TTLs, exit watches and background tasks of ``host``'s sandboxes. ``sweep`` runs on
    every round of the watch loop (the node sweeps idle layer mounts). With ``deaths_file``
    (on the node's runtime tmpfs) the causes of death outlive the daemon: a restarted one
    still answers ``SandboxDied`` for a sandbox that died before or while it was away."""

    def __init__(
        self,
        host: LifecycleHost,
        sweep: Callable[[], None] = lambda: None,
        deaths_file: Path | None = None,
    ) -> None:
        self.host = host
        self.sweep = sweep
        self.deaths_file = deaths_file
        self.tasks: set[asyncio.Task] = set()
        #: sandbox id -> (kind, cause) of those that died on their own, the latest MAX_DEATHS
        self.deaths: dict[str, tuple[str, str]] = {}
        #: ids of sandboxes inside ``expect_exit``: their processes may end (a VM's pause)
        self.expecting: set[str] = set()
        self._watch: asyncio.Task | None = None

    def open(self) -> None:
        """Read back the causes of death a previous daemon wrote (``Node.open``, before it
        adopts what that daemon left)."""
        if self.deaths_file is None:
            return
        try:
            doc = json.loads(self.deaths_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:  # a courtesy, as the causes are
            log.warning("causes of death in %s unreadable: %s", self.deaths_file, e)
            return
        for sid, (kind, cause) in doc.items():
            self.deaths[str(sid)] = (str(kind), str(cause))

    def start(self) -> None:
        """Start the watch loop (``Node.open``)."""
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    def stop(self) -> None:
        """Stop the watch loop (first thing in ``Node.close``)."""
        if self._watch:
            self._watch.cancel()

    async def close(self) -> None:
        """Drop every timer and exit watch (the sandboxes run on), then wait for the
        background tasks (the kills they run)."""
        for sb in self.host.sandboxes.values():
            self.unwatch(sb)
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def watch(self, sb: Sandbox) -> None:
        """Follow a running sandbox: its TTL armed, its exit watched."""
        self.arm(sb)
        self.watch_exit(sb)

    def unwatch(self, sb: Sandbox) -> None:
        """Stop following ``sb`` (it is being killed, or the node closes)."""
        self.unwatch_exit(sb)
        self.disarm(sb)

    # --- time to live ---------------------------------------------------------------------
    def arm(self, sb: Sandbox) -> None:
        """Kill ``sb`` when it expires (``sb.expires``; None: never)."""
        if sb.expires is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, sb.expires - time.time())
        sid = sb.rt.id
        sb.ttl_handle = loop.call_later(
            delay, lambda: self.spawn(self.host.kill(sid, reason="ttl"))
        )

    def disarm(self, sb: Sandbox) -> None:
        if sb.ttl_handle:
            sb.ttl_handle.cancel()
            sb.ttl_handle = None

    def set_ttl(self, sb: Sandbox, ttl: float | None) -> None:
        """Give a running sandbox ``ttl`` more seconds from now (None: until killed)."""
        if sb.status != "running":
            raise sb.not_running()
        if ttl is not None and not 0 < ttl < float("inf"):
            raise InvalidSpec(f"ttl must be a positive number of seconds, got {ttl}", field="ttl")
        self.disarm(sb)
        sb.expires = None if ttl is None else time.time() + ttl
        self.arm(sb)

    async def check_start(self, sb: Sandbox, seconds: float) -> None:
        """``StartTimeout`` if ``sb`` took ``seconds`` to start, over its ``start_timeout``:
        its backend is stopped (what else it holds is the create's to undo)."""
        limit = sb.rt.spec.start_timeout
        if limit is None or seconds <= limit:
            return
        await sb.backend.stop(sb.rt, sb.backend_state)
        raise StartTimeout(
            f"sandbox {sb.rt.id} took {seconds:.2f}s to start, over its start_timeout "
            f"of {limit:g}s: killed",
            sandbox_id=sb.rt.id,
            seconds=round(seconds, 3),
            start_timeout=limit,
        )

    # --- deaths ---------------------------------------------------------------------------
    def watch_exit(self, sb: Sandbox) -> None:
        """Have the loop notice when the sandbox stops on its own, if its backend can say so
        through a descriptor; the watch loop polls the others."""
        fd = sb.backend.exit_fd(sb.rt, sb.backend_state)
        if fd is None:
            return
        sb.exit_fd = fd
        sid = sb.rt.id

        def exited() -> None:
            self.unwatch_exit(sb)
            if self.host.sandboxes.get(sid) is sb and sb.status == "running":
                log.warning("sandbox %s died on its own; cleaning up", sid)
                self.spawn(self.host.kill(sid, reason="died"))

        asyncio.get_running_loop().add_reader(fd, exited)

    def unwatch_exit(self, sb: Sandbox) -> None:
        fd, sb.exit_fd = sb.exit_fd, None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    @contextlib.contextmanager
    def expect_exit(self, sb: Sandbox) -> Iterator[None]:
        """Inside this block the sandbox's process may end (a VM's save or pause ends it):
        not a death. Its exit is watched again after, in whatever process it runs in now."""
        self.unwatch_exit(sb)
        self.expecting.add(sb.rt.id)  # nor is it one to the watch loop's polls meanwhile
        try:
            yield
        finally:
            self.expecting.discard(sb.rt.id)
            self.watch_exit(sb)

    def death_of(self, sb: Sandbox) -> InfraEvent:
        """What ``sb`` died of, while what its backend left still tells; remembered for
        ``died`` and returned as the event to record."""
        sid = sb.rt.id
        try:
            said = sb.backend.death_cause(sb.rt, sb.backend_state)
        except Exception:  # a cause is a courtesy; the cleanup must go on
            log.exception("sandbox %s: asking its backend why it died", sid)
            said = None
        kind, cause = said or ("crashed", "its init or runtime stopped")
        sb.died = (kind, cause)  # requests meanwhile are SandboxDied, not SandboxNotRunning
        return self.note_death(sid, kind, cause)

    def note_death(self, sid: str, kind: str, cause: str) -> InfraEvent:
        """Remember that ``sid`` died of ``cause`` (``kind``: "guest_panic" or "crashed"), for
        ``missing``; the event to record."""
        self.deaths[sid] = (kind, cause)
        while len(self.deaths) > MAX_DEATHS:
            self.deaths.pop(next(iter(self.deaths)))
        self._save_deaths()
        return InfraEvent("crashed", sid, time.time(), f"{kind}: {cause}")

    def _save_deaths(self) -> None:
        if self.deaths_file is None:
            return
        tmp = self.deaths_file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.deaths))
            os.replace(tmp, self.deaths_file)
        except OSError as e:  # a full runtime tmpfs: the daemon's memory still has them
            log.warning("saving causes of death in %s: %s", self.deaths_file, e)

    def missing(self, sid: str) -> UnknownSandbox:
        """The error for sandbox ``sid``, which the node does not have: ``SandboxDied`` naming
        what it died of if it died on its own lately, else ``UnknownSandbox``."""
        if sid in self.deaths:
            return died_error(sid, *self.deaths[sid])
        # the others are not listed: an id is all it takes to drive a sandbox
        return UnknownSandbox(f"no sandbox {sid!r} on this node", name=sid)

    async def _watch_loop(self) -> None:
        """Notice sandboxes whose processes died on their own, and sweep."""
        while True:
            await asyncio.sleep(WATCH_PERIOD)
            try:
                self.sweep()
                for sid, sb in list(self.host.sandboxes.items()):
                    if sb.exit_fd is not None:
                        continue  # the loop hears of its end (watch_exit)
                    if sid in self.expecting:
                        continue  # a VM between its save and its new state (expect_exit)
                    if sb.status == "running" and not await sb.backend.alive(
                        sb.rt, sb.backend_state
                    ):
                        log.warning("sandbox %s died on its own; cleaning up", sid)
                        self.spawn(self.host.kill(sid, reason="died"))
            except Exception:  # the watcher must not die; log and go on
                log.exception("watch loop")
