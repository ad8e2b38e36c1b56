"""dsec layer source plugin ``shelf``: layers and catalogs in a directory, ``shelf:/some/dir``.

The ``BlobStoreSource`` layout over four primitives on files under one directory, written to a
temporary name and renamed into place. Migrated from dsec's first plugin contract by dsec's
guide "Migrating a plugin written before this change" (docs/plugins/migrating.md): plugin API 2.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dsec_core.errors import InvalidSpec, SourceUnavailable
from dsec_core.hookspecs import hookimpl
from dsec_core.sources.base import BlobStoreSource

DSEC_PLUGIN_API = 2

__all__ = ["ShelfLayerSource"]


class ShelfLayerSource(BlobStoreSource):
    """Layers in a directory (``shelf:/absolute/path``)."""

    scheme = "shelf"

    def __init__(self, location: str = "", *, cache_dir: Path | None = None) -> None:
        if not location.startswith("/"):
            raise InvalidSpec(f"shelf layer source needs an absolute path, got {location!r}")
        super().__init__(location, cache_dir=cache_dir)
        self.root = Path(location)

    @property
    def url(self) -> str:
        return f"shelf:{self.location}"

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise SourceUnavailable(f"{self.url}: no such directory", source=self.url)

    def _path(self, key: str) -> Path:
        self._check_root()
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise InvalidSpec(f"{self.url}: key {key!r} escapes the source")
        return path

    def _read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(offset)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise KeyError(key) from None

    def _write(self, key: str, data: bytes | Path) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data.read_bytes() if isinstance(data, Path) else data)
            os.rename(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def _keys(self, prefix: str) -> list[str]:
        self._check_root()
        base = self.root / prefix.rpartition("/")[0]
        if not base.is_dir():
            return []
        keys = (
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )
        return sorted(k for k in keys if k.startswith(prefix))


@hookimpl
def dsec_register_layer_sources(register):
    register(ShelfLayerSource)
