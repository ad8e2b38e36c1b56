"""One E2B template build, run through the caller's dsec client: resolve ``FROM``, run the
steps (RUN, COPY, ENV, WORKDIR, USER) in a build sandbox (labelled ``BUILD_LABEL``, with only
the network ``BuildNetwork`` grants), pack its writable layer with ``pack_diff`` and record
what a sandbox of the template is made of.

The packed layer's name is a digest of the base and every step (with the hashes of the files
``COPY`` brings), so an unchanged template is a cache hit: no build sandbox at all. The build
sandbox is killed and temporary files removed on every path out.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import io
import json
import logging
import os
import posixpath
import re
import shlex
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import DsecError, InvalidSpec, UnknownImage
from ..records import BUILD_LABEL, ExecResult
from .templates import (
    BuildNetwork,
    BuildRecord,
    FileStore,
    ImageTable,
    TemplateRecord,
    TemplateStore,
    check_hash,
)

__all__ = ["BuildFailed", "BuildRequest", "TemplateBuild", "copy_plan", "log_entry"]

log = logging.getLogger("dsec.e2b")

#: E2B's default user and working directory (its base image has the account).
E2B_USER, E2B_HOME = "user", "/home/user"
#: Seconds one RUN step may take.
STEP_TIMEOUT = 1800.0
#: A step's output kept in a failed build's reason (its tail).
REASON_OUTPUT = 4000
#: The longest log line: longer output without a newline is logged in pieces of this.
MAX_LINE = 4 << 10
#: Seconds between a running build's heartbeats in its record.
HEARTBEAT = 15.0
#: The build sandbox's ttl, renewed at each heartbeat: a build whose apiserver is gone (killed,
#: so nothing ran its clean-up) leaves no sandbox behind for longer than this.
BUILD_TTL = 300.0
#: The build sandbox's limits when the template asks for none.
BUILD_SANDBOX = {"cpu": 2.0, "memory": "2G", "disk": "10G", "ttl": BUILD_TTL}
_STEP_TYPES = ("RUN", "COPY", "ENV", "WORKDIR", "USER")
_COPY_TAR = "/tmp/.dsec-e2b-copy.tar"


class BuildFailed(Exception):
    """A build step (or the base, step ``"base"``) failed: the build's reason."""

    def __init__(self, message: str, step: str = "base") -> None:
        super().__init__(message)
        self.message, self.step = message, step


def _now() -> str:
    return datetime.now(UTC).isoformat()


def log_entry(message: str, level: str = "info", step: str | None = None) -> dict[str, Any]:
    """An E2B ``BuildLogEntry``."""
    entry: dict[str, Any] = {"timestamp": _now(), "level": level, "message": message}
    if step is not None:
        entry["step"] = step
    return entry


@dataclass(frozen=True)
class Step:
    type: str
    args: tuple[str, ...]
    files_hash: str | None = None
    force: bool = False


@dataclass(frozen=True)
class BuildRequest:
    """``TemplateBuildStartV2`` as the SDK sends it."""

    from_image: str | None = None
    from_template: str | None = None
    force: bool = False
    steps: tuple[Step, ...] = ()
    start_cmd: str | None = None
    ready_cmd: str | None = None
    registry: bool = False

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> BuildRequest:
        def text(name: str) -> str | None:
            value = body.get(name)
            if value is not None and not isinstance(value, str):
                raise InvalidSpec(f"{name} must be a string", field=name)
            return value or None

        steps = []
        raw = body.get("steps") or []
        if not isinstance(raw, list):
            raise InvalidSpec("steps must be a list", field="steps")
        for i, s in enumerate(raw):
            if not isinstance(s, dict) or s.get("type") not in _STEP_TYPES:
                raise InvalidSpec(
                    f"steps[{i}]: type must be one of {', '.join(_STEP_TYPES)}", field="steps"
                )
            args = s.get("args") or []
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise InvalidSpec(f"steps[{i}].args must be strings", field="steps")
            fh = s.get("filesHash")
            if s["type"] == "COPY":
                if not isinstance(fh, str) or len(args) < 2:
                    raise InvalidSpec(
                        f"steps[{i}]: COPY needs src, dest and filesHash", field="steps"
                    )
                check_hash(fh)
            elif not args or not args[0] or (s["type"] == "ENV" and len(args) % 2):
                raise InvalidSpec(
                    f"steps[{i}]: {s['type']} needs its arguments (ENV: names and values)",
                    field="steps",
                )
            steps.append(Step(s["type"], tuple(args), fh, bool(s.get("force"))))
        return cls(
            from_image=text("fromImage"),
            from_template=text("fromTemplate"),
            force=bool(body.get("force")),
            steps=tuple(steps),
            start_cmd=text("startCmd"),
            ready_cmd=text("readyCmd"),
            registry=body.get("fromImageRegistry") is not None,
        )

    @property
    def forced(self) -> bool:
        return self.force or any(s.force for s in self.steps)


