"""The nodes an apiserver knows, and the watcher that probes them.

The apiserver keeps no sandbox state: it learns its nodes from a static list or from Ray
(``dsec_core.cluster.discover``), and what each holds from the node's ``probe`` route, asked
every ``interval`` seconds. A node that misses ``misses`` probes in a row is unhealthy: placement
skips it and requests for its sandboxes get ``NodeLost``; one good probe brings it back.
Detection takes at most ``misses * interval + probe_timeout`` seconds.

Each node is addressed by its name (``DSEC_NODE_NAME``), which ends every sandbox id it makes,
so an id routes to its node without asking anyone. A node whose probe answers with another name
than the one it was registered under is never used: traffic only goes to registered nodes
under the names they really have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..api.messages import NodeProbe
from ..api.routes import ROUTES
from ..api.transport import AsyncHTTPTransport, TransportError
from ..errors import DsecError, InvalidSpec
from ..records import POOL_LABEL, NodeLoad

__all__ = ["NodeAddress", "NodeEntry", "NodeSet", "WatchSettings"]

log = logging.getLogger("dsec.apiserver.nodes")

_PROBE = ROUTES["probe"]


@dataclass(frozen=True)
class NodeAddress:
    """Where a node daemon listens and the bearer token it wants."""

    name: str
    url: str
    token: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WatchSettings:
    """How the watcher probes: every ``interval`` seconds, each probe given ``timeout``
    seconds; ``misses`` missed probes in a row make a node unhealthy. Nodes are discovered
    again every ``rediscover`` seconds."""

    interval: float = 1.0
    timeout: float = 1.0
    misses: int = 2
    rediscover: float = 5.0

    def __post_init__(self) -> None:
        if not (self.interval > 0 and self.timeout > 0 and self.misses >= 1):
            raise InvalidSpec("probe interval and timeout must be positive, misses at least 1")


class NodeEntry:
    """One registered node: its address, a pooled connection to it, and what the last probe
    said."""

    def __init__(self, address: NodeAddress) -> None:
        self.address = address
        self.transport = AsyncHTTPTransport(address.url, token=address.token)
        self.probe: NodeProbe | None = None
        self.healthy = False
        self.misses = 0
        self.last_ok = 0.0
        self.lost_at: float | None = None  # when it turned unhealthy (None: it is not)
        self.error = "not probed yet"
        #: sandboxes placed here since the last probe: (count, cpu, memory) by project
        self.pending: dict[str, tuple[int, float, int]] = {}

    @property
    def name(self) -> str:
        return self.address.name

    @property
    def pool(self) -> str:
        labels = self.probe.load.labels if self.probe else self.address.labels
        return labels.get(POOL_LABEL, "home")

    def load(self) -> NodeLoad | None:
        """The node as placement sees it: the probe's load with what was placed since, and
        the layers it holds."""
        if self.probe is None:
            return None
        load = self.probe.load
        n = sum(c for c, _, _ in self.pending.values())
        cpu = sum(c for _, c, _ in self.pending.values())
        memory = sum(m for _, _, m in self.pending.values())
        return replace(
            load,
            node=self.name,
            sandboxes=load.sandboxes + n,
            cpu_committed=load.cpu_committed + cpu,
            memory_committed=load.memory_committed + memory,
            layers=self.probe.layers,
            environments=self.probe.environments,
        )

    def placed(self, project: str, count: int, cpu: float, memory: int) -> None:
        n, c, m = self.pending.get(project, (0, 0.0, 0))
        self.pending[project] = (n + count, c + count * cpu, m + count * memory)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.address.url,
            "pool": self.pool,
            "healthy": self.healthy,
            "misses": self.misses,
            "error": None if self.healthy else self.error,
            "sandboxes": self.probe.load.sandboxes if self.probe else None,
            "load": round(self.probe.load.load, 4) if self.probe else None,
        }


Discover = Callable[[], Awaitable[Sequence[NodeAddress]]]


class NodeSet:
    """The registered nodes, kept current by a watcher task (``start``/``stop``)."""

    def __init__(
        self,
        static: Sequence[NodeAddress] = (),
        discover: Discover | None = None,
        settings: WatchSettings | None = None,
        on_probe: Callable[[NodeEntry, float, bool], None] | None = None,
    ) -> None:
        self.settings = settings or WatchSettings()
        self._static = list(static)
        self._discover = discover
        self._on_probe = on_probe
        self.nodes: dict[str, NodeEntry] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_discovery = 0.0
        self.round = 0  # good probes so far: what is derived from them is as old as this
        for address in static:
            self._register(address)

    def _register(self, address: NodeAddress) -> None:
        old = self.nodes.get(address.name)
        if old is not None and (old.address.url, old.address.token) == (
            address.url,
            address.token,
        ):
            return
        if old is not None:
            log.info("node %s moved from %s to %s", address.name, old.address.url, address.url)
        self.nodes[address.name] = NodeEntry(address)

    def get(self, name: str) -> NodeEntry | None:
        return self.nodes.get(name)

    def healthy(self) -> list[NodeEntry]:
        return [e for e in self.nodes.values() if e.healthy]

    async def start(self) -> None:
        """Discover and probe every node once, then keep watching in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._watch(), name="dsec-apiserver-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for entry in self.nodes.values():
            await entry.transport.aclose()

    async def refresh(self) -> None:
        """One round: discover (when due) and probe every node."""
        now = time.monotonic()
        if self._discover is not None and now - self._last_discovery >= self.settings.rediscover:
            self._last_discovery = now
            try:
                found = await self._discover()
            except (DsecError, OSError) as e:
                log.warning("node discovery failed: %s", e)
            else:
                for address in found:
                    self._register(address)
        await asyncio.gather(*(self._probe(e) for e in list(self.nodes.values())))

    async def _watch(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.refresh()
            except Exception:  # the watcher must outlive any one bad round
                log.exception("watcher round failed")
            await asyncio.sleep(max(0.0, self.settings.interval - (time.monotonic() - started)))

    async def _probe(self, entry: NodeEntry) -> None:
        t0 = time.perf_counter()
        try:
            # bounded here too: whatever the transport does, one node never holds up a round
            async with asyncio.timeout(self.settings.timeout + 0.5):
                r = await entry.transport.request(
                    "GET", _PROBE.path, timeout=self.settings.timeout, idempotent=False
                )
            if r.status_code != 200:
                raise DsecError(f"probe answered {r.status_code}: {r.text[:200]}")
            probe = _PROBE.decode_response(r.content)
            if probe.name != entry.name:
                raise DsecError(
                    f"the node at {entry.address.url} calls itself {probe.name!r}, not "
                    f"{entry.name!r}: not used"
                )
        except (TransportError, DsecError, OSError, TimeoutError) as e:
            await entry.transport.aclose()  # a connection that failed once is not reused
            entry.misses += 1
            entry.error = str(e) or type(e).__name__
            if entry.healthy and entry.misses >= self.settings.misses:
                entry.healthy = False
                entry.lost_at = time.time()
                log.warning("node %s lost after %d missed probes: %s", entry.name, entry.misses, e)
            if self._on_probe:
                self._on_probe(entry, time.perf_counter() - t0, False)
            return
        entry.probe, entry.misses, entry.last_ok = probe, 0, time.time()
        entry.pending.clear()  # the probe counts what was placed before it
        self.round += 1
        if not entry.healthy:
            log.info("node %s healthy (%s)", entry.name, entry.address.url)
        entry.healthy, entry.lost_at, entry.error = True, None, ""
        if self._on_probe:
            self._on_probe(entry, time.perf_counter() - t0, True)
