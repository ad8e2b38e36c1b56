"""``Client``: the blocking twin. Its methods are the core's operations (``core``), each run on
an ``HTTPTransport`` by ``methods.blocking``, with the operation's parameters and docstring;
``AsyncClient`` is made of the same operations (``tests/test_sdk.py`` compares the two). What
is not one operation (a lease's handle, a pause of one or several) is written here."""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

from ..api.transport import HTTPTransport, Response, TransportError
from ..records import ExecOutput, ExecResult, SandboxInfo
from . import core
from .connection import Connected
from .core import Batch, Call, Effect, Op, Stream
from .handles import Group, Sandbox, lease_handle, sandbox_handles, session_handle
from .methods import blocking, named, streaming

T = TypeVar("T")


@named
class Client(Connected):
    """Synchronous client of a dsec node (or an apiserver).

    ``address`` is ``unix:///path`` (or a path), ``http://host:port`` or ``https://host:port``;
    ``token`` is the node's API token (TCP only), or ``api_key`` an apiserver's API key (the
    same header); ``verify`` checks the node's TLS certificate against the system's CAs
    (True), a CA file (a path), or not at all (False). ``Client()`` uses
    ``DSEC_ADDRESS``/``DSEC_TOKEN``, or the local node (started if needed). ``retry`` is how
    many seconds a request keeps trying while the node is away (``DSEC_RETRY_TIMEOUT``).
    """

    _transport = HTTPTransport
    _http: HTTPTransport

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's pooled connections (leaving a ``with`` does it)."""
        self._http.close()

    # --- running the core's operations ----------------------------------------------------
    def _run(self, op: Op[T]) -> T:
        """Run an operation of the core: each effect done here, in turn, blocking."""
        try:
            effect = next(op)
            while True:
                try:
                    outcome = self._do(effect)
                except Exception as e:  # the operation may handle it (a lease forgotten)
                    effect = op.throw(e)
                else:
                    effect = op.send(outcome)
        except StopIteration as stop:
            return stop.value
        finally:
            op.close()

    def _do(self, effect: Effect) -> Any:
        if isinstance(effect, Call):
            return self._send(effect)
        if isinstance(effect, Batch):
            return [self._send(c) for c in effect.calls]
        return effect.fn(*effect.args)

    def _send(self, call: Call) -> Any:
        route = call.route
        try:
            r = self._http.request(
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

    def _stream(self, stream: Stream) -> Iterator[ExecOutput | ExecResult]:
        try:
            r = self._http.stream(
                "POST",
                stream.target,
                body=stream.content,
                content_type=stream.content_type,
                timeout=stream.timeout,
            )
        except TransportError as e:
            raise stream.unreachable(e, self.address) from e
        with r:
            if r.status_code >= 300:
                stream.refused(Response(r.status_code, r.read(), r.headers))
            lines = stream.lines()
            try:
                for piece in r:
                    yield from lines.feed(piece)
                    if lines.done:
                        return
            except TransportError as e:
                raise stream.broke(e, self.address) from e
            raise lines.end()

    # --- the node and its sandboxes -------------------------------------------------------
    node_info = blocking(core.node_info)
    probe = blocking(core.probe)
    warm = blocking(core.warm)
    set_warm = blocking(core.set_warm)
    create = blocking(core.create, into=Sandbox)
    create_many = blocking(core.create_many, into=sandbox_handles)
    get = blocking(core.get, into=Sandbox)
    kill = blocking(core.kill)
    usage = blocking(core.usage)
    events = blocking(core.events)
    set_ttl = blocking(core.set_ttl)
    policies = blocking(core.policies)
    set_policy = blocking(core.set_policy)

    def list(self) -> builtins.list[SandboxInfo]:
        """Every sandbox on the node (through an apiserver: the caller's project's), oldest
        first."""
        return self._run(core.list_sandboxes())

    def group(self, name: str) -> Group:
        """The rollout group ``name``: the sandboxes it creates carry the label ``dsec.group``
        (``GROUP_LABEL``) on the node, so another process (a trainer restarted after a
        preemption) finds the same group by name and pauses, resumes or kills it whole."""
        return Group(self, name)

    # a str is a Sequence[str] too: the str overload comes first, so one id gives one info
    @overload
    def pause(  # type: ignore[overload-overlap]
        self, sandboxes: str, *, reclaim: bool = False
    ) -> SandboxInfo: ...
    @overload
    def pause(
        self, sandboxes: Sequence[str] | Group, *, reclaim: bool = False
    ) -> builtins.list[SandboxInfo]: ...
    def pause(
        self, sandboxes: str | Sequence[str] | Group, *, reclaim: bool = False
    ) -> SandboxInfo | builtins.list[SandboxInfo]:
        """Pause one sandbox (its id: returns its ``SandboxInfo``) or several (a list of ids,
        or a rollout ``Group``: returns theirs): every process stops where it is; memory, open
        files and sessions stay, and nothing in it answers until ``resume``. ``reclaim`` then
        has the kernel take back what of its memory it can. Pausing a paused one changes
        nothing. An async client pauses several at once."""
        if isinstance(sandboxes, Group):
            return sandboxes.pause(reclaim=reclaim)
        if isinstance(sandboxes, str):
            return self._run(core.pause(sandboxes, reclaim=reclaim))
        return self._run(core.pause_all(sandboxes, reclaim=reclaim))

    @overload
    def resume(self, sandboxes: str) -> SandboxInfo: ...  # type: ignore[overload-overlap]
    @overload
    def resume(self, sandboxes: Sequence[str] | Group) -> builtins.list[SandboxInfo]: ...
    def resume(
        self, sandboxes: str | Sequence[str] | Group
    ) -> SandboxInfo | builtins.list[SandboxInfo]:
        """Let paused sandboxes go on where they were (one id: its ``SandboxInfo``; a list, or
        a ``Group``: theirs); a no-op for one that is not paused."""
        if isinstance(sandboxes, Group):
            return sandboxes.resume()
        if isinstance(sandboxes, str):
            return self._run(core.resume(sandboxes))
        return self._run(core.resume_all(sandboxes))

    # --- trainer leases and trajectories --------------------------------------------------
    lease = blocking(core.lease, into=lease_handle)
    lease_get = blocking(core.lease_get)
    lease_renew = blocking(core.lease_renew)
    lease_release = blocking(core.lease_release)
    trajectory = blocking(core.trajectory)
    remove_trajectory = blocking(core.remove_trajectory)

    # --- layers and snapshots -------------------------------------------------------------
    layers = blocking(core.layers)
    prefetch = blocking(core.prefetch)
    resolve_image = blocking(core.resolve_image)
    pack_diff = blocking(core.pack_diff)
    snapshot_memory = blocking(core.snapshot_memory)
    memory_snapshot = blocking(core.memory_snapshot)
    remove_memory_snapshot = blocking(core.remove_memory_snapshot)
    restore = blocking(core.restore, into=sandbox_handles)

    # --- stateless calls ------------------------------------------------------------------
    fncall = blocking(core.fncall)
    judge = blocking(core.judge)

    # --- IAM: projects, quotas and keys (through an apiserver) ----------------------------
    whoami = blocking(core.whoami)
    projects = blocking(core.projects)
    create_project = blocking(core.create_project)
    project = blocking(core.project)
    set_quota = blocking(core.set_quota)
    revoke_project = blocking(core.revoke_project)
    keys = blocking(core.keys)
    create_key = blocking(core.create_key)
    revoke_key = blocking(core.revoke_key)

    # --- inside a sandbox -----------------------------------------------------------------
    exec = blocking(core.exec)
    exec_stream = streaming(core.exec_stream)
    process_start = blocking(core.process_start)
    processes = blocking(core.processes)
    process = blocking(core.process)
    process_output = streaming(core.process_output)
    process_input = blocking(core.process_input)
    process_resize = blocking(core.process_resize)
    process_signal = blocking(core.process_signal)
    session_open = blocking(core.session_open, into=session_handle)
    sessions = blocking(core.sessions)
    session_exec = blocking(core.session_exec)
    session_close = blocking(core.session_close)
    read_file = blocking(core.read_file)
    write_file = blocking(core.write_file)
    upload = blocking(core.upload)
    download = blocking(core.download)
    list_dir = blocking(core.list_dir)
    stat = blocking(core.stat)
    remove = blocking(core.remove)
    screenshot = blocking(core.screenshot)
    input = blocking(core.input)
