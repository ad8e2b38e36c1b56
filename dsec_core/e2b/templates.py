"""Built E2B templates: their records, where every apiserver process sees them, and the
operator's settings for building them.

A template record (``TemplateRecord``) says what a sandbox of the template is made of: the
dsec environment and/or layers under it (top first), the environment variables, working
directory and user its ``Dockerfile`` left set, and its start and ready commands. Records, their
aliases, their builds' status and logs and the build cache live in IAM's store
(``dsec_core.iam.IamStore``: SQLite on one machine, etcd shared by several apiservers) under
keys starting ``e2b/``; files uploaded for ``COPY`` live in a directory (``FileStore``).

Templates belong to the project of the key that built them and are reached as that project's
sandboxes are (``can_reach``): one out of reach answers as one that does not exist.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import default_home
from ..errors import InvalidSpec, NotFound, PermissionDenied
from ..iam import IamStore, can_reach

__all__ = [
    "BUILD_ROLES",
    "BuildNetwork",
    "BuildRecord",
    "FileStore",
    "ImageTable",
    "TemplateRecord",
    "TemplateStore",
    "UnknownTemplate",
    "check_builder",
    "check_hash",
    "check_name",
    "check_tag",
]

#: Roles whose keys may build and delete templates (the apiserver's ``BUILD_ROLES``; the E2B
#: API sits below the apiserver's package, so the names are repeated here).
BUILD_ROLES = ("admin", "builder")
#: Most log entries a build record keeps, and their most bytes (JSON): the oldest go first,
#: counted in ``BuildRecord.dropped`` so log offsets stay those of the whole log. The bytes
#: bound keeps a record within what etcd takes in one value (1.5 MiB by default).
MAX_LOG_ENTRIES = 2000
MAX_LOG_BYTES = 512 << 10
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ID_RE = re.compile(r"^[0-9a-f]{20}$")  # a template id (``secrets.token_hex(10)``)
_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_HASH_RE = re.compile(r"^[0-9a-f]{16,128}$")


class UnknownTemplate(NotFound):
    """No such template (or build), or one the caller does not reach."""


def check_builder(role: str, what: str) -> None:
    """``PermissionDenied`` unless ``role`` may build templates."""
    if role not in BUILD_ROLES:
        raise PermissionDenied(
            f"a {role} key cannot {what}: only {' and '.join(BUILD_ROLES)} keys build "
            "templates (a template build runs as a dsec build)",
            role=role,
        )


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidSpec(
            f"template name {name!r}: letters, digits, '.', '_', '-' and '/', at most 128",
            field="name",
        )
    return name


def check_tag(tag: Any) -> str:
    if not isinstance(tag, str) or not _TAG_RE.match(tag):
        raise InvalidSpec(
            f"tag {tag!r}: letters, digits, '.', '_' and '-', at most 64", field="tags"
        )
    return tag


def check_hash(files_hash: str) -> str:
    if not _HASH_RE.match(files_hash):
        raise InvalidSpec(f"files hash {files_hash!r} is not a hex digest", field="hash")
    return files_hash


@dataclass(frozen=True)
class ImageTable:
    """The operator's table of docker image names (as a ``FROM`` line gives them) to a dsec
    environment or a layer ref (``name@version``): ``DSEC_E2B_IMAGES``, e.g.
    ``python:3.11-slim-bookworm=python,ubuntu:22.04=ubuntu@22.04``. Consulted before the
    node's own docker images and OCI layer sources."""

    mapping: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | None) -> ImageTable:
        mapping: dict[str, str] = {}
        for part in (text or "").split(","):
            if not part.strip():
                continue
            image, eq, target = part.rpartition("=")
            if not eq or not image.strip() or not target.strip():
                raise InvalidSpec(
                    f"DSEC_E2B_IMAGES: {part.strip()!r} is not image=environment or "
                    "image=layer@version",
                    field="DSEC_E2B_IMAGES",
                )
            mapping[image.strip()] = target.strip()
        return cls(mapping)

    @classmethod
    def from_env(cls) -> ImageTable:
        return cls.parse(os.environ.get("DSEC_E2B_IMAGES"))

    def get(self, image: str) -> str | None:
        """The environment or layer ref ``image`` maps to; a name without a tag is also
        looked up as ``name:latest``, as docker reads it."""
        found = self.mapping.get(image)
        if found is None and ":" not in image.rsplit("/", 1)[-1] and "@" not in image:
            found = self.mapping.get(image + ":latest")
        return found


