"""IAM's records: project paths, quotas, usage, API keys and the principal a key authenticates.

Every record is frozen, checks its fields when made (``InvalidSpec`` naming the field) and
converts to and from plain JSON (``to_dict``/``from_dict``), so the apiserver can put them on
the wire as they are.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import InvalidSpec
from ..records import parse_size

__all__ = [
    "LOOSEN_ROLES",
    "MINTABLE",
    "RESOURCES",
    "ROLES",
    "ROOT",
    "KeyInfo",
    "Principal",
    "Project",
    "ProjectRevocation",
    "Quota",
    "Usage",
    "ancestors",
    "check_key_name",
    "check_project_path",
    "in_subtree",
    "parent_of",
]

#: The root project: it always exists, has no quota, and holds every top-level project (an
#: org). An admin key of the root creates orgs and manages everything; the machine's operator
#: makes the first one with ``dsec iam key create --project / --role admin``.
ROOT = "/"
#: What a key may do: "admin" manages projects, quotas and keys in its project's subtree and
#: reaches its sandboxes; "member" reaches the subtree's sandboxes; "agent" reaches only its
#: own project's sandboxes (none of its subprojects'); "builder" reaches what a member does and
#: also makes environment builds (build sandboxes and staged layers, which the apiserver keeps
#: from every role but admin and builder). Every key may also delegate: mint keys no wider than
#: itself (``MINTABLE``) and make a sub-agent's project below its own within its own quota.
ROLES = ("admin", "member", "agent", "builder")
#: Roles whose keys may loosen a sandbox's security policies against the node's default: turn
#: a default policy off, let it be skipped, widen it (seccomp's ``allow``), open the network,
#: change a network policy live (``dsec_core.security.loosenings`` says what counts). Member
#: and agent keys may only tighten: the sandboxes they make run at least as confined as the
#: node's default.
LOOSEN_ROLES = ("admin", "builder")
#: The roles of the keys a key of each role may mint (``Iam.create_key`` with an actor): its
#: own or a narrower one, never a wider. A builder reaches what a member does and builds, a
#: member what an agent does and its project's subprojects; an admin's keys may be any role.
MINTABLE = {
    "admin": ROLES,
    "builder": ("builder", "member", "agent"),
    "member": ("member", "agent"),
    "agent": ("agent",),
}
#: What a quota bounds, each counted over a project's whole subtree.
RESOURCES = ("sandboxes", "cpu", "memory")

_SEGMENT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_KEY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

R = TypeVar("R", bound="_IamRecord")


def check_project_path(path: Any, what: str = "project") -> str:
    """``path`` if it names a project: ``/`` (the root) or segments like ``org/team/job``, each
    ``[a-z0-9][a-z0-9_-]{0,62}``; else ``InvalidSpec`` with ``field`` = ``what``."""
    if path == ROOT:
        return ROOT
    if not isinstance(path, str) or not all(_SEGMENT_RE.match(s) for s in path.split("/")):
        raise InvalidSpec(
            f"{what}: {path!r} is not a project path (/ for the root, or segments like "
            "org/team/job of lowercase letters, digits, - and _, each 1-63 long)",
            field=what,
        )
    return path


def check_key_name(name: Any) -> str | None:
    """``name`` if it is a valid API key name (or None); else ``InvalidSpec`` (field name)."""
    if name is None:
        return None
    if not isinstance(name, str) or not _KEY_NAME_RE.match(name):
        raise InvalidSpec(
            f"name: {name!r} is not a key name (letters, digits, ., - and _, 1-63 long)",
            field="name",
        )
    return name


def parent_of(path: str) -> str:
    """The project directly above ``path`` (the root for an org); the root has none."""
    if path == ROOT:
        raise InvalidSpec("the root project has no parent", field="project")
    head, sep, _ = path.rpartition("/")
    return head if sep else ROOT


def ancestors(path: str) -> list[str]:
    """``path`` and each project above it up to its org, nearest first (the root excluded)."""
    out = []
    while path != ROOT:
        out.append(path)
        path = parent_of(path)
    return out


def in_subtree(path: str, top: str) -> bool:
    """Is ``path`` the project ``top`` or one below it?"""
    return top == ROOT or path == top or path.startswith(top + "/")


def _number(name: str, value: Any, kinds: tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, kinds):
        what = "an integer" if kinds == (int,) else "a number"
        raise InvalidSpec(f"{name} must be {what}, got {value!r}", field=name)
    if not isinstance(value, (int, float)):
        raise InvalidSpec(f"{name} must be a number, got {value!r}", field=name)
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise InvalidSpec(f"{name} must be a finite number >= 0, got {value!r}", field=name)


class _IamRecord:
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, _IamRecord) else value
        return out

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record from its ``to_dict`` form; unknown fields are ``InvalidSpec``."""
        if not isinstance(data, Mapping):
            raise InvalidSpec(f"{cls.__name__} must be an object, got {data!r}", field="")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidSpec(
                f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}",
                field=unknown[0],
            )
        try:
            return cls(**data)
        except TypeError as e:
            raise InvalidSpec(f"{cls.__name__}: {e}", field="") from e


