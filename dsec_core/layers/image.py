"""Layers to and from docker/OCI images: export a stack of layers as an image archive that
``docker load`` accepts, and import a docker image, a ``docker save`` archive or a Dockerfile
build as a base layer.

Export reads each layer's EROFS image through a read-only mount (unmounted whatever happens) and
streams it into one tar per layer: overlay whiteouts (0:0 character devices, or files carrying
``trusted.overlay.whiteout``) become ``.wh.NAME`` entries and opaque directories
(``trusted.overlay.opaque=y``) get a ``.wh..wh..opq`` entry, as OCI and docker write them;
owners, modes, mtimes, symlinks, hard links, device nodes and xattrs (other than overlay's own)
are kept. The archive has both layouts ``docker save`` writes since docker 25: ``manifest.json``
(what docker 20.10 loads) and an OCI image layout (``oci-layout``, ``index.json``,
``blobs/sha256/``) over the same blobs, so other OCI tools read it too.

Import goes through the docker daemon (python-on-whales): the image's filesystem is flattened by
``build.export_docker_image`` and made into a base layer with ``build.build_tree``. Every image,
container and scratch file an import makes is removed on every path out. An OCI image layout
without docker's ``manifest.json`` (docker 20.10 cannot load one) is unpacked here instead,
layer by layer (``flatten_oci_layout``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import re
import shutil
import stat
import tarfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import InvalidSpec, LayerBuildError, ToolError, UnknownImage
from ..linux.mounts import MS_RDONLY, mount, unmount
from ..records import LayerInfo, LayerRef
from .build import build_tree, export_docker_image, extract_tar, extraction_filter
from .store import LayerStore, Progress, check_kind

__all__ = [
    "DEFAULT_PATH",
    "ImageReference",
    "export_image",
    "flatten_oci_layout",
    "import_dockerfile",
    "import_image",
    "layer_tar",
    "local_docker_image",
]

#: The PATH an exported image gets when ``env`` sets none: the one dsec sandboxes run with.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Overlay's own xattrs: they mean something only to overlayfs, and become whiteouts and
#: opaque markers in the layer tar instead.
_OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
_CHUNK = 1 << 20
#: What ``import_image`` takes for an archive's file name rather than an image name
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


# A docker image reference: [host[:port]/]path[:tag][@sha256:hex], path components lowercase.
_REF_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"(?:(?P<host>[A-Za-z0-9.-]+(?::[0-9]+)?|localhost)/)??"
    rf"(?P<path>{_REF_COMPONENT}(?:/{_REF_COMPONENT})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
)


@dataclass(frozen=True)
class ImageReference:
    """A docker image reference as a Dockerfile's ``FROM`` names it, split: ``host`` (None for
    docker's default registry), ``path`` (``library/python`` is written ``python``), ``tag``
    (None when only a digest, or nothing, is given: ``latest`` then) and ``digest``."""

    host: str | None
    path: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> ImageReference:
        """``InvalidSpec`` for text that is no image reference (build args such as
        ``$BASE`` are not expanded: they are not one)."""
        m = _REFERENCE.fullmatch(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise InvalidSpec(f"{text!r} is not a docker image reference", image=text)
        host = m["host"]
        path = m["path"]
        if host is None and "/" in path:
            first, _, rest = path.partition("/")
            if "." in first or first == "localhost":
                host, path = first, rest
        return cls(host, path, m["tag"], m["digest"])

    @property
    def version(self) -> str:
        """The tag, else the digest, else ``latest``: what a registry is asked for."""
        return self.tag or self.digest or "latest"

    def __str__(self) -> str:
        text = f"{self.host}/{self.path}" if self.host else self.path
        if self.tag:
            text += f":{self.tag}"
        return text + (f"@{self.digest}" if self.digest else "")


def _noop(stage: str, fraction: float | None) -> None:
    pass


# --- layer tars ------------------------------------------------------------------------------


class _DigestWriter:
    """A write-only file that hashes (sha256) and counts what passes through it."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.hash.update(data)
        self.size += len(data)
        return len(data)

    @property
    def digest(self) -> str:
        return f"sha256:{self.hash.hexdigest()}"


