"""The guest kernel unpacked from its bzImage (``ensure_vmlinux``), so QEMU boots it through its
PVH entry point and the guest does not decompress it itself.

Under TCG, Debian's xz-compressed ``vmlinuz`` takes about 3.5 s to decompress in the guest
(emulated), more than half of the boot of a q35 display guest to its first frame; the host
does it in about a second, once per kernel. QEMU loads an uncompressed ``vmlinux`` that has a
PVH ELF note (``CONFIG_PVH``, set in Debian's kernels) with ``-kernel`` on q35 and microvm.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import shutil
import struct
import subprocess
from pathlib import Path

from ..errors import GuestImageError

__all__ = ["ensure_vmlinux", "vmlinux_from_bzimage"]

_XZ = b"\xfd7zXZ\x00"
_GZIP = b"\x1f\x8b"
_LZ4_LEGACY = b"\x02!L\x18"  # Debian's cloud kernels: lz4 -l, decompressed by the lz4 tool


def vmlinux_from_bzimage(bzimage: bytes) -> bytes:
    """The ELF ``vmlinux`` inside a bzImage, found through its setup header (``payload_offset``
        and ``payload_length``, boot protocol 2.08 and later). xz and gzip payloads are handled,
        and lz4 (legacy frames, through the ``lz4`` program: Python has no lz4 of its own); anything
    else, or a file that is not a bzImage, is a ``GuestImageError``."""
    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != b"HdrS":
        raise GuestImageError("not a bzImage (no HdrS setup header)")
    (version,) = struct.unpack_from("<H", bzimage, 0x206)
    if version < 0x208:
        raise GuestImageError(f"bzImage boot protocol {version:#x} has no payload fields")
    setup_sects = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + offset
    payload = bzimage[start : start + length]
    try:
        if payload.startswith(_XZ):
            out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
        elif payload.startswith(_GZIP):
            out = gzip.decompress(payload)
        elif payload.startswith(_LZ4_LEGACY):
            out = _unlz4(payload)
        else:
            raise GuestImageError(f"bzImage payload compression {payload[:6]!r} is not handled")
    except (lzma.LZMAError, OSError, EOFError) as e:
        raise GuestImageError(f"bzImage payload does not decompress: {e}") from e
    if not out.startswith(b"\x7fELF"):
        raise GuestImageError("bzImage payload is not an ELF vmlinux")
    return out


def _unlz4(payload: bytes) -> bytes:
    """An lz4 legacy-frame payload decompressed (the kernel appends its size, which lz4 reads
    as a frame of garbage after the data: the data is what counts)."""
    lz4 = shutil.which("lz4")
    if lz4 is None:
        raise GuestImageError("the kernel is lz4-compressed: install lz4 (apt-get install lz4)")
    proc = subprocess.run([lz4, "-dc"], input=payload, capture_output=True)
    if not proc.stdout.startswith(b"\x7fELF"):
        raise GuestImageError(
            "bzImage payload does not decompress with lz4",
            command=[lz4, "-dc"],
            exit_code=proc.returncode,
            stderr=proc.stderr.decode(errors="replace"),
        )
    return proc.stdout


def ensure_vmlinux(vmlinuz: Path, cache_dir: Path) -> Path:
    """``cache_dir/vmlinux-<digest>``, the uncompressed kernel of ``vmlinuz`` (digest of the
    ``vmlinuz`` bytes), written first if missing; written under a temporary name and renamed,
    so concurrent callers never boot half a kernel."""
    data = Path(vmlinuz).read_bytes()
    target = Path(cache_dir) / f"vmlinux-{hashlib.sha256(data).hexdigest()[:16]}"
    if target.exists():
        return target
    elf = vmlinux_from_bzimage(data)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        tmp.write_bytes(elf)
        os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
