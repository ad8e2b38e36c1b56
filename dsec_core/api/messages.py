"""The node API's own messages: request bodies, query parameters and the replies that are not
already records (``SandboxSpec``, ``SandboxInfo``, ``ExecResult``, ... come from ``records``).

Each is a small frozen dataclass; ``to_dict``/``from_dict`` go through its JSON shape
(``shapes``), the same one the server decodes with and the OpenAPI document shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidSpec
from ..records import (
    ExecResult,
    FileEntry,
    LayerInfo,
    PolicyState,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)
from .shapes import decoder, encoder

__all__ = [
    "Closed",
    "CreateRequest",
    "CreateResult",
    "DirListing",
    "ErrorBody",
    "ErrorResponse",
    "ExecRequest",
    "ExecResult",
    "FileEntry",
    "FileQuery",
    "Killed",
    "LayerInfo",
    "LayerList",
    "Message",
    "NodeCapacity",
    "NodeStatus",
    "PolicySettings",
    "PolicyState",
    "PolicyStates",
    "PrefetchRequest",
    "PrefetchResult",
    "PrefetchedLayer",
    "ReadQuery",
    "RemoveQuery",
    "Removed",
    "SandboxInfo",
    "SandboxList",
    # records that travel as they are
    "SandboxSpec",
    "SandboxUsage",
    "SessionExecRequest",
    "SessionList",
    "SessionOpenRequest",
    "SessionOpened",
    "WriteQuery",
    "Written",
]

DEFAULT_MAX_OUTPUT = 1 << 20


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
class NodeStatus(Message):
    """A node daemon: its version, pid, home, sandboxes, capacity, backends and layer sources."""

    version: str
    pid: int
    home: str
    sandboxes: int
    capacity: NodeCapacity
    backends: tuple[str, ...]
    layer_sources: tuple[str, ...]


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
    """Create ``count`` sandboxes from one spec."""

    spec: SandboxSpec
    count: int = field(default=1, metadata=_limits(minimum=1))


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


@dataclass(frozen=True)
class Killed(Message):
    """The id of the sandbox that was killed."""

    killed: str


# --- commands and sessions --------------------------------------------------------------------


@dataclass(frozen=True)
class ExecRequest(Message):
    """Run a command: a string through ``/bin/sh -c``, an array as argv (PATH lookup).

    ``timeout`` in seconds (null: none) kills the whole process tree; ``stdin`` is base64 (null:
    /dev/null); output past ``max_output`` bytes per stream is dropped. When the command exits,
    the processes it left running are killed unless ``background``. ``exclusive`` kills every
    other process in the sandbox first (for verifiers).
    """

    cmd: str | tuple[str, ...] = field(metadata=_limits(minLength=1, minItems=1))
    timeout: float | None = None
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    stdin: bytes | None = None
    max_output: int = field(default=DEFAULT_MAX_OUTPUT, metadata=_limits(minimum=0))
    background: bool = False
    exclusive: bool = False

    def __post_init__(self) -> None:
        # The SDK hands over what its callers pass: a list, a str stdin, any mapping.
        if not isinstance(self.cmd, (str, tuple)):
            object.__setattr__(self, "cmd", tuple(self.cmd))
        if isinstance(self.stdin, str):
            object.__setattr__(self, "stdin", self.stdin.encode())
        if self.env is not None:
            object.__setattr__(self, "env", dict(self.env) or None)
        if not self.cmd:
            raise InvalidSpec("exec needs cmd: a non-empty string or list of strings", field="cmd")


@dataclass(frozen=True)
class SessionOpenRequest(Message):
    """Start a persistent shell; ``cwd`` and ``env`` default to the sandbox's."""

    cwd: str | None = None
    env: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.env is not None:
            object.__setattr__(self, "env", dict(self.env) or None)


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
    timeout: float | None = None
    stdin: bytes | None = None
    max_output: int = field(default=DEFAULT_MAX_OUTPUT, metadata=_limits(minimum=0))

    def __post_init__(self) -> None:
        if isinstance(self.stdin, str):
            object.__setattr__(self, "stdin", self.stdin.encode())
        if not self.cmd:
            raise InvalidSpec("session exec needs cmd: a shell command string", field="cmd")


@dataclass(frozen=True)
class Closed(Message):
    """The id of the session that was closed."""

    closed: str


# --- files (query parameters, raw bodies) -----------------------------------------------------

_PATH = _limits(minLength=1)


@dataclass(frozen=True)
class FileQuery(Message):
    """A path inside the sandbox."""

    path: str = field(metadata=_PATH)


@dataclass(frozen=True)
class ReadQuery(Message):
    """Up to ``length`` bytes (-1: to the end) of a file from ``offset``."""

    path: str = field(metadata=_PATH)
    offset: int = field(default=0, metadata=_limits(minimum=0))
    length: int = field(default=-1, metadata=_limits(minimum=-1))


@dataclass(frozen=True)
class WriteQuery(Message):
    """Write the body at ``offset``; ``truncate`` cuts the file there first; ``mode`` (octal)
    applies to a file this call creates."""

    path: str = field(metadata=_PATH)
    mode: str = field(default="644", metadata=_limits(pattern="^[0-7]{1,4}$"))
    offset: int = field(default=0, metadata=_limits(minimum=0))
    truncate: bool = True


@dataclass(frozen=True)
class RemoveQuery(Message):
    """Remove a file, symlink or empty directory; ``recursive`` removes a tree."""

    path: str = field(metadata=_PATH)
    recursive: bool = False


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
class LayerList(Message):
    """Every layer the node's layer sources hold, source by source."""

    layers: tuple[LayerInfo, ...]


@dataclass(frozen=True)
class PrefetchRequest(Message):
    """Layers (``name@version``) to warm on the node."""

    refs: tuple[str, ...] = field(metadata=_limits(minItems=1))

    def __post_init__(self) -> None:
        object.__setattr__(self, "refs", tuple(self.refs))


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
