"""Warm pools for FnCall: short stateless calls run in resident sandboxes that are reset between
calls instead of created for each.

One ``Pool`` per (environment, backend, cpu, memory). A call leases a clean member (or starts
one while the pool is under its max, or waits for one to come back), runs, and gives it back;
the member is then reset (``Backend.reset``: every process killed, work areas emptied) before
anyone else leases it, whatever the call did. A member that fails its reset, or whose sandbox
died (its agent or init killed), is killed and replaced; one found dead at lease time is
skipped. So a call never gets a dirty or dead member. Pools start at ``min`` members, grow on
demand up to ``max`` and shrink back to ``min`` after ``idle`` seconds without use.

Only backends that claim ``Feature.RESET`` serve pools. Members are ordinary sandboxes of the
node (listed, admitted and counted like any other), labelled ``dsec.fncall-pool``; a restarted
daemon kills the ones a previous daemon left, and a closing node kills its own: they hold
nothing anyone needs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..backend import Feature
from ..errors import (
    AdmissionRejected,
    BackendUnavailable,
    DsecError,
    InvalidSpec,
    SandboxError,
)
from ..records import DeviceRequest, FnCallResult, SandboxSpec, device_requests, parse_size

if TYPE_CHECKING:
    from .node import Node

__all__ = ["POOL_LABEL", "Lease", "Pool", "PoolKey", "PoolSettings", "Pools"]

log = logging.getLogger("dsec.pools")

#: The label every pool member carries, its value the pool's name.
POOL_LABEL = "dsec.fncall-pool"
#: The working directory of calls when the environment names none ("/" is read-only there).
DEFAULT_WORKDIR = "/work"
#: A member's writable layer: unused under a read-only root, so as small as one can be.
MEMBER_DISK = "16M"


@dataclass(frozen=True)
class PoolSettings:
    """How big pools are and how long idle members stay (``DSEC_FNCALL_POOL_MIN``,
    ``DSEC_FNCALL_POOL_MAX``, ``DSEC_FNCALL_IDLE``, ``DSEC_FNCALL_LEASE_TIMEOUT``), and the
    sizes of the environments that differ (``DSEC_FNCALL_POOLS="fizzbuzz=2:8,other=0:4"``)."""

    min: int = 0
    max: int = 16
    idle: float = 60.0  # seconds a free member beyond ``min`` stays unused before it goes
    lease_timeout: float = 30.0  # seconds a call waits for a member of a full pool
    #: environment -> (min, max), for the environments whose pools differ from the default
    sizes: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def size_of(self, environment: str) -> tuple[int, int]:
        """(min, max) for ``environment``, named as a call names it (``default/fizzbuzz`` or
        ``fizzbuzz``: a size set for the bare name covers the qualified one)."""
        bare = environment.rpartition("/")[2]
        return self.sizes.get(environment, self.sizes.get(bare, (self.min, self.max)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PoolSettings:
        env = os.environ if environ is None else environ
        d = cls()
        try:
            s = cls(
                min=int(env.get("DSEC_FNCALL_POOL_MIN", d.min)),
                max=int(env.get("DSEC_FNCALL_POOL_MAX", d.max)),
                idle=float(env.get("DSEC_FNCALL_IDLE", d.idle)),
                lease_timeout=float(env.get("DSEC_FNCALL_LEASE_TIMEOUT", d.lease_timeout)),
                sizes=_pool_sizes(env.get("DSEC_FNCALL_POOLS", "")),
            )
        except ValueError as e:
            raise InvalidSpec(
                f"DSEC_FNCALL_POOL_MIN/MAX, _POOLS, _IDLE, _LEASE_TIMEOUT: {e}"
            ) from None
        if any(not 0 <= lo <= hi or hi < 1 for lo, hi in s.sizes.values()):
            raise InvalidSpec(f"DSEC_FNCALL_POOLS: need 0 <= min <= max and max >= 1: {s.sizes}")
        if not 0 <= s.min <= s.max or s.max < 1 or s.idle < 0 or s.lease_timeout < 0:
            raise InvalidSpec(
                "FnCall pools need 0 <= DSEC_FNCALL_POOL_MIN <= DSEC_FNCALL_POOL_MAX, a max of "
                f"at least 1, and DSEC_FNCALL_IDLE and DSEC_FNCALL_LEASE_TIMEOUT >= 0; got {s}"
            )
        return s


def _pool_sizes(text: str) -> dict[str, tuple[int, int]]:
    """``"fizzbuzz=2:8,other=0:4"`` -> ``{"fizzbuzz": (2, 8), "other": (0, 4)}``."""
    out = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, sep, sizes = item.partition("=")
        lo, colon, hi = sizes.partition(":")
        if not sep or not colon or not name.strip():
            raise ValueError(f"expected ENV=MIN:MAX, got {item!r}")
        out[name.strip()] = (int(lo), int(hi))
    return out


@dataclass
class Lease:
    """A member leased for one call (``Pools.lease``): its sandbox, its pool, the working
    directory of calls, and how long the lease waited (a new member's start included)."""

    pool: Pool
    sid: str
    workdir: str
    wait: float
    broken: bool = False

    async def check(self) -> bool:
        """Whether the member still lives; if not, it is replaced instead of reset."""
        alive = await self.pool.healthy(self.sid)
        self.broken = self.broken or not alive
        return alive


@dataclass(frozen=True)
class PoolKey:
    """What makes members interchangeable."""

    environment: str
    backend: str
    cpu: float
    memory: int
    #: Members hold these devices as any sandbox does, so a pool is also bounded by them
    devices: tuple[DeviceRequest, ...] = ()

    @property
    def name(self) -> str:
        name = f"{self.environment}/{self.backend}/{self.cpu:g}cpu/{self.memory >> 20}M"
        return "/".join([name, *map(str, self.devices)])


class Pool:
    """The members of one ``PoolKey``: free (clean, most recently used last), leased, or being
    reset or started."""

    def __init__(self, node: Node, key: PoolKey, settings: PoolSettings, workdir: str) -> None:
        self.node = node
        self.key = key
        self.name = key.name
        self.settings = settings
        self.min, self.max = settings.size_of(key.environment)
        self.spec = SandboxSpec(
            environment=key.environment,
            backend=key.backend,
            cpu=key.cpu,
            memory=key.memory,
            disk=MEMBER_DISK,
            ttl=None,
            workdir=workdir,
            labels={POOL_LABEL: key.name},
            devices=key.devices,
        )
        self.members: set[str] = set()
        self.free: list[str] = []
        self.last_used: dict[str, float] = {}
        self.starting = 0
        self.resetting = 0
        self.waiters: collections.deque[asyncio.Future[str]] = collections.deque()
        self.replaced = 0  # members killed because they broke (or failed a reset)

    @property
    def size(self) -> int:
        return len(self.members) + self.starting

    # --- lease and give back --------------------------------------------------------------
    async def lease(self) -> str:
        """A clean, live member: a free one, a new one while under ``max`` and the node has
        room for it, or the next one given back; ``AdmissionRejected`` naming the pool after
        ``lease_timeout`` (the node's own refusal if it refused a new member meanwhile)."""
        deadline = time.monotonic() + self.settings.lease_timeout
        refused: AdmissionRejected | None = None  # the node's answer to a new member
        while True:
            while self.free:
                sid = self.free.pop()
                try:
                    ok = await self.healthy(sid)
                except BaseException:  # the caller went away: the member stays free
                    self.free.append(sid)
                    raise
                if ok:
                    return sid
                self._discard(sid, "found dead at lease")
            # a member being reset is back in a millisecond or two; a new one takes ~50 ms
            if refused is None and self.size < self.max and self.resetting <= len(self.waiters):
                self.starting += 1
                try:
                    return await self._start()
                except AdmissionRejected as e:
                    if not self.members:  # no member of ours will come back: nothing to wait for
                        raise
                    # the node has no room for another (its devices are held, its memory is
                    # short): wait for one of ours instead, as for a full pool
                    refused = e
                    continue
            fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            left = deadline - time.monotonic()
            try:
                done, _ = await asyncio.wait({fut}, timeout=max(0.0, left))
            except BaseException:  # the caller went away: a member handed over meanwhile
                if fut.done() and not fut.cancelled():  # goes to the next caller, not lost
                    self._put(fut.result())
                else:
                    fut.cancel()
                    with contextlib.suppress(ValueError):
                        self.waiters.remove(fut)
                raise
            if not done:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self.waiters.remove(fut)
                if refused is not None:
                    raise refused
                raise AdmissionRejected(
                    f"fncall pool {self.name}: all {self.max} members busy for "
                    f"{self.settings.lease_timeout:g}s (DSEC_FNCALL_POOL_MAX or _POOLS, "
                    "DSEC_FNCALL_LEASE_TIMEOUT)",
                    reason="fncall-pool",
                    pool=self.name,
                )
            sid = fut.result()
            if await self.healthy(sid):
                return sid
            self._discard(sid, "found dead at lease")

    def give_back(self, sid: str, broken: bool) -> None:
        """Reset the member (or replace it if ``broken``) and hand it to the next call."""
        self.node._spawn(self._recycle(sid, broken))

    async def _recycle(self, sid: str, broken: bool) -> None:
        if not broken:
            self.resetting += 1
            try:
                await self.node.reset(sid)
            except DsecError as e:
                log.warning("fncall pool %s: member %s failed its reset: %s", self.name, sid, e)
                broken = True
            finally:
                self.resetting -= 1
        if broken:
            self._discard(sid, "broken")
            self._refill()
        else:
            self._put(sid)

    def _put(self, sid: str) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(sid)
                return
        self.last_used[sid] = time.monotonic()
        self.free.append(sid)

    async def healthy(self, sid: str) -> bool:
        sb = self.node.sandboxes.get(sid)
        return (
            sb is not None
            and sb.status == "running"
            and await sb.backend.alive(sb.rt, sb.backend_state)
        )

    async def _start(self) -> str:
        """Start a member; the caller counted it in ``starting`` already (synchronously, so
        no other lease sees room that is taken)."""
        try:
            info = await self.node.create(self.spec)
        except AdmissionRejected as e:
            raise AdmissionRejected(
                f"fncall pool {self.name}: cannot start a member: {e}",
                reason=e.context.get("reason", "node"),
                pool=self.name,
            ) from e
        finally:
            self.starting -= 1
        self.members.add(info.id)
        return info.id

    def _discard(self, sid: str, why: str) -> None:
        self.members.discard(sid)
        self.last_used.pop(sid, None)
        with contextlib.suppress(ValueError):
            self.free.remove(sid)
        self.replaced += why != "idle"
        log.info("fncall pool %s: member %s goes (%s)", self.name, sid, why)
        if sid in self.node.sandboxes:
            self.node._spawn(self._kill(sid))

    async def _kill(self, sid: str) -> None:
        try:
            await self.node.kill(sid, reason="fncall pool")
        except DsecError:  # gone on its own meanwhile
            pass

    def _refill(self) -> None:
        """Start members for waiting calls and up to ``min``, in the background."""
        want = max(self.min - self.size, 0)
        want = max(want, min(len(self.waiters), self.max - self.size))
        for _ in range(want):
            self.starting += 1
            self.node._spawn(self._start_free())

    async def _start_free(self) -> None:
        try:
            sid = await self._start()
        except DsecError as e:
            log.warning("fncall pool %s: cannot start a member: %s", self.name, e)
            return
        self._put(sid)

    def shrink(self, now: float) -> None:
        """Let free members beyond ``min`` that sat unused for ``idle`` seconds go."""
        for sid in list(self.free):  # oldest first
            if self.size <= self.min:
                return
            if now - self.last_used.get(sid, now) >= self.settings.idle:
                self._discard(sid, "idle")

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "size": self.size,
            "free": len(self.free),
            "min": self.min,
            "max": self.max,
            "waiting": len(self.waiters),
            "replaced": self.replaced,
            "members": sorted(self.members),
        }


