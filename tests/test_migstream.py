"""``dsec_core.vm.migstream`` on streams built here in QEMU's format (the pure parsing; the
microVM tests split real QEMU streams and load them)."""

from __future__ import annotations

import io
import struct

import pytest

from dsec_core.vm.migstream import (
    END,
    EOF,
    F_CONTINUE,
    F_EOS,
    F_MEM_SIZE,
    F_PAGE,
    F_ZERO,
    FOOTER,
    FULL,
    MAGIC,
    PAGE,
    PART,
    START,
    StreamFormatError,
    split_stream,
)

RAM = b"microvm.ram"
RAM_SIZE = 16 * PAGE
ROM = b"pc.bios"
PMEM = b"pm0"


def _name(s: bytes) -> bytes:
    return bytes([len(s)]) + s


def _section(kind: int, sid: int, idstr: bytes | None = None) -> bytes:
    head = bytes([kind]) + sid.to_bytes(4, "big")
    if idstr is not None:
        head += _name(idstr) + struct.pack(">II", 0, 4)
    return head


def _footer(sid: int) -> bytes:
    return bytes([FOOTER]) + sid.to_bytes(4, "big")


def _page(offset: int, block: bytes | None, data: bytes | None) -> bytes:
    """A page record: ``data`` (4 KiB) or a zero page (None); ``block`` None is CONTINUE."""
    flags = (F_PAGE if data is not None else F_ZERO) | (F_CONTINUE if block is None else 0)
    out = (offset | flags).to_bytes(8, "big")
    if block is not None:
        out += _name(block)
    return out + (data if data is not None else b"\0")


def _stream(pages: bytes, device: bytes = b"DEVICES") -> tuple[bytes, bytes]:
    """A whole stream around ``pages`` (in one PART), and its device tail."""
    blocks = [(RAM, RAM_SIZE), (ROM, 2 * PAGE), (PMEM, 4 * PAGE)]
    total = sum(n for _, n in blocks)
    setup = (total | F_MEM_SIZE).to_bytes(8, "big")
    setup += b"".join(_name(b) + n.to_bytes(8, "big") for b, n in blocks)
    setup += F_EOS.to_bytes(8, "big")
    tail = _section(FULL, 2, b"cpu") + device + _footer(2) + bytes([EOF]) + b"vmdesc"
    stream = (
        struct.pack(">II", MAGIC, 3)
        + bytes([7])
        + (4).to_bytes(4, "big")
        + b"q35x"
        + _section(START, 0, b"ram")
        + setup
        + _footer(0)
        + _section(PART, 0)
        + pages
        + F_EOS.to_bytes(8, "big")
        + _footer(0)
        + _section(END, 0)
        + F_EOS.to_bytes(8, "big")
        + _footer(0)
        + tail
    )
    return stream, tail


def test_the_ram_blocks_pages_go_to_the_file_and_the_rest_stays_in_order(tmp_path):
    a, b, c = (bytes([i]) * PAGE for i in (1, 2, 3))
    pages = (
        _page(0, RAM, a)
        + _page(PAGE, None, b)  # CONTINUE: still the RAM block
        + _page(2 * PAGE, None, None)  # a zero page: a hole
        + _page(0, ROM, c)  # another block: kept, named
        + _page(PAGE, None, None)  # CONTINUE of the ROM: kept as it was
        + _page(0, PMEM, a)  # a dropped block: nowhere
        + _page(5 * PAGE, RAM, c)
        + _page(PAGE, None, None)  # the RAM page sent again, as zero: cleared
    )
    stream, tail = _stream(pages)
    state, ram = io.BytesIO(), tmp_path / "vm.ram"
    stats = split_stream(io.BufferedReader(io.BytesIO(stream)), state, ram, "microvm.ram", ["pm0"])
    data = ram.read_bytes()
    assert len(data) == RAM_SIZE
    assert data[:PAGE] == a and data[PAGE : 2 * PAGE] == bytes(PAGE)
    assert data[5 * PAGE : 6 * PAGE] == c and data[6 * PAGE :] == bytes(RAM_SIZE - 6 * PAGE)
    assert (stats.data_pages, stats.zero_pages, stats.dropped_pages) == (3, 2, 1)
    out = state.getvalue()
    # what stays: the ROM's two records, named then CONTINUE, and every section around them
    kept = _page(0, ROM, c) + _page(PAGE, None, None)
    expected, _ = _stream(kept)
    assert out == expected and out.endswith(tail)
    assert stats.state_bytes == len(out)


def test_a_stream_it_does_not_parse_is_a_format_error_and_leaves_no_file(tmp_path):
    xbzrle = (0 | 0x40).to_bytes(8, "big") + _name(RAM) + b"\0" * 16
    stream, _ = _stream(_page(0, RAM, b"\1" * PAGE) + xbzrle)
    ram = tmp_path / "vm.ram"
    with pytest.raises(StreamFormatError, match="XBZRLE"):
        split_stream(io.BufferedReader(io.BytesIO(stream)), io.BytesIO(), ram, "microvm.ram")
    assert not ram.exists()
    for bad, why in (
        (b"not a stream at all", "not a QEMU migration stream"),
        (_stream(b"")[0][:40], "ends early"),
    ):
        with pytest.raises(StreamFormatError, match=why):
            split_stream(io.BufferedReader(io.BytesIO(bad)), io.BytesIO(), ram, "microvm.ram")
        assert not ram.exists()
    with pytest.raises(StreamFormatError, match=r"no RAM block 'pc\.ram'"):
        split_stream(io.BufferedReader(io.BytesIO(stream)), io.BytesIO(), ram, "pc.ram")
