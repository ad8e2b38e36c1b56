"""``Iam``: nested projects with quotas, API keys with roles, and the checks every apiserver
request goes through (who is this key, may it reach that project, does the request fit the
quotas).

API keys look like ``dsk_<key id>_<secret part>``: the id finds the key's record, the whole
key is checked against the SHA-256 hash stored there. One fast hash is enough because the
secret part is 256 random bits: nobody can guess it or brute-force a hash of it, and unlike
passwords there is no small space of likely values to try; a slow KDF (scrypt, PBKDF2) would
only add tens of milliseconds to every request. Digests are compared with
``hmac.compare_digest``.

Authenticated keys and the project table are cached in the process for ``cache_ttl`` seconds
(2 by default): a key revoked or a quota changed by another process takes effect within that
bound; by this process, at once.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..config import default_home
from ..errors import (
    AuthenticationFailed,
    InvalidSpec,
    KeyExists,
    PermissionDenied,
    ProjectExists,
    ProjectInUse,
    QuotaExceeded,
    UnknownKey,
    UnknownProject,
)
from .model import (
    LOOSEN_ROLES,
    MINTABLE,
    RESOURCES,
    ROLES,
    ROOT,
    KeyInfo,
    Principal,
    Project,
    ProjectRevocation,
    Quota,
    Usage,
    ancestors,
    check_key_name,
    check_project_path,
    in_subtree,
    parent_of,
)
from .store import EtcdStore, IamStore, SqliteStore

__all__ = [
    "KEY_PREFIX",
    "Iam",
    "can_loosen",
    "can_manage",
    "can_reach",
    "default_iam_url",
    "mint_refusal",
]

#: Every API key starts with this, so a leaked one is recognisable (secret scanners).
KEY_PREFIX = "dsk_"
_SECRET_RE = re.compile(r"^dsk_([0-9a-f]{16})_([0-9a-f]{64})$")
#: One message for every failure, so a caller learns nothing about which keys exist.
_AUTH_FAILED = "API key missing, malformed, unknown or revoked"
_CACHE_MAX = 10_000


def default_iam_url() -> str:
    """``DSEC_IAM`` if set, else the SQLite file ``$DSEC_HOME/iam.db``."""
    return os.environ.get("DSEC_IAM") or f"sqlite://{default_home().absolute() / 'iam.db'}"


def can_reach(principal: Principal, project: str) -> bool:
    """May ``principal`` touch sandboxes labelled with ``project``? Admins, members and
    builders: those of their project and its subprojects; agents: only those of exactly their
    own project. (Which of them are builds' is the apiserver's check.)"""
    if principal.role == "agent":
        return project == principal.project
    return principal.role in ("admin", "member", "builder") and in_subtree(
        project, principal.project
    )


def can_loosen(principal: Principal) -> bool:
    """May ``principal`` loosen a sandbox's security policies against the node's default
    (``LOOSEN_ROLES``: admin and builder keys)? Others may only tighten them."""
    return principal.role in LOOSEN_ROLES


def can_manage(principal: Principal, project: str) -> bool:
    """May ``principal`` create, change or revoke ``project`` and keys in it? Only an admin
    of that project or one above it."""
    return principal.role == "admin" and in_subtree(project, principal.project)


def mint_refusal(
    principal: Principal, project: str, role: str, expires: float | None = None
) -> str | None:
    """Why ``principal`` may not mint a key of ``role`` for ``project`` expiring at
    ``expires`` (None: it may). A key mints only keys no wider than itself: a role it may
    mint (``MINTABLE``: its own or narrower; an admin's any), in its own project or one below
    it, expiring no later than itself when it expires."""
    if role not in MINTABLE.get(principal.role, ()):
        return (
            f"a {principal.role} key may not mint {role} keys (only "
            f"{', '.join(MINTABLE.get(principal.role, ())) or 'none'})"
        )
    if not in_subtree(project, principal.project):
        return (
            f"a key of project {principal.project} may not mint keys for project {project} "
            "(only for its own project and those below it)"
        )
    if principal.expires is not None and (expires is None or expires > principal.expires):
        return (
            f"a key that expires at {principal.expires:.0f} may not mint one that outlives it "
            f"({'never expiring' if expires is None else f'expiring at {expires:.0f}'})"
        )
    return None


def _project_key(path: str) -> str:
    return f"project/{path}"


def _key_key(key_id: str) -> str:
    return f"key/{key_id}"


def _name_key(project: str, name: str) -> str:
    return f"keyname/{project}:{name}"


def _positive(name: str, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 0 < value < 1e10:
        raise InvalidSpec(f"{name} must be seconds (more than 0), got {value!r}", field=name)


def _digest(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


def _stored_key(value: Mapping[str, Any]) -> tuple[KeyInfo, str]:
    fields = dict(value)
    digest = str(fields.pop("hash"))
    return KeyInfo.from_dict(fields), digest


class Iam:
    """Projects, API keys and authorisation over one ``IamStore``.

    Every operation takes and returns the records of ``dsec_core.iam.model``. Those that
    change something take ``actor``: the principal asking (the apiserver's IAM routes pass the
    caller's), checked here and only here (``can_manage`` for projects and quotas,
    ``mint_refusal`` for keys, a sub-agent's project within the actor's quota); None is the
    machine's operator working on the store directly (the ``dsec iam`` CLI), who may do
    anything. Thread-safe; its methods block on
    the store (microseconds on SQLite, a loopback round trip on etcd), so an asyncio server
    may prefer to call the uncached paths through a thread.
    """

    def __init__(self, store: IamStore, *, cache_ttl: float = 2.0) -> None:
        self.store = store
        self.cache_ttl = cache_ttl
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[str, Principal, float]] = {}
        self._projects: dict[str, Project] | None = None
        self._projects_at = 0.0

    @classmethod
    def open(cls, url: str | None = None, *, cache_ttl: float = 2.0) -> Iam:
        """IAM on the store ``url`` names: ``sqlite:///abs/path.db`` or
        ``etcd://host:port[/prefix]`` (default prefix ``dsec/iam``). None: ``DSEC_IAM``, else
        ``sqlite:///$DSEC_HOME/iam.db``."""
        url = url or default_iam_url()
        parsed = urlparse(url)
        if parsed.scheme == "sqlite" and not parsed.netloc and parsed.path.startswith("/"):
            return cls(SqliteStore(Path(parsed.path)), cache_ttl=cache_ttl)
        if parsed.scheme == "etcd" and parsed.netloc:
            prefix = parsed.path.strip("/") or "dsec/iam"
            return cls(EtcdStore(f"http://{parsed.netloc}", prefix), cache_ttl=cache_ttl)
        raise InvalidSpec(
            f"IAM store {url!r}: expected sqlite:///absolute/path.db or etcd://host:port[/prefix]",
            field="iam",
        )

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Iam:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- projects ---------------------------------------------------------------------------

    def _allow(self, actor: Principal | None, project: str) -> None:
        if actor is not None and not can_manage(actor, project):
            raise PermissionDenied(
                f"key {actor.key_id} ({actor.role} of {actor.project}) may not manage "
                f"project {project}",
                project=project,
            )

    def _forget_projects(self) -> None:
        with self._lock:
            self._projects = None

    def create_project(
        self, path: str, quota: Quota | None = None, *, actor: Principal | None = None
    ) -> Project:
        """Make project ``path`` under its existing parent (``UnknownProject`` if there is
        none, ``ProjectExists`` if ``path`` is taken)."""
        check_project_path(path)
        if path == ROOT:
            raise ProjectExists("the root project always exists", project=ROOT)
        if quota is not None and not isinstance(quota, Quota):
            raise InvalidSpec(f"quota must be a Quota, got {quota!r}", field="quota")
        if actor is not None and actor.role != "admin":
            self._allow_delegated_project(actor, path, quota or Quota())
        else:
            self._allow(actor, path)
        project = Project(path, quota or Quota(), time.time())
        parent = parent_of(path)
        require = [] if parent == ROOT else [_project_key(parent)]
        if not self.store.create({_project_key(path): project.to_dict()}, require):
            if require and self.store.get(require[0]) is None:
                raise UnknownProject(
                    f"no project {parent} to create {path} in", name=parent, project=path
                )
            raise ProjectExists(f"project {path} already exists", project=path)
        self._forget_projects()
        return project

    def _allow_delegated_project(self, actor: Principal, path: str, quota: Quota) -> None:
        """A key that is no admin's may make a project below its own (a sub-agent's), with a
        quota no larger than its own project's (the tightest bound of it and its ancestors);
        the new project's use counts against those quotas too, as every subproject's does."""
        if path == actor.project or not in_subtree(path, actor.project):
            raise PermissionDenied(
                f"key {actor.key_id} ({actor.role} of {actor.project}) may make projects only "
                f"below its own, not {path}",
                project=path,
            )
        own = self.effective_quota(actor.project)
        for resource in RESOURCES:
            bound, asked = own.limit(resource), quota.limit(resource)
            if bound is not None and asked is not None and asked > bound:
                raise PermissionDenied(
                    f"key {actor.key_id} ({actor.role} of {actor.project}) may not give "
                    f"project {path} a quota of {resource} of {asked:g}: its own is {bound:g}",
                    project=path,
                    resource=resource,
                    limit=bound,
                    requested=asked,
                )

    def effective_quota(self, path: str) -> Quota:
        """The tightest bound on each resource over ``path`` and its ancestors: the most its
        subtree may ever run."""
        bounds: dict[str, Any] = {}
        for p in ancestors(check_project_path(path)):
            quota = self.project(p).quota
            for resource in RESOURCES:
                limit = quota.limit(resource)
                if limit is not None and (bounds.get(resource) is None or limit < bounds[resource]):
                    bounds[resource] = limit
        return Quota(**bounds)

    def project(self, path: str) -> Project:
        """Project ``path`` as stored now (the root: a record with no quota)."""
        check_project_path(path)
        if path == ROOT:
            return Project(ROOT)
        value = self.store.get(_project_key(path))
        if value is None:
            raise UnknownProject(f"no project {path}", name=path)
        return Project.from_dict(value)

    def projects(
        self, under: str | None = None, *, actor: Principal | None = None
    ) -> list[Project]:
        """The projects in ``under``'s subtree (itself included; None: all), by path. An
        actor sees only the subtree of its own project."""
        under = check_project_path(under) if under is not None else ROOT
        if actor is not None and not in_subtree(under, actor.project):
            if not in_subtree(actor.project, under):
                return []
            under = actor.project
        prefix = "project/" if under == ROOT else f"project/{under}"
        out = [
            Project.from_dict(v)
            for v in self.store.scan(prefix).values()
            if in_subtree(v["path"], under)
        ]
        return sorted(out, key=lambda p: p.path)

    def set_quota(self, path: str, quota: Quota, *, actor: Principal | None = None) -> Project:
        """Replace ``path``'s quota; it applies to the next ``check_quota`` (in other
        processes: within ``cache_ttl``)."""
        check_project_path(path)
        if path == ROOT:
            raise InvalidSpec("the root project has no quota; set one on each org", field="path")
        self._allow(actor, path)
        if not isinstance(quota, Quota):
            raise InvalidSpec(f"quota must be a Quota, got {quota!r}", field="quota")
        current = self.project(path)
        updated = Project(path, quota, current.created)
        if not self.store.update(_project_key(path), updated.to_dict()):
            raise UnknownProject(f"no project {path}", name=path)
        self._forget_projects()
        return updated

    def revoke_project(
        self, path: str, *, force: bool = False, actor: Principal | None = None
    ) -> ProjectRevocation:
        """Remove project ``path``. One with subprojects or keys is ``ProjectInUse`` unless
        ``force``, which removes them too (keys first, then projects deepest first).

        Sandboxes still running with that project's label are the apiserver's to deal with.
        The check for subprojects and keys and the removal are two steps: a subproject or key
        made in between by another process is left without its parent, and such a key no
        longer authenticates (``authenticate`` checks that the key's project exists)."""
        check_project_path(path)
        if path == ROOT:
            raise InvalidSpec("the root project cannot be revoked", field="path")
        self._allow(actor, path)
        self.project(path)  # UnknownProject if absent
        children = sorted(
            (v["path"] for v in self.store.scan(f"project/{path}/").values()),
            key=lambda p: (-p.count("/"), p),
        )
        stored = [_stored_key(v)[0] for v in self.store.scan("key/").values()]
        keys = [k for k in stored if in_subtree(k.project, path)]
        if (children or keys) and not force:
            raise ProjectInUse(
                f"project {path} has {len(children)} subproject(s) and {len(keys)} key(s); "
                "revoke them first, or force it",
                project=path,
                children=children,
                keys=[k.key_id for k in keys],
            )
        doomed = [_key_key(k.key_id) for k in keys]
        doomed += [_name_key(k.project, k.name) for k in keys if k.name]
        self.store.delete(doomed)
        self.store.delete([_project_key(p) for p in [*children, path]])
        with self._lock:
            self._projects = None
            for k in keys:
                self._keys.pop(k.key_id, None)
        return ProjectRevocation((*children, path), tuple(k.key_id for k in keys))

    # --- keys -------------------------------------------------------------------------------

    def create_key(
        self,
        project: str,
        role: str,
        name: str | None = None,
        *,
        ttl: float | None = None,
        actor: Principal | None = None,
    ) -> tuple[KeyInfo, str]:
        """A new API key of ``role`` for ``project`` and its secret, the only time the secret
        is shown: only its hash is kept. ``name`` (optional) is unique within the project
        (``KeyExists``); ``ttl``: seconds until it expires (None: never).

        An actor mints only keys no wider than itself (``mint_refusal``, else
        ``PermissionDenied``). A key minted by one that is no admin's is a delegation: it
        records its minter (``minted_by``) and stops authenticating when the minter does."""
        check_project_path(project)
        check_key_name(name)
        if role not in ROLES:
            raise InvalidSpec(f"role must be one of {', '.join(ROLES)}, got {role!r}", field="role")
        if ttl is not None:
            _positive("ttl", ttl)
        now = time.time()
        expires = None if ttl is None else now + ttl
        minted_by = None
        if actor is not None:
            why = mint_refusal(actor, project, role, expires)
            if why:
                raise PermissionDenied(f"key {actor.key_id}: {why}", project=project, role=role)
            minted_by = None if actor.role == "admin" else actor.key_id
        require = [] if project == ROOT else [_project_key(project)]
        if minted_by is not None:
            require.append(_key_key(minted_by))  # not minted by a key revoked meanwhile
        while True:
            key_id = secrets.token_hex(8)
            secret = f"{KEY_PREFIX}{key_id}_{secrets.token_hex(32)}"
            info = KeyInfo(key_id, project, role, name, now, expires, minted_by)
            items = {_key_key(key_id): info.to_dict() | {"hash": _digest(secret)}}
            if name:
                items[_name_key(project, name)] = {"key_id": key_id}
            if self.store.create(items, require):
                return info, secret
            if project != ROOT and self.store.get(require[0]) is None:
                raise UnknownProject(f"no project {project}", name=project)
            if minted_by is not None and self.store.get(_key_key(minted_by)) is None:
                raise AuthenticationFailed(_AUTH_FAILED)
            if name and self.store.get(_name_key(project, name)) is not None:
                raise KeyExists(
                    f"project {project} already has a key named {name}", project=project, name=name
                )
            # else the random id collided with an existing key's (1 in 2**64): draw again

    def _all_keys(self) -> list[KeyInfo]:
        return [_stored_key(v)[0] for v in self.store.scan("key/").values()]

    @staticmethod
    def _minted_under(key_id: str, stored: list[KeyInfo]) -> list[KeyInfo]:
        """The keys ``key_id`` minted, and those they minted, and so on."""
        children: dict[str, list[KeyInfo]] = {}
        for k in stored:
            if k.minted_by is not None:
                children.setdefault(k.minted_by, []).append(k)
        out, todo = [], [key_id]
        while todo:
            for k in children.get(todo.pop(), ()):
                out.append(k)
                todo.append(k.key_id)
        return out

    def _may_revoke(self, actor: Principal, info: KeyInfo, stored: list[KeyInfo]) -> bool:
        """An admin revokes the keys of its subtree; any key those it minted (transitively)."""
        if can_manage(actor, info.project):
            return True
        return info.key_id in {k.key_id for k in self._minted_under(actor.key_id, stored)}

    def keys(self, project: str | None = None, *, actor: Principal | None = None) -> list[KeyInfo]:
        """The keys of ``project`` and its subprojects (None: all), by project then creation;
        never their secrets or hashes. An actor sees only those it may revoke (an admin: its
        subtree's; any key: those it minted)."""
        top = check_project_path(project) if project is not None else ROOT
        stored = self._all_keys()
        mine = (
            set() if actor is None else {k.key_id for k in self._minted_under(actor.key_id, stored)}
        )
        out = [
            info
            for info in stored
            if in_subtree(info.project, top)
            and (actor is None or can_manage(actor, info.project) or info.key_id in mine)
        ]
        return sorted(out, key=lambda k: (k.project, k.created, k.key_id))

    def key(self, key_id: str) -> KeyInfo:
        """Key ``key_id``'s record (``UnknownKey`` if there is none)."""
        value = self.store.get(_key_key(key_id)) if re.fullmatch(r"[0-9a-f]{16}", key_id) else None
        if value is None:
            raise UnknownKey(f"no API key {key_id}", name=key_id)
        return _stored_key(value)[0]

    def revoke_key(self, key_id: str, *, actor: Principal | None = None) -> KeyInfo:
        """Remove key ``key_id`` and the keys it minted (transitively): they stop
        authenticating at once in this process, within ``cache_ttl`` in others. A key the
        actor may not revoke (``keys``) is ``UnknownKey`` too."""
        stored = self._all_keys()
        info = next((k for k in stored if k.key_id == key_id), None)
        if info is None or (actor is not None and not self._may_revoke(actor, info, stored)):
            raise UnknownKey(f"no API key {key_id}", name=key_id)
        gone = [info, *self._minted_under(key_id, stored)]
        doomed = [_key_key(k.key_id) for k in gone]
        doomed += [_name_key(k.project, k.name) for k in gone if k.name]
        self.store.delete(doomed)
        with self._lock:
            for k in gone:
                self._keys.pop(k.key_id, None)
        return info

    def authenticate(self, secret: str | None) -> Principal:
        """The principal of API key ``secret``; ``AuthenticationFailed`` (one message for all)
        if it is missing, malformed, unknown, revoked, or its project was revoked."""
        match = _SECRET_RE.match(secret) if isinstance(secret, str) else None
        if match is None:
            raise AuthenticationFailed(_AUTH_FAILED)
        key_id = match.group(1)
        digest = _digest(secret)  # type: ignore[arg-type]
        now = time.monotonic()
        with self._lock:
            cached = self._keys.get(key_id)
        if cached is not None and cached[2] > now:
            if hmac.compare_digest(cached[0], digest):
                return cached[1]
            raise AuthenticationFailed(_AUTH_FAILED)
        value = self.store.get(_key_key(key_id))
        if value is None:
            raise AuthenticationFailed(_AUTH_FAILED)
        info, stored = _stored_key(value)
        if not hmac.compare_digest(stored, digest):
            raise AuthenticationFailed(_AUTH_FAILED)
        # revoked with its project? (the project table is cached like keys: one read per ttl)
        if info.project != ROOT and info.project not in self._project_table(info.project):
            raise AuthenticationFailed(_AUTH_FAILED)
        left = math.inf if info.expires is None else info.expires - time.time()
        if left <= 0 or (info.minted_by is not None and not self._minter_alive(info.minted_by)):
            raise AuthenticationFailed(_AUTH_FAILED)
        principal = Principal(key_id, info.project, info.role, info.expires)
        with self._lock:
            if len(self._keys) >= _CACHE_MAX:
                self._keys.clear()
            # remembered no longer than the ttl, nor past the key's expiry
            self._keys[key_id] = (stored, principal, now + min(self.cache_ttl, left))
        return principal

    def _minter_alive(self, key_id: str) -> bool:
        """Whether the key that minted another still authenticates: it exists, has not
        expired, and its own minter is alive (a delegation never outlives its chain)."""
        for _ in range(64):  # a chain is short; a cycle cannot be made, but never loop on one
            value = self.store.get(_key_key(key_id))
            if value is None:
                return False
            info = _stored_key(value)[0]
            if info.expires is not None and info.expires <= time.time():
                return False
            if info.minted_by is None:
                return True
            key_id = info.minted_by
        return False

    # --- authorisation ----------------------------------------------------------------------

    @staticmethod
    def can_reach(principal: Principal, project: str) -> bool:
        """See ``dsec_core.iam.can_reach``."""
        return can_reach(principal, project)

    @staticmethod
    def can_loosen(principal: Principal) -> bool:
        """See ``dsec_core.iam.can_loosen``."""
        return can_loosen(principal)

    @staticmethod
    def can_manage(principal: Principal, project: str) -> bool:
        """See ``dsec_core.iam.can_manage``."""
        return can_manage(principal, project)

    @staticmethod
    def usage(sandboxes: int = 0, cpu: float = 0.0, memory: int = 0) -> Usage:
        """A ``Usage`` record, for callers that hold an ``Iam`` but keep off its records'
        module (the apiserver's ``Authority`` protocol)."""
        return Usage(sandboxes, cpu, memory)

    def require_manage(self, principal: Principal, project: str) -> None:
        """``PermissionDenied`` unless ``principal`` may manage ``project``."""
        self._allow(principal, check_project_path(project))

    def _project_table(self, path: str) -> dict[str, Project]:
        """Every project, from a snapshot at most ``cache_ttl`` old (fresher if ``path`` is not
        in it: it may have been made since)."""
        now = time.monotonic()
        with self._lock:
            table, at = self._projects, self._projects_at
        if table is None or at + self.cache_ttl <= now or path not in table:
            table = {p.path: p for p in self.projects()}
            with self._lock:
                self._projects, self._projects_at = table, now
        return table

    def check_quota(
        self,
        project: str,
        usage: Mapping[str, Usage | Mapping[str, Any]],
        add: Usage | Mapping[str, Any],
    ) -> None:
        """``QuotaExceeded`` unless ``add`` fits in ``project``'s quota and every ancestor's,
        each counted over its whole subtree. ``usage`` maps each project's path to what its
        own running sandboxes take (the apiserver sums the nodes' reports); the error names
        the project whose quota it is, nearest first. ``UnknownProject`` if ``project`` is
        not there. Usage given as plain dicts (``Usage.to_dict`` form) is read as such.

        Two requests checked at once against the same usage may both fit and together go
        over: the apiserver's usage is what the nodes last reported, so quotas bound what
        runs up to the requests in flight between two probes."""
        check_project_path(project)
        add = add if isinstance(add, Usage) else Usage.from_dict(add)
        own = {p: u if isinstance(u, Usage) else Usage.from_dict(u) for p, u in usage.items()}
        if project == ROOT:
            return
        table = self._project_table(project)
        if project not in table:
            raise UnknownProject(f"no project {project}", name=project)
        for path in ancestors(project):
            quota = table[path].quota if path in table else Quota()
            limits = [(r, quota.limit(r)) for r in RESOURCES if quota.limit(r) is not None]
            if not limits:
                continue
            inside = [u for p, u in own.items() if in_subtree(p, path)]
            for resource, limit in limits:
                assert limit is not None
                before = sum(u.amount(resource) for u in inside)
                asked = add.amount(resource)
                if before + asked > limit:
                    raise QuotaExceeded(
                        f"project {path}'s quota of {resource} is {limit:g}: {before:g} in use, "
                        f"{asked:g} more asked for"
                        + ("" if path == project else f" (by {project})"),
                        project=path,
                        resource=resource,
                        limit=limit,
                        used=before,
                        requested=asked,
                    )
