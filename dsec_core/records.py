"""Small immutable records for specs and results; every public API takes and returns these.

Each record converts to and from plain JSON (``to_dict``/``from_dict``) for the daemon's HTTP
API and the on-disk state; nothing else passes dicts around.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import AdmissionRejected, CommandFailed, ExecTimeout, InvalidSpec

__all__ = [
    "BUILD_LABEL",
    "BUILD_NOTES_DIR",
    "COMPARE_MODES",
    "CREATE_KEY_LABEL",
    "DEFAULT_BACKEND",
    "DEFAULT_DISK",
    "DEVICE_MODES",
    "INFRA_KINDS",
    "LAYER_KINDS",
    "MAX_CREATE_KEY",
    "MAX_LABELS",
    "MAX_LABEL_BYTES",
    "POOL_LABEL",
    "PROJECT_LABEL",
    "QOS_CLASSES",
    "SANDBOX_START_MEMORY",
    "STAGED_PREFIX",
    "VERDICTS",
    "CaseResult",
    "DeviceRequest",
    "ExecOutput",
    "ExecResult",
    "FileEntry",
    "FnCallResult",
    "IdMap",
    "InfraEvent",
    "JudgeCase",
    "JudgeResult",
    "JudgeSpec",
    "LayerInfo",
    "LayerRef",
    "LeaseInfo",
    "Limits",
    "MemorySnapshot",
    "NodeLoad",
    "PolicyState",
    "ProcessInfo",
    "ResolvedImage",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxUsage",
    "TrajectoryEntry",
    "device_requests",
    "parse_size",
]

#: ``snapshot``: a sandbox's writable layer packed by ``pack_diff``; it only makes sense on top
#: of the layers it was taken over (``LayerInfo.parents``).
LAYER_KINDS = ("base", "workspace", "toolkit", "snapshot")
#: CPU classes: "ls" (latency-sensitive: normal scheduling) and "be" (best-effort: runs only on
#: CPU time the rest leave idle). ``SandboxSpec.qos``; the backend enforces them.
QOS_CLASSES = ("ls", "be")
#: The backend of a sandbox whose spec names none and whose environment names none either.
DEFAULT_BACKEND = "container"
#: How a sandbox holds a device (``DeviceRequest.mode``): "exclusive", alone (no other sandbox,
#: shared or not, gets it meanwhile), or "shared" with at most the node's share cap of others.
DEVICE_MODES = ("exclusive", "shared")
#: Infrastructure failures (``InfraEvent.kind``), told apart from a task's own failure so a
#: trainer can mask them rather than score them: "preempted" (its trainer's lease lapsed and the
#: node paused it), "out_of_memory" (the kernel's OOM killer struck in it), "start_timeout" (it
#: took longer to start than its ``start_timeout``), "node_lost" (its node stopped answering).
INFRA_KINDS = (
    "preempted",
    "out_of_memory",
    "start_timeout",
    "node_lost",
    "crashed",
    "disk_full",
    "source_unavailable",
)
#: The kernel's PID_MAX_LIMIT on 64-bit: a cgroup's pids.max refuses anything above it.
MAX_PIDS = 1 << 22
#: A sandbox's writable layer: its size unless the spec says otherwise, and the bounds. Below
#: 16M a filesystem's own metadata is most of it; 1T is far beyond any one sandbox's need (and
#: a fresh filesystem of that size already writes 2.6 MB of metadata at each create).
DEFAULT_DISK = 10 << 30
MIN_DISK = 16 << 20
MAX_DISK = 1 << 40

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str | None, what: str = "size") -> int | None:
    """``"512M"``, ``"2GiB"``, ``1048576`` -> bytes (binary units); ``None`` stays ``None``."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        if isinstance(value, int) and value < 0:
            raise InvalidSpec(f"{what} must not be negative: {value}", field=what)
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise InvalidSpec(
        f"{what}: cannot read {value!r} as a size (try 512M, 2G or bytes)", field=what
    )


def _check_type(name: str, value: Any, kinds: type | tuple[type, ...], what: str) -> None:
    """``InvalidSpec`` naming field ``name`` unless ``value`` is one of ``kinds`` (never a bool
    where a number or string is asked for: ``True`` is an int to Python, not to JSON)."""
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        raise InvalidSpec(f"{name} must be {what}, got {_shown(value)}", field=name)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_finite(name: str, value: float) -> None:
    try:
        ok = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        raise InvalidSpec(f"{name} must be a finite number, got {_shown(value)}", field=name)


def _check_strings(name: str, value: Any) -> None:
    """A mapping of strings to strings (environment variables, labels)."""
    _check_type(name, value, Mapping, "an object of strings")
    for key, item in value.items():
        _check_type(name, key, str, "an object with string keys")
        _check_type(f"{name}.{key}", item, str, "a string")


#: The most labels a sandbox carries, and their most bytes (names and values, UTF-8): a
#: sandbox's labels travel with it in every listing, so one tenant's could otherwise make
#: every list slow.
MAX_LABELS = 128
MAX_LABEL_BYTES = 16 << 10