@dataclass
class State:
    """What the steps so far left set: the base a sandbox is made from, ENV, WORKDIR, USER."""

    environment: str | None
    layers: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = E2B_HOME
    user: str = E2B_USER
    key: str = ""  # what identifies the base, for the cache key
    from_template: bool = False


# --- COPY: which uploaded file goes where ----------------------------------------------------


def _root(name: str, pattern: tuple[str, ...]) -> str | None:
    """The part of member ``name`` that ``pattern`` (path components, globs) matches."""
    if not pattern:
        return ""
    parts = name.split("/")
    if len(parts) < len(pattern):
        return None
    if all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern, strict=False)):
        return "/".join(parts[: len(pattern)])
    return None


def copy_plan(
    members: Sequence[tarfile.TarInfo], src: str, dest: str, workdir: str, dest_is_dir: bool
) -> tuple[list[tuple[tarfile.TarInfo, str]], list[str]]:
    """Where each uploaded member goes for ``COPY src dest`` (Docker's rules: a matched
    directory's contents go into ``dest``, a matched file goes to ``dest``, or into it when
    ``dest`` ends with ``/``, is a directory, or several sources matched), and the targets of
    what ``src`` matched (for ``--chown``/``--chmod``). ``BuildFailed`` if nothing matched."""
    src_n = posixpath.normpath(src.lstrip("/"))
    pattern = () if src_n == "." else tuple(src_n.split("/"))
    dest_abs = posixpath.normpath(posixpath.join(workdir, dest))
    matched: dict[str, bool] = {}  # root -> is a directory
    rows: list[tuple[tarfile.TarInfo, str, str]] = []
    for m in members:
        name = posixpath.normpath(m.name.lstrip("/"))
        if name == ".." or name.startswith("../"):
            continue
        root = _root(name, pattern)
        if root is None:
            continue
        is_dir = root == "" or name != root or m.isdir()
        matched[root] = matched.get(root, False) or is_dir
        rows.append((m, name, root))
    if not rows:
        raise BuildFailed(f"COPY {src}: no uploaded file matches it", step="")
    into = dest.endswith("/") or dest_is_dir or len(matched) > 1
    plan: list[tuple[tarfile.TarInfo, str]] = []
    targets: set[str] = set()
    for m, name, root in rows:
        if matched[root]:  # a directory: its contents into dest
            rel = posixpath.relpath(name, root) if root else name
            if rel == ".":
                continue  # dest itself keeps its owner and mode
            target = posixpath.join(dest_abs, rel)
            targets.add(posixpath.join(dest_abs, rel.split("/")[0]))
        else:
            target = posixpath.join(dest_abs, posixpath.basename(root)) if into else dest_abs
            targets.add(target)
        plan.append((m, target))
    return plan, sorted(targets)


def _rewrite(archive: Path, out: Path, plan_for: Any) -> list[str]:
    """Write ``out``: the members of ``archive`` that ``plan_for(members)`` places, at their
    targets (relative to /), owned by root as Docker's COPY makes them. Returns the targets
    ``--chown``/``--chmod`` apply to. Nothing of ``archive`` is extracted here."""
    with tarfile.open(archive, "r:*") as src:
        members = src.getmembers()
        plan, targets = plan_for(members)
        with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as dst:
            for m, target in plan:
                info = tarfile.TarInfo(target.lstrip("/"))
                info.mode, info.mtime = m.mode, m.mtime
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                if m.isdir():
                    info.type = tarfile.DIRTYPE
                    dst.addfile(info)
                elif m.issym():
                    info.type, info.linkname = tarfile.SYMTYPE, m.linkname
                    dst.addfile(info)
                elif m.isfile() or m.islnk():
                    f = src.extractfile(m)
                    if f is None:
                        continue
                    with f:
                        info.size = m.size if m.isfile() else len(data := f.read())
                        dst.addfile(info, f if m.isfile() else _bytes(data))
    return targets


