"""The lazy (on-demand) form of a layer and the machinery that serves it: EROFS metadata mounted
eagerly, file data fetched in chunks when first read.

``split`` turns an image into its lazy form (metadata image + chunked data blob), ``layout``
orders a blob by a read profile, ``chunks`` indexes a blob and caches chunks node-wide by digest,
``fuse`` serves blob files over FUSE, ``blob`` joins them (``LazyBlob``) and mounts EROFS over the
result, and ``fuse_keeper`` holds the FUSE connection across daemon restarts. This package is a
library with no node in it; the node's service that serves lazy layers with it is
``dsec_core.node.lazy_layers`` (``LazyLayers``).
"""

from .blob import LazyBlob, mount_lazy_erofs, prefetch
from .chunks import DEFAULT_CHUNK_SIZE, ChunkCache, ChunkIndex
from .fuse import FuseServer, recv_fuse_fd, send_fuse_fd

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ChunkCache",
    "ChunkIndex",
    "FuseServer",
    "LazyBlob",
    "mount_lazy_erofs",
    "prefetch",
    "recv_fuse_fd",
    "send_fuse_fd",
]
