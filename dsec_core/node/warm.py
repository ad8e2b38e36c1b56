"""Warm claims: a node keeps running sandboxes of the shapes it is told to, and a create that
matches one claims it instead of starting a sandbox (a claim costs a state write; a cold start
costs a root filesystem, a runtime and an agent).

**Shapes.** A ``Shape`` is every resolved field of a spec that decides what runs: the layers
(the environment's, resolved through the catalogs, and the spec's own), the kernel, backend,
cpu, memory, pids, disk, network, security policies, CPU class, runtime and working directory.
A create matches a member only when its shape is equal. What a create may differ in is what
the node applies at claim, as a cold create would have it: its ``env`` (the node passes a
sandbox's env with every command it starts; nothing inside reads it from anywhere else),
``labels`` (and so its project), ``ttl`` (counted from the claim) and ``environment`` as
named. A spec that asks for devices, drives other sandboxes, belongs to a FnCall pool or
starts from a saved state never claims.

**Identity.** A member is admitted and started as a cold create is, under a fresh sandbox id
(``Admission.new_sandbox_id``) that no one is ever told until a create claims it; the claim
keeps that id. So its record, its cgroups, its runtime's and its state's names, its hostname
and ``DSEC_SANDBOX_ID`` agree from its start, through the claim and across a daemon restart.
A member ran nothing but its agent, and a claimed sandbox is never a member again: nothing of
a previous tenant can be in it.

**Room.** Members are hidden (``Sandbox.warm``): not listed, not counted by admission or
placement (they are reclaimable), not in any project. The node keeps the sum right instead:
a member is started only while the node, members included, has room for it, nothing waits
in the create queue, no claim came in the last ``REFILL_QUIET`` seconds and fewer than half
the start slots are taken; and members are killed first (``evict``) whenever creates wait for
room, the host's memory runs short or the node, members included, is over its capacity.

**Targets** come from three places, the largest count of a shape winning: the catalogs'
``warm:`` entries, the API (``PUT /v1/warm``, ``dsec node warm``; kept in ``warm.json`` in the
node's home) and the automatic mode, which keeps as many members of each shape as creates of
it came in the last ``window`` seconds, the most asked-for first, within a ``budget`` of
members' memory limits.

A restarted daemon takes the members a previous one left back into their pools (a member is
marked in its state); a closing node kills its members.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..api.messages import WarmPoolStatus, WarmSettings, WarmStatus, WarmTarget
from ..errors import DsecError, InvalidSpec
from ..linux.files import write_atomic
from ..records import SandboxInfo, SandboxSpec, parse_size
from .admission import admit, resolve_spec, with_created
from .host import WarmHost
from .sandbox import POOL_LABEL, Sandbox

__all__ = ["WARM_FILE", "Shape", "WarmPool", "WarmPools", "shape_of"]

log = logging.getLogger("dsec.warm")

#: Where targets set through the API and the automatic mode's settings are kept (in the home).
WARM_FILE = "warm.json"
#: Seconds between two looks at the pools (room, pressure, targets) when nothing else asks.
TICK = 0.25
#: A refill waits until no claim came for this many seconds: a burst of claims is served
#: from what is ready, and the starts that refill it come after, not in the middle.
REFILL_QUIET = 0.05
#: Members started at once, at most, by the refills of all pools together.
REFILL_AT_ONCE = 2
#: The most recent creates the automatic mode remembers.
RECENT = 4096
#: Seconds a pool waits after a member failed to start, doubling up to ``RETRY_MAX``.
RETRY = 0.5
RETRY_MAX = 30.0


@dataclass(frozen=True)
class Shape:
    """What a warm member and a create must share for the create to claim it."""

    layers: tuple[str, ...]
    kernel: str | None
    backend: str
    cpu: float
    memory: int
    pids: int
    disk: int
    network: str
    policies: str  # canonical JSON of the spec's policies and their settings
    qos: str
    runtime: str | None
    workdir: str

    @property
    def name(self) -> str:
        """``kit-base@1/container/1cpu/256M#3fa2c1``: the top layer, backend and size, then a
        digest of the rest (two shapes that differ only in policies have two names)."""
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:6]
        top = self.layers[0] if self.layers else "-"
        more = f"+{len(self.layers) - 1}" if len(self.layers) > 1 else ""
        return f"{top}{more}/{self.backend}/{self.cpu:g}cpu/{self.memory >> 20}M#{digest}"


def shape_of(spec: SandboxSpec, catalogs: Any) -> tuple[SandboxSpec, Shape] | None:
    """``spec`` resolved as a create resolves it (``resolve_spec``) and its ``Shape``; None if
    such a create never claims (devices, drives, a FnCall pool member) or the spec does not
    resolve (the cold create then says why)."""
    if spec.devices or spec.drives or POOL_LABEL in spec.labels:
        return None
    try:
        resolved, kernel = resolve_spec(spec, catalogs)
        layers = tuple(resolved.layers)
        if resolved.environment:
            layers += tuple(catalogs.environment(resolved.environment).layer_refs())
        lim = resolved.limits
    except DsecError:
        return None
    assert resolved.backend is not None
    policies = json.dumps(resolved.policies, sort_keys=True) if resolved.policies else ""
    return resolved, Shape(
        layers=layers,
        kernel=kernel,
        backend=resolved.backend,
        cpu=lim.cpu,
        memory=lim.memory,
        pids=lim.pids,
        disk=lim.disk,
        network=resolved.network,
        policies=policies,
        qos=resolved.qos,
        runtime=resolved.runtime,
        workdir=resolved.workdir,
    )


def member_spec(spec: SandboxSpec) -> SandboxSpec:
    """The spec a member of ``spec``'s shape starts with: nothing of any create's own (env,
    labels, ttl, start bound, trajectory), so nothing of one create can reach another's."""
    return replace(spec, env={}, labels={}, ttl=None, start_timeout=None, trajectory=None)


