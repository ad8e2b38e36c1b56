"""On-demand layer loading: EROFS metadata mounted eagerly, file data fetched in chunks when read.

``chunks`` indexes a layer's data blob and caches chunks node-wide by digest, ``fuse`` serves
blob files over FUSE, and ``loader`` joins them (``LazyBlob``) and mounts EROFS over the result.
"""

from .chunks import DEFAULT_CHUNK_SIZE, ChunkCache, ChunkIndex
from .fuse import FuseServer, recv_fuse_fd, send_fuse_fd
from .loader import LazyBlob, mount_lazy_erofs, prefetch

__all__ = ["ChunkIndex", "ChunkCache", "DEFAULT_CHUNK_SIZE", "FuseServer", "send_fuse_fd",
           "recv_fuse_fd", "LazyBlob", "prefetch", "mount_lazy_erofs"]
