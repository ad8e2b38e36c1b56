"""``DsecEnvironment``: Harbor's ``BaseEnvironment`` on dsec sandboxes.

``start`` builds the task's ``environment/Dockerfile`` into a snapshot layer named by the
environment's content hash and its base (``dsec_harbor.build``; a cache hit when the node holds
it) and
restores a sandbox from it; that layer is the state after the environment's set-up, so every
trial of a task, and every attempt (``-k``), starts from one build as a fork of it (a new
writable layer over the same read-only ones). ``exec``, the file transfers and ``stop`` are the
SDK's. The node is ``DSEC_ADDRESS`` with ``DSEC_TOKEN`` (a node's token) or ``DSEC_API_KEY`` (an
apiserver's key), as the CLI takes them, or ``--ek address=... --ek token=...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode
from pydantic import Field

from dsec_core.errors import DsecError, LayerExists
from dsec_core.sdk import AsyncClient, AsyncSandbox

from .build import (
    RECIPE_VERSION,
    Base,
    build_layer,
    find_layer,
    layer_name,
    parse_images,
    put_files,
    resolve_base,
)
from .dockerfile import Recipe, parse

#: One build per environment hash at a time in this process: concurrent trials of one task
#: wait for the first one's build and restore from it.
_BUILDS: dict[str, asyncio.Lock] = {}


class DsecOptions(EnvironmentOptions):
    """What ``--ek key=value`` sets for ``-e dsec_harbor:DsecEnvironment``."""

    address: str | None = Field(default=None, description="Node or apiserver (DSEC_ADDRESS).")
    token: str | None = Field(
        default=None, description="Its token or API key (DSEC_TOKEN, DSEC_API_KEY)."
    )
    images: str | None = Field(
        default=None,
        description="FROM images to dsec environments or layers, image=env,... "
        "(DSEC_HARBOR_IMAGES).",
    )
    backend: str | None = Field(default=None, description="dsec backend (node default).")
    internet_network: str = Field(
        default="internet",
        description="dsec network mode for tasks with network_mode=public.",
    )
    build_network: str = Field(
        default="none",
        description="dsec network mode of the Dockerfile's build (none; internet for RUN steps "
        "that download).",
    )
    ttl_sec: float = Field(default=7200.0, description="The sandbox's time to live.")


class DsecEnvironment(BaseEnvironment):
    """A Harbor environment on a dsec node (or through an apiserver)."""

    options_model: ClassVar[type[EnvironmentOptions] | None] = DsecOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._sandbox: AsyncSandbox | None = None
        self._client: AsyncClient | None = None
        self._bash: bool | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "dsec"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # network "none" (loopback only) is a dsec sandbox's default
        return EnvironmentCapabilities(disable_internet=True)

    @property
    def _options(self) -> DsecOptions:
        assert isinstance(self.options, DsecOptions)
        return self.options

    @property
    def _dockerfile(self) -> Path:
        return self.environment_dir / "Dockerfile"

    def _validate_definition(self) -> None:
        if self.task_env_config.docker_image is None and not self._dockerfile.is_file():
            raise FileNotFoundError(f"{self._dockerfile} not found (and no docker_image)")
        if (self.environment_dir / "docker-compose.yaml").exists():
            raise ValueError("dsec runs one container per task: docker-compose is not supported")

    def _read_recipe(self, image_env: Mapping[str, str] | None = None) -> Recipe:
        if self._dockerfile.is_file():
            return parse(self._dockerfile, image_env)
        return Recipe(base=str(self.task_env_config.docker_image))

    def _connect(self) -> AsyncClient:
        """The client: ``--ek address/token``, else ``DSEC_ADDRESS`` with ``DSEC_TOKEN`` or
        ``DSEC_API_KEY`` (an apiserver's key), as the CLI takes them."""
        opts = self._options
        address = opts.address or os.environ.get("DSEC_ADDRESS") or None
        token = opts.token or os.environ.get("DSEC_TOKEN") or os.environ.get("DSEC_API_KEY")
        return AsyncClient(address, token=token or None, autostart=False)

    async def _layer(
        self, client: AsyncClient, recipe: Recipe, base: Base, force_build: bool
    ) -> str:
        """The snapshot layer of this environment: found on the node, or built now."""
        name = layer_name(self.environment_id, base)
        ref = f"{name}@{RECIPE_VERSION}"
        lock = _BUILDS.setdefault(ref, asyncio.Lock())
        async with lock:
            found = None if force_build else await find_layer(client, name, RECIPE_VERSION)
            if found is not None:
                self.logger.info(f"dsec: {found} is built already (cache hit)")
                return found
            timeout = float(self.task_env_config.build_timeout_sec)
            # layer versions are immutable: a forced build is packed as a version of its own,
            # used by this trial, and leaves the cached one as it is
            version = f"{RECIPE_VERSION}-f{time.time_ns()}" if force_build else RECIPE_VERSION
            try:
                return await build_layer(
                    client,
                    recipe,
                    self.environment_dir,
                    name=name,
                    version=version,
                    base=base,
                    timeout=timeout,
                    network=self._options.build_network,
                    log=lambda m: self.logger.info(f"dsec build {name}: {m}"),
                )
            except LayerExists:  # another Harbor process built the same environment meanwhile
                found = await find_layer(client, name, RECIPE_VERSION)
                if found is None:
                    raise
                return found

    def _network(self) -> str:
        if self.network_policy.network_mode == NetworkMode.PUBLIC:
            return self._options.internet_network
        return "none"

    async def start(self, force_build: bool) -> None:
        self._client = client = self._connect()
        try:
            images = parse_images(self._options.images or os.environ.get("DSEC_HARBOR_IMAGES"))
            image = self._read_recipe().base
            # the image's own ENV (PATH, ...) is what the Dockerfile's $PATH extends
            base = await resolve_base(client, image, images)
            recipe = self._read_recipe(base.env)
            ref = await self._layer(client, recipe, base, force_build)
            spec: dict[str, Any] = {
                "env": {**base.env, **recipe.env, **self._startup_env()},
                "workdir": self.task_env_config.workdir or recipe.workdir,
                "network": self._network(),
                "ttl": self._options.ttl_sec,
                "labels": {"harbor.session": self.session_id[:63]},
            }
            if self._effective_cpus:
                spec["cpu"] = float(self._effective_cpus)
            if self._effective_memory_mb:
                spec["memory"] = f"{int(self._effective_memory_mb)}M"
            if self._effective_storage_mb:
                spec["disk"] = f"{int(self._effective_storage_mb)}M"
            if self._options.backend:
                spec["backend"] = self._options.backend
            (self._sandbox,) = await client.restore(ref, 1, **spec)
            self.logger.info(
                f"dsec: sandbox {self._sandbox.id} restored from {ref} (network {spec['network']})"
            )
            if recipe.user is not None:
                self.default_user = recipe.user
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self.stop(delete=True)  # a sandbox that never started is no use to look at
            raise

    async def stop(self, delete: bool) -> None:
        """Kill the sandbox; ``--no-delete`` leaves it running until its TTL (``ttl_sec``),
        for a look inside (`dsec sandbox exec <id> ...`)."""
        sb, client = self._sandbox, self._client
        self._sandbox = self._client = None
        if sb is not None and not delete:
            self.logger.info(f"dsec: sandbox {sb.id} left running (--no-delete)")
        elif sb is not None:
            with contextlib.suppress(DsecError):
                await sb.kill()
        if client is not None:
            await client.close()

    def _require(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError("the dsec sandbox is not started")
        return self._sandbox

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        sb = self._require()
        who = self._resolve_user(user)
        argv = ["bash", "-c", command] if await self._has_bash() else ["/bin/sh", "-c", command]
        if who not in (None, "", "root", 0, "0"):
            argv = ["runuser", "-u", str(who), "--", *argv]
        r = await sb.exec(
            argv,
            cwd=cwd,
            env=self._merge_env(env),
            timeout=float(timeout_sec) if timeout_sec else None,
            background=False,
        )
        if r.timed_out:  # as Harbor's docker environment says it (its reference provider)
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(
            stdout=r.stdout.decode(errors="replace"),
            stderr=r.stderr.decode(errors="replace"),
            return_code=r.exit_code,
        )

    async def _has_bash(self) -> bool:
        """Whether the sandbox has bash, which Harbor's commands are written for (asked once)."""
        if self._bash is None:
            sb = self._require()
            r = await sb.exec(["/bin/sh", "-c", "command -v bash"], timeout=30)
            self._bash = r.exit_code == 0
        return self._bash

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        sb = self._require()
        parent = str(PurePosixPath(target_path).parent)
        await sb.exec(["mkdir", "-p", parent], timeout=60)
        await sb.upload(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        sb = self._require()
        root = Path(source_dir)
        pairs: list[tuple[Path, str]] = [(root, target_dir)]
        for dirpath, dirnames, filenames in os.walk(root):
            here = PurePosixPath(target_dir) / Path(dirpath).relative_to(root).as_posix()
            dirnames.sort()
            pairs.append((Path(dirpath), str(here)))
            pairs += [(Path(dirpath) / f, str(here / f)) for f in sorted(filenames)]
        await put_files(sb, pairs, timeout=600)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        sb = self._require()
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        await sb.download(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        sb = self._require()
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        for entry in await sb.list_dir(source_dir):
            remote = f"{source_dir.rstrip('/')}/{entry.name}"
            if entry.type == "dir":
                await self.download_dir(remote, target / entry.name)
            elif entry.type == "file":
                await sb.download(remote, target / entry.name)
