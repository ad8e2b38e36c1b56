"""The SDK: ``Client`` (sync) and ``AsyncClient`` (asyncio) with the same methods.

Every method is a line or two over the route table (``dsec_core.api.routes``): it names its
route and hands over the route's messages; the two clients only differ in how they send them.
``Client()`` with no address talks to ``DSEC_ADDRESS`` (with ``DSEC_TOKEN``) if set, else to
the local node daemon on its unix socket, starting it if none runs (the embedded single-node
default).

Bad arguments raise ``InvalidSpec`` naming the argument before anything is sent: each request is
checked against the same decoders the node runs. While the node is away (its daemon restarting)
a request is retried for up to ``retry`` seconds (``DSEC_RETRY_TIMEOUT``, 15 by default) if it
never reached the node, and GETs and deletes also if it broke before the answer came.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import contextlib
import dataclasses
import json
import logging
import os
import stat
import threading
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .api.messages import (
    DEFAULT_MAX_OUTPUT,
    CreateRequest,
    ExecRequest,
    FileQuery,
    FnCallRequest,
    InputRequest,
    LeaseRequest,
    MemorySnapshotRequest,
    PackDiffRequest,
    PauseQuery,
    PolicySettings,
    PrefetchRequest,
    ReadQuery,
    ReleaseQuery,
    RemoveQuery,
    RestoreRequest,
    SessionExecRequest,
    SessionOpenRequest,
    TtlRequest,
    WriteQuery,
)
from .api.routes import JSON, ROUTES, Route, dump_json
from .api.transport import (
    Address,
    AsyncHTTPTransport,
    AsyncStreamedResponse,
    HTTPTransport,
    Response,
    TransportError,
    TransportTimeout,
)
from .config import NodeConfig
from .errors import (
    DsecError,
    ExecTimeout,
    InvalidSpec,
    NodeUnavailable,
    UnknownLease,
    UnknownSandbox,
    error_from_wire,
)
from .inputs import InputEvent, input_dicts
from .localnode import ensure_daemon
from .records import (
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
    check_trajectory_name,
)

__all__ = [
    "GROUP_LABEL",
    "AsyncClient",
    "AsyncGroup",
    "AsyncLease",
    "AsyncSandbox",
    "AsyncSession",
    "Client",
    "Group",
    "Lease",
    "Sandbox",
    "Session",
]

log = logging.getLogger("dsec.sdk")

#: The label that makes a sandbox a member of a rollout group (``Client.group``).
GROUP_LABEL = "dsec.group"

CHUNK = 8 << 20  # file transfers move in pieces of this size
EXEC_GRACE = 30.0  # past an exec's own timeout, how long a client waits for the node's answer
RETRY_TIMEOUT = 15.0  # seconds a request keeps trying while the node is away (a restart)

_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(SandboxSpec))


def _snapshot_ref(snapshot: str | LayerInfo | MemorySnapshot) -> str:
    """What ``restore`` names: a snapshot layer's ref or a memory snapshot's name."""
    if isinstance(snapshot, LayerInfo):
        return snapshot.ref
    if isinstance(snapshot, MemorySnapshot):
        return snapshot.name
    return snapshot


def _spec(spec: SandboxSpec | None, kw: dict[str, Any]) -> SandboxSpec:
    unknown = sorted(set(kw) - _SPEC_FIELDS)
    if unknown:
        raise InvalidSpec(
            f"unknown sandbox spec field(s) {unknown}; known: {sorted(_SPEC_FIELDS)}",
            fields=unknown,
        )
    if spec is None:
        return SandboxSpec(**kw)
    if not isinstance(spec, SandboxSpec):
        raise InvalidSpec(f"spec must be a SandboxSpec, got {type(spec).__name__}", field="spec")
    if kw:
        return SandboxSpec(**{**spec.to_dict(), **kw})
    return spec


_JUDGE_FIELDS = frozenset(f.name for f in dataclasses.fields(JudgeSpec))


def _judge_spec(
    environment: str | JudgeSpec, run: str | Sequence[str] | None, kw: dict[str, Any]
) -> JudgeSpec:
    if isinstance(environment, JudgeSpec):
        if run is not None or kw:
            raise InvalidSpec("judge takes a JudgeSpec or its fields, not both", field="run")
        return environment
    unknown = sorted(set(kw) - _JUDGE_FIELDS)
    if unknown:
        raise InvalidSpec(
            f"unknown judge field(s) {unknown}; known: {sorted(_JUDGE_FIELDS)}", fields=unknown
        )
    if isinstance(run, Sequence) and not isinstance(run, str):
        run = tuple(run)
    return JudgeSpec(environment, run or "", **kw)


def _data(data: Any) -> bytes | bytearray | memoryview:
    if isinstance(data, str):
        return data.encode()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidSpec(f"data must be bytes or str, got {type(data).__name__}", field="data")
    return data


def _octal(mode: Any) -> str:
    """A file mode for ``WriteQuery``; ``WriteQuery`` itself refuses the sticky bit."""
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InvalidSpec(f"mode must be permission bits such as 0o644, got {mode!r}", field="mode")
    return f"{mode:o}"


def _write_chunks(data: bytes | bytearray | memoryview) -> Iterator[tuple[int, bytes]]:
    view = memoryview(data).cast("B")
    if not view:
        yield 0, b""
    for off in range(0, len(view), CHUNK):
        yield off, bytes(view[off : off + CHUNK])


def _file_chunks(local: Path) -> Generator[tuple[int, bytes], None, None]:
    """A local file in pieces, read as they are sent, so an upload never holds all of it."""
    with open(local, "rb") as f:
        off = 0
        while True:
            piece = f.read(CHUNK)
            if piece or off == 0:
                yield off, piece
            if len(piece) < CHUNK:
                return
            off += len(piece)


def _local(local: Any) -> Path:
    """A local path argument (an int would be taken for a file descriptor by ``open``)."""
    if not isinstance(local, (str, os.PathLike)) or not os.fspath(local):
        raise InvalidSpec(f"local must be a path, got {local!r}", field="local")
    return Path(local)


def _upload_mode(local: Path, mode: int | None) -> int:
    """The mode to give the uploaded file; ``InvalidSpec`` if ``local`` is no readable file."""
    try:
        st = local.stat()
    except OSError as e:
        raise InvalidSpec(f"local: cannot upload {local}: {e.strerror}", field="local") from e
    if not stat.S_ISREG(st.st_mode):
        raise InvalidSpec(f"local: {local} is not a regular file", field="local")
    # The sticky bit means nothing on a file and WriteQuery refuses it: leave it behind.
    return mode if mode is not None else st.st_mode & 0o6777


def _input_request(events: Sequence[Mapping[str, Any] | InputEvent]) -> InputRequest:
    """The request of ``events``, checked here (``InvalidSpec`` before anything is sent)."""
    return InputRequest(tuple(input_dicts(events)))


def _retry_timeout(retry: float | None) -> float:
    if retry is None:
        text = os.environ.get("DSEC_RETRY_TIMEOUT", "").strip()
        try:
            retry = float(text) if text else RETRY_TIMEOUT
        except ValueError:
            retry = -1.0
        field = "DSEC_RETRY_TIMEOUT"
    else:
        field = "retry"
    if isinstance(retry, bool) or not isinstance(retry, (int, float)) or not 0 <= retry < 1e9:
        raise InvalidSpec(f"{field} must be seconds (0 or more), got {retry!r}", field=field)
    return float(retry)


def _resolve(
    address: str | os.PathLike[str] | None, token: str | None, autostart: bool
) -> tuple[Address, str | None]:
    """Where to connect and with which token: the address given, else ``DSEC_ADDRESS`` (and
    ``DSEC_TOKEN``), else the local node's unix socket (started if ``autostart``)."""
    if token is not None and not isinstance(token, str):
        raise InvalidSpec(f"token must be a string, got {type(token).__name__}", field="token")
    if address is None and os.environ.get("DSEC_ADDRESS"):
        address = os.environ["DSEC_ADDRESS"]
        if token is None:  # the token goes with the address it was set for, never elsewhere
            token = os.environ.get("DSEC_TOKEN") or None
    if address is not None:
        return Address.parse(address), token
    config = NodeConfig.from_env()
    if autostart:
        ensure_daemon(config)
    return Address("unix", path=os.fspath(config.socket_path)), token


