"""The SDK's sans-I/O core: every operation of ``Client`` and ``AsyncClient``, written once.

An operation is a generator that yields effects and returns the typed result: a request to send
(``Call``: its route, target, body bytes, how long to wait, how to read the answer and map its
errors), several requests that may go at once (``Batch``), or a piece of local blocking work
(``Blocking``: a file's next piece). A client runs an operation by doing each effect on its
transport and sending the outcome back in (a failure is thrown in, so an operation can handle
one: a lease the node forgot, a member already gone). Multi-step operations (chunked reads and
writes, create-many's cleanup, forks, leases taken again) are then one piece of code, and the
two clients differ only in how they wait: blocking, or awaited with ``asyncio.gather`` and
threads, as httpx's clients do over h11.

Arguments are checked here against the same decoders the node runs, so a bad one is an
``InvalidSpec`` naming it before anything is sent.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any, TypeAlias, TypeVar

from ..api.messages import (
    DEFAULT_MAX_OUTPUT,
    CreateRequest,
    ExecRequest,
    FileQuery,
    FnCallRequest,
    InputRequest,
    LeaseRequest,
    MemorySnapshotRequest,
    NodeProbe,
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
from ..api.routes import JSON, ROUTES, Route, dump_json
from ..api.transport import Response, TransportError, TransportTimeout
from ..errors import (
    DsecError,
    ExecTimeout,
    InvalidSpec,
    NodeUnavailable,
    UnknownLease,
    UnknownSandbox,
    error_from_wire,
)
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
    check_trajectory_name,
)
from ..screen_input import InputEvent, input_dicts

#: The label that makes a sandbox a member of a rollout group (``Client.group``).
GROUP_LABEL = "dsec.group"

CHUNK = 8 << 20  # file transfers move in pieces of this size
EXEC_GRACE = 30.0  # past an exec's own timeout, how long a client waits for the node's answer
#: How long a client waits for a streamed exec's answer to begin (its lines come as they may)
STREAM_START_TIMEOUT = 60.0

T = TypeVar("T")

# --- effects: what an operation asks its client to do ----------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One request of an operation, and how its answer is read."""

    route: Route
    target: str
    content: bytes | None
    #: How long to wait for the answer (None: as long as it takes).
    timeout: float | None
    #: The command's own timeout, on routes it bounds (exec, fncall): running out of ``timeout``
    #: then means the command timed out (``ExecTimeout``), not that the node went away.
    command_timeout: float | None = None
    #: Errors that are this call's answer rather than its failure (a member gone meanwhile):
    #: the error is returned, not raised.
    tolerate: tuple[type[DsecError], ...] = ()

    @property
    def idempotent(self) -> bool:
        return bool(self.route.idempotent)

    def answer(self, r: Response) -> Any:
        """The typed answer of a response, or the typed error the node sent."""
        try:
            return _answer(self.route, r)
        except self.tolerate as e:
            return e

    def unreachable(self, e: TransportError, address: str) -> Any:
        """Raise what a transport failure means for this call (unless tolerated)."""
        if isinstance(e, TransportTimeout) and self.route.exec_timeout:
            error: DsecError = ExecTimeout(
                f"no answer from the node within {self.command_timeout}s + {EXEC_GRACE}s",
                timeout=self.command_timeout,
            )
        else:
            error = NodeUnavailable(f"the node did not answer: {e}", address=address)
        if isinstance(error, self.tolerate):
            return error
        raise error from e


