"""E2B's control plane (JSON over HTTP, the paths of ``e2b.api.client``) over dsec sandboxes:
create, get, list with paging and filters, kill, timeout, pause and connect (resume).

A template is a dsec environment (``Templates``); the sandbox's ``timeout`` is its ttl; its
``metadata`` are labels ``e2b.meta.<key>``, and the template asked for is the label
``e2b.template``, so nothing is kept here: every answer is built from the node's
``SandboxInfo``.
"""

from __future__ import annotations

import base64
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..api.routes import MAX_ITEMS, load_json
from ..api.serving import read_body, request_key
from ..errors import DsecError, FeatureUnavailable, InvalidSpec, UnknownSandbox
from ..records import SandboxInfo
from .callers import Connect, api_error, caller_client, error_body

__all__ = [
    "DEFAULT_TEMPLATES",
    "E2B_MAX_BODY",
    "ENVD_VERSION",
    "LABEL_TEMPLATE",
    "META_PREFIX",
    "Templates",
    "lifecycle_refusal",
    "lifecycle_routes",
]

#: The envd version dsec answers with. Below 0.6.2, so the SDK itself refuses file metadata
#: (``TemplateException``), which dsec does not keep; at or above 0.5.7, so streamed uploads
#: go as one octet-stream body.
ENVD_VERSION = "0.6.1"
META_PREFIX = "e2b.meta."
LABEL_TEMPLATE = "e2b.template"
#: E2B's default template is ``base``; here it is the default catalog's ``python``.
DEFAULT_TEMPLATES: Mapping[str, str] = {"base": "python"}
DEFAULT_TIMEOUT = 300  # seconds, E2B's default sandbox timeout
LIST_LIMIT, LIST_MAX = 100, 1000
#: The largest control-plane body read (a create's template, metadata and envs); more is 413,
#: refused from its Content-Length before a byte of it is read.
E2B_MAX_BODY = 1 << 20
NO_END = datetime(9999, 12, 31, tzinfo=UTC)  # endAt of a sandbox without a ttl


@dataclass(frozen=True)
class Templates:
    """Which dsec environment an E2B template name creates: ``mapping`` first, else the name
    itself (the node then answers ``UnknownEnvironment``, a 404, if it has no such one)."""

    mapping: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_TEMPLATES))
    #: Built templates (``template_routes.BuiltTemplates``), consulted first; None: none.
    built: Any = None

    @classmethod
    def parse(cls, text: str | None) -> Templates:
        """``DSEC_E2B_TEMPLATES`` syntax, ``base=python,web=node-env``, on top of the defaults."""
        mapping = dict(DEFAULT_TEMPLATES)
        for part in (text or "").split(","):
            if not part.strip():
                continue
            name, eq, env = part.partition("=")
            if not eq or not name.strip() or not env.strip():
                raise InvalidSpec(
                    f"DSEC_E2B_TEMPLATES: {part.strip()!r} is not template=environment",
                    field="DSEC_E2B_TEMPLATES",
                )
            mapping[name.strip()] = env.strip()
        return cls(mapping)

    @classmethod
    def from_env(cls) -> Templates:
        return cls.parse(os.environ.get("DSEC_E2B_TEMPLATES"))

    def environment(self, template: str) -> str:
        return self.mapping.get(template, template)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def _state(info: SandboxInfo) -> str:
    return "paused" if info.state == "paused" else "running"


def listed_sandbox(info: SandboxInfo) -> dict[str, Any]:
    """``ListedSandbox`` (and the core of ``SandboxDetail``) for a sandbox."""
    labels = dict(info.labels)
    limits = dict(info.limits)
    template = info.environment or (info.layers[-1] if info.layers else "")
    return {
        "templateID": template,
        "alias": labels.get(LABEL_TEMPLATE, template),
        "sandboxID": info.id,
        "clientID": "dsec",
        "startedAt": _iso(info.created),
        "endAt": _iso(info.expires) if info.expires is not None else NO_END.isoformat(),
        "cpuCount": max(1, math.ceil(float(limits.get("cpu") or 1))),
        "memoryMB": int(limits.get("memory") or 0) >> 20,
        "diskSizeMB": int(limits.get("disk") or 0) >> 20,
        "state": _state(info),
        "envdVersion": ENVD_VERSION,
        "metadata": {
            k[len(META_PREFIX) :]: v for k, v in labels.items() if k.startswith(META_PREFIX)
        },
    }


