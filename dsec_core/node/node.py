"""The node: owns every sandbox on this machine, from admission to cleanup, and survives restarts.

A create resolves layers, takes shared layer mounts, stacks an overlay, and asks a backend to
start the sandbox; each step is undone if a later one fails. Every sandbox's state is written
to ``$DSEC_HOME/run/sandboxes/<id>/state.json`` (a tmpfs) so a restarted daemon re-adopts what
is still running and cleans up what is not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from .. import plugins
from ..agent import ensure_agent
from ..agent.client import AgentClient
from ..backend import Backend, IdMap, SandboxRuntime
from ..catalog import CatalogStore
from ..config import NodeConfig
from ..errors import AdmissionRejected, DsecError, SandboxNotRunning, UnknownSandbox
from ..layers.source import LayerSource
from ..layers.sources import find_layer, node_sources
from ..records import ExecResult, FileEntry, LayerInfo, SandboxInfo, SandboxSpec
from .lazy import LazyLayers
from .mounts import (MountCache, OverlayStack, UserNamespaceHandle, ensure_tmpfs,
                     mounted_under, unmount)

__all__ = ["Node"]

log = logging.getLogger("dsec.node")

STATE_FILE = "state.json"


@dataclass
class Sandbox:
    """A sandbox as the daemon tracks it."""

    rt: SandboxRuntime
    backend: Backend
    layers: list[LayerInfo]
    created: float
    expires: float | None
    backend_state: dict[str, Any] = field(default_factory=dict)
    status: str = "creating"  # creating | running | stopping | dead
    ttl_handle: asyncio.TimerHandle | None = None
    agent: AgentClient | None = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    def info(self) -> SandboxInfo:
        spec = self.rt.spec
        return SandboxInfo(
            id=self.rt.id, backend=self.backend.name, state=self.status, created=self.created,
            expires=self.expires, layers=tuple(layer.ref for layer in self.layers),
            environment=spec.environment, limits=self.rt.limits.to_dict(),
            labels=dict(spec.labels), pid=self.backend_state.get("pid"))

    def state_doc(self) -> dict[str, Any]:
        return {
            "id": self.rt.id, "spec": self.rt.spec.to_dict(), "backend": self.backend.name,
            "created": self.created, "expires": self.expires, "status": self.status,
            "layers": [layer.to_dict() for layer in self.layers],
            "backend_state": self.backend_state,
            "idmap": [self.rt.idmap.host_base, self.rt.idmap.size],
        }


class Node:
    """Everything one node does; the HTTP API and the tests drive this class."""

    def __init__(self, config: NodeConfig | None = None) -> None:
        self.config = config or NodeConfig.from_env()
        self.registry = plugins.registry()
        self.idmap = IdMap(self.config.uid_base, self.config.uid_size)
        self.sandboxes: dict[str, Sandbox] = {}
        self._backends: dict[str, Backend] = {}
        self._tasks: set[asyncio.Task] = set()
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._watch: asyncio.Task | None = None
        self.userns: UserNamespaceHandle | None = None
        self.mounts: MountCache | None = None
        self.lazy: LazyLayers | None = None
        self.catalogs = CatalogStore(self.config.catalog_dir)
        self.agent_binary: Path | None = None

    # --- life of the node -----------------------------------------------------------------
    async def open(self) -> None:
        cfg = self.config
        cfg.ensure_dirs()
        ensure_tmpfs(cfg.run_dir)
        cfg.runtime_dir.mkdir(mode=0o711, exist_ok=True)
        self.agent_binary = ensure_agent(cfg.bin_dir)
        self.userns = UserNamespaceHandle(self.idmap)
        self.mounts = MountCache(cfg.mount_dir, self.userns, cfg.layer_linger)
        self.lazy = LazyLayers(cfg)
        if self.lazy.keeper_socket.exists():  # a previous daemon served on-demand layers
            await asyncio.to_thread(self.lazy.ensure_open)
        self.layer_sources = node_sources(cfg)
        await self._adopt()
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def close(self, kill_all: bool = False, release_runtime: bool = True) -> None:
        """Stop serving. Sandboxes keep running unless ``kill_all``; with none left and
        ``release_runtime``, the runtime tmpfs goes too (the daemon does that itself, last)."""
        if self._watch:
            self._watch.cancel()
        if kill_all:
            await asyncio.gather(*(self.kill(sid) for sid in list(self.sandboxes)),
                                 return_exceptions=True)
        for sb in self.sandboxes.values():
            if sb.ttl_handle:
                sb.ttl_handle.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.mounts:
            self.mounts.close()
        if self.lazy and not self.sandboxes:
            self.lazy.close()  # after the layer mounts that read through it
        if self.userns:
            self.userns.close()
        if release_runtime:
            self.release_runtime()

    def release_runtime(self, lazy: bool = False) -> None:
        """Unmount the runtime tmpfs if no sandbox needs it any more."""
        if not self.sandboxes and os.path.ismount(self.config.run_dir):
            unmount(self.config.run_dir, lazy=lazy)

    def backend(self, name: str) -> Backend:
        be = self._backends.get(name)
        if be is None:
            cls = self.registry.backend(name)
            cls.check_available()
            policies = [p() for p in self.registry.security_policies.values()]
            be = self._backends[name] = cls(self.config, policies)
        return be

    # --- layers ---------------------------------------------------------------------------
    def resolve_layers(self, refs: Sequence[str]) -> list[tuple[LayerSource, LayerInfo]]:
        """(source, layer) for each ``name@version``, from the first source that has it."""
        return [find_layer(self.layer_sources, text) for text in refs]

    # --- create ---------------------------------------------------------------------------
    def _admit(self, spec: SandboxSpec) -> None:
        lim = spec.limits
        live = [s for s in self.sandboxes.values() if s.status in ("creating", "running")]
        cfg = self.config
        if len(live) + 1 > cfg.max_sandboxes:
            raise AdmissionRejected(f"node is full: {len(live)} sandboxes of at most "
                                    f"{cfg.max_sandboxes}", reason="count")
        cpu = sum(s.rt.limits.cpu for s in live) + lim.cpu
        if cpu > cfg.cpu_capacity:
            raise AdmissionRejected(
                f"not enough CPU: asked {lim.cpu} cores, {cfg.cpu_capacity - cpu + lim.cpu:.1f} "
                f"of {cfg.cpu_capacity:.0f} (with overcommit) left", reason="cpu")
        mem = sum(s.rt.limits.memory for s in live) + lim.memory
        if mem > cfg.memory_capacity:
            raise AdmissionRejected(
                f"not enough memory: asked {lim.memory >> 20} MiB, "
                f"{(cfg.memory_capacity - mem + lim.memory) >> 20} MiB of "
                f"{cfg.memory_capacity >> 20} MiB left", reason="memory")

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        t0 = time.perf_counter()
        backend = self.backend(spec.backend)
        limits = spec.limits
        self._admit(spec)
        refs = list(spec.layers)  # explicit layers go on top of the environment's
        if spec.environment:
            environment = self.catalogs.environment(spec.environment)
            refs += environment.layer_refs()
            env = {**dict(environment.env or {}), **spec.env}
            workdir = spec.workdir if spec.workdir != "/" else (environment.workdir or "/")
            spec = SandboxSpec(**{**spec.to_dict(), "env": env, "workdir": workdir})
        sources = self.resolve_layers(refs)
        layers = [info for _, info in sources]
        sid = secrets.token_hex(6)
        sdir = self.config.runtime_dir / sid
        ddir = self.config.sandbox_dir / sid
        sdir.mkdir(mode=0o711)
        rt = SandboxRuntime(id=sid, spec=spec, limits=limits, dir=sdir, data_dir=ddir,
                            rootfs=sdir / "rootfs", agent_socket=sdir / "agent.sock",
                            agent_binary=self.agent_binary, idmap=self.idmap)
        now = time.time()
        sb = Sandbox(rt=rt, backend=backend, layers=layers, created=now,
                     expires=now + spec.ttl if spec.ttl else None)
        self.sandboxes[sid] = sb  # counted by admission from here on
        overlay = OverlayStack(ddir, rt.rootfs)
        taken: list[str] = []
        t_prep = time.perf_counter()
        try:
            self._write_state(sb)  # first, so a crash from here on leaves a trace to clean
            mounts = []
            for source, info in sources:
                image, device = await self._layer_files(source, info)
                mounts.append(self.mounts.acquire(info.digest, image, device))
                taken.append(info.digest)
            sb.rt = rt = replace(rt, layer_mounts=tuple(mounts))
            t_layers = time.perf_counter()
            overlay.mount(mounts, owner=self.idmap.host_base)
            t_overlay = time.perf_counter()
            sb.backend_state = await backend.start(rt)
            t_start = time.perf_counter()
            sb.status = "running"
            self._write_state(sb)
            log.debug("created %s: prepare %.1f ms, layers %.1f ms, overlay %.1f ms, "
                      "backend %.1f ms, total %.1f ms", sid, 1e3 * (t_prep - t0),
                      1e3 * (t_layers - t_prep), 1e3 * (t_overlay - t_layers),
                      1e3 * (t_start - t_overlay), 1e3 * (time.perf_counter() - t0))
        except BaseException:
            self.sandboxes.pop(sid, None)
            await asyncio.shield(self._undo_create(overlay, taken, rt))
            raise
        if sb.expires:
            self._arm_ttl(sb)
        return sb.info()

    async def _layer_files(self, source: LayerSource,
                           info: LayerInfo) -> tuple[Path, Path | None]:
        """What to mount for a layer: (image, None) for a whole image, or (metadata image,
        data blob) to load it on demand."""
        if source.scheme == "local":
            return source.image_path(info), None
        if self.config.ondemand:
            prepared = await self._once(("lazy", info.digest), self.lazy.prepare, source, info)
            if prepared is not None:
                return prepared
        return await self._once(("image", info.digest), source.image_path, info), None

    async def _once(self, key: tuple[str, str], fn, *args):
        """Run blocking ``fn(*args)`` in a thread, once for all concurrent callers with the same
        ``key``: a burst of sandboxes of one image fetches it once."""
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            self._inflight[key] = fut
            fut.add_done_callback(lambda _f: self._inflight.pop(key, None))
        return await asyncio.shield(fut)

    async def prefetch(self, refs: Sequence[str]) -> list[dict[str, Any]]:
        """Warm layers on this node: every chunk of on-demand layers, whole remote images."""
        out = []
        for source, info in self.resolve_layers(refs):
            if source.scheme == "local":
                out.append({"layer": info.ref, "source": source.url, "fetched": 0,
                            "mode": "local"})
                continue
            image, device = await self._layer_files(source, info)
            if device is None:
                out.append({"layer": info.ref, "source": source.url, "mode": "whole",
                            "fetched": info.size})
                continue
            form = source.lazy_form(info)
            n = await asyncio.to_thread(self.lazy.prefetch, form.index.blob_digest)
            out.append({"layer": info.ref, "source": source.url, "mode": "on-demand",
                        "fetched": n, "chunks": len(form.index.chunks)})
        return out

    async def _undo_create(self, overlay: OverlayStack, taken: list[str],
                           rt: SandboxRuntime) -> None:
        try:
            overlay.unmount()
        finally:
            for digest in taken:
                self.mounts.release(digest)
            self._remove_dirs(rt)

    @staticmethod
    def _remove_dirs(rt: SandboxRuntime) -> None:
        shutil.rmtree(rt.data_dir, ignore_errors=True)
        shutil.rmtree(rt.dir, ignore_errors=True)

    async def create_many_settled(self, spec: SandboxSpec, n: int) -> list[SandboxInfo | DsecError]:
        """Create ``n`` sandboxes concurrently; each slot holds its sandbox or its typed error."""
        results = await asyncio.gather(*(self.create(spec) for _ in range(n)),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, DsecError):
                raise r
        return list(results)

    def _arm_ttl(self, sb: Sandbox) -> None:
        loop = asyncio.get_running_loop()
        delay = max(0.0, (sb.expires or 0) - time.time())
        sid = sb.rt.id
        sb.ttl_handle = loop.call_later(delay, lambda: self._spawn(self.kill(sid, reason="ttl")))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- lookup ---------------------------------------------------------------------------
    def _get(self, sid: str) -> Sandbox:
        sb = self.sandboxes.get(sid)
        if sb is None:
            raise UnknownSandbox(f"no sandbox {sid!r} on this node", name=sid,
                                 known=sorted(self.sandboxes))
        return sb

    def get(self, sid: str) -> SandboxInfo:
        return self._get(sid).info()

    def list(self) -> list[SandboxInfo]:
        return [sb.info() for sb in sorted(self.sandboxes.values(), key=lambda s: s.created)]

    def usage(self, sid: str) -> dict[str, Any]:
        sb = self._get(sid)
        return sb.backend.usage(sb.rt, sb.backend_state)

    # --- kill -----------------------------------------------------------------------------
    async def kill(self, sid: str, reason: str = "request") -> None:
        sb = self._get(sid)
        if sb.status == "stopping":
            await sb.stopped.wait()
            return
        sb.status = "stopping"
        if sb.ttl_handle:
            sb.ttl_handle.cancel()
        log.info("killing sandbox %s (%s)", sid, reason)
        try:
            await self._teardown(sb)
        finally:
            self.sandboxes.pop(sid, None)
            sb.status = "dead"
            sb.stopped.set()

    async def _teardown(self, sb: Sandbox) -> None:
        """Stop the backend, unmount, release layers, delete the sandbox directory."""
        await sb.backend.stop(sb.rt, sb.backend_state)
        OverlayStack(sb.rt.data_dir, sb.rt.rootfs).unmount()
        for info in sb.layers:
            self.mounts.release(info.digest)
        self._remove_dirs(sb.rt)
        for policy in sb.backend.security_policies:
            policy.released(sb.rt)

    # --- inside the sandbox ---------------------------------------------------------------
    def agent(self, sid: str) -> AgentClient:
        sb = self._get(sid)
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {sb.status}", sandbox_id=sid)
        if sb.agent is None:
            sb.agent = AgentClient(sb.rt.agent_socket, sandbox_id=sid)
        return sb.agent

    async def exec(self, sid: str, cmd: str | Sequence[str], *, timeout: float | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None,
                   stdin: bytes | None = None, max_output: int = 1 << 20) -> ExecResult:
        sb = self._get(sid)
        merged = {**sb.rt.spec.env, **(env or {})} or None
        cwd = cwd or sb.rt.spec.workdir or "/"
        return await self.agent(sid).exec(cmd, timeout=timeout, cwd=cwd, env=merged,
                                          stdin=stdin, max_output=max_output)

    async def session_open(self, sid: str, cwd: str | None = None,
                           env: dict[str, str] | None = None) -> str:
        sb = self._get(sid)
        return await self.agent(sid).session_open(
            cwd=cwd or sb.rt.spec.workdir or "/", env={**sb.rt.spec.env, **(env or {})} or None)

    async def session_exec(self, sid: str, session: str, cmd: str, *,
                           timeout: float | None = None, stdin: bytes | None = None,
                           max_output: int = 1 << 20) -> ExecResult:
        return await self.agent(sid).session_exec(session, cmd, timeout=timeout, stdin=stdin,
                                                  max_output=max_output)

    async def session_close(self, sid: str, session: str) -> None:
        await self.agent(sid).session_close(session)

    async def sessions(self, sid: str) -> list[str]:
        return await self.agent(sid).sessions()

    async def read_file(self, sid: str, path: str, offset: int = 0, length: int = -1) -> bytes:
        return await self.agent(sid).read_file(path, offset, length)

    async def write_file(self, sid: str, path: str, data: bytes, mode: int = 0o644,
                         offset: int = 0, truncate: bool = True) -> None:
        await self.agent(sid).write_file(path, data, mode=mode, offset=offset, truncate=truncate)

    async def list_dir(self, sid: str, path: str) -> list[FileEntry]:
        return await self.agent(sid).list_dir(path)

    async def stat(self, sid: str, path: str) -> FileEntry:
        return await self.agent(sid).stat(path)

    async def remove(self, sid: str, path: str, recursive: bool = False) -> None:
        await self.agent(sid).remove(path, recursive=recursive)

    # --- persistence and adoption ---------------------------------------------------------
    def _write_state(self, sb: Sandbox) -> None:
        path = sb.rt.dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(sb.state_doc(), f)
        os.replace(tmp, path)

    async def _adopt(self) -> None:
        """Take over sandboxes a previous daemon left running; clean up the rest."""
        in_use: dict[str, int] = {}
        runtime = self.config.runtime_dir
        for sdir in sorted(runtime.iterdir()) if runtime.exists() else []:
            try:
                sb = self._load(sdir)
            except Exception as e:  # unreadable state: nothing to adopt, only to clean
                log.warning("sandbox dir %s: %s; removing", sdir, e)
                await self._scrub_dir(sdir)
                continue
            alive = sb.status == "running" and await sb.backend.alive(sb.rt, sb.backend_state)
            if alive and (sb.expires is None or sb.expires > time.time()):
                self.sandboxes[sb.rt.id] = sb
                for info in sb.layers:
                    in_use[info.digest] = in_use.get(info.digest, 0) + 1
            else:
                log.info("sandbox %s is gone or expired; cleaning up", sb.rt.id)
                try:
                    await sb.backend.stop(sb.rt, sb.backend_state)
                except DsecError as e:
                    log.warning("stopping %s: %s", sb.rt.id, e)
                await self._scrub_dir(sdir)
        # Writable layers with no runtime state (after a reboot, or a crash mid-create).
        for ddir in sorted(self.config.sandbox_dir.iterdir()):
            if ddir.name not in self.sandboxes:
                await self._scrub_dir(ddir)
        self.mounts.adopt(in_use)
        for sb in self.sandboxes.values():
            if sb.expires:
                self._arm_ttl(sb)

    def _load(self, sdir: Path) -> Sandbox:
        doc = json.loads((sdir / STATE_FILE).read_text())
        spec = SandboxSpec.from_dict(doc["spec"])
        backend = self.backend(doc["backend"])
        layers = [LayerInfo.from_dict(d) for d in doc["layers"]]
        idmap = IdMap(*doc["idmap"])
        rt = SandboxRuntime(id=doc["id"], spec=spec, limits=spec.limits, dir=sdir,
                            data_dir=self.config.sandbox_dir / doc["id"], rootfs=sdir / "rootfs", agent_socket=sdir / "agent.sock",
                            agent_binary=self.agent_binary, idmap=idmap,
                            layer_mounts=tuple(self.mounts.path_for(i.digest) for i in layers))
        return Sandbox(rt=rt, backend=backend, layers=layers, created=doc["created"],
                       expires=doc["expires"], backend_state=doc.get("backend_state") or {},
                       status=doc.get("status", "creating"))

    async def _scrub_dir(self, sdir: Path) -> None:
        for mp in mounted_under(sdir):
            unmount(mp)
        shutil.rmtree(sdir, ignore_errors=True)

    async def _watch_loop(self) -> None:
        """Notice sandboxes whose processes died on their own, and sweep idle layer mounts."""
        while True:
            await asyncio.sleep(1.0)
            try:
                self.mounts.sweep()
                for sid, sb in list(self.sandboxes.items()):
                    if sb.status == "running" and not await sb.backend.alive(sb.rt,
                                                                              sb.backend_state):
                        log.warning("sandbox %s died on its own; cleaning up", sid)
                        self._spawn(self.kill(sid, reason="died"))
            except Exception:  # the watcher must not die; log and go on
                log.exception("watch loop")