@dataclass(frozen=True)
class BuildNetwork:
    """The network a template build's sandbox gets: ``DSEC_E2B_BUILD_NETWORK``, ``none`` (the
    default: loopback only), ``internet`` (NAT through the node, where the node offers that
    mode), or a comma list of egress rules ``host:port/tcp`` (an allowlist, as a builder's
    build policy grants its package indexes)."""

    mode: str = "none"
    allow: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> BuildNetwork:
        text = (text or "").strip()
        if text in ("", "none"):
            return cls()
        if text == "internet":
            return cls("internet")
        rules = tuple(r.strip() for r in text.split(",") if r.strip())
        for rule in rules:
            if not re.match(r"^[A-Za-z0-9.:\[\]-]+:\d{1,5}/(tcp|udp)$", rule):
                raise InvalidSpec(
                    f"DSEC_E2B_BUILD_NETWORK: {rule!r} is not none, internet or host:port/tcp",
                    field="DSEC_E2B_BUILD_NETWORK",
                )
        return cls("allowlist", rules)

    @classmethod
    def from_env(cls) -> BuildNetwork:
        return cls.parse(os.environ.get("DSEC_E2B_BUILD_NETWORK"))

    @property
    def policies(self) -> dict[str, dict[str, Any]]:
        return {"egress": {"allow": list(self.allow)}} if self.allow else {}


@dataclass(frozen=True)
class TemplateRecord:
    """A template: its names, its project, its last build, and (once a build is ready) what a
    sandbox of it is made of."""

    template_id: str
    project: str
    names: tuple[str, ...]
    build_id: str
    status: str = "waiting"  # waiting | building | ready | error
    #: What a sandbox is created from: an environment, layers over it (top first), or both.
    environment: str | None = None
    layers: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "root"
    start_cmd: str | None = None
    ready_cmd: str | None = None
    #: The sandboxes' CPUs and memory as the build asked (None: dsec's defaults).
    cpu_count: int | None = None
    memory_mb: int | None = None
    created: float = 0.0
    updated: float = 0.0
    build_count: int = 0
    #: True once some build of it was ready: a sandbox can be made while another builds.
    built: bool = False
    #: E2B's tags: tag -> ``{"build": build id, "at": when it was assigned}``. A build's tags
    #: are assigned when it starts, as E2B does; ``name:tag`` creates from that build.
    tags: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TemplateRecord:
        d = dict(d)
        d["names"] = tuple(d.get("names", ()))
        d["layers"] = tuple(d.get("layers", ()))
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["names"], d["layers"], d["env"] = list(self.names), list(self.layers), dict(self.env)
        d["tags"] = {k: dict(v) for k, v in self.tags.items()}
        return d

    def result(self) -> dict[str, Any]:
        """What a sandbox of its last ready build is made of (``BuildRecord.result``)."""
        return {
            "environment": self.environment,
            "layers": list(self.layers),
            "env": dict(self.env),
            "workdir": self.workdir,
            "user": self.user,
            "start_cmd": self.start_cmd,
            "ready_cmd": self.ready_cmd,
            "cpu_count": self.cpu_count,
            "memory_mb": self.memory_mb,
        }