@dataclass(frozen=True, slots=True)
class Batch:
    """Requests independent of each other: an async client sends them at once, a blocking one
    in turn. The outcome is their answers in order; the first failure is raised."""

    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class Blocking:
    """Local work that blocks (a file's open, read, write): an async client runs it in a
    thread so the event loop goes on."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


Effect: TypeAlias = Call | Batch | Blocking
#: An operation: yields effects, is sent their outcomes, returns its result.
Op: TypeAlias = Generator[Effect, Any, T]


def call(
    name: str,
    body: Any = None,
    query: Any = None,
    *,
    tolerate: tuple[type[DsecError], ...] = (),
    **params: str,
) -> Call:
    """The ``Call`` of route ``name``: its path parameters filled, its query and body encoded
    and checked as the node would (``InvalidSpec`` naming the field before anything is sent)."""
    route = ROUTES[name]
    target, content = route.target(params, query), route.encode_body(body)
    timeout, command = route.timeout, None
    if route.exec_timeout:  # the command's own timeout plus time for the node to answer
        command = body.timeout
        timeout = None if command is None else command + EXEC_GRACE
    return Call(route, target, content, timeout, command, tolerate)


def _answer(route: Route, r: Response) -> Any:
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


# --- arguments ---------------------------------------------------------------------------------

_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(SandboxSpec))
_JUDGE_FIELDS = frozenset(f.name for f in dataclasses.fields(JudgeSpec))


def sandbox_spec(spec: SandboxSpec | None, kw: Mapping[str, Any]) -> SandboxSpec:
    """``spec``, with the fields in ``kw`` set (``InvalidSpec`` for a field it has not)."""
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


def _judge_spec(
    environment: str | JudgeSpec, run: str | Sequence[str] | None, kw: Mapping[str, Any]
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


def _snapshot_ref(snapshot: str | LayerInfo | MemorySnapshot) -> str:
    """What ``restore`` names: a snapshot layer's ref or a memory snapshot's name."""
    if isinstance(snapshot, LayerInfo):
        return snapshot.ref
    if isinstance(snapshot, MemorySnapshot):
        return snapshot.name
    return snapshot


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
    if not S_ISREG(st.st_mode):
        raise InvalidSpec(f"local: {local} is not a regular file", field="local")
    # The sticky bit means nothing on a file and WriteQuery refuses it: leave it behind.
    return mode if mode is not None else st.st_mode & 0o6777


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


def _ids(sandboxes: str | Sequence[str]) -> list[str]:
    return [sandboxes] if isinstance(sandboxes, str) else list(sandboxes)


# --- the node and its sandboxes ---------------------------------------------------------------


def node_info() -> Op[dict[str, Any]]:
    status = yield call("node_info")
    return status.to_dict()


def probe() -> Op[NodeProbe]:
    return (yield call("probe"))


def create(spec: SandboxSpec | None = None, **kw: Any) -> Op[SandboxInfo]:
    made = yield call("create", CreateRequest(sandbox_spec(spec, kw)))
    return made.sandboxes[0]


def create_many(spec: SandboxSpec | None = None, n: int = 1, **kw: Any) -> Op[list[SandboxInfo]]:
    """All or nothing: the sandboxes made are killed if any could not be, and the first error
    is raised (a failure to kill one of them is not: that error says more)."""
    made = yield call("create", CreateRequest(sandbox_spec(spec, kw), n))
    if made.errors:
        yield Batch(tuple(call("kill", sid=i.id, tolerate=(DsecError,)) for i in made.sandboxes))
        raise error_from_wire(made.errors[0].to_dict())
    return list(made.sandboxes)


def get(sandbox_id: str) -> Op[SandboxInfo]:
    return (yield call("get", sid=sandbox_id))


def list_sandboxes() -> Op[list[SandboxInfo]]:
    return list((yield call("list")).sandboxes)


def kill(sandbox_id: str) -> Op[None]:
    yield call("kill", sid=sandbox_id)


def kill_quietly(sandbox_id: str) -> Op[None]:
    """Kill, whatever went wrong (a handle leaving its ``with``: the sandbox may be gone)."""
    yield call("kill", sid=sandbox_id, tolerate=(DsecError,))


def usage(sandbox_id: str) -> Op[SandboxUsage]:
    return (yield call("usage", sid=sandbox_id))


def pause(sandboxes: str | Sequence[str], *, reclaim: bool = False) -> Op[Any]:
    """One sandbox's ``SandboxInfo`` (an id), or a list (a list of ids)."""
    q = PauseQuery(reclaim)
    if isinstance(sandboxes, str):
        return (yield call("pause", query=q, sid=sandboxes))
    return (yield Batch(tuple(call("pause", query=q, sid=sid) for sid in sandboxes)))


def resume(sandboxes: str | Sequence[str]) -> Op[Any]:
    """One sandbox's ``SandboxInfo`` (an id), or a list (a list of ids)."""
    if isinstance(sandboxes, str):
        return (yield call("resume", sid=sandboxes))
    return (yield Batch(tuple(call("resume", sid=sid) for sid in sandboxes)))


def events(sandbox_id: str) -> Op[list[InfraEvent]]:
    return list((yield call("events", sid=sandbox_id)).events)


def set_ttl(sandbox_id: str, ttl: float | None) -> Op[SandboxInfo]:
    return (yield call("set_ttl", TtlRequest(ttl), sid=sandbox_id))


def policies(sandbox_id: str) -> Op[list[PolicyState]]:
    return list((yield call("policies", sid=sandbox_id)).policies)


