"""The contract for layer sources: where EROFS layers and catalogs are found by name or digest.

A node lists its sources in order (``local`` first by default); a layer is taken from the first
source that has it. Sources are named by URL: ``local``, ``posix:/mnt/3fs/dsec``,
``s3://bucket/prefix?endpoint=http://127.0.0.1:9000``, ``oci://127.0.0.1:5000/dsec?insecure=1``.

Key/value stores (a directory, an S3 bucket) share one layout and most of their code through
``BlobStoreSource``: ``blobs/sha256/<hex>`` (the image), ``refs/<name>/<version>.json`` (its
``LayerInfo``), ``catalogs/<name>.json``. Every byte fetched is checked against the layer's
sha256 before anything can mount it.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, ClassVar

from ..errors import InvalidSpec, LayerCorrupt, UnknownLayer
from ..records import LayerInfo, LayerRef

__all__ = ["LayerSource", "BlobStoreSource", "fetch_verified", "FETCH_CHUNK"]

FETCH_CHUNK = 8 << 20


class LayerSource(abc.ABC):
    """Subclass, set ``scheme``, register from ``dsec_register_layer_sources``.

    ``location`` is the URL without the scheme (for ``s3://b/p?x=1``: ``b/p?x=1``);
    ``cache_dir`` is where fetched images may be kept on this node.
    """

    scheme: ClassVar[str]
    read_only: ClassVar[bool] = False

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

    # --- publishing -----------------------------------------------------------------------
    def push(self, info: LayerInfo, image: Path) -> bool:
        """Publish a layer; False (and nothing done) if this source already has it."""
        raise InvalidSpec(f"layer source {self.url} is read-only")

    def put_catalog(self, name: str, document: dict[str, Any]) -> None:
        """Store a catalog document under ``name`` (replacing an older one)."""
        raise InvalidSpec(f"layer source {self.url} is read-only")

    def get_catalog(self, name: str) -> dict[str, Any]:
        """The catalog document stored under ``name``; ``UnknownEnvironment`` if none."""
        raise InvalidSpec(f"layer source {self.url} holds no catalogs")

    def catalogs(self) -> list[str]:
        """Names of the catalogs this source holds."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url})"


def fetch_verified(read_range: Callable[[int, int], bytes], *, digest: str, size: int,
                   dest: Path, source: str, chunk: int = FETCH_CHUNK,
                   progress: Callable[[int], None] | None = None) -> Path:
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
                    raise LayerCorrupt(f"{source}: blob {digest} is truncated: got {len(data)} "
                                       f"bytes at offset {offset}, wanted {n}", digest=digest,
                                       source=source)
                h.update(data)
                f.write(data)
                offset += n
                if progress:
                    progress(offset)
        if h.hexdigest() != want:
            raise LayerCorrupt(f"{source}: blob {digest} does not match its digest (got "
                               f"sha256:{h.hexdigest()})", digest=digest, source=source)
        os.chmod(tmp, 0o444)
        os.rename(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return dest


class BlobStoreSource(LayerSource):
    """A source that is a store of keys: subclasses implement the five primitives below."""

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
            raise UnknownLayer(f"{self.url}: layer {info.ref} names blob {info.digest}, which "
                               "is missing", name=info.ref)
        if size != info.size:
            raise LayerCorrupt(f"{self.url}: blob {info.digest} is {size} bytes, the layer "
                               f"record says {info.size}", digest=info.digest, source=self.url)
        return fetch_verified(lambda off, n: self._read(key, off, n), digest=info.digest,
                              size=size, dest=dest, source=self.url)

    # --- publishing -----------------------------------------------------------------------
    def push(self, info: LayerInfo, image: Path) -> bool:
        existing = self._info(self.ref_key(info.name, info.version))
        if existing is not None:
            if existing.digest != info.digest:
                from ..errors import LayerExists
                raise LayerExists(f"{self.url}: {info.ref} is already {existing.digest}, not "
                                  f"{info.digest}; versions are immutable", name=info.ref)
            return False
        key = self.blob_key(info.digest)
        if self._size(key) != info.size:
            self._write(key, image)
        self._write(self.ref_key(info.name, info.version),
                    json.dumps(info.to_dict(), indent=2).encode())
        return True

    def put_catalog(self, name: str, document: dict[str, Any]) -> None:
        self._write(f"catalogs/{name}.json", json.dumps(document, indent=2).encode())

    def get_catalog(self, name: str) -> dict[str, Any]:
        from ..errors import UnknownEnvironment
        try:
            return json.loads(self._read(f"catalogs/{name}.json"))
        except KeyError:
            raise UnknownEnvironment(f"{self.url}: no catalog {name!r}", name=name,
                                     known=self.catalogs()) from None

    def catalogs(self) -> list[str]:
        return sorted(k[len("catalogs/"):-len(".json")] for k in self._keys("catalogs/")
                      if k.endswith(".json"))