def _check_labels(labels: Mapping[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidSpec(
            f"labels: {len(labels)} of them; a sandbox carries at most {MAX_LABELS}",
            field="labels",
            limit=MAX_LABELS,
        )
    size = sum(
        len(k.encode(errors="replace")) + len(v.encode(errors="replace")) for k, v in labels.items()
    )
    if size > MAX_LABEL_BYTES:
        raise InvalidSpec(
            f"labels: {size} bytes of names and values; the most is {MAX_LABEL_BYTES}",
            field="labels",
            limit=MAX_LABEL_BYTES,
        )


def _plain(value: Any) -> Any:
    """``value`` with records turned into dicts, containers copied (as ``dataclasses.asdict``
    does, without its deep copy of every leaf: 60 us a sandbox record, a tenth of a second to
    list 2,000)."""
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Record:
    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names
        if unknown:
            raise InvalidSpec(
                f"{cls.__name__}: unknown field(s) {sorted(unknown)}; known: {sorted(names)}",
                fields=sorted(unknown),
            )
        try:
            return cls(**data)
        except TypeError as e:
            raise InvalidSpec(f"{cls.__name__}: {e}") from e


@dataclass(frozen=True)
class LayerRef(_Record):
    """A layer named ``name@version``; ``version`` may be omitted to mean the newest."""

    name: str
    version: str | None = None

    @classmethod
    def parse(cls, text: str) -> LayerRef:
        name, _, version = text.partition("@")
        if not name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise InvalidSpec(f"bad layer reference {text!r}: expected name@version", ref=text)
        if version and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", version):
            raise InvalidSpec(f"bad layer version in {text!r}", ref=text)
        return cls(name, version or None)

    def __str__(self) -> str:
        return f"{self.name}@{self.version}" if self.version else self.name


@dataclass(frozen=True)
class LayerInfo(_Record):
    """A built layer in a store: a read-only EROFS image addressed by its sha256 digest."""

    name: str
    version: str
    kind: str
    digest: str  # "sha256:<hex>"
    size: int
    created: float = 0.0
    source: str = ""  # what it was built from, for humans
    #: A snapshot's layers below it, top first, as refs and as digests (same order): a
    #: sandbox restored from it stacks ``[self, *parents]``. Empty for every other kind.
    parents: tuple[str, ...] = ()
    parent_digests: tuple[str, ...] = ()
    #: A snapshot's sandbox environment (``KEY=VALUE``) and working directory, which a
    #: restored sandbox starts with (its own spec's env on top); empty for other kinds.
    env: tuple[str, ...] = ()
    workdir: str = ""
    #: The fingerprint (sha256) of the catalog recipe inputs the layer was built from (its
    #: source fields, directory contents, pip packages): building the same ``name@version``
    #: from a changed recipe is ``LayerStale``. Empty: not built from a recipe, or built
    #: before fingerprints were recorded (such a layer is never called stale).
    recipe_digest: str = ""

    def __post_init__(self) -> None:
        # JSON gives lists; keep the record hashable and equal to one built in Python
        object.__setattr__(self, "parents", tuple(self.parents))
        object.__setattr__(self, "parent_digests", tuple(self.parent_digests))
        object.__setattr__(self, "env", tuple(self.env))
        if len(self.parents) != len(self.parent_digests):
            raise InvalidSpec(
                f"layer {self.name}@{self.version}: {len(self.parents)} parent refs but "
                f"{len(self.parent_digests)} parent digests",
                field="parents",
            )

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def lineage(self) -> dict[str, Any]:
        """What a layer knows beyond its image (a snapshot's parents, env, workdir; a recipe
        layer's fingerprint), as keyword arguments of ``LayerStore.add``: a copy of it in
        another store keeps them."""
        return {
            "parents": self.parents,
            "parent_digests": self.parent_digests,
            "env": self.env,
            "workdir": self.workdir,
            "recipe_digest": self.recipe_digest,
        }


@dataclass(frozen=True)
class Limits(_Record):
    """Resource limits of one sandbox; ``memory`` and ``disk`` in bytes, ``cpu`` in cores.

    ``disk`` bounds the writable layer: what the sandbox may write beyond its read-only layers
    (the size of its own filesystem for composed roots, of its disk for image backends)."""

    cpu: float = 1.0
    memory: int = 512 << 20
    pids: int = 512
    disk: int = DEFAULT_DISK

    def __post_init__(self) -> None:
        if not (0 < float(self.cpu) <= 1024):
            raise InvalidSpec(f"cpu must be in (0, 1024] cores, got {self.cpu}", field="cpu")
        if int(self.memory) < (8 << 20):
            raise InvalidSpec(f"memory must be at least 8M, got {self.memory}", field="memory")
        if not 8 <= int(self.pids) <= MAX_PIDS:
            raise InvalidSpec(f"pids must be in [8, {MAX_PIDS}], got {self.pids}", field="pids")
        if not MIN_DISK <= int(self.disk) <= MAX_DISK:
            raise InvalidSpec(
                f"disk must be in [{MIN_DISK >> 20}M, {MAX_DISK >> 40}T], got {self.disk} bytes",
                field="disk",
            )


@dataclass(frozen=True)
class IdMap(_Record):
    """A sandbox's ids on the host: uid 0.. map to ``host_base``.. (``size`` ids), and so do
    gids, except that gid 0 maps to ``group`` when it is set.

    Every sandbox has a range of its own (no per-uid kernel limit is shared between two), while
    root's group is one host group common to all of them (``NodeConfig.sandbox_gid``): the one
    group that may pass the root-owned directories on the way to a sandbox's root filesystem.
    """

    host_base: int
    size: int
    group: int | None = None

    @property
    def root_gid(self) -> int:
        """The host gid of root's group inside."""
        return self.host_base if self.group is None else self.group

    def uid_lines(self) -> list[tuple[int, int, int]]:
        """(inside, host, count) lines of the uid map."""
        return [(0, self.host_base, self.size)]

    def gid_lines(self) -> list[tuple[int, int, int]]:
        """(inside, host, count) lines of the gid map."""
        if self.group is None or self.group == self.host_base:
            return [(0, self.host_base, self.size)]
        return [(0, self.group, 1), (1, self.host_base + 1, self.size - 1)]

    def unshift_uid_lines(self) -> list[tuple[int, int, int]]:
        """The uid map read backwards: a user namespace whose ids ``host_base``.. are host ids
        0.., so a mount idmapped through it shows the sandbox's files with their in-sandbox
        owners (how ``pack_diff`` reads a writable layer)."""
        return [(host, inside, count) for inside, host, count in self.uid_lines()]

    def unshift_gid_lines(self) -> list[tuple[int, int, int]]:
        """The gid map read backwards (see ``unshift_uid_lines``)."""
        return [(host, inside, count) for inside, host, count in self.gid_lines()]


@dataclass(frozen=True)
class DeviceRequest(_Record):
    """Devices of one kind a sandbox asks for: ``count`` distinct devices of ``kind`` (a name in
    the node's inventory, ``DSEC_DEVICES``, such as "gpu"), held ``mode`` ("exclusive" or
    "shared", ``DEVICE_MODES``). Text form for the CLI: ``kind[:count[:mode]]``."""

    kind: str
    count: int = 1
    mode: str = "exclusive"

    def __post_init__(self) -> None:
        _check_type("devices.kind", self.kind, str, "a device kind such as 'gpu'")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.kind):
            raise InvalidSpec(
                f"devices.kind must be a name such as 'gpu', got {_shown(self.kind)}",
                field="devices.kind",
            )
        _check_type("devices.count", self.count, int, "an integer")
        if not 1 <= self.count <= 1024:
            raise InvalidSpec(
                f"devices.count must be in [1, 1024], got {self.count}", field="devices.count"
            )
        if self.mode not in DEVICE_MODES:
            raise InvalidSpec(
                f"devices.mode must be one of {', '.join(DEVICE_MODES)}, got {_shown(self.mode)}",
                field="devices.mode",
            )

    @classmethod
    def parse(cls, text: str) -> DeviceRequest:
        """``"gpu"``, ``"gpu:2"``, ``"gpu:2:shared"`` or ``"gpu:shared"``."""
        parts = text.split(":")
        kind, rest = parts[0], parts[1:]
        count, mode = 1, "exclusive"
        if rest and rest[-1] in DEVICE_MODES:
            mode = rest.pop()
        if rest:
            if len(rest) > 1 or not rest[0].isdigit():
                raise InvalidSpec(
                    f"bad device request {text!r}: expected kind[:count[:mode]], e.g. gpu:2:shared",
                    field="devices",
                )
            count = int(rest[0])
        return cls(kind, count, mode)

    def __str__(self) -> str:
        return f"{self.kind}:{self.count}:{self.mode}"


def device_requests(value: Any) -> tuple[DeviceRequest, ...]:
    """Device requests from what callers pass (``SandboxSpec.devices``, an FnCall's
    ``devices``): records, dicts (JSON), text such as "gpu:2:shared", or a list of these."""
    if isinstance(value, (str, Mapping, DeviceRequest)):
        value = [value]
    _check_type("devices", value, (list, tuple), "a list of device requests")
    out = []
    for item in value:
        if isinstance(item, DeviceRequest):
            out.append(item)
        elif isinstance(item, str):
            out.append(DeviceRequest.parse(item))
        elif isinstance(item, Mapping):
            out.append(DeviceRequest.from_dict(item))
        else:
            raise InvalidSpec(
                f"devices: each request is an object {{kind, count, mode}} or text such as "
                f"'gpu:2:shared', got {_shown(item)}",
                field="devices",
            )
    kinds = [r.kind for r in out]
    if len(set(kinds)) != len(kinds):
        raise InvalidSpec(f"devices: one request per kind, got {', '.join(kinds)}", field="devices")
    return tuple(out)


@dataclass(frozen=True)
class SandboxSpec(_Record):
    """What a create request asks for.

    An ``environment`` (a catalog entry: base + workspaces + toolkits), explicit ``layers``
    (``name@version`` strings, top first: toolkits, workspaces, then the base last), or both:
    explicit layers then stack on top of the environment's.
    """

    environment: str | None = None
    layers: tuple[str, ...] = ()
    #: The backend to run it on; None: the environment's (``Environment.backend``), else
    #: ``DEFAULT_BACKEND``. The node resolves it at create: the spec it keeps (and
    #: ``SandboxInfo.backend``) always names one.
    backend: str | None = None
    cpu: float = 1.0
    memory: int | str = "512M"
    pids: int = 512
    #: The writable layer's size: writes beyond it fail with ENOSPC inside the sandbox.
    disk: int | str = "10G"
    ttl: float | None = 3600.0  # seconds from when it runs; None: lives until killed
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = "/"
    labels: Mapping[str, str] = field(default_factory=dict)
    #: "none": loopback only, which the backend's own isolation enforces. Any other mode is
    #: enforced by a security policy named in ``policies`` that declares it, or the create is
    #: refused (``PolicyUnavailable``).
    network: str = "none"
    #: Security policies for this sandbox, by name, each with its settings (JSON values), e.g.
    #: ``{"landlock": {"read_only": ["/usr"]}}``. A policy that cannot be enforced on the
    #: sandbox's backend fails the create; policies not named here are not applied.
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: CPU class (``QOS_CLASSES``): "ls" keeps normal scheduling; "be" runs under SCHED_IDLE
    #: at the lowest weight, on what "ls" work leaves idle, and is not counted toward the node's
    #: CPU admission budget.
    qos: str = "ls"
    #: Devices from the node's inventory (``DeviceRequest``; dicts and "gpu:2:shared" text are
    #: read as such): held for the sandbox's life, passed in at their paths.
    devices: tuple[DeviceRequest, ...] = ()
    #: Seconds the sandbox may take to start; one that takes longer is killed and the create
    #: is ``StartTimeout`` (an infrastructure failure). None: no bound.
    start_timeout: float | None = None
    #: Ids of sandboxes this one may drive (an agent sandbox driving its workers): it reaches
    #: them through ``DRIVE_SOCKET`` inside, and only them; each command is logged in its
    #: ``trajectory``.
    drives: tuple[str, ...] = ()
    #: The trajectory log that commands this sandbox drives go to (default: its id). A loop
    #: restarted in a new sandbox of the same trajectory fast-forwards through what was logged.
    trajectory: str | None = None
    #: The OCI runtime the backend runs it under: None is the node's default
    #: (``NodeConfig.runtime``); the container backend knows "crun", "runc" and "runsc" (gVisor). A
    #: runtime the backend does not know (or any, for a backend without runtimes) is refused.
    runtime: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "drives", tuple(self.drives))
        object.__setattr__(self, "devices", device_requests(self.devices))
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "labels", dict(self.labels))
        if not isinstance(self.policies, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Mapping) for k, v in self.policies.items()
        ):
            raise InvalidSpec(
                "policies must map policy names to settings objects", field="policies"
            )
        object.__setattr__(self, "policies", {k: dict(v) for k, v in self.policies.items()})
        for key, value in self.env.items():  # what runc would refuse, refused here as input
            if not key or "=" in key or "\0" in key or "\0" in str(value):
                raise InvalidSpec(
                    f"bad environment variable {key!r}: a name is not empty and "
                    "has no '=' or NUL, a value has no NUL",
                    field="env",
                )
        if not isinstance(self.network, str) or not self.network:
            raise InvalidSpec(
                f"network must be a mode name such as 'none', got {self.network!r}", field="network"
            )
        if self.qos not in QOS_CLASSES:
            raise InvalidSpec(
                f"qos must be one of {', '.join(QOS_CLASSES)}, got {_shown(self.qos)}", field="qos"
            )
        if not self.environment and not self.layers:
            raise InvalidSpec("a sandbox needs an environment or at least one layer")
        if self.ttl is not None and self.ttl <= 0:
            raise InvalidSpec(f"ttl must be positive seconds or None, got {self.ttl}", field="ttl")
        if self.start_timeout is not None and self.start_timeout <= 0:
            raise InvalidSpec(
                f"start_timeout must be positive seconds or None, got {self.start_timeout}",
                field="start_timeout",
            )
        if self.trajectory is not None:
            check_trajectory_name(self.trajectory)
        if not self.workdir.startswith("/") or "\0" in self.workdir:
            raise InvalidSpec(
                f"workdir must be an absolute path without NUL, got {self.workdir!r}",
                field="workdir",
            )
        for ref in self.layers:
            LayerRef.parse(ref)
        self.limits  # noqa: B018 - reject bad sizes and limits at construction

    def _check_types(self) -> None:
        """What the fields' types promise, checked before anything converts them: a caller's
        ``cpu="abc"`` is an ``InvalidSpec`` naming ``cpu``, not a ``ValueError`` from deep
        inside (the API's decoder checks the same for JSON; this covers the SDK's callers)."""
        _check_type("environment", self.environment, (str, type(None)), "a string or None")
        if isinstance(self.layers, str):
            raise InvalidSpec(
                f"layers must be a list of name@version strings, not one string: {self.layers!r}",
                field="layers",
            )
        _check_type("layers", self.layers, (list, tuple), "a list of name@version strings")
        for i, ref in enumerate(self.layers):
            _check_type(f"layers[{i}]", ref, str, "a name@version string")
        _check_type("backend", self.backend, (str, type(None)), "a backend name or None")
        _check_type("cpu", self.cpu, (int, float), "a number of cores")
        _check_finite("cpu", self.cpu)
        _check_type("memory", self.memory, (int, str), "bytes or a size such as 512M")
        _check_type("pids", self.pids, int, "an integer")
        _check_type("ttl", self.ttl, (int, float, type(None)), "seconds or None")
        if self.ttl is not None:
            _check_finite("ttl", self.ttl)
        _check_strings("env", self.env)
        _check_type("workdir", self.workdir, str, "an absolute path")
        _check_strings("labels", self.labels)
        _check_labels(self.labels)
        _check_type("qos", self.qos, str, "a CPU class: ls or be")
        _check_type("start_timeout", self.start_timeout, (int, float, type(None)), "seconds")
        _check_type("runtime", self.runtime, (str, type(None)), "a runtime name such as runsc")
        if self.start_timeout is not None:
            _check_finite("start_timeout", self.start_timeout)
        if isinstance(self.drives, str):
            raise InvalidSpec(
                "drives must be a list of sandbox ids, not one string", field="drives"
            )
        _check_type("drives", self.drives, (list, tuple), "a list of sandbox ids")
        for i, sid in enumerate(self.drives):
            _check_type(f"drives[{i}]", sid, str, "a sandbox id")
        _check_type("trajectory", self.trajectory, (str, type(None)), "a trajectory name")

    @functools.cached_property
    def limits(self) -> Limits:
        # made once (at construction, which checks them) and kept: the spec is frozen
        return Limits(
            cpu=float(self.cpu),
            memory=parse_size(self.memory, "memory") or 0,
            pids=int(self.pids),
            disk=parse_size(self.disk, "disk") or 0,
        )

    def relabelled(self, labels: Mapping[str, str], trajectory: str | None) -> SandboxSpec:
        """This spec with ``labels`` and ``trajectory`` in place of its own, those two checked
        as a new spec's are and the rest kept as this one's checks left it: what
        ``dataclasses.replace`` gives, without checking every field again (the apiserver
        does this to every create it admits)."""
        _check_strings("labels", labels)
        _check_labels(labels)
        if trajectory is not None:
            check_trajectory_name(trajectory)
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.__dict__.update(labels=dict(labels), trajectory=trajectory)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["layers"] = list(self.layers)
        d["devices"] = [r.to_dict() for r in self.devices]
        d["drives"] = list(self.drives)
        return d