@dataclass
class WarmPool:
    """The members of one shape: ready to claim (oldest first), and being started."""

    shape: Shape
    spec: SandboxSpec  # what its members start with (``member_spec``)
    ready: collections.deque[str] = field(default_factory=collections.deque)
    starting: int = 0
    claimed: int = 0
    missed: int = 0
    targets: dict[str, int] = field(default_factory=dict)  # source -> count
    retry_at: float = 0.0  # after a failed start, no other before this (monotonic)
    backoff: float = 0.0

    @property
    def target(self) -> int:
        return max(self.targets.values(), default=0)

    @property
    def size(self) -> int:
        return len(self.ready) + self.starting

    def status(self) -> WarmPoolStatus:
        return WarmPoolStatus(
            name=self.shape.name,
            sources=tuple(sorted(s for s, n in self.targets.items() if n)),
            target=self.target,
            ready=len(self.ready),
            starting=self.starting,
            claimed=self.claimed,
            missed=self.missed,
            memory=len(self.ready) * self.shape.memory,
        )


@dataclass
class _Settings:
    """The API's targets and the automatic mode's settings (kept in ``WARM_FILE``)."""

    targets: tuple[WarmTarget, ...] = ()
    auto: bool = False
    budget: int = 4 << 30
    window: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> _Settings:
        env = os.environ if environ is None else environ
        d = cls()
        try:
            return cls(
                auto=env.get("DSEC_WARM_AUTO", "0").lower() in ("1", "true", "yes", "on"),
                budget=parse_size(env.get("DSEC_WARM_BUDGET") or d.budget, "DSEC_WARM_BUDGET") or 0,
                window=float(env.get("DSEC_WARM_WINDOW", d.window)),
            )
        except ValueError as e:
            raise InvalidSpec(f"DSEC_WARM_AUTO, _BUDGET, _WINDOW: {e}") from None

    def to_json(self) -> bytes:
        doc = {
            "targets": [t.to_dict() for t in self.targets],
            "auto": self.auto,
            "budget": self.budget,
            "window": self.window,
        }
        return json.dumps(doc, indent=2).encode() + b"\n"


