"""The one route table of the node API: the daemon serves it, the SDK calls it, and the OpenAPI
document (``dsec node openapi``) describes it.

Each ``Route`` names the ``Node``/SDK method it maps to, its HTTP method and path template, and
the types of its query parameters, body and answer: a message or record (JSON), ``RAW`` bytes
(``application/octet-stream``), or ``dict`` (any JSON object). The per-route encoders and
decoders are built from those types on first use and kept, so a request costs no reflection.

Each route with a body says how large it may be (``max_body``: ``MAX_SPEC_BODY`` for a spec or a
list of names, ``MAX_BODY`` for what carries stdin or files, ``MAX_UPLOAD`` for a raw upload),
and every JSON body or answer is read with ``load_json``, which refuses nesting deeper than
``MAX_DEPTH``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from ..errors import InvalidSpec
from ..records import parse_size
from .messages import (
    Closed,
    CreateRequest,
    CreateResult,
    DirListing,
    ExecRequest,
    ExecResult,
    FileEntry,
    FileQuery,
    FnCallRequest,
    FnCallResult,
    InfraEvents,
    InputRequest,
    InputSent,
    JudgeResult,
    JudgeSpec,
    Killed,
    LayerInfo,
    LayerList,
    LeaseInfo,
    LeaseRequest,
    ListQuery,
    MemorySnapshot,
    MemorySnapshotRequest,
    NodeProbe,
    NodeStatus,
    PackDiffRequest,
    PauseQuery,
    PolicySettings,
    PolicyState,
    PolicyStates,
    PrefetchRequest,
    PrefetchResult,
    ProcessInfo,
    ProcessInputRequest,
    ProcessList,
    ProcessOutputRequest,
    ProcessResizeRequest,
    ProcessSignalRequest,
    ProcessStartRequest,
    ReadQuery,
    ReleaseQuery,
    Removed,
    RemoveQuery,
    ResolvedImage,
    ResolveImageRequest,
    RestoreRequest,
    SandboxInfo,
    SandboxList,
    SandboxUsage,
    SessionExecRequest,
    SessionList,
    SessionOpened,
    SessionOpenRequest,
    Trajectory,
    TtlRequest,
    WarmSettings,
    WarmStatus,
    WriteQuery,
    Written,
)
from .shapes import decoder, encoder, query_decoder, query_encoder

__all__ = [
    "IDEMPOTENCY_KEY",
    "JSON",
    "MAX_BODY",
    "MAX_DEPTH",
    "MAX_ITEMS",
    "MAX_SPEC_BODY",
    "MAX_UPLOAD",
    "NDJSON",
    "OCTETS",
    "PNG",
    "RAW",
    "ROUTES",
    "Route",
    "dump_json",
    "load_json",
]

#: The header of a create that may be sent more than once (``CREATE_KEY_LABEL``): the node
#: puts its value on the sandbox as that label and answers a create whose key a live sandbox
#: of the project has with that sandbox. A header rather than the label in the body, so that a
#: trainer's one spec stays one body (the apiserver and nodes keep bodies they decoded).
IDEMPOTENCY_KEY = "idempotency-key"
#: A body or answer of raw bytes (``application/octet-stream``).
RAW = bytes
JSON = "application/json"
OCTETS = "application/octet-stream"
#: A ``RAW`` answer that is a PNG image (``Route.raw_type``).
PNG = "image/png"
#: A ``RAW`` answer of JSON objects, one per line, as they come (``exec_stream``).
NDJSON = "application/x-ndjson"
#: The largest JSON body a node reads (``RequestTooLarge`` beyond it), on the routes that carry
#: stdin or files (exec, sessions' exec, fncall, judge): room for an exec's 16 MiB of stdin in
#: base64 and a command and environment as large as the agent takes.
MAX_BODY = 64 << 20
#: The largest body of the other JSON routes: a spec, a list of ids or layer names, a policy's
#: settings. Each is read whole and decoded, so what one request can make a server hold stays
#: small.
MAX_SPEC_BODY = 1 << 20
#: The largest raw upload (``write_file``; the E2B API's ``POST /files``), ``DSEC_MAX_UPLOAD``
#: (a size: 512M, 4G, or bytes). Raw bodies stream through in pieces, so this bounds disk and
#: time, not memory.
MAX_UPLOAD: int = parse_size(os.environ.get("DSEC_MAX_UPLOAD") or 4 << 30, "DSEC_MAX_UPLOAD") or 0
#: The deepest nesting of arrays and objects in a JSON body or answer (``load_json``): more
#: than any message has, and far less than what makes a recursive decoder or encoder fail.
MAX_DEPTH = 64
#: The most values a request's JSON body may hold (counted by its separators): what a body
#: that is mostly separators makes in memory is many times its size, and no request needs
#: this many (a command's argv is bounded by ARG_MAX, stdin and files travel as base64).
MAX_ITEMS = 1 << 20


def dump_json(value: Any) -> bytes:
    """Compact JSON; NaN and infinities are refused (they are not JSON)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class Route:
    """One operation of the API."""

    name: str  # the SDK and Node method it maps to
    method: str
    path: str  # a template: /v1/sandboxes/{sid}/exec
    summary: str
    response: Any  # a message or record class, RAW, or dict
    body: Any = None  # a message class, RAW, or None
    query: type | None = None  # a message of scalar fields, one query parameter each
    status: int = 200
    timeout: float | None = 60.0  # how long a client waits for the answer by default
    #: Sending it twice does no more than sending it once, so a client may send it again when
    #: the node went away before answering (GETs, and deletes of a named thing).
    idempotent: bool | None = None  # None: only a GET is
    #: The body's ``timeout`` bounds the call instead: a client waits that long plus a grace
    #: period, and running out of it means the command timed out (``ExecTimeout``).
    exec_timeout: bool = False
    #: The content type of a ``RAW`` answer.
    raw_type: str = OCTETS
    #: The largest body the route takes, in bytes (``RequestTooLarge`` beyond it; 0: none).
    max_body: int = 0
    params: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(re.findall(r"{(\w+)}", self.path)))
        if self.idempotent is None:
            object.__setattr__(self, "idempotent", self.method == "GET")
        if (self.body is None) != (self.max_body == 0):
            raise ValueError(f"route {self.name}: max_body is for a route with a body, and only")

    @property
    def body_type(self) -> str | None:
        """The request's content type, or None if it has no body."""
        return None if self.body is None else OCTETS if self.body is RAW else JSON

    @property
    def response_type(self) -> str:
        return self.raw_type if self.response is RAW else JSON

    # --- the client's side ----------------------------------------------------------------
    #
    # Both check what they encode as the node's decoders would, so a bad argument is an
    # ``InvalidSpec`` naming its field in the caller, before anything is sent.

    def target(self, params: Mapping[str, Any], query: Any = None) -> str:
        """The request target: the path with ``params`` filled in, and the query string."""
        path = self.path
        if self.params:
            path = path.format_map({k: _path_param(k, params.get(k)) for k in self.params})
        if query is not None:
            path += "?" + urlencode(self._encode_query(query), quote_via=quote)
        return path

    def encode_body(self, body: Any) -> bytes | None:
        if self.body is None:
            return None
        if self.body is RAW:
            if not isinstance(body, (bytes, bytearray, memoryview)):
                raise InvalidSpec(
                    f"{self.name}: data must be bytes, got {type(body).__name__}", field="data"
                )
            return bytes(body)
        return self._encode_body(body)

    def decode_response(self, content: bytes) -> Any:
        """The answer of a 2xx response, typed; ``InvalidSpec`` if it does not fit."""
        return self._decode_response(content)

    # --- the server's side ----------------------------------------------------------------
    def decode_query(self, params: Mapping[str, str]) -> Any:
        if self.query is None:
            if params:
                raise _no_query(self)
            return None
        return self._decode_query(params)

    def decode_body(self, content: bytes) -> Any:
        return self._decode_body(content)

    def encode_response(self, value: Any) -> bytes:
        return self._encode_response(value)

    # --- built once per route -------------------------------------------------------------
    @functools.cached_property
    def _encode_query(self) -> Callable[[Any], list[tuple[str, str]]]:
        assert self.query is not None, f"route {self.name} takes no query parameters"
        encode = query_encoder(self.query)
        check = _checked(self.query)
        return lambda query: encode(check(query))

    @functools.cached_property
    def _decode_query(self) -> Callable[[Mapping[str, str]], Any]:
        assert self.query is not None
        return query_decoder(self.query)

    @functools.cached_property
    def _encode_body(self) -> Callable[[Any], bytes]:
        encode = encoder(self.body) or _same
        check = _checked(self.body)
        where = self.body.__name__

        def encode_checked(body: Any) -> bytes:
            value = encode(check(body))
            try:
                return dump_json(value)
            except ValueError as e:  # NaN or infinity in a free-form (Any) value
                raise InvalidSpec(f"{where}: not JSON: {e}") from None

        return encode_checked

    @functools.cached_property
    def _decode_body(self) -> Callable[[bytes], Any]:
        if self.body is None:
            return lambda content: None
        if self.body is RAW:
            return bytes
        decode = decoder(self.body, strict=True)
        where = self.body.__name__
        return lambda content: decode(
            load_json(content or b"{}", where, max_items=MAX_ITEMS), where
        )

    @functools.cached_property
    def _encode_response(self) -> Callable[[Any], bytes]:
        if self.response is RAW:
            return bytes
        encode = encoder(self.response) or _same
        return lambda value: dump_json(encode(value))

    @functools.cached_property
    def _decode_response(self) -> Callable[[bytes], Any]:
        if self.response is RAW:
            return bytes
        decode = decoder(self.response, strict=False)
        where = getattr(self.response, "__name__", "answer")
        return lambda content: decode(load_json(content, where), where)