_TRAJECTORY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_trajectory_name(name: str) -> str:
    """``name`` if it can name a trajectory log (a file on the node): 1-128 of letters, digits,
    ``_.-``, not starting with a dot or dash; else ``InvalidSpec``."""
    if not isinstance(name, str) or not _TRAJECTORY_RE.match(name):
        raise InvalidSpec(
            f"a trajectory name is 1-128 letters, digits, '_', '.', '-' (starting with a letter "
            f"or digit), got {name!r}",
            field="trajectory",
        )
    return name


@dataclass(frozen=True)
class InfraEvent(_Record):
    """An infrastructure failure (``INFRA_KINDS``) that struck a sandbox: not the task's doing,
    so a trainer masks it instead of scoring it. ``at`` is the Unix time it happened."""

    kind: str
    sandbox_id: str = ""
    at: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class ResolvedImage(_Record):
    """A docker image name (as a Dockerfile's ``FROM`` names it) made into a base layer on the
    node: ``layer`` (``name@version``, for ``SandboxSpec.layers``), ``source`` (``docker`` for
    the node's local docker, else the URL of the layer source it came from), and what the
    image's config says a container of it starts with: ``env`` (``KEY=VALUE``), ``workdir``,
    ``user`` and ``cmd`` (argv; empty if none). ``cached``: the layer was there already."""

    image: str
    layer: str
    source: str
    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    cmd: tuple[str, ...] = ()
    cached: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", tuple(self.env))
        object.__setattr__(self, "cmd", tuple(self.cmd))


