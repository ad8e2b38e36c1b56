"""Sandboxes' writable layers, each on a filesystem of its own: a sparse ext4 image per sandbox
(or XFS with reflink, ``NodeConfig.disk_fs``), loop-mounted ``nosuid,nodev`` at its data
directory, whose size is the sandbox's disk quota.

Why a filesystem per sandbox rather than project quotas on a shared one: this kernel, like
many, is built without XFS quotas (``CONFIG_XFS_QUOTA``) and without the quota file format
ext4's project quotas need (``CONFIG_QFMT_V2``); a filesystem of its own needs only ext4 and
loop devices, which every kernel has. It also answers a full disk with ENOSPC (not EDQUOT,
as ext4 project quotas and btrfs qgroups do), shows the quota as the size in ``df``, keeps a
sandbox's damage to its filesystem (a corrupting ioctl such as XFS_IOC_SWAPEXT reaches only
its own), and needs no project-id bookkeeping across daemon restarts: the mount *is* the
state, and it outlives the daemon as the sandbox's overlay does.

Running ``mkfs.ext4`` for each sandbox would cost ~6 ms; each instead gets a copy of a
template formatted once per size (~130 KB of data for 10 GiB, held in memory and written with
O_DIRECT), bound to a loop device doing direct I/O (autoclear: unmounting is the whole
clean-up) and mounted, 3 to 4 ms in all (``bench/disk.py``). The images are sparse: a
sandbox's disk costs the host what it has written, never more than its quota. The quotas of
many sandboxes together may exceed the host's free space; nothing here bounds their sum.

A removed sandbox's image is renamed into ``freeing/`` and deleted there by one background
thread: deleting a file whose blocks were written frees them, and on a host filesystem mounted
with online discard (``-o discard``, as this project's CI machines are) each delete waits for its
discards, 6 ms for a fresh image and 30 to 50 ms for one a sandbox wrote to. A kill need not wait
for that: the image is out of sight at once (renamed, no loop device on it, unmounted), the
thread frees it, ``drain`` (a node's close) waits for the thread, and ``sweep`` (a node's open)
deletes what a crash left there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

from ..errors import InvalidSpec
from ..linux import ext4, xfs
from ..linux.ext4 import BLOCK_SIZE
from ..linux.files import SparseFile
from ..linux.loop import attach_loop
from ..linux.mounts import unmount

__all__ = ["WritableDisks"]

log = logging.getLogger("dsec.node.disks")

IMAGE_SUFFIX = ".img"
FREEING = "freeing"  # the images being deleted in the background
#: The filesystems a writable layer can be: (mkfs, mount) by ``NodeConfig.disk_fs``.
FORMATS = {"ext4": (ext4.mkfs_ext4, ext4.mount_ext4), "xfs": (xfs.mkfs_xfs, xfs.mount_xfs)}
HELD = 8  # templates held in memory
MAX_STACKED = 8  # mounts stacked on one writable layer's mount point that remove() takes off
KEPT = 16  # templates kept on disk


class WritableDisks:
    """The node's per-sandbox writable-layer filesystems, their images in ``disk_dir``."""

    def __init__(self, disk_dir: Path, fs: str = "ext4") -> None:
        if fs not in FORMATS:
            raise InvalidSpec(
                f"unknown writable-layer filesystem {fs!r}; known: {', '.join(sorted(FORMATS))}",
                field="DSEC_DISK_FS",
            )
        self.fs = fs
        self._mkfs, self._mount = FORMATS[fs]
        self.dir = disk_dir
        self.templates = disk_dir / "templates"
        self._lock = threading.Lock()
        self._making = threading.Lock()
        # The templates' data by size, the most recently used last. Sizes come from requests,
        # so both this and the templates on disk are bounded.
        self._formatted: OrderedDict[int, SparseFile] = OrderedDict()
        self.freeing = disk_dir / FREEING
        self._doomed: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
        self._freer: threading.Thread | None = None

    @staticmethod
    def size_of(limit: int) -> int:
        """The image size for a quota of ``limit`` bytes: whole filesystem blocks."""
        return -(-limit // BLOCK_SIZE) * BLOCK_SIZE

    def image(self, sandbox_id: str) -> Path:
        return self.dir / f"{sandbox_id}{IMAGE_SUFFIX}"

    def template_path(self, size: int) -> Path:
        return self.templates / f"{self.fs}-{size}{IMAGE_SUFFIX}"

    def template(self, size: int) -> SparseFile:
        """The formatted, empty image of ``size`` bytes that sandboxes' images are written
        from; formatted on first use (thread-safe), kept on disk for the next daemon and in
        memory (100 KB to a few MB) for the next sandbox: at most ``HELD`` sizes in memory and
        ``KEPT`` on disk, the least recently used going first."""
        with self._lock:
            formatted = self._formatted.get(size)
            if formatted is not None:
                self._formatted.move_to_end(size)
                return formatted
        with self._making:  # one at a time; readers of held templates do not wait for it
            path = self.template_path(size)
            if not path.exists():
                self.templates.mkdir(mode=0o700, parents=True, exist_ok=True)
                tmp = self.templates / f".{size}.{os.getpid()}.tmp"
                tmp.unlink(missing_ok=True)
                self._mkfs(tmp, size)
                os.rename(tmp, path)
            os.utime(path)  # its last use, for eviction on disk
            formatted = SparseFile.read(path)
            with self._lock:
                self._formatted[size] = formatted
                while len(self._formatted) > HELD:
                    self._formatted.popitem(last=False)
                held = {self.template_path(s) for s in self._formatted}
            self._evict(held)
        return formatted

    def _evict(self, held: set[Path]) -> None:
        """Remove the least recently used templates on disk beyond ``KEPT``, never one held in
        memory (those are the ones in use)."""
        others = sorted(
            (p for p in self.templates.glob(f"*{IMAGE_SUFFIX}") if p not in held),
            key=lambda p: p.stat().st_mtime,
        )
        for old in others[: max(0, len(others) + len(held) - KEPT)]:
            old.unlink(missing_ok=True)

    def ready(self, size: int) -> bool:
        """Whether ``template(size)`` answers without formatting or reading a file."""
        return size in self._formatted

    def mount(self, sandbox_id: str, size: int, target: Path) -> None:
        """Give sandbox ``sandbox_id`` a fresh filesystem of ``size`` bytes mounted at
        ``target`` (made, mode 0700): its image copied from the template, bound to a loop
        device, mounted nosuid and nodev. On failure nothing is left: no image, no loop
        device, no mount."""
        template = self.template(size)
        image = self.image(sandbox_id)
        template.write(image, direct=True)  # see SparseFile.write: the loop reads it directly
        try:
            target.mkdir(mode=0o700, exist_ok=True)
            with attach_loop(image) as dev:  # the mount holds it from here; autoclear on umount
                self._mount(dev.path, target)
            os.chmod(target, 0o700)  # the filesystem's root, now at the mount point
        except BaseException:
            unmount(target)
            with contextlib.suppress(OSError):
                target.rmdir()
            image.unlink(missing_ok=True)
            raise

    def remove(self, sandbox_id: str, target: Path) -> None:
        """Unmount a sandbox's filesystem from ``target`` (detaching it if still busy; the loop
        device goes when its last user does) and remove the mount point and the image. Nothing
        is deleted file by file; unmounting writes back what is still dirty. A ``target`` that
        is no mount (an image backend's data directory, a create that failed early) is
        removed. (It asks ``ismount``, not the mount table: reading that costs O(mounts), and a
        node of 2,000 sandboxes has 4,000 of them; a mount held below ``target`` goes with it,
        detached.)"""
        for _ in range(MAX_STACKED):
            if not os.path.ismount(target):
                break
            unmount(target)
        shutil.rmtree(target, ignore_errors=True)
        self._free(self.image(sandbox_id))

    def _free(self, image: Path) -> None:
        """Take ``image`` out of sight at once and delete it in the background (see above)."""
        if not image.exists():  # an image backend's sandbox, a create that failed early
            return
        self.freeing.mkdir(mode=0o700, exist_ok=True)
        doomed = self.freeing / image.name
        try:
            os.rename(image, doomed)
        except FileNotFoundError:
            return
        with self._lock:
            if self._freer is None or not self._freer.is_alive():
                self._freer = threading.Thread(
                    target=self._free_loop, name="dsec-disk-freer", daemon=True
                )
                self._freer.start()
        self._doomed.put(doomed)

    def _free_loop(self) -> None:
        while (doomed := self._doomed.get()) is not None:
            try:
                doomed.unlink(missing_ok=True)
            except OSError as e:  # the next sweep tries again
                log.warning("could not delete the disk image %s: %s", doomed, e)

    def drain(self) -> None:
        """Wait until every removed image is deleted (a node's close)."""
        with self._lock:
            freer, self._freer = self._freer, None
        if freer is not None:
            self._doomed.put(None)
            freer.join()

    def images(self) -> list[str]:
        """The sandbox ids that have an image here."""
        if not self.dir.is_dir():
            return []
        return sorted(
            p.name[: -len(IMAGE_SUFFIX)]
            for p in self.dir.iterdir()
            if p.name.endswith(IMAGE_SUFFIX) and p.is_file()
        )

    def sweep(self, keep: set[str]) -> None:
        """Remove the images of sandboxes not in ``keep`` (gone while no daemon ran)."""
        for sid in self.images():
            if sid not in keep:
                log.info("removing the disk image of gone sandbox %s", sid)
                self.image(sid).unlink(missing_ok=True)
        if self.freeing.is_dir():  # a crash while the freer had work
            for doomed in self.freeing.iterdir():
                doomed.unlink(missing_ok=True)
