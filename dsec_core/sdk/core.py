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

Each operation's parameters, defaults and docstring are those of the methods that run it:
``methods`` makes ``Client.fncall``, ``AsyncClient.fncall`` and the handles' methods from
``fncall`` here, so its docstring speaks to their callers (of the handle a method returns, where
it makes one). Arguments are checked here against the same decoders the node runs, so a bad one
is an ``InvalidSpec`` naming it before anything is sent.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
import secrets
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any, TypeAlias, TypeVar

from ..api.iam import (
    IAM_ROUTES,
    KeyQuery,
    KeyRequest,
    MintedKey,
    ProjectQuery,
    ProjectRequest,
    ProjectsQuery,
    QuotaRequest,
    RevokeProjectQuery,
)
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
    ProcessInputRequest,
    ProcessOutputRequest,
    ProcessResizeRequest,
    ProcessSignalRequest,
    ProcessStartRequest,
    ReadQuery,
    ReleaseQuery,
    RemoveQuery,
    ResolveImageRequest,
    RestoreRequest,
    SessionExecRequest,
    SessionOpenRequest,
    TtlRequest,
    WarmSettings,
    WarmStatus,
    WarmTarget,
    WriteQuery,
)
from ..api.routes import IDEMPOTENCY_KEY, JSON, ROUTES, Route, dump_json
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
from ..iam.model import KeyInfo, Project, ProjectRevocation, Quota
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
    ProcessInfo,
    ResolvedImage,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
    TrajectoryEntry,
    check_trajectory_name,
    parse_size,
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
    #: Safe to send again after the connection broke mid-request although its route is not
    #: idempotent (a create carrying a create key).
    retry_safe: bool = False
    #: Headers of this request beyond those every request carries.
    headers: Mapping[str, str] | None = None

    @property
    def idempotent(self) -> bool:
        return bool(self.route.idempotent) or self.retry_safe

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
    route = ROUTES[name] if name in ROUTES else IAM_ROUTES[name]
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
    """What the node daemon is and holds (``NodeStatus`` as a dict): version, capacity,
    backends, layer sources, FnCall pools, devices."""
    status = yield call("node_info")
    return status.to_dict()


def probe() -> Op[NodeProbe]:
    """What the control plane's watcher sees of the node (``NodeProbe``)."""
    return (yield call("probe"))


def warm() -> Op[WarmStatus]:
    """The node's warm pools: the shapes it keeps started for creates to claim, their
    targets (from catalogs, the API, the automatic mode), members ready, claims and misses."""
    return (yield call("warm"))


def set_warm(
    targets: Sequence[WarmTarget | tuple[SandboxSpec, int]] = (),
    *,
    auto: bool | None = None,
    budget: int | str | None = None,
    window: float | None = None,
) -> Op[WarmStatus]:
    """Keep ``targets`` warm (``WarmTarget`` or ``(spec, count)``; they replace those set
    before, a catalog's ``warm:`` entries stay), and switch the automatic mode (``auto``,
    with a ``budget`` of members' memory limits such as "4G", over creates of the last
    ``window`` seconds); None leaves a setting as it is."""
    made = tuple(t if isinstance(t, WarmTarget) else WarmTarget(t[0], t[1]) for t in targets)
    size = None if budget is None else parse_size(budget, "budget")
    body = WarmSettings(targets=made, auto=auto, budget=size, window=window)
    return (yield call("set_warm", body))


def create(
    spec: SandboxSpec | None = None,
    *,
    wait: float = 0.0,
    batch: str = "",
    key: str | None = None,
    **kw: Any,
) -> Op[SandboxInfo]:
    """Create a sandbox from ``spec`` (a ``SandboxSpec``) or its fields as keywords
    (``environment="judge-fizzbuzz"``), the keywords overriding the spec's; returns its
    handle. ``InvalidSpec`` names an unknown or bad field before anything is sent.

    ``wait``: seconds the create may wait in the node's fair create queue for room (served by
    project, then by ``batch``, not first come first served) before ``AdmissionRejected``
    naming what was short; 0 (the default) is refused at once when there is no room.

    ``key``: the create key (a fresh one if None), which the sandbox carries as its
    ``CREATE_KEY_LABEL``: a create sent again with it (by the SDK when the connection broke
    before the answer; by a trainer after ``NodeUnavailable``) answers with the sandbox the
    first made, if it did, instead of making another."""
    made = yield _create_call(CreateRequest(sandbox_spec(spec, kw), wait=wait, batch=batch), key)
    return made.sandboxes[0]


