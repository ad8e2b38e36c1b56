"""The node API's own messages: request bodies, query parameters and the replies that are not
already records (``SandboxSpec``, ``SandboxInfo``, ``ExecResult``, ... come from ``records``).

Each is a small frozen dataclass; ``to_dict``/``from_dict`` go through its JSON shape
(``shapes``), the same one the server decodes with and the OpenAPI document shows.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from collections.abc import Sequence as AbcSequence
from dataclasses import dataclass, field
from typing import Any

from ..agent.rpc import MAX_OUTPUT
from ..errors import InvalidSpec
from ..records import (
    DeviceRequest,
    ExecResult,
    FileEntry,
    FnCallResult,
    InfraEvent,
    JudgeCase,
    JudgeResult,
    JudgeSpec,
    LayerInfo,
    LeaseInfo,
    MemorySnapshot,
    NodeLoad,
    PolicyState,
    ProcessInfo,
    ResolvedImage,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
    TrajectoryEntry,
    check_trajectory_name,
    device_requests,
)
from ..screen_input import MAX_EVENTS as MAX_INPUT_EVENTS
from ..screen_input import input_dicts
from .shapes import decoder, encoder

__all__ = [
    "MAX_READ",
    "MAX_TIMEOUT",
    "Closed",
    "CreateRequest",
    "CreateResult",
    "DeviceStatus",
    "DirListing",
    "ErrorBody",
    "ErrorResponse",
    "ExecRequest",
    "ExecResult",
    "FileEntry",
    "FileQuery",
    "FnCallRequest",
    "FnCallResult",
    "InfraEvents",
    "InputRequest",
    "InputSent",
    "JudgeCase",
    "JudgeResult",
    "JudgeSpec",
    "KernelFeature",
    "Killed",
    "LayerInfo",
    "LayerList",
    "LeaseInfo",
    "LeaseRequest",
    "ListQuery",
    "MemorySnapshot",
    "MemorySnapshotRequest",
    "Message",
    "NodeCapacity",
    "NodeLoad",
    "NodeProbe",
    "NodeStatus",
    "PackDiffRequest",
    "PauseQuery",
    "PolicySettings",
    "PolicyState",
    "PolicyStates",
    "PoolStatus",
    "PrefetchRequest",
    "PrefetchResult",
    "PrefetchedLayer",
    "ProcessInfo",
    "ProcessInputRequest",
    "ProcessList",
    "ProcessOutputRequest",
    "ProcessResizeRequest",
    "ProcessSignalRequest",
    "ProcessStartRequest",
    "ProjectUsage",
    "QosSupport",
    "ReadQuery",
    "ReleaseQuery",
    "RemoveQuery",
    "Removed",
    "ResolveImageRequest",
    "ResolvedImage",
    "RestoreRequest",
    "SandboxInfo",
    "SandboxList",
    # records that travel as they are
    "SandboxSpec",
    "SandboxUsage",
    "SessionExecRequest",
    "SessionList",
    "SessionOpenRequest",
    "SessionOpened",
    "Trajectory",
    "TtlRequest",
    "WarmPoolStatus",
    "WarmSettings",
    "WarmStatus",
    "WarmTarget",
    "WriteQuery",
    "Written",
]

DEFAULT_MAX_OUTPUT = 1 << 20
#: The most one read answers: a length of -1 (to the end) stops here too, so reading a device
#: such as /dev/zero ends. The node streams an answer in pieces, whatever its size.
MAX_READ = 256 << 20
#: The longest command timeout, in seconds (30 days): anything longer is a mistake, and the
#: agent counts deadlines in 64-bit milliseconds.
MAX_TIMEOUT = 30 * 86400.0


def _limits(**schema: Any) -> dict[str, Any]:
    """Field metadata: JSON Schema constraints the decoder enforces and the document shows."""
    return {"schema": schema}


class Message:
    """Base of the API's messages: JSON through the shape read from the type hints."""

    def to_dict(self) -> dict[str, Any]:
        return encoder(type(self))(self)  # type: ignore[arg-type, misc]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        return decoder(cls)(data, cls.__name__)


