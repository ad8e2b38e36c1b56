"""The contract for layer sources: where EROFS layers and catalogs are found by name or digest.

A node lists its sources in order (``local`` first by default); a layer is taken from the first
source that has it. Sources are named by URL: ``local``, ``posix:/mnt/3fs/dsec``,
``s3://bucket/prefix?endpoint=http://127.0.0.1:9000``, ``oci://127.0.0.1:5000/dsec?insecure=1``.

Key/value stores (a directory, an S3 bucket) share one layout and most of their code through
``BlobStoreSource``: ``blobs/sha256/<hex>`` (the image), ``refs/<name>/<version>.json`` (its
``LayerInfo``), ``catalogs/<name>.json``, and for on-demand loading ``lazy/<layer hex>.json``
(the layer's ``LazyForm``: its split metadata image and data blob, both also under ``blobs/``).
Every byte fetched is checked against the layer's sha256 before anything can mount it; lazily
read blob ranges are checked chunk by chunk by the node's ``ChunkCache``.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from ..errors import (
    DsecError,
    InvalidSpec,
    LayerBuildError,
    LayerCorrupt,
    LayerExists,
    SourceUnavailable,
    ToolError,
    UnknownEnvironment,
    UnknownImage,
    UnknownLayer,
)
from ..lazy.chunks import DEFAULT_CHUNK_SIZE
from ..lazy.layout import ReadProfile
from ..lazy.split import LazyForm, compress_split, pack_split, split_image
from ..records import LayerInfo, LayerRef, parse_size

__all__ = [
    "FETCH_CHUNK",
    "BlobStoreSource",
    "LayerSource",
    "fetch_verified",
    "publish_chunk_size",
    "publish_compression",
    "split_for_publishing",
]

log = logging.getLogger(__name__)

FETCH_CHUNK = 8 << 20


class LayerSource(abc.ABC):
    """Subclass, set ``scheme``, register from ``dsec_register_layer_sources``.

    ``location`` is the URL without the scheme (for ``s3://b/p?x=1``: ``b/p?x=1``);
    ``cache_dir`` is where fetched images may be kept on this node.

    Errors are part of the contract: a layer or blob that is not there is ``UnknownLayer`` (or
    None from ``resolve``/``lazy_form``), a stored blob that does not match its digest or size
    is ``LayerCorrupt`` (and never reaches ``cache_dir``), and a source that cannot be reached
    or refuses the credentials is ``SourceUnavailable`` with ``source=self.url``, raised within
    a few seconds rather than hanging. ``dsec_core.testing.LayerSourceConformance`` checks all
    of it.
    """

    scheme: ClassVar[str]
    read_only: ClassVar[bool] = False
    #: Images already on this machine: the node mounts ``image_path`` in place and never
    #: fetches them or loads them on demand (the node's own store is such a source).
    local: ClassVar[bool] = False
    # How published data blobs are compressed ("zstd", "zlib" or "" for none); None follows
    # DSEC_CHUNK_COMPRESSION. Set on an instance to override.
    compression: str | None = None

    def __init__(self, location: str = "", *, cache_dir: Path | None = None) -> None:
        self.location = location
        self.cache_dir = Path(cache_dir) if cache_dir else None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.location}" if self.location else self.scheme

    # --- reading --------------------------------------------------------------------------
    @abc.abstractmethod
    def resolve(self, ref: LayerRef) -> LayerInfo | None:
        """The layer ``ref`` names (newest version if unversioned), or None if not here."""

    @abc.abstractmethod
    def list(self) -> list[LayerInfo]:
        """Every layer this source holds."""

    @abc.abstractmethod
    def image_path(self, info: LayerInfo) -> Path:
        """A local path to the layer's EROFS image, fetched and verified first if needed."""

    # --- on-demand loading -----------------------------------------------------------------
    def lazy_form(self, info: LayerInfo) -> LazyForm | None:
        """The split form of ``info`` (metadata image + chunked data blob), or None if this
        source offers the layer only as a whole image (the default)."""
        return None

    def fetch_meta(self, form: LazyForm) -> Path:
        """A local path to ``form``'s metadata image, fetched into ``cache_dir`` and verified."""
        raise UnknownLayer(
            f"{self.url}: no lazy layers here (metadata {form.meta_digest})",
            digest=form.meta_digest,
        )

    def read_blob(self, digest: str, offset: int, length: int) -> bytes:
        """Raw bytes [offset, offset+length) of stored blob ``digest`` (short at its end).

        Not verified here: the node's ``ChunkCache`` checks every chunk against the index.
        A missing blob is ``UnknownLayer``; a source that cannot answer, ``SourceUnavailable``.
        """
        raise UnknownLayer(f"{self.url}: no lazy layers here (blob {digest})", digest=digest)

    def _meta_dest(self, form: LazyForm) -> Path:
        if self.cache_dir is None:
            raise InvalidSpec(f"layer source {self.url} needs a cache directory to fetch into")
        return self.cache_dir / f"{form.meta_digest.split(':', 1)[-1]}.meta.erofs"

    def _fetch_meta_checked(
        self,
        form: LazyForm,
        size: int | None,
        read_range: Callable[[int, int], bytes],
        where: str = "",
    ) -> Path:
        """What every ``fetch_meta`` does once it knows the stored size and how to read it:
        refuse a missing or wrongly sized metadata image, then fetch it verified."""
        dest = self._meta_dest(form)
        if size is None:
            raise UnknownLayer(
                f"{self.url}: metadata image {form.meta_digest} of layer "
                f"{form.layer_digest} is missing{where}",
                digest=form.meta_digest,
            )
        if size != form.meta_size:
            raise LayerCorrupt(
                f"{self.url}: metadata image {form.meta_digest} is {size} bytes,"
                f" its lazy form says {form.meta_size}",
                digest=form.meta_digest,
                source=self.url,
            )
        return fetch_verified(
            read_range, digest=form.meta_digest, size=size, dest=dest, source=self.url
        )

    # --- docker/OCI images ----------------------------------------------------------------
    def find_image(self, image: str) -> str | None:
        """The manifest digest of docker image ``image`` (a reference as a Dockerfile's
        ``FROM`` names it; a registry host in it is left out) for this machine's platform, if
        this source holds such an image; None if not. Sources that hold only dsec layers (the
        default) hold none. Blocking."""
        return None

    def fetch_image(self, image: str, dest: Path | None) -> dict[str, Any]:
        """The config of the image ``find_image`` found (its JSON's ``config`` object:
        ``Env``, ``WorkingDir``, ``User``, ``Cmd``...), and unless ``dest`` is None the image
        itself, written into an OCI image layout at ``dest`` (one manifest, this platform's,
        and its blobs, each verified). ``UnknownImage`` if the source holds no such image.
        Blocking."""
        raise UnknownImage(f"{self.url} holds no docker images ({image!r})", name=image)

    # --- publishing -----------------------------------------------------------------------
    def push(self, info: LayerInfo, image: Path, *, profile: ReadProfile | None = None) -> bool:
        """Publish a layer; False (and nothing done) if this source already has it.

        A source that publishes lazy forms passes ``profile`` (what a workload read of this
        layer, ``lazy.layout``) to ``split_for_publishing`` so the data blob is stored in the
        order it is read. Sources without lazy forms ignore it.
        """
        raise InvalidSpec(f"layer source {self.url} is read-only")

    def put_catalog(self, name: str, document: dict[str, Any]) -> None:
        """Store a catalog document under ``name`` (replacing an older one)."""
        raise InvalidSpec(f"layer source {self.url} is read-only")

    def get_catalog(self, name: str) -> dict[str, Any]:
        """The catalog document stored under ``name``; ``UnknownEnvironment`` if none."""
        raise InvalidSpec(f"layer source {self.url} holds no catalogs")

    def catalogs(self) -> builtins.list[str]:
        """Names of the catalogs this source holds."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url})"


def fetch_verified(
    read_range: Callable[[int, int], bytes],
    *,
    digest: str,
    size: int,
    dest: Path,
    source: str,
    chunk: int = FETCH_CHUNK,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Download ``size`` bytes through ``read_range(offset, length)`` into ``dest``, hashing as
    it goes; ``dest`` only appears (atomically) if the sha256 matches ``digest``.

    A short read, an over-long blob or a digest mismatch raises ``LayerCorrupt``.
    """
    want = digest.split(":", 1)[-1]
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            offset = 0
            while offset < size:
                n = min(chunk, size - offset)
                data = read_range(offset, n)
                if len(data) != n:
                    raise LayerCorrupt(
                        f"{source}: blob {digest} is truncated: got {len(data)} "
                        f"bytes at offset {offset}, wanted {n}",
                        digest=digest,
                        source=source,
                    )
                h.update(data)
                f.write(data)
                offset += n
                if progress:
                    progress(offset)
        if h.hexdigest() != want:
            raise LayerCorrupt(
                f"{source}: blob {digest} does not match its digest (got sha256:{h.hexdigest()})",
                digest=digest,
                source=source,
            )
        os.chmod(tmp, 0o444)
        os.rename(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return dest


def publish_chunk_size() -> int:
    """Chunk size of published lazy forms: ``DSEC_CHUNK_SIZE`` (a power of two, 64K to 64M),
    1 MiB by default. Nodes fetch data in chunks of this size."""
    text = os.environ.get("DSEC_CHUNK_SIZE")
    if not text:
        return DEFAULT_CHUNK_SIZE
    size = parse_size(text, "DSEC_CHUNK_SIZE") or 0
    if size < (64 << 10) or size > (64 << 20) or size & (size - 1):
        raise InvalidSpec(
            f"DSEC_CHUNK_SIZE must be a power of two from 64K to 64M, got {text}",
            field="DSEC_CHUNK_SIZE",
        )
    return size


def publish_compression() -> str:
    """How published data blobs are compressed, chunk by chunk: ``DSEC_CHUNK_COMPRESSION``,
    ``zstd`` (default), ``zlib`` or ``none``."""
    text = os.environ.get("DSEC_CHUNK_COMPRESSION", "zstd").strip().lower()
    if text in ("none", "off", "0", ""):
        return ""
    if text not in ("zstd", "zlib"):
        raise InvalidSpec(
            f"DSEC_CHUNK_COMPRESSION must be zstd, zlib or none, got {text!r}",
            field="DSEC_CHUNK_COMPRESSION",
        )
    return text


@contextlib.contextmanager
def split_for_publishing(
    info: LayerInfo,
    image: Path,
    source: str,
    profile: ReadProfile | None = None,
    compression: str | None = None,
) -> Iterator[tuple[LazyForm, Path, Path] | None]:
    """Split ``image`` (``split_image``) in a temporary directory, removed on exit.

    Yields (form, meta path, blob path), or None if this host cannot split it (no root for
    the mount, no mkfs.erofs): the lazy form is an optimisation, so the layer is then published
    whole only, with a warning. An image that does not match ``info.digest`` is ``LayerCorrupt``.
    With a read ``profile`` of this layer the data blob is stored in profile order
    (``lazy.split.pack_split``); a profile recorded on another split (say, at another chunk
    size) is ignored with a warning. Then each chunk is compressed (``compression``, by default
    ``publish_compression()``; "" for none).
    """
    if compression is None:
        compression = publish_compression()  # a bad setting fails before any work

    work = Path(tempfile.mkdtemp(prefix="dsec-split-"))
    try:
        try:
            split = split_image(Path(image), work, publish_chunk_size())
        except (LayerBuildError, ToolError) as e:
            log.warning("%s: publishing %s without its lazy form: %s", source, info.ref, e)
            split = None
        if split is not None and split[0].layer_digest != info.digest:
            raise LayerCorrupt(
                f"{image} is {split[0].layer_digest}, the layer record says {info.digest}",
                digest=info.digest,
                source=str(image),
            )
        if split is not None and profile is not None:
            form, meta, blob = split
            try:
                form, blob = pack_split(form, blob, profile)
                split = (form, meta, blob)
            except LayerCorrupt as e:
                log.warning("%s: publishing %s in its original order: %s", source, info.ref, e)
        if split is not None and compression:
            form, meta, blob = split
            form, blob = compress_split(form, blob, compression)
            split = (form, meta, blob)
        yield split
    finally:
        shutil.rmtree(work, ignore_errors=True)


class BlobStoreSource(LayerSource):
    """A source that is a store of keys: subclasses implement the four primitives below
    (``_read``, ``_write``, ``_size``, ``_keys``) and inherit the whole layout, verified
    fetches, lazy forms and catalogs.

    A primitive that cannot reach its store (server down, mount gone, credentials refused)
    raises ``SourceUnavailable`` naming the source (``source=self.url``), within a few seconds;
    a missing key is ``KeyError`` (``_read``) or None (``_size``), never ``SourceUnavailable``.
    """

    # --- primitives -----------------------------------------------------------------------
    @abc.abstractmethod
    def _read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of ``key`` (a range if ``length``); ``KeyError`` if there is no such key."""

    @abc.abstractmethod
    def _write(self, key: str, data: bytes | Path) -> None:
        """Store ``data`` (bytes, or a file to upload) under ``key``, atomically."""

    @abc.abstractmethod
    def _size(self, key: str) -> int | None:
        """Size of ``key`` in bytes, or None if there is no such key."""

    @abc.abstractmethod
    def _keys(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix``."""

    # --- the layout -----------------------------------------------------------------------
    @staticmethod
    def blob_key(digest: str) -> str:
        return f"blobs/sha256/{digest.split(':', 1)[-1]}"

    @staticmethod
    def ref_key(name: str, version: str) -> str:
        return f"refs/{name}/{version}.json"

    @staticmethod
    def lazy_key(layer_digest: str) -> str:
        return f"lazy/{layer_digest.split(':', 1)[-1]}.json"

    def _info(self, key: str) -> LayerInfo | None:
        try:
            return LayerInfo.from_dict(json.loads(self._read(key)))
        except KeyError:
            return None

    def list(self) -> list[LayerInfo]:
        out = []
        for key in self._keys("refs/"):
            if key.endswith(".json"):
                info = self._info(key)
                if info is not None:
                    out.append(info)
        return sorted(out, key=lambda i: (i.name, i.created))

    def resolve(self, ref: LayerRef) -> LayerInfo | None:
        if ref.version:
            return self._info(self.ref_key(ref.name, ref.version))
        versions = [i for i in self.list() if i.name == ref.name]
        return max(versions, key=lambda i: i.created) if versions else None

    def image_path(self, info: LayerInfo) -> Path:
        if self.cache_dir is None:
            raise InvalidSpec(f"layer source {self.url} needs a cache directory to fetch into")
        dest = self.cache_dir / f"{info.digest.split(':', 1)[-1]}.erofs"
        if dest.exists():
            return dest
        key = self.blob_key(info.digest)
        size = self._size(key)
        if size is None:
            raise UnknownLayer(
                f"{self.url}: layer {info.ref} names blob {info.digest}, which is missing",
                name=info.ref,
            )
        if size != info.size:
            raise LayerCorrupt(
                f"{self.url}: blob {info.digest} is {size} bytes, the layer "
                f"record says {info.size}",
                digest=info.digest,
                source=self.url,
            )
        return fetch_verified(
            lambda off, n: self._read(key, off, n),
            digest=info.digest,
            size=size,
            dest=dest,
            source=self.url,
        )

    # --- on-demand loading -----------------------------------------------------------------
    def lazy_form(self, info: LayerInfo) -> LazyForm | None:
        try:
            text = self._read(self.lazy_key(info.digest))
        except KeyError:
            return None  # pushed before lazy forms existed, or by a host that could not split
        form = LazyForm.from_json(text)
        if form.layer_digest != info.digest:
            raise LayerCorrupt(
                f"{self.url}: {self.lazy_key(info.digest)} describes "
                f"{form.layer_digest}, not {info.digest}",
                digest=info.digest,
                source=self.url,
            )
        return form

    def fetch_meta(self, form: LazyForm) -> Path:
        dest = self._meta_dest(form)
        if dest.exists():  # only fetch_verified puts files here, after checking them
            return dest
        key = self.blob_key(form.meta_digest)
        return self._fetch_meta_checked(
            form, self._size(key), lambda off, n: self._read(key, off, n)
        )

    def read_blob(self, digest: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            return self._read(self.blob_key(digest), offset, length)
        except KeyError:
            raise UnknownLayer(f"{self.url}: no blob {digest}", digest=digest) from None
        except DsecError:
            raise
        except OSError as e:
            raise SourceUnavailable(
                f"{self.url}: reading blob {digest} at {offset}+{length} failed: {e}",
                source=self.url,
                digest=digest,
            ) from e

    def _push_lazy(self, info: LayerInfo, image: Path, profile: ReadProfile | None = None) -> None:
        """Store the layer's split form unless it is there already (from any name@version)."""
        if self._size(self.lazy_key(info.digest)) is not None:
            return
        with split_for_publishing(info, image, self.url, profile, self.compression) as split:
            if split is None:
                return
            form, meta, blob = split
            for digest, size, path in (
                (form.meta_digest, form.meta_size, meta),
                (form.blob_digest, form.index.stored_size, blob),
            ):
                if self._size(self.blob_key(digest)) != size:
                    self._write(self.blob_key(digest), path)
            # Written last: a reader that finds the form finds both blobs.
            self._write(self.lazy_key(info.digest), form.to_json().encode())

    # --- publishing -----------------------------------------------------------------------
    def push(self, info: LayerInfo, image: Path, *, profile: ReadProfile | None = None) -> bool:
        existing = self._info(self.ref_key(info.name, info.version))
        if existing is not None:
            if existing.digest != info.digest:
                raise LayerExists(
                    f"{self.url}: {info.ref} is already {existing.digest}, not "
                    f"{info.digest}; versions are immutable",
                    name=info.ref,
                )
            return False
        key = self.blob_key(info.digest)
        if self._size(key) != info.size:
            self._write(key, image)
        self._push_lazy(info, image, profile)
        self._write(
            self.ref_key(info.name, info.version), json.dumps(info.to_dict(), indent=2).encode()
        )
        return True

    def put_catalog(self, name: str, document: dict[str, Any]) -> None:
        self._write(f"catalogs/{name}.json", json.dumps(document, indent=2).encode())

    def get_catalog(self, name: str) -> dict[str, Any]:
        try:
            return json.loads(self._read(f"catalogs/{name}.json"))
        except KeyError:
            raise UnknownEnvironment(
                f"{self.url}: no catalog {name!r}", name=name, known=self.catalogs()
            ) from None

    def catalogs(self) -> builtins.list[str]:
        return sorted(
            k[len("catalogs/") : -len(".json")]
            for k in self._keys("catalogs/")
            if k.endswith(".json")
        )