def created_sandbox(info: SandboxInfo, key: str) -> dict[str, Any]:
    """``Sandbox``, the answer to a create or connect. ``envdAccessToken`` is the caller's own
    key: the SDK sends it back on envd's paths (``X-Access-Token``), where it authenticates the
    caller just as ``X-API-KEY`` does here, so no per-sandbox secret needs keeping."""
    labels = dict(info.labels)
    template = info.environment or (info.layers[-1] if info.layers else "")
    return {
        "templateID": template,
        "alias": labels.get(LABEL_TEMPLATE, template),
        "sandboxID": info.id,
        "clientID": "dsec",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": key,
        "domain": None,
    }


def _api_key(request: Request) -> str | None:
    """The caller's key: ``X-API-KEY`` (a Bearer key first, as the apiserver checked it)."""
    return request_key(request.scope["headers"])


async def _json(request: Request) -> dict[str, Any]:
    """The request's JSON object, read within ``E2B_MAX_BODY`` and in time (413 and 408
    otherwise) and nested no deeper than ``MAX_DEPTH``."""
    body = load_json(await read_body(request, E2B_MAX_BODY) or b"{}", "body", max_items=MAX_ITEMS)
    if not isinstance(body, dict):
        raise InvalidSpec("the body must be a JSON object", field="body")
    return body


def _strings(body: Mapping[str, Any], name: str) -> dict[str, str]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidSpec(f"{name} must map strings to strings", field=name)
    return dict(value)