@dataclass(frozen=True)
class BuildRecord:
    """One build of a template: its status, its log entries (E2B's ``BuildLogEntry``s) and,
    if it failed, why (``BuildStatusReason``)."""

    template_id: str
    build_id: str
    status: str = "waiting"
    logs: tuple[Mapping[str, Any], ...] = ()
    reason: Mapping[str, Any] | None = None
    updated: float = 0.0
    #: Once ready: what a sandbox of this build is made of (``TemplateRecord.result``).
    result: Mapping[str, Any] | None = None
    #: How many of the oldest entries were dropped (``MAX_LOG_ENTRIES``, ``MAX_LOG_BYTES``).
    dropped: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BuildRecord:
        return cls(
            template_id=d["template_id"],
            build_id=d["build_id"],
            status=d.get("status", "waiting"),
            logs=tuple(d.get("logs", ())),
            reason=d.get("reason"),
            updated=float(d.get("updated", 0.0)),
            result=d.get("result"),
            dropped=int(d.get("dropped", 0)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "template_id": self.template_id,
            "build_id": self.build_id,
            "status": self.status,
            "logs": [dict(e) for e in self.logs],
            "reason": dict(self.reason) if self.reason is not None else None,
            "updated": self.updated,
            "result": dict(self.result) if self.result is not None else None,
            "dropped": self.dropped,
        }

    def entries(self, offset: int, limit: int) -> list[Mapping[str, Any]]:
        """Log entries from ``offset`` of the whole log (dropped ones are skipped)."""
        start = max(0, offset - self.dropped)
        return list(self.logs[start : start + limit])


def _tkey(tid: str) -> str:
    return f"e2b/t/{tid}"


def _scope(project: str) -> str:
    return hashlib.sha256(project.encode()).hexdigest()[:16]


def _akey(project: str, alias: str) -> str:
    return f"e2b/a/{_scope(project)}/{alias}"


def _bkey(tid: str, bid: str) -> str:
    return f"e2b/b/{tid}/{bid}"


def _ckey(project: str, key: str) -> str:
    return f"e2b/c/{_scope(project)}/{key}"


@dataclass
class TemplateStore:
    """Templates, aliases, builds and the build cache in an ``IamStore``. Every call is a
    blocking store operation run in a thread."""

    store: IamStore

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    # --- templates and aliases ------------------------------------------------------------
    async def template(self, tid: str) -> TemplateRecord | None:
        d = await self._run(self.store.get, _tkey(tid))
        return TemplateRecord.from_dict(d) if d is not None else None

    async def find(self, role: str, project: str, name: str) -> TemplateRecord | None:
        """The template ``name`` (an alias, ``alias:tag``, or an id) that a key of ``role``
        in ``project`` reaches: its own project's alias first, then an id it reaches."""
        principal = _Caller(role, project)
        base = name.partition(":")[0]
        for alias in dict.fromkeys((name, base)):  # "name:tag" names template "name"
            d = await self._run(self.store.get, _akey(project, alias))
            if d is not None:
                rec = await self.template(d["template"])
                if rec is not None:
                    return rec
        rec = await self.template(base) if _ID_RE.match(base) else None
        if rec is not None and can_reach(principal, rec.project):  # type: ignore[arg-type]
            return rec
        return None

    async def listing(self, role: str, project: str) -> list[TemplateRecord]:
        principal = _Caller(role, project)
        rows = await self._run(self.store.scan, "e2b/t/")
        recs = [TemplateRecord.from_dict(v) for v in rows.values()]
        return sorted(
            (r for r in recs if can_reach(principal, r.project)),  # type: ignore[arg-type]
            key=lambda r: (r.created, r.template_id),
        )

    async def open_build(
        self,
        project: str,
        name: str,
        tags: Sequence[str],
        cpu: int | None,
        memory_mb: int | None,
    ) -> tuple[TemplateRecord, BuildRecord]:
        """A new build of template ``name`` in ``project``: the template it names (made now if
        there is none) with a new build id and ``tags`` pointing at it, and its record."""
        check_name(name)
        bid = str(uuid.uuid4())  # the SDK reads build ids as UUIDs
        now = time.time()
        for _ in range(5):  # two apiservers making the same name at once: one wins
            d = await self._run(self.store.get, _akey(project, name))
            rec = await self.template(d["template"]) if d is not None else None
            if rec is None:
                tid = secrets.token_hex(10)
                rec = TemplateRecord(tid, project, (name,), bid, created=now, updated=now)
                items = {_tkey(tid): rec.to_dict(), _akey(project, name): {"template": tid}}
                if d is not None:  # an alias left without its template
                    await self._run(self.store.delete, [_akey(project, name)])
                if not await self._run(self.store.create, items):
                    continue
            assigned = {t: {"build": bid, "at": now} for t in tags}
            rec = replace(
                rec,
                tags={**rec.tags, **assigned},
                build_id=bid,
                status="waiting",
                updated=now,
                build_count=rec.build_count + 1,
                cpu_count=cpu,
                memory_mb=memory_mb,
            )
            build = BuildRecord(rec.template_id, bid, "waiting", updated=now)
            await self._run(self.store.update, _tkey(rec.template_id), rec.to_dict())
            await self._run(self.store.create, {_bkey(rec.template_id, bid): build.to_dict()})
            return rec, build
        raise InvalidSpec(f"template {name!r} is being created by another request; try again")

    async def made_by(self, rec: TemplateRecord, selector: str) -> Mapping[str, Any]:
        """What the build that ``selector`` (a tag of ``rec``, or one of its build ids)
        names made; ``UnknownTemplate`` (E2B's words) if there is none, or it is not ready."""
        tagged = rec.tags.get(selector)
        bid = str(tagged["build"]) if tagged else selector
        build = await self.build(rec.template_id, bid) if _UUID_RE.match(bid) else None
        if build is None or build.result is None:
            state = f" (its build is {build.status})" if build is not None else ""
            raise UnknownTemplate(
                f"tag '{selector}' does not exist for template '{rec.names[0]}'{state}",
                name=selector,
            )
        return build.result

    async def save_template(self, rec: TemplateRecord) -> None:
        await self._run(self.store.update, _tkey(rec.template_id), rec.to_dict())

    async def delete(self, rec: TemplateRecord) -> None:
        """Remove the template, its aliases and its builds' records."""
        builds = await self._run(self.store.scan, f"e2b/b/{rec.template_id}/")
        keys = [_tkey(rec.template_id), *(_akey(rec.project, n) for n in rec.names), *builds]
        await self._run(self.store.delete, keys)

    # --- builds ---------------------------------------------------------------------------
    async def build(self, tid: str, bid: str) -> BuildRecord | None:
        d = await self._run(self.store.get, _bkey(tid, bid))
        return BuildRecord.from_dict(d) if d is not None else None

    async def save_build(self, build: BuildRecord) -> BuildRecord:
        """Save ``build``, its oldest log entries dropped past the bounds; returns what was
        saved."""
        logs, dropped = list(build.logs), build.dropped
        size = sum(len(json.dumps(e)) for e in logs)
        while logs and (len(logs) > MAX_LOG_ENTRIES or size > MAX_LOG_BYTES):
            size -= len(json.dumps(logs.pop(0)))
            dropped += 1
        build = replace(build, logs=tuple(logs), dropped=dropped, updated=time.time())
        await self._run(
            self.store.update, _bkey(build.template_id, build.build_id), build.to_dict()
        )
        return build

    # --- the build cache ------------------------------------------------------------------
    async def cached(self, project: str, key: str) -> dict[str, Any] | None:
        d: dict[str, Any] | None = await self._run(self.store.get, _ckey(project, key))
        return d

    async def remember(self, project: str, key: str, value: dict[str, Any]) -> None:
        if not await self._run(self.store.update, _ckey(project, key), value):
            await self._run(self.store.create, {_ckey(project, key): value})

    async def forget(self, project: str, key: str) -> None:
        await self._run(self.store.delete, [_ckey(project, key)])


@dataclass(frozen=True)
class _Caller:
    """What ``can_reach`` reads of a principal."""

    role: str
    project: str


class FileStore:
    """Files uploaded for ``COPY`` steps: one archive per (project, files hash), as the SDK
    uploaded it (a tar, gzipped or not). ``DSEC_E2B_FILES``, default ``$DSEC_HOME/e2b-files``;
    apiservers that share templates must share this directory too."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root or os.environ.get("DSEC_E2B_FILES") or default_home() / "e2b-files")

    def path(self, project: str, files_hash: str) -> Path:
        return self.root / _scope(project) / f"{check_hash(files_hash)}.tar"

    def present(self, project: str, files_hash: str) -> bool:
        return self.path(project, files_hash).is_file()

    async def put(
        self, project: str, files_hash: str, pieces: AsyncIterator[bytes], limit: int
    ) -> int:
        """Store the archive ``pieces`` make (at most ``limit`` bytes, else ``InvalidSpec``)
        under its hash: written beside it and renamed, so a reader never sees half of one."""
        final = self.path(project, files_hash)
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".upload-")
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for piece in pieces:
                    size += len(piece)
                    if size > limit:
                        raise InvalidSpec(
                            f"the upload is over {limit} bytes", field="body", limit=limit
                        )
                    f.write(piece)
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size