class Pools:
    """Every FnCall pool of a node, and the reaper that shrinks them."""

    def __init__(self, node: Node, settings: PoolSettings | None = None) -> None:
        self.node = node
        self.settings = settings or PoolSettings.from_env()
        self.pools: dict[PoolKey, Pool] = {}
        self._reaper: asyncio.Task | None = None
        self._closed = False

    def pool(
        self,
        environment: str,
        backend: str,
        cpu: float,
        memory: int | str,
        devices: Sequence[DeviceRequest | str] = (),
    ) -> Pool:
        mem = parse_size(memory, "memory")
        if mem is None:
            raise InvalidSpec("fncall: memory must be a size such as '512M'", field="memory")
        key = PoolKey(environment, backend, float(cpu), mem, device_requests(devices))
        found = self.pools.get(key)
        if found is not None:
            return found
        be = self.node.backend(backend)
        if Feature.RESET not in be.features:
            raise BackendUnavailable(
                f"backend {backend!r} cannot serve FnCall pools: it cannot reset a sandbox "
                "between calls (no Feature.RESET); use backend 'fncall'",
                backend=backend,
            )
        env = self.node.catalogs.environment(environment)  # UnknownEnvironment
        workdir = env.workdir if env.workdir not in ("", "/") else DEFAULT_WORKDIR
        p = self.pools[key] = Pool(self.node, key, self.settings, workdir)
        p._refill()
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return p

    async def call(
        self,
        environment: str,
        cmd: str | Sequence[str] | None = None,
        *,
        script: str | None = None,
        stdin: bytes | None = None,
        files: Mapping[str, bytes] | None = None,
        timeout: float | None = None,
        max_output: int = 1 << 20,
        env: Mapping[str, str] | None = None,
        backend: str = "fncall",
        cpu: float = 1.0,
        memory: int | str = "512M",
        devices: Sequence[DeviceRequest | str] = (),
    ) -> FnCallResult:
        if (cmd is None) == (script is None):
            raise InvalidSpec("fncall needs one of cmd or script, not both", field="cmd")
        t0 = time.monotonic()
        async with self.lease(environment, backend, cpu, memory, devices) as m:
            if files:
                await self.write_files(m.sid, m.workdir, files)
            argv = cmd if script is None else ["/bin/sh", "-c", script]
            assert argv is not None
            try:
                r = await self.node.exec(
                    m.sid,
                    argv,
                    timeout=timeout,
                    env=dict(env) if env else None,
                    stdin=stdin,
                    max_output=max_output,
                    exclusive=True,
                )
            except SandboxError as e:
                # the agent's side of the call died under it: the member's init (the agent
                # itself), or the exec's own handler, killed by the call (``kill -9 -1``)
                await m.check()
                return FnCallResult(
                    exit_code=-1,
                    stdout=b"",
                    stderr=f"the call's member or its handler died under it: {e}".encode(),
                    duration=time.monotonic() - t0 - m.wait,
                    command=str(argv),
                    sandbox_id=m.sid,
                    error="runtime-error",
                    member=m.sid,
                    pool=m.pool.name,
                    wait=m.wait,
                )
            return FnCallResult.from_exec(r, member=m.sid, pool=m.pool.name, wait=m.wait)

    @contextlib.asynccontextmanager
    async def lease(
        self,
        environment: str,
        backend: str = "fncall",
        cpu: float = 1.0,
        memory: int | str = "512M",
        devices: Sequence[DeviceRequest | str] = (),
    ) -> AsyncIterator[Lease]:
        """A clean member of the pool for (environment, backend, cpu, memory, devices) for the
        body of the ``async with``; given back (and reset, or replaced if ``Lease.check`` found
        it broken) at its end, whatever happened."""
        if self._closed:
            raise BackendUnavailable("the node is closing: no more FnCalls")
        t0 = time.monotonic()
        pool = self.pool(environment, backend, cpu, memory, devices)
        sid = await pool.lease()
        m = Lease(pool, sid, pool.spec.workdir, time.monotonic() - t0)
        try:
            yield m
        finally:
            pool.give_back(sid, m.broken)  # the reset that follows checks its health too

    async def write_files(self, sid: str, workdir: str, files: Mapping[str, bytes]) -> None:
        """Write ``files`` (paths relative to ``workdir``) into member ``sid``."""
        paths = {}
        for name, data in files.items():
            path = os.path.normpath(os.path.join(workdir, name))
            if not name or "\0" in name:
                raise InvalidSpec(f"files: bad path {name!r}", field="files")
            paths[path] = data.encode() if isinstance(data, str) else bytes(data)
        # the agent makes missing parent directories
        await asyncio.gather(*(self.node.write_file(sid, p, d) for p, d in paths.items()))

    async def _reap(self) -> None:
        period = max(0.2, min(self.settings.idle / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for p in list(self.pools.values()):
                p.shrink(now)

    def status(self) -> list[dict[str, object]]:
        return [p.status() for p in self.pools.values()]

    async def close(self) -> None:
        """Kill every member: a pool holds nothing anyone needs after the node goes."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        for p in self.pools.values():
            for fut in p.waiters:
                fut.cancel()
        sids = [sid for p in self.pools.values() for sid in p.members]
        await asyncio.gather(*(self._kill(s) for s in sids if s in self.node.sandboxes))

    async def _kill(self, sid: str) -> None:
        try:
            await self.node.kill(sid, reason="fncall pool closed")
        except DsecError:
            pass
