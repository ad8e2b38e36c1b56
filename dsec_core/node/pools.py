"""Warm pools for FnCall: short stateless calls run in resident sandboxes that are reset between
calls instead of created for each.

One ``Pool`` per (project, environment, backend, cpu, memory, devices). A call checks out a
clean member (``Checkout``: or starts one while the pool is under its max, or waits for one to
come back), runs, and gives it back;
the member is then reset (``Backend.reset``: every process killed, work areas emptied) before
anyone else checks it out, whatever the call did. A member that fails its reset, or whose
sandbox died (its agent or init killed), is killed and replaced; one found dead at checkout is
skipped. So a call never gets a dirty or dead member. Pools start at ``min`` members, grow on
demand up to ``max`` and shrink back to ``min`` after ``idle`` seconds without use.

Only backends that claim ``Feature.RESET`` serve pools. Members are ordinary sandboxes of the
node (listed, admitted and counted like any other), labelled ``dsec.fncall-pool``; a restarted
daemon kills the ones a previous daemon left, and a closing node kills its own: they hold
nothing anyone needs.

**Pools belong to a project.** A call names its project (``project``: the apiserver sets it to
the caller's; a direct caller of the node may leave it None and use the node's shared pools),
and a project's calls check out only members of its own pools, so calls through the apiserver
never share a member across projects. What members count for: each member of a project's
pool is labelled ``dsec.project=<project>`` and counts as one sandbox, with its CPU and memory
limits, against that project's quota (``Node.project_usage``, the apiserver's probe), idle or
busy, from its start until the pool lets it go (after ``idle`` seconds unused beyond the
pool's ``min``; sizes apply to each project's pool on its own). A call with ``start=False``
(the apiserver's choice when the project's quota has no room for one more sandbox) never
starts a member: it takes a free one or waits, up to the checkout timeout, for one to be
given back, and fails with ``AdmissionRejected`` (``reason="pool-start"``) at once if the pool
has no member at all, or when none came free in time.

A member held for one call is a ``Checkout`` (``Pools.checkout``), not a lease: leases are the
trainer's hold on its sandboxes (``dsec_core.node.leases``).
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
from ..iam import check_project_path
from ..records import (
    PROJECT_LABEL,
    DeviceRequest,
    FnCallResult,
    SandboxSpec,
    device_requests,
    parse_size,
)
from ..renamed import renamed_getattr
from .host import PoolHost
from .sandbox import POOL_LABEL  # defined with the records: pausing refuses members too

__all__ = ["POOL_LABEL", "Checkout", "Pool", "PoolKey", "PoolSettings", "Pools"]

if not TYPE_CHECKING:  # ``Lease``, renamed ``Checkout``, warns (mypy would take any name for Any)
    __getattr__ = renamed_getattr(__name__)

log = logging.getLogger("dsec.pools")

#: The working directory of calls when the environment names none ("/" is read-only there).
DEFAULT_WORKDIR = "/work"
#: A member's writable layer: unused under a read-only root, so as small as one can be.
MEMBER_DISK = "16M"


@dataclass(frozen=True)
class PoolSettings:
    """How big pools are and how long idle members stay (``DSEC_FNCALL_POOL_MIN``,
    ``DSEC_FNCALL_POOL_MAX``, ``DSEC_FNCALL_IDLE``, ``DSEC_FNCALL_CHECKOUT_TIMEOUT``), and
    the sizes of the environments that differ (``DSEC_FNCALL_POOLS="fizzbuzz=2:8,other=0:4"``).
    Sizes are per pool: each project's pool of an environment has its own min and max."""

    min: int = 0
    max: int = 16
    idle: float = 60.0  # seconds a free member beyond ``min`` stays unused before it goes
    checkout_timeout: float = 30.0  # seconds a call waits for a member of a full pool
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
                checkout_timeout=float(_checkout_timeout(env, d.checkout_timeout)),
                sizes=_pool_sizes(env.get("DSEC_FNCALL_POOLS", "")),
            )
        except ValueError as e:
            raise InvalidSpec(
                f"DSEC_FNCALL_POOL_MIN/MAX, _POOLS, _IDLE, _CHECKOUT_TIMEOUT: {e}"
            ) from None
        if any(not 0 <= lo <= hi or hi < 1 for lo, hi in s.sizes.values()):
            raise InvalidSpec(f"DSEC_FNCALL_POOLS: need 0 <= min <= max and max >= 1: {s.sizes}")
        if not 0 <= s.min <= s.max or s.max < 1 or s.idle < 0 or s.checkout_timeout < 0:
            raise InvalidSpec(
                "FnCall pools need 0 <= DSEC_FNCALL_POOL_MIN <= DSEC_FNCALL_POOL_MAX, a max of "
                f"at least 1, and DSEC_FNCALL_IDLE and DSEC_FNCALL_CHECKOUT_TIMEOUT >= 0; got {s}"
            )
        return s