@dataclass(frozen=True)
class MemorySnapshot(_Record):
    """A running VM sandbox saved at one instant (``Client.snapshot_memory``): its memory,
    devices and writable disk, on the node that made it. ``Client.restore(name, n)`` starts n
    sandboxes that go on from that instant, each with its own copy of the disk; they take the
    saved sandbox's spec (backend, layers, limits). ``bytes``: what it holds on disk."""

    name: str
    sandbox_id: str
    backend: str
    created: float
    bytes: int
    spec: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LeaseInfo(_Record):
    """A trainer's lease on sandboxes (``Client.lease``): renewed within ``ttl`` seconds, or it
    lapses (``state`` "lapsed") and the node pauses them (``reclaim``: and reclaims their
    memory). ``expires`` is Unix time."""

    id: str
    holder: str
    sandboxes: tuple[str, ...]
    ttl: float
    expires: float
    state: str = "held"
    reclaim: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "sandboxes", tuple(self.sandboxes))

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["sandboxes"] = list(self.sandboxes)
        return d


@dataclass(frozen=True)
class TrajectoryEntry(_Record):
    """One step of a trajectory log: the command a loop ran at ``step`` in ``sandbox_id``, and
    its result. The log is append-only; a loop that restarts gets these back instead of running
    the commands again."""

    step: int
    sandbox_id: str
    command: str
    result: ExecResult
    at: float = 0.0