def set_policy(sandbox_id: str, policy: str, settings: Mapping[str, Any]) -> Op[PolicyState]:
    return (yield call("set_policy", PolicySettings(settings), sid=sandbox_id, policy=policy))


# --- leases and trajectories ------------------------------------------------------------------


def lease(
    sandboxes: str | Sequence[str], *, ttl: float = 10.0, holder: str = "", reclaim: bool = False
) -> Op[LeaseInfo]:
    return (yield call("lease", LeaseRequest(tuple(_ids(sandboxes)), ttl, holder, reclaim)))


def lease_get(lease_id: str) -> Op[LeaseInfo]:
    return (yield call("lease_get", lease=lease_id))


def lease_renew(lease_id: str) -> Op[LeaseInfo]:
    return (yield call("lease_renew", lease=lease_id))


def lease_release(lease_id: str, *, kill: bool = False) -> Op[LeaseInfo]:
    return (yield call("lease_release", query=ReleaseQuery(kill), lease=lease_id))


def renew_or_retake(info: LeaseInfo) -> Op[LeaseInfo]:
    """Renew a lease; if the node forgot it (a restarted daemon), the same lease again, on the
    same sandboxes, as it was asked for."""
    try:
        return (yield call("lease_renew", lease=info.id))
    except UnknownLease:
        again = LeaseRequest(info.sandboxes, info.ttl, info.holder, info.reclaim)
        return (yield call("lease", again))


def release_if_held(lease_id: str, kill: bool, info: LeaseInfo) -> Op[LeaseInfo]:
    """End a lease; one the node no longer knows is ended already (``info`` stays)."""
    try:
        return (yield call("lease_release", query=ReleaseQuery(kill), lease=lease_id))
    except UnknownLease:
        return info


def trajectory(name: str) -> Op[list[TrajectoryEntry]]:
    return list((yield call("trajectory", trajectory=check_trajectory_name(name))).entries)


def remove_trajectory(name: str) -> Op[None]:
    yield call("remove_trajectory", trajectory=check_trajectory_name(name))


# --- layers and snapshots ---------------------------------------------------------------------


def layers() -> Op[list[LayerInfo]]:
    return list((yield call("layers")).layers)


def prefetch(refs: Sequence[str]) -> Op[list[dict[str, Any]]]:
    made = yield call("prefetch", PrefetchRequest(refs))  # type: ignore[arg-type]
    return [row.to_dict() for row in made.layers]


def pack_diff(
    sandbox_id: str,
    *,
    name: str | None = None,
    version: str | None = None,
    exclude: Sequence[str] = (),
    scrub: bool = True,
    source: str | None = None,
    secrets: Mapping[str, str] | None = None,
) -> Op[LayerInfo]:
    body = PackDiffRequest(name, version, tuple(exclude), scrub, source, dict(secrets or {}))
    return (yield call("pack_diff", body, sid=sandbox_id))


def snapshot_memory(sandbox_id: str, name: str | None = None) -> Op[MemorySnapshot]:
    return (yield call("snapshot_memory", MemorySnapshotRequest(name), sid=sandbox_id))


def memory_snapshot(name: str) -> Op[MemorySnapshot]:
    return (yield call("memory_snapshot", snapshot=name))


def remove_memory_snapshot(name: str) -> Op[None]:
    yield call("remove_memory_snapshot", snapshot=name)


def restore(
    snapshot: str | LayerInfo | MemorySnapshot,
    n: int = 1,
    spec: SandboxSpec | None = None,
    **kw: Any,
) -> Op[list[SandboxInfo]]:
    ref = _snapshot_ref(snapshot)
    # the node replaces the layers; a spec needs some to be valid
    body = RestoreRequest(ref, n, sandbox_spec(spec, {"layers": (ref,), **kw}))
    return list((yield call("restore", body)).sandboxes)


# --- commands ---------------------------------------------------------------------------------


