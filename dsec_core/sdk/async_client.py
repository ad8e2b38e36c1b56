"""``AsyncClient``: the asyncio twin of ``Client``. It runs the same operations of the core
(``core``) on an ``AsyncHTTPTransport``, each made a method by ``methods.awaiting``: a ``Batch``
at once (``asyncio.gather``), local file work in a thread, so the loop never blocks on a file."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar, overload

from ..api.transport import AsyncHTTPTransport, AsyncStreamedResponse, Response, TransportError
from ..records import ExecOutput, ExecResult, SandboxInfo
from . import core
from .connection import Connected
from .core import Batch, Call, Effect, Op, Stream
from .handles import (
    AsyncGroup,
    AsyncSandbox,
    async_lease_handle,
    async_sandbox_handles,
    async_session_handle,
)
from .methods import awaiting, named, streaming_async

T = TypeVar("T")


@named
class AsyncClient(Connected):
    """Asyncio client of a dsec node (or an apiserver); the same methods as ``Client``,
    awaited, and the same arguments (see ``Client``)."""

    _transport = AsyncHTTPTransport
    _http: AsyncHTTPTransport

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
                headers=call.headers,
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
    node_info = awaiting(core.node_info)
    probe = awaiting(core.probe)
    warm = awaiting(core.warm)
    set_warm = awaiting(core.set_warm)
    create = awaiting(core.create, into=AsyncSandbox)
    create_many = awaiting(core.create_many, into=async_sandbox_handles)
    get = awaiting(core.get, into=AsyncSandbox)
    kill = awaiting(core.kill)
    usage = awaiting(core.usage)
    events = awaiting(core.events)
    set_ttl = awaiting(core.set_ttl)
    policies = awaiting(core.policies)
    set_policy = awaiting(core.set_policy)

    async def list(self) -> builtins.list[SandboxInfo]:
        """Every sandbox on the node (through an apiserver: the caller's project's), oldest
        first."""
        return await self._run(core.list_sandboxes())

    def group(self, name: str) -> AsyncGroup:
        """The rollout group ``name``: the sandboxes it creates carry the label ``dsec.group``
        (``GROUP_LABEL``) on the node, so another process (a trainer restarted after a
        preemption) finds the same group by name and pauses, resumes or kills it whole."""
        return AsyncGroup(self, name)

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
        if isinstance(sandboxes, str):
            return await self._run(core.pause(sandboxes, reclaim=reclaim))
        return await self._run(core.pause_all(sandboxes, reclaim=reclaim))

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
        if isinstance(sandboxes, str):
            return await self._run(core.resume(sandboxes))
        return await self._run(core.resume_all(sandboxes))

    # --- trainer leases and trajectories --------------------------------------------------
    lease = awaiting(core.lease, into=async_lease_handle)
    lease_get = awaiting(core.lease_get)
    lease_renew = awaiting(core.lease_renew)
    lease_release = awaiting(core.lease_release)
    trajectory = awaiting(core.trajectory)
    remove_trajectory = awaiting(core.remove_trajectory)

    # --- layers and snapshots -------------------------------------------------------------
    layers = awaiting(core.layers)
    prefetch = awaiting(core.prefetch)
    resolve_image = awaiting(core.resolve_image)
    pack_diff = awaiting(core.pack_diff)
    snapshot_memory = awaiting(core.snapshot_memory)
    memory_snapshot = awaiting(core.memory_snapshot)
    remove_memory_snapshot = awaiting(core.remove_memory_snapshot)
    restore = awaiting(core.restore, into=async_sandbox_handles)

    # --- stateless calls ------------------------------------------------------------------
    fncall = awaiting(core.fncall)
    judge = awaiting(core.judge)

    # --- IAM: projects, quotas and keys (through an apiserver) ----------------------------
    whoami = awaiting(core.whoami)
    projects = awaiting(core.projects)
    create_project = awaiting(core.create_project)
    project = awaiting(core.project)
    set_quota = awaiting(core.set_quota)
    revoke_project = awaiting(core.revoke_project)
    keys = awaiting(core.keys)
    create_key = awaiting(core.create_key)
    revoke_key = awaiting(core.revoke_key)

    # --- inside a sandbox -----------------------------------------------------------------
    exec = awaiting(core.exec)
    exec_stream = streaming_async(core.exec_stream)
    process_start = awaiting(core.process_start)
    processes = awaiting(core.processes)
    process = awaiting(core.process)
    process_output = streaming_async(core.process_output)
    process_input = awaiting(core.process_input)
    process_resize = awaiting(core.process_resize)
    process_signal = awaiting(core.process_signal)
    session_open = awaiting(core.session_open, into=async_session_handle)
    sessions = awaiting(core.sessions)
    session_exec = awaiting(core.session_exec)
    session_close = awaiting(core.session_close)
    read_file = awaiting(core.read_file)
    write_file = awaiting(core.write_file)
    upload = awaiting(core.upload)
    download = awaiting(core.download)
    list_dir = awaiting(core.list_dir)
    stat = awaiting(core.stat)
    remove = awaiting(core.remove)
    screenshot = awaiting(core.screenshot)
    input = awaiting(core.input)