class WarmPools:
    """Every warm pool of ``host``, the claims, and the loop that refills and evicts."""

    def __init__(self, host: WarmHost, path: Path | None = None) -> None:
        self.host = host
        self.path = path if path is not None else host.config.home / WARM_FILE
        self.settings = _Settings.from_env()
        self.pools: dict[Shape, WarmPool] = {}
        self.members: dict[str, Shape] = {}  # every member, ready or not yet started
        self.recent: collections.deque[tuple[float, Shape, SandboxSpec]] = collections.deque(
            maxlen=RECENT
        )
        self.evicted = 0
        self._last_claim = 0.0
        self._refilling = 0
        self._loop: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        self._later: asyncio.TimerHandle | None = None
        self._closed = False

    # --- life -----------------------------------------------------------------------------
    def open(self) -> None:
        """Read the saved settings, take back the members a previous daemon left (their
        state marks them; ``Node.open`` adopted them as sandboxes), and start the loop."""
        if self.path.is_file():
            try:
                doc = json.loads(self.path.read_text())
                self.settings = _Settings(
                    targets=tuple(WarmTarget.from_dict(t) for t in doc.get("targets", ())),
                    auto=bool(doc.get("auto", self.settings.auto)),
                    budget=int(doc.get("budget", self.settings.budget)),
                    window=float(doc.get("window", self.settings.window)),
                )
            except (ValueError, TypeError, DsecError) as e:
                log.warning("%s: %s; starting without its targets", self.path, e)
        for sid, sb in self.host.sandboxes.items():
            if sb.warm:
                self._adopt(sid, sb)
        self._loop = asyncio.get_running_loop().create_task(self._run())

    def _adopt(self, sid: str, sb: Sandbox) -> None:
        found = shape_of(sb.rt.spec, self.host.catalogs)
        if found is None or sb.status != "running":
            self.host.spawn(self._kill(sid, "a member left that no longer resolves"))
            return
        pool = self._pool(found[1], found[0])
        self.members[sid] = pool.shape
        pool.ready.append(sid)

    async def close(self) -> None:
        """Stop the loop and kill every member: a member holds nothing anyone needs."""
        self._closed = True
        if self._later is not None:
            self._later.cancel()
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        sids = [sid for pool in self.pools.values() for sid in pool.ready]
        for pool in self.pools.values():
            pool.ready.clear()
        await asyncio.gather(*(self._kill(sid, "node closing") for sid in sids))

    # --- claims ---------------------------------------------------------------------------
    async def claim(self, spec: SandboxSpec) -> SandboxInfo | None:
        """A ready member of ``spec``'s shape made the create's sandbox (its env, labels and
        ttl applied), or None: no member is ready, the spec never claims, creates wait in the
        queue (they go first, in fair order), or admission would refuse it (the cold create
        then says why)."""
        if not self.pools and not self.settings.auto:
            return None  # the common case of a node told to keep nothing warm: no cost
        found = shape_of(spec, self.host.catalogs)
        if found is None:
            return None
        resolved, shape = found
        now = time.monotonic()
        if self.settings.auto:
            self.recent.append((now, shape, member_spec(resolved)))
        pool = self.pools.get(shape)
        if pool is None:
            return None
        if not pool.ready or self.host.waiting_creates():
            pool.missed += 1
            self._soon()
            return None
        try:
            admit(resolved, with_created(self.host.load(), self.host.pending_creates()))
        except DsecError:
            return None  # the cold create meets the same refusal and raises it
        sid = self._take(pool)
        if sid is None:
            pool.missed += 1
            self._soon()
            return None
        sb = self.host.sandboxes[sid]
        self.members.pop(sid, None)
        sb.rt = replace(sb.rt, spec=resolved)
        sb.warm = False  # a sandbox of its own from here: listed, counted, its project's
        sb.created = time.time()
        pool.claimed += 1
        self._last_claim = now
        await self.host.set_ttl(sid, resolved.ttl)  # also writes its state, now unmarked
        self._soon()
        return sb.info()

    def _take(self, pool: WarmPool) -> str | None:
        """The oldest ready member that still runs (the dead ones the node is killing)."""
        while pool.ready:
            sid = pool.ready.popleft()
            sb = self.host.sandboxes.get(sid)
            if sb is not None and sb.warm and sb.status == "running" and not sb.paused:
                return sid
            self.members.pop(sid, None)
        return None

    # --- targets --------------------------------------------------------------------------
    def status(self) -> WarmStatus:
        s = self.settings
        return WarmStatus(
            pools=tuple(p.status() for p in self.pools.values()),
            targets=s.targets,
            auto=s.auto,
            budget=s.budget,
            window=s.window,
            evicted=self.evicted,
        )

    def configure(self, settings: WarmSettings) -> WarmStatus:
        """Set the API's targets (all of them, replacing those set before) and, where given,
        the automatic mode's settings; kept in ``WARM_FILE`` for the next daemon."""
        for i, t in enumerate(settings.targets):
            spec = t.spec
            if spec.devices or spec.drives or POOL_LABEL in spec.labels:
                raise InvalidSpec(
                    f"targets[{i}]: a sandbox with devices, drives or of a FnCall pool is "
                    "never kept warm",
                    field=f"targets[{i}].spec",
                )
            self._resolve(spec, f"targets[{i}]")
        s = self.settings
        self.settings = _Settings(
            targets=tuple(settings.targets),
            auto=s.auto if settings.auto is None else settings.auto,
            budget=s.budget if settings.budget is None else settings.budget,
            window=s.window if settings.window is None else settings.window,
        )
        write_atomic(self.path, self.settings.to_json())
        self._retarget()
        self.kick()
        return self.status()

    def _resolve(self, spec: SandboxSpec, where: str) -> tuple[SandboxSpec, Shape]:
        try:
            resolved, _ = resolve_spec(spec, self.host.catalogs)
            self.host.backend(resolved.backend or "")  # UnknownBackend, BackendUnavailable
        except DsecError as e:
            raise type(e)(f"{where}: {e}", **e.context) from e
        found = shape_of(spec, self.host.catalogs)
        if found is None:
            raise InvalidSpec(f"{where}: the spec does not resolve", field=where)
        return found

    def _pool(self, shape: Shape, spec: SandboxSpec) -> WarmPool:
        pool = self.pools.get(shape)
        if pool is None:
            pool = self.pools[shape] = WarmPool(shape, member_spec(spec))
        return pool

    def _retarget(self) -> None:
        """Every pool's targets from the catalogs, the API and the automatic mode now."""
        wanted: dict[Shape, dict[str, int]] = collections.defaultdict(dict)
        specs: dict[Shape, SandboxSpec] = {}
        for source, spec, count in self._explicit():
            found = shape_of(spec, self.host.catalogs)
            if found is None:
                continue
            specs.setdefault(found[1], found[0])
            got = wanted[found[1]]
            got[source] = max(got.get(source, 0), count)
        for shape, (spec, count) in self._auto_targets().items():
            specs.setdefault(shape, spec)
            wanted[shape]["auto"] = count
        for shape, spec in specs.items():
            self._pool(shape, spec)
        for shape, pool in list(self.pools.items()):
            pool.targets = wanted.get(shape, {})
            if not pool.targets and not pool.size:
                del self.pools[shape]  # nothing kept, nothing counted: forgotten

    def _explicit(self) -> Iterable[tuple[str, SandboxSpec, int]]:
        for t in self.settings.targets:
            yield "api", t.spec, t.count
        try:
            catalogs = self.host.catalogs.catalogs()
        except DsecError as e:  # a broken catalog leaves its entries out, said once a tick
            log.warning("reading the catalogs' warm entries: %s", e)
            return
        for catalog in catalogs:
            for entry in catalog.warm:
                yield "catalog", entry.spec(catalog.name), entry.count

    def _auto_targets(self) -> dict[Shape, tuple[SandboxSpec, int]]:
        """As many members of each shape as creates of it came within the window, the most
        asked-for shapes first, while their memory limits fit the budget."""
        if not self.settings.auto:
            return {}
        since = time.monotonic() - self.settings.window
        while self.recent and self.recent[0][0] < since:
            self.recent.popleft()
        counts: collections.Counter[Shape] = collections.Counter()
        specs: dict[Shape, SandboxSpec] = {}
        for _, shape, spec in self.recent:
            counts[shape] += 1
            specs[shape] = spec
        out: dict[Shape, tuple[SandboxSpec, int]] = {}
        left = self.settings.budget
        for shape, n in counts.most_common():
            fits = n if not shape.memory else min(n, left // shape.memory)
            if fits > 0:
                out[shape] = (specs[shape], fits)
                left -= fits * shape.memory
        return out

    # --- the loop: evict, trim, refill ------------------------------------------------------
    def kick(self) -> None:
        """Look at the pools now (a claim, a new target)."""
        self._kick.set()

    async def _run(self) -> None:
        self._retarget()
        while not self._closed:
            # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel that lands as the
            # event is set (a member's start kicks as the node closes), and the loop ran on
            # while close waited for it (a CI run hung there for 300 s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK):
                    await self._kick.wait()
            if self._closed:
                return
            self._kick.clear()
            try:
                self._retarget()
                self._prune()
                self._evict()
                self._trim()
                self._refill()
            except Exception:  # the loop must not die; log and go on
                log.exception("warm pools")

    def _prune(self) -> None:
        """Forget ready members that are gone (died on their own: the node killed them)."""
        for pool in self.pools.values():
            for sid in [s for s in pool.ready if s not in self.host.sandboxes]:
                pool.ready.remove(sid)
                self.members.pop(sid, None)

    def _ready(self) -> list[tuple[WarmPool, str]]:
        """Every ready member, the pool with most ready first (oldest member first)."""
        pools = sorted(self.pools.values(), key=lambda p: len(p.ready), reverse=True)
        return [(p, sid) for p in pools for sid in p.ready]

    def _evict(self) -> None:
        """Kill members first when creates wait for room, when the host's memory runs short
        or when the node, members included, is over its capacity."""
        ready = self._ready()
        if not ready:
            return
        load = self.host.load(warm=True)
        over = max(
            load.sandboxes - load.max_sandboxes,
            0 if load.cpu_committed <= load.cpu_capacity else len(ready),
            0 if load.memory_committed <= load.memory_capacity else len(ready),
        )
        short = load.memory_pressure >= load.memory_pressure_limit / 2 or (
            load.memory_available is not None and load.memory_available < 2 * load.memory_reserve
        )
        n = max(over, self.host.creates_waiting_for_room(), (len(ready) + 3) // 4 if short else 0)
        for pool, sid in ready[:n]:
            self._drop(pool, sid, "room")

    def _trim(self) -> None:
        """Members beyond a pool's target go (a target lowered, an auto shape gone quiet)."""
        for pool in self.pools.values():
            while len(pool.ready) > pool.target:
                self._drop(pool, pool.ready[0], "over its target")

    def _drop(self, pool: WarmPool, sid: str, why: str) -> None:
        with contextlib.suppress(ValueError):
            pool.ready.remove(sid)
        self.members.pop(sid, None)
        self.evicted += why == "room"
        self.host.spawn(self._kill(sid, why))

    async def _kill(self, sid: str, why: str) -> None:
        log.debug("warm member %s goes (%s)", sid, why)
        with contextlib.suppress(DsecError):
            await self.host.kill(sid, reason=f"warm: {why}")

    def _refill(self) -> None:
        """Start members for pools under their targets, while the node is idle enough:
        nothing waits in the create queue, no claim just came, start slots to spare, and
        room for one more member with every member counted."""
        if self._closed or self.host.waiting_creates():
            return
        if time.monotonic() - self._last_claim < REFILL_QUIET:
            self._soon()  # look again once the burst is over (not before: no spin)
            return
        now = time.monotonic()
        for pool in sorted(self.pools.values(), key=lambda p: p.size - p.target):
            if pool.retry_at > now:
                continue
            while pool.size < pool.target and self._refilling < REFILL_AT_ONCE:
                if not self.host.start_slots_spare() or not self._room_for(pool):
                    return
                pool.starting += 1
                self._refilling += 1
                self.host.spawn(self._start(pool))

    def _soon(self) -> None:
        """Look at the pools once ``REFILL_QUIET`` seconds from now (a burst of claims makes
        one look after it, not one each)."""
        if self._later is None and not self._closed:
            self._later = asyncio.get_running_loop().call_later(REFILL_QUIET, self._look_again)

    def _look_again(self) -> None:
        self._later = None
        self.kick()

    def _room_for(self, pool: WarmPool) -> bool:
        load = self.host.load(warm=True)
        if load.refusal(pool.spec) is not None:
            return False
        # a member must leave the host's memory out of the range where _evict kills them
        need = min(pool.shape.memory, 16 << 20)
        return load.memory_available is None or (
            load.memory_available - need >= 2 * load.memory_reserve
        )

    async def _start(self, pool: WarmPool) -> None:
        try:
            info = await self.host.start_warm(pool.spec)
        except DsecError as e:
            log.info("warm pool %s: cannot start a member: %s", pool.shape.name, e)
            pool.backoff = min(RETRY_MAX, 2 * pool.backoff or RETRY)
            pool.retry_at = time.monotonic() + pool.backoff
            return
        finally:
            pool.starting -= 1
            self._refilling -= 1
            self.kick()
        if self._closed or self.pools.get(pool.shape) is not pool:
            # killed here, in this task: a closing node waits for it (a kill spawned now
            # would start after the node stopped waiting, and the member would outlive it)
            await self._kill(info.id, "its pool is gone")
            return
        pool.backoff = 0.0
        self.members[info.id] = pool.shape
        pool.ready.append(info.id)