def create_many(
    spec: SandboxSpec | None = None,
    n: int = 1,
    *,
    wait: float = 0.0,
    batch: str = "",
    key: str | None = None,
    **kw: Any,
) -> Op[list[SandboxInfo]]:
    """Create ``n`` sandboxes concurrently; all or nothing (the created are killed on
    error, and the first error is raised). ``wait``: as for ``create``, for each of them; the
    ``n`` are one batch of the fair queue (``batch`` names it, to share one over calls).
    ``key``: as for ``create``; member ``i`` carries ``<key>.<i>``."""
    made = yield _create_call(CreateRequest(sandbox_spec(spec, kw), n, wait, batch), key)
    if made.errors:  # a failure to kill one of them is not raised: the first error says more
        yield Batch(tuple(call("kill", sid=i.id, tolerate=(DsecError,)) for i in made.sandboxes))
        raise error_from_wire(made.errors[0].to_dict())
    return list(made.sandboxes)


def _create_call(request: CreateRequest, key: str | None) -> Call:
    """The create's call, under create key ``key`` (a fresh one if None), so sent again
    after a broken connection; its answer awaited ``wait`` seconds longer than the route's."""
    c = dataclasses.replace(
        call("create", request),
        retry_safe=True,
        headers={IDEMPOTENCY_KEY: key or secrets.token_hex(12)},
    )
    if c.timeout is None or not request.wait:
        return c
    return dataclasses.replace(c, timeout=c.timeout + request.wait)


def get(sandbox_id: str) -> Op[SandboxInfo]:
    """The handle of sandbox ``sandbox_id`` as the node sees it now (``UnknownSandbox``
    if there is none)."""
    return (yield call("get", sid=sandbox_id))


def list_sandboxes() -> Op[list[SandboxInfo]]:
    """Every sandbox on the node (through an apiserver: the caller's project's), oldest
    first."""
    return list((yield call("list")).sandboxes)


def kill(sandbox_id: str) -> Op[None]:
    """Kill the sandbox and remove everything it left."""
    yield call("kill", sid=sandbox_id)


def kill_quietly(sandbox_id: str) -> Op[None]:
    """Kill, whatever went wrong (a handle leaving its ``with``: the sandbox may be gone)."""
    yield call("kill", sid=sandbox_id, tolerate=(DsecError,))


def usage(sandbox_id: str) -> Op[SandboxUsage]:
    """What the sandbox uses now: CPU time, memory, processes, disk."""
    return (yield call("usage", sid=sandbox_id))


def pause(sandbox_id: str, *, reclaim: bool = False) -> Op[SandboxInfo]:
    """Pause the sandbox: every process stops where it is; memory, open files and sessions
    stay, and nothing in it answers until ``resume``. ``reclaim`` then has the kernel take
    back what of its memory it can. Pausing a paused one changes nothing."""
    return (yield call("pause", query=PauseQuery(reclaim), sid=sandbox_id))


def pause_all(sandbox_ids: Sequence[str], *, reclaim: bool = False) -> Op[list[SandboxInfo]]:
    """``pause`` of each sandbox: at once in an async client, in turn in a blocking one."""
    q = PauseQuery(reclaim)
    return (yield Batch(tuple(call("pause", query=q, sid=sid) for sid in sandbox_ids)))


def resume(sandbox_id: str) -> Op[SandboxInfo]:
    """Let the paused sandbox go on where it was; a no-op for one that is not paused."""
    return (yield call("resume", sid=sandbox_id))


def resume_all(sandbox_ids: Sequence[str]) -> Op[list[SandboxInfo]]:
    """``resume`` of each sandbox: at once in an async client, in turn in a blocking one."""
    return (yield Batch(tuple(call("resume", sid=sid) for sid in sandbox_ids)))


def events(sandbox_id: str) -> Op[list[InfraEvent]]:
    """The infrastructure failures that struck the sandbox (``InfraEvent``: preempted, out
    of memory, ...), oldest first: not the task's doing, so a trainer masks them."""
    return list((yield call("events", sid=sandbox_id)).events)