@dataclass(frozen=True)
class Quota(_IamRecord):
    """The most a project's subtree may run at once; None: no bound at this level (the
    ancestors' quotas still apply). ``memory`` is bytes (``"8G"`` is read as such)."""

    sandboxes: int | None = None
    cpu: float | None = None
    memory: int | None = None

    def __post_init__(self) -> None:
        if self.sandboxes is not None:
            _number("sandboxes", self.sandboxes, (int,))
        if self.cpu is not None:
            _number("cpu", self.cpu, (int, float))
        if isinstance(self.memory, str):
            object.__setattr__(self, "memory", parse_size(self.memory, "memory"))
        if self.memory is not None:
            _number("memory", self.memory, (int,))

    def limit(self, resource: str) -> float | None:
        value: float | None = getattr(self, resource)
        return value


@dataclass(frozen=True)
class Usage(_IamRecord):
    """What running sandboxes take: how many, their CPU cores and their memory limits in
    bytes. The apiserver reports one per project (its own sandboxes, not its subtree's) and
    one for what a create request adds."""

    sandboxes: int = 0
    cpu: float = 0.0
    memory: int = 0

    def __post_init__(self) -> None:
        _number("sandboxes", self.sandboxes, (int,))
        _number("cpu", self.cpu, (int, float))
        if isinstance(self.memory, str):
            object.__setattr__(self, "memory", parse_size(self.memory, "memory"))
        _number("memory", self.memory, (int,))

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.sandboxes + other.sandboxes, self.cpu + other.cpu, self.memory + other.memory
        )

    def amount(self, resource: str) -> float:
        value: float = getattr(self, resource)
        return value


@dataclass(frozen=True)
class Project(_IamRecord):
    """A node of the project tree (``org``, ``org/team``, ``org/team/job``) and its quota."""

    path: str
    quota: Quota = field(default_factory=Quota)
    created: float = 0.0

    def __post_init__(self) -> None:
        check_project_path(self.path, "path")
        if isinstance(self.quota, Mapping):
            object.__setattr__(self, "quota", Quota.from_dict(self.quota))
        if not isinstance(self.quota, Quota):
            raise InvalidSpec(f"quota must be a Quota, got {self.quota!r}", field="quota")


@dataclass(frozen=True)
class KeyInfo(_IamRecord):
    """An API key as it may be shown: never its secret, nor the secret's hash. ``expires``:
    when it stops authenticating (a Unix time; None: when revoked). ``minted_by``: the key
    that minted it when that was not an admin's (a delegation: it dies with its minter)."""

    key_id: str
    project: str
    role: str
    name: str | None = None
    created: float = 0.0
    expires: float | None = None
    minted_by: str | None = None

    def __post_init__(self) -> None:
        check_project_path(self.project)
        if self.role not in ROLES:
            raise InvalidSpec(
                f"role must be one of {', '.join(ROLES)}, got {self.role!r}", field="role"
            )
        check_key_name(self.name)
        if self.expires is not None:
            _number("expires", self.expires, (int, float))


@dataclass(frozen=True)
class Principal(_IamRecord):
    """Who a request is: the key it carried, that key's project and role, and when the key
    expires (None: never)."""

    key_id: str
    project: str
    role: str
    expires: float | None = None


@dataclass(frozen=True)
class ProjectRevocation(_IamRecord):
    """What revoking a project removed: its path and its subprojects' (``projects``, deepest
    first) and the ids of the keys that went with them (``keys``)."""

    projects: tuple[str, ...]
    keys: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"projects": list(self.projects), "keys": list(self.keys)}
