"""On-demand layers on a node: one FUSE filesystem of data blobs over one shared chunk cache.

When a layer comes from a source that publishes its lazy form (a small EROFS metadata image
plus a chunked data blob and its chunk index), the node fetches the metadata and the index
eagerly and serves the data blob through ``FuseServer`` at ``$DSEC_HOME/run/lazy/<blob hex>``:
a read of file data in any sandbox becomes, on a cache miss, one fetch of a whole chunk
(default 1 MiB) from the source, verified against the index before it is stored. The cache
(``$DSEC_HOME/cache/chunks``) is content-addressed, so a chunk shared by several layers is
fetched and stored once, and bounded (LRU).

Limitation for now: the FUSE connection lives in the daemon process, so sandboxes using
on-demand layers read EIO (never wrong data) after the daemon dies, until a successor adopts
the connection; the fd hand-over exists (``dsec_core.lazy.fuse``) but no keeper process holds
it across restarts yet.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ..config import NodeConfig
from ..lazy.chunks import ChunkCache
from ..lazy.fuse import FuseServer
from ..lazy.loader import LazyBlob, prefetch
from ..layers.source import LayerSource
from ..records import LayerInfo

__all__ = ["LazyLayers"]

log = logging.getLogger("dsec.lazy")


class LazyLayers:
    """The node's on-demand loader. ``prepare`` returns what ``MountCache.acquire`` mounts."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.mountpoint = config.run_dir / "lazy"
        self.cache: ChunkCache | None = None
        self.server: FuseServer | None = None
        self.blobs: dict[str, LazyBlob] = {}  # by blob digest
        self._lock = threading.Lock()

    def _open(self) -> None:
        if self.server is not None:
            return
        self.cache = ChunkCache(self.config.cache_dir / "chunks", self.config.chunk_cache_bytes)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        server = FuseServer()
        server.mount(self.mountpoint)
        self.server = server

    def prepare(self, source: LayerSource, info: LayerInfo) -> tuple[Path, Path] | None:
        """(metadata image, data blob path) for an on-demand mount of ``info``, or None if the
        source offers only the whole image. Blocking: fetches the metadata."""
        form = source.lazy_form(info)
        if form is None:
            return None
        meta = source.fetch_meta(form)
        index = form.index
        name = index.blob_digest.split(":", 1)[-1]
        with self._lock:
            self._open()
            if index.blob_digest not in self.blobs:
                blob = LazyBlob(index, self.cache,
                                lambda off, n: source.read_blob(index.blob_digest, off, n),
                                self.config.fetch_timeout)
                self.server.add_blob(name, index.blob_size, blob.read)
                self.blobs[index.blob_digest] = blob
                log.info("layer %s on demand: %d chunks of %d KiB from %s", info.ref,
                         len(index.chunks), index.chunk_size >> 10, source.url)
        return meta, self.server.path_of(name)

    def prefetch(self, blob_digest: str) -> int:
        """Warm every chunk of a registered blob; returns how many were fetched."""
        blob = self.blobs[blob_digest]
        return prefetch(blob)

    def close(self) -> None:
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None
            self.blobs.clear()
