"""E2B's template API (the paths the stock SDK's ``Template.build``, ``alias_exists`` and the
API client's template calls use): create a template build (``POST /v3/templates``), upload a
``COPY``'s files by hash, start the build, poll its status and logs, look up aliases, list and
delete templates. What a build does is ``template_build``; where templates are kept,
``templates``. Building and deleting take a builder or admin key (403 otherwise); every key
may list, look up and create sandboxes from its project's templates.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..api.routes import MAX_ITEMS, load_json
from ..api.serving import read_body, request_key
from ..errors import DsecError, InvalidSpec, StartTimeout
from .callers import Connect, api_error, caller_client, error_body
from .template_build import BuildRequest, TemplateBuild
from .templates import (
    BuildNetwork,
    FileStore,
    ImageTable,
    TemplateRecord,
    TemplateStore,
    UnknownTemplate,
    check_builder,
    check_hash,
    check_tag,
)

__all__ = ["BuiltTemplates", "Target", "template_refusal", "template_routes"]

#: The largest ``COPY`` upload (one archive), in bytes.
MAX_UPLOAD = 4 << 30
#: A build whose record has not moved for this long lost its apiserver (it beats every 15 s).
STALE_BUILD = 120.0
#: Seconds a sandbox's ready command may take to succeed at create.
READY_TIMEOUT = 60.0
_WHO_TTL = 5.0
_UPLOAD_PATH = "/e2b/files"
_tasks: set[asyncio.Task[None]] = set()


@dataclass(frozen=True)
class Who:
    role: str
    project: str


class _Callers:
    """Who a key is (``whoami`` through the caller's client), remembered a few seconds by
    the key's digest so a sandbox create costs no extra round trip each time."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, Who]] = {}

    async def who(self, client: Any, key: str) -> Who:
        digest = hashlib.sha256(key.encode()).hexdigest()
        hit = self._seen.get(digest)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        info = await client.whoami()
        who = Who(info.role, info.project)
        if len(self._seen) > 10_000:
            self._seen.clear()
        self._seen[digest] = (time.monotonic() + _WHO_TTL, who)
        return who


@dataclass(frozen=True)
class Target:
    """What ``Sandbox.create(template=...)`` makes: a dsec environment and/or layers, with
    the template's env, workdir and start/ready commands."""

    environment: str | None
    layers: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = "/"
    start_cmd: str | None = None
    ready_cmd: str | None = None
    cpu_count: int | None = None
    memory_mb: int | None = None

    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"environment": self.environment}
        if self.cpu_count:
            spec["cpu"] = float(self.cpu_count)
        if self.memory_mb:
            spec["memory"] = f"{self.memory_mb}M"
        if self.layers:
            spec["layers"] = self.layers
        if self.workdir != "/":
            spec["workdir"] = self.workdir
        return spec

    async def started(self, client: Any, sid: str, env: Mapping[str, str]) -> None:
        """Run the start command in the background and wait for the ready command, as E2B
        does when it builds the template (here: at each create). A ready command that only
        waits (``sleep N``, the SDK's ``wait_for_timeout``) is not waited for: E2B uses it
        to let a start command settle before it snapshots, and nothing is snapshotted here."""
        if self.start_cmd:
            await client.exec(
                sid,
                f"({self.start_cmd}) >/dev/null 2>&1 &",
                cwd=self.workdir,
                env=env,
                background=True,
                timeout=30,
            )
        ready = (self.ready_cmd or "").strip()
        if not ready or (ready.startswith("sleep ") and ready[6:].replace(".", "").isdigit()):
            return
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            r = await client.exec(sid, ready, cwd=self.workdir, env=env, timeout=10)
            if r.exit_code == 0:
                return
            if time.monotonic() > deadline:
                raise StartTimeout(
                    f"the template's ready command {ready!r} did not succeed in "
                    f"{READY_TIMEOUT:.0f} s",
                    sandbox_id=sid,
                )
            await asyncio.sleep(0.5)


