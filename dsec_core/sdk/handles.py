"""Handles: a sandbox, a session, a rollout group or a trainer's lease bound to its client.

Each comes in twins, ``Sandbox`` for ``Client`` and ``AsyncSandbox`` for ``AsyncClient`` and so
on. A handle's methods are its client's with the handle's id filled in, made from the same
operations of the core (``methods.handle_method``), so an IDE and mypy see ``sb.exec`` with
``exec``'s parameters and its ``ExecResult``; what takes more than one request (a group's fork, a
lease taken again) is an operation of the core too. ``tests/test_sdk.py`` holds each twin's
methods to the other's and to the client's.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import threading
from typing import TYPE_CHECKING

from ..errors import DsecError
from ..records import LeaseInfo, SandboxInfo
from . import core
from .core import SandboxRef
from .methods import (
    async_handle_method,
    async_session_method,
    awaiting,
    blocking,
    handle_method,
    named,
    session_method,
    streaming,
    streaming_async,
)

if TYPE_CHECKING:
    from .async_client import AsyncClient
    from .client import Client

log = logging.getLogger("dsec.sdk")


# --- what a client's operation makes a handle of (``into``) -----------------------------------


def sandbox_handles(client: Client, infos: list[SandboxInfo]) -> list[Sandbox]:
    return [Sandbox(client, i) for i in infos]


def async_sandbox_handles(client: AsyncClient, infos: list[SandboxInfo]) -> list[AsyncSandbox]:
    return [AsyncSandbox(client, i) for i in infos]


def session_handle(client: Client, ids: tuple[str, str]) -> Session:
    return Session(client, *ids)


def async_session_handle(client: AsyncClient, ids: tuple[str, str]) -> AsyncSession:
    return AsyncSession(client, *ids)


def lease_handle(client: Client, taken: tuple[LeaseInfo, bool]) -> Lease:
    return Lease(client, *taken)


def async_lease_handle(client: AsyncClient, taken: tuple[LeaseInfo, bool]) -> AsyncLease:
    return AsyncLease(client, *taken)


# --- sandboxes --------------------------------------------------------------------------------


@named
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

    kill = handle_method(blocking(core.kill))
    exec = handle_method(blocking(core.exec))
    exec_stream = handle_method(streaming(core.exec_stream))
    process_start = handle_method(blocking(core.process_start))
    processes = handle_method(blocking(core.processes))
    process = handle_method(blocking(core.process))
    process_output = handle_method(streaming(core.process_output))
    process_input = handle_method(blocking(core.process_input))
    process_resize = handle_method(blocking(core.process_resize))
    process_signal = handle_method(blocking(core.process_signal))
    session = handle_method(blocking(core.session_open, into=session_handle))
    session_open = handle_method(blocking(core.session_open, into=session_handle))
    sessions = handle_method(blocking(core.sessions))
    set_ttl = handle_method(blocking(core.set_ttl))
    pause = handle_method(blocking(core.pause))
    resume = handle_method(blocking(core.resume))
    usage = handle_method(blocking(core.usage))
    events = handle_method(blocking(core.events))
    policies = handle_method(blocking(core.policies))
    set_policy = handle_method(blocking(core.set_policy))
    read_file = handle_method(blocking(core.read_file))
    write_file = handle_method(blocking(core.write_file))
    upload = handle_method(blocking(core.upload))
    download = handle_method(blocking(core.download))
    list_dir = handle_method(blocking(core.list_dir))
    stat = handle_method(blocking(core.stat))
    remove = handle_method(blocking(core.remove))
    screenshot = handle_method(blocking(core.screenshot))
    input = handle_method(blocking(core.input))
    pack_diff = handle_method(blocking(core.pack_diff))
    snapshot_memory = handle_method(blocking(core.snapshot_memory))


@named
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

    kill = async_handle_method(awaiting(core.kill))
    exec = async_handle_method(awaiting(core.exec))
    exec_stream = async_handle_method(streaming_async(core.exec_stream))
    process_start = async_handle_method(awaiting(core.process_start))
    processes = async_handle_method(awaiting(core.processes))
    process = async_handle_method(awaiting(core.process))
    process_output = async_handle_method(streaming_async(core.process_output))
    process_input = async_handle_method(awaiting(core.process_input))
    process_resize = async_handle_method(awaiting(core.process_resize))
    process_signal = async_handle_method(awaiting(core.process_signal))
    session = async_handle_method(awaiting(core.session_open, into=async_session_handle))
    session_open = async_handle_method(awaiting(core.session_open, into=async_session_handle))
    sessions = async_handle_method(awaiting(core.sessions))
    set_ttl = async_handle_method(awaiting(core.set_ttl))
    pause = async_handle_method(awaiting(core.pause))
    resume = async_handle_method(awaiting(core.resume))
    usage = async_handle_method(awaiting(core.usage))
    events = async_handle_method(awaiting(core.events))
    policies = async_handle_method(awaiting(core.policies))
    set_policy = async_handle_method(awaiting(core.set_policy))
    read_file = async_handle_method(awaiting(core.read_file))
    write_file = async_handle_method(awaiting(core.write_file))
    upload = async_handle_method(awaiting(core.upload))
    download = async_handle_method(awaiting(core.download))
    list_dir = async_handle_method(awaiting(core.list_dir))
    stat = async_handle_method(awaiting(core.stat))
    remove = async_handle_method(awaiting(core.remove))
    screenshot = async_handle_method(awaiting(core.screenshot))
    input = async_handle_method(awaiting(core.input))
    pack_diff = async_handle_method(awaiting(core.pack_diff))
    snapshot_memory = async_handle_method(awaiting(core.snapshot_memory))


# --- sessions ---------------------------------------------------------------------------------


class SessionRef:
    """What a session handle is: its sandbox's id and its own."""

    def __init__(self, sandbox_id: str, session_id: str) -> None:
        self.sandbox_id, self.id = sandbox_id, session_id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} in {self.sandbox_id}>"