@dataclass(frozen=True)
class SandboxInfo(_Record):
    """A sandbox as the node sees it."""

    id: str
    backend: str
    state: str  # "running" | "dead"
    created: float
    expires: float | None
    layers: tuple[str, ...]  # name@version, top first
    environment: str | None
    limits: Mapping[str, Any]
    labels: Mapping[str, str] = field(default_factory=dict)
    pid: int | None = None
    #: Every security policy considered for the sandbox: "enforced", or why it is not
    #: ("off: ..." turned off by the spec, "skipped: ..." best effort or a default the backend
    #: cannot enforce).
    policies: Mapping[str, str] = field(default_factory=dict)
    qos: str = "ls"  # the CPU class (SandboxSpec.qos)
    #: The devices it holds, by host path (``SandboxSpec.devices``; inside at the same path).
    devices: tuple[str, ...] = ()
    #: The OCI runtime it runs under ("crun", "runc", "runsc"), if its backend has runtimes.
    runtime: str | None = None
    #: Where to watch its display over VNC (``host:port`` on the node's loopback), if its
    #: backend has a screen and the node serves it (``DSEC_VM_VNC``).
    vnc: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "devices", tuple(self.devices))

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["layers"] = list(self.layers)
        d["devices"] = list(self.devices)
        return d


@dataclass(frozen=True)
class SandboxUsage(_Record):
    """What a sandbox uses now: memory in bytes, CPU seconds since it started, live processes.

    None where a backend cannot tell; a backend that claims the ``cgroups`` feature reports all
    three.
    """

    memory: int | None = None
    cpu_seconds: float | None = None
    pids: int | None = None
    #: Processes the kernel's OOM killer killed in the sandbox so far.
    oom_kills: int | None = None


@dataclass(frozen=True)
class PolicyState(_Record):
    """One security policy of a sandbox: ``state`` is "enforced" (then ``settings`` are those in
    force and ``stats`` what the policy saw so far, e.g. denied attempts) or why it is not."""

    name: str
    state: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    stats: Mapping[str, Any] = field(default_factory=dict)


#: The label that names a sandbox's project (set by the apiserver from the caller's key; a
#: client cannot choose it there).
PROJECT_LABEL = "dsec.project"
#: The label under which a node keeps a sandbox's create key (the ``idempotency-key`` header
#: of its create): a create whose key a live sandbox of the same project already has (or a
#: create under way) is answered with that sandbox instead of making another. The SDK sends a
#: fresh key with each create, so a create it sends again after the connection broke (or a
#: trainer sends again after ``NodeUnavailable``, with the same ``key``) makes one sandbox, not
#: two. Member ``i`` of one ``create_many`` gets ``<key>.<i>``. Kept in the sandbox's state
#: (a restarted daemon still knows it), never shown in its labels (``user_labels``).
CREATE_KEY_LABEL = "dsec.create-key"
#: The longest create key.
MAX_CREATE_KEY = 128


def user_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """``labels`` as a sandbox shows them: without its create key (the node's to keep; a
    sandbox restored from this one's snapshot must not inherit it)."""
    if CREATE_KEY_LABEL not in labels:
        return dict(labels)
    return {k: v for k, v in labels.items() if k != CREATE_KEY_LABEL}


def check_create_key(key: str) -> str:
    """``key`` if it can be a create key (1-128 printable ASCII characters, no space), else
    ``InvalidSpec``."""
    if not 0 < len(key) <= MAX_CREATE_KEY or not all(33 <= ord(c) < 127 for c in key):
        raise InvalidSpec(
            f"a create key is 1-{MAX_CREATE_KEY} printable ASCII characters without spaces",
            field="key",
        )
    return key


#: The label of a node's pool (``NodeLoad.labels``): ``overflow`` for the burst pool.
POOL_LABEL = "dsec.pool"
#: The label of a build session's sandbox (its value: the build's name). Only admin and
#: builder keys may create one, and the apiserver hides such sandboxes from every other key.
BUILD_LABEL = "dsec.build"
#: Layers whose name starts with this are a build's staged output, not yet through QA: only
#: admin and builder keys may pack to, create from or restore such a layer.
STAGED_PREFIX = "staged-"
#: Where a builder keeps its notes inside a build sandbox; ``pack_diff``'s scrub leaves it out.
BUILD_NOTES_DIR = "/.dsec-build"