class BuiltTemplates:
    """The built templates a sandbox create consults before ``DSEC_E2B_TEMPLATES`` and
    environment names (``lifecycle.Templates.built``)."""

    def __init__(self, store: TemplateStore) -> None:
        self.store = store
        self.callers = _Callers()

    async def find(self, client: Any, key: str, name: str) -> Target | None:
        """The target of template ``name``: an alias or id, its last ready build; with
        ``:tag`` or ``:build-id`` after it, that build. None if the caller has no such
        template; ``UnknownTemplate`` for a tag or build that is not (yet) ready."""
        who = await self.callers.who(client, key)
        rec = await self.store.find(who.role, who.project, name)
        if rec is None:
            return None
        base, sep, selector = name.partition(":")
        if sep and selector:
            made = await self.store.made_by(rec, selector)
        elif rec.built:
            made = rec.result()
        else:
            raise UnknownTemplate(f"template {name!r} has no ready build yet", name=name)
        return Target(
            made.get("environment"),
            tuple(made.get("layers") or ()),
            dict(made.get("env") or {}),
            str(made.get("workdir") or "/"),
            made.get("start_cmd"),
            made.get("ready_cmd"),
            made.get("cpu_count"),
            made.get("memory_mb"),
        )


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts or time.time(), UTC).isoformat()


def _listed(rec: TemplateRecord) -> dict[str, Any]:
    """E2B's ``Template``."""
    return {
        "templateID": rec.template_id,
        "buildID": rec.build_id,
        "cpuCount": rec.cpu_count or 1,
        "memoryMB": rec.memory_mb or 512,
        "diskSizeMB": 10240,
        "public": False,
        "aliases": list(rec.names),
        "names": list(rec.names),
        "createdAt": _iso(rec.created),
        "updatedAt": _iso(rec.updated),
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": rec.build_count,
        "envdVersion": "0.6.1",
        "buildStatus": rec.status if rec.status != "waiting" else "building",
    }


async def _json(request: Request) -> dict[str, Any]:
    body = load_json(await read_body(request, 4 << 20) or b"{}", "body", max_items=MAX_ITEMS)
    if not isinstance(body, dict):
        raise InvalidSpec("the body must be a JSON object", field="body")
    return body


def _int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidSpec(f"{name} must be a positive integer", field=name)
    return value


