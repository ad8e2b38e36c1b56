"""dsec layer source plugin: a shared filesystem path (3FS, CephFS, NFS) mounted on every node.

``posix:/mnt/3fs/dsec`` holds the ``BlobStoreSource`` layout; writes go to a temporary name in
the same directory and are renamed into place, so readers on other nodes never see half a blob.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dsec_core.errors import InvalidSpec, SourceUnavailable
from dsec_core.hookspecs import hookimpl
from dsec_core.sources.base import BlobStoreSource

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["PosixLayerSource"]


class PosixLayerSource(BlobStoreSource):
    """Layers in a directory tree shared by every node."""

    scheme = "posix"

    def __init__(self, location: str = "", *, cache_dir: Path | None = None) -> None:
        if not location.startswith("/"):
            raise InvalidSpec(f"posix layer source needs an absolute path, got {location!r}")
        super().__init__(location, cache_dir=cache_dir)
        self.root = Path(location)

    @property
    def url(self) -> str:
        return f"posix:{self.location}"

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise SourceUnavailable(
                f"{self.url}: no such directory (is the shared filesystem mounted?)",
                source=self.url,
            )

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise InvalidSpec(f"{self.url}: key {key!r} escapes the source")
        return path

    def _read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        self._check_root()
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KeyError(key) from None
        try:
            if length is None:
                length = os.fstat(fd).st_size - offset
            out = bytearray()
            while len(out) < length:
                piece = os.pread(fd, length - len(out), offset + len(out))
                if not piece:
                    break
                out += piece
            return bytes(out)
        finally:
            os.close(fd)

    def _write(self, key: str, data: bytes | Path) -> None:
        self._check_root()
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(data, Path):
                    with open(data, "rb") as src:
                        while chunk := src.read(8 << 20):
                            f.write(chunk)
                else:
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o444 if key.startswith("blobs/") else 0o644)
            os.rename(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def _size(self, key: str) -> int | None:
        self._check_root()
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def _keys(self, prefix: str) -> list[str]:
        self._check_root()
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )


@hookimpl
def dsec_register_layer_sources(register):
    register(PosixLayerSource)
