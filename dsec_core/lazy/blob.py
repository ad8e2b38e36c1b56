"""A layer's data blob read on demand: byte ranges become whole-chunk fetches through the cache.

``LazyBlob.read`` is what the FUSE server calls for each READ of a blob file; ``prefetch`` warms
chunks ahead of use (e.g. the ones a previous run of the same image touched).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import DsecError
from ..linux.mounts import mount_erofs_file
from .chunks import ChunkCache, ChunkIndex
from .layout import AccessTrace

__all__ = ["LazyBlob", "mount_lazy_erofs", "prefetch"]


class LazyBlob:
    """Random access to a remote blob through the node's chunk cache.

    ``read_range(offset, length)`` reads that many bytes of the stored blob from its source (a
    distributed filesystem, an object store, ...); it is only ever asked for whole (stored,
    possibly compressed) chunks.
    With ``readahead`` > 0 a read also starts background fetches of that many following chunks,
    which hides source latency for sequential reads at the price of fetching a little more.
    """

    def __init__(
        self,
        index: ChunkIndex,
        cache: ChunkCache,
        read_range: Callable[[int, int], bytes],
        fetch_timeout: float = 30.0,
        *,
        readahead: int = 0,
        trace: AccessTrace | None = None,
    ) -> None:
        self.index = index
        self.trace = trace
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
        offset, length = self.index.stored_range(i)

        def fetch() -> bytes:
            return self.index.decode(i, self.read_range(offset, length))

        return self.cache.get(self.index.chunks[i], fetch, self.fetch_timeout)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of the (logical) blob, short at its end.

        With a profile-guided layout the logical range is gathered from where it is stored.
        """
        end = min(offset + max(length, 0), self.index.blob_size)
        if offset < 0 or offset >= end:
            return b""
        if self.trace is not None:
            self.trace.touch(offset, end - offset)
        pieces = self.index.physical(offset, end - offset)
        if len(pieces) == 1:
            return self._read_stored(*pieces[0])
        return b"".join(self._read_stored(at, n) for at, n in pieces)

    def _read_stored(self, offset: int, length: int) -> bytes:
        end = offset + length
        cs = self.index.chunk_size
        parts = []
        for i in range(offset // cs, (end - 1) // cs + 1):
            data = self.chunk(i)
            base = i * cs
            parts.append(data[max(offset, base) - base : min(end, base + len(data)) - base])
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
            threading.Thread(
                target=self._fetch_ahead, args=(i,), name=f"prefetch-chunk-{i}", daemon=True
            ).start()

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
    mount_erofs_file(Path(meta), Path(target), None, device=Path(blob))