def set_ttl(sandbox_id: str, ttl: float | None) -> Op[SandboxInfo]:
    """Let the sandbox live ``ttl`` more seconds from now (None: until killed)."""
    return (yield call("set_ttl", TtlRequest(ttl), sid=sandbox_id))


def policies(sandbox_id: str) -> Op[list[PolicyState]]:
    """The sandbox's security policies: in force (with what they saw), or why not."""
    return list((yield call("policies", sid=sandbox_id)).policies)


def set_policy(sandbox_id: str, policy: str, settings: Mapping[str, Any]) -> Op[PolicyState]:
    """Change a live policy (e.g. a network allowlist) of the running sandbox."""
    return (yield call("set_policy", PolicySettings(settings), sid=sandbox_id, policy=policy))


# --- leases and trajectories ------------------------------------------------------------------


def lease(
    sandboxes: str | Sequence[str],
    *,
    ttl: float = 10.0,
    holder: str = "",
    reclaim: bool = False,
    renew: bool = True,
) -> Op[tuple[LeaseInfo, bool]]:
    """Take a lease on ``sandboxes`` (an agent sandbox and its workers, a group's members):
    if it is not renewed within ``ttl`` seconds (its trainer died) the node pauses them,
    with ``reclaim`` reclaiming their memory too, and records a "preempted" event. A lease
    on sandboxes of a lapsed one takes them over and resumes them. ``renew``: this process
    renews it every ttl/3 until ``release`` (a thread; an async client's task). ``LeaseHeld``
    if a live lease of another holds one of them."""
    # renewing is the handle's to do: ``renew`` goes back with the lease to the client
    taken = yield call("lease", LeaseRequest(tuple(_ids(sandboxes)), ttl, holder, reclaim))
    return taken, renew


def lease_get(lease_id: str) -> Op[LeaseInfo]:
    """Lease ``lease_id`` as the node holds it now (``UnknownLease`` if it does not)."""
    return (yield call("lease_get", lease=lease_id))


def lease_renew(lease_id: str) -> Op[LeaseInfo]:
    """Renew a lease (``Lease.renew``: the handle does it for its holder)."""
    return (yield call("lease_renew", lease=lease_id))


def lease_release(lease_id: str, *, kill: bool = False) -> Op[LeaseInfo]:
    """End a lease (``Lease.release``); ``kill`` kills its sandboxes too."""
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
    """Every step of trajectory log ``name`` (none if there is no such log)."""
    return list((yield call("trajectory", trajectory=check_trajectory_name(name))).entries)


def remove_trajectory(name: str) -> Op[None]:
    """Remove trajectory log ``name`` (``NotFound`` if there is none)."""
    yield call("remove_trajectory", trajectory=check_trajectory_name(name))


# --- layers and snapshots ---------------------------------------------------------------------


def layers() -> Op[list[LayerInfo]]:
    """Every layer of the node's layer sources, source by source."""
    return list((yield call("layers")).layers)


def prefetch(refs: Sequence[str]) -> Op[list[dict[str, Any]]]:
    """Warm layers on the node (all chunks of on-demand layers); returns what was fetched."""
    made = yield call("prefetch", PrefetchRequest(refs))  # type: ignore[arg-type]
    return [row.to_dict() for row in made.layers]


def resolve_image(image: str) -> Op[ResolvedImage]:
    """Make docker image ``image``, named as a Dockerfile's ``FROM`` names it
    (``python:3.11-slim-bookworm``), into a base layer on the node: from the node's local
    docker, else from a layer source of the node that holds images (an OCI registry). Never
    pulls from public registries. Returns the layer (``ResolvedImage.layer``, for
    ``layers=[...]``) and the image's env, workdir, user and command; ``UnknownImage`` naming
    the image if neither has it. Through an apiserver it needs a builder or admin key."""
    return (yield call("resolve_image", ResolveImageRequest(image)))


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
    """Pack the running sandbox's writable layer into a snapshot layer over its layers
    (``Node.pack_diff``): the sandbox is frozen meanwhile. ``exclude`` leaves paths out;
    ``scrub`` also leaves out /tmp, caches, shell histories and credentials; ``source``
    (a URL of one of the node's layer sources) also pushes it there, with the parents it
    lacks. ``secrets`` (label -> text, e.g. ``{"hidden-test": ...}``): the packed layer
    is scanned for each; a hit removes it and raises ``LeakFound`` naming paths and
    labels."""
    body = PackDiffRequest(name, version, tuple(exclude), scrub, source, dict(secrets or {}))
    return (yield call("pack_diff", body, sid=sandbox_id))


