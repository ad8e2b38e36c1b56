"""A QEMU migration stream split in two: the guest's RAM into a file a later QEMU maps, and
the rest (devices, and the pages of any other RAM block) into a smaller stream it loads.

``QemuBackend`` saves a VM (a pause, a memory snapshot, a start template) by migrating it
into a pipe and ``split_stream`` reads it as it comes: the pages of the guest's RAM block
(``microvm.ram`` or ``pc.ram``) go into ``ram``, a sparse file of the block's size (a page
never written, or written as zero, stays a hole); the pages of ``drop`` blocks, read-only
files the loading QEMU maps again (virtio-pmem layers), go nowhere; everything else is
written to ``state`` unchanged. A QEMU started with its RAM as ``ram`` mapped privately
(``memory-backend-file,share=off``) and ``-incoming`` from ``state`` is the saved VM, and
every QEMU started so shares the file's pages in the host's page cache until its guest
writes one: n clones of a VM hold its memory about once, not n times, and a clone starts
without reading the memory it never touches.

The format is QEMU's own (``migration/savevm.c`` and ``migration/ram.c``, unchanged from 2.x
through 7.2 for what is parsed here): a header, an optional configuration section, then
sections (a type byte, a section id, for START and FULL the handler's name, instance and
version; each ends with a footer). ``ram``'s START holds the block list, its PART and END
sections hold pages (a be64 offset ORed with flags, the block's name unless CONTINUE, then a
zero byte or 4 KiB of data) up to an EOS mark. The device sections that follow are copied
whole, unparsed. A stream with anything else (a subsection in the configuration, compressed
or XBZRLE pages, another iterative handler) is ``StreamFormatError``: the caller keeps the
whole stream instead.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["RAM_BLOCKS", "SplitStats", "StreamFormatError", "split_stream"]

MAGIC = 0x5145564D  # "QEVM"
VERSION = 3
#: Section types (savevm.c).
EOF, START, PART, END, FULL, SUBSECTION, CONFIGURATION, FOOTER = (
    0x00,
    0x01,
    0x02,
    0x03,
    0x04,
    0x05,
    0x07,
    0x7E,
)
#: Page record flags (ram.c), in the low bits of a page's offset.
F_ZERO, F_MEM_SIZE, F_PAGE, F_EOS, F_CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
F_UNSUPPORTED = 0x01 | 0x40 | 0x80 | 0x100 | 0x200  # full, XBZRLE, hook, compressed, flush
FLAGS = 0xFFF
PAGE = 4096
#: The guest RAM block of each machine (the implicit memory backend's id).
RAM_BLOCKS = {"microvm": "microvm.ram", "q35": "pc.ram"}
#: Bytes copied at a time once the device sections begin.
_COPY = 1 << 20


class StreamFormatError(ValueError):
    """The stream holds something this splitter does not parse (or ends early)."""


@dataclass
class SplitStats:
    """What a split moved: pages into the RAM file (data, zero) and pages dropped."""

    ram_bytes: int = 0  # the RAM block's size (the file's length)
    data_pages: int = 0
    zero_pages: int = 0
    dropped_pages: int = 0
    state_bytes: int = 0


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def exact(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise StreamFormatError(f"the stream ends early ({len(data)} of {n} bytes)")
        return data

    def byte(self) -> int:
        return self.exact(1)[0]

    def be32(self) -> int:
        return int.from_bytes(self.exact(4), "big")

    def be64(self) -> int:
        return int.from_bytes(self.exact(8), "big")

    def name(self) -> bytes:
        return self.exact(self.byte())


class _RamFile:
    """The RAM block's pages, written in runs of adjacent pages."""

    def __init__(self, path: Path, size: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(self.fd, size)
        self.size = size
        self.run_at = -1
        self.run: list[bytes] = []
        self.written: set[int] = set()  # offsets holding data (a zero page over one clears it)

    def page(self, offset: int, data: bytes) -> None:
        if offset + PAGE > self.size:
            raise StreamFormatError(f"a page at {offset:#x} beyond the RAM block's end")
        if self.run and offset == self.run_at + PAGE * len(self.run) and len(self.run) < 256:
            self.run.append(data)
        else:
            self.flush()
            self.run_at, self.run = offset, [data]
        self.written.add(offset)

    def zero(self, offset: int) -> None:
        if offset in self.written:  # sent again as zero after data: clear it
            self.flush()
            os.pwrite(self.fd, bytes(PAGE), offset)
            self.written.discard(offset)

    def flush(self) -> None:
        if self.run:
            os.pwrite(self.fd, b"".join(self.run), self.run_at)
            self.run = []

    def close(self) -> None:
        try:
            self.flush()
        finally:
            os.close(self.fd)


def split_stream(
    source: BinaryIO,
    state: BinaryIO,
    ram: Path,
    block: str,
    drop: Collection[str] = (),
) -> SplitStats:
    """Read a migration stream from ``source`` to its end; write ``block``'s pages into the new
    file ``ram`` (of the block's size) and the rest to ``state``. ``StreamFormatError`` for a
    stream this does not parse; ``ram`` is then removed."""
    r = _Reader(source)
    stats = SplitStats()
    out = bytearray()
    want, dropped = block.encode(), {d.encode() for d in drop}
    ram_file: _RamFile | None = None
    try:
        if r.be32() != MAGIC or r.be32() != VERSION:
            raise StreamFormatError("not a QEMU migration stream (version 3)")
        out += struct.pack(">II", MAGIC, VERSION)
        ram_section: int | None = None
        last: bytes | None = None  # the block of the last page (CONTINUE)
        while True:
            kind = r.byte()
            if kind == CONFIGURATION:
                length = r.be32()
                out += bytes([kind]) + length.to_bytes(4, "big") + r.exact(length)
                if source.peek(1)[:1] == bytes([SUBSECTION]):  # type: ignore[attr-defined]
                    raise StreamFormatError("a configuration subsection")
                continue
            if kind in (START, FULL):
                sid = r.be32()
                idstr = r.name()
                instance, version = r.be32(), r.be32()
                head = (
                    bytes([kind])
                    + sid.to_bytes(4, "big")
                    + bytes([len(idstr)])
                    + idstr
                    + struct.pack(">II", instance, version)
                )
                if kind == START and idstr == b"ram":
                    ram_section = sid
                    out += head
                    size = _ram_setup(r, out, want)
                    stats.ram_bytes = size
                    ram_file = _RamFile(ram, size)
                    _footer(r, out, sid)
                    continue
                if kind == START:
                    raise StreamFormatError(f"an iterative section {idstr!r} besides ram")
                # the device sections: the rest of the stream, copied whole
                stats.state_bytes += _copy_rest(source, state, bytes(out) + head)
                break
            if kind in (PART, END):
                sid = r.be32()
                if sid != ram_section or ram_file is None:
                    raise StreamFormatError(f"a PART/END of section {sid}, not ram's")
                out += bytes([kind]) + sid.to_bytes(4, "big")
                last = _pages(r, out, ram_file, want, dropped, last, stats)
                _footer(r, out, sid)
                if len(out) > _COPY:
                    state.write(out)
                    stats.state_bytes += len(out)
                    out.clear()
                continue
            if kind == EOF:  # no device sections (not a VM QEMU saves)
                stats.state_bytes += _copy_rest(source, state, bytes(out) + bytes([kind]))
                break
            raise StreamFormatError(f"a section of type {kind:#x}")
        if ram_file is None:
            raise StreamFormatError("no ram section")
    except BaseException:
        if ram_file is not None:
            ram_file.close()
            ram_file = None
        ram.unlink(missing_ok=True)
        raise
    finally:
        if ram_file is not None:
            ram_file.close()
    return stats


def _copy_rest(source: BinaryIO, state: BinaryIO, first: bytes) -> int:
    """``first``, then the rest of ``source``, written to ``state``; the bytes written."""
    state.write(first)
    n = len(first)
    while chunk := source.read(_COPY):
        state.write(chunk)
        n += len(chunk)
    return n


def _ram_setup(r: _Reader, out: bytearray, want: bytes) -> int:
    """ram's START payload (the block list, copied) up to its EOS; ``want``'s size."""
    total = r.be64()
    if total & FLAGS != F_MEM_SIZE:
        raise StreamFormatError("ram's setup holds no block list")
    out += total.to_bytes(8, "big")
    total &= ~FLAGS
    size, seen = None, 0
    while seen < total:
        idstr = r.name()
        used = r.be64()
        out += bytes([len(idstr)]) + idstr + used.to_bytes(8, "big")
        if idstr == want:
            size = used
        seen += used
    if seen != total:
        raise StreamFormatError("ram's block list does not add up (postcopy or ignore-shared)")
    eos = r.be64()
    if eos != F_EOS:
        raise StreamFormatError("ram's setup does not end at EOS")
    out += eos.to_bytes(8, "big")
    if size is None:
        raise StreamFormatError(f"no RAM block {want.decode()!r} in the stream")
    return size


def _pages(
    r: _Reader,
    out: bytearray,
    ram_file: _RamFile,
    want: bytes,
    dropped: set[bytes],
    last: bytes | None,
    stats: SplitStats,
) -> bytes | None:
    """Page records up to an EOS: ``want``'s into the file, ``dropped``'s nowhere, the rest
    copied. Returns the last page's block (a CONTINUE in the next section refers to it)."""
    while True:
        word = r.be64()
        flags = word & FLAGS
        if flags & F_EOS:
            if flags != F_EOS:
                raise StreamFormatError(f"page flags {flags:#x}")
            out += word.to_bytes(8, "big")
            return last
        if flags & F_UNSUPPORTED or not flags & (F_ZERO | F_PAGE):
            raise StreamFormatError(f"page flags {flags:#x} (compression, XBZRLE?)")
        name = b""
        if flags & F_CONTINUE:
            if last is None:
                raise StreamFormatError("a CONTINUE page before any block")
        else:
            name = r.name()
            last = name
        offset = word & ~FLAGS
        data = r.exact(1) if flags & F_ZERO else r.exact(PAGE)
        if last == want:
            if flags & F_ZERO:
                if data != b"\0":
                    raise StreamFormatError("a zero page filled with a non-zero byte")
                ram_file.zero(offset)
                stats.zero_pages += 1
            else:
                ram_file.page(offset, data)
                stats.data_pages += 1
        elif last in dropped:
            stats.dropped_pages += 1
        else:
            out += word.to_bytes(8, "big")
            if name:
                out += bytes([len(name)]) + name
            out += data


def _footer(r: _Reader, out: bytearray, sid: int) -> None:
    if r.byte() != FOOTER or r.be32() != sid:
        raise StreamFormatError(f"section {sid} ends without its footer")
    out += bytes([FOOTER]) + sid.to_bytes(4, "big")