def _checkout_timeout(env: Mapping[str, str], default: float) -> str | float:
    """``DSEC_FNCALL_CHECKOUT_TIMEOUT``, or the variable's name before this release
    (``DSEC_FNCALL_LEASE_TIMEOUT``, read with a warning until the next one)."""
    if "DSEC_FNCALL_CHECKOUT_TIMEOUT" in env:
        return env["DSEC_FNCALL_CHECKOUT_TIMEOUT"]
    if "DSEC_FNCALL_LEASE_TIMEOUT" in env:
        log.warning(
            "DSEC_FNCALL_LEASE_TIMEOUT is renamed DSEC_FNCALL_CHECKOUT_TIMEOUT; the old name "
            "goes in the next release"
        )
        return env["DSEC_FNCALL_LEASE_TIMEOUT"]
    return default


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
class Checkout:
    """A member checked out for one call (``Pools.checkout``): its sandbox, its pool, the
    working directory of calls, and how long the call waited for it (a new member's start
    included)."""

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
    #: The project whose calls the members serve and whose quota they count against; None:
    #: the node's direct callers (no project), whose pools are shared among them
    project: str | None = None

    @property
    def name(self) -> str:
        """``fizzbuzz/fncall/1cpu/512M[/gpu...]``, then ``@project`` for a project's pool (the
        environment first, so a name still starts with what the call named)."""
        name = f"{self.environment}/{self.backend}/{self.cpu:g}cpu/{self.memory >> 20}M"
        name = "/".join([name, *map(str, self.devices)])
        return name if self.project is None else f"{name}@{self.project}"


def _cannot_start(pool: str, project: str | None, why: str) -> AdmissionRejected:
    """The refusal of a ``start=False`` call that found no member to take."""
    return AdmissionRejected(
        f"fncall pool {pool}: could not start a member for the call (start=False: it may not "
        f"start one) and {why}",
        reason="pool-start",
        pool=pool,
        project=project,
    )


