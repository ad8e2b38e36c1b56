"""A build session: a sandbox under the builder's client, labelled as a build, from ``--from
ENV``, reachable only through the indexes its policy names; and ``finish``, which turns it into
a published environment: scrub -> pack_diff (staged, leak-scanned) -> QA -> publish.

The session outlives the process that opened it: its record (``BuildStore``) names the sandbox,
so each CLI invocation, MCP server or plan run re-attaches with ``BuildSession.attach``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec_core.catalog.distribution import publish_catalog
from dsec_core.catalog.model import Catalog, Environment, Task
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.errors import (
    DsecError,
    InvalidSpec,
    LeakFound,
    SandboxNotRunning,
    SandboxPathError,
    UnknownSandbox,
)
from dsec_core.layers.store import LayerStore
from dsec_core.plugins import open_source
from dsec_core.records import (
    BUILD_LABEL,
    STAGED_PREFIX,
    ExecResult,
    FileEntry,
    LayerInfo,
    LayerRef,
    SandboxSpec,
    parse_size,
)
from dsec_core.sdk import Client, Sandbox

from .errors import BuildSessionLost, QAFailed
from .policy import BuildPolicy
from .qa import DEFAULT_MAX_BYTES, Check, QAReport, TaskSpec, run_qa
from .record import LIVE_STATES, BuildRecord, BuildStore, check_build_name

__all__ = ["BuildContext", "BuildSession", "FinishResult"]

#: What the session's sandbox may use unless ``start`` is told otherwise.
SESSION_SANDBOX = {"cpu": 1.0, "memory": "2G", "pids": 1024, "disk": "10G", "ttl": 4 * 3600.0}


@dataclass
class BuildContext:
    """Where builds run and what they use: ``home`` (the builder's ``DSEC_HOME``: build
    records, and the node store that publish writes to), ``client`` (the builder's: opens the
    session, packs it) and ``runtime`` (a runtime identity's: runs QA)."""

    home: Path
    client: Client
    runtime: Client

    @classmethod
    def from_env(cls) -> BuildContext:
        """The local node (``DSEC_HOME``) by default; ``DSEC_ADDRESS`` + ``DSEC_API_KEY`` name
        an apiserver and the builder's key, ``DSEC_RUNTIME_ADDRESS`` (default: the same
        address) + ``DSEC_RUNTIME_API_KEY`` the runtime key QA runs under."""
        config = NodeConfig.from_env()
        address = os.environ.get("DSEC_ADDRESS") or None
        client = Client(address, api_key=os.environ.get("DSEC_API_KEY") or None)
        runtime_key = os.environ.get("DSEC_RUNTIME_API_KEY") or None
        runtime_address = os.environ.get("DSEC_RUNTIME_ADDRESS") or address
        if runtime_key or runtime_address != address:
            runtime = Client(runtime_address, api_key=runtime_key)
        else:
            runtime = client
        return cls(config.home, client, runtime)

    @property
    def config(self) -> NodeConfig:
        return NodeConfig(home=self.home)

    @property
    def store(self) -> BuildStore:
        return BuildStore(self.home)

    def close(self) -> None:
        self.client.close()
        if self.runtime is not self.client:
            self.runtime.close()


@dataclass(frozen=True)
class FinishResult:
    """What ``finish`` did: the published layer (None if not published), the catalog entry's
    environment name, the QA report and where it is stored."""

    layer: LayerInfo | None
    environment: str
    report: Mapping[str, Any]
    report_path: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer.to_dict() if self.layer else None,
            "environment": self.environment,
            "report": dict(self.report),
            "report_path": self.report_path,
        }


