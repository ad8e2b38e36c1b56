"""The lazy (split) form of a layer: a small EROFS metadata image plus a chunked data blob.

A layer is built and distributed as one monolithic, compressed EROFS image. For on-demand
loading a source also publishes its split form: ``mkfs.erofs --blobdev`` rewrites the image's
tree into a metadata image (inodes, directories, chunk tables; fetched whole and verified) and
a data blob (file contents in ``chunk_size`` chunks; read lazily, each chunk verified against
the ``ChunkIndex``). ``LazyForm`` is the record that ties the three together.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import LayerBuildError, LayerCorrupt, MountError
from ..linux.erofs import mkfs_erofs_split
from ..linux.files import file_digest
from ..linux.mounts import mount_erofs_file, unmount
from .chunks import DEFAULT_CHUNK_SIZE, ChunkIndex, deflate
from .layout import ReadProfile, plan_layout, write_packed

__all__ = ["LAZY_FORM_VERSION", "LazyForm", "compress_split", "pack_split", "split_image"]

LAZY_FORM_VERSION = 2  # 2: the chunk index may carry a layout and compressed chunks
_READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class LazyForm:
    """Where the split form of layer ``layer_digest`` lives: its metadata image (digest, size)
    and its data blob (``index.blob_digest``/``blob_size``, one digest per chunk)."""

    layer_digest: str
    meta_digest: str
    meta_size: int
    index: ChunkIndex

    @property
    def blob_digest(self) -> str:
        return self.index.blob_digest

    @property
    def blob_size(self) -> int:
        """Size of the data blob as a source stores it (compressed, if it is)."""
        return self.index.stored_size

    def to_dict(self) -> dict:
        plain = not (self.index.layout or self.index.compression)
        return {
            "version": 1 if plain else LAZY_FORM_VERSION,
            "layer_digest": self.layer_digest,
            "meta_digest": self.meta_digest,
            "meta_size": self.meta_size,
            "index": json.loads(self.index.to_json()),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> LazyForm:
        """Parse ``to_json``'s output; anything malformed is ``LayerCorrupt``."""
        try:
            d = json.loads(text)
            if d.get("version") not in _READABLE_VERSIONS:
                raise ValueError(f"unknown lazy form version {d.get('version')!r}")
            return cls(
                str(d["layer_digest"]),
                str(d["meta_digest"]),
                int(d["meta_size"]),
                ChunkIndex.from_json(json.dumps(d["index"])),
            )
        except LayerCorrupt:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LayerCorrupt(f"not a lazy layer form: {e}") from e


