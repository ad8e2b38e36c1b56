"""The route table of IAM's management API, which only an apiserver serves (a node has no
tenants): projects, their quotas and API keys under ``/v1/iam``, for people and agents alike.

Each route is a ``Route`` as in ``routes.ROUTES``, so the SDK builds its requests and reads its
answers from it, and the apiserver decodes bodies and queries with the same decoders. Answers
are IAM's own records (``dsec_core.iam``: ``Project``, ``Quota``, ``KeyInfo``,
``ProjectRevocation``) or the small messages here. Project paths contain ``/``, so they travel
in queries and bodies, never in a path segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..iam.model import KeyInfo, Project, ProjectRevocation, Quota
from .messages import Message
from .routes import MAX_SPEC_BODY, Route

__all__ = [
    "IAM_ROUTES",
    "KeyList",
    "KeyQuery",
    "KeyRequest",
    "MintedKey",
    "ProjectList",
    "ProjectQuery",
    "ProjectRequest",
    "ProjectsQuery",
    "QuotaRequest",
    "RevokeProjectQuery",
]


@dataclass(frozen=True)
class ProjectsQuery(Message):
    """Which projects to list: ``under``'s subtree (None: all the caller sees)."""

    under: str | None = None


@dataclass(frozen=True)
class ProjectQuery(Message):
    """One project, by its path (``org/team``; ``/`` is the root)."""

    path: str


@dataclass(frozen=True)
class RevokeProjectQuery(Message):
    """A project to revoke; ``force`` also revokes its subprojects and their keys."""

    path: str
    force: bool = False


@dataclass(frozen=True)
class ProjectRequest(Message):
    """A project to create under its existing parent, with its quota."""

    path: str
    quota: Quota = field(default_factory=Quota)


@dataclass(frozen=True)
class QuotaRequest(Message):
    """A project's new quota (it replaces the old one whole)."""

    path: str
    quota: Quota


@dataclass(frozen=True)
class ProjectList(Message):
    projects: tuple[Project, ...]


@dataclass(frozen=True)
class KeyQuery(Message):
    """Which keys to list: those of ``project``'s subtree (None: all the caller may see)."""

    project: str | None = None


@dataclass(frozen=True)
class KeyRequest(Message):
    """A key to mint: its project, role, name (unique in the project) and seconds to live
    (None: until revoked)."""

    project: str
    role: str
    name: str | None = None
    ttl: float | None = None


@dataclass(frozen=True)
class MintedKey(Message):
    """A minted key and its secret: the only time the secret is shown."""

    key: KeyInfo
    secret: str


@dataclass(frozen=True)
class KeyList(Message):
    keys: tuple[KeyInfo, ...]


_IAM = "/v1/iam"

IAM_ROUTES: dict[str, Route] = {
    r.name: r
    for r in (
        Route("whoami", "GET", _IAM + "/whoami", "The caller's own API key", KeyInfo),
        Route(
            "projects",
            "GET",
            _IAM + "/projects",
            "The projects the caller sees (its project's subtree), with their quotas",
            ProjectList,
            query=ProjectsQuery,
        ),
        Route(
            "create_project",
            "POST",
            _IAM + "/projects",
            "Create a project under its parent: an admin's in its subtree; any other key's "
            "below its own project, with a quota no larger than its own",
            Project,
            body=ProjectRequest,
            status=201,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "project",
            "GET",
            _IAM + "/project",
            "One project the caller sees, with its quota",
            Project,
            query=ProjectQuery,
        ),
        Route(
            "set_quota",
            "PUT",
            _IAM + "/project/quota",
            "Replace a project's quota (an admin's, in its subtree)",
            Project,
            body=QuotaRequest,
            idempotent=True,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "revoke_project",
            "DELETE",
            _IAM + "/project",
            "Revoke a project (an admin's, in its subtree); with force its subprojects and "
            "their keys too",
            ProjectRevocation,
            query=RevokeProjectQuery,
        ),
        Route(
            "keys",
            "GET",
            _IAM + "/keys",
            "The keys the caller may revoke (an admin: its subtree's; any key: those it "
            "minted), never their secrets",
            KeyList,
            query=KeyQuery,
        ),
        Route(
            "create_key",
            "POST",
            _IAM + "/keys",
            "Mint a key no wider than the caller's own; its secret is in this answer only",
            MintedKey,
            body=KeyRequest,
            status=201,
            max_body=MAX_SPEC_BODY,
        ),
        Route(
            "revoke_key",
            "DELETE",
            _IAM + "/keys/{key}",
            "Revoke a key and those it minted (within 2 s on every apiserver)",
            KeyInfo,
            idempotent=False,
        ),
    )
}