@dataclass(frozen=True)
class ExecOutput(_Record):
    """A piece of a running command's output (``Sandbox.exec_stream``), as it came."""

    stream: str  # "stdout" | "stderr"
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@dataclass(frozen=True)
class ProcessInfo(_Record):
    """A command started with ``process_start``: it runs on while clients attach to its output
    (``process_output``) and go, takes input, resizes and signals, until it ends, is killed,
    or its sandbox dies. ``pid`` is its process id inside the sandbox; ``rows`` and ``cols``
    its terminal's size (None: no terminal, pipes); ``stdin`` whether it takes input;
    ``exit_code`` once it ended (then ``running`` is false; 128+N after signal N)."""

    pid: int
    command: str
    sandbox_id: str = ""
    running: bool = True
    stdin: bool = False
    rows: int | None = None
    cols: int | None = None
    started: float = 0.0
    exit_code: int | None = None

    @property
    def pty(self) -> bool:
        return self.rows is not None


@dataclass(frozen=True)
class ExecResult(_Record):
    """What one command did: exit code, captured output (capped), time, and why it stopped."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration: float  # seconds
    truncated: bool = False  # output went past the per-call cap and the rest was dropped
    timed_out: bool = False  # the process tree was killed at the timeout
    command: str = ""
    sandbox_id: str = ""
    #: What the command used, where the backend's agent says (None: unknown, or timed out):
    #: CPU seconds (user + system) of it and the descendants it waited for, and the peak
    #: resident set in bytes of it or of the largest of those descendants.
    cpu_time: float | None = None
    max_rss: int | None = None
    #: The kernel's OOM killer struck in the sandbox while the command ran (an infrastructure
    #: failure: ``InfraEvent`` "out_of_memory").
    oom_killed: bool = False
    #: Served from a trajectory log: the command ran before (at this step), not now.
    replayed: bool = False

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> ExecResult:
        """Return self if the command succeeded; raise ``ExecTimeout`` or ``CommandFailed``."""
        stderr = self.stderr.decode("utf-8", "replace")[-2000:]
        ctx: dict[str, Any] = dict(
            sandbox_id=self.sandbox_id,
            command=self.command,
            exit_code=self.exit_code,
            stderr=stderr,
        )
        if self.timed_out:
            raise ExecTimeout(
                f"sandbox {self.sandbox_id}: {self.command!r} timed out after {self.duration:.1f}s",
                **ctx,
            )
        if self.exit_code != 0:
            raise CommandFailed(
                f"sandbox {self.sandbox_id}: {self.command!r} exited "
                f"{self.exit_code}: {stderr.strip()[-500:]}",
                **ctx,
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["stdout"] = base64.b64encode(self.stdout).decode()
        d["stderr"] = base64.b64encode(self.stderr).decode()
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecResult:
        data = dict(data)
        data["stdout"] = base64.b64decode(data.get("stdout", ""))
        data["stderr"] = base64.b64decode(data.get("stderr", ""))
        return super().from_dict(data)


@dataclass(frozen=True)
class FnCallResult(ExecResult):
    """What one FnCall did (``ExecResult``'s fields), and where: the pool and member that ran it
    and how long the call waited for a member (``wait``, seconds; a new member's start
    included). ``error`` is "" when the command ran to an exit code or its timeout
    (``timed_out``); "runtime-error" when the member died under it (its agent or init killed,
    say): the member is replaced, ``exit_code`` is -1 and ``stderr`` says what happened."""

    error: str = ""
    member: str = ""
    pool: str = ""
    wait: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error and super().ok

    @classmethod
    def from_exec(cls, r: ExecResult, **kw: Any) -> FnCallResult:
        return cls(**{**dataclasses.asdict(r), **kw})


@dataclass(frozen=True)
class FileEntry(_Record):
    """One directory entry inside a sandbox."""

    name: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    mtime: float


#: What admission expects a new sandbox to take from the host's memory at start (what a
#: started, idle container sandbox holds is about 1.5 MiB; this is generous).
SANDBOX_START_MEMORY = 16 << 20


@dataclass(frozen=True)
class NodeLoad(_Record):
    """What placement knows of one node: its capacity, what its sandboxes reserve, how many it
    holds, and the memory really in use. CPU in cores and memory in bytes, capacities with
    overcommit applied.

    Limits are promises most sandboxes never use (DSec: 90% use under 5% of the CPU they ask
    for; an idle sandbox holds under 2 MiB), so the sums of limits are only a backstop; what
    admits a sandbox is the host's memory: ``memory_available`` (MemAvailable, less
    ``SANDBOX_START_MEMORY`` for each sandbox being created) must stay above
    ``memory_reserve``, and ``memory_pressure`` (PSI) under ``memory_pressure_limit``.

    Best-effort sandboxes (``qos="be"``) take only CPU time the others leave idle, so
    ``cpu_committed`` does not count them, and one is refused for CPU only if it alone asks for
    more than ``cpu_capacity``; their memory and their number count as any sandbox's.
    """

    node: str  # the node's name or address
    backends: tuple[str, ...]
    cpu_capacity: float
    cpu_committed: float
    memory_capacity: int
    memory_committed: int
    sandboxes: int = 0
    max_sandboxes: int = 4096
    labels: Mapping[str, str] = field(default_factory=dict)
    memory_total: int = 0  # the host's RAM; 0: unknown
    memory_available: int | None = None  # None: not measured (only limits count)
    memory_reserve: int = 0
    memory_pressure: float = 0.0  # PSI memory "some" avg10, in %
    memory_pressure_limit: float = 100.0
    #: The node's devices by kind: ``total``, ``idle`` (held by no sandbox: what an exclusive
    #: request may take) and ``shareable`` (not held exclusively and under the share cap).
    devices: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    #: What a create there would find mounted (the control plane fills these from the node's
    #: probe): layers as ``name@version``, and environments all of whose layers those are.
    layers: tuple[str, ...] = ()
    environments: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", tuple(self.backends))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "environments", tuple(self.environments))
        object.__setattr__(self, "labels", dict(self.labels))
        object.__setattr__(self, "devices", {k: dict(v) for k, v in self.devices.items()})

    @property
    def load(self) -> float:
        """The fullest of CPU, memory and sandbox count, as a fraction of capacity."""
        in_use = 0.0
        if self.memory_available is not None and self.memory_total > self.memory_reserve:
            room = self.memory_total - self.memory_reserve
            in_use = 1.0 - max(0, self.memory_available - self.memory_reserve) / room
        return max(
            self.cpu_committed / max(self.cpu_capacity, 1e-9),
            self.memory_committed / max(self.memory_capacity, 1),
            self.sandboxes / max(self.max_sandboxes, 1),
            in_use,
        )

    def _device_refusal(self, req: DeviceRequest) -> AdmissionRejected | None:
        """Why ``req`` cannot be met here now, from the counts alone (the node's allocator
        decides which devices, and refuses the same way if a concurrent create took them)."""
        have = self.devices.get(req.kind)
        if have is None:
            return AdmissionRejected(
                f"node {self.node} has no devices of kind {req.kind!r} "
                f"(it has: {', '.join(sorted(self.devices)) or 'none'}; DSEC_DEVICES)",
                reason="devices",
                pool=f"devices:{req.kind}",
                node=self.node,
            )
        free = have.get("idle" if req.mode == "exclusive" else "shareable", 0)
        if req.count > free:
            return AdmissionRejected(
                f"devices {req.kind}: asked {req.count} {req.mode}, {free} of "
                f"{have.get('total', 0)} can take one more {req.mode} holder now",
                reason="devices",
                pool=f"devices:{req.kind}",
                node=self.node,
            )
        return None

    def refusal(self, spec: SandboxSpec) -> AdmissionRejected | None:
        """Why this node cannot take ``spec`` (the error to raise), or None if it can."""
        lim = spec.limits
        # None with an environment: the environment's backend, which only the node's catalogs
        # know; its create refuses a backend it does not run (UnknownBackend)
        backend = spec.backend or (None if spec.environment else DEFAULT_BACKEND)
        if backend is not None and backend not in self.backends:
            return AdmissionRejected(
                f"node {self.node} does not run backend {backend!r}",
                reason="backend",
                node=self.node,
            )
        if self.sandboxes + 1 > self.max_sandboxes:
            return AdmissionRejected(
                f"node is full: {self.sandboxes} sandboxes of at most {self.max_sandboxes}",
                reason="count",
                node=self.node,
            )
        for req in spec.devices:
            refused = self._device_refusal(req)
            if refused is not None:
                return refused
        committed = 0.0 if spec.qos == "be" else self.cpu_committed
        if committed + lim.cpu > self.cpu_capacity:
            return AdmissionRejected(
                f"not enough CPU: asked {lim.cpu} cores, "
                f"{self.cpu_capacity - committed:.1f} of {self.cpu_capacity:.0f} (with "
                f"overcommit) left{' to a best-effort sandbox' if spec.qos == 'be' else ''}",
                reason="cpu",
                node=self.node,
            )
        if self.memory_committed + lim.memory > self.memory_capacity:
            return AdmissionRejected(
                f"not enough memory: asked {lim.memory >> 20} MiB, "
                f"{(self.memory_capacity - self.memory_committed) >> 20} MiB of "
                f"{self.memory_capacity >> 20} MiB of limits (with overcommit) left",
                reason="memory",
                node=self.node,
            )
        if self.memory_pressure >= self.memory_pressure_limit:
            return AdmissionRejected(
                f"memory pressure: tasks stalled on memory {self.memory_pressure:.1f}% of the "
                f"last 10 s (limit {self.memory_pressure_limit:g}%)",
                reason="memory-pressure",
                node=self.node,
            )
        needs = min(lim.memory, SANDBOX_START_MEMORY)
        if (
            self.memory_available is not None
            and self.memory_available - needs < self.memory_reserve
        ):
            return AdmissionRejected(
                f"not enough memory in use terms: {self.memory_available >> 20} MiB available, "
                f"a new sandbox takes about {needs >> 20} MiB and the node keeps "
                f"{self.memory_reserve >> 20} MiB in reserve",
                reason="memory-available",
                node=self.node,
            )
        return None


#: Judge verdicts, for one test case and for a whole submission: accepted, wrong answer, time
#: limit exceeded, memory limit exceeded, runtime error, and (for a submission only) compile
#: error. A submission's verdict is its first case's that is not AC (or CE, or AC).
VERDICTS = ("AC", "WA", "TLE", "MLE", "RE", "CE")
#: How a case's output is compared with the expected: "lines" (trailing whitespace of each line
#: and trailing blank lines ignored), "tokens" (whitespace-separated words), "exact" (bytes).
COMPARE_MODES = ("lines", "tokens", "exact")


@dataclass(frozen=True)
class JudgeCase(_Record):
    """One test case: the program's stdin, the output it must print, and a name to report."""

    input: bytes = b""
    output: bytes = b""
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("input", "output"):
            value = getattr(self, key)
            if isinstance(value, str):
                object.__setattr__(self, key, value.encode())
            elif not isinstance(value, bytes):
                raise InvalidSpec(f"a case's {key} must be bytes or text", field=key)
        _check_type("name", self.name, str, "a string")