def split_image(
    image: Path, out_dir: Path, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[LazyForm, Path, Path]:
    """Split monolithic EROFS ``image`` into ``out_dir/meta.erofs`` and ``out_dir/data.blob``.

    The image is mounted read-only (file-backed) and ``mkfs.erofs --blobdev --chunksize``
    rewrites its tree: owners, modes, mtimes and xattrs as in the image, file data
    uncompressed (erofs-utils 1.5 cannot compress chunked files), identical chunks stored once.
    Returns (form, meta path, blob path). Failures raise ``ToolError`` (mkfs.erofs) or
    ``LayerBuildError`` (mounting); nothing is left mounted or half-written.
    """
    image, out_dir = Path(image), Path(out_dir)
    if chunk_size < 4096 or chunk_size & (chunk_size - 1):
        raise LayerBuildError(
            f"chunk size {chunk_size} is not a power of two >= 4096", chunk_size=chunk_size
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    # Everything is made in a private directory and renamed into place at the end, so a
    # failure leaves out_dir as it was.
    work = Path(tempfile.mkdtemp(prefix=".split-", dir=out_dir))
    mnt, meta, blob = work / "mnt", work / "meta.erofs", work / "data.blob"
    try:
        mnt.mkdir()
        try:
            mount_erofs_file(image, mnt, None)
        except MountError as e:
            raise LayerBuildError(f"cannot mount {image} to split it: {e}", path=str(image)) from e
        try:
            # Reproducible like the image itself, so every node that splits one image agrees
            # on the digests.
            mkfs_erofs_split(mnt, meta, blob, chunk_size)
        finally:
            unmount(mnt)
        index = ChunkIndex.build(blob, chunk_size)
        form = LazyForm(
            layer_digest=file_digest(image),
            meta_digest=file_digest(meta),
            meta_size=meta.stat().st_size,
            index=index,
        )
        os.replace(meta, out_dir / meta.name)
        os.replace(blob, out_dir / blob.name)
    finally:
        for leftover in (meta, blob):
            leftover.unlink(missing_ok=True)
        for d in (mnt, work):
            try:
                os.rmdir(d)
            except OSError:
                pass
    return form, out_dir / "meta.erofs", out_dir / "data.blob"


def pack_split(form: LazyForm, blob: Path, profile: ReadProfile) -> tuple[LazyForm, Path]:
    """Rewrite ``blob`` (the data blob of ``form``) in the order ``profile`` read it.

    Returns the form of the packed blob (its chunk index carries the layout; the metadata image
    is unchanged) and the packed blob's path, next to ``blob``. A profile of another layer, or
    recorded on another blob, is ``LayerCorrupt``.
    """
    index = form.index
    if profile.layer_digest != form.layer_digest:
        raise LayerCorrupt(
            f"the read profile is of layer {profile.layer_digest}, not {form.layer_digest}",
            digest=profile.layer_digest,
        )
    if (profile.blob_digest, profile.blob_size) != (index.logical_digest, index.blob_size):
        raise LayerCorrupt(
            f"the read profile of {profile.layer_digest} was recorded on blob "
            f"{profile.blob_digest}, not {index.logical_digest}",
            digest=profile.blob_digest,
        )
    layout, hot = plan_layout(index.blob_size, profile.ranges)
    packed = Path(blob).with_name("packed.blob")
    write_packed(blob, layout, packed)
    stored = ChunkIndex.build(packed, index.chunk_size)
    return (
        LazyForm(
            form.layer_digest,
            form.meta_digest,
            form.meta_size,
            ChunkIndex(
                stored.blob_digest,
                stored.blob_size,
                stored.chunk_size,
                stored.chunks,
                layout,
                index.logical_digest,
                hot=hot,
            ),
        ),
        packed,
    )


def compress_split(form: LazyForm, blob: Path, compression: str = "zstd") -> tuple[LazyForm, Path]:
    """Compress ``blob`` (the data blob of ``form``) chunk by chunk (``zstd`` or ``zlib``).

    Returns the form of the compressed blob (``ChunkIndex.compression``/``stored``; chunk
    digests, layout and the metadata image unchanged) and its path, next to ``blob``. A chunk
    that does not shrink is stored as is.
    """
    index = form.index
    if index.compression:
        return form, Path(blob)
    out = Path(blob).with_name("compressed.blob")
    whole = hashlib.sha256()
    stored = []
    at = 0
    with open(blob, "rb") as src, open(out, "wb") as dst:
        for i in range(len(index.chunks)):
            offset, length = index.chunk_range(i)
            raw = os.pread(src.fileno(), length, offset)
            if len(raw) != length:
                raise LayerCorrupt(f"{blob} is shorter than its chunk index says", path=str(blob))
            packed = deflate(compression, raw)
            piece = packed if len(packed) < length else raw
            dst.write(piece)
            whole.update(piece)
            stored.append((at, len(piece)))
            at += len(piece)
    return (
        LazyForm(
            form.layer_digest,
            form.meta_digest,
            form.meta_size,
            ChunkIndex(
                "sha256:" + whole.hexdigest(),
                index.blob_size,
                index.chunk_size,
                index.chunks,
                index.layout,
                index.logical_digest,
                compression,
                tuple(stored),
                index.hot,
            ),
        ),
        out,
    )