def _same(value: Any) -> Any:
    return value


#: How the SDK names path parameters in its methods' arguments.
_PARAM_ARGS = {"sid": "sandbox_id", "ses": "session_id"}


def _path_param(name: str, value: Any) -> str:
    arg = _PARAM_ARGS.get(name, name)
    if not isinstance(value, str) or not value:
        raise InvalidSpec(f"{arg} must be a non-empty string, got {value!r}", field=arg)
    try:
        return quote(value, safe="")
    except UnicodeEncodeError:  # a lone surrogate is no text
        raise InvalidSpec(f"{arg} must be text, got {value!r}", field=arg) from None


def _checked(cls: type) -> Callable[[Any], Any]:
    """A function that returns a message unchanged if the node's decoder would take its JSON
    form, and raises the decoder's ``InvalidSpec`` (naming the field) if not."""
    encode = encoder(cls) or _same
    decode = decoder(cls, strict=True)
    where = cls.__name__

    def check(message: Any) -> Any:
        if not isinstance(message, cls):
            raise InvalidSpec(f"expected a {where}, got {type(message).__name__}")
        try:
            value = encode(message)
        except (TypeError, ValueError) as e:  # a value with no JSON form: a set, an object
            raise InvalidSpec(f"{where}: {e}") from None
        decode(value, where)
        return message

    return check