def snapshot_memory(sandbox_id: str, name: str | None = None) -> Op[MemorySnapshot]:
    """Save a running VM sandbox's memory, devices and disk at one instant (it runs on);
    ``restore(snapshot.name, n)`` starts n sandboxes that go on from there."""
    return (yield call("snapshot_memory", MemorySnapshotRequest(name), sid=sandbox_id))


def memory_snapshot(name: str) -> Op[MemorySnapshot]:
    """Memory snapshot ``name`` as ``snapshot_memory`` made it (``UnknownSnapshot`` if
    there is none): its size on disk and the spec its restores take."""
    return (yield call("memory_snapshot", snapshot=name))


def remove_memory_snapshot(name: str) -> Op[None]:
    """Remove memory snapshot ``name`` (``UnknownSnapshot`` if there is none)."""
    yield call("remove_memory_snapshot", snapshot=name)


def restore(
    snapshot: str | LayerInfo | MemorySnapshot,
    n: int = 1,
    spec: SandboxSpec | None = None,
    **kw: Any,
) -> Op[list[SandboxInfo]]:
    """``n`` new sandboxes that each start from ``snapshot``'s state, each with its own
    writable layer over the same read-only layers; all or nothing. ``spec`` (or its
    fields) sets the rest; its layers and environment are replaced by the snapshot's.
    ``MissingParentLayers`` names the digests of parent layers no source holds."""
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
    """Run ``cmd`` in the sandbox: a string through ``/bin/sh -c``, a list as argv.
    Processes it leaves running are killed when it exits, unless ``background``;
    ``exclusive`` first kills every other process in the sandbox (sessions, background
    jobs, other calls), which is how a verifier should run. ``trajectory``: log it as
    ``step`` (default: the next) of that trajectory log; a step logged already comes back
    from the log (``replayed``) without running."""
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
    """Run a short stateless call (``cmd``, or shell ``script``) in a warm member of the
    environment's FnCall pool, with ``files`` (relative to its working directory) written
    first; the member is reset before anyone else's call. A timeout sets ``timed_out``; a
    member that died under the call gives ``error="runtime-error"`` (it is replaced).
    ``devices`` (e.g. ``["gpu"]``): members hold them, and the pool is one of its own."""
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
    """Judge a submission in a warm member of the environment's FnCall pool: ``files``
    written, ``compile`` run once, then ``run`` on each of ``cases`` (``JudgeCase``) or
    of ``cases_dir``'s NAME.in/NAME.out, each with ``time_limit`` CPU seconds and
    ``memory_limit``; a verdict per case (AC, WA, TLE, MLE, RE) and for the whole (or CE).
    Takes a ``JudgeSpec``, or its fields as arguments."""
    return (yield call("judge", _judge_spec(environment, run, kw)))


def session_open(
    sandbox_id: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None
) -> Op[tuple[str, str]]:
    """Start a persistent shell in the sandbox (``cwd`` and ``env`` default to the
    sandbox's): its cwd, variables and functions carry over between its commands. A
    context manager that closes it on exit."""
    opened = yield call("session_open", SessionOpenRequest(cwd, env), sid=sandbox_id)
    return sandbox_id, opened.session  # what its handle is made of


def sessions(sandbox_id: str) -> Op[list[str]]:
    """The ids of the sandbox's sessions whose shells still run."""
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
    """Run shell command ``cmd`` in the session (``Session.exec``)."""
    body = SessionExecRequest(cmd, timeout, stdin, max_output)  # type: ignore[arg-type]
    return (yield call("session_exec", body, sid=sandbox_id, ses=session_id))


def session_close(sandbox_id: str, session_id: str) -> Op[None]:
    """Close the session (``Session.close``): its shell and what it started end."""
    yield call("session_close", sid=sandbox_id, ses=session_id)


def session_close_quietly(sandbox_id: str, session_id: str) -> Op[None]:
    """Close a session, whatever went wrong (a handle leaving its ``with``)."""
    yield call("session_close", sid=sandbox_id, ses=session_id, tolerate=(DsecError,))