def _xattrs(path: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:  # a filesystem without xattrs
        return {}
    out = {}
    for name in sorted(names):
        with contextlib.suppress(OSError):  # removed or unreadable meanwhile: leave it out
            out[name] = os.getxattr(path, name, follow_symlinks=False)
    return out


def _is_whiteout(st: os.stat_result, xattrs: Mapping[str, bytes]) -> bool:
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return True
    return stat.S_ISREG(st.st_mode) and any(
        name.endswith("overlay.whiteout") for name in xattrs
    )  # an "xwhiteout" (kernel 6.7+)


def _is_opaque(xattrs: Mapping[str, bytes]) -> bool:
    return any(
        name in ("trusted.overlay.opaque", "user.overlay.opaque") and value == b"y"
        for name, value in xattrs.items()
    )


def _walk(root: str) -> Iterator[tuple[str, str, os.stat_result]]:
    """Every entry below ``root`` as (relative path, full path, lstat), parents before
    children, names sorted, so the same tree always gives the same tar. (A stack rather than
    recursion: a layer's depth is not bounded by Python's recursion limit.)"""

    def listing(rel: str) -> Iterator[str]:
        base = os.path.join(root, rel) if rel else root
        return iter([f"{rel}/{name}" if rel else name for name in sorted(os.listdir(base))])

    stack = [listing("")]
    while stack:
        arc = next(stack[-1], None)
        if arc is None:
            stack.pop()
            continue
        full = os.path.join(root, arc)
        st = os.lstat(full)
        yield arc, full, st
        if stat.S_ISDIR(st.st_mode):
            stack.append(listing(arc))


def _marker(name: str, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = 0o600
    info.mtime = int(mtime)
    info.uname = info.gname = ""
    return info


def layer_tar(root: Path, out: IO[bytes], progress: Progress | None = None) -> tuple[str, int]:
    """Write the directory tree ``root`` (an overlay layer) to ``out`` as an OCI layer tar,
    streaming (no file is held in memory); returns its ``sha256:`` digest and size.

    Whiteouts and opaque directories are turned into OCI ``.wh.`` entries; ownership is kept
    numerically (no user or group names); xattrs go in PAX ``SCHILY.xattr.`` records, which
    docker applies on load. ``progress("tar", fraction)`` follows the bytes of file data.
    """
    progress = progress or _noop
    top = os.fspath(root)
    total = sum(st.st_size for _, _, st in _walk(top) if stat.S_ISREG(st.st_mode)) or 1
    done = 0
    writer = _DigestWriter(out)
    progress("tar", 0.0)
    # "w|": a stream, written through as it goes; PAX for long names and xattrs
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for arc, full, st in _walk(top):
            xattrs = _xattrs(full)
            parent, name = os.path.split(arc)
            if _is_whiteout(st, xattrs):
                tar.addfile(_marker(os.path.join(parent, _WHITEOUT + name), st.st_mtime))
                continue
            info = tar.gettarinfo(full, arcname=arc)
            if info is None:  # a socket: nothing a layer can carry
                continue
            info.uname = info.gname = ""
            for key, value in xattrs.items():
                if not key.startswith(_OVERLAY_XATTRS):
                    info.pax_headers[f"SCHILY.xattr.{key}"] = value.decode(
                        "utf-8", "surrogateescape"
                    )
            if info.isreg():
                with open(full, "rb") as f:
                    tar.addfile(info, f)
                done += info.size
                progress("tar", min(done / total, 1.0))
            else:
                tar.addfile(info)
            if info.isdir() and _is_opaque(xattrs):
                tar.addfile(_marker(f"{arc}/{_OPAQUE}", st.st_mtime))
    progress("tar", 1.0)
    return writer.digest, writer.size


@contextlib.contextmanager
def _mounted(store: LayerStore, info: LayerInfo, scratch: Path) -> Iterator[Path]:
    """The layer's EROFS image mounted read-only under ``scratch``; unmounted on exit."""
    target = scratch / f"mnt-{info.digest[7:19]}"
    target.mkdir()
    mount(os.fspath(store.image_path(info)), target, "erofs", MS_RDONLY)
    try:
        yield target
    finally:
        unmount(target)
        target.rmdir()


# --- export ----------------------------------------------------------------------------------


def _architecture() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(machine, machine)


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _check_tag(tag: str) -> str:
    # docker's reference grammar, loosely: lowercase path components, an optional :tag
    if not re.fullmatch(
        r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
        r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?",
        tag,
    ):
        raise InvalidSpec(
            f"image tag {tag!r} is not a docker reference (lowercase NAME[:TAG])", field="tag"
        )
    return tag if ":" in tag.rsplit("/", 1)[-1] else f"{tag}:latest"


def _json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = int(mtime)
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    info.mtime = int(mtime)
    tar.addfile(info)


def export_image(
    store: LayerStore,
    refs_top_first: Sequence[str],
    output: Path | str,
    *,
    tag: str,
    env: Sequence[str] | Mapping[str, str] = (),
    workdir: str = "/",
    cmd: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write the layers ``refs_top_first`` (a sandbox's stack: top first, base last) as an image
    archive at ``output`` that ``docker load`` takes, tagged ``tag``, and return its path.

    One layer tar per dsec layer, bottom first as images list them; ``env`` (``KEY=VALUE``
    strings or a mapping; ``PATH`` defaults to ``DEFAULT_PATH``), ``workdir`` and ``cmd`` go to
    the image config. Layer tars are streamed through the store's scratch space, one at a time;
    the archive appears at ``output`` only when complete (written beside it, then renamed).
    ``UnknownLayer`` for a ref not in the store, ``InvalidSpec`` for a bad tag or no refs.
    """
    progress = progress or _noop
    if not refs_top_first:
        raise InvalidSpec("an image needs at least one layer", field="refs")
    full_tag = _check_tag(tag)
    infos = [store.resolve(LayerRef.parse(str(ref))) for ref in refs_top_first]
    bottom_first = list(reversed(infos))
    env_list = [f"{k}={v}" for k, v in env.items()] if isinstance(env, Mapping) else list(env)
    for item in env_list:
        if "=" not in item or not item.split("=", 1)[0]:
            raise InvalidSpec(f"env entry {item!r} is not KEY=VALUE", field="env")
    if not any(item.startswith("PATH=") for item in env_list):
        env_list.insert(0, f"PATH={DEFAULT_PATH}")
    if not workdir.startswith("/"):
        raise InvalidSpec(f"workdir {workdir!r} must be absolute", field="workdir")
    output = Path(output)
    if not output.parent.is_dir() or output.is_dir():
        raise InvalidSpec(
            f"cannot write {output}: {output.parent} is not a directory"
            if not output.parent.is_dir()
            else f"cannot write {output}: it is a directory",
            field="output",
        )
    created = max(i.created for i in infos)
    partial = output.with_name(f".{output.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with (
            store.scratch("export-") as scratch,
            tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as archive,
        ):
            _add_dir(archive, "blobs", created)
            _add_dir(archive, "blobs/sha256", created)
            diff_ids: list[str] = []
            written: set[str] = set()
            layer_descriptors = []
            for n, info in enumerate(bottom_first, 1):
                stage = f"{info.ref}: layer {n}/{len(infos)}"  # one progress bar per layer

                def report(_stage: str, fraction: float | None, stage: str = stage) -> None:
                    progress(stage, fraction)

                body = scratch / "layer.tar"
                with _mounted(store, info, scratch) as root, open(body, "wb") as f:
                    digest, size = layer_tar(root, f, report)
                diff_ids.append(digest)
                layer_descriptors.append(
                    {
                        "mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": digest,
                        "size": size,
                    }
                )
                if digest not in written:  # the same content twice is one blob
                    member = archive.gettarinfo(body, arcname=f"blobs/sha256/{digest[7:]}")
                    member.mtime, member.mode = int(created), 0o644
                    member.uid = member.gid = 0
                    member.uname = member.gname = ""
                    with open(body, "rb") as blob:
                        archive.addfile(member, blob)
                    written.add(digest)
                body.unlink()
            progress("archive", None)
            container_config: dict[str, Any] = {"Env": env_list, "WorkingDir": workdir}
            if cmd is not None:
                container_config["Cmd"] = list(cmd)
            container_config["Labels"] = {
                "org.dsec.layers": ",".join(i.ref for i in infos),
            }
            config = _json_bytes(
                {
                    "architecture": _architecture(),
                    "os": "linux",
                    "created": _rfc3339(created),
                    "config": container_config,
                    "rootfs": {"type": "layers", "diff_ids": diff_ids},
                    "history": [
                        {
                            "created": _rfc3339(i.created),
                            "created_by": f"dsec layer {i.ref} ({i.kind})",
                            "comment": i.source,
                        }
                        for i in bottom_first
                    ],
                }
            )
            config_hex = hashlib.sha256(config).hexdigest()
            _add_bytes(archive, f"blobs/sha256/{config_hex}", config, created)
            manifest = _json_bytes(
                {
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {
                        "mediaType": "application/vnd.oci.image.config.v1+json",
                        "digest": f"sha256:{config_hex}",
                        "size": len(config),
                    },
                    "layers": layer_descriptors,
                }
            )
            manifest_hex = hashlib.sha256(manifest).hexdigest()
            _add_bytes(archive, f"blobs/sha256/{manifest_hex}", manifest, created)
            index = {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.index.v1+json",
                "manifests": [
                    {
                        "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": f"sha256:{manifest_hex}",
                        "size": len(manifest),
                        "annotations": {
                            "io.containerd.image.name": f"docker.io/library/{full_tag}"
                            if "/" not in full_tag
                            else full_tag,
                            "org.opencontainers.image.ref.name": full_tag.rsplit(":", 1)[1],
                        },
                    }
                ],
            }
            _add_bytes(archive, "index.json", _json_bytes(index), created)
            _add_bytes(archive, "oci-layout", _json_bytes({"imageLayoutVersion": "1.0.0"}), created)
            docker_manifest = [
                {
                    "Config": f"blobs/sha256/{config_hex}",
                    "RepoTags": [full_tag],
                    "Layers": [f"blobs/sha256/{d[7:]}" for d in diff_ids],
                }
            ]
            _add_bytes(archive, "manifest.json", _json_bytes(docker_manifest), created)
        partial.rename(output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    progress("archive", 1.0)
    return output


# --- import ----------------------------------------------------------------------------------


def _docker_error(what: str, e: Any) -> ToolError:
    return ToolError(
        what,
        command=[str(c) for c in (e.docker_command or [])],
        exit_code=e.return_code,
        stdout=e.stdout or "",
        stderr=e.stderr or "",
    )


def _archive_images(archive: Path) -> tuple[list[str], str]:
    """The RepoTags and image id (sha256 of its config) of a ``docker save`` archive."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            member = tar.extractfile("manifest.json")
            if member is None:
                raise KeyError("manifest.json")
            manifest = json.loads(member.read())
            if not isinstance(manifest, list) or len(manifest) != 1:
                raise LayerBuildError(
                    f"{archive} holds {len(manifest) if isinstance(manifest, list) else 0} "
                    "images; import takes an archive of exactly one",
                    path=os.fspath(archive),
                )
            config = tar.extractfile(manifest[0]["Config"])
            if config is None:
                raise KeyError(manifest[0]["Config"])
            h = hashlib.sha256()
            for chunk in iter(lambda: config.read(_CHUNK), b""):
                h.update(chunk)
            return list(manifest[0].get("RepoTags") or []), f"sha256:{h.hexdigest()}"
    except (tarfile.TarError, OSError, KeyError, ValueError, TypeError) as e:
        raise LayerBuildError(
            f"{archive} is not a docker image archive (docker save): {e}", path=os.fspath(archive)
        ) from e


@contextlib.contextmanager
def _loaded_archive(docker: Any, archive: Path) -> Iterator[str]:
    """``docker load`` the archive and yield its image id; on exit, remove what the load
    added (the image if it was not there before, else only tags it did not have)."""
    from python_on_whales.exceptions import DockerException

    tags, image_id = _archive_images(archive)
    try:
        had_image = docker.image.exists(image_id)
        had_tags = {t for t in tags if docker.image.exists(t)}
        docker.image.load(archive, quiet=True)
    except DockerException as e:
        raise _docker_error(f"docker load of {archive} failed", e) from e
    try:
        yield image_id
    finally:
        with contextlib.suppress(DockerException):
            if not had_image:
                docker.image.remove(image_id, force=True)
            else:
                for t in tags:
                    if t not in had_tags:
                        docker.image.remove(t)


def _build_from_image(
    store: LayerStore,
    image: str,
    *,
    name: str,
    version: str | None,
    kind: str,
    source: str,
    progress: Progress | None,
) -> LayerInfo:
    with store.scratch("import-") as scratch:
        archive = export_docker_image(image, scratch / "image.tar", progress)
        tree = extract_tar(archive, scratch / "rootfs", progress)
        archive.unlink()  # halve the scratch space needed
        return build_tree(
            tree,
            name=name,
            version=version,
            kind=kind,
            store=store,
            all_root=False,
            source=source,
            progress=progress,
        )


# --- OCI image layouts (no docker needed) ------------------------------------------------------

_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)


class _Layout:
    """Blobs of an OCI image layout: a directory, or a tar archive of one."""

    def __init__(self, path: Path, tar: tarfile.TarFile | None) -> None:
        self.path, self.tar = path, tar

    def open(self, name: str) -> IO[bytes]:
        if self.tar is None:
            return open(self.path / name, "rb")
        member = self.tar.extractfile(name)
        if member is None:
            raise KeyError(name)
        return member

    def json(self, name: str) -> Any:
        with self.open(name) as f:
            return json.loads(f.read())

    def blob(self, digest: str) -> str:
        algo, _, hexd = str(digest).partition(":")
        if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
            raise ValueError(f"unsupported blob digest {digest!r}")
        return f"blobs/sha256/{hexd}"


def _pick_manifest(layout: _Layout) -> dict[str, Any]:
    """The image manifest the layout's index names: its only one, else the one for this
    machine's linux platform."""
    desc = layout.json("index.json")
    while True:
        manifests = desc.get("manifests") or []
        if not manifests:
            raise ValueError("the index lists no manifests")
        if len(manifests) > 1:
            here = [
                m
                for m in manifests
                if (m.get("platform") or {}).get("architecture") == _architecture()
                and (m.get("platform") or {}).get("os", "linux") == "linux"
            ]
            if len(here) != 1:
                raise ValueError(
                    f"the index lists {len(manifests)} images and not exactly one for "
                    f"linux/{_architecture()}"
                )
            manifests = here
        chosen = manifests[0]
        desc = layout.json(layout.blob(chosen["digest"]))
        if chosen.get("mediaType") not in _INDEX_TYPES and "layers" in desc:
            return dict(desc)


def _safe_target(root: str, name: str) -> str:
    """Where tar entry ``name`` lands under ``root``; ``LayerBuildError`` if it would leave it
    (through ``..``, an absolute path or a symlinked parent)."""
    rel = os.path.normpath(name)
    if name.startswith("/") or rel in (".", "..") or rel.startswith("../"):
        raise LayerBuildError(f"layer entry {name!r} leaves the image root", member=name)
    parent = os.path.realpath(os.path.join(root, os.path.dirname(rel)))
    if parent != root and not parent.startswith(root + "/"):
        raise LayerBuildError(f"layer entry {name!r} leaves the image root", member=name)
    return os.path.join(parent, os.path.basename(rel))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _apply_layer(tar: tarfile.TarFile, root: str) -> None:
    """Apply one OCI layer tar (a stream) to the tree at ``root``: ``.wh.NAME`` deletes NAME,
    ``.wh..wh..opq`` empties its directory of what lower layers put there, anything else
    replaces what was at its path."""
    check = extraction_filter(root)
    ours: set[str] = set()  # what this layer wrote: an opaque marker keeps it
    for member in tar:
        if os.path.normpath(member.name) == ".":  # the root itself ("./"): keep ours
            continue
        target = _safe_target(root, member.name)
        parent, base = os.path.split(target)
        if base == _OPAQUE:
            for name in os.listdir(parent):
                if os.path.join(parent, name) not in ours:
                    _remove(os.path.join(parent, name))
            continue
        if base.startswith(_WHITEOUT):
            gone = base[len(_WHITEOUT) :]
            if gone in ("", ".", ".."):  # ".wh..." would delete the directory above
                raise LayerBuildError(
                    f"layer entry {member.name!r} leaves the image root", member=member.name
                )
            _remove(os.path.join(parent, gone))
            continue
        if not (member.isdir() and os.path.isdir(target) and not os.path.islink(target)):
            _remove(target)  # a file over a directory, a directory over a symlink...
        member.name = os.path.relpath(target, root)
        if member.islnk():
            member.linkname = os.path.relpath(_safe_target(root, member.linkname), root)
        tar.extract(member, root, numeric_owner=True, filter=check)
        ours.add(target)


def flatten_oci_layout(layout_path: Path, dest: Path, progress: Progress | None = None) -> Path:
    """Unpack the image of an OCI image layout (a directory, or a tar of one, as ``docker
    save`` since docker 25 and skopeo write) into ``dest``, its layers applied bottom up with
    their whiteouts. Owners and modes are kept; uncompressed and gzip layers are read.
    ``LayerBuildError`` if it is not a layout, names several images, or a layer is bad."""
    progress = progress or _noop
    dest.mkdir(parents=True, exist_ok=True)
    dest.chmod(0o755)
    root = os.path.realpath(dest)
    try:
        with contextlib.ExitStack() as stack:
            if layout_path.is_dir():
                layout = _Layout(layout_path, None)
            else:
                layout = _Layout(layout_path, stack.enter_context(tarfile.open(layout_path)))
            layers = _pick_manifest(layout)["layers"]
            for n, desc in enumerate(layers, 1):
                progress(f"layer {n}/{len(layers)}", None)
                media = str(desc.get("mediaType", ""))
                if "zstd" in media:
                    raise LayerBuildError(
                        f"layer {desc.get('digest')} is zstd-compressed, which import does not "
                        "read (uncompressed and gzip layers only)",
                        path=os.fspath(layout_path),
                    )
                with (
                    layout.open(layout.blob(desc["digest"])) as blob,
                    tarfile.open(fileobj=blob, mode="r|*") as tar,
                ):
                    _apply_layer(tar, root)
                progress(f"layer {n}/{len(layers)}", 1.0)
    except (tarfile.TarError, OSError, KeyError, ValueError, TypeError, EOFError) as e:
        raise LayerBuildError(
            f"{layout_path} is not a readable OCI image layout: {e}", path=os.fspath(layout_path)
        ) from e
    return dest


def _is_oci_layout(path: Path) -> bool:
    """A layout directory, or a tar with ``index.json`` but no docker ``manifest.json``."""
    if path.is_dir():
        return (path / "oci-layout").is_file()
    try:
        with tarfile.open(path) as tar:
            names = set(tar.getnames())
    except (tarfile.TarError, OSError, EOFError):
        return False
    return "index.json" in names and "manifest.json" not in names


def _client() -> Any:
    from python_on_whales import DockerClient

    if shutil.which("docker") is None:
        raise ToolError(
            "docker is not installed: importing images needs the docker CLI and a daemon",
            command=["docker"],
        )
    return DockerClient()


def local_docker_image(image: str) -> tuple[str, dict[str, Any]] | None:
    """The id (``sha256:...``) and config (``Env``, ``WorkingDir``, ``User``, ``Cmd``,
    ``Entrypoint``) of docker image ``image`` as the local docker has it (``DOCKER_HOST``'s
    daemon; nothing is pulled); None if docker has no such image, or there is no docker CLI
    or daemon to ask (the caller looks elsewhere then)."""
    from python_on_whales.exceptions import DockerException

    if shutil.which("docker") is None:
        return None
    try:
        found = _client().image.inspect(image)
    except DockerException:  # no such image, or no daemon: either way, not here
        return None
    config = found.config
    doc = {
        "Env": list(config.env or []),
        "WorkingDir": config.working_dir or "",
        "User": config.user or "",
        "Cmd": list(config.cmd or []),
        "Entrypoint": list(config.entrypoint or []),
    }
    return str(found.id), doc


def import_image(
    store: LayerStore,
    image_or_archive: str | Path,
    *,
    name: str,
    version: str | None,
    kind: str = "base",
    progress: Progress | None = None,
) -> LayerInfo:
    """Make a layer ``name@version`` of the filesystem of a docker image: an image already in
    the local docker (a name, ``name:tag`` or id; nothing is pulled), a ``docker save``
    archive file (loaded, flattened by docker, and removed again), or an OCI image layout, as
    a directory or a tar without docker's ``manifest.json`` (flattened here by
    ``flatten_oci_layout``, no docker needed). A ``Path`` is an archive or layout, and so is a
    string that names an existing file, starts with ``/``, ``./`` or ``../`` or ends in
    ``.tar``, ``.tar.gz`` or ``.tgz``.

    Owners and modes are kept. The image's env and workdir are not: a layer carries only
    files. ``UnknownImage`` if docker has no such image, ``LayerBuildError`` for an archive
    that is not one, ``ToolError`` if docker fails.
    """
    from python_on_whales.exceptions import DockerException

    check_kind(kind)
    LayerRef.parse(f"{name}@{version}" if version else name)
    text = str(image_or_archive)
    is_archive = (
        isinstance(image_or_archive, Path)
        or Path(text).is_file()
        or (Path(text) / "oci-layout").is_file()
        or text.startswith(("/", "./", "../"))
        or text.endswith(_ARCHIVE_SUFFIXES)
    )
    if is_archive:
        archive = Path(image_or_archive).resolve()
        if not archive.exists():
            raise LayerBuildError(f"image archive {archive} does not exist", path=str(archive))
        if _is_oci_layout(archive):  # docker 20.10 cannot load these: unpack them ourselves
            with store.scratch("import-") as scratch:
                tree = flatten_oci_layout(archive, scratch / "rootfs", progress)
                return build_tree(
                    tree,
                    name=name,
                    version=version,
                    kind=kind,
                    store=store,
                    all_root=False,
                    source=f"oci-layout:{archive}",
                    progress=progress,
                )
        if not archive.is_file():
            raise LayerBuildError(
                f"{archive} is neither an image archive nor an OCI image layout",
                path=str(archive),
            )
        with _loaded_archive(_client(), archive) as image_id:
            return _build_from_image(
                store,
                image_id,
                name=name,
                version=version,
                kind=kind,
                source=f"docker-archive:{archive}",
                progress=progress,
            )
    image = text
    try:
        present = _client().image.exists(image)
    except DockerException as e:
        raise _docker_error(f"docker could not look up image {image!r}", e) from e
    if not present:
        raise UnknownImage(
            f"docker has no image {image!r} locally (import never pulls: "
            "`docker pull` or `docker load` it first)",
            name=image,
        )
    return _build_from_image(
        store,
        image,
        name=name,
        version=version,
        kind=kind,
        source=f"docker:{image}",
        progress=progress,
    )


_STEP_IMAGE = re.compile(r"^ ---> ([0-9a-f]{12,64})\s*$", re.MULTILINE)


def import_dockerfile(
    store: LayerStore,
    context_dir: Path | str,
    *,
    name: str,
    version: str | None,
    dockerfile: Path | str | None = None,
    progress: Progress | None = None,
) -> LayerInfo:
    """Build the Dockerfile in ``context_dir`` (or ``dockerfile``) with docker and make a base
    layer ``name@version`` of the resulting image's filesystem.

    The build never pulls (its FROM image must be local) and runs under a temporary tag;
    the image, its intermediate images and containers are removed afterwards, also when the
    build fails. ``LayerBuildError`` for a missing context or Dockerfile, ``ToolError`` (with
    docker's output) when the build fails.
    """
    from python_on_whales.exceptions import DockerException
    from python_on_whales.utils import run

    progress = progress or _noop
    LayerRef.parse(f"{name}@{version}" if version else name)
    context = Path(context_dir).resolve()
    if not context.is_dir():
        raise LayerBuildError(f"Dockerfile context {context} is not a directory", path=str(context))
    file = Path(dockerfile).resolve() if dockerfile is not None else context / "Dockerfile"
    if not file.is_file():
        raise LayerBuildError(f"no Dockerfile at {file}", path=str(file))
    docker = _client()
    tag = f"dsec-import-{uuid.uuid4().hex[:12]}:build"
    try:
        before = _image_ids(docker)
    except DockerException as e:
        raise _docker_error("cannot ask docker for images (is its daemon running?)", e) from e
    # The classic builder (no buildx here): --force-rm removes the container of a failed step
    # too; the intermediate images it committed are found in its output and removed below.
    command = [
        *docker.client_config.docker_cmd,
        "build",
        "--force-rm",
        "--pull=false",
        "--file",
        str(file),
        "--tag",
        tag,
        str(context),
    ]
    progress("docker build", None)
    output = ""
    built = False
    try:
        try:
            output = str(run(command, env={"DOCKER_BUILDKIT": "0"}))
            built = True
        except DockerException as e:
            output = (e.stdout or "") + (e.stderr or "")
            # the failed step's own output is on stdout; stderr has only docker's verdict
            steps = (e.stdout or "").strip().splitlines()[-15:]
            what = f"docker build of {file} failed"
            if steps:
                what += "\n  last output:\n    " + "\n    ".join(steps)
            raise _docker_error(what, e) from e
        progress("docker build", 1.0)
        return _build_from_image(
            store,
            tag,
            name=name,
            version=version,
            kind="base",
            source=f"dockerfile:{file}",
            progress=progress,
        )
    finally:
        with contextlib.suppress(DockerException):
            if built:
                docker.image.remove(tag, force=True)
            # Untagged intermediates of this build (a failed one keeps them; rmi of the tag
            # prunes only the final image's untagged ancestors)
            ours = [i for i in _STEP_IMAGE.findall(output) if not _known(i, before)]
            for image_id in reversed(ours):
                with contextlib.suppress(DockerException):
                    docker.image.remove(image_id, force=True)


def _image_ids(docker: Any) -> set[str]:
    """Every image id (hex, no prefix) docker has, intermediates included."""
    return {image.id.removeprefix("sha256:") for image in docker.image.list(all=True)}


def _known(short: str, ids: set[str]) -> bool:
    return any(i.startswith(short) for i in ids)