def _api_key(token: str | None, api_key: str | None) -> str | None:
    """An apiserver's API key travels as the bearer token, as a node's token does."""
    if api_key is not None and token is not None and api_key != token:
        raise InvalidSpec("give token or api_key, not both", field="api_key")
    return token if token is not None else api_key


def _timeout(route: Route, body: Any) -> float | None:
    """How long to wait for the answer: the route's default, or an exec's own timeout plus a
    grace period for the node to kill the command and answer."""
    if route.exec_timeout:
        return None if body.timeout is None else body.timeout + EXEC_GRACE
    return route.timeout


def _answer(route: Route, r: Response) -> Any:
    """The typed answer of a response, or the typed error the node sent."""
    if r.status_code >= 300:
        try:
            payload = r.json()["error"]
            payload["type"]
        except (ValueError, KeyError, TypeError):
            raise DsecError(
                f"the node answered {r.status_code} to {route.method} {route.path}: {r.text[:500]}"
            ) from None
        raise error_from_wire(payload)
    try:
        return route.decode_response(r.content)
    except InvalidSpec as e:
        raise DsecError(
            f"the node's answer to {route.method} {route.path} does not fit the API: {e}"
        ) from e


def _transport_error(route: Route, body: Any, e: TransportError, address: str) -> DsecError:
    if isinstance(e, TransportTimeout) and route.exec_timeout:
        return ExecTimeout(
            f"no answer from the node within {body.timeout}s + {EXEC_GRACE}s", timeout=body.timeout
        )
    return NodeUnavailable(f"the node did not answer: {e}", address=address)


#: How long a client waits for a streamed exec's answer to begin (its lines come as they may)
STREAM_START_TIMEOUT = 60.0


class _ExecLines:
    """Turns the pieces of an ``exec_stream`` answer into ``ExecOutput``s and the last
    ``ExecResult``; the node's error line is raised as its typed error."""

    def __init__(self) -> None:
        self._buf = b""
        self.done = False

    def feed(self, piece: bytes) -> list[ExecOutput | ExecResult]:
        self._buf += piece
        out: list[ExecOutput | ExecResult] = []
        while not self.done and (i := self._buf.find(b"\n")) >= 0:
            line, self._buf = self._buf[:i], self._buf[i + 1 :]
            out.append(self._item(line))
        return out

    def _item(self, line: bytes) -> ExecOutput | ExecResult:
        try:
            obj = json.loads(line)
            (key, value), *rest = obj.items()
            if rest:
                raise ValueError("more than one key")
            if key in ("stdout", "stderr"):
                return ExecOutput(key, base64.b64decode(value, validate=True))
            if key == "result":
                self.done = True
                return ROUTES["exec"].decode_response(dump_json(value))
            if key == "error":
                self.done = True
                raise error_from_wire(value)
            raise ValueError(f"unknown key {key!r}")
        except DsecError:
            raise
        except (ValueError, TypeError, AttributeError, binascii.Error) as e:
            raise DsecError(f"the node's exec stream has a malformed line: {e}") from None

    def end(self) -> DsecError:
        return NodeUnavailable("the node ended the exec stream without a result")


def _stream_request(
    sandbox_id: str, cmd: Any, timeout: float | None, kw: dict[str, Any]
) -> tuple[Route, str, bytes]:
    route = ROUTES["exec_stream"]
    body = ExecRequest(
        cmd,
        timeout,
        kw.get("cwd"),
        kw.get("env"),
        kw.get("stdin"),
        kw.get("max_output", DEFAULT_MAX_OUTPUT),
        kw.get("background", False),
        kw.get("exclusive", False),
    )
    content = route.encode_body(body)
    assert content is not None
    return route, route.target({"sid": sandbox_id}), content


async def _aexec_lines(
    route: Route, r: AsyncStreamedResponse, address: str
) -> AsyncIterator[ExecOutput | ExecResult]:
    async with r:
        if r.status_code >= 300:
            _answer(route, Response(r.status_code, await r.read(), r.headers))
        lines = _ExecLines()
        try:
            async for piece in r:
                for item in lines.feed(piece):
                    yield item
                if lines.done:
                    return
        except TransportError as e:
            raise NodeUnavailable(f"the exec stream broke: {e}", address=address) from e
        raise lines.end()


