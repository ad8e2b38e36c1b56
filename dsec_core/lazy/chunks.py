"""Chunk index of a layer's data blob, and the node-wide content-addressed chunk cache.

A data blob (``mkfs.erofs --blobdev``) is cut into fixed ``chunk_size`` pieces, each named by its
sha256. The cache stores chunks as files named by that digest, so a chunk that appears in several
layers is fetched and stored once per node, whichever layer touched it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
import zlib
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import LayerCorrupt, SourceUnavailable
from .layout import check_layout

__all__ = ["DEFAULT_CHUNK_SIZE", "ChunkCache", "ChunkIndex"]

DEFAULT_CHUNK_SIZE = 1 << 20
COMPRESSIONS = ("", "zstd", "zlib")
_TMP_PREFIX = ".tmp-"
STUCK_GRACE = 0.2  # seconds a reader waits on a fetch that already ran past its timeout


class _Fetch(Future):
    """One in-flight fetch; ``stuck_until`` is set once it has outlived a reader's timeout."""

    stuck_until: float | None = None


@dataclass(frozen=True)
class ChunkIndex:
    """The sha256 of each ``chunk_size`` piece of a blob, and how the blob is laid out.

    Chunk i is bytes [i*chunk_size, min(blob_size, (i+1)*chunk_size)); the last one is shorter.
    A blob stored in profile-guided order (``lazy.layout``) carries its ``layout``: extents
    (logical offset, stored offset, length) mapping the blob the metadata image addresses
    (``logical_digest``) onto the stored one (``blob_digest``). Without a layout both are one.

    A blob stored compressed (``compression`` "zstd" or "zlib") is its chunks compressed one by
    one and concatenated; ``stored`` gives each chunk's (offset, length) in it, and a chunk that
    did not shrink is stored as is (its stored length equals its length). ``blob_digest`` and
    ``stored_size`` are then those of the compressed object a source holds, while ``blob_size``,
    the chunk digests and the cache stay uncompressed: identical chunks dedupe either way.

    ``hot`` (with a layout) is how many bytes at the start of the stored order the profile
    read: a node prefetches those chunks when it first mounts the layer.
    """

    blob_digest: str
    blob_size: int
    chunk_size: int
    chunks: tuple[str, ...]
    layout: tuple[tuple[int, int, int], ...] = ()
    logical_digest: str = ""
    compression: str = ""
    stored: tuple[tuple[int, int], ...] = ()
    hot: int = 0  # with a layout: the first ``hot`` bytes are what the profile read

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))
        object.__setattr__(self, "layout", tuple(tuple(map(int, e)) for e in self.layout))
        expected = -(-self.blob_size // self.chunk_size) if self.chunk_size > 0 else -1
        if self.chunk_size <= 0 or len(self.chunks) != expected:
            raise LayerCorrupt(
                f"chunk index of {self.blob_digest} lists {len(self.chunks)} chunks,"
                f" a {self.blob_size}-byte blob in {self.chunk_size}-byte chunks"
                f" has {expected}",
                digest=self.blob_digest,
            )
        if self.layout:
            check_layout(self.layout, self.blob_size)
            object.__setattr__(self, "layout", tuple(sorted(self.layout)))
        object.__setattr__(self, "stored", tuple((int(o), int(n)) for o, n in self.stored))
        if self.compression not in COMPRESSIONS:
            raise LayerCorrupt(
                f"chunk index of {self.blob_digest}: unknown compression {self.compression!r}",
                digest=self.blob_digest,
            )
        if self.compression:
            at = 0
            for i, (offset, n) in enumerate(self.stored):
                if offset != at or not 0 < n <= self.chunk_range(i)[1]:
                    at = -1
                    break
                at += n
            if len(self.stored) != len(self.chunks) or at < 0:
                raise LayerCorrupt(
                    f"chunk index of {self.blob_digest}: stored chunk ranges do not tile the blob",
                    digest=self.blob_digest,
                )
        elif self.stored:
            raise LayerCorrupt(
                f"chunk index of {self.blob_digest}: stored ranges without compression",
                digest=self.blob_digest,
            )
        if not self.logical_digest:
            if self.layout or self.compression:
                raise LayerCorrupt(
                    f"chunk index of {self.blob_digest} is laid out or "
                    "compressed but names no logical digest",
                    digest=self.blob_digest,
                )
            object.__setattr__(self, "logical_digest", self.blob_digest)
        if not 0 <= self.hot <= (self.blob_size if self.layout else 0):
            raise LayerCorrupt(
                f"chunk index of {self.blob_digest}: hot region of {self.hot} "
                "bytes without a layout, or past the blob",
                digest=self.blob_digest,
            )
        object.__setattr__(self, "_starts", [e[0] for e in self.layout])

    @property
    def hot_chunks(self) -> range:
        """The chunks holding what the layout's profile read (empty without a profile)."""
        return range(-(-self.hot // self.chunk_size))

    @property
    def stored_size(self) -> int:
        """Size of the blob object a source holds (compressed, if it is)."""
        return sum(n for _, n in self.stored) if self.compression else self.blob_size

    def stored_range(self, i: int) -> tuple[int, int]:
        """(offset, length) of chunk ``i`` in the stored blob."""
        return self.stored[i] if self.compression else self.chunk_range(i)

    def decode(self, i: int, data: bytes) -> bytes:
        """Chunk ``i`` from its stored bytes: decompressed and length-checked, not yet hashed
        (``ChunkCache`` does that). Short, overlong or undecodable data is ``LayerCorrupt``."""
        length = self.chunk_range(i)[1]
        stored = self.stored_range(i)[1]
        if len(data) != stored:
            raise LayerCorrupt(
                f"blob {self.blob_digest} chunk {i}: source returned "
                f"{len(data)} bytes, expected {stored}",
                digest=self.blob_digest,
                chunk=i,
            )
        if stored == length:
            return data
        try:
            out = _inflate(self.compression, data, length)
        except _Undecodable as e:
            raise LayerCorrupt(
                f"blob {self.blob_digest} chunk {i} does not decompress: {e}",
                digest=self.blob_digest,
                chunk=i,
            ) from None
        if out is None or len(out) != length:
            raise LayerCorrupt(
                f"blob {self.blob_digest} chunk {i} decompresses to the wrong size",
                digest=self.blob_digest,
                chunk=i,
            )
        return out

    def physical(self, offset: int, length: int) -> list[tuple[int, int]]:
        """Where logical bytes [offset, offset+length) are stored: (offset, length) pieces."""
        if not self.layout:
            return [(offset, length)]
        end = offset + length
        starts: list[int] = self._starts  # type: ignore[attr-defined]  # set in __post_init__
        i = max(0, bisect_right(starts, offset) - 1)
        out: list[tuple[int, int]] = []
        while offset < end and i < len(self.layout):
            logical, phys, n = self.layout[i]
            take = min(end, logical + n) - offset
            if take > 0:
                if out and out[-1][0] + out[-1][1] == phys + offset - logical:
                    out[-1] = (out[-1][0], out[-1][1] + take)
                else:
                    out.append((phys + offset - logical, take))
                offset += take
            i += 1
        return out

    @classmethod
    def build(cls, blob_path: Path | str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ChunkIndex:
        """Hash ``blob_path`` chunk by chunk (one pass, one chunk in memory at a time)."""
        whole = hashlib.sha256()
        chunks = []
        size = 0
        with open(blob_path, "rb") as f:
            while True:
                piece = f.read(chunk_size)
                if not piece:
                    break
                whole.update(piece)
                chunks.append("sha256:" + hashlib.sha256(piece).hexdigest())
                size += len(piece)
        return cls("sha256:" + whole.hexdigest(), size, chunk_size, tuple(chunks))

    def chunk_range(self, i: int) -> tuple[int, int]:
        """(offset, length) of chunk ``i`` in the blob."""
        start = i * self.chunk_size
        return start, min(self.blob_size, start + self.chunk_size) - start

    def to_json(self) -> str:
        d = {
            "blob_digest": self.blob_digest,
            "blob_size": self.blob_size,
            "chunk_size": self.chunk_size,
            "chunks": list(self.chunks),
        }
        if self.layout or self.compression:
            d["logical_digest"] = self.logical_digest
        if self.layout:
            d["layout"] = [list(e) for e in self.layout]
        if self.hot:
            d["hot"] = self.hot
        if self.compression:
            d["compression"] = self.compression
            d["stored"] = [list(r) for r in self.stored]
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str | bytes) -> ChunkIndex:
        d = json.loads(text)
        return cls(
            d["blob_digest"],
            int(d["blob_size"]),
            int(d["chunk_size"]),
            tuple(d["chunks"]),
            tuple(tuple(e) for e in d.get("layout", ())),
            d.get("logical_digest", ""),
            d.get("compression", ""),
            tuple(tuple(r) for r in d.get("stored", ())),
            int(d.get("hot", 0)),
        )


class _Undecodable(Exception):
    """A stored chunk its codec cannot decompress (zlib's or zstd's error, as text)."""


def deflate(compression: str, data: bytes) -> bytes:
    """``data`` compressed for a chunk index of that ``compression`` (zstd level 3, zlib 3)."""
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data)
    return zlib.compress(data, 3)


def _inflate(compression: str, data: bytes, length: int) -> bytes | None:
    """Decompress one stored chunk of ``length`` bytes, never inflating past length + 1 (a
    damaged or hostile chunk cannot balloon); None if its header claims another size."""
    if compression == "zstd":
        import zstandard

        try:
            claimed = zstandard.frame_content_size(data)
            if claimed not in (length, zstandard.CONTENTSIZE_UNKNOWN):
                return None
            # With the size in the header the output buffer is exactly that; without it, at
            # most length + 1 (more is a ZstdError).
            return zstandard.ZstdDecompressor().decompress(data, max_output_size=length + 1)
        except zstandard.ZstdError as e:
            raise _Undecodable(str(e)) from None
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, length + 1)
    except zlib.error as e:
        raise _Undecodable(str(e)) from None
    return out if inflater.eof else None


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise LayerCorrupt(f"not a sha256 chunk digest: {digest!r}", digest=digest)
    return hexpart


class ChunkCache:
    """Content-addressed chunks under ``root``, at most ``max_bytes`` of them, evicted LRU.

    ``get`` returns a chunk's bytes, fetching it on a miss. Concurrent misses of one chunk share
    a single fetch (single-flight). Fetched bytes are verified against the digest before they are
    stored (temp file + rename); a failing or slow fetch raises ``SourceUnavailable`` and no
    failure is remembered, so a later ``get`` tries the source again. A fetch that outlived its
    timeout stays joinable: for one more ``timeout`` new readers wait on it only briefly
    (``STUCK_GRACE``) rather than stacking timeouts, then a fresh fetch is started.

    Readers copy a chunk out under a pin, and eviction skips pinned chunks. Hits are re-verified
    (``verify_hits``) so a chunk rotted on disk is dropped and refetched, never served. The cache
    is rebuilt from ``root`` on start (sizes, LRU order from mtimes; temp files deleted), so it
    survives daemon restarts. Thread-safe within one process; one process owns a root.
    """

    def __init__(
        self,
        root: Path | str,
        max_bytes: int,
        *,
        verify_hits: bool = True,
        memory_bytes: int = 32 << 20,
    ) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.verify_hits = verify_hits
        # The kernel asks for a chunk in readahead-sized pieces (128 KiB by default), so the
        # last few verified chunks are kept in memory instead of re-reading and re-hashing a
        # whole chunk file for every piece.
        self.memory_bytes = memory_bytes
        self._hot: OrderedDict[str, bytes] = OrderedDict()
        self._hot_bytes = 0
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # hex digest -> size, LRU first
        self._pins: dict[str, int] = {}
        self._inflight: dict[str, _Fetch] = {}
        self.total_bytes = 0
        self.fetches = 0  # fetches started, for tests and metrics
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    # -- restart -------------------------------------------------------------------------------

    def _scan(self) -> None:
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                if sub.name.startswith(_TMP_PREFIX):
                    sub.unlink(missing_ok=True)
                continue
            for f in sub.iterdir():
                if f.name.startswith(_TMP_PREFIX):  # a store interrupted by a crash
                    f.unlink(missing_ok=True)
                    continue
                try:
                    _hex("sha256:" + f.name)
                    st = f.stat()
                except (LayerCorrupt, OSError):
                    continue
                found.append((st.st_mtime, f.name, st.st_size))
        for _mtime, name, size in sorted(found):  # oldest access first
            self._sizes[name] = size
            self.total_bytes += size
        with self._lock:
            self._evict_locked()

    # -- paths and pins ------------------------------------------------------------------------

    def path_of(self, digest: str) -> Path:
        h = _hex(digest)
        return self.root / h[:2] / h

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return _hex(digest) in self._sizes

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    @contextmanager
    def pin(self, digest: str) -> Iterator[None]:
        """Keep ``digest`` from eviction for the duration (it may still be absent)."""
        h = _hex(digest)
        with self._lock:
            self._pins[h] = self._pins.get(h, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                n = self._pins[h] - 1
                if n:
                    self._pins[h] = n
                else:
                    del self._pins[h]
                self._evict_locked()

    # -- reading -------------------------------------------------------------------------------

    def get(self, digest: str, fetch: Callable[[], bytes], timeout: float = 30.0) -> bytes:
        """The chunk ``digest``; on a miss ``fetch()`` it (once, however many callers wait)."""
        h = _hex(digest)
        deadline = time.monotonic() + timeout
        while True:
            with self.pin(digest):
                data = self._read_hit(h)
                if data is not None:
                    return data
                with self._lock:
                    if h in self._sizes:  # stored between our look and now
                        continue
                    fut = self._inflight.get(h)
                    if (
                        fut is not None
                        and fut.stuck_until is not None
                        and time.monotonic() >= fut.stuck_until
                    ):
                        fut = None  # backoff over: ask the source again, beside the stuck call
                    if fut is None:
                        fut = _Fetch()
                        self._inflight[h] = fut
                        self.fetches += 1
                        threading.Thread(
                            target=self._run_fetch,
                            args=(h, fetch, fut),
                            name=f"chunk-fetch-{h[:12]}",
                            daemon=True,
                        ).start()
                    wait = max(0.0, deadline - time.monotonic())
                    if fut.stuck_until is not None:
                        # The kernel retries a failed read a few times; fail those fast
                        # instead of stacking timeouts, yet catch a fetch that just finished.
                        wait = min(wait, STUCK_GRACE)
                try:
                    return fut.result(timeout=wait)
                except TimeoutError:
                    with self._lock:
                        if fut.stuck_until is None:
                            fut.stuck_until = time.monotonic() + timeout
                    raise SourceUnavailable(
                        f"fetching chunk {digest} took longer than {timeout}s",
                        digest=digest,
                        timeout=timeout,
                    ) from None

    def _remember(self, h: str, data: bytes) -> None:
        if len(data) > self.memory_bytes:
            return
        with self._lock:
            if h in self._hot:
                self._hot.move_to_end(h)
                return
            self._hot[h] = data
            self._hot_bytes += len(data)
            while self._hot_bytes > self.memory_bytes:
                _, old = self._hot.popitem(last=False)
                self._hot_bytes -= len(old)

    def _read_hit(self, h: str) -> bytes | None:
        with self._lock:
            if h not in self._sizes:
                return None
            self._sizes.move_to_end(h)
            hot = self._hot.get(h)
            if hot is not None:
                self._hot.move_to_end(h)
                return hot
        path = self.root / h[:2] / h
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = None
        if data is not None and (not self.verify_hits or hashlib.sha256(data).hexdigest() == h):
            try:
                os.utime(path)  # access time for LRU order after a restart
            except OSError:
                pass
            self._remember(h, data)
            return data
        with self._lock:  # missing or rotten on disk: drop it, the caller refetches
            hot = self._hot.pop(h, None)
            if hot is not None:
                self._hot_bytes -= len(hot)
            size = self._sizes.pop(h, None)
            if size is not None:
                self.total_bytes -= size
        path.unlink(missing_ok=True)
        return None

    def _run_fetch(self, h: str, fetch: Callable[[], bytes], fut: _Fetch) -> None:
        try:
            data = fetch()
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"fetch returned {type(data).__name__}, not bytes")
            data = bytes(data)
            got = hashlib.sha256(data).hexdigest()
            if got != h:
                raise LayerCorrupt(
                    f"chunk sha256:{h} fetched as {len(data)} bytes with digest sha256:{got}",
                    digest="sha256:" + h,
                    got="sha256:" + got,
                )
            self._store(h, data)
            self._remember(h, data)
        except LayerCorrupt as e:
            result: BaseException | None = e
        except SourceUnavailable as e:
            result = e
        except Exception as e:  # the source's own errors
            result = SourceUnavailable(
                f"fetching chunk sha256:{h} failed: {e}", digest="sha256:" + h
            )
            result.__cause__ = e
        else:
            result = None
        with self._lock:
            if self._inflight.get(h) is fut:
                del self._inflight[h]
        if result is None:
            fut.set_result(data)
        else:
            fut.set_exception(result)

    def _store(self, h: str, data: bytes) -> None:
        d = self.root / h[:2]
        d.mkdir(exist_ok=True)
        tmp = d / f"{_TMP_PREFIX}{h}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, d / h)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            if h not in self._sizes:
                self._sizes[h] = len(data)
                self.total_bytes += len(data)
            self._sizes.move_to_end(h)
            self._evict_locked()

    def _evict_locked(self) -> None:
        if self.total_bytes <= self.max_bytes:
            return
        for h in list(self._sizes):
            if self.total_bytes <= self.max_bytes:
                break
            if self._pins.get(h):
                continue
            size = self._sizes.pop(h)
            self.total_bytes -= size
            hot = self._hot.pop(h, None)
            if hot is not None:
                self._hot_bytes -= len(hot)
            # Readers read a whole chunk under a pin, so unlinking an unpinned one hurts nobody.
            try:
                os.unlink(self.root / h[:2] / h)
            except FileNotFoundError:
                pass