# --- the node ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeCapacity(Message):
    """What a node may hold: CPU cores and memory bytes with overcommit applied, and sandboxes."""

    cpu: float
    memory: int
    sandboxes: int


@dataclass(frozen=True)
class KernelFeature(Message):
    """Whether the node's kernel offers a feature, and how that was found out (or why not)."""

    available: bool
    detail: str


@dataclass(frozen=True)
class QosSupport(Message):
    """What the node's kernel offers the CPU classes (``SandboxSpec.qos``): SCHED_IDLE and
    ``cpu.idle`` for best-effort sandboxes, core scheduling for latency-sensitive ones."""

    sched_idle: KernelFeature
    cpu_idle: KernelFeature
    core_scheduling: KernelFeature


@dataclass(frozen=True)
class DeviceStatus(Message):
    """One device of the node's inventory: where it is, what it is, how many may share it, and
    the sandboxes holding it (exclusively: one at most; shared: up to ``share_cap``)."""

    kind: str
    path: str
    type: str
    major: int
    minor: int
    share_cap: int
    exclusive: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReclaimStatus(Message):
    """The node's memory reclaim (``dsec_core.node.reclaim``): on or off, how often it passes
    over the sandboxes that give memory back (VMs), what each always keeps (``floor``), how
    it finds cold memory (``monitor``), whether DAMON of its own could run here and why not,
    and what its passes gave back (bytes) so far."""

    enabled: bool
    interval: float
    floor: str
    monitor: str
    damon: bool
    damon_detail: str
    passes: int = 0
    given_back: int = 0
    last_pass: float = 0.0  # Unix time; 0: none yet


@dataclass(frozen=True)
class NodeStatus(Message):
    """A node daemon: its version, pid, home, sandboxes, capacity, backends, layer sources and
    what its kernel offers the CPU classes."""

    version: str
    pid: int
    home: str
    sandboxes: int
    capacity: NodeCapacity
    backends: tuple[str, ...]
    layer_sources: tuple[str, ...]
    qos: QosSupport | None = None  # None from a node older than the CPU classes
    pools: tuple[PoolStatus, ...] = ()  # the FnCall pools, one per (project, environment, size)
    devices: tuple[DeviceStatus, ...] = ()  # the inventory (DSEC_DEVICES) and its holders
    warm: WarmStatus | None = None  # the warm pools of stateful sandboxes (None: an older node)
    reclaim: ReclaimStatus | None = None  # memory given back by VMs (None: an older node)


@dataclass(frozen=True)
class WarmTarget(Message):
    """Keep ``count`` warm sandboxes of a shape: the fields of ``spec`` that decide what runs
    (environment and layers, backend, cpu, memory, pids, disk, network, policies, qos,
    runtime, workdir); its env, labels and ttl are a create's own and are ignored here."""

    spec: SandboxSpec
    count: int = field(default=1, metadata=_limits(minimum=0, maximum=100000))


@dataclass(frozen=True)
class WarmSettings(Message):
    """What the node keeps warm, set through the API (``PUT /v1/warm``): ``targets`` replace
    those set before (the catalogs' ``warm:`` entries stay); ``auto`` learns targets from the
    creates of the last ``window`` seconds, their members' memory limits within ``budget``
    bytes (None: leave as it is)."""

    targets: tuple[WarmTarget, ...] = ()
    auto: bool | None = None
    budget: int | None = field(default=None, metadata=_limits(minimum=0))
    window: float | None = field(default=None, metadata=_limits(exclusiveMinimum=0, maximum=86400))


@dataclass(frozen=True)
class WarmPoolStatus(Message):
    """One shape kept warm: its name, where its target comes from (``catalog``, ``api``,
    ``auto``), the target, the members ready to claim and starting, the creates that claimed
    one and those that found none ready (``missed``: they went cold), and the memory its
    members' limits reserve."""

    name: str
    sources: tuple[str, ...]
    target: int
    ready: int
    starting: int
    claimed: int
    missed: int
    memory: int