def exec(
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
) -> Op[ExecResult]:
    body = ExecRequest(
        cmd,  # type: ignore[arg-type]  # ExecRequest takes any sequence, and str stdin
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
    return (yield call("exec", body, sid=sandbox_id))


def fncall(
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
) -> Op[FnCallResult]:
    body = FnCallRequest(
        environment,
        cmd,  # type: ignore[arg-type]  # FnCallRequest takes what the SDK's callers pass
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
    return (yield call("fncall", body))


def judge(
    environment: str | JudgeSpec, run: str | Sequence[str] | None = None, **kw: Any
) -> Op[JudgeResult]:
    return (yield call("judge", _judge_spec(environment, run, kw)))


def session_open(
    sandbox_id: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None
) -> Op[str]:
    """The new session's id."""
    opened = yield call("session_open", SessionOpenRequest(cwd, env), sid=sandbox_id)
    return opened.session


def sessions(sandbox_id: str) -> Op[list[str]]:
    return list((yield call("sessions", sid=sandbox_id)).sessions)


def session_exec(
    sandbox_id: str,
    session_id: str,
    cmd: str,
    *,
    timeout: float | None = 300.0,
    stdin: bytes | str | None = None,
    max_output: int = DEFAULT_MAX_OUTPUT,
) -> Op[ExecResult]:
    body = SessionExecRequest(cmd, timeout, stdin, max_output)  # type: ignore[arg-type]
    return (yield call("session_exec", body, sid=sandbox_id, ses=session_id))


def session_close(sandbox_id: str, session_id: str) -> Op[None]:
    yield call("session_close", sid=sandbox_id, ses=session_id)


def session_close_quietly(sandbox_id: str, session_id: str) -> Op[None]:
    """Close a session, whatever went wrong (a handle leaving its ``with``)."""
    yield call("session_close", sid=sandbox_id, ses=session_id, tolerate=(DsecError,))


# --- files and the screen ---------------------------------------------------------------------


def read_file(sandbox_id: str, path: str) -> Op[bytes]:
    out = bytearray()
    while True:
        piece = yield call("read_file", query=ReadQuery(path, len(out), CHUNK), sid=sandbox_id)
        out += piece
        if len(piece) < CHUNK:
            return bytes(out)


def _write(sandbox_id: str, path: str, mode: str, off: int, piece: bytes) -> Call:
    return call("write_file", piece, WriteQuery(path, mode, off, off == 0), sid=sandbox_id)


def write_file(sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644) -> Op[None]:
    octal = _octal(mode)
    for off, piece in _write_chunks(_data(data)):
        yield _write(sandbox_id, path, octal, off, piece)


def upload(
    sandbox_id: str, local: str | os.PathLike[str], remote: str, *, mode: int | None = None
) -> Op[None]:
    """A local file's pieces, each read (in a thread, for an async client) as it is sent."""
    where = _local(local)
    octal = _octal((yield Blocking(_upload_mode, (where, mode))))
    pieces = _file_chunks(where)
    try:
        while (item := (yield Blocking(next, (pieces, None)))) is not None:
            off, piece = item
            yield _write(sandbox_id, remote, octal, off, piece)
    finally:
        pieces.close()


def download(sandbox_id: str, remote: str, local: str | os.PathLike[str]) -> Op[None]:
    """The local file is opened once the first piece came (a bad remote path leaves it as it
    was), and written piece by piece."""
    where = _local(local)
    piece = yield call("read_file", query=ReadQuery(remote, 0, CHUNK), sid=sandbox_id)
    f = yield Blocking(open, (where, "wb"))
    try:
        off = 0
        while True:
            yield Blocking(f.write, (piece,))
            off += len(piece)
            if len(piece) < CHUNK:
                return
            piece = yield call("read_file", query=ReadQuery(remote, off, CHUNK), sid=sandbox_id)
    finally:
        f.close()


def list_dir(sandbox_id: str, path: str) -> Op[list[FileEntry]]:
    return list((yield call("list_dir", query=FileQuery(path), sid=sandbox_id)).entries)


def stat(sandbox_id: str, path: str) -> Op[FileEntry]:
    return (yield call("stat", query=FileQuery(path), sid=sandbox_id))


def remove(sandbox_id: str, path: str, *, recursive: bool = False) -> Op[None]:
    yield call("remove", query=RemoveQuery(path, recursive), sid=sandbox_id)


def screenshot(sandbox_id: str) -> Op[bytes]:
    return (yield call("screenshot", sid=sandbox_id))


def input(sandbox_id: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> Op[int]:
    # checked here: InvalidSpec names the bad event before anything is sent
    body = InputRequest(tuple(input_dicts(events)))
    return (yield call("input", body, sid=sandbox_id)).sent


# --- streamed exec ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stream:
    """A streamed exec: the request, and what its answer's pieces and failures mean. A client
    opens it on its transport and feeds the pieces to ``lines()``."""

    route: Route
    target: str
    content: bytes
    timeout: float = STREAM_START_TIMEOUT
    content_type: str = JSON

    def unreachable(self, e: TransportError, address: str) -> NodeUnavailable:
        return NodeUnavailable(f"the node did not answer: {e}", address=address)

    def refused(self, r: Response) -> None:
        """Raise the typed error of an answer that is not a stream (``r.status_code`` >= 300)."""
        _answer(self.route, r)

    def broke(self, e: TransportError, address: str) -> NodeUnavailable:
        return NodeUnavailable(f"the exec stream broke: {e}", address=address)

    def lines(self) -> ExecLines:
        return ExecLines()


def exec_stream(
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
) -> Stream:
    route = ROUTES["exec_stream"]
    body = ExecRequest(
        cmd,  # type: ignore[arg-type]
        timeout,
        cwd,
        env,
        stdin,  # type: ignore[arg-type]
        max_output,
        background,
        exclusive,
    )
    target, content = route.target({"sid": sandbox_id}), route.encode_body(body)
    assert content is not None
    return Stream(route, target, content)


class ExecLines:
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


# --- rollout groups ---------------------------------------------------------------------------


class SandboxRef:
    """What a handle of a sandbox is to the core: its id and what was last seen of it."""

    def __init__(self, info: SandboxInfo) -> None:
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.info.state}>"


def group_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "\0" in name:
        raise InvalidSpec(f"a group name is a non-empty string, got {name!r}", field="group")
    return name


def _in_group(spec: SandboxSpec | None, kw: Mapping[str, Any], name: str) -> SandboxSpec:
    """The spec, labelled as a member of group ``name``."""
    spec = sandbox_spec(spec, kw)
    return dataclasses.replace(spec, labels={**spec.labels, GROUP_LABEL: name})


def group_members(name: str) -> Op[list[SandboxInfo]]:
    """The group's sandboxes on the node now, oldest first."""
    found = [i for i in (yield from list_sandboxes()) if i.labels.get(GROUP_LABEL) == name]
    return sorted(found, key=lambda i: i.created)


def group_create(
    name: str, spec: SandboxSpec | None, n: int, kw: Mapping[str, Any]
) -> Op[list[SandboxInfo]]:
    return (yield from create_many(_in_group(spec, kw, name), n))


def group_fork(
    name: str,
    source: str | SandboxRef | None,
    n: int,
    snapshot: str | LayerInfo | None,
    spec: SandboxSpec | None,
    kw: Mapping[str, Any],
) -> Op[list[SandboxInfo]]:
    """Member ``source`` packed (``pack_diff``), then ``n`` restores of it; or of ``snapshot``.
    The restore spec is labelled into the group and checked before anything is packed; the
    layers it is given only make it valid, the node replaces them by the snapshot's."""
    if (source is None) == (snapshot is None):
        raise InvalidSpec("fork takes a source member or a snapshot, one of them", field="source")
    if snapshot is not None:
        ref = snapshot.ref if isinstance(snapshot, LayerInfo) else str(snapshot)
        return (yield from restore(ref, n, _in_group(spec, {"layers": (ref,), **kw}, name)))
    sid = source.id if isinstance(source, SandboxRef) else source
    if not isinstance(sid, str) or not sid:
        raise InvalidSpec(f"a fork source is a sandbox id or handle, got {sid!r}", field="source")
    info = yield from get(sid)
    if info.labels.get(GROUP_LABEL) != name:
        raise InvalidSpec(
            f"sandbox {info.id} is not a member of group {name!r}; a group forks its own",
            field="source",
            sandbox_id=info.id,
        )
    restore_spec = _in_group(spec, {"layers": info.layers, **kw}, name)
    packed = yield from pack_diff(sid)
    return (yield from restore(packed, n, restore_spec))


def group_lease(name: str, *, ttl: float, holder: str, reclaim: bool) -> Op[LeaseInfo]:
    ids = [i.id for i in (yield from group_members(name))]
    return (yield from lease(ids, ttl=ttl, holder=holder or name, reclaim=reclaim))


def group_pause(name: str, *, reclaim: bool) -> Op[list[SandboxInfo]]:
    live = [i.id for i in (yield from group_members(name)) if i.state == "running"]
    return list((yield from pause(live, reclaim=reclaim)))


def group_resume(name: str) -> Op[list[SandboxInfo]]:
    paused = [i.id for i in (yield from group_members(name)) if i.state == "paused"]
    return list((yield from resume(paused)))


def group_kill(name: str) -> Op[int]:
    """Kill every member; one that went away meanwhile (its TTL, another process's kill) is no
    error. How many there were."""
    members = yield from group_members(name)
    yield Batch(tuple(call("kill", sid=i.id, tolerate=(UnknownSandbox,)) for i in members))
    return len(members)
