"""The nodes an apiserver knows, and the watcher that probes them.

The apiserver keeps no sandbox state: it learns its nodes from a static list or from Ray
(``dsec_core.cluster.discover``), and what each holds from the node's ``probe`` route, asked
every ``interval`` seconds. A node that misses ``misses`` probes in a row is unhealthy: placement
skips it and requests for its sandboxes get ``NodeLost``; one good probe brings it back.
Detection takes at most ``misses * interval + probe_timeout`` seconds.

What the apiserver placed that the nodes' probes may not show yet is in the ``Ledger``: quotas
and placement count it on top of the probes, so requests in flight between two probes are
never counted zero times.

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
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..api.messages import NodeProbe
from ..api.routes import ROUTES
from ..api.transport import AsyncHTTPTransport, TransportError
from ..errors import AdmissionRejected, DsecError, InvalidSpec
from ..records import POOL_LABEL, NodeLoad, SandboxSpec

__all__ = ["Hold", "Ledger", "NodeAddress", "NodeEntry", "NodeSet", "WatchSettings"]

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


@dataclass(eq=False)
class Hold:
    """Sandboxes an apiserver request holds room for: ``count`` of them, with their CPU and
    memory limits summed, for ``project``, on ``node`` (None: not known yet, a restore looking
    for its snapshot). In flight until the node answers; then it stands for what the node
    made until a probe of that node counts them instead: one made after ``created`` (the
    node's clock: the newest sandbox's creation), or, when the node did not say, one sent
    after ``done_at`` (this apiserver's monotonic clock)."""

    project: str
    node: str | None
    count: int
    cpu: float
    memory: int
    done_at: float | None = None
    created: float | None = None


_Sums = tuple[int, float, int]


class Ledger:
    """What this apiserver has placed that the nodes' probes may not show yet.

    ``hold`` reserves room before a node is asked; ``settle`` records what the node made
    (nothing, for a refusal: the room is free again at once). A probe counts a node's
    sandboxes by their creation time (``NodeProbe.at``), so ``probed`` drops exactly the held
    sandboxes it counted; a hold settled after a probe that already counted its sandboxes goes
    at once. Holds in flight are kept whatever the probes say (the node may be counting the
    sandboxes it is creating too): while a request is in flight its sandboxes may count
    twice, never zero times. Single-threaded (the apiserver's event loop): a check and the
    hold that follows it are one step.

    Every create reads the sums by node and by project, and at a thousand creates a second
    with probes a second apart a thousand holds are kept: the sums are kept as the holds
    come and go, and the holds are filed by node (a probe looks at its node's only), so
    neither costs more with more holds.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self._clock = clock
        self._on_change = on_change  # told the node whose held sums changed
        self._holds: dict[str | None, set[Hold]] = {}  # by node (None: not known yet)
        self._probed: dict[str, float] = {}  # node -> its last probe's NodeProbe.at
        self._by_node: dict[str, list[Any]] = {}  # node -> [count, cpu, memory] held
        self._by_project: dict[str, list[Any]] = {}

    def _file(self, h: Hold, sign: int) -> None:
        """Add ``h`` to the sums (``sign`` 1) or take it out of them (-1), and file it."""
        if sign > 0:
            self._holds.setdefault(h.node, set()).add(h)
        else:
            filed = self._holds.get(h.node)
            if filed is not None:
                filed.discard(h)
                if not filed:
                    del self._holds[h.node]
        tables = [(self._by_project, h.project)]
        if h.node is not None:
            tables.append((self._by_node, h.node))
            if self._on_change is not None:
                self._on_change(h.node)
        for table, key in tables:
            sums = table.setdefault(key, [0, 0.0, 0])
            sums[0] += sign * h.count
            sums[1] += sign * h.cpu
            sums[2] += sign * h.memory
            if sums[0] <= 0:  # nothing held: exactly nothing (no float left over)
                del table[key]

    def _filed(self, h: Hold) -> bool:
        return h in self._holds.get(h.node, ())

    def hold(self, project: str, node: str | None, count: int, cpu: float, memory: int) -> Hold:
        """Hold room for ``count`` sandboxes of ``cpu`` cores and ``memory`` bytes each."""
        h = Hold(project, node, count, count * cpu, count * memory)
        self._file(h, 1)
        return h

    def settle(
        self,
        hold: Hold,
        made: int,
        *,
        node: str | None = None,
        created: float | None = None,
        cpu: float | None = None,
        memory: int | None = None,
    ) -> None:
        """The node answered: it made ``made`` of the held sandboxes (on ``node``, the newest
        at ``created`` by the node's clock, with these summed limits when they differ from what
        was held). Nothing made: the hold goes."""
        if not self._filed(hold):
            return  # settled already (and gone)
        node = node or hold.node
        if (
            0 < made == hold.count
            and node == hold.node
            and cpu is None
            and memory is None
            and (created is None or created >= self._probed.get(node or "", 0.0))
        ):
            # all it held was made where it was held (the common create): the sums stand as
            # they are, and nothing changed for placement
            hold.created, hold.done_at = created, self._clock()
            return
        self._file(hold, -1)
        if made <= 0 or (created is not None and created < self._probed.get(node or "", 0.0)):
            return
        if hold.count:
            share = made / hold.count
            hold.cpu = cpu if cpu is not None else hold.cpu * share
            hold.memory = memory if memory is not None else int(hold.memory * share)
        hold.count, hold.node, hold.created = made, node, created
        hold.done_at = self._clock()
        self._file(hold, 1)

    def probed(self, node: str, sent_at: float, at: float = 0.0) -> None:
        """A probe of ``node`` sent at ``sent_at`` (this clock) and made at ``at`` (the node's
        clock; 0: not said) answered: it counts what the node had made by then."""
        if at:
            self._probed[node] = at

        def counted(h: Hold) -> bool:
            if h.done_at is None:
                return False
            if h.created is not None and at:
                return h.created < at
            return h.done_at < sent_at

        for h in [h for h in self._holds.get(node, ()) if counted(h)]:
            self._file(h, -1)

    def now(self) -> float:
        return self._clock()

    def by_project(self) -> dict[str, _Sums]:
        return {p: (s[0], s[1], s[2]) for p, s in self._by_project.items()}

    def by_node(self) -> dict[str, _Sums]:
        return {n: (s[0], s[1], s[2]) for n, s in self._by_node.items()}

    def held(self, node: str) -> _Sums:
        """What is held on ``node``: (count, cpu, memory)."""
        s = self._by_node.get(node)
        return (s[0], s[1], s[2]) if s is not None else (0, 0.0, 0)


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
        self._load: tuple[NodeProbe, _Sums, NodeLoad] | None = None
        self._refusal: tuple[NodeLoad, tuple[Any, ...], AdmissionRejected | None] | None = None

    @property
    def name(self) -> str:
        return self.address.name

    @property
    def pool(self) -> str:
        labels = self.probe.load.labels if self.probe else self.address.labels
        return labels.get(POOL_LABEL, "home")

    def load(self, held: _Sums = (0, 0.0, 0)) -> NodeLoad | None:
        """The node as placement sees it: the probe's load with what is ``held`` for it since
        (the ledger's), and the layers it holds. The same record while neither changes (every
        create asks it of every node; most nodes did not change since the last one)."""
        probe = self.probe
        if probe is None:
            return None
        seen = self._load
        if seen is not None and seen[0] is probe and seen[1] == held:
            return seen[2]
        load = probe.load
        n, cpu, memory = held
        # a copy with these fields changed, without ``replace``'s __init__ (which copies the
        # labels and devices again): this runs for every node a create changed
        out = object.__new__(NodeLoad)
        out.__dict__.update(load.__dict__)
        out.__dict__.update(
            node=self.name,
            sandboxes=load.sandboxes + n,
            cpu_committed=load.cpu_committed + cpu,
            memory_committed=load.memory_committed + memory,
            layers=probe.layers,
            environments=probe.environments,
        )
        self._load = (probe, held, out)
        return out

    def refusal(self, load: NodeLoad, spec: SandboxSpec) -> AdmissionRejected | None:
        """``load.refusal(spec)`` (why the node cannot take ``spec``, or None), remembered for
        the last load and the spec's shape: creates of one shape ask it of every node, and
        each asks it anew only of the node the last one changed."""
        shape = _shape(spec)
        seen = self._refusal
        if seen is not None and seen[0] is load and seen[1] == shape:
            return seen[2]
        why = load.refusal(spec)
        self._refusal = (load, shape, why)
        return why

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
#: How many spec shapes ``NodeSet.eligible`` keeps a view for (then it starts over).
_VIEWS = 256
#: How many node changes are logged before the log starts over (and every view with it).
_CHANGES = 20_000


def _shape(spec: SandboxSpec) -> tuple[Any, ...]:
    """What of a spec ``NodeLoad.refusal`` reads: specs of one shape fit the same nodes."""
    return (spec.backend, spec.environment, spec.cpu, spec.memory, spec.qos, spec.devices)


@dataclass
class _Eligible:
    """``NodeSet.eligible``'s answer for one spec shape, as of its ``seen`` changes."""

    epoch: int = -1
    seen: int = 0  # how many of ``NodeSet._changes`` it has looked at
    loads: dict[str, NodeLoad] = field(default_factory=dict)


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
        #: the nodes that changed (a probe, its health, what is held on it), in order:
        #: placement looks again at those only (``eligible``)
        self._changes: list[str] = []
        self._epoch = 0  # bumped when ``_changes`` starts over: every view looks at all nodes
        self._views: dict[tuple[Any, ...], _Eligible] = {}
        #: bumped when a node turns healthy or unhealthy or is registered (what is summed
        #: over the healthy nodes is as old as this and ``round``)
        self.health = 0
        self.ledger = Ledger(on_change=self._touch)
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
        self.health += 1  # a moved node is unhealthy until its first probe at the new address
        self._touch(address.name)

    def _touch(self, name: str) -> None:
        self._changes.append(name)
        if len(self._changes) > _CHANGES:
            self._changes.clear()
            self._epoch += 1

    def eligible(self, spec: SandboxSpec) -> list[NodeLoad]:
        """The healthy nodes of the home pool that can take one sandbox of ``spec`` now, as
        placement sees them (``NodeEntry.load`` with what the ledger holds). Kept for each
        spec shape and brought up to date from the nodes that changed since it was last
        asked: a create costs the nodes the last creates and probes changed, not all of
        them (at 160 nodes, looking at each one per create was most of the apiserver's
        time)."""
        shape = _shape(spec)
        view = self._views.get(shape)
        if view is None:
            if len(self._views) >= _VIEWS:
                self._views.clear()
            view = self._views[shape] = _Eligible()
        if view.epoch != self._epoch:
            view.epoch, view.seen, view.loads = self._epoch, 0, {}
            changed: Iterable[str] = list(self.nodes)
        else:
            changed = set(self._changes[view.seen :])
        if changed:
            for name in changed:
                entry = self.nodes.get(name)
                load = None
                if entry is not None and entry.healthy and entry.pool != "overflow":
                    load = entry.load(self.ledger.held(name))
                if load is not None and entry is not None and entry.refusal(load, spec) is None:
                    view.loads[name] = load
                else:
                    view.loads.pop(name, None)
            view.seen = len(self._changes)
        return list(view.loads.values())

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
        sent_at = self.ledger.now()
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
                self.health += 1
                self._touch(entry.name)
                entry.lost_at = time.time()
                log.warning("node %s lost after %d missed probes: %s", entry.name, entry.misses, e)
            if not entry.healthy:
                # requests in flight to it will get no answer: they fail now (NodeLost), not
                # at their own timeouts (a create's is minutes); at each missed probe, for
                # one placed just before the node was given up may only connect after that
                entry.transport.abort()
            if self._on_probe:
                self._on_probe(entry, time.perf_counter() - t0, False)
            return
        entry.probe, entry.misses, entry.last_ok = probe, 0, time.time()
        self._touch(entry.name)
        self.ledger.probed(entry.name, sent_at, probe.at)  # it counts what was made before it
        self.round += 1
        if not entry.healthy:
            log.info("node %s healthy (%s)", entry.name, entry.address.url)
            self.health += 1
        entry.healthy, entry.lost_at, entry.error = True, None, ""
        if self._on_probe:
            self._on_probe(entry, time.perf_counter() - t0, True)