@dataclass(frozen=True)
class WarmStatus(Message):
    """The node's warm pools, and its automatic mode: on or off, its memory budget (bytes of
    members' memory limits) and window (seconds of recent creates it learns from); ``evicted``:
    members killed to make room (pressure, waiting creates, a smaller target)."""

    pools: tuple[WarmPoolStatus, ...] = ()
    targets: tuple[WarmTarget, ...] = ()
    auto: bool = False
    budget: int = 0
    window: float = 0.0
    evicted: int = 0


@dataclass(frozen=True)
class ProjectUsage(Message):
    """What one project's live sandboxes on a node hold: their number and their CPU and memory
    limits (the apiserver checks quotas against these sums)."""

    sandboxes: int = 0
    cpu: float = 0.0
    memory: int = 0


@dataclass(frozen=True)
class NodeProbe(Message):
    """What the control plane's watcher learns of a node each probe: its name, its load, the
    layers it holds mounted now (``name@version``; a create there reuses them), the
    environments all of whose layers those are, and its live sandboxes by project
    (``PROJECT_LABEL``)."""

    name: str
    version: str
    load: NodeLoad
    layers: tuple[str, ...] = ()
    environments: tuple[str, ...] = ()
    projects: Mapping[str, ProjectUsage] = field(default_factory=dict)
    #: The node's clock (Unix time) when it made the probe: every sandbox whose ``created`` is
    #: earlier is counted in ``projects`` (0: a node that does not say).
    at: float = 0.0


@dataclass(frozen=True)
class TtlRequest(Message):
    """A sandbox's new time to live, in seconds from now; null: it lives until killed."""

    ttl: float | None = field(
        default=None, metadata=_limits(exclusiveMinimum=0, maximum=MAX_TIMEOUT)
    )


@dataclass(frozen=True)
class PoolStatus(Message):
    """One FnCall pool: its members (``size``, ``free`` of them clean and idle), its bounds,
    the calls waiting for a member, how many members broke and were replaced, and the project
    whose calls it serves and whose quota its members count against (None: the node's shared
    pool of direct callers)."""

    name: str
    size: int
    free: int
    min: int
    max: int
    waiting: int
    replaced: int
    project: str | None = None


@dataclass(frozen=True)
class ErrorBody(Message):
    """A typed error: the ``DsecError`` subclass's name, its message and its context."""

    type: str
    message: str
    context: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ErrorResponse(Message):
    """Every 4xx and 5xx answer: the client raises the same ``DsecError`` subclass."""

    error: ErrorBody


# --- sandboxes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateRequest(Message):
    """Create ``count`` sandboxes from one spec; a node takes at most ``DSEC_MAX_BATCH`` in one
    request, and (without ``wait``) no more than it has room for, or refuses the whole request
    before any work. ``wait``: seconds each create may wait in the fair create queue for room
    before ``AdmissionRejected`` (0: refused at once); ``batch``: the queue's batch the creates
    belong to within their project (empty: a batch of this request's own when ``count`` > 1,
    else the project's default batch)."""

    spec: SandboxSpec
    count: int = field(default=1, metadata=_limits(minimum=1))
    wait: float = field(default=0.0, metadata=_limits(minimum=0, maximum=86400))
    batch: str = field(default="", metadata=_limits(maxLength=256))


@dataclass(frozen=True)
class CreateResult(Message):
    """The sandboxes made, and a typed error for each one that could not be."""

    sandboxes: tuple[SandboxInfo, ...]
    errors: tuple[ErrorBody, ...] = ()


@dataclass(frozen=True)
class SandboxList(Message):
    """Every sandbox on the node, oldest first."""

    sandboxes: tuple[SandboxInfo, ...]


@dataclass(frozen=True)
class PolicyStates(Message):
    """Every security policy considered for a sandbox (``dsec sandbox inspect``)."""

    policies: tuple[PolicyState, ...]


