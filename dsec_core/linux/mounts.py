"""Linux mount primitives: the new mount API for EROFS image files, overlayfs, tmpfs, unmounting.

The lowest floor of dsec: it speaks to the kernel through libc (``ctypes``) and imports nothing
of dsec but its error tree. Everything here raises ``MountError`` with the errno and target.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import MountError

__all__ = [
    "MS_BIND",
    "MS_NODEV",
    "MS_NOSUID",
    "MS_RDONLY",
    "IdLines",
    "UserNamespaceHandle",
    "attach",
    "bind_onto_itself",
    "clone_idmapped",
    "ensure_tmpfs",
    "mount",
    "mount_erofs_file",
    "mount_overlay",
    "mount_points",
    "mounted_under",
    "unmount",
]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

# x86_64 and aarch64 share these (they were added after the syscall tables were unified).
SYS_MOVE_MOUNT, SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT, SYS_MOUNT_SETATTR = 429, 430, 431, 432, 442
SYS_OPEN_TREE = 428
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
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
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_PRIVATE = 1 << 18


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, what: str, target: str | os.PathLike[str] = "") -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise MountError(
            f"{what} {os.fspath(target)}: {os.strerror(err)}", errno=err, target=os.fspath(target)
        )
    return ret


IdLines = Sequence[tuple[int, int, int]]


class UserNamespaceHandle:
    """An open user-namespace fd with the given maps (``(inside, host, count)`` lines), for
    MOUNT_ATTR_IDMAP; ``gid_map`` defaults to ``uid_map``.

    A throwaway process unshares a user namespace, we write its maps and keep a reference to
    the namespace, then the process goes (about 2 ms: posix_spawn of ``unshare``; forking the
    daemon itself costs more).
    """

    def __init__(self, uid_map: IdLines, gid_map: IdLines | None = None) -> None:
        self.uid_map = [tuple(line) for line in uid_map]
        self.gid_map = [tuple(line) for line in (uid_map if gid_map is None else gid_map)]
        self.fd = -1
        proc = subprocess.Popen(
            ["unshare", "--user", "sh", "-c", "read _"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        try:
            ns_path = f"/proc/{proc.pid}/ns/user"
            own = os.stat("/proc/self/ns/user").st_ino
            deadline = time.monotonic() + 5
            while os.stat(ns_path).st_ino == own:  # wait until the child has unshared
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise MountError("could not create a user namespace for idmapped mounts")
                time.sleep(0.001)
            for name, lines in (("uid_map", self.uid_map), ("gid_map", self.gid_map)):
                text = "".join(f"{a} {b} {c}\n" for a, b, c in lines)
                try:
                    with open(f"/proc/{proc.pid}/{name}", "w") as f:
                        f.write(text)
                except OSError as e:
                    raise MountError(
                        f"writing the {name} {text.strip()!r} of a user namespace: {e.strerror}",
                        errno=e.errno,
                    ) from e
            self.fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
        finally:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def clone_idmapped(path: Path, userns: UserNamespaceHandle) -> int:
    """A detached copy of the mount at ``path``, idmapped through ``userns``: an fd whose
    ``/proc/self/fd/N`` path can be an overlay's lower layer (the overlay keeps a private clone
    of it, so the fd may be closed right after the overlay is mounted). It shares the original
    mount's superblock, so every clone is served from one page cache. Costs about 30 us."""
    fd = _check(
        _libc.syscall(
            SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC
        ),
        "open_tree (clone) of",
        path,
    )
    try:
        attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns.fd)
        _check(
            _libc.syscall(
                SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)
            ),
            "idmapping a clone of",
            path,
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


def attach(fd: int, target: Path) -> None:
    """Attach the detached mount ``fd`` (from ``clone_idmapped``) at ``target``. Tools that
    canonicalize their paths (mkfs.erofs) cannot walk a detached mount through
    ``/proc/self/fd/N``: it reads back as ``/``."""
    _check(
        _libc.syscall(
            SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, os.fsencode(target), MOVE_MOUNT_F_EMPTY_PATH
        ),
        "move_mount to",
        target,
    )