def _bytes(data: bytes) -> Any:
    return io.BytesIO(data)


# --- the build ---------------------------------------------------------------------------------


def _user_script(name: str) -> str:
    """Create account ``name`` (home ``/home/<name>``, bash where the image has it) if the
    image lacks it, as E2B's base image has ``user``: with the image's own tools (``useradd``,
    else busybox's ``adduser``), else by hand in ``/etc/passwd`` and ``/etc/group``."""
    u = shlex.quote(name)
    h = shlex.quote(f"/home/{name}")
    return (
        f"grep -q '^'{u}':' /etc/passwd 2>/dev/null || {{ "
        "s=/bin/sh; [ -x /bin/bash ] && s=/bin/bash; "
        f'useradd -m -d {h} -s "$s" {u} 2>/dev/null || '
        f'useradd -m -d {h} -s "$s" -g {u} {u} 2>/dev/null || '
        f'adduser -D -h {h} -s "$s" {u} 2>/dev/null || '
        f"{{ echo {u}':x:1000:1000::'{h}\":$s\" >> /etc/passwd && "
        f"echo {u}':x:1000:' >> /etc/group; }}; }} && "
        f"mkdir -p {h} && (chown {u} {h} 2>/dev/null || true)"
    )


def _tail(text: str, n: int = REASON_OUTPUT) -> str:
    return text if len(text) <= n else "..." + text[-n:]


class BuildLog:
    """A build's log entries and status, written to the store as they come (at most every
    second, and at each heartbeat), so every apiserver answers its status."""

    def __init__(self, store: TemplateStore, build: BuildRecord) -> None:
        self.store, self.build = store, build
        self.entries: list[dict[str, Any]] = [dict(e) for e in build.logs]
        self._saved = 0.0

    def add(self, message: str, level: str = "info", step: str | None = None) -> None:
        self.entries.append(log_entry(message, level, step))

    async def save(
        self,
        status: str | None = None,
        reason: Mapping[str, Any] | None = None,
        result: Mapping[str, Any] | None = None,
    ) -> None:
        self.build = replace(
            self.build,
            status=status or self.build.status,
            logs=tuple(self.entries),
            reason=reason if reason is not None else self.build.reason,
            result=result if result is not None else self.build.result,
        )
        self._saved = time.monotonic()
        # the store drops the oldest entries past its bounds: keep in step with what it kept
        self.build = await self.store.save_build(self.build)
        self.entries = [dict(e) for e in self.build.logs]

    async def maybe_save(self) -> None:
        if time.monotonic() - self._saved > 1.0:
            await self.save()


