"""``AsyncClient``: the asyncio twin of ``Client``. It runs the same operations of the core
(``core``) on an ``AsyncHTTPTransport``: a ``Batch`` at once (``asyncio.gather``), local file
work in a thread, so the loop never blocks on a file."""

from __future__ import annotations

import asyncio
import builtins
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, TypeVar, overload

from ..api.messages import DEFAULT_MAX_OUTPUT, NodeProbe
from ..api.transport import AsyncHTTPTransport, AsyncStreamedResponse, Response, TransportError
from ..records import (
    DeviceRequest,
    ExecOutput,
    ExecResult,
    FileEntry,
    FnCallResult,
    InfraEvent,
    JudgeResult,
    JudgeSpec,
    LayerInfo,
    LeaseInfo,
    MemorySnapshot,
    PolicyState,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
    TrajectoryEntry,
)
from ..screen_input import InputEvent
from . import core
from .connection import connection
from .core import Batch, Call, Effect, Op, Stream
from .handles import AsyncGroup, AsyncLease, AsyncSandbox, AsyncSession

T = TypeVar("T")


class AsyncClient:
    """Asyncio client of a dsec node (or an apiserver); the same methods as ``Client``,
    awaited, and the same arguments (see ``Client``)."""

    def __init__(
        self,
        address: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        verify: bool | str | os.PathLike[str] = True,
        autostart: bool = True,
        retry: float | None = None,
        api_key: str | None = None,
    ) -> None:
        c = connection(address, token=token, api_key=api_key, autostart=autostart, retry=retry)
        self.address = str(c.address)
        self._http = AsyncHTTPTransport(c.address, token=c.token, verify=verify, retry=c.retry)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the client's pooled connections (leaving a ``with`` does it)."""
        await self._http.aclose()

    # --- running the core's operations ----------------------------------------------------
    async def _run(self, op: Op[T]) -> T:
        """Run an operation of the core: each effect done here, awaited."""
        try:
            effect = next(op)
            while True:
                try:
                    outcome = await self._do(effect)
                except Exception as e:  # the operation may handle it (a lease forgotten)
                    effect = op.throw(e)
                else:
                    effect = op.send(outcome)
        except StopIteration as stop:
            return stop.value
        finally:
            op.close()

    async def _do(self, effect: Effect) -> Any:
        if isinstance(effect, Call):
            return await self._send(effect)
        if isinstance(effect, Batch):
            return list(await asyncio.gather(*(self._send(c) for c in effect.calls)))
        return await asyncio.to_thread(effect.fn, *effect.args)

    async def _send(self, call: Call) -> Any:
        route = call.route
        try:
            r = await self._http.request(
                route.method,
                call.target,
                body=call.content,
                content_type=route.body_type,
                timeout=call.timeout,
                idempotent=call.idempotent,
            )
        except TransportError as e:
            return call.unreachable(e, self.address)
        return call.answer(r)

    async def _stream(self, stream: Stream) -> AsyncIterator[ExecOutput | ExecResult]:
        try:
            r = await self._http.stream(
                "POST",
                stream.target,
                body=stream.content,
                content_type=stream.content_type,
                timeout=stream.timeout,
            )
        except TransportError as e:
            raise stream.unreachable(e, self.address) from e
        return self._lines(stream, r)

    async def _lines(
        self, stream: Stream, r: AsyncStreamedResponse
    ) -> AsyncIterator[ExecOutput | ExecResult]:
        async with r:
            if r.status_code >= 300:
                stream.refused(Response(r.status_code, await r.read(), r.headers))
            lines = stream.lines()
            try:
                async for piece in r:
                    for item in lines.feed(piece):
                        yield item
                    if lines.done:
                        return
            except TransportError as e:
                raise stream.broke(e, self.address) from e
            raise lines.end()

    # --- the node and its sandboxes -------------------------------------------------------
    async def node_info(self) -> dict[str, Any]:
        """What the node daemon is and holds (``NodeStatus`` as a dict): version, capacity,
        backends, layer sources, FnCall pools, devices."""
        return await self._run(core.node_info())

    async def probe(self) -> NodeProbe:
        """What the control plane's watcher sees of the node (``NodeProbe``)."""
        return await self._run(core.probe())

    async def create(self, spec: SandboxSpec | None = None, **kw: Any) -> AsyncSandbox:
        """Create a sandbox from ``spec`` (a ``SandboxSpec``) or its fields as keywords
        (``environment="judge-fizzbuzz"``), the keywords overriding the spec's; returns its
        handle. ``InvalidSpec`` names an unknown or bad field before anything is sent."""
        return AsyncSandbox(self, await self._run(core.create(spec, **kw)))

    async def create_many(
        self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any
    ) -> builtins.list[AsyncSandbox]:
        """Create ``n`` sandboxes concurrently; all or nothing (the created are killed on
        error, and the first error is raised)."""
        return [AsyncSandbox(self, i) for i in await self._run(core.create_many(spec, n, **kw))]

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """The handle of sandbox ``sandbox_id`` as the node sees it now (``UnknownSandbox``
        if there is none)."""
        return AsyncSandbox(self, await self._run(core.get(sandbox_id)))

    async def list(self) -> builtins.list[SandboxInfo]:
        """Every sandbox on the node (through an apiserver: the caller's project's), oldest
        first."""
        return await self._run(core.list_sandboxes())

    async def kill(self, sandbox_id: str) -> None:
        """Kill a sandbox and remove everything it left."""
        await self._run(core.kill(sandbox_id))

    def group(self, name: str) -> AsyncGroup:
        """The rollout group ``name``: the sandboxes it creates carry the label ``dsec.group``
        (``GROUP_LABEL``) on the node, so another process (a trainer restarted after a
        preemption) finds the same group by name and pauses, resumes or kills it whole."""
        return AsyncGroup(self, name)

    async def usage(self, sandbox_id: str) -> SandboxUsage:
        """What the sandbox uses now: CPU time, memory, processes, disk."""
        return await self._run(core.usage(sandbox_id))

    # a str is a Sequence[str] too: the str overload comes first, so one id gives one info
    @overload
    async def pause(  # type: ignore[overload-overlap]
        self, sandboxes: str, *, reclaim: bool = False
    ) -> SandboxInfo: ...
    @overload
    async def pause(
        self, sandboxes: Sequence[str] | AsyncGroup, *, reclaim: bool = False
    ) -> builtins.list[SandboxInfo]: ...
    async def pause(
        self, sandboxes: str | Sequence[str] | AsyncGroup, *, reclaim: bool = False
    ) -> SandboxInfo | builtins.list[SandboxInfo]:
        """Pause one sandbox (its id: returns its ``SandboxInfo``) or several (a list of ids,
        or a rollout ``Group``: returns theirs): every process stops where it is; memory, open
        files and sessions stay, and nothing in it answers until ``resume``. ``reclaim`` then
        has the kernel take back what of its memory it can. Pausing a paused one changes
        nothing. An async client pauses several at once."""
        if isinstance(sandboxes, AsyncGroup):
            return await sandboxes.pause(reclaim=reclaim)
        return await self._run(core.pause(sandboxes, reclaim=reclaim))

    @overload
    async def resume(self, sandboxes: str) -> SandboxInfo: ...  # type: ignore[overload-overlap]
    @overload
    async def resume(self, sandboxes: Sequence[str] | AsyncGroup) -> builtins.list[SandboxInfo]: ...
    async def resume(
        self, sandboxes: str | Sequence[str] | AsyncGroup
    ) -> SandboxInfo | builtins.list[SandboxInfo]:
        """Let paused sandboxes go on where they were (one id: its ``SandboxInfo``; a list, or
        a ``Group``: theirs); a no-op for one that is not paused."""
        if isinstance(sandboxes, AsyncGroup):
            return await sandboxes.resume()
        return await self._run(core.resume(sandboxes))

    async def events(self, sandbox_id: str) -> builtins.list[InfraEvent]:
        """The infrastructure failures that struck the sandbox (``InfraEvent``: preempted, out
        of memory, ...), oldest first: not the task's doing, so a trainer masks them."""
        return await self._run(core.events(sandbox_id))

    async def set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        """Let the sandbox live ``ttl`` more seconds from now (None: until killed)."""
        return await self._run(core.set_ttl(sandbox_id, ttl))

    async def policies(self, sandbox_id: str) -> builtins.list[PolicyState]:
        """The sandbox's security policies: in force (with what they saw), or why not."""
        return await self._run(core.policies(sandbox_id))

    async def set_policy(
        self, sandbox_id: str, policy: str, settings: Mapping[str, Any]
    ) -> PolicyState:
        """Change a live policy (e.g. a network allowlist) of a running sandbox."""
        return await self._run(core.set_policy(sandbox_id, policy, settings))

    # --- trainer leases and trajectories --------------------------------------------------
    async def lease(
        self,
        sandboxes: str | Sequence[str],
        *,
        ttl: float = 10.0,
        holder: str = "",
        reclaim: bool = False,
        renew: bool = True,
    ) -> AsyncLease:
        """Take a lease on ``sandboxes`` (an agent sandbox and its workers, a group's members):
        if it is not renewed within ``ttl`` seconds (its trainer died) the node pauses them,
        with ``reclaim`` reclaiming their memory too, and records a "preempted" event. A lease
        on sandboxes of a lapsed one takes them over and resumes them. ``renew``: this process
        renews it every ttl/3 until ``release`` (a thread; an async client's task). ``LeaseHeld``
        if a live lease of another holds one of them."""
        info = await self._run(core.lease(sandboxes, ttl=ttl, holder=holder, reclaim=reclaim))
        return AsyncLease(self, info, renew=renew)

    async def lease_get(self, lease_id: str) -> LeaseInfo:
        """Lease ``lease_id`` as the node holds it now (``UnknownLease`` if it does not)."""
        return await self._run(core.lease_get(lease_id))

    async def lease_renew(self, lease_id: str) -> LeaseInfo:
        """Renew a lease (``Lease.renew``: the handle does it for its holder)."""
        return await self._run(core.lease_renew(lease_id))

    async def lease_release(self, lease_id: str, *, kill: bool = False) -> LeaseInfo:
        """End a lease (``Lease.release``); ``kill`` kills its sandboxes too."""
        return await self._run(core.lease_release(lease_id, kill=kill))

    async def trajectory(self, name: str) -> builtins.list[TrajectoryEntry]:
        """Every step of trajectory log ``name`` (none if there is no such log)."""
        return await self._run(core.trajectory(name))

    async def remove_trajectory(self, name: str) -> None:
        """Remove trajectory log ``name`` (``NotFound`` if there is none)."""
        await self._run(core.remove_trajectory(name))

    # --- layers and snapshots -------------------------------------------------------------
    async def layers(self) -> builtins.list[LayerInfo]:
        """Every layer of the node's layer sources, source by source."""
        return await self._run(core.layers())

    async def prefetch(self, refs: Sequence[str]) -> builtins.list[dict[str, Any]]:
        """Warm layers on the node (all chunks of on-demand layers); returns what was fetched."""
        return await self._run(core.prefetch(refs))

    async def pack_diff(
        self,
        sandbox_id: str,
        *,
        name: str | None = None,
        version: str | None = None,
        exclude: Sequence[str] = (),
        scrub: bool = True,
        source: str | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> LayerInfo:
        """Pack the running sandbox's writable layer into a snapshot layer over its layers
        (``Node.pack_diff``): the sandbox is frozen meanwhile. ``exclude`` leaves paths out;
        ``scrub`` also leaves out /tmp, caches, shell histories and credentials; ``source``
        (a URL of one of the node's layer sources) also pushes it there, with the parents it
        lacks. ``secrets`` (label -> text, e.g. ``{"hidden-test": ...}``): the packed layer
        is scanned for each; a hit removes it and raises ``LeakFound`` naming paths and
        labels."""
        op = core.pack_diff(
            sandbox_id,
            name=name,
            version=version,
            exclude=exclude,
            scrub=scrub,
            source=source,
            secrets=secrets,
        )
        return await self._run(op)

    async def snapshot_memory(self, sandbox_id: str, name: str | None = None) -> MemorySnapshot:
        """Save a running VM sandbox's memory, devices and disk at one instant (it runs on);
        ``restore(snapshot.name, n)`` starts n sandboxes that go on from there."""
        return await self._run(core.snapshot_memory(sandbox_id, name))

    async def memory_snapshot(self, name: str) -> MemorySnapshot:
        """Memory snapshot ``name`` as ``snapshot_memory`` made it (``UnknownSnapshot`` if
        there is none): its size on disk and the spec its restores take."""
        return await self._run(core.memory_snapshot(name))

    async def remove_memory_snapshot(self, name: str) -> None:
        """Remove memory snapshot ``name`` (``UnknownSnapshot`` if there is none)."""
        await self._run(core.remove_memory_snapshot(name))

    async def restore(
        self,
        snapshot: str | LayerInfo | MemorySnapshot,
        n: int = 1,
        spec: SandboxSpec | None = None,
        **kw: Any,
    ) -> builtins.list[AsyncSandbox]:
        """``n`` new sandboxes that each start from ``snapshot``'s state, each with its own
        writable layer over the same read-only layers; all or nothing. ``spec`` (or its
        fields) sets the rest; its layers and environment are replaced by the snapshot's.
        ``MissingParentLayers`` names the digests of parent layers no source holds."""
        return [
            AsyncSandbox(self, i) for i in await self._run(core.restore(snapshot, n, spec, **kw))
        ]

    # --- stateless calls ------------------------------------------------------------------
    async def fncall(
        self,
        environment: str,
        cmd: str | Sequence[str] | None = None,
        *,
        script: str | None = None,
        stdin: bytes | str | None = None,
        files: Mapping[str, bytes | str] | None = None,
        timeout: float | None = 300.0,
        max_output: int = DEFAULT_MAX_OUTPUT,
        env: Mapping[str, str] | None = None,
        backend: str = "fncall",
        cpu: float = 1.0,
        memory: int | str = "512M",
        devices: Sequence[DeviceRequest | str | Mapping[str, Any]] = (),
    ) -> FnCallResult:
        """Run a short stateless call (``cmd``, or shell ``script``) in a warm member of the
        environment's FnCall pool, with ``files`` (relative to its working directory) written
        first; the member is reset before anyone else's call. A timeout sets ``timed_out``; a
        member that died under the call gives ``error="runtime-error"`` (it is replaced).
        ``devices`` (e.g. ``["gpu"]``): members hold them, and the pool is one of its own."""
        op = core.fncall(
            environment,
            cmd,
            script=script,
            stdin=stdin,
            files=files,
            timeout=timeout,
            max_output=max_output,
            env=env,
            backend=backend,
            cpu=cpu,
            memory=memory,
            devices=devices,
        )
        return await self._run(op)

    async def judge(
        self, environment: str | JudgeSpec, run: str | Sequence[str] | None = None, **kw: Any
    ) -> JudgeResult:
        """Judge a submission in a warm member of the environment's FnCall pool: ``files``
        written, ``compile`` run once, then ``run`` on each of ``cases`` (``JudgeCase``) or
        of ``cases_dir``'s NAME.in/NAME.out, each with ``time_limit`` CPU seconds and
        ``memory_limit``; a verdict per case (AC, WA, TLE, MLE, RE) and for the whole (or CE).
        Takes a ``JudgeSpec``, or its fields as arguments."""
        return await self._run(core.judge(environment, run, **kw))

    # --- inside a sandbox -----------------------------------------------------------------
    async def exec(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        background: bool = False,
        exclusive: bool = False,
        trajectory: str | None = None,
        step: int | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in the sandbox: a string through ``/bin/sh -c``, a list as argv.
        Processes it leaves running are killed when it exits, unless ``background``;
        ``exclusive`` first kills every other process in the sandbox (sessions, background
        jobs, other calls), which is how a verifier should run. ``trajectory``: log it as
        ``step`` (default: the next) of that trajectory log; a step logged already comes back
        from the log (``replayed``) without running."""
        op = core.exec(
            sandbox_id,
            cmd,
            timeout=timeout,
            cwd=cwd,
            env=env,
            stdin=stdin,
            max_output=max_output,
            background=background,
            exclusive=exclusive,
            trajectory=trajectory,
            step=step,
        )
        return await self._run(op)

    async def exec_stream(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        background: bool = False,
        exclusive: bool = False,
    ) -> AsyncIterator[ExecOutput | ExecResult]:
        """``exec``, with the output as it comes: ``ExecOutput`` pieces (``stream`` "stdout"
        or "stderr", ``data``), then the ``ExecResult`` (its stdout and stderr empty). Takes
        ``exec``'s arguments but ``trajectory``. Leaving the loop early kills the command."""
        stream = core.exec_stream(
            sandbox_id,
            cmd,
            timeout=timeout,
            cwd=cwd,
            env=env,
            stdin=stdin,
            max_output=max_output,
            background=background,
            exclusive=exclusive,
        )
        return await self._stream(stream)

    async def session_open(
        self, sandbox_id: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> AsyncSession:
        """Start a persistent shell in the sandbox (``cwd`` and ``env`` default to the
        sandbox's): its cwd, variables and functions carry over between its commands."""
        opened = await self._run(core.session_open(sandbox_id, cwd=cwd, env=env))
        return AsyncSession(self, sandbox_id, opened)

    async def sessions(self, sandbox_id: str) -> builtins.list[str]:
        """The ids of the sandbox's sessions whose shells still run."""
        return await self._run(core.sessions(sandbox_id))

    async def session_exec(
        self,
        sandbox_id: str,
        session_id: str,
        cmd: str,
        *,
        timeout: float | None = 300.0,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        """Run shell command ``cmd`` in a session (``Session.exec``)."""
        op = core.session_exec(
            sandbox_id, session_id, cmd, timeout=timeout, stdin=stdin, max_output=max_output
        )
        return await self._run(op)

    async def session_close(self, sandbox_id: str, session_id: str) -> None:
        """Close a session (``Session.close``): its shell and what it started end."""
        await self._run(core.session_close(sandbox_id, session_id))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        """The whole file at ``path`` in the sandbox (read in pieces of ``CHUNK``)."""
        return await self._run(core.read_file(sandbox_id, path))

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None:
        """Write ``data`` (str: as UTF-8) to ``path`` in the sandbox, replacing the file;
        ``mode`` (permission bits such as 0o755) applies to a file this creates."""
        await self._run(core.write_file(sandbox_id, path, data, mode=mode))

    async def upload(
        self,
        sandbox_id: str,
        local: str | os.PathLike[str],
        remote: str,
        *,
        mode: int | None = None,
    ) -> None:
        """Copy local file ``local`` to ``remote`` in the sandbox piece by piece, never holding
        all of it; ``mode`` defaults to the local file's."""
        await self._run(core.upload(sandbox_id, local, remote, mode=mode))

    async def download(self, sandbox_id: str, remote: str, local: str | os.PathLike[str]) -> None:
        """Copy a file out of the sandbox piece by piece, never holding all of it. The local
        file is opened once the first piece came (a bad remote path leaves it as it was)."""
        await self._run(core.download(sandbox_id, remote, local))

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        """The entries of directory ``path`` in the sandbox (lstat, without . and ..), sorted
        by name."""
        return await self._run(core.list_dir(sandbox_id, path))

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        """What lstat says of ``path`` in the sandbox."""
        return await self._run(core.stat(sandbox_id, path))

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        """Remove a file, symlink or empty directory in the sandbox; ``recursive``: a tree."""
        await self._run(core.remove(sandbox_id, path, recursive=recursive))

    async def screenshot(self, sandbox_id: str) -> bytes:
        """The sandbox's display now, as PNG bytes (a backend with a screen: ``vm``)."""
        return await self._run(core.screenshot(sandbox_id))

    async def input(self, sandbox_id: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send input to the sandbox's display in order: records (``dsec_core.screen_input``:
        ``Key("a")``, ``Move(x, y)``, ``Click(x, y)``) or their dicts (``{"type": "click",
        "x": 200, "y": 140}``); returns how many were sent."""
        return await self._run(core.input(sandbox_id, events))