@dataclass(frozen=True)
class PolicySettings(Message):
    """New settings for a live security policy in force on a running sandbox."""

    settings: Mapping[str, Any]

    def __post_init__(self) -> None:
        if isinstance(self.settings, Mapping):
            object.__setattr__(self, "settings", dict(self.settings))


@dataclass(frozen=True)
class Killed(Message):
    """The id of the sandbox that was killed."""

    killed: str


# --- commands and sessions --------------------------------------------------------------------

_TIMEOUT = _limits(exclusiveMinimum=0, maximum=MAX_TIMEOUT)
#: The agent keeps at most MAX_OUTPUT of each stream: asking for more is refused, not ignored.
_MAX_OUTPUT = _limits(minimum=0, maximum=MAX_OUTPUT)


def _text_to_bytes(msg: Any, name: str) -> None:
    value = getattr(msg, name)
    if isinstance(value, str):
        object.__setattr__(msg, name, value.encode("utf-8", "surrogateescape"))
    elif isinstance(value, (bytearray, memoryview)):
        object.__setattr__(msg, name, bytes(value))


def _plain_env(msg: Any) -> None:
    """Any mapping becomes a dict (an empty one None); anything else stays for the decoder."""
    if isinstance(msg.env, Mapping):
        object.__setattr__(msg, "env", dict(msg.env) or None)


@dataclass(frozen=True)
class ExecRequest(Message):
    """Run a command: a string through ``/bin/sh -c``, an array as argv (PATH lookup).

    ``timeout`` in seconds (null: none) kills the whole process tree; ``stdin`` is base64 (null:
    /dev/null); output past ``max_output`` bytes per stream is dropped. When the command exits,
    the processes it left running are killed unless ``background``. ``exclusive`` kills every
    other process in the sandbox first (for verifiers).
    """

    cmd: str | tuple[str, ...] = field(metadata=_limits(minLength=1, minItems=1))
    timeout: float | None = field(default=None, metadata=_TIMEOUT)
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    stdin: bytes | None = None
    max_output: int = field(default=DEFAULT_MAX_OUTPUT, metadata=_MAX_OUTPUT)
    background: bool = False
    exclusive: bool = False
    #: Log the command as ``step`` (default: the next) of this trajectory; a step logged
    #: already is answered from the log without running (``replayed``).
    trajectory: str | None = None
    step: int | None = field(default=None, metadata=_limits(minimum=0))

    def __post_init__(self) -> None:
        # The SDK hands over what its callers pass: a list (paths in it too), a str stdin, any
        # mapping. Anything else is left as it is for the decoder to name (``cmd: expected ...``).
        cmd = self.cmd
        if isinstance(cmd, AbcSequence) and not isinstance(cmd, (str, bytes, tuple)):
            cmd = tuple(cmd)
        if isinstance(cmd, tuple):
            cmd = tuple(os.fspath(a) if isinstance(a, os.PathLike) else a for a in cmd)
        object.__setattr__(self, "cmd", cmd)
        _text_to_bytes(self, "stdin")
        _plain_env(self)
        if not self.cmd:
            raise InvalidSpec("exec needs cmd: a non-empty string or list of strings", field="cmd")
        if self.trajectory is not None:
            check_trajectory_name(self.trajectory)