#: Time limits beyond this are not judging but batch work: use fncall or a sandbox.
MAX_TIME_LIMIT = 600.0


@dataclass(frozen=True)
class JudgeSpec(_Record):
    """One submission to judge (``dsec_core.node.judge``): write ``files`` (relative to the
    environment's working directory) into a warm FnCall member, run ``compile`` once (a
    failure is CE), then ``run`` on each case with ``time_limit`` CPU seconds and
    ``memory_limit`` bytes, comparing its output by ``compare`` (``COMPARE_MODES``).

    ``run`` and ``compile`` are a shell command (through ``/bin/sh -c``) or argv. The cases
    come with the request (``cases``) or from ``cases_dir``: NAME.in and NAME.out inside the
    working directory, hidden from the submission while it runs. ``stop_on_failure`` skips
    the cases after the first that fails (SKIPPED). ``memory`` is the member's own limit,
    which the compiler runs under and which must exceed ``memory_limit``.

    ``project`` and ``start`` are an FnCall's (``FnCallRequest``): the pool is ``project``'s
    (set by the apiserver to the caller's; None from a direct caller of a node: its shared
    pools), and ``start`` False means the submission may not start a member, only take a free
    one or wait for one (``AdmissionRejected`` with ``reason="pool-start"`` if the pool has
    none, or none frees up within the pool's checkout timeout).
    """

    environment: str
    run: str | tuple[str, ...]
    compile: str | tuple[str, ...] | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)
    cases: tuple[JudgeCase, ...] = ()
    cases_dir: str | None = None
    time_limit: float = 2.0
    memory_limit: int | str = "256M"
    compare: str = "lines"
    compile_timeout: float = 60.0
    stop_on_failure: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    backend: str = "fncall"
    cpu: float = 1.0
    memory: int | str = "1G"
    #: Devices the member holds (``SandboxSpec.devices``): a kernel judged on an accelerator.
    devices: tuple[DeviceRequest, ...] = ()
    #: The project whose pool serves the submission (None: the node's shared pools)
    project: str | None = None
    #: False: take a free member or wait for one, never start one
    start: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", device_requests(self.devices))
        for name in ("run", "compile"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "env", dict(self.env or {}))
        object.__setattr__(
            self,
            "files",
            {
                str(k): v.encode() if isinstance(v, str) else bytes(v)
                for k, v in (self.files or {}).items()
            },
        )
        object.__setattr__(
            self,
            "cases",
            tuple(JudgeCase(**c) if isinstance(c, Mapping) else c for c in self.cases or ()),
        )
        _check_type("environment", self.environment, str, "an environment name")
        _check_strings("env", self.env)
        _check_type("time_limit", self.time_limit, (int, float), "seconds")
        _check_finite("time_limit", self.time_limit)
        _check_type("compile_timeout", self.compile_timeout, (int, float), "seconds")
        _check_finite("compile_timeout", self.compile_timeout)
        _check_type("cpu", self.cpu, (int, float), "a number of cores")
        _check_type("project", self.project, (str, type(None)), "a project path or null")
        _check_type("start", self.start, bool, "true or false")
        if not self.environment:
            raise InvalidSpec("judge needs an environment", field="environment")
        if not self.run or not all(isinstance(a, str) for a in _as_argv(self.run)):
            raise InvalidSpec("judge needs run: a command string or a list of strings", field="run")
        if self.compile is not None and (
            not self.compile or not all(isinstance(a, str) for a in _as_argv(self.compile))
        ):
            raise InvalidSpec(
                "compile must be a command string or a list of strings", field="compile"
            )
        if not all(isinstance(c, JudgeCase) for c in self.cases):
            raise InvalidSpec("cases must be JudgeCase records or objects", field="cases")
        if bool(self.cases) == bool(self.cases_dir):
            raise InvalidSpec("judge needs cases or cases_dir, one of them", field="cases")
        if not 0 < self.time_limit <= MAX_TIME_LIMIT:
            raise InvalidSpec(
                f"time_limit must be in (0, {MAX_TIME_LIMIT:g}] seconds, got {self.time_limit}",
                field="time_limit",
            )
        if self.compile_timeout <= 0:
            raise InvalidSpec("compile_timeout must be positive seconds", field="compile_timeout")
        if self.compare not in COMPARE_MODES:
            raise InvalidSpec(
                f"compare must be one of {', '.join(COMPARE_MODES)}, got {_shown(self.compare)}",
                field="compare",
            )
        limit, member = self.memory_bytes, parse_size(self.memory, "memory") or 0
        if limit < 1 << 20:
            raise InvalidSpec("memory_limit must be at least 1M", field="memory_limit")
        if member < limit + (16 << 20):
            raise InvalidSpec(
                f"memory (the member's limit, {member >> 20} MiB) must be at least "
                f"memory_limit ({limit >> 20} MiB) + 16 MiB for the agent and the files",
                field="memory",
            )
        if self.cases_dir is not None:
            _check_type("cases_dir", self.cases_dir, str, "a relative path")
            rel = os.path.normpath(self.cases_dir)
            if os.path.isabs(rel) or rel in (".", "..") or rel.startswith("../"):
                raise InvalidSpec(
                    "cases_dir must be a directory inside the working directory (so the judge "
                    f"can hide it from the submission), got {self.cases_dir!r}",
                    field="cases_dir",
                )

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.memory_limit, "memory_limit") or 0

    @property
    def wall_limit(self) -> float:
        """When the wall clock kills a case: a program that sleeps or blocks is TLE too."""
        return max(2 * self.time_limit, self.time_limit + 1.0)


