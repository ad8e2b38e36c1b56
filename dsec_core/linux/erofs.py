"""EROFS images made with erofs-utils (``mkfs.erofs``), reproducibly.

Every image gets one fixed UUID and a zeroed superblock build time (with per-file mtimes kept),
so the same tree always gives the same bytes and thus the same digest. ``mkfs_erofs`` makes a
monolithic lz4hc image; ``mkfs_erofs_split`` writes a metadata image and a separate chunked data
blob (``--blobdev``), the on-demand form of a layer.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Sequence
from pathlib import Path

from ..errors import LayerBuildError
from .tools import run_tool

__all__ = ["LAYER_UUID", "mkfs_erofs", "mkfs_erofs_split", "zero_build_time"]

# One UUID for every layer: a random one would make each build of the same tree unique.
LAYER_UUID = str(uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/dsec/layers"))


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def _crc32c(data: bytes, crc: int = 0xFFFFFFFF) -> int:
    """CRC32C as erofs uses it for the superblock: seed ~0, no final inversion."""
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


_SB_OFFSET = 1024
_EROFS_MAGIC = 0xE0F5E1E2
_SB_CHKSUM = 0x1


def zero_build_time(image: Path) -> None:
    """Set the superblock's build time to 0 and fix its checksum.

    erofs-utils 1.5 can fix the build time only together with every file's mtime (``-T``),
    and real mtimes matter: Python's .pyc files check them. With ``force-inode-extended`` every
    inode carries its own mtime, so the build time is not read for anything else.
    """
    with open(image, "r+b") as f:
        head = bytearray(f.read(_SB_OFFSET + 4096))
        magic, _, compat, blkszbits = struct.unpack_from("<IIIB", head, _SB_OFFSET)
        if magic != _EROFS_MAGIC:
            raise LayerBuildError(f"{image} is not an EROFS image", path=str(image))
        struct.pack_into("<QI", head, _SB_OFFSET + 24, 0, 0)
        if compat & _SB_CHKSUM:
            end = max(1 << blkszbits, _SB_OFFSET + 128)
            struct.pack_into("<I", head, _SB_OFFSET + 4, 0)
            struct.pack_into("<I", head, _SB_OFFSET + 4, _crc32c(bytes(head[_SB_OFFSET:end])))
        f.seek(0)
        f.write(head)


def mkfs_erofs(
    tree: Path,
    image: Path,
    *,
    all_root: bool,
    timestamp: int | None = None,
    exclude: Sequence[str] = (),
    compression: str | None = "lz4hc",
    timeout: float | None = None,
) -> Path:
    """An lz4hc-compressed EROFS image of ``tree`` at ``image``, reproducibly.

    ``all_root`` makes every file owned by root; ``timestamp`` gives every file that mtime
    (else per-file mtimes are kept and the build time is zeroed). ``exclude``: paths relative
    to ``tree`` (no leading ``/``) left out with everything below them. ``compression``:
    ``lz4hc`` (smallest, slowest: 12 s for 40 MiB of mixed data here), ``lz4`` (0.7 s) or
    None (stored as is: 0.07 s, a third larger). ``ToolError`` on failure, or past
    ``timeout`` seconds.
    """
    cmd = ["mkfs.erofs", f"-U{LAYER_UUID}", "--quiet"]
    if compression:
        cmd.append(f"-z{compression}")
    cmd += [f"--exclude-path={path}" for path in exclude]
    if timestamp is not None:
        cmd.append(f"-T{int(timestamp)}")
    else:
        cmd.append("-Eforce-inode-extended")
    if all_root:
        cmd.append("--all-root")
    run_tool([*cmd, str(image), str(tree)], "mkfs.erofs", timeout=timeout)
    if timestamp is None:
        zero_build_time(image)
    return image


def mkfs_erofs_split(tree: Path, meta: Path, blob: Path, chunk_size: int) -> None:
    """Write ``tree`` as metadata image ``meta`` plus chunked data blob ``blob``.

    Owners, modes, mtimes and xattrs are taken from the tree as they are; file data is stored
    uncompressed (erofs-utils 1.5 cannot compress chunked files), identical chunks once. Same
    UUID and per-file mtimes as ``mkfs_erofs``, so one tree always splits into the same bytes.
    """
    run_tool(
        [
            "mkfs.erofs",
            f"-U{LAYER_UUID}",
            "--quiet",
            "-Eforce-inode-extended",
            f"--blobdev={blob}",
            f"--chunksize={chunk_size}",
            str(meta),
            str(tree),
        ],
        "mkfs.erofs (split)",
    )
    zero_build_time(meta)
