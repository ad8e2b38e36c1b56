"""XFS filesystem images for sandboxes' writable layers, the other format besides ext4: with
reflink, as production fleets often run (DSec's disks are XFS), so what a sandbox does with
extent-sharing ioctls (FICLONE, FIDEDUPERANGE) behaves as it would there.

Images are formatted once (``mkfs.xfs``) and copied per sandbox, so every copy carries the same
filesystem UUID: they are mounted ``nouuid`` (XFS refuses a second mount of a UUID otherwise).
XFS needs 300 MiB at the least. Mounted ``nosuid,nodev`` like the ext4 images; XFS has no
``nobarrier`` any more, so cache flushes from the sandbox still reach the host's disk.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidSpec
from .mounts import MS_NODEV, MS_NOSUID, mount
from .tools import run_tool

__all__ = ["MIN_SIZE", "mkfs_xfs", "mount_xfs"]

MIN_SIZE = 300 << 20  # mkfs.xfs refuses smaller filesystems
BLOCK_SIZE = 4096


def mkfs_xfs(image: Path, size: int) -> None:
    """Make ``image`` a sparse ``size``-byte file holding a fresh, empty XFS filesystem with
    reflink (root directory owned by root). ``ToolError`` if ``mkfs.xfs`` fails or is missing;
    ``InvalidSpec`` (field ``disk``) below ``MIN_SIZE``."""
    if size < MIN_SIZE or size % BLOCK_SIZE:
        raise InvalidSpec(
            f"an XFS writable layer needs at least {MIN_SIZE >> 20} MiB in whole {BLOCK_SIZE}-byte "
            f"blocks, got {size} bytes",
            field="disk",
        )
    with open(image, "xb") as f:
        f.truncate(size)
    try:
        run_tool(
            # 4 KiB sectors too: the direct-I/O loop device it is mounted from has 4 KiB logical
            # blocks, and XFS refuses (ENOSYS) a 512-byte-sector filesystem there.
            [
                "mkfs.xfs",
                "-q",
                "-f",
                "-K",
                "-b",
                f"size={BLOCK_SIZE}",
                "-s",
                f"size={BLOCK_SIZE}",
                "-m",
                "reflink=1,crc=1",
                image,
            ],
            f"formatting the disk image {image}",
        )
    except BaseException:
        image.unlink(missing_ok=True)
        raise


def mount_xfs(device: Path, target: Path, flags: int = 0) -> None:
    """Mount the XFS filesystem on ``device`` at ``target``, nosuid and nodev (plus ``flags``),
    ``nouuid`` since every image is a copy of one template. ``MountError`` on failure."""
    mount(os.fspath(device), target, "xfs", MS_NOSUID | MS_NODEV | flags, "nouuid")
