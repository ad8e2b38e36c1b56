"""IAM's management API on the apiserver (``dsec_core.api.iam.IAM_ROUTES``): projects, their
quotas and API keys under ``/v1/iam``, for people and agents alike.

Every request's key was checked before it got here (``auth.Authenticated``); each route hands
the caller's principal to IAM's service as the ``actor``, and the service alone decides what
it may do (``Iam``: ``can_manage`` for projects and quotas, ``mint_refusal`` for keys), the
same rules the ``dsec iam`` CLI's direct path goes through. Refusals are IAM's typed errors
(``PermissionDenied`` 403, ``UnknownProject``/``UnknownKey`` 404, ``ProjectExists``/
``KeyExists``/``ProjectInUse`` 409, ``InvalidSpec`` 422); a project or key out of the caller's
reach answers as one that does not exist. The store is called in a thread: a write to SQLite
or etcd blocks for a moment, and the event loop serves other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

from ..api.iam import IAM_ROUTES, KeyList, MintedKey, ProjectList
from ..api.routes import JSON, Route
from ..api.serving import error_response, read_json_body
from ..errors import AuthenticationFailed, DsecError, UnknownKey, UnknownProject
from ..iam import (
    KeyInfo,
    Principal,
    Project,
    ProjectRevocation,
    Quota,
    check_project_path,
    in_subtree,
)
from ..observe import current_request_id, new_request_id
from .auth import PRINCIPAL

__all__ = ["IamManager", "iam_routes"]

log = logging.getLogger("dsec.apiserver")

#: The request id header (``app.REQUEST_ID``; repeated here so this module does not import the
#: app that mounts it).
_REQUEST_ID = "x-request-id"


class IamManager(Protocol):
    """What the IAM routes ask of IAM (``dsec_core.iam.Iam``)."""

    def key(self, key_id: str) -> KeyInfo: ...

    def project(self, path: str) -> Project: ...

    def projects(
        self, under: str | None = None, *, actor: Principal | None = None
    ) -> list[Project]: ...

    def create_project(
        self, path: str, quota: Quota | None = None, *, actor: Principal | None = None
    ) -> Project: ...

    def set_quota(self, path: str, quota: Quota, *, actor: Principal | None = None) -> Project: ...

    def revoke_project(
        self, path: str, *, force: bool = False, actor: Principal | None = None
    ) -> ProjectRevocation: ...

    def keys(
        self, project: str | None = None, *, actor: Principal | None = None
    ) -> list[KeyInfo]: ...

    def create_key(
        self,
        project: str,
        role: str,
        name: str | None = None,
        *,
        ttl: float | None = None,
        actor: Principal | None = None,
    ) -> tuple[KeyInfo, str]: ...

    def revoke_key(self, key_id: str, *, actor: Principal | None = None) -> KeyInfo: ...


#: What one route does: (IAM, the caller, its decoded query, its decoded body) -> the answer.
Action = Callable[[IamManager, Principal, Any, Any], Any]


def _whoami(iam: IamManager, who: Principal, query: Any, body: Any) -> KeyInfo:
    """The caller's key as stored now: one revoked since this apiserver cached it is no key."""
    try:
        return iam.key(who.key_id)
    except UnknownKey:
        raise AuthenticationFailed("API key missing, malformed, unknown or revoked") from None


def _projects(iam: IamManager, who: Principal, query: Any, body: Any) -> ProjectList:
    return ProjectList(tuple(iam.projects(query.under, actor=who)))


def _create_project(iam: IamManager, who: Principal, query: Any, body: Any) -> Project:
    return iam.create_project(body.path, body.quota, actor=who)


def _project(iam: IamManager, who: Principal, query: Any, body: Any) -> Project:
    """A project the caller sees (its own or one below it); any other answers as missing."""
    path = check_project_path(query.path, "path")
    if not in_subtree(path, who.project):
        raise UnknownProject(f"no project {path}", name=path)
    return iam.project(path)


def _set_quota(iam: IamManager, who: Principal, query: Any, body: Any) -> Project:
    return iam.set_quota(body.path, body.quota, actor=who)


def _revoke_project(iam: IamManager, who: Principal, query: Any, body: Any) -> ProjectRevocation:
    return iam.revoke_project(query.path, force=query.force, actor=who)


def _keys(iam: IamManager, who: Principal, query: Any, body: Any) -> KeyList:
    return KeyList(tuple(iam.keys(query.project, actor=who)))


def _create_key(iam: IamManager, who: Principal, query: Any, body: Any) -> MintedKey:
    info, secret = iam.create_key(body.project, body.role, body.name, ttl=body.ttl, actor=who)
    log.info("key %s (%s of %s) minted by key %s", info.key_id, info.role, info.project, who.key_id)
    return MintedKey(info, secret)


def _revoke_key(iam: IamManager, who: Principal, query: Any, body: Any, key: str = "") -> KeyInfo:
    info = iam.revoke_key(key, actor=who)
    log.info("key %s (%s of %s) revoked by key %s", key, info.role, info.project, who.key_id)
    return info


ACTIONS: dict[str, Action] = {
    "whoami": _whoami,
    "projects": _projects,
    "create_project": _create_project,
    "project": _project,
    "set_quota": _set_quota,
    "revoke_project": _revoke_project,
    "keys": _keys,
    "create_key": _create_key,
    "revoke_key": _revoke_key,
}


def _endpoint(iam: IamManager, route: Route) -> Callable[[Request], Awaitable[Response]]:
    action = ACTIONS[route.name]

    async def endpoint(request: Request) -> Response:
        rid = current_request_id() or new_request_id()
        principal: Principal = request.scope[PRINCIPAL]
        try:
            query = route.decode_query(request.query_params)
            body = None
            if route.body is not None:
                body = route.decode_body(await read_json_body(request, route.max_body))
            work = functools.partial(action, iam, principal, query, body, **request.path_params)
            answer = await asyncio.to_thread(work)
        except DsecError as e:
            return error_response(e, {_REQUEST_ID: rid})
        return Response(
            route.encode_response(answer),
            route.status,
            headers={_REQUEST_ID: rid},
            media_type=JSON,
        )

    return endpoint


def iam_routes(iam: Any) -> list[StarletteRoute]:
    """The Starlette routes of ``IAM_ROUTES`` over ``iam`` (an ``IamManager``); none if
    ``iam`` only authenticates (an ``Authority`` that manages nothing)."""
    if not all(callable(getattr(iam, name, None)) for name in ("create_key", "revoke_key", "key")):
        return []
    return [
        StarletteRoute(r.path, _endpoint(iam, r), methods=[r.method]) for r in IAM_ROUTES.values()
    ]