# --- files and the screen ---------------------------------------------------------------------


def read_file(sandbox_id: str, path: str) -> Op[bytes]:
    """The whole file at ``path`` in the sandbox (read in pieces of ``CHUNK``)."""
    out = bytearray()
    while True:
        piece = yield call("read_file", query=ReadQuery(path, len(out), CHUNK), sid=sandbox_id)
        out += piece
        if len(piece) < CHUNK:
            return bytes(out)


def _write(sandbox_id: str, path: str, mode: str, off: int, piece: bytes) -> Call:
    return call("write_file", piece, WriteQuery(path, mode, off, off == 0), sid=sandbox_id)


def write_file(sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644) -> Op[None]:
    """Write ``data`` (str: as UTF-8) to ``path`` in the sandbox, replacing the file;
    ``mode`` (permission bits such as 0o755) applies to a file this creates."""
    octal = _octal(mode)
    for off, piece in _write_chunks(_data(data)):
        yield _write(sandbox_id, path, octal, off, piece)


def upload(
    sandbox_id: str, local: str | os.PathLike[str], remote: str, *, mode: int | None = None
) -> Op[None]:
    """Copy local file ``local`` to ``remote`` in the sandbox piece by piece, never holding
    all of it; ``mode`` defaults to the local file's."""
    # each piece is read (in a thread, for an async client) as it is sent
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
    """Copy a file out of the sandbox piece by piece, never holding all of it. The local
    file is opened once the first piece came (a bad remote path leaves it as it was)."""
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
    """The entries of directory ``path`` in the sandbox (lstat, without . and ..), sorted
    by name."""
    return list((yield call("list_dir", query=FileQuery(path), sid=sandbox_id)).entries)


def stat(sandbox_id: str, path: str) -> Op[FileEntry]:
    """What lstat says of ``path`` in the sandbox."""
    return (yield call("stat", query=FileQuery(path), sid=sandbox_id))


def remove(sandbox_id: str, path: str, *, recursive: bool = False) -> Op[None]:
    """Remove a file, symlink or empty directory in the sandbox; ``recursive``: a tree."""
    yield call("remove", query=RemoveQuery(path, recursive), sid=sandbox_id)


def screenshot(sandbox_id: str) -> Op[bytes]:
    """The sandbox's display now, as PNG bytes (a backend with a screen: ``vm``)."""
    return (yield call("screenshot", sid=sandbox_id))


