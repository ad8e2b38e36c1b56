"""The node's layer mounts: one shared, reference-counted EROFS mount per layer, and an overlay
per sandbox.

Each layer image is mounted once per node straight from its file (EROFS file-backed mount via
the new mount API, so no loop device), read-only, where only root on the host can reach it: one
mount, one page cache, serving every sandbox that uses the layer. Each sandbox of a backend that
asks for a composed root filesystem then gets an overlayfs stack of detached clones of those
mounts, each idmapped to the sandbox's own uid range (``clone_idmapped``: same superblock, so
still one page cache), with a writable upper directory on the sandbox's own filesystem. The
overlay keeps private clones of its layers, so the clones leave no mount behind on the host:
a sandbox costs the host's mount table one overlay (and its writable layer's filesystem).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..linux.mounts import (
    UserNamespaceHandle,
    clone_idmapped,
    mount_erofs_file,
    mount_overlay,
    mounted_under,
    unmount,
)

__all__ = ["MountCache", "OverlayStack"]


@dataclass
class _Entry:
    path: Path
    refs: int
    idle_since: float | None


class MountCache:
    """One read-only mount per layer digest, shared by all sandboxes and reference counted.

    ``acquire`` mounts on first use; ``release`` unmounts when the count drops to zero (after
    ``linger`` seconds if set: ``sweep`` does it). Thread-safe. ``hits`` counts the acquires
    that found the layer mounted, ``misses`` those that mounted it (the node's
    ``dsec_layer_cache_total``).
    """

    def __init__(self, root: Path, linger: float = 0.0):
        self.root = root
        self.linger = linger
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        root.mkdir(parents=True, exist_ok=True)

    def path_for(self, digest: str) -> Path:
        # ".0": not idmapped (daemons before per-sandbox uid ranges mounted layers idmapped at
        # the bare digest; adopt() unmounts those, their overlays keep private clones)
        return self.root / (digest.split(":", 1)[-1][:32] + ".0")

    def acquire(self, digest: str, image: Path, device: Path | None = None) -> Path:
        """Mount layer ``digest`` from ``image`` (and its data ``device``, for on-demand
        layers) unless it is mounted already; count one more user."""
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                target = self.path_for(digest)
                target.mkdir(exist_ok=True)
                if not os.path.ismount(target):
                    try:
                        mount_erofs_file(image, target, None, device)
                    except BaseException:
                        _rmdir_quiet(target)
                        raise
                entry = self._entries[digest] = _Entry(target, 0, None)
                self.misses += 1
            else:
                self.hits += 1
            entry.refs += 1
            entry.idle_since = None
            return entry.path

    def release(self, digest: str) -> None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return
            entry.refs = max(0, entry.refs - 1)
            if entry.refs == 0:
                if self.linger <= 0:
                    self._drop(digest)
                else:
                    entry.idle_since = time.monotonic()

    def sweep(self, now: float | None = None) -> None:
        """Unmount layers idle for longer than ``linger``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for digest, entry in list(self._entries.items()):
                if (
                    entry.refs == 0
                    and entry.idle_since is not None
                    and now - entry.idle_since >= self.linger
                ):
                    self._drop(digest)

    def _drop(self, digest: str) -> None:
        entry = self._entries.pop(digest)
        unmount(entry.path)
        _rmdir_quiet(entry.path)

    def adopt(self, in_use: dict[str, int]) -> None:
        """After a daemon restart: take over existing mounts with their counts from sandbox
        state, and unmount any layer mount nobody uses any more."""
        with self._lock:
            by_path = {self.path_for(d): d for d in in_use}
            for mp in mounted_under(self.root):
                if mp == self.root:
                    continue
                digest = by_path.get(mp)
                if digest is None:
                    unmount(mp)
                    _rmdir_quiet(mp)
                else:
                    self._entries[digest] = _Entry(mp, in_use[digest], None)

    def drop_idle(self, digests: set[str]) -> list[str]:
        """Unmount now those of ``digests`` that no sandbox uses, lingering or not (their data
        can no longer be read); those still in use, returned, are left."""
        busy = []
        with self._lock:
            for digest in digests & self._entries.keys():
                if self._entries[digest].refs:
                    busy.append(digest)
                else:
                    self._drop(digest)
        return busy

    def refcounts(self) -> dict[str, int]:
        with self._lock:
            return {d: e.refs for d, e in self._entries.items()}

    def close(self) -> None:
        """Unmount every layer with no users (node shutdown)."""
        with self._lock:
            for digest, entry in list(self._entries.items()):
                if entry.refs == 0:
                    self._drop(digest)


def _rmdir_quiet(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


class OverlayStack:
    """A sandbox's root filesystem: read-only layer mounts under a writable upper directory."""

    def __init__(self, data_dir: Path, rootfs: Path) -> None:
        self.upper = data_dir / "upper"
        self.work = data_dir / "work"
        self.rootfs = rootfs

    def mount(
        self, lowers: list[Path], owner: tuple[int, int], userns: UserNamespaceHandle | None = None
    ) -> Path:
        """Mount ``lowers`` (top first) with a fresh upper owned by host ``(uid, gid)``
        ``owner``; with ``userns``, each lower is an idmapped clone through it."""
        for d in (self.upper, self.work, self.rootfs):
            d.mkdir(parents=True, exist_ok=True)
        os.chown(self.upper, *owner)
        os.chown(self.work, *owner)
        if userns is None:
            mount_overlay(lowers, self.upper, self.work, self.rootfs)
            return self.rootfs
        fds: list[int] = []
        try:
            for lower in lowers:
                fds.append(clone_idmapped(lower, userns))
            paths = [Path(f"/proc/self/fd/{fd}") for fd in fds]
            mount_overlay(paths, self.upper, self.work, self.rootfs)
        finally:
            for fd in fds:
                os.close(fd)
        return self.rootfs

    def unmount(self) -> None:
        unmount(self.rootfs)
