"""The "newc" cpio archive the Linux kernel unpacks as its initramfs, written without the cpio
program: ``CpioEntry`` records in, archive bytes out (uncompressed, as the kernel unpacks that
fastest; under TCG decompression is emulated instruction by instruction)."""

from __future__ import annotations

import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["CpioEntry", "write_newc"]

_MAGIC = b"070701"
_TRAILER = "TRAILER!!!"


@dataclass(frozen=True)
class CpioEntry:
    """One archive member: ``path`` inside the archive (no leading ``/``), full ``st_mode``
    (type and permissions), ``data`` (a symlink's target for a link), ``rdev`` for a device
    node as ``(major, minor)``. Owner is root and the time is 0, so archives are reproducible."""

    path: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)

    @classmethod
    def directory(cls, path: str, perm: int = 0o755) -> CpioEntry:
        return cls(path, stat.S_IFDIR | perm)

    @classmethod
    def file(cls, path: str, data: bytes, perm: int = 0o644) -> CpioEntry:
        return cls(path, stat.S_IFREG | perm, data)

    @classmethod
    def symlink(cls, path: str, target: str) -> CpioEntry:
        return cls(path, stat.S_IFLNK | 0o777, target.encode())

    @classmethod
    def char_device(cls, path: str, major: int, minor: int, perm: int = 0o600) -> CpioEntry:
        return cls(path, stat.S_IFCHR | perm, rdev=(major, minor))


def _pad(n: int) -> bytes:
    return b"\0" * (-n % 4)


def _header(entry: CpioEntry, ino: int) -> bytes:
    name = entry.path.encode() + b"\0"
    nlink = 2 if stat.S_ISDIR(entry.mode) else 1
    fields = (ino, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0, *entry.rdev, len(name), 0)
    head = _MAGIC + b"".join(b"%08X" % v for v in fields) + name
    return head + _pad(len(head))


def write_newc(out: BinaryIO, entries: Iterable[CpioEntry]) -> None:
    """Write ``entries`` in the given order (parents before children, as the kernel creates
    them in order) and the trailer."""
    ino = 0
    for ino, entry in enumerate(entries, start=1):
        out.write(_header(entry, ino))
        out.write(entry.data)
        out.write(_pad(len(entry.data)))
    out.write(_header(CpioEntry(_TRAILER, 0), ino + 1))
