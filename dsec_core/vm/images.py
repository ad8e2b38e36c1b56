"""Layer images as a VM guest takes them: for virtio-pmem with DAX, an uncompressed copy padded
to whole 2 MiB pages, made once per layer and node and shared by every guest.

DAX maps a file's blocks straight into the guest, so every guest reading a layer uses the
host's one copy in its page cache instead of a copy of its own; that holds only for blocks
stored as they are read, so the node's (lz4hc-compressed) layer images are unpacked into a
plain EROFS image first. An on-demand layer (metadata image plus a data blob) becomes one
self-contained image the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..backend import LayerImage
from ..linux.mounts import mount_erofs_file, unmount
from ..linux.tools import run_tool
from .qemu import PMEM_ALIGN

__all__ = ["pmem_image"]


def _name(digest: str) -> str:
    return digest.replace(":", "-")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def pmem_image(cache_dir: Path, layer: LayerImage) -> Path:
    """``cache_dir/<digest>.pmem``: the layer's files in an uncompressed EROFS image (owners,
    modes, xattrs, whiteouts and links as in the layer; its UUID derived from the digest), its
    size rounded up to whole ``PMEM_ALIGN``. Made if missing; concurrent callers wait for one
    maker. ``ToolError`` if ``mkfs.erofs`` fails."""
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = cache_dir / f"{_name(layer.digest)}.pmem"
    if out.exists():
        return out
    with _locked(cache_dir / f".{_name(layer.digest)}.lock"):
        if out.exists():
            return out
        work = Path(tempfile.mkdtemp(prefix=".pmem-", dir=cache_dir))
        try:
            mnt, image = work / "mnt", work / "image"
            mnt.mkdir()
            mount_erofs_file(layer.image, mnt, None, device=layer.device)
            try:
                volume = uuid.uuid5(uuid.NAMESPACE_URL, f"dsec-layer:{layer.digest}")
                run_tool(
                    ["mkfs.erofs", "--quiet", "-U", str(volume), image, mnt],
                    f"unpacking layer {layer.ref} for virtio-pmem",
                )
            finally:
                unmount(mnt)
            size = image.stat().st_size
            os.truncate(image, -(-size // PMEM_ALIGN) * PMEM_ALIGN)
            os.chmod(image, 0o444)
            os.rename(image, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out