def load_json(
    content: bytes | str, where: str, max_depth: int = MAX_DEPTH, max_items: int | None = None
) -> Any:
    """``content`` as JSON, its arrays and objects nested at most ``max_depth`` deep (and, for
    a request's body, with fewer than ``max_items`` values); else ``InvalidSpec`` naming
    ``where`` (the body it is), never a ``RecursionError``.

    ``json.loads`` itself stops a deep document at the interpreter's recursion limit (some
    hundreds of levels, at once: a 64 MiB body of ``[`` costs microseconds); what it did
    load is then measured one level at a time, without recursing, so nothing that decodes,
    re-encodes or copies the value later can recurse deeper than ``max_depth``.
    """
    # What json.loads makes of a body is many times its size when the body is mostly
    # separators (a 64 MiB array of 0s is 32 million list slots): bound the values first,
    # counting separators, which only overcounts (a comma inside a string counts too).
    separators = content.count(b",") if isinstance(content, bytes) else content.count(",")
    if max_items is not None and separators >= max_items:
        raise InvalidSpec(
            f"{where}: the body has {separators + 1} or more values; the limit is {max_items}",
            field="body",
            limit=max_items,
        )
    try:
        value = json.loads(content)
    except RecursionError:
        raise _too_deep(where, max_depth) from None
    except ValueError as e:  # UnicodeDecodeError is one too
        raise InvalidSpec(f"{where}: the body is not JSON: {e}", field="body") from None
    if _deeper_than(value, max_depth):
        raise _too_deep(where, max_depth)
    return value