class Pool:
    """The members of one ``PoolKey``: free (clean, most recently used last), checked out, or
    being reset or started."""

    def __init__(self, host: PoolHost, key: PoolKey, settings: PoolSettings, workdir: str) -> None:
        self.host = host
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
            # the project label makes members count against the project's quota like any
            # sandbox of it (Node.project_usage, the apiserver's probe)
            labels={POOL_LABEL: key.name}
            | ({} if key.project is None else {PROJECT_LABEL: key.project}),
            devices=key.devices,
        )
        self.members: set[str] = set()
        self.free: list[str] = []
        self.last_used: dict[str, float] = {}
        self.starting = 0
        self.resetting = 0
        self.waiters: collections.deque[asyncio.Future[str]] = collections.deque()
        #: the waiters of ``start=False`` calls: no member is started for them
        self.held: set[asyncio.Future[str]] = set()
        self.replaced = 0  # members killed because they broke (or failed a reset)

    @property
    def size(self) -> int:
        return len(self.members) + self.starting

    # --- take and give back ---------------------------------------------------------------
    async def take(self, start: bool = True) -> str:
        """A clean, live member: a free one, a new one while under ``max`` and the node has
        room for it, or the next one given back; ``AdmissionRejected`` naming the pool after
        ``checkout_timeout`` (the node's own refusal if it refused a new member meanwhile).

        ``start=False`` never starts a member: a free one or the next given back, and
        ``AdmissionRejected`` with ``reason="pool-start"`` at once when the pool has no
        member (none would ever come back), else after ``checkout_timeout``."""
        deadline = time.monotonic() + self.settings.checkout_timeout
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
                self._discard(sid, "found dead at checkout")
                if not start:  # a starting caller may yet start one the held ones can wait for
                    self._release_held()
            if not start and self.size == 0:
                raise _cannot_start(self.name, self.key.project, "the pool has no member")
            # a member being reset is back in a millisecond or two; a new one takes ~50 ms
            if (
                start
                and refused is None
                and self.size < self.max
                and self.resetting <= len(self.waiters)
            ):
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
            sid = await self._wait(deadline, start, refused)
            if await self.healthy(sid):
                return sid
            self._discard(sid, "found dead at checkout")
            if not start:
                self._release_held()

    async def _wait(self, deadline: float, start: bool, refused: AdmissionRejected | None) -> str:
        """The next member given back, or the refusal once ``deadline`` passed."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        if not start:
            self.held.add(fut)
        left = deadline - time.monotonic()
        try:
            done, _ = await asyncio.wait({fut}, timeout=max(0.0, left))
        except BaseException:  # the caller went away: a member handed over meanwhile
            if fut.done() and not fut.cancelled():  # goes to the next caller, not lost
                if fut.exception() is None:
                    self._put(fut.result())
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self.waiters.remove(fut)
            raise
        finally:
            self.held.discard(fut)
        if done:
            return fut.result()  # a member, or the refusal ``_release_held`` set
        fut.cancel()
        with contextlib.suppress(ValueError):
            self.waiters.remove(fut)
        if not start:
            raise _cannot_start(
                self.name,
                self.key.project,
                f"none of its {self.size} members came free in "
                f"{self.settings.checkout_timeout:g}s (DSEC_FNCALL_CHECKOUT_TIMEOUT)",
            )
        if refused is not None:
            raise refused
        raise AdmissionRejected(
            f"fncall pool {self.name}: all {self.max} members busy for "
            f"{self.settings.checkout_timeout:g}s (DSEC_FNCALL_POOL_MAX or _POOLS, "
            "DSEC_FNCALL_CHECKOUT_TIMEOUT)",
            reason="fncall-pool",
            pool=self.name,
        )

    def _release_held(self) -> None:
        """Refuse the waiting ``start=False`` calls at once when the pool has lost its last
        member and is starting none: no member will ever come back to them."""
        if self.size:
            return
        for fut in [f for f in self.waiters if f in self.held]:
            self.waiters.remove(fut)
            if not fut.done():
                fut.set_exception(_cannot_start(self.name, self.key.project, "it has no member"))

    def give_back(self, sid: str, broken: bool) -> None:
        """Reset the member (or replace it if ``broken``) and hand it to the next call."""
        self.host.spawn(self._recycle(sid, broken))

    async def _recycle(self, sid: str, broken: bool) -> None:
        if not broken:
            self.resetting += 1
            try:
                await self.host.reset(sid)
            except DsecError as e:
                log.warning("fncall pool %s: member %s failed its reset: %s", self.name, sid, e)
                broken = True
            finally:
                self.resetting -= 1
        if broken:
            self._discard(sid, "broken")
            self._refill()
            self._release_held()
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
        sb = self.host.sandboxes.get(sid)
        return (
            sb is not None
            and sb.status == "running"
            and await sb.backend.alive(sb.rt, sb.backend_state)
        )

    async def _start(self) -> str:
        """Start a member; the caller counted it in ``starting`` already (synchronously, so
        no other checkout sees room that is taken)."""
        try:
            info = await self.host.create(self.spec)
        except BaseException as e:
            self.starting -= 1
            self._release_held()  # a start=False call waited for this member
            if isinstance(e, AdmissionRejected):
                raise AdmissionRejected(
                    f"fncall pool {self.name}: cannot start a member: {e}",
                    reason=e.context.get("reason", "node"),
                    pool=self.name,
                ) from e
            raise
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
        if sid in self.host.sandboxes:
            self.host.spawn(self._kill(sid))

    async def _kill(self, sid: str) -> None:
        try:
            await self.host.kill(sid, reason="fncall pool")
        except DsecError:  # gone on its own meanwhile
            pass

    def _refill(self) -> None:
        """Start members for waiting calls and up to ``min``, in the background."""
        want = max(self.min - self.size, 0)
        # a start=False call's waiting starts nothing: its project has no room for a member
        may_start = len(self.waiters) - len(self.held)
        want = max(want, min(may_start, self.max - self.size))
        for _ in range(want):
            self.starting += 1
            self.host.spawn(self._start_free())

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
            "project": self.key.project,
            "size": self.size,
            "free": len(self.free),
            "min": self.min,
            "max": self.max,
            "waiting": len(self.waiters),
            "replaced": self.replaced,
            "members": sorted(self.members),
        }


class Pools:
    """Every FnCall pool of ``host``, and the reaper that shrinks them."""

    def __init__(self, host: PoolHost, settings: PoolSettings | None = None) -> None:
        self.host = host
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
        project: str | None = None,
        start: bool = True,
    ) -> Pool:
        """The pool of ``project`` for (environment, backend, cpu, memory, devices), made on
        first use (its ``min`` members started) unless ``start`` is False: a call that may
        not start a member has nothing to take from a pool that does not exist yet."""
        mem = parse_size(memory, "memory")
        if mem is None:
            raise InvalidSpec("fncall: memory must be a size such as '512M'", field="memory")
        if project is not None:
            check_project_path(project)
        key = PoolKey(environment, backend, float(cpu), mem, device_requests(devices), project)
        found = self.pools.get(key)
        if found is not None:
            return found
        be = self.host.backend(backend)
        if Feature.RESET not in be.features:
            raise BackendUnavailable(
                f"backend {backend!r} cannot serve FnCall pools: it cannot reset a sandbox "
                "between calls (no Feature.RESET); use backend 'fncall'",
                backend=backend,
            )
        env = self.host.catalogs.environment(environment)  # UnknownEnvironment
        workdir = env.workdir if env.workdir not in ("", "/") else DEFAULT_WORKDIR
        if not start:
            raise _cannot_start(key.name, project, "the pool has no member")
        p = self.pools[key] = Pool(self.host, key, self.settings, workdir)
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
        project: str | None = None,
        start: bool = True,
    ) -> FnCallResult:
        """Run one call in a member of ``project``'s pool (see ``checkout``)."""
        if (cmd is None) == (script is None):
            raise InvalidSpec("fncall needs one of cmd or script, not both", field="cmd")
        t0 = time.monotonic()
        async with self.checkout(
            environment, backend, cpu, memory, devices, project=project, start=start
        ) as m:
            if files:
                await self.write_files(m.sid, m.workdir, files)
            argv = cmd if script is None else ["/bin/sh", "-c", script]
            assert argv is not None
            try:
                r = await self.host.exec(
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
    async def checkout(
        self,
        environment: str,
        backend: str = "fncall",
        cpu: float = 1.0,
        memory: int | str = "512M",
        devices: Sequence[DeviceRequest | str] = (),
        *,
        project: str | None = None,
        start: bool = True,
    ) -> AsyncIterator[Checkout]:
        """A clean member of ``project``'s pool for (environment, backend, cpu, memory,
        devices) for the body of the ``async with``; given back (and reset, or replaced if
        ``Checkout.check`` found it broken) at its end, whatever happened. ``start=False``:
        take a free member or wait for one, never start one (``Pool.take``)."""
        if self._closed:
            raise BackendUnavailable("the node is closing: no more FnCalls")
        t0 = time.monotonic()
        pool = self.pool(environment, backend, cpu, memory, devices, project, start)
        sid = await pool.take(start)
        m = Checkout(pool, sid, pool.spec.workdir, time.monotonic() - t0)
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
        await asyncio.gather(*(self.host.write_file(sid, p, d) for p, d in paths.items()))

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
        await asyncio.gather(*(self._kill(s) for s in sids if s in self.host.sandboxes))

    async def _kill(self, sid: str) -> None:
        try:
            await self.host.kill(sid, reason="fncall pool closed")
        except DsecError:
            pass

    async def drop_left(self) -> None:
        """Pool members a previous daemon left are nobody's: kill them (``Node.open``)."""
        left = [sid for sid, sb in self.host.sandboxes.items() if POOL_LABEL in sb.rt.spec.labels]
        if left:
            log.info("killing %d FnCall pool members a previous daemon left", len(left))
        await asyncio.gather(*(self.host.kill(sid, reason="stale pool member") for sid in left))