@dataclass(frozen=True)
class FnCallRequest(Message):
    """Run one short stateless call in a warm member of the environment's FnCall pool.

    ``cmd`` (a string through ``/bin/sh -c``, or argv) or ``script`` (shell script text), not
    both; ``files`` (paths relative to the working directory, or absolute under ``/tmp`` or
    it; contents base64) are written before it runs. The pool is the node's for
    (environment, backend, cpu, memory); ``timeout`` kills the call's whole process tree and
    sets ``timed_out``. The member is reset before anyone else's call, whatever happened.

    ``project`` picks the pool's owner: the apiserver sets it to the caller's project, whose
    pools are its own (their members carry its ``dsec.project`` label and count against its
    quota); a direct caller of a node may leave it None and use the node's shared pools.
    ``start`` False (the apiserver's choice when the project's quota has no room for one more
    sandbox) lets the call take a free member or wait for one (the pool's checkout timeout) but
    never start one: with no member at all, or none free in time, it fails with
    ``AdmissionRejected`` (``reason="pool-start"``).
    """

    environment: str = field(metadata=_limits(minLength=1))
    cmd: str | tuple[str, ...] | None = None
    script: str | None = None
    stdin: bytes | None = None
    files: Mapping[str, bytes] | None = None
    timeout: float | None = field(default=None, metadata=_TIMEOUT)
    max_output: int = field(default=DEFAULT_MAX_OUTPUT, metadata=_MAX_OUTPUT)
    env: Mapping[str, str] | None = None
    backend: str = "fncall"
    cpu: float = field(default=1.0, metadata=_limits(exclusiveMinimum=0))
    memory: int | str = "512M"
    devices: tuple[DeviceRequest, ...] = ()
    project: str | None = None
    start: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", device_requests(self.devices))
        cmd = self.cmd
        if isinstance(cmd, AbcSequence) and not isinstance(cmd, (str, bytes, tuple)):
            object.__setattr__(self, "cmd", tuple(cmd))
        _text_to_bytes(self, "stdin")
        _plain_env(self)
        _plain_files(self)
        if (self.cmd is None) == (self.script is None) or self.cmd in ("", ()) or self.script == "":
            raise InvalidSpec("fncall needs one of cmd or script, not both", field="cmd")


def _plain_files(msg: Any) -> None:
    """``files`` as ``{str: bytes}`` (None if empty), whatever paths and contents came."""
    if isinstance(msg.files, Mapping):
        files = {}
        for k, v in msg.files.items():
            files[os.fspath(k) if isinstance(k, os.PathLike) else k] = (
                v.encode()
                if isinstance(v, str)
                else bytes(v)
                if isinstance(v, (bytearray, memoryview))
                else v
            )
        object.__setattr__(msg, "files", files or None)


@dataclass(frozen=True)
class SessionOpenRequest(Message):
    """Start a persistent shell; ``cwd`` and ``env`` default to the sandbox's."""

    cwd: str | None = None
    env: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        _plain_env(self)


#: A terminal's largest side, in rows or columns (the kernel's ``winsize`` holds 16 bits).
_TERMINAL_SIDE = _limits(minimum=1, maximum=65535)


@dataclass(frozen=True)
class ProcessStartRequest(Message):
    """Start a command that runs on between clients: a string through ``/bin/sh -c``, an
    array as argv. ``stdin`` keeps its standard input open for ``process_input``; ``rows``
    and ``cols`` (both, or neither) run it on a new pseudo-terminal of that size as its
    controlling tty (stdin, stdout and stderr; its output is all "stdout"). ``timeout`` kills
    its process tree; when it exits, what it left running is killed unless ``background``.
    Output is kept for clients that attach later: all of it (up to 16 MiB) until one reads it
    from the start, then the last 1 MiB."""

    cmd: str | tuple[str, ...] = field(metadata=_limits(minLength=1, minItems=1))
    timeout: float | None = field(default=None, metadata=_TIMEOUT)
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    stdin: bool = False
    rows: int | None = field(default=None, metadata=_TERMINAL_SIDE)
    cols: int | None = field(default=None, metadata=_TERMINAL_SIDE)
    background: bool = False

    def __post_init__(self) -> None:
        cmd = self.cmd
        if isinstance(cmd, AbcSequence) and not isinstance(cmd, (str, bytes, tuple)):
            object.__setattr__(self, "cmd", tuple(cmd))
        _plain_env(self)
        if not self.cmd:
            raise InvalidSpec("process_start needs cmd: a non-empty string or list", field="cmd")
        if (self.rows is None) != (self.cols is None):
            raise InvalidSpec("a terminal needs both rows and cols", field="rows")


