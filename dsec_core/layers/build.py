"""Building read-only EROFS layers from a directory, a tar archive or a docker image.

Images are made with ``mkfs.erofs -zlz4hc`` and a fixed UUID, and the superblock's build time
is zeroed afterwards, so the same tree always gives the same bytes and thus the same digest.
All scratch work happens in the store's ``tmp/`` and is removed whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

from ..errors import LayerBuildError, ToolError
from ..linux.erofs import mkfs_erofs
from ..records import LayerInfo, LayerRef
from .store import LayerStore, Progress, check_kind

__all__ = [
    "build_layer",
    "build_tree",
    "export_docker_image",
    "extract_tar",
    "extraction_filter",
    "make_image",
]

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def _noop(stage: str, fraction: float | None) -> None:
    pass


def make_image(
    tree: Path,
    image: Path,
    *,
    all_root: bool,
    timestamp: int | None = None,
    progress: Progress | None = None,
) -> Path:
    """Make a reproducible EROFS image of ``tree`` (``linux.erofs.mkfs_erofs``), reporting
    its ``mkfs`` stage to ``progress``."""
    progress = progress or _noop
    progress("mkfs", None)
    mkfs_erofs(tree, image, all_root=all_root, timestamp=timestamp)
    progress("mkfs", 1.0)
    return image


# --- tar and docker sources ----------------------------------------------------------------


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def extraction_filter(root: str) -> Callable[[tarfile.TarInfo, str], tarfile.TarInfo]:
    """A tarfile extraction filter: keep owners and modes, refuse anything that leaves ``root``.

    It runs just before each member is written, so symlinks made by earlier members count:
    ``link -> /etc`` followed by ``link/passwd`` is refused. Symlinks themselves may point
    anywhere; they are resolved inside the sandbox, not here.
    """

    def check(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
        name = member.name
        if name.startswith("/") or os.path.isabs(name):
            raise LayerBuildError(f"tar member {name!r} has an absolute path", member=name)
        target = os.path.join(root, name)
        if member.issym() or member.islnk():
            # A link replaces what is there; only the directory it lands in must be ours.
            real = os.path.join(os.path.realpath(os.path.dirname(target)), os.path.basename(target))
        else:
            real = os.path.realpath(target)
        if not _inside(real, root) or not _inside(os.path.normpath(target), root):
            raise LayerBuildError(
                f"tar member {name!r} would be written outside the layer", member=name
            )
        if member.islnk():
            if os.path.isabs(member.linkname):
                raise LayerBuildError(
                    f"tar hard link {name!r} -> {member.linkname!r} is absolute", member=name
                )
            if not _inside(os.path.realpath(os.path.join(root, member.linkname)), root):
                raise LayerBuildError(
                    f"tar hard link {name!r} -> {member.linkname!r} leaves the layer", member=name
                )
        if member.ischr() or member.isblk():
            top = os.path.normpath(name).split("/", 1)[0]
            if top != "dev":
                raise LayerBuildError(
                    f"tar member {name!r} is a device node outside /dev", member=name
                )
        return member

    return check


def extract_tar(archive: Path, dest: Path, progress: Progress | None = None) -> Path:
    """Unpack a .tar/.tar.gz into ``dest`` safely, keeping numeric owners and modes."""
    progress = progress or _noop
    dest.mkdir(parents=True, exist_ok=True)
    dest.chmod(0o755)  # the image's root directory, unless the archive has a "." entry
    root = os.path.realpath(dest)
    check = extraction_filter(root)
    size = max(archive.stat().st_size, 1)
    try:
        with open(archive, "rb") as raw, tarfile.open(fileobj=raw, mode="r:*") as tar:

            def filtered(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo:
                progress("extract", min(raw.tell() / size, 1.0))
                return check(member, path)

            tar.extractall(root, numeric_owner=True, filter=filtered)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise LayerBuildError(f"cannot unpack {archive}: {e}", path=str(archive)) from e
    progress("extract", 1.0)
    return dest


def export_docker_image(image: str, output: Path, progress: Progress | None = None) -> Path:
    """Write the filesystem of docker ``image`` to a tar via a created (never started) container.

    The container is removed whatever happens.
    """
    # Imported here: python-on-whales takes a third of a second to import, and only docker
    # sources need it.
    from python_on_whales import DockerClient
    from python_on_whales.exceptions import DockerException

    progress = progress or _noop
    docker = DockerClient()
    container = None
    try:
        progress("docker export", None)
        # The command is never run; it only lets images without CMD be created.
        container = docker.container.create(image, ["/bin/true"])
        docker.container.export(container, output)
    except DockerException as e:
        raise ToolError(
            f"exporting docker image {image!r} failed",
            command=list(e.docker_command or []),
            exit_code=e.return_code,
            stdout=e.stdout or "",
            stderr=e.stderr or "",
        ) from e
    finally:
        if container is not None:
            with contextlib.suppress(DockerException):
                docker.container.remove(container, force=True, volumes=True)
    progress("docker export", 1.0)
    return output


# --- layers --------------------------------------------------------------------------------


def build_tree(
    tree: Path,
    *,
    name: str,
    version: str | None,
    kind: str,
    store: LayerStore,
    all_root: bool,
    timestamp: int | None = None,
    source: str = "",
    progress: Progress | None = None,
    recipe_digest: str = "",
) -> LayerInfo:
    """Make an image of a prepared directory tree and add it to ``store`` (``recipe_digest``:
    the fingerprint of the catalog recipe it comes from, kept in its ``LayerInfo``)."""
    with store.scratch("image-") as scratch:
        image = make_image(
            tree, scratch / "layer.erofs", all_root=all_root, timestamp=timestamp, progress=progress
        )
        return store.add(
            image,
            name=name,
            version=version,
            kind=kind,
            source=source,
            progress=progress,
            recipe_digest=recipe_digest,
        )


def _source_kind(source: str | Path) -> str:
    text = str(source)
    if text.startswith("docker:"):
        return "docker"
    path = Path(text)
    if path.is_dir():
        return "dir"
    if path.is_file() and text.endswith(_TAR_SUFFIXES):
        return "tar"
    if not path.exists():
        raise LayerBuildError(
            f"layer source {text!r} does not exist (expected a directory, "
            "a .tar/.tar.gz/.tgz file or docker:IMAGE)",
            source=text,
        )
    raise LayerBuildError(
        f"layer source {text!r} is neither a directory nor a .tar/.tar.gz/.tgz "
        "file (or docker:IMAGE)",
        source=text,
    )


def build_layer(
    source: str | Path,
    *,
    name: str,
    version: str | None = None,
    kind: str,
    store: LayerStore,
    progress: Progress | None = None,
    all_root: bool | None = None,
) -> LayerInfo:
    """Build an EROFS layer from a directory, a .tar/.tar.gz/.tgz file or ``docker:IMAGE``.

    Directory sources are owned by root inside the sandbox unless ``all_root=False``; tar and
    docker sources keep their owners. ``version`` defaults to the first 12 hex digits of the
    image digest. ``progress(stage, fraction)`` is called as the build goes (fraction None:
    unknown).
    """
    check_kind(kind)
    LayerRef.parse(f"{name}@{version}" if version else name)
    what = _source_kind(source)
    text = str(source)
    if what == "dir":
        tree = Path(source).resolve()
        return build_tree(
            tree,
            name=name,
            version=version,
            kind=kind,
            store=store,
            all_root=True if all_root is None else all_root,
            source=text,
            progress=progress,
        )
    with store.scratch() as scratch:
        if what == "docker":
            archive = export_docker_image(
                text.removeprefix("docker:"), scratch / "image.tar", progress
            )
        else:
            archive = Path(source).resolve()
        tree = extract_tar(archive, scratch / "rootfs", progress)
        if what == "docker":
            archive.unlink()  # halve the scratch space needed
        return build_tree(
            tree,
            name=name,
            version=version,
            kind=kind,
            store=store,
            all_root=bool(all_root),
            source=text,
            progress=progress,
        )
