"""Files: atomic writes, sparse files held in memory, sha256 digests of files, and removing trees
that may hold mounts."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidSpec, LayerBuildError
from .mounts import mounted_under

__all__ = ["SparseFile", "copy_sparse", "digest_hex", "file_digest", "remove_tree", "write_atomic"]

_CHUNK = 1 << 20
_DIRECT_ALIGN = 4096  # O_DIRECT offsets and lengths: the logical block size, at most this


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a
    part: a temporary file in the same directory, fsync'd, then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def copy_sparse(src: Path, dst: Path, mode: int = 0o600) -> None:
    """Copy ``src`` to the new file ``dst`` extent by extent (``SEEK_DATA``/``SEEK_HOLE``,
    in-kernel ``copy_file_range``): its holes stay holes, nothing passes through our memory.
    Between two file systems the kernel may refuse ``copy_file_range`` (EXDEV; the soak's
    node homes on a file system of their own met it saving a VM template): the extents are
    then read and written. A failed copy leaves no ``dst``."""
    fd_in = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except BaseException:
        os.close(fd_in)
        raise
    try:
        size = os.fstat(fd_in).st_size
        os.ftruncate(fd_out, size)
        offset = 0
        while offset < size:
            try:
                data = os.lseek(fd_in, offset, os.SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                break  # only a hole is left
            hole = os.lseek(fd_in, data, os.SEEK_HOLE)
            pos = data
            while pos < hole:
                n = _copy_range(fd_in, fd_out, hole - pos, pos)
                if n <= 0:
                    raise OSError(errno.EIO, f"copying {src}: short copy at {pos}")
                pos += n
            offset = hole
    except BaseException:
        os.close(fd_out)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        raise
    finally:
        os.close(fd_in)
    os.close(fd_out)


_COPY_CHUNK = 1 << 20
_NO_COPY_RANGE = (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _copy_range(fd_in: int, fd_out: int, count: int, pos: int) -> int:
    """Copy up to ``count`` bytes at ``pos`` from ``fd_in`` to the same offset of ``fd_out``:
    in the kernel where it can, else through a buffer. How many were copied."""
    try:
        return os.copy_file_range(fd_in, fd_out, count, pos, pos)
    except OSError as e:
        if e.errno not in _NO_COPY_RANGE:
            raise
    data = os.pread(fd_in, min(count, _COPY_CHUNK), pos)
    done = 0
    while done < len(data):
        done += os.pwrite(fd_out, memoryview(data)[done:], pos + done)
    return done


@dataclass(frozen=True)
class SparseFile:
    """A sparse file's size and data extents, ``(offset, bytes)``, held in memory: a formatted
    disk image is a few hundred KB of data in gigabytes of holes."""

    size: int
    extents: tuple[tuple[int, bytes], ...]

    @classmethod
    def read(cls, path: Path) -> SparseFile:
        extents = []
        with open(path, "rb") as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            offset = 0
            while offset < size:
                try:
                    data = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError as e:
                    if e.errno != errno.ENXIO:
                        raise
                    break  # only a hole is left
                hole = os.lseek(fd, data, os.SEEK_HOLE)
                extents.append((data, os.pread(fd, hole - data, data)))
                offset = hole
        return cls(size, tuple(extents))

    def write(self, dst: Path, mode: int = 0o600, direct: bool = False) -> None:
        """Write it to a new file ``dst`` (which must not exist), holes and all. With
        ``direct`` the data goes straight to the disk (``O_DIRECT``) where the filesystem
        allows it, not into the page cache: a loop device doing direct I/O on ``dst`` would
        otherwise have to write those pages back, synchronously, on its first reads. A failed
        write leaves no ``dst``."""
        aligned = all(
            o % _DIRECT_ALIGN == 0 and len(d) % _DIRECT_ALIGN == 0 for o, d in self.extents
        )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(dst, flags | (os.O_DIRECT if direct and aligned else 0), mode)
        except OSError as e:  # a filesystem without O_DIRECT (tmpfs): through the cache
            if e.errno != errno.EINVAL:
                raise
            fd = os.open(dst, flags, mode)
        try:
            os.ftruncate(fd, self.size)
            for offset, data in self.extents:
                with mmap.mmap(-1, len(data)) as buf:  # page-aligned, as O_DIRECT wants
                    buf.write(data)
                    done = 0
                    while done < len(data):
                        done += os.pwrite(fd, memoryview(buf)[done:], offset + done)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dst)
            raise
        os.close(fd)


def file_digest(path: Path, progress: Callable[[str, float | None], None] | None = None) -> str:
    """``"sha256:<hex>"`` of a file's bytes; ``progress("hash", fraction)`` as it goes."""
    h = hashlib.sha256()
    total = max(path.stat().st_size, 1)
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress("hash", min(done / total, 1.0))
    return f"sha256:{h.hexdigest()}"


def digest_hex(digest: str) -> str:
    """The 64 hex digits of ``sha256:<hex>`` (or of bare hex); ``InvalidSpec`` otherwise."""
    algo, _, hexpart = digest.partition(":")
    if not hexpart:
        algo, hexpart = "sha256", algo
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise InvalidSpec(
            f"bad layer digest {digest!r}: expected sha256:<64 hex digits>", digest=digest
        )
    return hexpart


def remove_tree(path: Path) -> None:
    """``rm -rf`` that first detaches mounts inside (debootstrap mounts /proc in its target).

    Deleting through a live /proc or /sys mount would be a disaster, so it refuses to go on
    if anything stays mounted.
    """
    if not os.path.lexists(path):
        return
    for point in mounted_under(path):
        subprocess.run(["umount", "-l", os.fspath(point)], capture_output=True)
    left = mounted_under(path)
    if left:
        raise LayerBuildError(
            f"cannot remove {path}: still mounted: {', '.join(map(os.fspath, left))}",
            path=str(path),
        )
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