def template_routes(
    connect: Connect,
    store: TemplateStore,
    files: FileStore,
    base_templates: Any,
    images: ImageTable | None = None,
    network: BuildNetwork | None = None,
) -> list[Route]:
    """The template API's routes over ``store`` and ``files``; builds run in this process,
    each through a client ``connect`` makes for its caller's key."""
    images = images if images is not None else ImageTable.from_env()
    network = network if network is not None else BuildNetwork.from_env()
    callers = _Callers()
    Fn = Callable[[Request, Any, str, Who], Awaitable[Response]]

    def handler(fn: Fn) -> Any:
        async def endpoint(request: Request) -> Response:
            key = request_key(request.scope["headers"])
            if key is None:
                return error_body(401, "missing X-API-KEY: set E2B_API_KEY to a dsec API key")
            try:
                async with caller_client(connect, key) as client:
                    who = await callers.who(client, key)
                    return await fn(request, client, key, who)
            except DsecError as e:
                return api_error(e)

        return endpoint

    async def owned(who: Who, tid: str) -> TemplateRecord:
        rec = await store.find(who.role, who.project, tid)
        if rec is None:
            raise UnknownTemplate(f"template {tid} not found", name=tid)
        return rec

    async def create(request: Request, client: Any, key: str, who: Who) -> Response:
        check_builder(who.role, "build templates")
        body = await _json(request)
        name = body.get("name") or body.get("alias")
        if not isinstance(name, str) or not name:
            raise InvalidSpec("name is required", field="name")
        base, _, tag = name.partition(":")
        extra = body.get("tags") or []
        if not isinstance(extra, list):
            raise InvalidSpec("tags must be a list of tags", field="tags")
        tags = [check_tag(t) for t in ([tag] if tag else []) + extra] or ["default"]
        rec, build = await store.open_build(
            who.project, base, tags, _int(body, "cpuCount"), _int(body, "memoryMB")
        )
        return JSONResponse(
            {
                "templateID": rec.template_id,
                "buildID": build.build_id,
                "public": False,
                "names": list(rec.names),
                "aliases": list(rec.names),
                "tags": tags,
            },
            status_code=202,
        )

    async def tags(request: Request, client: Any, key: str, who: Who) -> Response:
        rec = await owned(who, request.path_params["tid"])
        return JSONResponse(
            [
                {"tag": t, "buildID": v["build"], "createdAt": _iso(float(v["at"]))}
                for t, v in sorted(rec.tags.items())
            ]
        )

    async def assign(request: Request, client: Any, key: str, who: Who) -> Response:
        check_builder(who.role, "tag templates")
        body = await _json(request)
        target, new = body.get("target"), body.get("tags")
        if not isinstance(target, str) or ":" not in target:
            raise InvalidSpec("target must be name:tag", field="target")
        if not isinstance(new, list) or not new:
            raise InvalidSpec("tags must be a list of tags", field="tags")
        rec = await owned(who, target)
        selector = target.partition(":")[2]
        tagged = rec.tags.get(selector)
        bid = str(tagged["build"]) if tagged else selector
        await store.made_by(rec, selector)  # UnknownTemplate unless that build is ready
        now = time.time()
        added = {check_tag(t): {"build": bid, "at": now} for t in new}
        await store.save_template(replace(rec, tags={**rec.tags, **added}))
        return JSONResponse({"tags": list(added), "buildID": bid}, status_code=201)

    async def untag(request: Request, client: Any, key: str, who: Who) -> Response:
        check_builder(who.role, "untag templates")
        body = await _json(request)
        name, gone = body.get("name"), body.get("tags")
        if not isinstance(name, str) or not isinstance(gone, list):
            raise InvalidSpec("name and tags are required", field="tags")
        rec = await owned(who, name)
        missing = [t for t in gone if t not in rec.tags]
        if missing:
            raise UnknownTemplate(f"template {name!r} has no tag {missing[0]!r}", name=name)
        kept = {t: v for t, v in rec.tags.items() if t not in gone}
        await store.save_template(replace(rec, tags=kept))
        return Response(status_code=204)

    async def file_link(request: Request, client: Any, key: str, who: Who) -> Response:
        check_builder(who.role, "upload template files")
        tid, files_hash = request.path_params["tid"], check_hash(request.path_params["hash"])
        await owned(who, tid)
        if files.present(who.project, files_hash):
            return JSONResponse({"present": True}, status_code=201)
        url = str(request.base_url).rstrip("/") + f"{_UPLOAD_PATH}/{tid}/{files_hash}"
        return JSONResponse(
            {"present": False, "url": url, "headers": {"X-API-KEY": key}}, status_code=201
        )

    async def upload(request: Request, client: Any, key: str, who: Who) -> Response:
        check_builder(who.role, "upload template files")
        tid, files_hash = request.path_params["tid"], check_hash(request.path_params["hash"])
        await owned(who, tid)
        await files.put(who.project, files_hash, request.stream(), MAX_UPLOAD)
        return Response(status_code=200)

    async def start(request: Request, client: Any, key: str, who: Who) -> Response:
        check_builder(who.role, "build templates")
        tid, bid = request.path_params["tid"], request.path_params["bid"]
        rec = await owned(who, tid)
        build = await store.build(tid, bid)
        if build is None:
            raise UnknownTemplate(f"build {bid} of template {tid} not found", name=bid)
        if build.status != "waiting":
            raise InvalidSpec(f"build {bid} was started already ({build.status})")
        req = BuildRequest.parse(await _json(request))
        build = replace(build, status="building")  # a second start is refused from here on
        await store.save_build(build)

        async def run() -> None:
            async with caller_client(connect, key) as build_client:
                await TemplateBuild(
                    build_client,
                    store,
                    files,
                    images,
                    network,
                    base_templates,
                    who.role,
                    who.project,
                    rec,
                    build,
                    req,
                ).run()

        task = asyncio.ensure_future(run())
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
        return Response(status_code=202)

    async def status(request: Request, client: Any, key: str, who: Who) -> Response:
        tid, bid = request.path_params["tid"], request.path_params["bid"]
        await owned(who, tid)
        build = await store.build(tid, bid)
        if build is None:
            raise UnknownTemplate(f"build {bid} of template {tid} not found", name=bid)
        state, reason = build.status, build.reason
        if state in ("waiting", "building") and time.time() - build.updated > STALE_BUILD:
            state = "error"
            reason = {"message": "the build stopped: its apiserver is gone", "step": "base"}
        try:
            offset = max(0, int(request.query_params.get("logsOffset", 0)))
            limit = min(100, max(1, int(request.query_params.get("limit", 100))))
        except ValueError:
            raise InvalidSpec("logsOffset and limit are integers", field="logsOffset") from None
        entries = build.entries(offset, limit)
        answer: dict[str, Any] = {
            "templateID": tid,
            "buildID": bid,
            "status": state,
            "logs": [e["message"] for e in entries],
            "logEntries": entries,
        }
        if state == "error" and reason is not None:
            answer["reason"] = reason
        return JSONResponse(answer)

    async def alias(request: Request, client: Any, key: str, who: Who) -> Response:
        name = request.path_params["alias"]
        rec = await store.find(who.role, who.project, name)
        if rec is None or name not in rec.names:
            raise UnknownTemplate(f"template alias {name!r} not found", name=name)
        return JSONResponse({"templateID": rec.template_id, "public": False})

    async def listing(request: Request, client: Any, key: str, who: Who) -> Response:
        return JSONResponse([_listed(r) for r in await store.listing(who.role, who.project)])

    async def get(request: Request, client: Any, key: str, who: Who) -> Response:
        rec = await owned(who, request.path_params["tid"])
        build = await store.build(rec.template_id, rec.build_id)
        builds = []
        if build is not None:
            builds.append(
                {
                    "buildID": build.build_id,
                    "status": build.status,
                    "createdAt": _iso(rec.updated),
                    "updatedAt": _iso(build.updated),
                    "cpuCount": rec.cpu_count or 1,
                    "memoryMB": rec.memory_mb or 512,
                }
            )
        return JSONResponse({**_listed(rec), "builds": builds})

    async def delete(request: Request, client: Any, key: str, who: Who) -> Response:
        check_builder(who.role, "delete templates")
        rec = await owned(who, request.path_params["tid"])
        await store.delete(rec)
        return Response(status_code=204)

    return [
        Route("/v3/templates", handler(create), methods=["POST"]),
        Route("/templates/tags", handler(assign), methods=["POST"]),
        Route("/templates/tags", handler(untag), methods=["DELETE"]),
        Route("/templates/{tid}/tags", handler(tags), methods=["GET"]),
        Route("/templates", handler(listing), methods=["GET"]),
        Route("/v2/templates", handler(listing), methods=["GET"]),
        Route("/templates/aliases/{alias}", handler(alias), methods=["GET"]),
        Route("/templates/{tid}/files/{hash}", handler(file_link), methods=["GET"]),
        Route(_UPLOAD_PATH + "/{tid}/{hash}", handler(upload), methods=["PUT"]),
        Route("/v2/templates/{tid}/builds/{bid}", handler(start), methods=["POST"]),
        Route("/templates/{tid}/builds/{bid}/status", handler(status), methods=["GET"]),
        Route("/templates/{tid}", handler(get), methods=["GET"]),
        Route("/templates/{tid}", handler(delete), methods=["DELETE"]),
    ]


def template_refusal(path: str, e: DsecError) -> Response | None:
    """The template API's answer to a request refused before its route ran."""
    if path.startswith(("/templates", "/v2/templates", "/v3/templates", _UPLOAD_PATH)):
        return api_error(e)
    return None