@dataclass(frozen=True)
class ProcessList(Message):
    """The sandbox's processes started with ``process_start`` (those that ended a moment
    ago too, ``running`` false)."""

    processes: tuple[ProcessInfo, ...]


@dataclass(frozen=True)
class ProcessOutputRequest(Message):
    """Attach to a process's output: from the first byte still kept (``from_start``) or from
    now on."""

    from_start: bool = True


@dataclass(frozen=True)
class ProcessInputRequest(Message):
    """Input for a process's stdin or terminal (base64), and/or the end of its input (``eof``:
    stdin closes once what came before is written; a terminal gets its EOF character)."""

    stdin: bytes = b""
    eof: bool = False

    def __post_init__(self) -> None:
        _text_to_bytes(self, "stdin")


@dataclass(frozen=True)
class ProcessResizeRequest(Message):
    """A process's terminal's new size."""

    rows: int = field(metadata=_TERMINAL_SIDE)
    cols: int = field(metadata=_TERMINAL_SIDE)


@dataclass(frozen=True)
class ProcessSignalRequest(Message):
    """A signal for a process: a name (``KILL``, ``SIGTERM``, ``INT``, ...) or its number."""

    signal: str | int = "KILL"


@dataclass(frozen=True)
class SessionOpened(Message):
    """The id of the new session."""

    session: str


@dataclass(frozen=True)
class SessionList(Message):
    """The ids of the sandbox's sessions whose shells still run."""

    sessions: tuple[str, ...]


@dataclass(frozen=True)
class SessionExecRequest(Message):
    """Run a shell command in a session; cwd, variables and functions persist between calls."""

    cmd: str = field(metadata=_limits(minLength=1))
    timeout: float | None = field(default=None, metadata=_TIMEOUT)
    stdin: bytes | None = None
    max_output: int = field(default=DEFAULT_MAX_OUTPUT, metadata=_MAX_OUTPUT)

    def __post_init__(self) -> None:
        _text_to_bytes(self, "stdin")
        if not self.cmd:
            raise InvalidSpec("session exec needs cmd: a shell command string", field="cmd")


@dataclass(frozen=True)
class Closed(Message):
    """The id of the session that was closed."""

    closed: str


# --- files (query parameters, raw bodies) -----------------------------------------------------

_PATH = _limits(minLength=1)
_OCTAL_MODE = re.compile(r"[0-7]{1,4}")


class _PathQuery(Message):
    """A query naming a path in the sandbox; the SDK's callers may pass a ``Path``."""

    path: str

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))


@dataclass(frozen=True)
class FileQuery(_PathQuery):
    """A path inside the sandbox."""

    path: str = field(metadata=_PATH)


@dataclass(frozen=True)
class ReadQuery(_PathQuery):
    """Up to ``length`` bytes of a file from ``offset``; -1 reads to the end. One answer holds at
    most ``MAX_READ`` bytes (256 MiB), -1 too: a full answer may have more after it."""

    path: str = field(metadata=_PATH)
    offset: int = field(default=0, metadata=_limits(minimum=0))
    length: int = field(default=-1, metadata=_limits(minimum=-1, maximum=MAX_READ))


@dataclass(frozen=True)
class WriteQuery(_PathQuery):
    """Write the body at ``offset``; ``truncate`` cuts the file there first; ``mode`` (octal)
    applies to a file this call creates. The sticky bit is refused: it means nothing on a file,
    and it is where a mode written in decimal lands (755 is 0o1363)."""

    path: str = field(metadata=_PATH)
    mode: str = field(default="644", metadata=_limits(pattern="^[0-7]{1,4}$"))
    offset: int = field(default=0, metadata=_limits(minimum=0))
    truncate: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.mode, str)
            and _OCTAL_MODE.fullmatch(self.mode)
            and int(self.mode, 8) & 0o1000
        ):
            raise InvalidSpec(
                f"mode {self.mode} (octal) sets the sticky bit, which means nothing on a file; "
                "was it written in decimal? (write 0o755, not 755)",
                field="mode",
            )


