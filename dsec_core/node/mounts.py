"""Mounting layers: one shared, reference-counted EROFS mount per layer, and an overlay per sandbox.

Each layer image is mounted once per node straight from its file (EROFS file-backed mount via
the new mount API, so no loop device), read-only and idmapped to the sandboxes' uid range: one
mount, one page cache, serving every sandbox that uses the layer. Each sandbox then gets an
overlayfs stack of those mounts with a writable upper directory on local disk.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..backend import IdMap
from ..errors import MountError

__all__ = ["MountCache", "OverlayStack", "UserNamespaceHandle", "mounted_under", "unmount",
           "ensure_tmpfs"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

# x86_64 and aarch64 share these (they were added after the syscall tables were unified).
SYS_MOVE_MOUNT, SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT, SYS_MOUNT_SETATTR = 429, 430, 431, 432, 442
FSOPEN_CLOEXEC = 1
FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x100000
MNT_DETACH = 2
MS_NOSUID = 0x2
MS_NODEV = 0x4


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(ret: int, what: str, target: str | os.PathLike = "") -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise MountError(f"{what} {os.fspath(target)}: {os.strerror(err)}", errno=err,
                         target=os.fspath(target))
    return ret


class UserNamespaceHandle:
    """An open user-namespace fd carrying an ``IdMap``, for MOUNT_ATTR_IDMAP.

    Made once per daemon: a throwaway process unshares a user namespace, we write its maps and
    keep a reference to the namespace, then the process goes.
    """

    def __init__(self, idmap: IdMap) -> None:
        self.idmap = idmap
        proc = subprocess.Popen(["unshare", "--user", "sh", "-c", "read _"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        try:
            ns_path = f"/proc/{proc.pid}/ns/user"
            own = os.stat("/proc/self/ns/user").st_ino
            deadline = time.monotonic() + 5
            while os.stat(ns_path).st_ino == own:  # wait until the child has unshared
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise MountError("could not create a user namespace for idmapped mounts")
                time.sleep(0.001)
            line = f"0 {idmap.host_base} {idmap.size}\n"
            with open(f"/proc/{proc.pid}/uid_map", "w") as f:
                f.write(line)
            with open(f"/proc/{proc.pid}/gid_map", "w") as f:
                f.write(line)
            self.fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
        finally:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def mount_erofs_file(image: Path, target: Path, userns: UserNamespaceHandle | None,
                     device: Path | None = None) -> None:
    """Mount an EROFS image file read-only at ``target``, idmapped through ``userns``.

    With ``device``, ``image`` is a metadata image whose file data lives in that blob file (EROFS
    multi-device; the blob may sit on the node's on-demand FUSE filesystem)."""
    fs = _check(_libc.syscall(SYS_FSOPEN, b"erofs", FSOPEN_CLOEXEC), "fsopen erofs for", image)
    try:
        _check(_libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"source",
                             os.fsencode(image), 0), "fsconfig source", image)
        if device is not None:
            _check(_libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"device",
                                 os.fsencode(device), 0), "fsconfig device", device)
        _check(_libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0),
               "mounting EROFS image (is it a valid EROFS image?)", image)
        mnt = _check(_libc.syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC,
                                   MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV), "fsmount", image)
    finally:
        os.close(fs)
    try:
        if userns is not None:
            attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns.fd)
            _check(_libc.syscall(SYS_MOUNT_SETATTR, mnt, b"", AT_EMPTY_PATH, ctypes.byref(attr),
                                 ctypes.sizeof(attr)), "idmapping mount of", image)
        _check(_libc.syscall(SYS_MOVE_MOUNT, mnt, b"", AT_FDCWD, os.fsencode(target),
                             MOVE_MOUNT_F_EMPTY_PATH), "move_mount to", target)
    finally:
        os.close(mnt)