def input(sandbox_id: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> Op[int]:
    """Send input to the sandbox's display in order: records (``dsec_core.screen_input``:
    ``Key("a")``, ``Move(x, y)``, ``Click(x, y)``) or their dicts (``{"type": "click",
    "x": 200, "y": 140}``); returns how many were sent."""
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
    """``exec``, with the output as it comes: ``ExecOutput`` pieces (``stream`` "stdout"
    or "stderr", ``data``), then the ``ExecResult`` (its stdout and stderr empty). Takes
    ``exec``'s arguments but ``trajectory``. Leaving the loop early kills the command."""
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


# --- interactive processes -------------------------------------------------------------------


def process_start(
    sandbox_id: str,
    cmd: str | Sequence[str],
    *,
    timeout: float | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    stdin: bool = False,
    rows: int | None = None,
    cols: int | None = None,
    background: bool = False,
) -> Op[ProcessInfo]:
    """Start ``cmd`` (a string through ``/bin/sh -c``, a list as argv) as a process that
    runs on between clients: ``stdin`` keeps its input open for ``process_input``; ``rows``
    and ``cols`` run it on a terminal of that size (``tty`` names it, ``stty size`` shows
    the size; its output is all "stdout"). Read its output with ``process_output`` (from
    the start, or from now; any number of readers, at any time), resize with
    ``process_resize``, signal with ``process_signal``. It runs until it ends, ``timeout``
    (None: none) runs out, a signal kills it, or the sandbox dies; what it leaves running is
    killed when it exits, unless ``background``."""
    body = ProcessStartRequest(
        cmd,  # type: ignore[arg-type]  # ProcessStartRequest takes any sequence
        timeout,
        cwd,
        env,
        stdin,
        rows,
        cols,
        background,
    )
    return (yield call("process_start", body, sid=sandbox_id))


def processes(sandbox_id: str) -> Op[list[ProcessInfo]]:
    """The sandbox's processes started with ``process_start``: those running, and those that
    ended in the last half minute (``running`` false, with their ``exit_code``)."""
    return list((yield call("processes", sid=sandbox_id)).processes)


def process(sandbox_id: str, pid: int) -> Op[ProcessInfo]:
    """One process started with ``process_start`` (``NotFound`` once it is forgotten)."""
    return (yield call("process", sid=sandbox_id, pid=_pid(pid)))


def _pid(pid: Any) -> str:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise InvalidSpec(f"pid must be a positive integer, got {pid!r}", field="pid")
    return str(pid)


def process_output(sandbox_id: str, pid: int, *, from_start: bool = True) -> Stream:
    """A process's output as it comes: ``ExecOutput`` pieces, then its ``ExecResult`` (its
    stdout and stderr empty). ``from_start``: beginning with what the node kept of it (its
    last MiB), else from now on. Leaving the loop early leaves the process running."""
    route = ROUTES["process_output"]
    target = route.target({"sid": sandbox_id, "pid": _pid(pid)})
    content = route.encode_body(ProcessOutputRequest(from_start))
    assert content is not None
    return Stream(route, target, content)


def process_input(
    sandbox_id: str, pid: int, stdin: bytes | str = b"", *, eof: bool = False
) -> Op[ProcessInfo]:
    """Send ``stdin`` to a process's stdin (or terminal); ``eof`` then ends its input (stdin
    closes; a terminal gets its EOF character, ^D)."""
    body = ProcessInputRequest(stdin, eof)  # type: ignore[arg-type]  # str is encoded
    return (yield call("process_input", body, sid=sandbox_id, pid=_pid(pid)))


def process_resize(sandbox_id: str, pid: int, rows: int, cols: int) -> Op[ProcessInfo]:
    """Resize a process's terminal (its programs get SIGWINCH)."""
    body = ProcessResizeRequest(rows, cols)
    return (yield call("process_resize", body, sid=sandbox_id, pid=_pid(pid)))


def process_signal(sandbox_id: str, pid: int, signal: str | int = "KILL") -> Op[ProcessInfo]:
    """Send ``signal`` (a name such as "TERM" or "INT", or a number) to a process."""
    body = ProcessSignalRequest(signal)
    return (yield call("process_signal", body, sid=sandbox_id, pid=_pid(pid)))


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

    @property
    def _key(self) -> str:
        """What the core's operations on the sandbox take first (``methods.handle_method``)."""
        return self.id

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
    name: str, /, spec: SandboxSpec | None = None, n: int = 1, **kw: Any
) -> Op[list[SandboxInfo]]:
    """``n`` new members (all or none), labelled into the group."""
    return (yield from create_many(_in_group(spec, kw, name), n))


def group_fork(
    name: str,
    /,
    source: str | SandboxRef | None = None,
    n: int = 1,
    *,
    snapshot: str | LayerInfo | None = None,
    spec: SandboxSpec | None = None,
    **kw: Any,
) -> Op[list[SandboxInfo]]:
    """``n`` new members that each start from member ``source``'s state now (packed with
    ``pack_diff``, then ``restore``), each with its own writable layer, on ``source``'s
    backend unless told otherwise; or from an earlier ``snapshot`` instead. ``spec`` (or
    its fields) goes to ``Client.restore``.
    ``InvalidSpec`` if ``source`` is not a member of this group."""
    # The restore spec is labelled into the group and checked before anything is packed; the
    # layers it is given only make it valid, the node replaces them by the snapshot's.
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
    fields = {"layers": info.layers, **kw}
    if spec is None and "backend" not in kw and info.backend:
        fields["backend"] = info.backend  # a fork runs as its source does (a VM's are VMs)
    restore_spec = _in_group(spec, fields, name)
    packed = yield from pack_diff(sid)
    return (yield from restore(packed, n, restore_spec))


def group_lease(
    name: str, *, ttl: float = 10.0, holder: str = "", reclaim: bool = False
) -> Op[tuple[LeaseInfo, bool]]:
    """A lease on every member now (``Client.lease``): they pause if this process stops
    renewing it, and a new trainer's lease on the group resumes them."""
    ids = [i.id for i in (yield from group_members(name))]
    return (yield from lease(ids, ttl=ttl, holder=holder or name, reclaim=reclaim))