_NESTED = frozenset({dict, list})


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` (as ``json.loads`` made it) nests more than ``limit`` levels. A level
    whose items are all scalars costs one pass in C (``isdisjoint`` over their types)."""
    level = [value] if type(value) in _NESTED else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for v in level:
            items = v.values() if type(v) is dict else v
            if not _NESTED.isdisjoint(map(type, items)):
                below.extend(x for x in items if type(x) in _NESTED)
        level = below
    return False


def _too_deep(where: str, limit: int) -> InvalidSpec:
    return InvalidSpec(
        f"{where}: the body nests arrays and objects more than {limit} levels deep",
        field="body",
        limit=limit,
    )


def _no_query(route: Route) -> InvalidSpec:
    return InvalidSpec(f"{route.method} {route.path} takes no query parameters")


_SB = "/v1/sandboxes/{sid}"

ROUTES: dict[str, Route] = {
    r.name: r
    for r in (
        Route("node_info", "GET", "/v1/node", "What the node daemon is and holds", NodeStatus),
        Route("openapi", "GET", "/v1/openapi.json", "This API as an OpenAPI 3.1 document", dict),
        Route(
            "probe",
            "GET",
            "/v1/node/probe",
            "What the control plane's watcher asks each interval: the node's load, its mounted "
            "layers and warm environments, and its live sandboxes by project",
            NodeProbe,
            timeout=10.0,
        ),
        Route(
            "warm",
            "GET",
            "/v1/warm",
            "The node's warm pools: what it keeps started for creates to claim",
            WarmStatus,
        ),
        Route(
            "set_warm",
            "PUT",
            "/v1/warm",
            "Set the warm targets (replacing those set before) and the automatic mode",
            WarmStatus,
            body=WarmSettings,
            idempotent=True,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "create",
            "POST",
            "/v1/sandboxes",
            "Create one or more sandboxes from a spec",
            CreateResult,
            body=CreateRequest,
            status=201,
            timeout=300.0,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "list",
            "GET",
            "/v1/sandboxes",
            "Every sandbox on the node (or a project's)",
            SandboxList,
            query=ListQuery,
        ),
        Route("get", "GET", _SB, "One sandbox", SandboxInfo),
        Route(
            "kill",
            "DELETE",
            _SB,
            "Kill a sandbox and remove everything it left",
            Killed,
            idempotent=True,
        ),
        Route("usage", "GET", _SB + "/usage", "What a sandbox uses now", SandboxUsage),
        Route(
            "pause",
            "POST",
            _SB + "/pause",
            "Stop every process of a sandbox where it is (memory, files and sessions stay)",
            SandboxInfo,
            query=PauseQuery,
            idempotent=True,
        ),
        Route(
            "resume",
            "POST",
            _SB + "/resume",
            "Let a paused sandbox's processes go on (a no-op if it is not paused)",
            SandboxInfo,
            idempotent=True,
        ),
        Route(
            "events",
            "GET",
            _SB + "/events",
            "The infrastructure failures that struck a sandbox (preempted, out of memory, ...)",
            InfraEvents,
        ),
        Route(
            "lease",
            "POST",
            "/v1/leases",
            "Take a lease on sandboxes: renew it within its ttl or the node pauses them",
            LeaseInfo,
            body=LeaseRequest,
            status=201,
            max_body=MAX_SPEC_BODY,
        ),
        Route("lease_get", "GET", "/v1/leases/{lease}", "One lease", LeaseInfo),
        Route(
            "lease_renew",
            "POST",
            "/v1/leases/{lease}/renew",
            "Renew a lease (a lapsed one is held again and what its lapse paused resumes)",
            LeaseInfo,
            idempotent=True,
        ),
        Route(
            "lease_release",
            "DELETE",
            "/v1/leases/{lease}",
            "End a lease; its sandboxes stay as they are, or are killed with ?kill=true",
            LeaseInfo,
            query=ReleaseQuery,
        ),
        Route(
            "trajectory",
            "GET",
            "/v1/trajectories/{trajectory}",
            "A trajectory log: every command logged, with its result",
            Trajectory,
        ),
        Route(
            "remove_trajectory",
            "DELETE",
            "/v1/trajectories/{trajectory}",
            "Remove a trajectory log",
            Removed,
            idempotent=True,
        ),
        Route(
            "policies",
            "GET",
            _SB + "/policies",
            "The sandbox's security policies: in force (with what they saw) or why not",
            PolicyStates,
        ),
        Route(
            "set_policy",
            "PUT",
            _SB + "/policies/{policy}",
            "Change a live security policy of a running sandbox",
            PolicyState,
            body=PolicySettings,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "exec",
            "POST",
            _SB + "/exec",
            "Run a command in a sandbox",
            ExecResult,
            body=ExecRequest,
            exec_timeout=True,
            max_body=MAX_BODY,
        ),
        Route(
            "exec_stream",
            "POST",
            _SB + "/exec/stream",
            "Run a command in a sandbox, its output streamed as it comes: one JSON object a "
            'line, {"stdout": base64} or {"stderr": base64}, then {"result": ExecResult} '
            '(its stdout and stderr empty) or {"error": ...}',
            RAW,
            body=ExecRequest,
            raw_type=NDJSON,
            exec_timeout=True,
            max_body=MAX_BODY,
        ),
        Route(
            "process_start",
            "POST",
            _SB + "/processes",
            "Start a command that runs on between clients, with stdin kept open or on a "
            "terminal of its own: attach to its output, send input, resize and signal it later",
            ProcessInfo,
            body=ProcessStartRequest,
            status=201,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "processes",
            "GET",
            _SB + "/processes",
            "The sandbox's processes started with process_start (and those just ended)",
            ProcessList,
        ),
        Route("process", "GET", _SB + "/processes/{pid}", "One process", ProcessInfo),
        Route(
            "process_output",
            "POST",
            _SB + "/processes/{pid}/output",
            "A process's output, streamed as it comes (from the start of what is kept, or "
            'from now): one JSON object a line, {"stdout": base64} or {"stderr": base64}, '
            'then {"result": ExecResult} (its stdout and stderr empty) or {"error": ...}',
            RAW,
            body=ProcessOutputRequest,
            raw_type=NDJSON,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "process_input",
            "POST",
            _SB + "/processes/{pid}/input",
            "Send input to a process's stdin or terminal, and/or end its input",
            ProcessInfo,
            body=ProcessInputRequest,
            max_body=MAX_BODY,
        ),
        Route(
            "process_resize",
            "POST",
            _SB + "/processes/{pid}/resize",
            "Resize a process's terminal",
            ProcessInfo,
            body=ProcessResizeRequest,
            idempotent=True,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "process_signal",
            "POST",
            _SB + "/processes/{pid}/signal",
            "Send a signal to a process (KILL by default)",
            ProcessInfo,
            body=ProcessSignalRequest,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "set_ttl",
            "PUT",
            _SB + "/ttl",
            "Set a sandbox's time to live, from now (null: until killed)",
            SandboxInfo,
            body=TtlRequest,
            idempotent=True,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "session_open",
            "POST",
            _SB + "/sessions",
            "Start a persistent shell",
            SessionOpened,
            body=SessionOpenRequest,
            status=201,
            max_body=MAX_SPEC_BODY,
        ),
        Route("sessions", "GET", _SB + "/sessions", "The sandbox's live sessions", SessionList),
        Route(
            "session_exec",
            "POST",
            _SB + "/sessions/{ses}/exec",
            "Run a command in a session",
            ExecResult,
            body=SessionExecRequest,
            exec_timeout=True,
            max_body=MAX_BODY,
        ),
        Route(
            "session_close",
            "DELETE",
            _SB + "/sessions/{ses}",
            "Close a session",
            Closed,
            idempotent=True,
        ),
        Route("read_file", "GET", _SB + "/file", "Read (part of) a file", RAW, query=ReadQuery),
        Route(
            "write_file",
            "PUT",
            _SB + "/file",
            "Write (part of) a file",
            Written,
            body=RAW,
            query=WriteQuery,
            max_body=MAX_UPLOAD,
        ),
        Route(
            "remove",
            "DELETE",
            _SB + "/file",
            "Remove a file or a tree",
            Removed,
            query=RemoveQuery,
            idempotent=True,
        ),
        Route(
            "screenshot",
            "GET",
            _SB + "/screenshot",
            "The sandbox's display now, as a PNG image (backends with a screen: vm)",
            RAW,
            raw_type=PNG,
        ),
        Route(
            "input",
            "POST",
            _SB + "/input",
            "Send key presses, pointer moves and clicks to the sandbox's display, in order",
            InputSent,
            body=InputRequest,
            max_body=MAX_SPEC_BODY,
        ),
        Route("list_dir", "GET", _SB + "/ls", "List a directory", DirListing, query=FileQuery),
        Route("stat", "GET", _SB + "/stat", "lstat a path", FileEntry, query=FileQuery),
        Route(
            "fncall",
            "POST",
            "/v1/fncall",
            "Run a short stateless call in a warm, reset member of an environment's FnCall pool",
            FnCallResult,
            body=FnCallRequest,
            exec_timeout=True,
            max_body=MAX_BODY,
        ),
        Route(
            "judge",
            "POST",
            "/v1/judge",
            "Judge a submission: compile once, then each test case with its own time and "
            "memory limits, in a warm member of the environment's FnCall pool",
            JudgeResult,
            body=JudgeSpec,
            timeout=None,
            max_body=MAX_BODY,
        ),
        Route(
            "pack_diff",
            "POST",
            _SB + "/pack_diff",
            "Pack a running sandbox's writable layer into a snapshot layer over its layers "
            "(the sandbox is frozen meanwhile)",
            LayerInfo,
            body=PackDiffRequest,
            status=201,
            timeout=600.0,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "snapshot_memory",
            "POST",
            _SB + "/memory_snapshot",
            "Save a running VM sandbox's memory, devices and disk at one instant (it runs "
            "on); restore starts sandboxes from that instant",
            MemorySnapshot,
            body=MemorySnapshotRequest,
            status=201,
            timeout=600.0,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "memory_snapshot",
            "GET",
            "/v1/memory-snapshots/{snapshot}",
            "A memory snapshot: when and from which sandbox it was made, what it holds on "
            "disk, and the spec its restores take",
            MemorySnapshot,
        ),
        Route(
            "remove_memory_snapshot",
            "DELETE",
            "/v1/memory-snapshots/{snapshot}",
            "Remove a memory snapshot",
            Removed,
            idempotent=True,
        ),
        Route(
            "restore",
            "POST",
            "/v1/restore",
            "Create sandboxes that each start from a snapshot's state, all or nothing",
            SandboxList,
            body=RestoreRequest,
            status=201,
            timeout=300.0,
            max_body=MAX_SPEC_BODY,
        ),
        Route("layers", "GET", "/v1/layers", "Every layer of the node's layer sources", LayerList),
        Route(
            "prefetch",
            "POST",
            "/v1/layers/prefetch",
            "Warm layers on the node",
            PrefetchResult,
            body=PrefetchRequest,
            timeout=None,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "resolve_image",
            "POST",
            "/v1/layers/resolve-image",
            "Make a docker image (by name, as FROM names it) into a base layer: from the node's "
            "docker, else its layer sources",
            ResolvedImage,
            body=ResolveImageRequest,
            timeout=None,
            max_body=MAX_SPEC_BODY,
        ),
    )
}