@dataclass(frozen=True)
class RemoveQuery(_PathQuery):
    """Remove a file, symlink or empty directory; ``recursive`` removes a tree."""

    path: str = field(metadata=_PATH)
    recursive: bool = False


@dataclass(frozen=True)
class LeaseRequest(Message):
    """Take a lease on ``sandboxes`` for ``holder`` (a trainer's name, for messages): renew it
    within ``ttl`` seconds or the node pauses them (``reclaim``: and reclaims their memory).
    Sandboxes of a lapsed lease are handed over and resumed."""

    sandboxes: tuple[str, ...] = field(metadata=_limits(minItems=1, maxItems=4096))
    ttl: float = field(default=10.0, metadata=_limits(minimum=0.2, maximum=86400))
    holder: str = ""
    reclaim: bool = False


@dataclass(frozen=True)
class ListQuery(Message):
    """``project``: only the sandboxes labelled with that project (``PROJECT_LABEL``), and
    with ``subtree`` those of the projects below it too; empty: every sandbox. The apiserver
    asks each node for the caller's own, so a list costs what the caller has, not what every
    tenant has. ``create_key``: only the sandbox a create under that key of ``project`` made
    (``CREATE_KEY_LABEL``), waited for while it is being made: how an apiserver that took over
    finds where a create sent again went."""

    project: str = ""
    subtree: bool = False
    create_key: str = ""


@dataclass(frozen=True)
class ReleaseQuery(Message):
    """``kill``: kill the lease's sandboxes too (else they stay as they are)."""

    kill: bool = False


@dataclass(frozen=True)
class InfraEvents(Message):
    """The infrastructure failures that struck a sandbox, oldest first."""

    events: tuple[InfraEvent, ...]


@dataclass(frozen=True)
class Trajectory(Message):
    """A trajectory log's steps, in order."""

    name: str
    entries: tuple[TrajectoryEntry, ...]

    def __post_init__(self) -> None:
        check_trajectory_name(self.name)


@dataclass(frozen=True)
class PauseQuery(Message):
    """``reclaim``: once the sandbox is paused, have the kernel reclaim what of its memory it
    can (page cache; its processes' own memory stays where the host has no swap)."""

    reclaim: bool = False


@dataclass(frozen=True)
class InputRequest(Message):
    """Input for a sandbox's display (``Feature.SCREEN``), sent in order: ``{"type": "key",
    "key": "a"}`` (a QEMU key name: ``a``, ``ret``, ``shift``), ``{"type": "move", "x": 10,
    "y": 20}``, ``{"type": "click", "x": 10, "y": 20, "button": "left"}`` (button optional:
    left, middle, right, wheel-up, wheel-down, side, extra). Coordinates are pixels of the
    screenshot."""

    events: tuple[Mapping[str, Any], ...] = field(
        metadata=_limits(minItems=1, maxItems=MAX_INPUT_EVENTS)
    )

    def __post_init__(self) -> None:
        if isinstance(self.events, AbcSequence) and not isinstance(self.events, str | bytes):
            checked = input_dicts(self.events)  # InvalidSpec names the bad event and field
            object.__setattr__(self, "events", tuple(checked))


@dataclass(frozen=True)
class InputSent(Message):
    """How many input events were sent."""

    sent: int


@dataclass(frozen=True)
class Written(Message):
    """How many bytes were written."""

    written: int


@dataclass(frozen=True)
class Removed(Message):
    """The path that was removed."""

    removed: str


@dataclass(frozen=True)
class DirListing(Message):
    """A directory's entries (lstat, without . and ..), sorted by name."""

    entries: tuple[FileEntry, ...]