@dataclass
class TemplateBuild:
    """One build of ``template`` as ``request`` asks, through ``client`` (the caller's)."""

    client: Any
    store: TemplateStore
    files: FileStore
    images: ImageTable
    network: BuildNetwork
    base_templates: Any  # lifecycle.Templates: E2B names of dsec environments
    role: str
    project: str
    template: TemplateRecord
    build: BuildRecord
    request: BuildRequest
    #: Set when a build sandbox was created (a cache hit creates none).
    sandbox_id: str | None = None

    async def run(self) -> None:
        """Run the build to its end, recording ready or error; never raises but on
        cancellation."""
        blog = BuildLog(self.store, self.build)
        beat = asyncio.ensure_future(self._heartbeat(blog))
        try:
            await blog.save("building")
            state = await self._base(blog)
            key = self._cache_key(state)
            result = None if self.request.forced else await self._cached(key, blog)
            if result is None:
                result = await self._execute(state, key, blog)
            await self._finish(result, blog)
        except BuildFailed as e:
            await self._fail(blog, e.message, e.step)
        except DsecError as e:
            await self._fail(blog, f"{type(e).__name__}: {e.message}", "base")
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._fail(blog, "the build was cancelled (its apiserver stopped)", "base")
            raise
        except Exception as e:  # a bug: the build fails saying so, the server goes on
            log.exception("template build %s failed", self.build.build_id)
            await self._fail(blog, f"internal error: {type(e).__name__}: {e}", "base")
        finally:
            beat.cancel()

    async def _heartbeat(self, blog: BuildLog) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            with contextlib.suppress(Exception):
                await blog.save()
            if self.sandbox_id is not None:
                with contextlib.suppress(Exception):
                    await self.client.set_ttl(self.sandbox_id, BUILD_TTL)

    # --- FROM ----------------------------------------------------------------------------
    async def _base(self, blog: BuildLog) -> State:
        req = self.request
        if req.from_template:
            rec = await self.store.find(self.role, self.project, req.from_template)
            if rec is not None:
                if not rec.built:
                    raise BuildFailed(f"FROM template {req.from_template!r}: it has no ready build")
                blog.add(f"FROM template {req.from_template} ({rec.template_id})", step="base")
                return State(
                    rec.environment,
                    rec.layers,
                    dict(rec.env),
                    rec.workdir,
                    rec.user,
                    key=f"template:{json.dumps([rec.environment, rec.layers, rec.env])}",
                    from_template=True,
                )
            env = self.base_templates.environment(req.from_template)
            blog.add(f"FROM template {req.from_template}: dsec environment {env}", step="base")
            return State(env, (), key=f"env:{env}")
        image = req.from_image or "e2bdev/base"
        if req.registry:
            blog.add("registry credentials are not used: images come from the node", "warn")
        target = self.images.get(image)
        if target is None and image.split(":")[0] in ("e2bdev/base", "e2bdev/code-interpreter"):
            target = self.base_templates.environment("base")
        if target is not None:
            blog.add(f"FROM {image}: {target} (DSEC_E2B_IMAGES)", step="base")
            if "@" in target:
                return State(None, (target,), key=f"layer:{target}")
            return State(target, (), key=f"env:{target}")
        resolve = getattr(self.client, "resolve_image", None)
        if resolve is None:
            raise BuildFailed(
                f"FROM {image}: the image is not in DSEC_E2B_IMAGES and this dsec cannot load "
                "docker images"
            )
        try:
            resolved = await resolve(image)
        except UnknownImage as e:
            raise BuildFailed(f"FROM {image}: unknown image: {e.message}") from e
        except DsecError as e:
            raise BuildFailed(f"FROM {image}: {type(e).__name__}: {e.message}") from e
        ref = resolved.layer
        how = "cached" if resolved.cached else "made"
        blog.add(f"FROM {image}: layer {ref} ({how} from {resolved.source})", step="base")
        # the image's ENV holds (Docker's semantics: PATH, LANG, ...); its user and workdir
        # give way to E2B's defaults, as on E2B
        env = dict(item.partition("=")[::2] for item in resolved.env)
        return State(None, (ref,), env, key=f"layer:{ref}")

    def _cache_key(self, state: State) -> str:
        doc = {
            "v": 1,
            "base": state.key,
            "steps": [[s.type, list(s.args), s.files_hash] for s in self.request.steps],
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    async def _cached(self, key: str, blog: BuildLog) -> dict[str, Any] | None:
        hit = await self.store.cached(self.project, key)
        if hit is None:
            return None
        layer = hit["layers"][0] if hit.get("layers") else None
        if layer is not None and not await self._has_layer(layer):
            await self.store.forget(self.project, key)
            return None
        blog.add(f"cache hit: {layer or hit.get('environment')}, no step runs")
        return hit

    async def _has_layer(self, ref: str) -> bool:
        try:
            known = await self.client.layers()
        except DsecError:
            return False
        return any(ref in (info.ref, f"{info.name}@{info.version}") for info in known)

    # --- the steps -------------------------------------------------------------------------
    async def _execute(self, state: State, key: str, blog: BuildLog) -> dict[str, Any]:
        memory_mb = max(2048, self.template.memory_mb or 0)  # at least what it will run with
        spec: dict[str, Any] = {
            **BUILD_SANDBOX,
            "memory": f"{memory_mb}M",
            "environment": state.environment,
            "layers": state.layers,
            "labels": {BUILD_LABEL: f"e2b-{self.template.template_id}"},
            "network": self.network.mode,
            "policies": self.network.policies,
        }
        blog.add("starting the build sandbox", step="base")
        await blog.save()
        try:
            sb = await self.client.create(**spec)
        except DsecError as e:
            raise BuildFailed(
                f"the build sandbox did not start: {type(e).__name__}: {e.message}"
            ) from e
        self.sandbox_id = sid = sb.id
        try:
            if not state.from_template:
                await self._sh(sid, _user_script(E2B_USER), "base", blog, state, cwd="/")
            for i, step in enumerate(self.request.steps, 1):
                await self._step(sid, step, str(i), state, blog)
                await blog.maybe_save()
            blog.add("packing the template's layer", step="finalize")
            await blog.save()
            info = await self.client.pack_diff(
                sid,
                name=f"e2b-{key[:32]}",
                version=self.build.build_id.replace("-", "")[:12],
                scrub=False,
                source=os.environ.get("DSEC_E2B_LAYER_SOURCE") or None,
            )
        finally:
            with contextlib.suppress(Exception):
                await self.client.kill(sid)
        result = {
            "environment": state.environment,
            "layers": [info.ref, *state.layers],
            "env": state.env,
            "workdir": state.workdir,
            "user": state.user,
        }
        await self.store.remember(self.project, key, result)
        blog.add(f"packed {info.ref} ({info.size} bytes)", step="finalize")
        return result

    async def _sh(
        self,
        sid: str,
        command: str,
        step: str,
        blog: BuildLog,
        state: State,
        cwd: str | None = None,
        what: str | None = None,
    ) -> None:
        items = await self.client.exec_stream(
            sid, command, cwd=cwd or state.workdir, env=state.env, timeout=STEP_TIMEOUT
        )
        kept: list[str] = []  # the step's output, for the reason if it fails
        partial = {"stdout": b"", "stderr": b""}
        r: ExecResult | None = None

        def line(raw: bytes) -> None:
            text = raw[:MAX_LINE].decode("utf-8", "replace")
            blog.add(text, "info", step)
            kept.append(text)

        async for item in items:  # the output goes to the log as it comes, line by line
            if isinstance(item, ExecResult):
                r = item
                continue
            *lines, rest = (partial[item.stream] + item.data).split(b"\n")
            if len(rest) > MAX_LINE:  # a line without end is logged in pieces
                lines, rest = [*lines, rest], b""
            partial[item.stream] = rest
            for raw in lines:
                line(raw)
            del kept[:-400]
            await blog.maybe_save()
        for rest in partial.values():
            if rest:
                line(rest)
        if r is None:
            raise BuildFailed(f"step {step}: {what or command}: its output stream broke off")
        if r.timed_out or r.exit_code != 0:
            why = f"exit code {r.exit_code}"
            if r.timed_out:
                why = f"timed out after {STEP_TIMEOUT:.0f} s"
            raise BuildFailed(
                f"step {step}: {what or command} failed ({why}): {_tail(chr(10).join(kept))}",
                step=step,
            )

    async def _step(self, sid: str, step: Step, n: str, state: State, blog: BuildLog) -> None:
        shown = f"{step.type} {' '.join(a for a in step.args if a)}"
        blog.add(f"[{n}/{len(self.request.steps)}] {shown}", step=n)
        if step.type == "RUN":
            await self._sh(sid, step.args[0], n, blog, state, what=f"RUN {step.args[0]}")
        elif step.type == "ENV":
            args = list(step.args)
            state.env.update(zip(args[0::2], args[1::2], strict=False))
        elif step.type == "WORKDIR":
            path = posixpath.normpath(posixpath.join(state.workdir, step.args[0]))
            await self._sh(sid, f"mkdir -p {shlex.quote(path)}", n, blog, state, cwd="/")
            state.workdir = path
        elif step.type == "USER":
            name = step.args[0].split(":")[0]
            if name and name != "root" and not name.isdigit():
                await self._sh(sid, _user_script(name), n, blog, state, cwd="/")
            state.user = step.args[0]
        elif step.type == "COPY":
            await self._copy(sid, step, n, state, blog)

    async def _copy(self, sid: str, step: Step, n: str, state: State, blog: BuildLog) -> None:
        src, dest = step.args[0], step.args[1]
        owner = step.args[2] if len(step.args) > 2 else ""
        mode = step.args[3] if len(step.args) > 3 else ""
        archive = self.files.path(self.project, step.files_hash or "")
        if not archive.is_file():
            raise BuildFailed(f"step {n}: COPY {src}: its files were not uploaded", step=n)
        dest_abs = posixpath.normpath(posixpath.join(state.workdir, dest))
        dest_is_dir = False
        with contextlib.suppress(DsecError):
            dest_is_dir = (await self.client.stat(sid, dest_abs)).type == "dir"

        def plan_for(members: Sequence[tarfile.TarInfo]) -> Any:
            return copy_plan(members, src, dest, state.workdir, dest_is_dir)

        fd, tmp = tempfile.mkstemp(prefix="dsec-e2b-copy-", suffix=".tar")
        os.close(fd)
        try:
            try:
                targets = await asyncio.to_thread(_rewrite, archive, Path(tmp), plan_for)
            except BuildFailed as e:
                raise BuildFailed(f"step {n}: {e.message}", step=n) from None
            except (tarfile.TarError, OSError, EOFError) as e:
                raise BuildFailed(f"step {n}: COPY {src}: a bad upload: {e}", step=n) from e
            await self.client.upload(sid, tmp, _COPY_TAR)
        finally:
            Path(tmp).unlink(missing_ok=True)
        parent = dest_abs if (dest.endswith("/") or dest_is_dir) else posixpath.dirname(dest_abs)
        quoted = " ".join(shlex.quote(t) for t in targets)
        script = f"mkdir -p {shlex.quote(parent)} && tar -xf {_COPY_TAR} -C /"
        if owner:
            script += f" && chown -R {shlex.quote(owner)} {quoted}"
        if mode and re.match(r"^[0-7]{3,4}$", mode):
            script += f" && chmod -R {mode} {quoted}"
        script = f"{script}; rc=$?; rm -f {_COPY_TAR}; exit $rc"
        await self._sh(sid, script, n, blog, state, cwd="/", what=f"COPY {src} {dest}")

    # --- the end -----------------------------------------------------------------------------
    async def _finish(self, result: Mapping[str, Any], blog: BuildLog) -> None:
        made: dict[str, Any] = {
            "environment": result.get("environment"),
            "layers": list(result.get("layers") or ()),
            "env": dict(result.get("env") or {}),
            "workdir": str(result.get("workdir") or "/"),
            "user": str(result.get("user") or "root"),
            "start_cmd": self.request.start_cmd,
            "ready_cmd": self.request.ready_cmd,
            "cpu_count": self.template.cpu_count,
            "memory_mb": self.template.memory_mb,
        }
        current = await self.store.template(self.template.template_id)
        if current is not None and current.build_id == self.build.build_id:
            await self.store.save_template(
                replace(
                    current,
                    status="ready",
                    built=True,
                    environment=made["environment"],
                    layers=tuple(made["layers"]),
                    env=made["env"],
                    workdir=made["workdir"],
                    user=made["user"],
                    start_cmd=made["start_cmd"],
                    ready_cmd=made["ready_cmd"],
                    updated=time.time(),
                )
            )
        blog.add("build ready", step="finalize")
        await blog.save("ready", result=made)

    async def _fail(self, blog: BuildLog, message: str, step: str) -> None:
        blog.add(message, "error", step)
        reason = {
            "message": message,
            "step": step,
            "logEntries": [e for e in blog.entries if e.get("step") == step][-50:],
        }
        current = await self.store.template(self.template.template_id)
        if current is not None and current.build_id == self.build.build_id:
            await self.store.save_template(replace(current, status="error", updated=time.time()))
        await blog.save("error", reason)