def unmount(target: Path | str, *, lazy_fallback: bool = True, lazy: bool = False) -> None:
    """Unmount ``target``; if it stays busy, detach it (it goes once its last user does).
    ``lazy`` detaches at once."""
    path = os.fsencode(target)
    for attempt in range(0 if lazy else 20):
        if _libc.umount2(path, 0) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EINVAL or err == errno.ENOENT:  # not a mount point (any more)
            return
        if err != errno.EBUSY:
            break
        time.sleep(0.005 * (attempt + 1))
    if lazy_fallback and _libc.umount2(path, MNT_DETACH) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):
        return
    raise MountError(f"umount {os.fspath(target)}: {os.strerror(err)}", errno=err,
                     target=os.fspath(target))


def ensure_tmpfs(target: Path, mode: int = 0o711, size: str = "256m") -> None:
    """Mount a private tmpfs at ``target`` unless one is already there."""
    target.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(target):
        return
    opts = f"mode={mode:o},size={size}".encode()
    ret = _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", MS_NOSUID | MS_NODEV, opts)
    _check(ret, "tmpfs mount at", target)


def mounted_under(prefix: Path) -> list[Path]:
    """Mount points at or below ``prefix`` (from /proc/self/mountinfo), deepest first."""
    pre = os.fspath(prefix).rstrip("/")
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == pre or mp.startswith(pre + "/"):
                found.append(Path(mp))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


@dataclass
class _Entry:
    path: Path
    refs: int
    idle_since: float | None


class MountCache:
    """One read-only mount per layer digest, shared by all sandboxes and reference counted.

    ``acquire`` mounts on first use; ``release`` unmounts when the count drops to zero (after
    ``linger`` seconds if set: ``sweep`` does it). Thread-safe.
    """

    def __init__(self, root: Path, userns: UserNamespaceHandle | None, linger: float = 0.0):
        self.root = root
        self.userns = userns
        self.linger = linger
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)

    def path_for(self, digest: str) -> Path:
        return self.root / digest.split(":", 1)[-1][:32]

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
                        mount_erofs_file(image, target, self.userns, device)
                    except BaseException:
                        _rmdir_quiet(target)
                        raise
                entry = self._entries[digest] = _Entry(target, 0, None)
            entry.refs += 1
            entry.idle_since = None
            return entry.path

    def acquire_all(self, layers: Iterable[tuple[str, Path]]) -> list[Path]:
        """Acquire several (digest, image) pairs; on failure release what was taken."""
        taken: list[str] = []
        paths = []
        try:
            for digest, image in layers:
                paths.append(self.acquire(digest, image))
                taken.append(digest)
        except BaseException:
            for digest in taken:
                self.release(digest)
            raise
        return paths

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
                if entry.refs == 0 and entry.idle_since is not None and \
                        now - entry.idle_since >= self.linger:
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

    def mount(self, lowers: list[Path], owner: int) -> Path:
        """Mount ``lowers`` (top first) with a fresh upper owned by host uid ``owner``."""
        if not lowers:
            raise MountError("an overlay needs at least one layer")
        for d in (self.upper, self.work, self.rootfs):
            d.mkdir(parents=True, exist_ok=True)
        os.chown(self.upper, owner, owner)
        os.chown(self.work, owner, owner)
        # Relative lowerdirs would keep the option string short, but mount(2) resolves them
        # against our cwd; absolute paths are unambiguous and fit in a page for ~30 layers.
        opts = "lowerdir={},upperdir={},workdir={}".format(
            ":".join(os.fspath(p) for p in lowers), self.upper, self.work)
        if len(opts) >= 4000:
            raise MountError(f"too many layers for one overlay ({len(lowers)})")
        ret = _libc.mount(b"overlay", os.fsencode(self.rootfs), b"overlay", 0, opts.encode())
        _check(ret, "overlay mount at", self.rootfs)
        return self.rootfs

    def unmount(self) -> None:
        unmount(self.rootfs)
