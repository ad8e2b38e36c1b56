"""Loop devices: attach an image file to a free ``/dev/loopN`` through ``/dev/loop-control``, and
find which loop devices a directory's files are bound to.

Devices are attached with ``LO_FLAGS_AUTOCLEAR``: the kernel detaches one when its last user
goes (the caller's descriptor, then the filesystem mounted from it), so an unmount is the whole
clean-up and a crash between attach and mount leaves nothing bound. Direct I/O keeps the
image's blocks out of the host's page cache: the filesystem on the device caches them already,
and caching them twice would cost a dense node memory for nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import MountError

__all__ = ["LoopDevice", "attach_loop", "loop_backing_files"]

LOOP_CONTROL = "/dev/loop-control"
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_READ_ONLY = 1
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
# struct loop_config: fd, block_size, struct loop_info64 (232 bytes), 8 reserved u64.
_LOOP_INFO64 = struct.Struct("=5Q4I64s64s32s2Q")
_SYS_BLOCK = Path("/sys/block")
_ATTACH_TRIES = 64  # other processes on the host may take the device we were offered


@dataclass
class LoopDevice:
    """An attached loop device and the open descriptor that keeps it attached until the
    filesystem on it is mounted: ``close()`` it then (or on failure, which detaches it)."""

    path: Path
    fd: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> LoopDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _config(backing_fd: int, direct_io: bool, read_only: bool = False) -> bytes:
    flags = LO_FLAGS_AUTOCLEAR | (LO_FLAGS_DIRECT_IO if direct_io else 0)
    flags |= LO_FLAGS_READ_ONLY if read_only else 0
    info = _LOOP_INFO64.pack(0, 0, 0, 0, 0, 0, 0, 0, flags, b"", b"", b"", 0, 0)
    # Direct I/O needs the device's blocks to be the backing filesystem's: 4 KiB everywhere
    # we run. Zero keeps the kernel's default (512) for buffered devices.
    return struct.pack("=II", backing_fd, 4096 if direct_io else 0) + info + bytes(64)


def attach_loop(image: Path, *, direct_io: bool = True, read_only: bool = False) -> LoopDevice:
    """Bind ``image`` (read-write, or ``read_only``: the device refuses writes) to a free loop
    device with autoclear; ``MountError`` if there is no loop support or no device could be
    had. Falls back to buffered I/O where the backing filesystem cannot do direct I/O."""
    try:
        ctl = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise MountError(
            f"no loop devices: cannot open {LOOP_CONTROL}: {e.strerror}",
            errno=e.errno,
            target=os.fspath(image),
        ) from e
    try:
        backing = os.open(image, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
    except OSError as e:
        os.close(ctl)
        raise MountError(
            f"cannot open disk image {image}: {e.strerror}", errno=e.errno, target=os.fspath(image)
        ) from e
    try:
        busy = 0
        while True:
            path, dev = _free_device(ctl, image)
            try:
                try:
                    fcntl.ioctl(dev, LOOP_CONFIGURE, _config(backing, direct_io, read_only))
                except OSError as e:
                    if e.errno != errno.EINVAL or not direct_io:
                        raise
                    fcntl.ioctl(dev, LOOP_CONFIGURE, _config(backing, False, read_only))
            except OSError as e:
                os.close(dev)
                busy += 1
                if e.errno == errno.EBUSY and busy < _ATTACH_TRIES:  # someone bound it first
                    continue
                raise MountError(
                    f"cannot attach {image} to {path}: {e.strerror}",
                    errno=e.errno,
                    target=os.fspath(image),
                ) from e
            return LoopDevice(path, dev)
    finally:
        os.close(backing)
        os.close(ctl)


def _free_device(ctl: int, image: Path) -> tuple[Path, int]:
    """The path and an open descriptor of the loop device the kernel offers as free."""
    for attempt in range(100):
        try:
            n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            path = Path(f"/dev/loop{n}")
            return path, os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            # devtmpfs adds a new device's node at once, a udev-managed /dev a moment later
            if e.errno != errno.ENOENT or attempt == 99:
                raise MountError(
                    f"cannot get a free loop device: {e.strerror}",
                    errno=e.errno,
                    target=os.fspath(image),
                ) from e
            time.sleep(0.005)
    raise AssertionError("unreachable")


def loop_backing_files(prefix: Path) -> dict[str, str]:
    """Loop devices bound to files at or below ``prefix``: ``{"/dev/loopN": backing file}``
    (a deleted file keeps its name with `` (deleted)`` after it)."""
    pre = os.fspath(prefix).rstrip("/") + "/"
    found = {}
    for entry in _SYS_BLOCK.glob("loop*/loop/backing_file"):
        try:
            backing = entry.read_text().rstrip("\n")
        except OSError:  # detached while we looked
            continue
        if backing.startswith(pre):
            found[f"/dev/{entry.parent.parent.name}"] = backing
    return dict(sorted(found.items()))