def _timeout(body: Mapping[str, Any], default: int | None) -> int | None:
    value = body.get("timeout", default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidSpec(
            f"timeout must be a positive number of seconds, got {value!r}", field="timeout"
        )
    return value


#: Create fields dsec has no counterpart for: refused, not ignored (each changes behaviour).
_UNSUPPORTED_CREATE = ("network", "mcp", "volumeMounts", "iam", "autoResume")


def _check_create(body: Mapping[str, Any]) -> str:
    template = body.get("templateID")
    if not isinstance(template, str) or not template:
        raise InvalidSpec("templateID must be a template name", field="templateID")
    for name in _UNSUPPORTED_CREATE:
        if body.get(name) not in (None, {}, []):
            raise InvalidSpec(f"{name} is not supported by dsec's E2B API", field=name)
    if body.get("autoPause") is True:
        raise InvalidSpec(
            "autoPause is not supported: a dsec sandbox is killed at its timeout",
            field="autoPause",
        )
    if body.get("allow_internet_access") not in (None, True, False):
        raise InvalidSpec(
            "allow_internet_access must be true or false", field="allow_internet_access"
        )
    return template


def _network(body: Mapping[str, Any]) -> dict[str, Any]:
    """``allow_internet_access: true`` is dsec's ``network="internet"`` (out through the node's
    NAT, private ranges, cloud metadata and the node's own addresses refused); false or absent
    leaves the sandbox its default, loopback only."""
    return {"network": "internet"} if body.get("allow_internet_access") is True else {}


async def _set_ttl(client: Any, sandbox_id: str, ttl: float | None) -> None:
    set_ttl = getattr(client, "set_ttl", None)
    if set_ttl is None:
        raise FeatureUnavailable("this dsec node has no set_ttl: cannot change a sandbox's timeout")
    await set_ttl(sandbox_id, ttl)


async def _info(client: Any, sandbox_id: str) -> SandboxInfo:
    """The sandbox's info; a dead one is as unknown as one that never was (E2B forgets them)."""
    info = (await client.get(sandbox_id)).info
    if info.state == "dead":
        raise UnknownSandbox(f"sandbox {sandbox_id} is dead", name=sandbox_id)
    return info


def _page_token(info: SandboxInfo) -> str:
    raw = json.dumps([info.created, info.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _after(token: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        created, sid = load_json(raw, "nextToken")  # a made-up one may nest [[[...]]]
        return float(created), str(sid)
    except (InvalidSpec, ValueError, TypeError) as e:
        raise InvalidSpec(f"nextToken {token!r} is not one this API gave", field="nextToken") from e


@dataclass(frozen=True)
class ListQuery:
    """``GET /v2/sandboxes``'s query as the SDK sends it."""

    metadata: dict[str, str]
    states: frozenset[str]
    started_after: float | None
    template: str | None
    order: str
    limit: int
    after: tuple[float, str] | None

    @classmethod
    def parse(cls, q: Mapping[str, str], v1: bool = False) -> ListQuery:
        # the SDK percent-quotes each key and value (``quote``), then url-encodes the pairs as
        # one parameter (``urlencode``): the query's decoding undid the transport's layer,
        # ``parse_qsl`` undoes ``urlencode``, and ``unquote`` the SDK's own quoting, so keys
        # and values with spaces, ``&``, ``=``, ``/`` or any UTF-8 match exactly
        metadata = {
            unquote(k): unquote(v)
            for k, v in parse_qsl(q.get("metadata", ""), keep_blank_values=True)
        }
        states = frozenset(s for s in q.get("state", "").split(",") if s)
        if not states:
            states = frozenset({"running"}) if v1 else frozenset({"running", "paused"})
        if not states <= {"running", "paused"}:
            raise InvalidSpec(
                f"state must be running and/or paused, got {sorted(states)}", field="state"
            )
        started_after = None
        if q.get("startedAfter"):
            try:
                started_after = datetime.fromisoformat(q["startedAfter"]).timestamp()
            except ValueError:
                raise InvalidSpec(
                    "startedAfter must be an ISO 8601 time", field="startedAfter"
                ) from None
        order = q.get("order", "asc")
        if order not in ("asc", "desc"):
            raise InvalidSpec(f"order must be asc or desc, got {order!r}", field="order")
        try:
            limit = int(q.get("limit", LIST_LIMIT))
        except ValueError:
            raise InvalidSpec("limit must be an integer", field="limit") from None
        if not 1 <= limit <= LIST_MAX:
            raise InvalidSpec(f"limit must be 1 to {LIST_MAX}, got {limit}", field="limit")
        after = _after(q["nextToken"]) if q.get("nextToken") else None
        return cls(metadata, states, started_after, q.get("template") or None, order, limit, after)

    def matches(self, info: SandboxInfo) -> bool:
        if info.state == "dead" or _state(info) not in self.states:
            return False
        labels = info.labels
        if any(labels.get(META_PREFIX + k) != v for k, v in self.metadata.items()):
            return False
        if self.started_after is not None and info.created < self.started_after:
            return False
        return self.template is None or self.template in (
            info.environment,
            labels.get(LABEL_TEMPLATE),
        )

    def page(self, infos: list[SandboxInfo]) -> tuple[list[SandboxInfo], str | None]:
        """This page of the matching sandboxes, in order, and the token of the next (None: last).
        The token is the last sandbox's (start time, id), so a page never repeats or skips one
        because others were created or killed in between."""
        desc = self.order == "desc"
        rows = sorted(
            (i for i in infos if self.matches(i)), key=lambda i: (i.created, i.id), reverse=desc
        )
        if self.after is not None:
            after = self.after
            rows = [
                i
                for i in rows
                if ((i.created, i.id) < after if desc else (i.created, i.id) > after)
            ]
        page = rows[: self.limit]
        more = len(rows) > self.limit
        return page, (_page_token(page[-1]) if more else None)


def lifecycle_routes(connect: Connect, templates: Templates) -> list[Route]:
    """The control-plane routes, each answering with E2B's status codes and error bodies."""

    def handler(fn: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            key = _api_key(request)
            if key is None:
                return error_body(401, "missing X-API-KEY: set E2B_API_KEY to a dsec API key")
            try:
                async with caller_client(connect, key) as client:
                    return await fn(request, client, key)
            except DsecError as e:
                return api_error(e)

        return endpoint

    async def create(request: Request, client: Any, key: str) -> Response:
        body = await _json(request)
        template = _check_create(body)
        labels = {META_PREFIX + k: v for k, v in _strings(body, "metadata").items()}
        labels[LABEL_TEMPLATE] = template
        # a built template (its layers, env, workdir, start and ready commands) comes first
        built = templates.built and await templates.built.find(client, key, template)
        made = built.spec() if built else {"environment": templates.environment(template)}
        env = {**(built.env if built else {}), **_strings(body, "envVars")}
        sb = await client.create(
            **made,
            ttl=_timeout(body, DEFAULT_TIMEOUT),
            env=env,
            labels=labels,
            **_network(body),
        )
        if built:
            try:
                await built.started(client, sb.info.id, env)
            except BaseException:
                await client.kill(sb.info.id)
                raise
        return JSONResponse(created_sandbox(sb.info, key), status_code=201)

    async def get(request: Request, client: Any, key: str) -> Response:
        info = await _info(client, request.path_params["sid"])
        return JSONResponse({**listed_sandbox(info), "domain": None, "envdAccessToken": key})

    async def listing(request: Request, client: Any, key: str) -> Response:
        v1 = not request.url.path.startswith("/v2/")
        query = ListQuery.parse(request.query_params, v1=v1)
        page, token = query.page(list(await client.list()))
        r = JSONResponse([listed_sandbox(i) for i in page])
        if token:
            r.headers["x-next-token"] = token
        return r

    async def kill(request: Request, client: Any, key: str) -> Response:
        sid = request.path_params["sid"]
        await _info(client, sid)  # a dead one is a 404, as in E2B
        await client.kill(sid)
        return Response(status_code=204)

    async def set_timeout(request: Request, client: Any, key: str) -> Response:
        sid = request.path_params["sid"]
        body = await _json(request)
        ttl = _timeout(body, None)
        if ttl is None:
            raise InvalidSpec("timeout is required", field="timeout")
        await _info(client, sid)
        await _set_ttl(client, sid, float(ttl))
        return Response(status_code=204)

    async def pause(request: Request, client: Any, key: str) -> Response:
        sid = request.path_params["sid"]
        if (await _info(client, sid)).state == "paused":
            return error_body(409, f"sandbox {sid} is already paused")
        await client.pause(sid)
        return Response(status_code=204)

    async def connect_sandbox(request: Request, client: Any, key: str) -> Response:
        """Resume a paused sandbox (201) or attach to a running one (200); a ``timeout``
        only ever extends a running sandbox's life, as in E2B."""
        sid = request.path_params["sid"]
        body = await _json(request)
        timeout = _timeout(body, None)
        info = await _info(client, sid)
        status = 200
        if info.state == "paused":
            await client.resume(sid)
            status = 201
        if timeout is not None:
            longer = info.expires is not None and info.expires < time.time() + timeout
            if status == 201 or longer:
                await _set_ttl(client, sid, float(timeout))
        info = await _info(client, sid)
        return JSONResponse(created_sandbox(info, key), status_code=status)

    return [
        Route("/v2/sandboxes", handler(create), methods=["POST"]),
        Route("/sandboxes", handler(create), methods=["POST"]),
        Route("/v2/sandboxes", handler(listing), methods=["GET"]),
        Route("/sandboxes", handler(listing), methods=["GET"]),
        Route("/sandboxes/{sid}", handler(get), methods=["GET"]),
        Route("/sandboxes/{sid}", handler(kill), methods=["DELETE"]),
        Route("/sandboxes/{sid}/timeout", handler(set_timeout), methods=["POST"]),
        Route("/sandboxes/{sid}/pause", handler(pause), methods=["POST"]),
        Route("/v2/sandboxes/{sid}/connect", handler(connect_sandbox), methods=["POST"]),
        Route("/sandboxes/{sid}/connect", handler(connect_sandbox), methods=["POST"]),
        Route("/sandboxes/{sid}/resume", handler(connect_sandbox), methods=["POST"]),
    ]


def lifecycle_refusal(path: str, e: DsecError) -> Response | None:
    """The control plane's answer to a request refused before its route ran (a missing or
    wrong key: the apiserver checks keys first); None if ``path`` is not the control plane's."""
    if path == "/sandboxes" or path.startswith(("/sandboxes/", "/v2/sandboxes")):
        return api_error(e)
    return None