# --- layers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackDiffRequest(Message):
    """Pack a running sandbox's writable layer into a snapshot layer over its layers.

    ``name`` defaults to ``snapshot-<id>``, ``version`` to the first 12 hex digits of its
    digest; ``exclude`` lists paths inside the sandbox left out (with all below them), and
    ``scrub`` also leaves out the usual scratch (/tmp, caches, shell histories, credentials).
    ``secrets`` maps a label ("hidden-test") to a text that must not be in the layer: the node
    scans the packed layer for it and fails with ``LeakFound`` (removing the layer) on a hit."""

    name: str | None = None
    version: str | None = None
    exclude: tuple[str, ...] = ()
    scrub: bool = True
    #: The URL of one of the node's layer sources to push the snapshot (and the parents it
    #: lacks) to, so other nodes can restore it; None: the node's own store only.
    source: str | None = None
    secrets: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.exclude, str):
            raise InvalidSpec(
                f"exclude must be a list of paths, not one string: {self.exclude!r}",
                field="exclude",
            )
        if isinstance(self.exclude, AbcSequence) and not isinstance(self.exclude, tuple):
            object.__setattr__(self, "exclude", tuple(self.exclude))
        if not isinstance(self.secrets, Mapping):
            raise InvalidSpec("secrets must map a label to its text", field="secrets")
        for label, text in self.secrets.items():
            if not isinstance(label, str) or not label.strip():
                raise InvalidSpec(f"secrets: bad label {label!r}", field="secrets")
            if not isinstance(text, str) or not text.strip():
                # Never echo a secret's text, even a malformed one.
                raise InvalidSpec(f"secrets: {label!r} has no text to scan for", field="secrets")


@dataclass(frozen=True)
class MemorySnapshotRequest(Message):
    """Save a running VM sandbox's memory, devices and disk of one instant under ``name``
    (default ``<id>-<unix time>``); it runs on."""

    name: str | None = None


@dataclass(frozen=True)
class RestoreRequest(Message):
    """Create ``count`` sandboxes from snapshot layer ``snapshot`` (``name@version``), each
    with its own writable layer over the snapshot and its parents; ``spec`` gives the rest
    (limits, env, labels: its layers and environment are replaced). All or nothing. A
    memory snapshot's name instead: VMs that go on from its instant, each with its own copy
    of its disk, with its spec (``spec`` gives only ttl and labels)."""

    snapshot: str = field(metadata=_limits(minLength=1))
    count: int = field(default=1, metadata=_limits(minimum=1))
    spec: SandboxSpec | None = None


@dataclass(frozen=True)
class LayerList(Message):
    """Every layer the node's layer sources hold, source by source."""

    layers: tuple[LayerInfo, ...]


@dataclass(frozen=True)
class PrefetchRequest(Message):
    """Layers (``name@version``) to warm on the node."""

    refs: tuple[str, ...] = field(metadata=_limits(minItems=1))

    def __post_init__(self) -> None:
        if isinstance(self.refs, str):
            raise InvalidSpec(
                f"refs must be a list of name@version strings, not one string: {self.refs!r}",
                field="refs",
            )
        if isinstance(self.refs, AbcSequence) and not isinstance(self.refs, (bytes, tuple)):
            object.__setattr__(self, "refs", tuple(self.refs))


#: The longest image name a resolve takes (docker's own limit for a reference is 255 for the
#: repository; a tag and digest add at most 200 more).
MAX_IMAGE_NAME = 512


@dataclass(frozen=True)
class ResolveImageRequest(Message):
    """A docker image to make into a base layer, named as a Dockerfile's ``FROM`` names it
    (``python:3.11-slim-bookworm``, ``ghcr.io/org/tool:1``, ``name@sha256:...``)."""

    image: str = field(metadata=_limits(minLength=1, maxLength=MAX_IMAGE_NAME))


@dataclass(frozen=True)
class PrefetchedLayer(Message):
    """What warming one layer did: ``mode`` is local, whole or on-demand; ``fetched`` counts
    bytes for whole images and chunks for on-demand layers (of ``chunks``)."""

    layer: str
    source: str
    mode: str
    fetched: int
    chunks: int | None = None


@dataclass(frozen=True)
class PrefetchResult(Message):
    """One row per layer asked for."""

    layers: tuple[PrefetchedLayer, ...]
