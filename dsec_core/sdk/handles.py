"""Handles: a sandbox, a session, a rollout group or a trainer's lease bound to its client.

Each comes in twins, ``Sandbox`` for ``Client`` and ``AsyncSandbox`` for ``AsyncClient`` and so
on, with explicit, typed, documented methods (so an IDE and mypy see ``sb.exec`` and its
``ExecResult``); a sandbox's methods are its client's with the sandbox's id filled in, and what
takes more than one request (a group's fork, a lease taken again) is an operation of the core.
``tests/test_sdk.py`` holds each twin's methods to the other's and to the client's.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..api.messages import DEFAULT_MAX_OUTPUT
from ..errors import DsecError
from ..records import (
    ExecOutput,
    ExecResult,
    FileEntry,
    InfraEvent,
    LayerInfo,
    LeaseInfo,
    MemorySnapshot,
    PolicyState,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)
from ..screen_input import InputEvent
from . import core
from .core import SandboxRef

if TYPE_CHECKING:
    from .async_client import AsyncClient
    from .client import Client

log = logging.getLogger("dsec.sdk")


# --- sandboxes --------------------------------------------------------------------------------


class Sandbox(SandboxRef):
    """A sandbox handle: ``sb.exec(...)``, ``sb.read_file(...)``, ``sb.kill()``; a context
    manager that kills the sandbox on exit. ``info`` is what was last seen of it
    (``refresh``)."""

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        super().__init__(info)
        self.client = client

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client._run(core.kill_quietly(self.id))

    def refresh(self) -> SandboxInfo:
        """The sandbox as the node sees it now (kept as ``info``)."""
        self.info = self.client._run(core.get(self.id))
        return self.info

    def kill(self) -> None:
        """Kill the sandbox and remove everything it left (``Client.kill``)."""
        self.client.kill(self.id)

    def exec(
        self,
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
        """Run ``cmd`` in the sandbox (``Client.exec``)."""
        return self.client.exec(
            self.id,
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

    def exec_stream(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        background: bool = False,
        exclusive: bool = False,
    ) -> Iterator[ExecOutput | ExecResult]:
        """Run ``cmd`` with its output as it comes (``Client.exec_stream``)."""
        return self.client.exec_stream(
            self.id,
            cmd,
            timeout=timeout,
            cwd=cwd,
            env=env,
            stdin=stdin,
            max_output=max_output,
            background=background,
            exclusive=exclusive,
        )

    def session(self, *, cwd: str | None = None, env: Mapping[str, str] | None = None) -> Session:
        """Start a persistent shell (``Client.session_open``); a context manager."""
        return self.client.session_open(self.id, cwd=cwd, env=env)

    def session_open(
        self, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> Session:
        """Start a persistent shell (``Client.session_open``); the same as ``session``."""
        return self.client.session_open(self.id, cwd=cwd, env=env)

    def sessions(self) -> builtins.list[str]:
        """The ids of the sandbox's live sessions (``Client.sessions``)."""
        return self.client.sessions(self.id)

    def set_ttl(self, ttl: float | None) -> SandboxInfo:
        """Let the sandbox live ``ttl`` more seconds from now (``Client.set_ttl``)."""
        return self.client.set_ttl(self.id, ttl)

    def pause(self, *, reclaim: bool = False) -> SandboxInfo:
        """Pause the sandbox (``Client.pause``)."""
        return self.client.pause(self.id, reclaim=reclaim)

    def resume(self) -> SandboxInfo:
        """Let the paused sandbox go on (``Client.resume``)."""
        return self.client.resume(self.id)

    def usage(self) -> SandboxUsage:
        """What the sandbox uses now (``Client.usage``)."""
        return self.client.usage(self.id)

    def events(self) -> builtins.list[InfraEvent]:
        """The infrastructure failures that struck the sandbox (``Client.events``)."""
        return self.client.events(self.id)

    def policies(self) -> builtins.list[PolicyState]:
        """The sandbox's security policies (``Client.policies``)."""
        return self.client.policies(self.id)

    def set_policy(self, policy: str, settings: Mapping[str, Any]) -> PolicyState:
        """Change a live policy of the sandbox (``Client.set_policy``)."""
        return self.client.set_policy(self.id, policy, settings)

    def read_file(self, path: str) -> bytes:
        """The whole file at ``path`` (``Client.read_file``)."""
        return self.client.read_file(self.id, path)

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` (``Client.write_file``)."""
        self.client.write_file(self.id, path, data, mode=mode)

    def upload(
        self, local: str | os.PathLike[str], remote: str, *, mode: int | None = None
    ) -> None:
        """Copy local file ``local`` to ``remote`` in the sandbox (``Client.upload``)."""
        self.client.upload(self.id, local, remote, mode=mode)

    def download(self, remote: str, local: str | os.PathLike[str]) -> None:
        """Copy ``remote`` out of the sandbox to ``local`` (``Client.download``)."""
        self.client.download(self.id, remote, local)

    def list_dir(self, path: str) -> builtins.list[FileEntry]:
        """The entries of directory ``path`` (``Client.list_dir``)."""
        return self.client.list_dir(self.id, path)

    def stat(self, path: str) -> FileEntry:
        """What lstat says of ``path`` (``Client.stat``)."""
        return self.client.stat(self.id, path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove ``path`` (``Client.remove``)."""
        self.client.remove(self.id, path, recursive=recursive)

    def screenshot(self) -> bytes:
        """The sandbox's display now, as PNG bytes (``Client.screenshot``)."""
        return self.client.screenshot(self.id)

    def input(self, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send input to the sandbox's display (``Client.input``)."""
        return self.client.input(self.id, events)

    def pack_diff(
        self,
        *,
        name: str | None = None,
        version: str | None = None,
        exclude: Sequence[str] = (),
        scrub: bool = True,
        source: str | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> LayerInfo:
        """Pack the sandbox's writable layer into a snapshot layer (``Client.pack_diff``)."""
        return self.client.pack_diff(
            self.id,
            name=name,
            version=version,
            exclude=exclude,
            scrub=scrub,
            source=source,
            secrets=secrets,
        )

    def snapshot_memory(self, name: str | None = None) -> MemorySnapshot:
        """Save the VM sandbox's memory, devices and disk now (``Client.snapshot_memory``)."""
        return self.client.snapshot_memory(self.id, name)


class AsyncSandbox(SandboxRef):
    """The asyncio twin of ``Sandbox`` (``async with`` kills it on exit)."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        super().__init__(info)
        self.client = client

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client._run(core.kill_quietly(self.id))

    async def refresh(self) -> SandboxInfo:
        """The sandbox as the node sees it now (kept as ``info``)."""
        self.info = await self.client._run(core.get(self.id))
        return self.info

    async def kill(self) -> None:
        """Kill the sandbox and remove everything it left (``Client.kill``)."""
        await self.client.kill(self.id)

    async def exec(
        self,
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
        """Run ``cmd`` in the sandbox (``Client.exec``)."""
        return await self.client.exec(
            self.id,
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

    async def exec_stream(
        self,
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
        """Run ``cmd`` with its output as it comes (``Client.exec_stream``)."""
        return await self.client.exec_stream(
            self.id,
            cmd,
            timeout=timeout,
            cwd=cwd,
            env=env,
            stdin=stdin,
            max_output=max_output,
            background=background,
            exclusive=exclusive,
        )

    async def session(
        self, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> AsyncSession:
        """Start a persistent shell (``Client.session_open``); a context manager."""
        return await self.client.session_open(self.id, cwd=cwd, env=env)

    async def session_open(
        self, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> AsyncSession:
        """Start a persistent shell (``Client.session_open``); the same as ``session``."""
        return await self.client.session_open(self.id, cwd=cwd, env=env)

    async def sessions(self) -> builtins.list[str]:
        """The ids of the sandbox's live sessions (``Client.sessions``)."""
        return await self.client.sessions(self.id)

    async def set_ttl(self, ttl: float | None) -> SandboxInfo:
        """Let the sandbox live ``ttl`` more seconds from now (``Client.set_ttl``)."""
        return await self.client.set_ttl(self.id, ttl)

    async def pause(self, *, reclaim: bool = False) -> SandboxInfo:
        """Pause the sandbox (``Client.pause``)."""
        return await self.client.pause(self.id, reclaim=reclaim)

    async def resume(self) -> SandboxInfo:
        """Let the paused sandbox go on (``Client.resume``)."""
        return await self.client.resume(self.id)

    async def usage(self) -> SandboxUsage:
        """What the sandbox uses now (``Client.usage``)."""
        return await self.client.usage(self.id)

    async def events(self) -> builtins.list[InfraEvent]:
        """The infrastructure failures that struck the sandbox (``Client.events``)."""
        return await self.client.events(self.id)

    async def policies(self) -> builtins.list[PolicyState]:
        """The sandbox's security policies (``Client.policies``)."""
        return await self.client.policies(self.id)

    async def set_policy(self, policy: str, settings: Mapping[str, Any]) -> PolicyState:
        """Change a live policy of the sandbox (``Client.set_policy``)."""
        return await self.client.set_policy(self.id, policy, settings)

    async def read_file(self, path: str) -> bytes:
        """The whole file at ``path`` (``Client.read_file``)."""
        return await self.client.read_file(self.id, path)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` (``Client.write_file``)."""
        await self.client.write_file(self.id, path, data, mode=mode)

    async def upload(
        self, local: str | os.PathLike[str], remote: str, *, mode: int | None = None
    ) -> None:
        """Copy local file ``local`` to ``remote`` in the sandbox (``Client.upload``)."""
        await self.client.upload(self.id, local, remote, mode=mode)

    async def download(self, remote: str, local: str | os.PathLike[str]) -> None:
        """Copy ``remote`` out of the sandbox to ``local`` (``Client.download``)."""
        await self.client.download(self.id, remote, local)

    async def list_dir(self, path: str) -> builtins.list[FileEntry]:
        """The entries of directory ``path`` (``Client.list_dir``)."""
        return await self.client.list_dir(self.id, path)

    async def stat(self, path: str) -> FileEntry:
        """What lstat says of ``path`` (``Client.stat``)."""
        return await self.client.stat(self.id, path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove ``path`` (``Client.remove``)."""
        await self.client.remove(self.id, path, recursive=recursive)

    async def screenshot(self) -> bytes:
        """The sandbox's display now, as PNG bytes (``Client.screenshot``)."""
        return await self.client.screenshot(self.id)

    async def input(self, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send input to the sandbox's display (``Client.input``)."""
        return await self.client.input(self.id, events)

    async def pack_diff(
        self,
        *,
        name: str | None = None,
        version: str | None = None,
        exclude: Sequence[str] = (),
        scrub: bool = True,
        source: str | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> LayerInfo:
        """Pack the sandbox's writable layer into a snapshot layer (``Client.pack_diff``)."""
        return await self.client.pack_diff(
            self.id,
            name=name,
            version=version,
            exclude=exclude,
            scrub=scrub,
            source=source,
            secrets=secrets,
        )

    async def snapshot_memory(self, name: str | None = None) -> MemorySnapshot:
        """Save the VM sandbox's memory, devices and disk now (``Client.snapshot_memory``)."""
        return await self.client.snapshot_memory(self.id, name)


# --- sessions ---------------------------------------------------------------------------------


class Session:
    """A persistent shell in a sandbox: cwd, env and shell variables carry over. A context
    manager that closes it on exit."""

    def __init__(self, client: Client, sandbox_id: str, session_id: str) -> None:
        self.client, self.sandbox_id, self.id = client, sandbox_id, session_id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} in {self.sandbox_id}>"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client._run(core.session_close_quietly(self.sandbox_id, self.id))

    def exec(
        self,
        cmd: str,
        *,
        timeout: float | None = 300.0,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        """Run shell command ``cmd`` in the session (``Client.session_exec``)."""
        return self.client.session_exec(
            self.sandbox_id, self.id, cmd, timeout=timeout, stdin=stdin, max_output=max_output
        )

    def close(self) -> None:
        """Close the session (``Client.session_close``)."""
        self.client.session_close(self.sandbox_id, self.id)


class AsyncSession:
    """The asyncio twin of ``Session``."""

    def __init__(self, client: AsyncClient, sandbox_id: str, session_id: str) -> None:
        self.client, self.sandbox_id, self.id = client, sandbox_id, session_id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} in {self.sandbox_id}>"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client._run(core.session_close_quietly(self.sandbox_id, self.id))

    async def exec(
        self,
        cmd: str,
        *,
        timeout: float | None = 300.0,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        """Run shell command ``cmd`` in the session (``Client.session_exec``)."""
        return await self.client.session_exec(
            self.sandbox_id, self.id, cmd, timeout=timeout, stdin=stdin, max_output=max_output
        )

    async def close(self) -> None:
        """Close the session (``Client.session_close``)."""
        await self.client.session_close(self.sandbox_id, self.id)


# --- rollout groups ---------------------------------------------------------------------------


class Group:
    """A rollout group: sandboxes created, paused, resumed and killed together, found again by
    name from any process (see ``Client.group``)."""

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = core.group_name(name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def create(
        self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any
    ) -> builtins.list[Sandbox]:
        """``n`` new members (all or none), labelled into the group."""
        made = self.client._run(core.group_create(self.name, spec, n, kw))
        return [Sandbox(self.client, i) for i in made]

    def fork(
        self,
        source: str | Sandbox | None = None,
        n: int = 1,
        *,
        snapshot: str | LayerInfo | None = None,
        spec: SandboxSpec | None = None,
        **kw: Any,
    ) -> builtins.list[Sandbox]:
        """``n`` new members that each start from member ``source``'s state now (packed with
        ``pack_diff``, then ``restore``), each with its own writable layer; or from an
        earlier ``snapshot`` instead. ``spec`` (or its fields) goes to ``Client.restore``.
        ``InvalidSpec`` if ``source`` is not a member of this group."""
        made = self.client._run(core.group_fork(self.name, source, n, snapshot, spec, kw))
        return [Sandbox(self.client, i) for i in made]

    def members(self) -> builtins.list[SandboxInfo]:
        """The group's sandboxes on the node now, oldest first."""
        return self.client._run(core.group_members(self.name))

    def sandboxes(self) -> builtins.list[Sandbox]:
        """Handles of the group's sandboxes on the node now, oldest first."""
        return [Sandbox(self.client, i) for i in self.members()]

    def lease(self, *, ttl: float = 10.0, holder: str = "", reclaim: bool = False) -> Lease:
        """A lease on every member now (``Client.lease``): they pause if this process stops
        renewing it, and a new trainer's lease on the group resumes them."""
        op = core.group_lease(self.name, ttl=ttl, holder=holder, reclaim=reclaim)
        return Lease(self.client, self.client._run(op))

    def pause(self, *, reclaim: bool = False) -> builtins.list[SandboxInfo]:
        """Pause every member that runs (see ``Client.pause``)."""
        return self.client._run(core.group_pause(self.name, reclaim=reclaim))

    def resume(self) -> builtins.list[SandboxInfo]:
        """Resume every paused member."""
        return self.client._run(core.group_resume(self.name))

    def kill(self) -> int:
        """Kill every member; returns how many there were."""
        return self.client._run(core.group_kill(self.name))


class AsyncGroup:
    """``Group`` for ``AsyncClient``: members are paused, resumed and killed at once."""

    def __init__(self, client: AsyncClient, name: str) -> None:
        self.client = client
        self.name = core.group_name(name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    async def create(
        self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any
    ) -> builtins.list[AsyncSandbox]:
        """``n`` new members (all or none), labelled into the group."""
        made = await self.client._run(core.group_create(self.name, spec, n, kw))
        return [AsyncSandbox(self.client, i) for i in made]

    async def fork(
        self,
        source: str | AsyncSandbox | None = None,
        n: int = 1,
        *,
        snapshot: str | LayerInfo | None = None,
        spec: SandboxSpec | None = None,
        **kw: Any,
    ) -> builtins.list[AsyncSandbox]:
        """``n`` new members that each start from member ``source``'s state now (packed with
        ``pack_diff``, then ``restore``), each with its own writable layer; or from an
        earlier ``snapshot`` instead. ``spec`` (or its fields) goes to ``Client.restore``.
        ``InvalidSpec`` if ``source`` is not a member of this group."""
        made = await self.client._run(core.group_fork(self.name, source, n, snapshot, spec, kw))
        return [AsyncSandbox(self.client, i) for i in made]

    async def members(self) -> builtins.list[SandboxInfo]:
        """The group's sandboxes on the node now, oldest first."""
        return await self.client._run(core.group_members(self.name))

    async def sandboxes(self) -> builtins.list[AsyncSandbox]:
        """Handles of the group's sandboxes on the node now, oldest first."""
        return [AsyncSandbox(self.client, i) for i in await self.members()]

    async def lease(
        self, *, ttl: float = 10.0, holder: str = "", reclaim: bool = False
    ) -> AsyncLease:
        """A lease on every member now (``Client.lease``): they pause if this process stops
        renewing it, and a new trainer's lease on the group resumes them."""
        op = core.group_lease(self.name, ttl=ttl, holder=holder, reclaim=reclaim)
        return AsyncLease(self.client, await self.client._run(op))

    async def pause(self, *, reclaim: bool = False) -> builtins.list[SandboxInfo]:
        """Pause every member that runs (see ``Client.pause``)."""
        return await self.client._run(core.group_pause(self.name, reclaim=reclaim))

    async def resume(self) -> builtins.list[SandboxInfo]:
        """Resume every paused member."""
        return await self.client._run(core.group_resume(self.name))

    async def kill(self) -> int:
        """Kill every member; returns how many there were."""
        return await self.client._run(core.group_kill(self.name))


# --- trainer leases ---------------------------------------------------------------------------


class Lease:
    """A trainer's lease on sandboxes (``Client.lease``). With ``renew`` a daemon thread renews
    it every ttl/3; if the node forgot it (a restarted daemon), the thread takes a new one on
    the same sandboxes. ``release()`` (or leaving a ``with``) ends it; the sandboxes stay."""

    def __init__(self, client: Client, info: LeaseInfo, renew: bool = True) -> None:
        self.client = client
        self.info = info
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if renew:
            self._thread = threading.Thread(
                target=self._renewing, name=f"dsec-lease-{info.id}", daemon=True
            )
            self._thread.start()

    @property
    def id(self) -> str:
        """The lease's id."""
        return self.info.id

    def __repr__(self) -> str:
        on = ", ".join(self.info.sandboxes)
        return f"<{type(self).__name__} {self.id} on {on}: {self.info.state}>"

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def renew(self) -> LeaseInfo:
        """Renew now (a lapsed lease is held again, and what its lapse paused resumes); one
        the node forgot (a restarted daemon) is taken again on the same sandboxes."""
        self.info = self.client._run(core.renew_or_retake(self.info))
        return self.info

    def _renewing(self) -> None:
        while not self._stop.wait(self.info.ttl / 3):
            try:
                self.renew()
            except DsecError as e:  # the node away for a moment: try again next period
                log.warning("renewing lease %s: %s", self.info.id, e)

    def release(self, *, kill: bool = False) -> None:
        """End the lease (and stop renewing); ``kill`` kills its sandboxes too."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.info = self.client._run(core.release_if_held(self.info.id, kill, self.info))


class AsyncLease:
    """``Lease`` for ``AsyncClient``: renewed by a task of the event loop."""

    def __init__(self, client: AsyncClient, info: LeaseInfo, renew: bool = True) -> None:
        self.client = client
        self.info = info
        self._task = asyncio.get_running_loop().create_task(self._renewing()) if renew else None

    @property
    def id(self) -> str:
        """The lease's id."""
        return self.info.id

    def __repr__(self) -> str:
        on = ", ".join(self.info.sandboxes)
        return f"<{type(self).__name__} {self.id} on {on}: {self.info.state}>"

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    async def renew(self) -> LeaseInfo:
        """Renew now (a lapsed lease is held again, and what its lapse paused resumes); one
        the node forgot (a restarted daemon) is taken again on the same sandboxes."""
        self.info = await self.client._run(core.renew_or_retake(self.info))
        return self.info

    async def _renewing(self) -> None:
        while True:
            await asyncio.sleep(self.info.ttl / 3)
            try:
                await self.renew()
            except DsecError as e:  # the node away for a moment: try again next period
                log.warning("renewing lease %s: %s", self.info.id, e)

    async def release(self, *, kill: bool = False) -> None:
        """End the lease (and stop renewing); ``kill`` kills its sandboxes too."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.info = await self.client._run(core.release_if_held(self.info.id, kill, self.info))