class BuildSession:
    """One build's session; ``start`` opens it, ``attach`` finds it again by name."""

    def __init__(self, ctx: BuildContext, name: str) -> None:
        self.ctx = ctx
        self.name = check_build_name(name)

    # --- opening -----------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        ctx: BuildContext,
        *,
        from_env: str,
        name: str,
        version: str = "1",
        policy: BuildPolicy | None = None,
        checks: Sequence[Check] = (),
        **sandbox: Any,
    ) -> BuildSession:
        """Open a build session: a sandbox of environment ``from_env`` under the builder's
        client, labelled ``BUILD_LABEL=name``, with network only to ``policy``'s indexes
        (none without). ``sandbox`` overrides ``SESSION_SANDBOX`` (cpu, memory, disk, ttl)."""
        check_build_name(name)
        policy = policy or BuildPolicy()
        _layer_version(name, version)
        store = ctx.store
        record = BuildRecord(
            name=name,
            version=version,
            from_env=from_env,
            sandbox_id="",
            policy=policy.to_dict(),
            checks=tuple({"name": c.name, "command": c.command} for c in checks),
        )
        store.create(record)  # BuildExists before any sandbox is made
        try:
            spec = SandboxSpec(
                environment=from_env,
                labels={BUILD_LABEL: name},
                env=policy.mirror_env(),
                network=policy.network,
                policies=policy.policies,
                **{**SESSION_SANDBOX, **sandbox},
            )
            sb = ctx.client.create(spec)
        except BaseException:
            store.remove(name)
            raise
        try:
            store.update(name, sandbox_id=sb.id)
            restore = _grant_files(sb, policy.mirror_files())
            store.update(name, restore=restore)
        except BaseException:
            with contextlib.suppress(DsecError):
                sb.kill()
            store.remove(name)
            raise
        session = cls(ctx, name)
        session.log("start", {"from": from_env, "version": version}, {"sandbox": sb.id})
        return session

    @classmethod
    def attach(cls, ctx: BuildContext, name: str) -> BuildSession:
        """The session of build ``name`` (``UnknownBuild`` if there is no such build)."""
        ctx.store.get(name)
        return cls(ctx, name)

    @property
    def record(self) -> BuildRecord:
        return self.ctx.store.get(self.name)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    def log(self, tool: str, args: Mapping[str, Any], result: Any = None, error: str = "") -> None:
        entry: dict[str, Any] = {"tool": tool, "args": dict(args)}
        if error:
            entry["error"] = error
        else:
            entry["result"] = result
        self.ctx.store.log(self.name, entry)

    def _live(self) -> str:
        """The session sandbox's id, once it is known to run; ``BuildSessionLost`` if not."""
        record = self.record
        if record.state not in LIVE_STATES:
            raise InvalidSpec(
                f"build {self.name} is {record.state}: its session is closed", name=self.name
            )
        try:
            info = self.ctx.client.get(record.sandbox_id).info
        except UnknownSandbox as e:
            raise self._lost(f"its sandbox {record.sandbox_id} is gone ({e})") from e
        if info.state != "running":
            raise self._lost(f"its sandbox {record.sandbox_id} is {info.state}")
        return record.sandbox_id

    def _lost(self, why: str) -> BuildSessionLost:
        self.ctx.store.update(self.name, state="lost", error=why)
        return BuildSessionLost(
            f"build {self.name}: the session is lost: {why}; nothing was packed",
            name=self.name,
            sandbox_id=self.record.sandbox_id,
        )

    # --- the tools' work ------------------------------------------------------------------
    def exec(self, command: str, *, timeout: float = 300.0, cwd: str | None = None) -> ExecResult:
        return self.ctx.client.exec(self._live(), command, timeout=timeout, cwd=cwd)

    def session_exec(
        self, command: str, *, session: str | None = None, timeout: float = 300.0
    ) -> tuple[str, ExecResult]:
        """Run ``command`` in shell session ``session`` (state kept between calls: cwd,
        variables); None: the build's own, opened on first use. Returns the session id too."""
        sid = self._live()
        client = self.ctx.client
        if session is None:
            session = self.record.session
            if session is not None and session not in client.sessions(sid):
                session = None  # it ended (its shell exited): open another
            if session is None:
                session = client.session_open(sid).id
                self.ctx.store.update(self.name, session=session)
        return session, client.session_exec(sid, session, command, timeout=timeout)

    def read(self, path: str) -> bytes:
        return self.ctx.client.read_file(self._live(), path)

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        self.ctx.client.write_file(self._live(), path, data, mode=mode)

    def list(self, path: str) -> list[FileEntry]:
        return self.ctx.client.list_dir(self._live(), path)

    def kill(self) -> None:
        """End the session: kill its sandbox (if still there)."""
        with contextlib.suppress(UnknownSandbox):
            self.ctx.client.kill(self.record.sandbox_id)

    # --- finish -------------------------------------------------------------------------
    def finish(
        self,
        *,
        checks: Sequence[Check] = (),
        task: Mapping[str, Any] | None = None,
        max_bytes: int | str = DEFAULT_MAX_BYTES,
        publish: str | None = None,
    ) -> FinishResult:
        """Scrub the session, pack it as staged layer ``staged-<name>@<version>`` (leak-scanned
        for the task's tests, reference and secrets), QA it, and publish it: the layer as
        ``<name>@<version>``, a catalog ``<name>`` with environment ``<name>`` (and the task),
        and, with ``publish`` (a layer source URL), the catalog and its layers there too.

        ``BuildSessionLost`` if the session's sandbox is gone (nothing packed); ``LeakFound``
        if a secret is in the packed diff (nothing staged, the session stays open to remove
        it); ``QAFailed`` if a check failed (the layer stays staged with its report, the
        session stays open, nothing is published)."""
        record = self.record
        from_env = CatalogStore(self.ctx.config.catalog_dir).environment(record.from_env)
        parse_size(max_bytes, "max_bytes")  # a bad budget is refused before anything is packed
        all_checks = [*(Check.from_dict(c) for c in record.checks), *checks]
        sid = self._live()
        if task is not None:
            task = self._resolve_files(task)
        spec = TaskSpec.from_dict(task, self.name) if task is not None else None
        if task is not None:  # for graders: the builder's own file, tests and reference too
            self.ctx.store.save_task(self.name, task)
        self.scrub()
        self._drop_staged(record)
        secrets = spec.secret_texts() if spec else {}
        try:
            staged = self.ctx.client.pack_diff(
                sid, name=STAGED_PREFIX + self.name, version=record.version, secrets=secrets
            )
        except LeakFound as e:
            self.ctx.store.update(self.name, state="leaked", error=str(e))
            self.log("finish", {}, error=f"LeakFound: {e}")
            raise
        except (UnknownSandbox, SandboxNotRunning) as e:
            raise self._lost(str(e)) from e
        self.ctx.store.update(self.name, state="staged", staged=staged.ref)
        report = run_qa(
            self.ctx.runtime,
            staged,
            env=from_env.env,
            workdir=from_env.workdir,
            checks=all_checks,
            task=spec,
            max_bytes=max_bytes,
            backend=from_env.backend,
        )
        report_path = self.ctx.store.save_report(self.name, report.to_dict())
        if not report.passed:
            self.ctx.store.update(
                self.name, state="qa-failed", error=f"QA failed: {', '.join(report.failed)}"
            )
            self.log("finish", {}, error=f"QAFailed: {', '.join(report.failed)}")
            raise QAFailed(
                f"build {self.name}: QA failed: {', '.join(report.failed)}; {staged.ref} stays "
                f"staged, report in {report_path}",
                name=self.name,
                failed=report.failed,
                report=os.fspath(report_path),
            )
        layer, environment = self._publish(staged, from_env, spec, report, publish)
        self.ctx.store.update(self.name, state="published", published=layer.ref, error="")
        self.log("finish", {"publish": publish}, {"layer": layer.ref, "passed": True})
        with contextlib.suppress(DsecError):
            self.kill()
        return FinishResult(layer, environment, report.to_dict(), os.fspath(report_path))

    def _resolve_files(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """``task`` with each tests/reference entry given as ``{file: PATH}`` replaced by
        that file's text in the session (read before the scrub: the builder keeps hidden
        tests and the reference under BUILD_NOTES_DIR, which pack_diff leaves out)."""
        out = dict(task)
        for key in ("tests", "reference"):
            files = out.get(key)
            if not isinstance(files, Mapping):
                continue
            resolved = {}
            for path, value in files.items():
                if isinstance(value, Mapping) and set(value) == {"file"}:
                    try:
                        value = self.read(str(value["file"])).decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise InvalidSpec(
                            f"task.{key}.{path}: {value['file']} is not UTF-8 text",
                            field=f"task.{key}",
                        ) from e
                resolved[path] = value
            out[key] = resolved
        return out

    def scrub(self) -> None:
        """Undo in the session what pack_diff's own scrub cannot know of: the mirror files the
        policy granted get their old text back (pip's mirror is only in the session's env,
        which the published environment does not carry). The builder's notes
        (BUILD_NOTES_DIR) stay in the session, for a finish again after a failed QA:
        pack_diff's scrub leaves them out of the layer."""
        sid = self._live()
        for path, old in self.record.restore.items():
            if old is None:
                self.ctx.client.exec(sid, "rm -f -- " + shlex.quote(path), timeout=60)
            else:
                self.ctx.client.write_file(sid, path, old)

    def _drop_staged(self, record: BuildRecord) -> None:
        """A previous finish's staged layer (QA failed, then fixed): removed before packing
        again under the same ref."""
        if record.staged:
            store = LayerStore(self.ctx.config.layer_dir)
            if store.exists(record.staged):
                store.remove(record.staged)
            self.ctx.store.update(self.name, staged="")

    def _publish(
        self,
        staged: LayerInfo,
        from_env: Environment,
        spec: TaskSpec | None,
        report: QAReport,
        source: str | None,
    ) -> tuple[LayerInfo, str]:
        """The staged layer retagged as ``name@version`` (a toolkit layer over the source
        environment's layers: catalogs stack base, workspaces, toolkits), and a catalog
        ``name`` holding environment ``name`` and, for a task without hidden tests, the task
        (``expect``: the unmodified workspace's reward)."""
        config = self.ctx.config
        layers = LayerStore(config.layer_dir)
        record = self.record
        # the layer's own record says how it was made and checked: it travels with the layer
        checked = ", ".join(c["name"] for c in report.checks)
        origin = f"dsec build {self.name} from {from_env.name}; QA passed: {checked}"
        layer = _retag(layers, staged, self.name, record.version, origin)
        env = Environment(
            name=self.name,
            base=from_env.base,
            workspaces=from_env.workspaces,
            toolkits=(layer.ref, *from_env.toolkits),
            env=from_env.env,
            workdir=from_env.workdir,
            description=f"built by dsec build from {from_env.name}",
            backend=from_env.backend,
        )
        tasks: list[Task] = []
        if spec is not None and not spec.tests:
            # a task whose tests ship in the workspace runs as is: register it (a hidden
            # test is given to QA sandboxes only; its task stays in the build's task.json)
            unmodified = next(c for c in report.checks if c["name"] == "unmodified-fails")
            fields = {**spec.task.__dict__, "environment": env.name}
            tasks.append(Task(**{**fields, "expect": unmodified["reward"]}))
        catalog = Catalog(
            name=self.name,
            environments=(env,),
            tasks=tuple(tasks),
            description=f"dsec build {self.name} from {from_env.name}",
        )
        CatalogStore(config.catalog_dir).save(catalog)
        if source:
            publish_catalog(catalog, open_source(source, config), layers)
        with contextlib.suppress(DsecError):
            layers.remove(staged.ref)
        self.ctx.store.update(self.name, staged="")
        return layer, env.name


def _grant_files(sb: Sandbox, files: Mapping[str, str]) -> dict[str, str | None]:
    """Write ``files`` in ``sb``; what each replaced (None: nothing was there)."""
    old: dict[str, str | None] = {}
    for path, text in files.items():
        try:
            old[path] = sb.read_file(path).decode("utf-8")
        except SandboxPathError:
            old[path] = None
        sb.exec(["mkdir", "-p", posixpath.dirname(path)], timeout=30)
        sb.write_file(path, text)
    return old


def _layer_version(name: str, version: str) -> None:
    """InvalidSpec unless ``name@version`` (and its staged name) can name a layer."""
    LayerRef.parse(f"{STAGED_PREFIX}{name}@{version}")


def _retag(store: LayerStore, staged: LayerInfo, name: str, version: str, source: str) -> LayerInfo:
    """``staged``'s image under ``name@version`` in ``store``: the same blob, a second ref."""
    with store.scratch("retag-") as tmp:
        image = Path(tmp) / "image.erofs"
        os.link(store.image_path(staged), image)
        return store.add(image, name=name, version=version, kind="toolkit", source=source)