def group_pause(name: str, *, reclaim: bool = False) -> Op[list[SandboxInfo]]:
    """Pause every member that runs (see ``Client.pause``)."""
    live = [i.id for i in (yield from group_members(name)) if i.state == "running"]
    return (yield from pause_all(live, reclaim=reclaim))


def group_resume(name: str) -> Op[list[SandboxInfo]]:
    """Resume every paused member."""
    paused = [i.id for i in (yield from group_members(name)) if i.state == "paused"]
    return (yield from resume_all(paused))


def group_kill(name: str) -> Op[int]:
    """Kill every member; returns how many there were."""
    # one that went away meanwhile (its TTL, another process's kill) is no error
    members = yield from group_members(name)
    yield Batch(tuple(call("kill", sid=i.id, tolerate=(UnknownSandbox,)) for i in members))
    return len(members)


# --- IAM: projects, quotas and keys (through an apiserver) -------------------------------------


def _quota(quota: Quota | Mapping[str, Any] | None) -> Quota:
    if quota is None:
        return Quota()
    if isinstance(quota, Mapping):
        return Quota.from_dict(quota)
    if not isinstance(quota, Quota):
        raise InvalidSpec(f"quota must be a Quota or a dict, got {quota!r}", field="quota")
    return quota


def whoami() -> Op[KeyInfo]:
    """The API key this client sends, as IAM knows it: its id, project, role, name and
    when it expires (never its secret)."""
    return (yield call("whoami"))


def projects(under: str | None = None) -> Op[list[Project]]:
    """The projects the key sees (its project and those below it; ``under``: that
    subtree only), by path, with their quotas."""
    return list((yield call("projects", query=ProjectsQuery(under))).projects)


def create_project(path: str, quota: Quota | Mapping[str, Any] | None = None) -> Op[Project]:
    """Create project ``path`` (``org/team/job``) under its existing parent, with ``quota``
    (a ``Quota`` or its fields as a dict; memory may be ``"8G"``). An admin key makes them
    in its subtree; any other key below its own project (a sub-agent's), with a quota no
    larger than its own (``PermissionDenied``)."""
    return (yield call("create_project", ProjectRequest(path, _quota(quota))))


def project(path: str) -> Op[Project]:
    """Project ``path`` and its quota (``UnknownProject`` if the key does not see it)."""
    return (yield call("project", query=ProjectQuery(path)))


def set_quota(path: str, quota: Quota | Mapping[str, Any]) -> Op[Project]:
    """Replace project ``path``'s quota (an admin key's, in its subtree); returns the
    project as it is now."""
    return (yield call("set_quota", QuotaRequest(path, _quota(quota))))


def revoke_project(path: str, *, force: bool = False) -> Op[ProjectRevocation]:
    """Revoke project ``path`` (an admin key's, in its subtree). One with subprojects or
    keys is ``ProjectInUse`` unless ``force``, which revokes them too."""
    return (yield call("revoke_project", query=RevokeProjectQuery(path, force)))


def keys(project: str | None = None) -> Op[list[KeyInfo]]:
    """The keys this key may revoke (an admin's: its subtree's; any key's: those it
    minted), of ``project``'s subtree if given; never their secrets."""
    return list((yield call("keys", query=KeyQuery(project))).keys)


def create_key(
    project: str, role: str, name: str | None = None, ttl: float | None = None
) -> Op[MintedKey]:
    """Mint an API key of ``role`` for ``project``, no wider than this client's own: a
    role it may mint (its own or narrower), its project or one below it, expiring no
    later than it does (``ttl``: seconds to live; None: until revoked). Returns the key
    and its secret (``.key``, ``.secret``): the only time the secret is shown. A key
    minted by one that is no admin's is revoked with it."""
    return (yield call("create_key", KeyRequest(project, role, name, ttl)))


def revoke_key(key_id: str) -> Op[KeyInfo]:
    """Revoke API key ``key_id`` and the keys it minted: they stop working within 2 s on
    every apiserver. One this key may not revoke is ``UnknownKey``, as a missing one."""
    return (yield call("revoke_key", key=key_id))