class Client:
    """Synchronous client of a dsec node.

    ``address`` is ``unix:///path`` (or a path), ``http://host:port`` or ``https://host:port``;
    ``token`` is the node's API token (TCP only), or ``api_key`` an apiserver's API key (the
    same header); ``verify`` checks the node's TLS certificate against the system's CAs
    (True), a CA file (a path), or not at all (False). ``Client()``
    uses ``DSEC_ADDRESS``/``DSEC_TOKEN``, or the local node (started if needed). ``retry`` is
    how many seconds a request keeps trying while the node is away (``DSEC_RETRY_TIMEOUT``).
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
        retry = _retry_timeout(retry)
        token = _api_key(token, api_key)
        where, token = _resolve(address, token, autostart)
        self.address = str(where)
        self._http = HTTPTransport(where, token=token, verify=verify, retry=retry)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, name: str, body: Any = None, query: Any = None, **params: str) -> Any:
        route = ROUTES[name]
        target, content = route.target(params, query), route.encode_body(body)
        try:
            r = self._http.request(
                route.method,
                target,
                body=content,
                content_type=route.body_type,
                timeout=_timeout(route, body),
                idempotent=bool(route.idempotent),
            )
        except TransportError as e:
            raise _transport_error(route, body, e, self.address) from e
        return _answer(route, r)

    # --- node and sandboxes ---------------------------------------------------------------
    def node_info(self) -> dict[str, Any]:
        return self._call("node_info").to_dict()

    def create(self, spec: SandboxSpec | None = None, **kw: Any) -> Sandbox:
        return Sandbox(self, self._call("create", CreateRequest(_spec(spec, kw))).sandboxes[0])

    def create_many(self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any) -> list[Sandbox]:
        """Create ``n`` sandboxes concurrently; all or nothing (the created are killed on error)."""
        made = self._call("create", CreateRequest(_spec(spec, kw), n))
        if made.errors:
            for info in made.sandboxes:
                self.kill(info.id)
            raise error_from_wire(made.errors[0].to_dict())
        return [Sandbox(self, i) for i in made.sandboxes]

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self, self._call("get", sid=sandbox_id))

    def list(self) -> builtins.list[SandboxInfo]:
        return list(self._call("list").sandboxes)

    def kill(self, sandbox_id: str) -> None:
        self._call("kill", sid=sandbox_id)

    def group(self, name: str) -> Group:
        """The rollout group ``name``: the sandboxes it creates carry the label ``dsec.group``
        (``GROUP_LABEL``) on the node, so another process (a trainer restarted after a
        preemption) finds the same group by name and pauses, resumes or kills it whole."""
        return Group(self, name)

    def usage(self, sandbox_id: str) -> SandboxUsage:
        return self._call("usage", sid=sandbox_id)

    def pause(self, sandboxes: str | Sequence[str] | Group, *, reclaim: bool = False) -> Any:
        """Pause one sandbox (its id: returns its ``SandboxInfo``) or several (a list of ids,
        or a rollout ``Group``: returns theirs): every process stops where it is; memory, open
        files and sessions stay, and nothing in it answers until ``resume``. ``reclaim`` then
        has the kernel take back what of its memory it can. Pausing a paused one changes
        nothing."""
        if isinstance(sandboxes, Group):
            return sandboxes.pause(reclaim=reclaim)
        q = PauseQuery(reclaim)
        if isinstance(sandboxes, str):
            return self._call("pause", query=q, sid=sandboxes)
        return [self._call("pause", query=q, sid=sid) for sid in sandboxes]

    def resume(self, sandboxes: str | Sequence[str] | Group) -> Any:
        """Let paused sandboxes go on where they were (one id, a list, or a ``Group``); a no-op
        for one that is not paused."""
        if isinstance(sandboxes, Group):
            return sandboxes.resume()
        if isinstance(sandboxes, str):
            return self._call("resume", sid=sandboxes)
        return [self._call("resume", sid=sid) for sid in sandboxes]

    def events(self, sandbox_id: str) -> builtins.list[InfraEvent]:
        """The infrastructure failures that struck the sandbox (``InfraEvent``: preempted, out
        of memory, ...), oldest first: not the task's doing, so a trainer masks them."""
        return list(self._call("events", sid=sandbox_id).events)

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
        on sandboxes of a lapsed one takes them over and resumes them. ``renew``: a thread of
        this process renews it every ttl/3 until ``release``. ``LeaseHeld`` if a live lease
        of another holds one of them."""
        ids = [sandboxes] if isinstance(sandboxes, str) else list(sandboxes)
        info = self._call("lease", LeaseRequest(tuple(ids), ttl, holder, reclaim))
        return Lease(self, info, renew=renew)

    def lease_get(self, lease_id: str) -> LeaseInfo:
        return self._call("lease_get", lease=lease_id)

    def lease_renew(self, lease_id: str) -> LeaseInfo:
        """Renew a lease (``Lease.renew``: the handle does it for its holder)."""
        return self._call("lease_renew", lease=lease_id)

    def lease_release(self, lease_id: str, *, kill: bool = False) -> LeaseInfo:
        """End a lease (``Lease.release``); ``kill`` kills its sandboxes too."""
        return self._call("lease_release", query=ReleaseQuery(kill), lease=lease_id)

    def trajectory(self, name: str) -> builtins.list[TrajectoryEntry]:
        """Every step of trajectory log ``name`` (none if there is no such log)."""
        return list(self._call("trajectory", trajectory=check_trajectory_name(name)).entries)

    def remove_trajectory(self, name: str) -> None:
        """Remove trajectory log ``name`` (``NotFound`` if there is none)."""
        self._call("remove_trajectory", trajectory=check_trajectory_name(name))

    def policies(self, sandbox_id: str) -> builtins.list[PolicyState]:
        """The sandbox's security policies: in force (with what they saw), or why not."""
        return list(self._call("policies", sid=sandbox_id).policies)

    def set_policy(self, sandbox_id: str, policy: str, settings: Mapping[str, Any]) -> PolicyState:
        """Change a live policy (e.g. a network allowlist) of a running sandbox."""
        return self._call("set_policy", PolicySettings(settings), sid=sandbox_id, policy=policy)

    def layers(self) -> builtins.list[LayerInfo]:
        return list(self._call("layers").layers)

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
        body = PackDiffRequest(name, version, tuple(exclude), scrub, source, dict(secrets or {}))
        return self._call("pack_diff", body, sid=sandbox_id)

    def snapshot_memory(self, sandbox_id: str, name: str | None = None) -> MemorySnapshot:
        """Save a running VM sandbox's memory, devices and disk at one instant (it runs on);
        ``restore(snapshot.name, n)`` starts n sandboxes that go on from there."""
        return self._call("snapshot_memory", MemorySnapshotRequest(name), sid=sandbox_id)

    def memory_snapshot(self, name: str) -> MemorySnapshot:
        """Memory snapshot ``name`` as ``snapshot_memory`` made it (``UnknownSnapshot`` if
        there is none): its size on disk and the spec its restores take."""
        return self._call("memory_snapshot", snapshot=name)

    def remove_memory_snapshot(self, name: str) -> None:
        self._call("remove_memory_snapshot", snapshot=name)

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
        ref = _snapshot_ref(snapshot)
        # the node replaces the layers; a spec needs some to be valid
        body = RestoreRequest(ref, n, _spec(spec, {"layers": (ref,), **kw}))
        return [Sandbox(self, i) for i in self._call("restore", body).sandboxes]

    def prefetch(self, refs: Sequence[str]) -> builtins.list[dict[str, Any]]:
        """Warm layers on the node (all chunks of on-demand layers); returns what was fetched."""
        body = PrefetchRequest(refs)  # type: ignore[arg-type]
        return [row.to_dict() for row in self._call("prefetch", body).layers]

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
        body = FnCallRequest(
            environment,
            cmd,  # type: ignore[arg-type]
            script,
            stdin,  # type: ignore[arg-type]
            files,  # type: ignore[arg-type]
            timeout,
            max_output,
            env,
            backend,
            cpu,
            memory,
            devices,  # type: ignore[arg-type]
        )
        return self._call("fncall", body)

    def judge(
        self, environment: str | JudgeSpec, run: str | Sequence[str] | None = None, **kw: Any
    ) -> JudgeResult:
        """Judge a submission in a warm member of the environment's FnCall pool: ``files``
        written, ``compile`` run once, then ``run`` on each of ``cases`` (``JudgeCase``) or
        of ``cases_dir``'s NAME.in/NAME.out, each with ``time_limit`` CPU seconds and
        ``memory_limit``; a verdict per case (AC, WA, TLE, MLE, RE) and for the whole (or CE).
        Takes a ``JudgeSpec``, or its fields as arguments."""
        return self._call("judge", _judge_spec(environment, run, kw))

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
        """Run ``cmd`` in the sandbox. Processes it leaves running are killed when it exits,
        unless ``background``; ``exclusive`` first kills every other process in the sandbox
        (sessions, background jobs, other calls), which is how a verifier should run.
        ``trajectory``: log it as ``step`` (default: the next) of that trajectory log; a
        step logged already comes back from the log (``replayed``) without running."""
        body = ExecRequest(
            cmd,  # type: ignore[arg-type]
            timeout,
            cwd,
            env,
            stdin,  # type: ignore[arg-type]
            max_output,
            background,
            exclusive,
            trajectory,
            step,
        )
        return self._call("exec", body, sid=sandbox_id)

    def exec_stream(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        **kw: Any,
    ) -> Iterator[ExecOutput | ExecResult]:
        """``exec``, with the output as it comes: ``ExecOutput`` pieces (``stream`` "stdout"
        or "stderr", ``data``), then the ``ExecResult`` (its stdout and stderr empty). Takes
        ``exec``'s arguments but ``trajectory``. Leaving the loop early kills the command."""
        route, target, content = _stream_request(sandbox_id, cmd, timeout, kw)
        try:
            r = self._http.stream(
                "POST", target, body=content, content_type=JSON, timeout=STREAM_START_TIMEOUT
            )
        except TransportError as e:
            raise NodeUnavailable(f"the node did not answer: {e}", address=self.address) from e
        with r:
            if r.status_code >= 300:
                _answer(route, Response(r.status_code, r.read(), r.headers))
            lines = _ExecLines()
            try:
                for piece in r:
                    yield from lines.feed(piece)
                    if lines.done:
                        return
            except TransportError as e:
                raise NodeUnavailable(f"the exec stream broke: {e}", address=self.address) from e
            raise lines.end()

    def set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        """Let the sandbox live ``ttl`` more seconds from now (None: until killed)."""
        return self._call("set_ttl", TtlRequest(ttl), sid=sandbox_id)

    def probe(self) -> Any:
        """What the control plane's watcher sees of the node (``NodeProbe``)."""
        return self._call("probe")

    def session_open(
        self, sandbox_id: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> Session:
        opened = self._call("session_open", SessionOpenRequest(cwd, env), sid=sandbox_id)
        return Session(self, sandbox_id, opened.session)

    def sessions(self, sandbox_id: str) -> builtins.list[str]:
        return list(self._call("sessions", sid=sandbox_id).sessions)

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
        body = SessionExecRequest(cmd, timeout, stdin, max_output)  # type: ignore[arg-type]
        return self._call("session_exec", body, sid=sandbox_id, ses=session_id)

    def session_close(self, sandbox_id: str, session_id: str) -> None:
        self._call("session_close", sid=sandbox_id, ses=session_id)

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        out = bytearray()
        while True:
            piece = self._call("read_file", query=ReadQuery(path, len(out), CHUNK), sid=sandbox_id)
            out += piece
            if len(piece) < CHUNK:
                return bytes(out)

    def write_file(
        self, sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None:
        octal = _octal(mode)
        for off, piece in _write_chunks(_data(data)):
            self._call("write_file", piece, WriteQuery(path, octal, off, off == 0), sid=sandbox_id)

    def upload(
        self, sandbox_id: str, local: str | os.PathLike, remote: str, *, mode: int | None = None
    ) -> None:
        local = _local(local)
        octal = _octal(_upload_mode(local, mode))
        for off, piece in _file_chunks(local):
            self._call(
                "write_file", piece, WriteQuery(remote, octal, off, off == 0), sid=sandbox_id
            )

    def download(self, sandbox_id: str, remote: str, local: str | os.PathLike) -> None:
        """Copy a file out of the sandbox piece by piece, never holding all of it. The local
        file is opened once the first piece came (a bad remote path leaves it as it was)."""
        where = _local(local)
        piece = self._call("read_file", query=ReadQuery(remote, 0, CHUNK), sid=sandbox_id)
        with open(where, "wb") as f:
            off = 0
            while True:
                f.write(piece)
                off += len(piece)
                if len(piece) < CHUNK:
                    return
                piece = self._call("read_file", query=ReadQuery(remote, off, CHUNK), sid=sandbox_id)

    def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return list(self._call("list_dir", query=FileQuery(path), sid=sandbox_id).entries)

    def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return self._call("stat", query=FileQuery(path), sid=sandbox_id)

    def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        self._call("remove", query=RemoveQuery(path, recursive), sid=sandbox_id)

    def screenshot(self, sandbox_id: str) -> bytes:
        """The sandbox's display now, as PNG bytes (a backend with a screen: ``vm``)."""
        return self._call("screenshot", sid=sandbox_id)

    def input(self, sandbox_id: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send input to the sandbox's display in order: records (``dsec_core.inputs``:
        ``Key("a")``, ``Move(x, y)``, ``Click(x, y)``) or their dicts (``{"type": "click",
        "x": 200, "y": 140}``); returns how many were sent."""
        return self._call("input", _input_request(events), sid=sandbox_id).sent


class AsyncClient:
    """Asyncio client of a dsec node; the same methods as ``Client``, awaited."""

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
        retry = _retry_timeout(retry)
        token = _api_key(token, api_key)
        where, token = _resolve(address, token, autostart)
        self.address = str(where)
        self._http = AsyncHTTPTransport(where, token=token, verify=verify, retry=retry)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, name: str, body: Any = None, query: Any = None, **params: str) -> Any:
        route = ROUTES[name]
        target, content = route.target(params, query), route.encode_body(body)
        try:
            r = await self._http.request(
                route.method,
                target,
                body=content,
                content_type=route.body_type,
                timeout=_timeout(route, body),
                idempotent=bool(route.idempotent),
            )
        except TransportError as e:
            raise _transport_error(route, body, e, self.address) from e
        return _answer(route, r)

    async def node_info(self) -> dict[str, Any]:
        return (await self._call("node_info")).to_dict()

    async def create(self, spec: SandboxSpec | None = None, **kw: Any) -> AsyncSandbox:
        made = await self._call("create", CreateRequest(_spec(spec, kw)))
        return AsyncSandbox(self, made.sandboxes[0])

    async def create_many(
        self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any
    ) -> list[AsyncSandbox]:
        made = await self._call("create", CreateRequest(_spec(spec, kw), n))
        if made.errors:
            await asyncio.gather(*(self.kill(i.id) for i in made.sandboxes), return_exceptions=True)
            raise error_from_wire(made.errors[0].to_dict())
        return [AsyncSandbox(self, i) for i in made.sandboxes]

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self, await self._call("get", sid=sandbox_id))

    async def list(self) -> builtins.list[SandboxInfo]:
        return list((await self._call("list")).sandboxes)

    async def kill(self, sandbox_id: str) -> None:
        await self._call("kill", sid=sandbox_id)

    def group(self, name: str) -> AsyncGroup:
        """``Client.group``, for asyncio: a group's sandboxes are handled at once."""
        return AsyncGroup(self, name)

    async def usage(self, sandbox_id: str) -> SandboxUsage:
        return await self._call("usage", sid=sandbox_id)

    async def pause(
        self, sandboxes: str | Sequence[str] | AsyncGroup, *, reclaim: bool = False
    ) -> Any:
        """``Client.pause``, awaited; a group's sandboxes are paused at once."""
        if isinstance(sandboxes, AsyncGroup):
            return await sandboxes.pause(reclaim=reclaim)
        q = PauseQuery(reclaim)
        if isinstance(sandboxes, str):
            return await self._call("pause", query=q, sid=sandboxes)
        return list(await asyncio.gather(*(self._call("pause", query=q, sid=s) for s in sandboxes)))

    async def resume(self, sandboxes: str | Sequence[str] | AsyncGroup) -> Any:
        """``Client.resume``, awaited; a group's sandboxes are resumed at once."""
        if isinstance(sandboxes, AsyncGroup):
            return await sandboxes.resume()
        if isinstance(sandboxes, str):
            return await self._call("resume", sid=sandboxes)
        return list(await asyncio.gather(*(self._call("resume", sid=s) for s in sandboxes)))

    async def events(self, sandbox_id: str) -> builtins.list[InfraEvent]:
        return list((await self._call("events", sid=sandbox_id)).events)

    async def lease(
        self,
        sandboxes: str | Sequence[str],
        *,
        ttl: float = 10.0,
        holder: str = "",
        reclaim: bool = False,
        renew: bool = True,
    ) -> AsyncLease:
        """``Client.lease``; renewed by a task of the running loop."""
        ids = [sandboxes] if isinstance(sandboxes, str) else list(sandboxes)
        info = await self._call("lease", LeaseRequest(tuple(ids), ttl, holder, reclaim))
        return AsyncLease(self, info, renew=renew)

    async def lease_get(self, lease_id: str) -> LeaseInfo:
        return await self._call("lease_get", lease=lease_id)

    async def lease_renew(self, lease_id: str) -> LeaseInfo:
        return await self._call("lease_renew", lease=lease_id)

    async def lease_release(self, lease_id: str, *, kill: bool = False) -> LeaseInfo:
        return await self._call("lease_release", query=ReleaseQuery(kill), lease=lease_id)

    async def trajectory(self, name: str) -> builtins.list[TrajectoryEntry]:
        return list(
            (await self._call("trajectory", trajectory=check_trajectory_name(name))).entries
        )

    async def remove_trajectory(self, name: str) -> None:
        await self._call("remove_trajectory", trajectory=check_trajectory_name(name))

    async def policies(self, sandbox_id: str) -> builtins.list[PolicyState]:
        return list((await self._call("policies", sid=sandbox_id)).policies)

    async def set_policy(
        self, sandbox_id: str, policy: str, settings: Mapping[str, Any]
    ) -> PolicyState:
        return await self._call(
            "set_policy", PolicySettings(settings), sid=sandbox_id, policy=policy
        )

    async def layers(self) -> builtins.list[LayerInfo]:
        return list((await self._call("layers")).layers)

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
        """``Client.pack_diff``, awaited."""
        body = PackDiffRequest(name, version, tuple(exclude), scrub, source, dict(secrets or {}))
        return await self._call("pack_diff", body, sid=sandbox_id)

    async def snapshot_memory(self, sandbox_id: str, name: str | None = None) -> MemorySnapshot:
        """``Client.snapshot_memory``, awaited."""
        return await self._call("snapshot_memory", MemorySnapshotRequest(name), sid=sandbox_id)

    async def memory_snapshot(self, name: str) -> MemorySnapshot:
        """``Client.memory_snapshot``, awaited."""
        return await self._call("memory_snapshot", snapshot=name)

    async def remove_memory_snapshot(self, name: str) -> None:
        await self._call("remove_memory_snapshot", snapshot=name)

    async def restore(
        self,
        snapshot: str | LayerInfo | MemorySnapshot,
        n: int = 1,
        spec: SandboxSpec | None = None,
        **kw: Any,
    ) -> builtins.list[AsyncSandbox]:
        """``Client.restore``, awaited."""
        ref = _snapshot_ref(snapshot)
        # the node replaces the layers; a spec needs some to be valid
        body = RestoreRequest(ref, n, _spec(spec, {"layers": (ref,), **kw}))
        return [AsyncSandbox(self, i) for i in (await self._call("restore", body)).sandboxes]

    async def prefetch(self, refs: Sequence[str]) -> builtins.list[dict[str, Any]]:
        body = PrefetchRequest(refs)  # type: ignore[arg-type]
        made = await self._call("prefetch", body)
        return [row.to_dict() for row in made.layers]

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
        body = FnCallRequest(
            environment,
            cmd,  # type: ignore[arg-type]
            script,
            stdin,  # type: ignore[arg-type]
            files,  # type: ignore[arg-type]
            timeout,
            max_output,
            env,
            backend,
            cpu,
            memory,
            devices,  # type: ignore[arg-type]
        )
        return await self._call("fncall", body)

    async def judge(
        self, environment: str | JudgeSpec, run: str | Sequence[str] | None = None, **kw: Any
    ) -> JudgeResult:
        """``Client.judge``, awaited."""
        return await self._call("judge", _judge_spec(environment, run, kw))

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
        """Run ``cmd`` in the sandbox. Processes it leaves running are killed when it exits,
        unless ``background``; ``exclusive`` first kills every other process in the sandbox
        (sessions, background jobs, other calls), which is how a verifier should run.
        ``trajectory``: log it as ``step`` (default: the next) of that trajectory log; a
        step logged already comes back from the log (``replayed``) without running."""
        body = ExecRequest(
            cmd,  # type: ignore[arg-type]
            timeout,
            cwd,
            env,
            stdin,  # type: ignore[arg-type]
            max_output,
            background,
            exclusive,
            trajectory,
            step,
        )
        return await self._call("exec", body, sid=sandbox_id)

    async def exec_stream(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        **kw: Any,
    ) -> AsyncIterator[ExecOutput | ExecResult]:
        """The asyncio twin of ``Client.exec_stream``: an async iterator."""
        route, target, content = _stream_request(sandbox_id, cmd, timeout, kw)
        try:
            r = await self._http.stream(
                "POST", target, body=content, content_type=JSON, timeout=STREAM_START_TIMEOUT
            )
        except TransportError as e:
            raise NodeUnavailable(f"the node did not answer: {e}", address=self.address) from e
        return _aexec_lines(route, r, self.address)

    async def set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        return await self._call("set_ttl", TtlRequest(ttl), sid=sandbox_id)

    async def probe(self) -> Any:
        return await self._call("probe")

    async def session_open(
        self, sandbox_id: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> AsyncSession:
        opened = await self._call("session_open", SessionOpenRequest(cwd, env), sid=sandbox_id)
        return AsyncSession(self, sandbox_id, opened.session)

    async def sessions(self, sandbox_id: str) -> builtins.list[str]:
        return list((await self._call("sessions", sid=sandbox_id)).sessions)

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
        body = SessionExecRequest(cmd, timeout, stdin, max_output)  # type: ignore[arg-type]
        return await self._call("session_exec", body, sid=sandbox_id, ses=session_id)

    async def session_close(self, sandbox_id: str, session_id: str) -> None:
        await self._call("session_close", sid=sandbox_id, ses=session_id)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        out = bytearray()
        while True:
            piece = await self._call(
                "read_file", query=ReadQuery(path, len(out), CHUNK), sid=sandbox_id
            )
            out += piece
            if len(piece) < CHUNK:
                return bytes(out)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None:
        octal = _octal(mode)
        for off, piece in _write_chunks(_data(data)):
            await self._call(
                "write_file", piece, WriteQuery(path, octal, off, off == 0), sid=sandbox_id
            )

    async def upload(
        self, sandbox_id: str, local: str | os.PathLike, remote: str, *, mode: int | None = None
    ) -> None:
        local = _local(local)
        octal = _octal(await asyncio.to_thread(_upload_mode, local, mode))
        pieces = _file_chunks(local)
        try:
            while (next_piece := await asyncio.to_thread(next, pieces, None)) is not None:
                off, piece = next_piece
                await self._call(
                    "write_file", piece, WriteQuery(remote, octal, off, off == 0), sid=sandbox_id
                )
        finally:
            pieces.close()

    async def download(self, sandbox_id: str, remote: str, local: str | os.PathLike) -> None:
        """Copy a file out of the sandbox piece by piece, never holding all of it. The local
        file is opened once the first piece came (a bad remote path leaves it as it was)."""
        where = _local(local)
        piece = await self._call("read_file", query=ReadQuery(remote, 0, CHUNK), sid=sandbox_id)
        f = await asyncio.to_thread(open, where, "wb")
        try:
            off = 0
            while True:
                await asyncio.to_thread(f.write, piece)
                off += len(piece)
                if len(piece) < CHUNK:
                    return
                piece = await self._call(
                    "read_file", query=ReadQuery(remote, off, CHUNK), sid=sandbox_id
                )
        finally:
            f.close()

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return list((await self._call("list_dir", query=FileQuery(path), sid=sandbox_id)).entries)

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return await self._call("stat", query=FileQuery(path), sid=sandbox_id)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        await self._call("remove", query=RemoveQuery(path, recursive), sid=sandbox_id)

    async def screenshot(self, sandbox_id: str) -> bytes:
        """The sandbox's display now, as PNG bytes (a backend with a screen: ``vm``)."""
        return await self._call("screenshot", sid=sandbox_id)

    async def input(self, sandbox_id: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send input to the sandbox's display in order (see ``Client.input``)."""
        return (await self._call("input", _input_request(events), sid=sandbox_id)).sent


# --- handles: a sandbox or session bound to its client -------------------------------------

_SANDBOX_METHODS = (
    "exec",
    "exec_stream",
    "set_ttl",
    "pause",
    "resume",
    "session_open",
    "sessions",
    "read_file",
    "write_file",
    "upload",
    "download",
    "list_dir",
    "stat",
    "remove",
    "screenshot",
    "input",
    "usage",
    "policies",
    "set_policy",
    "pack_diff",
    "snapshot_memory",
    "kill",
)


class _Bound:
    def __init__(self, client: Any, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        self.id = info.id

    def __getattr__(self, name: str) -> Any:
        if name in _SANDBOX_METHODS:
            method = getattr(self.client, name)
            return lambda *a, **kw: method(self.id, *a, **kw)
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.info.state}>"


class Sandbox(_Bound):
    """A sandbox handle: ``sb.exec(...)``, ``sb.read_file(...)``, ``sb.kill()``; a context
    manager that kills the sandbox on exit."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.client.kill(self.id)
        except DsecError:
            pass

    def session(self, **kw: Any) -> Session:
        return self.client.session_open(self.id, **kw)

    def refresh(self) -> SandboxInfo:
        self.info = self.client._call("get", sid=self.id)
        return self.info


class AsyncSandbox(_Bound):
    """The asyncio twin of ``Sandbox`` (``async with`` kills it on exit)."""

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.client.kill(self.id)
        except DsecError:
            pass

    async def session(self, **kw: Any) -> AsyncSession:
        return await self.client.session_open(self.id, **kw)

    async def refresh(self) -> SandboxInfo:
        self.info = await self.client._call("get", sid=self.id)
        return self.info


class Session:
    """A persistent shell in a sandbox: cwd, env and shell variables carry over."""

    def __init__(self, client: Client, sandbox_id: str, session_id: str) -> None:
        self.client, self.sandbox_id, self.id = client, sandbox_id, session_id

    def exec(self, cmd: str, **kw: Any) -> ExecResult:
        return self.client.session_exec(self.sandbox_id, self.id, cmd, **kw)

    def close(self) -> None:
        self.client.session_close(self.sandbox_id, self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        except DsecError:
            pass


class AsyncSession:
    """The asyncio twin of ``Session``."""

    def __init__(self, client: AsyncClient, sandbox_id: str, session_id: str) -> None:
        self.client, self.sandbox_id, self.id = client, sandbox_id, session_id

    async def exec(self, cmd: str, **kw: Any) -> ExecResult:
        return await self.client.session_exec(self.sandbox_id, self.id, cmd, **kw)

    async def close(self) -> None:
        await self.client.session_close(self.sandbox_id, self.id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.close()
        except DsecError:
            pass


# --- rollout groups ----------------------------------------------------------------------------


def _group_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "\0" in name:
        raise InvalidSpec(f"a group name is a non-empty string, got {name!r}", field="group")
    return name


def _in_group(spec: SandboxSpec | None, kw: dict[str, Any], name: str) -> SandboxSpec:
    """The spec, labelled as a member of group ``name``."""
    spec = _spec(spec, kw)
    return dataclasses.replace(spec, labels={**spec.labels, GROUP_LABEL: name})


def _fork_source(source: Any, snapshot: Any) -> str | None:
    """The id of the member a fork packs; None when it restores ``snapshot``."""
    if (source is None) == (snapshot is None):
        raise InvalidSpec("fork takes a source member or a snapshot, one of them", field="source")
    sid = source.id if isinstance(source, _Bound) else source
    if sid is not None and (not isinstance(sid, str) or not sid):
        raise InvalidSpec(f"a fork source is a sandbox id or handle, got {sid!r}", field="source")
    return sid


def _fork_spec(
    name: str, layers: tuple[str, ...], spec: SandboxSpec | None, kw: dict[str, Any]
) -> SandboxSpec:
    """The restore spec of a fork, labelled into group ``name`` and checked before anything is
    packed; ``layers`` only make it valid, the node replaces them by the snapshot's."""
    return _in_group(spec, {"layers": layers, **kw}, name)


def _check_member(name: str, info: SandboxInfo) -> None:
    if info.labels.get(GROUP_LABEL) != name:
        raise InvalidSpec(
            f"sandbox {info.id} is not a member of group {name!r}; a group forks its own",
            field="source",
            sandbox_id=info.id,
        )


class Group:
    """A rollout group: sandboxes created, paused, resumed and killed together, found again by
    name from any process (see ``Client.group``)."""

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = _group_name(name)

    def __repr__(self) -> str:
        return f"<Group {self.name}>"

    def create(self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any) -> list[Sandbox]:
        """``n`` new members (all or none), labelled into the group."""
        return self.client.create_many(_in_group(spec, kw, self.name), n)

    def fork(
        self,
        source: str | Sandbox | None = None,
        n: int = 1,
        *,
        snapshot: str | LayerInfo | None = None,
        spec: SandboxSpec | None = None,
        **kw: Any,
    ) -> list[Sandbox]:
        """``n`` new members that each start from member ``source``'s state now (packed with
        ``pack_diff``, then ``restore``), each with its own writable layer; or from an
        earlier ``snapshot`` instead. ``spec`` (or its fields) goes to ``Client.restore``.
        ``InvalidSpec`` if ``source`` is not a member of this group."""
        sid = _fork_source(source, snapshot)
        if sid is None:
            ref = snapshot.ref if isinstance(snapshot, LayerInfo) else str(snapshot)
            return self.client.restore(ref, n, _fork_spec(self.name, (ref,), spec, kw))
        info = self.client.get(sid).info
        _check_member(self.name, info)
        restore_spec = _fork_spec(self.name, info.layers, spec, kw)
        return self.client.restore(self.client.pack_diff(sid), n, restore_spec)

    def members(self) -> list[SandboxInfo]:
        """The group's sandboxes on the node now, oldest first."""
        found = [i for i in self.client.list() if i.labels.get(GROUP_LABEL) == self.name]
        return sorted(found, key=lambda i: i.created)

    def sandboxes(self) -> list[Sandbox]:
        return [Sandbox(self.client, i) for i in self.members()]

    def lease(self, *, ttl: float = 10.0, holder: str = "", reclaim: bool = False) -> Lease:
        """A lease on every member now (``Client.lease``): they pause if this process stops
        renewing it, and a new trainer's lease on the group resumes them."""
        ids = [i.id for i in self.members()]
        return self.client.lease(ids, ttl=ttl, holder=holder or self.name, reclaim=reclaim)

    def pause(self, *, reclaim: bool = False) -> list[SandboxInfo]:
        """Pause every member that runs (see ``Client.pause``)."""
        live = [i.id for i in self.members() if i.state == "running"]
        return list(self.client.pause(live, reclaim=reclaim))

    def resume(self) -> list[SandboxInfo]:
        """Resume every paused member."""
        return list(self.client.resume([i.id for i in self.members() if i.state == "paused"]))

    def kill(self) -> int:
        """Kill every member; returns how many there were."""
        members = self.members()
        for info in members:
            with _gone_ok():
                self.client.kill(info.id)
        return len(members)


class AsyncGroup:
    """``Group`` for ``AsyncClient``: members are paused, resumed and killed at once."""

    def __init__(self, client: AsyncClient, name: str) -> None:
        self.client = client
        self.name = _group_name(name)

    def __repr__(self) -> str:
        return f"<AsyncGroup {self.name}>"

    async def create(
        self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any
    ) -> list[AsyncSandbox]:
        return await self.client.create_many(_in_group(spec, kw, self.name), n)

    async def fork(
        self,
        source: str | AsyncSandbox | None = None,
        n: int = 1,
        *,
        snapshot: str | LayerInfo | None = None,
        spec: SandboxSpec | None = None,
        **kw: Any,
    ) -> list[AsyncSandbox]:
        """``Group.fork``, awaited."""
        sid = _fork_source(source, snapshot)
        if sid is None:
            ref = snapshot.ref if isinstance(snapshot, LayerInfo) else str(snapshot)
            return await self.client.restore(ref, n, _fork_spec(self.name, (ref,), spec, kw))
        info = (await self.client.get(sid)).info
        _check_member(self.name, info)
        restore_spec = _fork_spec(self.name, info.layers, spec, kw)
        return await self.client.restore(await self.client.pack_diff(sid), n, restore_spec)

    async def members(self) -> list[SandboxInfo]:
        found = [i for i in await self.client.list() if i.labels.get(GROUP_LABEL) == self.name]
        return sorted(found, key=lambda i: i.created)

    async def sandboxes(self) -> list[AsyncSandbox]:
        return [AsyncSandbox(self.client, i) for i in await self.members()]

    async def lease(
        self, *, ttl: float = 10.0, holder: str = "", reclaim: bool = False
    ) -> AsyncLease:
        ids = [i.id for i in await self.members()]
        return await self.client.lease(ids, ttl=ttl, holder=holder or self.name, reclaim=reclaim)

    async def pause(self, *, reclaim: bool = False) -> list[SandboxInfo]:
        live = [i.id for i in await self.members() if i.state == "running"]
        return list(await self.client.pause(live, reclaim=reclaim))

    async def resume(self) -> list[SandboxInfo]:
        paused = [i.id for i in await self.members() if i.state == "paused"]
        return list(await self.client.resume(paused))

    async def kill(self) -> int:
        members = await self.members()

        async def one(sid: str) -> None:
            with _gone_ok():
                await self.client.kill(sid)

        await asyncio.gather(*(one(i.id) for i in members))
        return len(members)


@contextlib.contextmanager
def _gone_ok() -> Iterator[None]:
    """A member that went away meanwhile (its TTL, another process's kill) is no error."""
    try:
        yield
    except UnknownSandbox:
        pass


# --- trainer leases ----------------------------------------------------------------------------


def _lease_again(info: LeaseInfo) -> LeaseRequest:
    """The request that takes ``info``'s lease again, as it was asked for."""
    return LeaseRequest(info.sandboxes, info.ttl, info.holder, info.reclaim)


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
        return self.info.id

    def __repr__(self) -> str:
        return f"<Lease {self.info.id} on {', '.join(self.info.sandboxes)}: {self.info.state}>"

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def renew(self) -> LeaseInfo:
        """Renew now (a lapsed lease is held again, and what its lapse paused resumes)."""
        try:
            self.info = self.client.lease_renew(self.info.id)
        except UnknownLease:  # a restarted node forgot it: the same lease again
            self.info = self.client._call("lease", _lease_again(self.info))
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
        with contextlib.suppress(UnknownLease):
            self.info = self.client.lease_release(self.info.id, kill=kill)


class AsyncLease:
    """``Lease`` for ``AsyncClient``: renewed by a task of the event loop."""

    def __init__(self, client: AsyncClient, info: LeaseInfo, renew: bool = True) -> None:
        self.client = client
        self.info = info
        self._task = asyncio.get_running_loop().create_task(self._renewing()) if renew else None

    @property
    def id(self) -> str:
        return self.info.id

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()

    async def renew(self) -> LeaseInfo:
        try:
            self.info = await self.client.lease_renew(self.info.id)
        except UnknownLease:  # a restarted node forgot it: the same lease again
            self.info = await self.client._call("lease", _lease_again(self.info))
        return self.info

    async def _renewing(self) -> None:
        while True:
            await asyncio.sleep(self.info.ttl / 3)
            try:
                await self.renew()
            except DsecError as e:
                log.warning("renewing lease %s: %s", self.info.id, e)

    async def release(self, *, kill: bool = False) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(UnknownLease):
            self.info = await self.client.lease_release(self.info.id, kill=kill)
