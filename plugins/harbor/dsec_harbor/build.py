"""A task's environment made into dsec layers: ``build_layer`` replays a parsed Dockerfile
(``dsec_harbor.dockerfile``) in a sandbox of its base through the SDK and packs what the steps
wrote as a snapshot layer named by the environment's content hash, so an unchanged environment
is built once and each trial restores from that layer.

Why the SDK and not ``docker build``: it works against any node or apiserver a client can
reach (no docker daemon, no node-side access), with the node's own isolation for the build's
RUN steps. ``build_layer`` is the one place that decides how; an apiserver that builds
Dockerfiles itself (E2B's template API) can take its place later.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shlex
import tarfile
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from dsec_core.errors import DsecError, InvalidSpec, LayerBuildError, UnknownImage
from dsec_core.sdk import AsyncClient, AsyncSandbox

from .dockerfile import Copy, Recipe, Run

#: Bumped when what ``build_layer`` makes of the same Dockerfile changes: a new version is a
#: new layer name, so layers built by an older recipe are never reused.
RECIPE_VERSION = "1"

Log = Callable[[str], None]


@dataclass(frozen=True)
class Base:
    """Where a build starts: a dsec environment (``python``) or layers (top first), and the
    image's own ENV (a docker image's config: PATH, LANG, ...), which holds in the build's
    steps and in the sandboxes after it, as under Docker."""

    environment: str | None = None
    layers: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def spec(self) -> dict[str, Any]:
        if self.environment is not None:
            return {"environment": self.environment}
        return {"layers": self.layers}


def parse_images(text: str | None, field: str = "DSEC_HARBOR_IMAGES") -> dict[str, Base]:
    """An operator's table of FROM images: ``image=environment`` or ``image=name@version``
    (a layer), comma-separated, e.g. ``python:3.12-slim=python,ubuntu:24.04=python``."""
    table: dict[str, Base] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        image, eq, target = part.strip().rpartition("=")
        if not eq or not image or not target:
            raise InvalidSpec(f"{field}: {part.strip()!r} is not image=environment", field=field)
        table[image] = Base(layers=(target,)) if "@" in target else Base(environment=target)
    return table


def lookup_base(image: str, images: Mapping[str, Base]) -> Base | None:
    """FROM ``image`` in the operator's table: as written, then without its tag or digest,
    then with ``:latest`` for a bare name."""
    bare = image.split("@", 1)[0]
    if ":" in bare.rsplit("/", 1)[-1]:
        bare = bare.rsplit(":", 1)[0]
    for name in (image, bare, f"{image}:latest"):
        if name in images:
            return images[name]
    return None


async def resolve_base(client: AsyncClient, image: str, images: Mapping[str, Base]) -> Base:
    """The dsec base of FROM ``image``: the operator's table (``lookup_base``), else the node's
    ``resolve_image`` (its local docker images, then its layer sources that hold images; never
    a public registry), whose layer keeps the image's ENV. ``UnknownImage`` naming the image
    and where it was looked for otherwise."""
    found = lookup_base(image, images)
    if found is not None:
        return found
    try:
        resolved = await client.resolve_image(image)
    except UnknownImage as e:
        raise UnknownImage(
            f"FROM {image}: not in DSEC_HARBOR_IMAGES (map it: '{image}=<environment>'), "
            f"and the node has no such image: {e.message}",
            name=image,
        ) from e
    env = dict(item.partition("=")[::2] for item in resolved.env)
    return Base(layers=(resolved.layer,), env=env)


def layer_name(environment_hash: str, base: Base) -> str:
    """The snapshot layer of an environment with this content hash (Harbor's
    ``environment_id``: the task's ``environment/`` files) built over ``base``: an operator
    who maps the FROM image elsewhere gets a new build, not the old base's."""
    doc = {"environment": environment_hash, "base": base.spec(), "env": dict(base.env)}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return f"harbor-{digest[:32]}"


async def find_layer(client: AsyncClient, name: str, version: str) -> str | None:
    """The ref of layer ``name@version`` as the node (or apiserver) lists it, or None. Through
    an apiserver a project's layers are listed under its scope tag (``<tag>-<name>``, what
    ``pack_diff`` there made of ``name``), and only those the caller reaches."""
    try:
        layers = await client.layers()
    except DsecError:
        return None
    for info in layers:
        if info.version == version and (info.name == name or info.name.endswith(f"-{name}")):
            return info.ref
    return None


def _as_user(command: str, user: str | None) -> list[str]:
    if user in (None, "", "root", "0"):
        return ["/bin/sh", "-c", command]
    # util-linux's runuser: no PAM password prompt for root, and a login-free shell
    return ["runuser", "-u", str(user), "--", "/bin/sh", "-c", command]


async def _run(
    sb: AsyncSandbox, argv: list[str], *, env: Mapping[str, str], cwd: str, timeout: float
) -> None:
    r = await sb.exec(argv, cwd=cwd, env=dict(env), timeout=timeout)
    if r.exit_code != 0:
        out = (r.stdout + r.stderr).decode(errors="replace").strip().splitlines()[-20:]
        raise LayerBuildError(
            f"build step failed (exit {r.exit_code}): {shlex.join(argv[-1:])}\n  "
            + "\n  ".join(out),
            path=cwd,
        )


def _copies(step: Copy, context: Path, dest_is_dir: bool = False) -> list[tuple[Path, str]]:
    """(local file or directory, remote path) pairs of one COPY, with Docker's rules: a
    directory's contents go into ``dest``; a file goes to ``dest`` itself unless ``dest``
    ends in ``/``, is a directory already (``dest_is_dir``) or several sources are copied."""
    into_dir = step.dest.endswith("/") or len(step.sources) > 1 or dest_is_dir
    out: list[tuple[Path, str]] = []
    root = context.resolve()
    for pattern in step.sources:
        matches = sorted(glob.glob(str(root / pattern))) or []
        if not matches:
            raise LayerBuildError(f"COPY {pattern}: no such file in {root}", path=str(root))
        if len(matches) > 1:
            into_dir = True
        for match in matches:
            src = Path(match).resolve()
            if not src.is_relative_to(root):
                raise LayerBuildError(f"COPY {pattern}: outside the build context", path=match)
            if src.is_dir():
                for dirpath, dirnames, filenames in os.walk(src):
                    rel = Path(dirpath).relative_to(src)
                    target = PurePosixPath(step.dest) / rel.as_posix()
                    out.append((Path(dirpath), str(target)))
                    out.extend((Path(dirpath) / f, str(target / f)) for f in filenames)
                    dirnames.sort()
            else:
                dest = PurePosixPath(step.dest)
                out.append((src, str(dest / src.name) if into_dir else str(dest)))
    return out


#: Past this many files a transfer goes as one tar archive, unpacked by the sandbox's tar
#: (a request per file is fine for a task's few scripts, slow for a COPY of a source tree).
TAR_FROM = 16


async def put_files(sb: AsyncSandbox, pairs: list[tuple[Path, str]], timeout: float) -> str:
    """Copy local files and directories (``pairs``: local path, absolute remote path) into
    the sandbox, making the directories; modes are kept, owners are root's (as Docker's
    COPY makes them). Many files go as one tar when the sandbox has tar. Says how it went:
    ``"<n> files"`` or ``"<n> files as one tar"``."""
    files = [(local, remote) for local, remote in pairs if not local.is_dir()]
    dirs = {remote for local, remote in pairs if local.is_dir()}
    dirs |= {str(PurePosixPath(remote).parent) for _, remote in files}
    if dirs:
        await _run(sb, ["mkdir", "-p", *sorted(dirs)], env={}, cwd="/", timeout=timeout)
    if len(files) > TAR_FROM and (await sb.exec(["sh", "-c", "command -v tar"])).exit_code == 0:
        with tempfile.TemporaryDirectory(prefix="dsec-harbor-") as tmp:
            archive = Path(tmp) / "files.tar"

            def root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                return info

            with tarfile.open(archive, "w") as tar:
                for local, remote in files:
                    tar.add(local, arcname=remote.lstrip("/"), filter=root_owned)
            remote_tar = f"/tmp/.dsec-harbor-{uuid.uuid4().hex}.tar"
            await sb.upload(archive, remote_tar)
            unpack = f"tar -xpf {remote_tar} -C / && rm -f {remote_tar}"
            await _run(sb, ["sh", "-c", unpack], env={}, cwd="/", timeout=timeout)
        return f"{len(files)} files as one tar"
    for local, remote in files:
        await sb.upload(local, remote)
    return f"{len(files)} files"


async def _copy(sb: AsyncSandbox, step: Copy, context: Path, timeout: float) -> str:
    is_dir = await sb.exec(["test", "-d", step.dest], timeout=timeout)
    pairs = _copies(step, context, dest_is_dir=is_dir.exit_code == 0)
    how = await put_files(sb, pairs, timeout)
    if step.chown:
        targets = sorted({remote for _, remote in pairs})
        await _run(sb, ["chown", step.chown, *targets], env={}, cwd="/", timeout=timeout)
    return how


async def build_layer(
    client: AsyncClient,
    recipe: Recipe,
    context: Path,
    *,
    name: str,
    version: str = RECIPE_VERSION,
    base: Base,
    timeout: float,
    network: str = "none",
    log: Log = lambda _m: None,
) -> str:
    """Replay ``recipe`` in a new sandbox of ``base`` (in dsec network mode ``network``:
    ``none`` by default, ``internet`` for RUN steps that download) and pack what it wrote as
    snapshot layer ``name@version``; returns that ref. The sandbox is killed on every path.
    ``LayerBuildError`` with the failing step's output if one fails."""
    sb = await client.create(**base.spec(), network=network, ttl=timeout + 60, memory="2G")
    try:
        made: set[str] = set()
        for step, env, workdir, user in recipe.steps:
            if workdir not in made:  # docker makes a WORKDIR that does not exist
                await _run(sb, ["mkdir", "-p", workdir], env={}, cwd="/", timeout=timeout)
                made.add(workdir)
            if isinstance(step, Run):
                log(f"RUN {step.command}")
                if isinstance(step.command, str):
                    argv = _as_user(step.command, user)
                else:
                    argv = _as_user(shlex.join(step.command), user)
                await _run(sb, argv, env={**base.env, **env}, cwd=workdir, timeout=timeout)
            else:
                how = await _copy(sb, step, context, timeout)
                log(f"COPY {' '.join(step.sources)} {step.dest}: {how}")
        await _run(sb, ["mkdir", "-p", recipe.workdir], env={}, cwd="/", timeout=timeout)
        info = await sb.pack_diff(name=name, version=version, scrub=False)
        log(f"packed {info.ref} ({info.size} bytes)")
        return info.ref
    finally:
        with contextlib.suppress(DsecError):
            await sb.kill()


__all__ = [
    "RECIPE_VERSION",
    "Base",
    "build_layer",
    "find_layer",
    "layer_name",
    "lookup_base",
    "parse_images",
    "put_files",
    "resolve_base",
]