def _as_argv(cmd: Any) -> tuple[Any, ...]:
    return (cmd,) if isinstance(cmd, str) else tuple(cmd) if isinstance(cmd, tuple) else (None,)


@dataclass(frozen=True)
class CaseResult(_Record):
    """The verdict of one test case (``VERDICTS`` but CE; SKIPPED after an earlier failure with
    ``JudgeSpec.stop_on_failure``) and what the run took: ``time`` is CPU seconds (the wall
    time where the backend does not measure CPU), ``memory`` the peak resident memory in
    bytes (None: unknown). ``stdout``/``stderr`` keep the start of what it printed (4 KiB) and
    ``detail`` says why a verdict is not AC."""

    name: str
    verdict: str
    exit_code: int
    time: float
    wall: float
    memory: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    detail: str = ""


@dataclass(frozen=True)
class JudgeResult(_Record):
    """What the judge made of one submission: its verdict (``VERDICTS``), each case's (none
    after a compile error), the compiler's output, and where it ran (the FnCall pool and
    member, and how long it waited for one)."""

    verdict: str
    cases: tuple[CaseResult, ...] = ()
    passed: int = 0
    total: int = 0
    compile_output: bytes = b""
    compile_time: float = 0.0
    duration: float = 0.0
    member: str = ""
    pool: str = ""
    wait: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict == "AC"

    @property
    def score(self) -> float:
        """Accepted cases over all cases (0.0 on a compile error)."""
        return self.passed / self.total if self.total else 0.0
