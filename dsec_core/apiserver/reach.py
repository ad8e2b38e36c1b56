"""Who may reach what through the apiserver: the one place that answers "may this key reach
that object?" for every object a tenant can name.

Nodes have no tenants. Through an apiserver every object a key can name belongs to a project,
and that project is read off the object itself, never kept aside:

- a **sandbox**: its ``dsec.project`` label (``PROJECT_LABEL``), set by the apiserver at create
  and restore; build sandboxes (``BUILD_LABEL``) are reached only by ``BUILD_ROLES`` keys, FnCall
  pool members (``MEMBER_LABEL``) by no key at all (their pool's calls reach them);
- a **name a project chooses** (a snapshot layer from ``pack_diff``, a memory snapshot, a
  trajectory log, a lease's holder): the apiserver puts the project's tag in front
  (``scope_tag``: a digest, so names stay short), so each project has a namespace of its own
  and the tag says whose a name is. Layers without a tag (the catalog's, published
  environments) are everyone's; a build's staged layers (``STAGED_PREFIX``) are
  ``BUILD_ROLES``' only, and only their project's;
- a **lease**: its holder, tagged at take;
- **drives**, **groups**, **pools**, **builds**: a sandbox's ``drives`` are sandbox ids (each
  reached as a sandbox); a group is a label on the project's own sandboxes, and listing shows
  only those; FnCall and judge pools are keyed by the caller's project on the node; a build is
  its sandboxes and staged layers. E2B templates, when served, will be a project's layers and
  follow the layer rule.

``can_reach`` (IAM's) says which projects a key reaches: an admin, member or builder key its
project and the projects below it, an agent key exactly its own. An object out of reach answers
exactly as one that does not exist (``missing``): same type, status and message, no list of
what exists, no node address.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import NotFound, UnknownLayer, UnknownLease, UnknownSandbox, UnknownSnapshot
from ..iam import ROOT
from ..records import BUILD_LABEL, PROJECT_LABEL, STAGED_PREFIX

__all__ = [
    "BUILD_ROLES",
    "KINDS",
    "MEMBER_LABEL",
    "Owner",
    "Reach",
    "is_staged",
    "may_build",
    "missing",
    "scope_tag",
    "scoped",
    "strip_tag",
    "tag_of",
]

#: Roles whose keys may make builds: create build sandboxes (``BUILD_LABEL``), see them, and
#: pack to, create from and restore their project's staged layers (``STAGED_PREFIX``).
BUILD_ROLES = ("admin", "builder")
#: The label FnCall pool members carry (``dsec_core.node.pools.POOL_LABEL``; the apiserver sits
#: above the node's packages, so the name is repeated here and a test checks they agree).
MEMBER_LABEL = "dsec.fncall-pool"
#: What a tenant can name, each with the error a name that is missing or out of reach gets.
KINDS: dict[str, type[NotFound]] = {
    "sandbox": UnknownSandbox,
    "layer": UnknownLayer,
    "snapshot": UnknownSnapshot,  # a memory snapshot, or a snapshot layer given to restore
    "lease": UnknownLease,
    "trajectory": NotFound,
}
_WHAT = {
    "sandbox": "sandbox",
    "layer": "layer",
    "snapshot": "snapshot",
    "lease": "lease",
    "trajectory": "trajectory log",
}
_TAG_RE = re.compile(r"^(p[0-9a-f]{10})-")
#: How often the tag -> project table is read again when a tag is not in it (a project made
#: since): at most once a second, whatever a caller sends.
_REFRESH = 1.0


def scope_tag(project: str) -> str:
    """The short tag of ``project`` that prefixes the names it chooses on nodes."""
    return "p" + hashlib.sha256(project.encode()).hexdigest()[:10]


def scoped(project: str, name: str) -> str:
    """``name`` in ``project``'s namespace (``<tag>-<name>``)."""
    return f"{scope_tag(project)}-{name}"


def tag_of(name: str) -> str | None:
    """The scope tag a name starts with, or None (a name nobody scoped: everyone's)."""
    m = _TAG_RE.match(name)
    return m.group(1) if m else None


def strip_tag(name: str) -> str:
    """``name`` as its project named it: its scope tag off (an untagged name as it is)."""
    return _TAG_RE.sub("", name, count=1)