def mount_erofs_file(
    image: Path, target: Path, userns: UserNamespaceHandle | None, device: Path | None = None
) -> None:
    """Mount an EROFS image file read-only at ``target``, idmapped through ``userns``.

    With ``device``, ``image`` is a metadata image whose file data lives in that blob file (EROFS
    multi-device; the blob may sit on the node's on-demand FUSE filesystem)."""
    fs = _check(_libc.syscall(SYS_FSOPEN, b"erofs", FSOPEN_CLOEXEC), "fsopen erofs for", image)
    try:
        _check(
            _libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"source", os.fsencode(image), 0),
            "fsconfig source",
            image,
        )
        if device is not None:
            _check(
                _libc.syscall(
                    SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"device", os.fsencode(device), 0
                ),
                "fsconfig device",
                device,
            )
        _check(
            _libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0),
            "mounting EROFS image (is it a valid EROFS image?)",
            image,
        )
        mnt = _check(
            _libc.syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV),
            "fsmount",
            image,
        )
    finally:
        os.close(fs)
    try:
        if userns is not None:
            attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns.fd)
            _check(
                _libc.syscall(
                    SYS_MOUNT_SETATTR,
                    mnt,
                    b"",
                    AT_EMPTY_PATH,
                    ctypes.byref(attr),
                    ctypes.sizeof(attr),
                ),
                "idmapping mount of",
                image,
            )
        _check(
            _libc.syscall(
                SYS_MOVE_MOUNT, mnt, b"", AT_FDCWD, os.fsencode(target), MOVE_MOUNT_F_EMPTY_PATH
            ),
            "move_mount to",
            target,
        )
    finally:
        os.close(mnt)


def mount(
    source: str, target: Path | str, fstype: str, flags: int = 0, data: str | None = None
) -> None:
    """mount(2): ``MountError`` on failure."""
    ret = _libc.mount(
        source.encode(),
        os.fsencode(target),
        fstype.encode(),
        flags,
        data.encode() if data is not None else None,
    )
    _check(ret, f"{fstype} mount at", target)


def mount_overlay(lowers: Sequence[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount an overlayfs of ``lowers`` (top first) under writable ``upper`` at ``target``,
    nosuid and nodev: a setuid file or device node written through it is only a file on the
    host. (Inside a sandbox nothing changes: its processes run with no_new_privs and without
    CAP_MKNOD, and its /dev is a mount of its own.)"""
    if not lowers:
        raise MountError("an overlay needs at least one layer", target=os.fspath(target))
    # Relative lowerdirs would keep the option string short, but mount(2) resolves them
    # against our cwd; absolute paths are unambiguous and fit in a page for ~30 layers.
    opts = "lowerdir={},upperdir={},workdir={}".format(
        ":".join(os.fspath(p) for p in lowers), upper, work
    )
    if len(opts) >= 4000:
        raise MountError(
            f"too many layers for one overlay ({len(lowers)})", target=os.fspath(target)
        )
    mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, opts)


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
    raise MountError(
        f"umount {os.fspath(target)}: {os.strerror(err)}", errno=err, target=os.fspath(target)
    )


def ensure_tmpfs(
    target: Path, mode: int = 0o711, size: str = "256m", gid: int | None = None
) -> None:
    """Mount a private tmpfs at ``target`` (its root of ``mode``, and group ``gid`` if given)
    unless one is already there."""
    target.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(target):
        return
    opts = f"mode={mode:o},size={size}{'' if gid is None else f',gid={gid}'}".encode()
    ret = _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", MS_NOSUID | MS_NODEV, opts)
    _check(ret, "tmpfs mount at", target)


def bind_onto_itself(target: Path) -> bool:
    """Make directory ``target`` a private mount (a bind of the directory onto itself, unless
    something is mounted there already), so that whatever is mounted below it later is one
    subtree a single detach drops (a mount namespace copied from this one can shed them all
    at once), and nothing mounted there propagates to other mount namespaces, whatever the
    host's propagation (systemd makes ``/`` shared). True if it is one now; False, changing
    nothing, if ``target`` is no mount point but something below it is mounted (binding over
    those would hide them from whoever unmounts them)."""
    below = mounted_under(target)
    if target not in below:
        if below:
            return False
        mount(os.fspath(target), target, "none", MS_BIND)
    mount("none", target, "none", MS_PRIVATE)
    return True


def mount_points(mountinfo: str) -> list[str]:
    """The mount points of a mountinfo file's text (``/proc/<pid>/mountinfo``), in its order,
    their octal escapes (``\\040`` for a space) decoded."""
    return [line.split()[4].encode().decode("unicode_escape") for line in mountinfo.splitlines()]


def mounted_under(prefix: Path) -> list[Path]:
    """Mount points at or below ``prefix`` (from /proc/self/mountinfo), deepest first."""
    pre = os.fspath(prefix).rstrip("/")
    with open("/proc/self/mountinfo") as f:
        points = mount_points(f.read())
    found = {Path(mp) for mp in points if mp == pre or mp.startswith(pre + "/")}
    return sorted(found, key=lambda p: len(p.parts), reverse=True)
