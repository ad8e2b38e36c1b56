"""Profile-guided layout of a data blob: the pages a workload reads first are stored first.

On-demand loading fetches whole chunks (default 1 MiB), but a workload reads pages scattered
over the blob: Python's start-up touches a few KiB in each of hundreds of modules, laid out in
directory order between the files it never opens. Each touched page then costs a whole chunk.
Eager-loading systems solve the same problem with access profiles (eStargz's prioritized files,
Nydus's prefetch table): record what a run of the image reads, then store that first.

dsec does it below the filesystem, on the blob, so EROFS never notices:

- ``AccessTrace`` records the pages of a blob in the order a node's readers first touched them
  (``NodeConfig.trace_reads``; ``dsec catalog profile`` runs tasks to record them).
- ``ReadProfile`` is that record for one layer, saved next to the layer in the author's store.
- ``plan_layout`` turns a profile into a permutation of the blob's pages: read pages first, in
  first-read order, then the rest in their original order. ``write_packed`` writes the blob in
  that order; the chunk index carries the permutation as extents (``ChunkIndex.layout``), and
  ``LazyBlob`` maps each read of the original ("logical") blob to the stored ("physical") one.

The metadata image still addresses the logical blob, so the same image mounts over a packed or
an unpacked blob alike, and a profile never changes what a sandbox reads, only how many chunks
it costs.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import LayerCorrupt

__all__ = [
    "PAGE_SIZE",
    "PROFILE_VERSION",
    "AccessTrace",
    "Extent",
    "ReadProfile",
    "plan_layout",
    "write_packed",
]

PAGE_SIZE = 4096
PROFILE_VERSION = 1

Extent = tuple[int, int, int]  # (logical offset, physical offset, length), page-aligned


class AccessTrace:
    """Pages of one blob in the order they were first read. Thread-safe."""

    def __init__(self, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self._pages: dict[int, None] = {}  # insertion-ordered: first touch first
        self._lock = threading.Lock()

    def touch(self, offset: int, length: int) -> None:
        if length <= 0:
            return
        first, last = offset // self.page_size, (offset + length - 1) // self.page_size
        with self._lock:
            for page in range(first, last + 1):
                self._pages.setdefault(page)

    def __len__(self) -> int:
        return len(self._pages)

    def ranges(self) -> list[tuple[int, int]]:
        """Byte ranges (offset, length) in first-read order; consecutive pages merged."""
        with self._lock:
            pages = list(self._pages)
        out: list[list[int]] = []
        for page in pages:
            if out and out[-1][0] + out[-1][1] == page:
                out[-1][1] += 1
            else:
                out.append([page, 1])
        return [(p * self.page_size, n * self.page_size) for p, n in out]


@dataclass(frozen=True)
class ReadProfile:
    """What a workload read of one layer's data blob, in first-read order.

    ``blob_digest`` and ``blob_size`` name the logical blob the offsets refer to (the layer's
    split form at one chunk size); a profile is only ever applied to that blob.
    """

    layer_digest: str
    blob_digest: str
    blob_size: int
    ranges: tuple[tuple[int, int], ...]
    workload: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", tuple((int(o), int(n)) for o, n in self.ranges))

    @property
    def read_bytes(self) -> int:
        return sum(n for _, n in self.ranges)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": PROFILE_VERSION,
                "layer_digest": self.layer_digest,
                "blob_digest": self.blob_digest,
                "blob_size": self.blob_size,
                "workload": self.workload,
                "ranges": [list(r) for r in self.ranges],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ReadProfile:
        try:
            d = json.loads(text)
            if d.get("version") != PROFILE_VERSION:
                raise ValueError(f"unknown profile version {d.get('version')!r}")
            return cls(
                str(d["layer_digest"]),
                str(d["blob_digest"]),
                int(d["blob_size"]),
                tuple((int(o), int(n)) for o, n in d["ranges"]),
                str(d.get("workload", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LayerCorrupt(f"not a read profile: {e}") from e

    def merged(self, other: ReadProfile) -> ReadProfile:
        """This profile's ranges, then ``other``'s not already listed (same blob only)."""
        if (other.blob_digest, other.blob_size) != (self.blob_digest, self.blob_size):
            raise LayerCorrupt(
                f"profiles of different blobs: {self.blob_digest} and {other.blob_digest}",
                digest=self.blob_digest,
            )
        trace = AccessTrace()
        for offset, length in self.ranges + other.ranges:
            trace.touch(offset, length)
        workload = ", ".join(w for w in (self.workload, other.workload) if w)
        return ReadProfile(
            self.layer_digest, self.blob_digest, self.blob_size, tuple(trace.ranges()), workload
        )


def plan_layout(
    blob_size: int,
    ranges: list[tuple[int, int]] | tuple[tuple[int, int], ...],
    page_size: int = PAGE_SIZE,
) -> tuple[tuple[Extent, ...], int]:
    """A permutation of the blob's pages: ``ranges`` first (in order, each page once, clipped
    to the blob), then every other page in its original order.

    Returns (extents, hot): extents (logical, physical, length) sorted by logical offset,
    covering the blob exactly once on both sides, adjacent extents that are contiguous on both
    sides merged; and how many bytes ``ranges`` cover, i.e. the stored prefix they were put
    in. The last page may be short.
    """
    pages = -(-blob_size // page_size)
    placed: dict[int, int] = {}  # logical page -> physical page
    for offset, length in ranges:
        if length <= 0 or offset < 0:
            continue
        first = offset // page_size
        last = min(pages - 1, (offset + length - 1) // page_size)
        for page in range(first, last + 1):
            if page not in placed:
                placed[page] = len(placed)
    nxt = len(placed)
    order = [0] * pages
    for page in range(pages):
        if page in placed:
            order[page] = placed[page]
        else:
            order[page] = nxt
            nxt += 1
    # A short last page must stay last physically too, or it would leave a hole mid-blob.
    if pages and blob_size % page_size and order[pages - 1] != pages - 1:
        moved = order[pages - 1]
        order = [p - 1 if p > moved else p for p in order]
        order[pages - 1] = pages - 1
    extents: list[list[int]] = []
    for page, phys in enumerate(order):
        if extents and extents[-1][1] + extents[-1][2] == phys:
            extents[-1][2] += 1
        else:
            extents.append([page, phys, 1])
    out = []
    for logical, phys, n in extents:
        length = min(n * page_size, blob_size - logical * page_size)
        out.append((logical * page_size, phys * page_size, length))
    return tuple(out), min(blob_size, len(placed) * page_size)


def check_layout(layout: tuple[Extent, ...], blob_size: int) -> None:
    """Raise ``LayerCorrupt`` unless ``layout`` maps [0, blob_size) one-to-one onto itself."""

    def contiguous(key: int) -> bool:
        at = 0
        for extent in sorted(layout, key=lambda e: e[key]):
            if extent[key] != at or extent[2] <= 0:
                return False
            at += extent[2]
        return at == blob_size

    if not (contiguous(0) and contiguous(1)):
        raise LayerCorrupt(
            f"blob layout does not map {blob_size} bytes one-to-one", extents=len(layout)
        )


def write_packed(blob: Path | str, layout: tuple[Extent, ...], dest: Path | str) -> None:
    """Write ``blob``'s bytes to ``dest`` in physical order (``dest`` is replaced atomically)."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp")
    try:
        with open(blob, "rb") as src, open(tmp, "wb") as out:
            for logical, _, length in sorted(layout, key=lambda e: e[1]):
                for at in range(logical, logical + length, 8 << 20):
                    n = min(8 << 20, logical + length - at)
                    data = os.pread(src.fileno(), n, at)
                    if len(data) != n:
                        raise LayerCorrupt(
                            f"{blob} is shorter than its layout says", path=str(blob)
                        )
                    out.write(data)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