@named
class Session(SessionRef):
    """A persistent shell in a sandbox: cwd, env and shell variables carry over. A context
    manager that closes it on exit."""

    def __init__(self, client: Client, sandbox_id: str, session_id: str) -> None:
        super().__init__(sandbox_id, session_id)
        self.client = client

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client._run(core.session_close_quietly(self.sandbox_id, self.id))

    exec = session_method(blocking(core.session_exec))
    close = session_method(blocking(core.session_close))


@named
class AsyncSession(SessionRef):
    """The asyncio twin of ``Session``."""

    def __init__(self, client: AsyncClient, sandbox_id: str, session_id: str) -> None:
        super().__init__(sandbox_id, session_id)
        self.client = client

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client._run(core.session_close_quietly(self.sandbox_id, self.id))

    exec = async_session_method(awaiting(core.session_exec))
    close = async_session_method(awaiting(core.session_close))


# --- rollout groups ---------------------------------------------------------------------------


class GroupRef:
    """What a rollout group's handle is: its name, which its operations take first."""

    def __init__(self, name: str) -> None:
        self.name = core.group_name(name)

    @property
    def _key(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


@named
class Group(GroupRef):
    """A rollout group: sandboxes created, paused, resumed and killed together, found again by
    name from any process (see ``Client.group``)."""

    def __init__(self, client: Client, name: str) -> None:
        super().__init__(name)
        self.client = client

    create = handle_method(blocking(core.group_create, into=sandbox_handles))
    fork = handle_method(blocking(core.group_fork, into=sandbox_handles))
    members = handle_method(blocking(core.group_members))
    lease = handle_method(blocking(core.group_lease, into=lease_handle))
    pause = handle_method(blocking(core.group_pause))
    resume = handle_method(blocking(core.group_resume))
    kill = handle_method(blocking(core.group_kill))

    def sandboxes(self) -> builtins.list[Sandbox]:
        """Handles of the group's sandboxes on the node now, oldest first."""
        return [Sandbox(self.client, i) for i in self.members()]


@named
class AsyncGroup(GroupRef):
    """``Group`` for ``AsyncClient``: members are paused, resumed and killed at once."""

    def __init__(self, client: AsyncClient, name: str) -> None:
        super().__init__(name)
        self.client = client

    create = async_handle_method(awaiting(core.group_create, into=async_sandbox_handles))
    fork = async_handle_method(awaiting(core.group_fork, into=async_sandbox_handles))
    members = async_handle_method(awaiting(core.group_members))
    lease = async_handle_method(awaiting(core.group_lease, into=async_lease_handle))
    pause = async_handle_method(awaiting(core.group_pause))
    resume = async_handle_method(awaiting(core.group_resume))
    kill = async_handle_method(awaiting(core.group_kill))

    async def sandboxes(self) -> builtins.list[AsyncSandbox]:
        """Handles of the group's sandboxes on the node now, oldest first."""
        return [AsyncSandbox(self.client, i) for i in await self.members()]


# --- trainer leases ---------------------------------------------------------------------------


class LeaseRef:
    """What a trainer's lease handle is: the lease as last seen (``info``)."""

    def __init__(self, info: LeaseInfo) -> None:
        self.info = info

    @property
    def id(self) -> str:
        """The lease's id."""
        return self.info.id

    def __repr__(self) -> str:
        on = ", ".join(self.info.sandboxes)
        return f"<{type(self).__name__} {self.id} on {on}: {self.info.state}>"


class Lease(LeaseRef):
    """A trainer's lease on sandboxes (``Client.lease``). With ``renew`` a daemon thread renews
    it every ttl/3; if the node forgot it (a restarted daemon), the thread takes a new one on
    the same sandboxes. ``release()`` (or leaving a ``with``) ends it; the sandboxes stay."""

    def __init__(self, client: Client, info: LeaseInfo, renew: bool = True) -> None:
        super().__init__(info)
        self.client = client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if renew:
            self._thread = threading.Thread(
                target=self._renewing, name=f"dsec-lease-{info.id}", daemon=True
            )
            self._thread.start()

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


class AsyncLease(LeaseRef):
    """``Lease`` for ``AsyncClient``: renewed by a task of the event loop."""

    def __init__(self, client: AsyncClient, info: LeaseInfo, renew: bool = True) -> None:
        super().__init__(info)
        self.client = client
        self._task = asyncio.get_running_loop().create_task(self._renewing()) if renew else None

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