def is_staged(name: str) -> bool:
    """Whether layer ``name`` (or ``name@version``) is a build's staged output: its name, as
    given or as an apiserver scoped it, starts with ``STAGED_PREFIX``."""
    return strip_tag(name.partition("@")[0]).startswith(STAGED_PREFIX)


def may_build(principal: Any) -> bool:
    """Whether ``principal``'s key may make builds (``BUILD_ROLES``)."""
    return principal.role in BUILD_ROLES


@dataclass(frozen=True)
class Owner:
    """Whose an object is: its project (None: everyone's, or nobody's when ``known`` is false),
    and whether it is a build's or a pool member."""

    project: str | None
    known: bool = True  # False: a tag no project has, a sandbox with no project label
    build: bool = False
    member: bool = False

    @classmethod
    def of_labels(cls, labels: Any) -> Owner:
        project = labels.get(PROJECT_LABEL)
        return cls(
            project,
            known=project is not None,
            build=BUILD_LABEL in labels,
            member=MEMBER_LABEL in labels,
        )


PUBLIC = Owner(None)


class Reach:
    """Reach decisions over IAM: ``can_reach(principal, project)`` is IAM's rule, ``projects()``
    lists every project (to find whose a tag is)."""

    def __init__(
        self,
        can_reach: Callable[[Any, str], bool],
        projects: Callable[[], Iterable[Any]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._can_reach = can_reach
        self._projects = projects
        self._clock = clock
        self._tags: dict[str, str] = {}
        self._read_at = -_REFRESH

    # --- whose is it ----------------------------------------------------------------------
    def project_of_tag(self, tag: str, caller: str | None = None) -> str | None:
        """The project whose tag ``tag`` is, or None. The table of every project's tag is
        read again on a miss at most once a second; ``caller``'s own tag is known at once
        (a project made a moment ago names its own snapshots)."""
        if caller is not None and tag == scope_tag(caller):
            return caller
        project = self._tags.get(tag)
        if project is None and self._clock() - self._read_at >= _REFRESH:
            self._read_at = self._clock()
            self._tags = {scope_tag(p.path): p.path for p in self._projects()}
            project = self._tags.get(tag)
        return project

    def owner_of_name(self, name: str, caller: Any = None) -> Owner:
        """Whose a name is: its tag's project; an untagged name is everyone's. ``caller``
        (the asking principal) makes its own project's tag known at once."""
        tag = tag_of(name)
        if tag is None:
            return PUBLIC
        project = self.project_of_tag(tag, caller.project if caller is not None else None)
        return Owner(project, known=project is not None)

    def owner_of_layer(self, ref: str, caller: Any = None) -> Owner:
        """Whose a layer (``name`` or ``name@version``) is; a staged one is a build's."""
        owner = self.owner_of_name(ref.partition("@")[0], caller)
        if is_staged(ref):
            return Owner(owner.project, known=owner.known, build=True)
        return owner

    # --- may this key reach it ------------------------------------------------------------
    def allows(self, principal: Any, owner: Owner) -> bool:
        """The one rule: ``principal`` reaches ``owner``'s objects if it reaches their project
        (everyone's objects: everyone), a build's only with a ``BUILD_ROLES`` key, a pool
        member never."""
        if not owner.known or owner.member:
            return False
        if owner.build and not may_build(principal):
            return False
        return owner.project is None or self._can_reach(principal, owner.project)

    def may_change(self, principal: Any, owner: Owner) -> bool:
        """Whether ``principal`` may change or remove ``owner``'s object: one of a project it
        reaches, as ``allows``; everyone's (untagged: shared by every tenant) only with an
        admin key of the root project, the operator's."""
        if owner.known and owner.project is None:
            return bool(principal.role == "admin" and principal.project == ROOT)
        return self.allows(principal, owner)

    def require(self, principal: Any, kind: str, name: str, owner: Owner) -> None:
        """``missing(kind, name)`` unless ``principal`` reaches ``owner``."""
        if not self.allows(principal, owner):
            raise missing(kind, name)


def missing(kind: str, name: str) -> NotFound:
    """The answer for a ``kind`` named ``name`` that does not exist, or that the caller does
    not reach: the same in both cases, naming only what the caller sent."""
    return KINDS[kind](f"no {_WHAT[kind]} {name!r}", name=name)
