"""A layer's data blob read on demand: byte ranges become whole-chunk fetches through the cache.

``LazyBlob.read`` is what the FUSE server calls for each READ of a blob file; ``prefetch`` warms
chunks ahead of use (e.g. the ones a previous run of the same image touched).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from ..errors import DsecError, LayerCorrupt
from ..node.mounts import (AT_FDCWD, FSCONFIG_CMD_CREATE, FSCONFIG_SET_STRING, FSMOUNT_CLOEXEC,
                           FSOPEN_CLOEXEC, MOUNT_ATTR_NODEV, MOUNT_ATTR_RDONLY,
                           MOVE_MOUNT_F_EMPTY_PATH, SYS_FSCONFIG, SYS_FSMOUNT, SYS_FSOPEN,
                           SYS_MOVE_MOUNT, _check, _libc)
from .chunks import ChunkCache, ChunkIndex

__all__ = ["LazyBlob", "prefetch", "mount_lazy_erofs"]


class LazyBlob:
    """Random access to a remote blob through the node's chunk cache.

    ``read_range(offset, length)`` reads that many bytes of the blob from its source (a
    distributed filesystem, an object store, ...); it is only ever asked for whole chunks.
    With ``readahead`` > 0 a read also starts background fetches of that many following chunks,
    which hides source latency for sequential reads at the price of fetching a little more.
    """

    def __init__(self, index: ChunkIndex, cache: ChunkCache,
                 read_range: Callable[[int, int], bytes], fetch_timeout: float = 30.0,
                 *, readahead: int = 0) -> None:
        self.index = index
        self.cache = cache
        self.read_range = read_range
        self.fetch_timeout = fetch_timeout
        self.readahead = readahead
        self._ahead: set[int] = set()
        self._ahead_lock = threading.Lock()

    @property
    def size(self) -> int:
        return self.index.blob_size

    def chunk(self, i: int) -> bytes:
        """Chunk ``i`` of the blob, from the cache or fetched into it."""
        offset, length = self.index.chunk_range(i)

        def fetch() -> bytes:
            data = self.read_range(offset, length)
            if len(data) != length:
                raise LayerCorrupt(f"blob {self.index.blob_digest} chunk {i}: source returned"
                                   f" {len(data)} bytes, expected {length}",
                                   digest=self.index.blob_digest, chunk=i)
            return data

        return self.cache.get(self.index.chunks[i], fetch, self.fetch_timeout)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of the blob, short at its end."""
        end = min(offset + max(length, 0), self.index.blob_size)
        if offset < 0 or offset >= end:
            return b""
        cs = self.index.chunk_size
        parts = []
        for i in range(offset // cs, (end - 1) // cs + 1):
            data = self.chunk(i)
            base = i * cs
            parts.append(data[max(offset, base) - base:min(end, base + len(data)) - base])
        if self.readahead:
            self._read_ahead((end - 1) // cs + 1)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read_ahead(self, first: int) -> None:
        for i in range(first, min(first + self.readahead, len(self.index.chunks))):
            if self.index.chunks[i] in self.cache:
                continue
            with self._ahead_lock:
                if i in self._ahead:
                    continue
                self._ahead.add(i)
            threading.Thread(target=self._fetch_ahead, args=(i,), name=f"prefetch-chunk-{i}",
                             daemon=True).start()

    def _fetch_ahead(self, i: int) -> None:
        try:
            self.chunk(i)
        except DsecError:
            pass  # a real read of this chunk will retry and report the error
        finally:
            with self._ahead_lock:
                self._ahead.discard(i)


def prefetch(blob: LazyBlob, chunks: Iterable[int] | None = None, *, parallel: int = 4) -> int:
    """Fetch ``chunks`` (all of them by default) of ``blob`` into the cache; returns how many.

    Raises the first error (``SourceUnavailable``, ``LayerCorrupt``) after the others finished.
    """
    todo = list(range(len(blob.index.chunks)) if chunks is None else chunks)
    with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="prefetch") as pool:
        futures = [pool.submit(_warm, blob, i) for i in todo]
    for f in futures:
        f.result()
    return len(todo)


def _warm(blob: LazyBlob, i: int) -> None:
    blob.chunk(i)  # drop the bytes: prefetching must not hold the whole blob in memory


def mount_lazy_erofs(meta: Path | str, blob: Path | str, target: Path | str) -> None:
    """Mount EROFS metadata image ``meta`` read-only at ``target``, its data in file ``blob``.

    ``blob`` is typically a file of a ``FuseServer`` mount, so data reads become chunk fetches.
    """
    fs = _check(_libc.syscall(SYS_FSOPEN, b"erofs", FSOPEN_CLOEXEC), "fsopen erofs for", meta)
    try:
        _check(_libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"source",
                             os.fsencode(meta), 0), "fsconfig source", meta)
        _check(_libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"device",
                             os.fsencode(blob), 0), "fsconfig device", blob)
        _check(_libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0),
               "mounting EROFS metadata image", meta)
        mnt = _check(_libc.syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC,
                                   MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV), "fsmount", meta)
    finally:
        os.close(fs)
    try:
        _check(_libc.syscall(SYS_MOVE_MOUNT, mnt, b"", AT_FDCWD, os.fsencode(target),
                             MOVE_MOUNT_F_EMPTY_PATH), "move_mount to", target)
    finally:
        os.close(mnt)
