"""ext4 filesystem images: format a sparse image once (``mkfs.ext4``), clone it cheaply, and mount
it from a loop device with ``nosuid,nodev``.

The images hold sandboxes' writable layers, which live no longer than their sandbox and never
across a reboot, so they are made for a fast start rather than for crash recovery: no journal
(no jbd2 thread and no journal blocks per sandbox), no blocks reserved for root (root inside
is the user they would be kept from), no resize inode (its reserved descriptor blocks were
4.2 of the 4.4 MB a fresh 10 GiB image allocated), no backup superblocks (``sparse_super2``
with none: a 4 TiB image kept 42 of its 53 MB in them), lazily initialised inode tables that
the kernel is told not to zero behind our back (``noinit_itable``: the holes of a sparse
image read as zeros already). A formatted image then allocates about 100 KB at 16 MiB,
130 KB at 10 GiB, 2.6 MB at 1 TiB.

They are mounted ``nobarrier``: a loop device turns every cache flush into an fsync of its
image on the host, a journal commit of the host's filesystem, which took 2 to 60 ms on a busy
machine at each mount and unmount; and a sandbox calling fsync in a loop would force those
commits on every other user of the host's disk. Nothing on these filesystems has to survive
a power cut.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidSpec
from .mounts import MS_NODEV, MS_NOSUID, mount
from .tools import run_tool

__all__ = ["BLOCK_SIZE", "BYTES_PER_INODE", "MIN_SIZE", "mkfs_ext4", "mount_ext4"]

BLOCK_SIZE = 4096  # what a direct-I/O loop device on a 4 KiB host filesystem needs
BYTES_PER_INODE = 16384  # mke2fs's default for ordinary filesystems
MIN_SIZE = 16 << 20  # below this ext4's own metadata is most of the disk


def mkfs_ext4(image: Path, size: int) -> None:
    """Make ``image`` a sparse ``size``-byte file holding a fresh, empty ext4 filesystem (root
    directory owned by root, mode 0755). ``ToolError`` if ``mkfs.ext4`` fails or is missing."""
    if size < MIN_SIZE or size % BLOCK_SIZE:
        raise InvalidSpec(
            f"an ext4 image needs at least {MIN_SIZE >> 20} MiB in whole {BLOCK_SIZE}-byte "
            f"blocks, got {size} bytes",
            field="disk",
        )
    with open(image, "xb") as f:
        f.truncate(size)
    try:
        run_tool(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-b",
                BLOCK_SIZE,
                "-i",
                BYTES_PER_INODE,
                "-m",
                "0",
                "-O",
                "^has_journal,^resize_inode,sparse_super2",
                "-E",
                "num_backup_sb=0,lazy_itable_init=1,root_owner=0:0,nodiscard",
                image,
            ],
            f"formatting the disk image {image}",
        )
    except BaseException:
        image.unlink(missing_ok=True)
        raise


def mount_ext4(device: Path, target: Path, flags: int = 0) -> None:
    """Mount the ext4 filesystem on ``device`` at ``target`` with nosuid and nodev (plus
    ``flags``): nothing planted on it can be run with privileges or opened as a device from
    the host. No cache flushes, and no zeroing of inode tables (see above). ``MountError`` on
    failure."""
    opts = "noinit_itable,nobarrier"
    mount(os.fspath(device), target, "ext4", MS_NOSUID | MS_NODEV | flags, opts)
