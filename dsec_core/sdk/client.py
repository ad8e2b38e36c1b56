"""``Client``: the blocking twin. Each method is a typed, documented wrapper that runs one
operation of the core (``core``) on an ``HTTPTransport``; ``AsyncClient`` has the same methods,
with the same signatures and docstrings (``tests/test_sdk.py`` compares them)."""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

from ..api.messages import DEFAULT_MAX_OUTPUT, NodeProbe
from ..api.transport import HTTPTransport, Response, TransportError
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
from .handles import Group, Lease, Sandbox, Session

T = TypeVar("T")


class Client:
    """Synchronous client of a dsec node (or an apiserver).

    ``address`` is ``unix:///path`` (or a path), ``http://host:port`` or ``https://host:port``;
    ``token`` is the node's API token (TCP only), or ``api_key`` an apiserver's API key (the
    same header); ``verify`` checks the node's TLS certificate against the system's CAs
    (True), a CA file (a path), or not at all (False). ``Client()`` uses
    ``DSEC_ADDRESS``/``DSEC_TOKEN``, or the local node (started if needed). ``retry`` is how
    many seconds a request keeps trying while the node is away (``DSEC_RETRY_TIMEOUT``).
    """

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
        self._http = HTTPTransport(c.address, token=c.token, verify=verify, retry=c.retry)

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
    def node_info(self) -> dict[str, Any]:
        """What the node daemon is and holds (``NodeStatus`` as a dict): version, capacity,
        backends, layer sources, FnCall pools, devices."""
        return self._run(core.node_info())

    def probe(self) -> NodeProbe:
        """What the control plane's watcher sees of the node (``NodeProbe``)."""
        return self._run(core.probe())

    def create(self, spec: SandboxSpec | None = None, **kw: Any) -> Sandbox:
        """Create a sandbox from ``spec`` (a ``SandboxSpec``) or its fields as keywords
        (``environment="judge-fizzbuzz"``), the keywords overriding the spec's; returns its
        handle. ``InvalidSpec`` names an unknown or bad field before anything is sent."""
        return Sandbox(self, self._run(core.create(spec, **kw)))

    def create_many(
        self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any
    ) -> builtins.list[Sandbox]:
        """Create ``n`` sandboxes concurrently; all or nothing (the created are killed on
        error, and the first error is raised)."""
        return [Sandbox(self, i) for i in self._run(core.create_many(spec, n, **kw))]

    def get(self, sandbox_id: str) -> Sandbox:
        """The handle of sandbox ``sandbox_id`` as the node sees it now (``UnknownSandbox``
        if there is none)."""
        return Sandbox(self, self._run(core.get(sandbox_id)))

    def list(self) -> builtins.list[SandboxInfo]:
        """Every sandbox on the node (through an apiserver: the caller's project's), oldest
        first."""
        return self._run(core.list_sandboxes())

    def kill(self, sandbox_id: str) -> None:
        """Kill a sandbox and remove everything it left."""
        self._run(core.kill(sandbox_id))

    def group(self, name: str) -> Group:
        """The rollout group ``name``: the sandboxes it creates carry the label ``dsec.group``
        (``GROUP_LABEL``) on the node, so another process (a trainer restarted after a
        preemption) finds the same group by name and pauses, resumes or kills it whole."""
        return Group(self, name)

    def usage(self, sandbox_id: str) -> SandboxUsage:
        """What the sandbox uses now: CPU time, memory, processes, disk."""
        return self._run(core.usage(sandbox_id))

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
        return self._run(core.pause(sandboxes, reclaim=reclaim))

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
        return self._run(core.resume(sandboxes))

    def events(self, sandbox_id: str) -> builtins.list[InfraEvent]:
        """The infrastructure failures that struck the sandbox (``InfraEvent``: preempted, out
        of memory, ...), oldest first: not the task's doing, so a trainer masks them."""
        return self._run(core.events(sandbox_id))

    def set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        """Let the sandbox live ``ttl`` more seconds from now (None: until killed)."""
        return self._run(core.set_ttl(sandbox_id, ttl))

    def policies(self, sandbox_id: str) -> builtins.list[PolicyState]:
        """The sandbox's security policies: in force (with what they saw), or why not."""
        return self._run(core.policies(sandbox_id))

    def set_policy(self, sandbox_id: str, policy: str, settings: Mapping[str, Any]) -> PolicyState:
        """Change a live policy (e.g. a network allowlist) of a running sandbox."""
        return self._run(core.set_policy(sandbox_id, policy, settings))

    # --- trainer leases and trajectories --------------------------------------------------
    def lease(
        self,
        sandboxes: str | Sequence[str],
        *,
        ttl: float = 10.0,
        holder: str = "",
        reclaim: bool = False,
        renew: bool = True,
    ) -> Lease:
        """Take a lease on ``sandboxes`` (an agent sandbox and its workers, a group's members):
        if it is not renewed within ``ttl`` seconds (its trainer died) the node pauses them,
        with ``reclaim`` reclaiming their memory too, and records a "preempted" event. A lease
        on sandboxes of a lapsed one takes them over and resumes them. ``renew``: this process
        renews it every ttl/3 until ``release`` (a thread; an async client's task). ``LeaseHeld``
        if a live lease of another holds one of them."""
        info = self._run(core.lease(sandboxes, ttl=ttl, holder=holder, reclaim=reclaim))
        return Lease(self, info, renew=renew)

    def lease_get(self, lease_id: str) -> LeaseInfo:
        """Lease ``lease_id`` as the node holds it now (``UnknownLease`` if it does not)."""
        return self._run(core.lease_get(lease_id))

    def lease_renew(self, lease_id: str) -> LeaseInfo:
        """Renew a lease (``Lease.renew``: the handle does it for its holder)."""
        return self._run(core.lease_renew(lease_id))

    def lease_release(self, lease_id: str, *, kill: bool = False) -> LeaseInfo:
        """End a lease (``Lease.release``); ``kill`` kills its sandboxes too."""
        return self._run(core.lease_release(lease_id, kill=kill))

    def trajectory(self, name: str) -> builtins.list[TrajectoryEntry]:
        """Every step of trajectory log ``name`` (none if there is no such log)."""
        return self._run(core.trajectory(name))

    def remove_trajectory(self, name: str) -> None:
        """Remove trajectory log ``name`` (``NotFound`` if there is none)."""
        self._run(core.remove_trajectory(name))

    # --- layers and snapshots -------------------------------------------------------------
    def layers(self) -> builtins.list[LayerInfo]:
        """Every layer of the node's layer sources, source by source."""
        return self._run(core.layers())

    def prefetch(self, refs: Sequence[str]) -> builtins.list[dict[str, Any]]:
        """Warm layers on the node (all chunks of on-demand layers); returns what was fetched."""
        return self._run(core.prefetch(refs))

    def pack_diff(
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
        return self._run(op)

    def snapshot_memory(self, sandbox_id: str, name: str | None = None) -> MemorySnapshot:
        """Save a running VM sandbox's memory, devices and disk at one instant (it runs on);
        ``restore(snapshot.name, n)`` starts n sandboxes that go on from there."""
        return self._run(core.snapshot_memory(sandbox_id, name))

    def memory_snapshot(self, name: str) -> MemorySnapshot:
        """Memory snapshot ``name`` as ``snapshot_memory`` made it (``UnknownSnapshot`` if
        there is none): its size on disk and the spec its restores take."""
        return self._run(core.memory_snapshot(name))

    def remove_memory_snapshot(self, name: str) -> None:
        """Remove memory snapshot ``name`` (``UnknownSnapshot`` if there is none)."""
        self._run(core.remove_memory_snapshot(name))

    def restore(
        self,
        snapshot: str | LayerInfo | MemorySnapshot,
        n: int = 1,
        spec: SandboxSpec | None = None,
        **kw: Any,
    ) -> builtins.list[Sandbox]:
        """``n`` new sandboxes that each start from ``snapshot``'s state, each with its own
        writable layer over the same read-only layers; all or nothing. ``spec`` (or its
        fields) sets the rest; its layers and environment are replaced by the snapshot's.
        ``MissingParentLayers`` names the digests of parent layers no source holds."""
        return [Sandbox(self, i) for i in self._run(core.restore(snapshot, n, spec, **kw))]

    # --- stateless calls ------------------------------------------------------------------
    def fncall(
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
        return self._run(op)

    def judge(
        self, environment: str | JudgeSpec, run: str | Sequence[str] | None = None, **kw: Any
    ) -> JudgeResult:
        """Judge a submission in a warm member of the environment's FnCall pool: ``files``
        written, ``compile`` run once, then ``run`` on each of ``cases`` (``JudgeCase``) or
        of ``cases_dir``'s NAME.in/NAME.out, each with ``time_limit`` CPU seconds and
        ``memory_limit``; a verdict per case (AC, WA, TLE, MLE, RE) and for the whole (or CE).
        Takes a ``JudgeSpec``, or its fields as arguments."""
        return self._run(core.judge(environment, run, **kw))

    # --- inside a sandbox -----------------------------------------------------------------
    def exec(
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
        return self._run(op)

    def exec_stream(
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
    ) -> Iterator[ExecOutput | ExecResult]:
        """``exec``, with the output as it comes: ``ExecOutput`` pieces (``stream`` "stdout"
        or "stderr", ``data``), then the ``ExecResult`` (its stdout and stderr empty). Takes
        ``exec``'s arguments but ``trajectory``. Leaving the loop early kills the command."""
        # a generator: nothing is checked or sent before the first item is asked for
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
        yield from self._stream(stream)

    def session_open(
        self, sandbox_id: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> Session:
        """Start a persistent shell in the sandbox (``cwd`` and ``env`` default to the
        sandbox's): its cwd, variables and functions carry over between its commands."""
        opened = self._run(core.session_open(sandbox_id, cwd=cwd, env=env))
        return Session(self, sandbox_id, opened)

    def sessions(self, sandbox_id: str) -> builtins.list[str]:
        """The ids of the sandbox's sessions whose shells still run."""
        return self._run(core.sessions(sandbox_id))

    def session_exec(
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
        return self._run(op)

    def session_close(self, sandbox_id: str, session_id: str) -> None:
        """Close a session (``Session.close``): its shell and what it started end."""
        self._run(core.session_close(sandbox_id, session_id))

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        """The whole file at ``path`` in the sandbox (read in pieces of ``CHUNK``)."""
        return self._run(core.read_file(sandbox_id, path))

    def write_file(
        self, sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None:
        """Write ``data`` (str: as UTF-8) to ``path`` in the sandbox, replacing the file;
        ``mode`` (permission bits such as 0o755) applies to a file this creates."""
        self._run(core.write_file(sandbox_id, path, data, mode=mode))

    def upload(
        self,
        sandbox_id: str,
        local: str | os.PathLike[str],
        remote: str,
        *,
        mode: int | None = None,
    ) -> None:
        """Copy local file ``local`` to ``remote`` in the sandbox piece by piece, never holding
        all of it; ``mode`` defaults to the local file's."""
        self._run(core.upload(sandbox_id, local, remote, mode=mode))

    def download(self, sandbox_id: str, remote: str, local: str | os.PathLike[str]) -> None:
        """Copy a file out of the sandbox piece by piece, never holding all of it. The local
        file is opened once the first piece came (a bad remote path leaves it as it was)."""
        self._run(core.download(sandbox_id, remote, local))

    def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        """The entries of directory ``path`` in the sandbox (lstat, without . and ..), sorted
        by name."""
        return self._run(core.list_dir(sandbox_id, path))

    def stat(self, sandbox_id: str, path: str) -> FileEntry:
        """What lstat says of ``path`` in the sandbox."""
        return self._run(core.stat(sandbox_id, path))

    def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        """Remove a file, symlink or empty directory in the sandbox; ``recursive``: a tree."""
        self._run(core.remove(sandbox_id, path, recursive=recursive))

    def screenshot(self, sandbox_id: str) -> bytes:
        """The sandbox's display now, as PNG bytes (a backend with a screen: ``vm``)."""
        return self._run(core.screenshot(sandbox_id))

    def input(self, sandbox_id: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send input to the sandbox's display in order: records (``dsec_core.screen_input``:
        ``Key("a")``, ``Move(x, y)``, ``Click(x, y)``) or their dicts (``{"type": "click",
        "x": 200, "y": 140}``); returns how many were sent."""
        return self._run(core.input(sandbox_id, events))
