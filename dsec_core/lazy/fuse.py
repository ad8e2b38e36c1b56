"""A minimal read-only FUSE server, spoken straight over /dev/fuse, that exposes lazy blob files.

It serves one flat directory of immutable blob files whose bytes come from a callback (in
practice ``LazyBlob.read``), so EROFS can mount a layer's metadata image with
``device=<mountpoint>/<blob>`` and pull file data through the chunk cache only when touched.

Why FUSE and not fanotify pre-content events: if the fetch daemon dies, a read of a FUSE file
fails (ENOTCONN, or waits for a successor) instead of silently returning the zeros of a sparse
file's holes; and a FUSE connection outlives its daemon as long as some process holds a dup of
the /dev/fuse fd, so a new daemon can adopt it (``FuseServer.from_fd``) while the EROFS mounts
above it stay mounted. Requests the dead daemon had taken but not answered are handed to the
successor with FUSE_NOTIFY_RESEND (Linux 6.9+).

We talk the kernel protocol (``include/uapi/linux/fuse.h``) with ``struct`` rather than using
libfuse bindings: the subset a read-only flat directory needs is small, and owning the fd is what
makes adoption by a successor process possible.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import LayerCorrupt, MountError, SourceUnavailable
from ..linux.mounts import MS_NODEV, MS_NOSUID, MS_RDONLY, mount, unmount

__all__ = ["FuseServer", "abort_connection", "recv_fuse_fd", "send_fuse_fd"]

log = logging.getLogger(__name__)

ROOT_ID = 1
ENTRY_TTL = 86400  # seconds; blob files never change once added

# Opcodes (fuse.h enum fuse_opcode).
LOOKUP, FORGET, GETATTR = 1, 2, 3
OPEN, READ, STATFS, RELEASE = 14, 15, 17, 18
GETXATTR, LISTXATTR, FLUSH, INIT = 22, 23, 25, 26
OPENDIR, READDIR, RELEASEDIR, ACCESS = 27, 28, 29, 34
INTERRUPT, DESTROY, BATCH_FORGET = 36, 38, 42

# INIT flags.
FUSE_ASYNC_READ = 1 << 0
FUSE_BIG_WRITES = 1 << 5
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_MAX_PAGES = 1 << 22
FOPEN_KEEP_CACHE = 1 << 1
NOTIFY_RESEND = 7

MAX_PAGES = 256  # 1 MiB requests with 4 KiB pages
MAX_READ = 1 << 20
MAX_WRITE = 128 << 10  # nothing is written; the kernel still sizes our read buffer from it
READ_BUFFER = MAX_WRITE + 4096

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks a/m/ctime nsecs mode nlink ...
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid nsecs
ATTR_OUT = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags
INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")
DIRENT = struct.Struct("<QQII")  # ino off namelen type
STATFS_OUT = struct.Struct("<QQQQQIIII6I")
XATTR_OUT = struct.Struct("<II")
DT_DIR, DT_REG = 4, 8


@dataclass(frozen=True)
class _Blob:
    name: str
    ino: int
    size: int
    read_fn: Callable[[int, int], bytes]


def _ino_for(name: str) -> int:
    # Derived from the name, not from insertion order, so a successor that adds the same blobs
    # in any order answers the kernel's cached node ids correctly.
    n = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)
    return n if n > ROOT_ID else n + 2


class FuseServer:
    """Serves blob files over one FUSE connection with a small worker pool.

    Typical use::

        server = FuseServer()
        server.add_blob("data.blob", size, lazy_blob.read)
        fd = server.mount(path)          # mounts and starts serving
        ...
        server.close()                   # unmount, stop, close the fd

    A successor daemon adopts a live mount with ``FuseServer.from_fd(fd, mountpoint)``, adds
    the same blobs, then ``start()``s; see ``detach``, ``send_fuse_fd`` and ``recv_fuse_fd``.
    """

    def __init__(self, *, workers: int = 8) -> None:
        self.workers = workers
        self.fd = -1
        self.mountpoint: Path | None = None
        self._blobs: dict[str, _Blob] = {}
        self._by_ino: dict[int, _Blob] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._wake_r, self._wake_w = -1, -1
        self._dead = False  # set by abandon(): in-flight work must not answer
        self.requests = 0
        self._resend_on_start = False

    # -- content -------------------------------------------------------------------------------

    def add_blob(self, name: str, size: int, read_fn: Callable[[int, int], bytes]) -> None:
        """Expose ``name`` (``size`` bytes); ``read_fn(offset, length)`` supplies its bytes.

        ``read_fn`` may raise; the reader then gets EIO.
        """
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"bad blob name {name!r}")
        blob = _Blob(name, _ino_for(name), size, read_fn)
        with self._lock:
            self._blobs[name] = blob
            self._by_ino[blob.ino] = blob

    def path_of(self, name: str) -> Path:
        if self.mountpoint is None:
            raise MountError("FUSE server is not mounted")
        return self.mountpoint / name

    # -- lifecycle -----------------------------------------------------------------------------

    def mount(self, path: Path | str) -> int:
        """Mount a new FUSE connection read-only at ``path``, start serving; returns its fd."""
        path = Path(path)
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = (
            f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,"
            f"max_read={MAX_READ}"
        )
        try:
            mount("dsec-lazy", path, "fuse", MS_RDONLY | MS_NOSUID | MS_NODEV, opts)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.mountpoint = path
        self.start()
        return fd

    @classmethod
    def from_fd(
        cls, fd: int, mountpoint: Path | str | None = None, *, workers: int = 8, resend: bool = True
    ) -> FuseServer:
        """Adopt the already-mounted connection ``fd``; add blobs, then call ``start()``.

        With ``resend`` the kernel re-queues requests a dead predecessor had taken but not
        answered, so readers blocked on them get served instead of hanging.
        """
        server = cls(workers=workers)
        server.fd = fd
        server.mountpoint = Path(mountpoint) if mountpoint is not None else None
        server._resend_on_start = resend
        return server

    def start(self) -> None:
        """Serve requests on ``self.fd`` in background threads."""
        if self._reader is not None:
            return
        os.set_blocking(self.fd, False)
        self._dead = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fuse-worker")
        self._reader = threading.Thread(target=self._loop, name="fuse-reader", daemon=True)
        self._reader.start()
        if self._resend_on_start:
            self._resend_on_start = False
            try:
                os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0))
            except OSError as e:  # older kernels: lost requests stay lost, the rest works
                log.warning("FUSE_NOTIFY_RESEND not accepted: %s", e)

    def stop(self) -> None:
        """Stop reading requests; answer the ones in flight. The fd stays open and mounted."""
        reader, self._reader = self._reader, None
        if reader is None:
            return
        os.write(self._wake_w, b"x")
        reader.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1

    def detach(self) -> int:
        """Stop serving and give up the fd (still mounted) for a successor to adopt."""
        self.stop()
        fd, self.fd = self.fd, -1
        self.mountpoint = None  # the successor owns the mount now
        return fd

    def abandon(self) -> None:
        """Behave like a crashed daemon: stop at once, never answer requests already taken.

        Closes this server's fd without unmounting; the connection lives on only if another
        fd (a dup held by a supervisor or successor) refers to it.
        """
        self._dead = True
        reader, self._reader = self._reader, None
        if reader is not None:
            os.write(self._wake_w, b"x")
            reader.join()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # stragglers finish and drop their replies
            self._pool = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmount (detaching if still in use), stop serving and close the fd."""
        if self.mountpoint is not None:
            try:
                unmount(self.mountpoint)
            finally:
                self.mountpoint = None
        self.stop()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> FuseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                return
            try:
                data = os.read(self.fd, READ_BUFFER)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                if e.errno == errno.ENOENT:  # the request was aborted before we got it
                    continue
                if e.errno != errno.ENODEV:  # ENODEV: unmounted or aborted, we are done
                    log.error("reading /dev/fuse failed: %s", e)
                return
            if len(data) < IN_HEADER.size:
                continue
            self.requests += 1
            length, opcode, unique, nodeid = IN_HEADER.unpack_from(data)[:4]
            body = memoryview(data)[IN_HEADER.size : length]
            if opcode in (FORGET, BATCH_FORGET, INTERRUPT):
                # Nodes are stateless (ids come from names), so lookup counts need no bookkeeping;
                # interrupts are ignored and the request is answered when its fetch ends.
                continue
            if opcode == INIT:
                self._init(unique, body)
                continue
            assert self._pool is not None  # made by start() before this loop runs
            self._pool.submit(self._handle, opcode, unique, nodeid, body)

    def _reply(self, unique: int, payload: bytes | list[bytes] = b"", error: int = 0) -> None:
        if self._dead:
            return
        parts = payload if isinstance(payload, list) else [payload]
        length = OUT_HEADER.size + sum(len(p) for p in parts)
        try:
            os.writev(self.fd, [OUT_HEADER.pack(length, -error, unique), *parts])
        except OSError as e:
            # ENOENT: the kernel dropped the request (interrupted, or the connection aborted).
            if e.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                log.error("replying to FUSE request %d failed: %s", unique, e)

    def _init(self, unique: int, body: memoryview) -> None:
        major, minor, max_readahead, flags = INIT_IN.unpack_from(body)
        if major != 7:
            # Tell a newer kernel which major we speak; it retries INIT with it.
            self._reply(unique, INIT_OUT.pack(7, 40, 0, 0, 0, 0, 0, 0, 0, 0, 0, *[0] * 7))
            return
        want = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES
        out = INIT_OUT.pack(
            7,
            min(minor, 40),
            min(max_readahead, MAX_READ),
            flags & want,
            32,
            24,
            MAX_WRITE,
            1,
            MAX_PAGES,
            0,
            0,
            *[0] * 7,
        )
        self._reply(unique, out)

    def _handle(self, opcode: int, unique: int, nodeid: int, body: memoryview) -> None:
        try:
            handler = _HANDLERS.get(opcode)
            if handler is None:
                self._reply(unique, error=errno.ENOSYS)
                return
            result = handler(self, nodeid, body)
            if isinstance(result, int):
                self._reply(unique, error=result)
            else:
                self._reply(unique, result)
        except (SourceUnavailable, LayerCorrupt) as e:
            log.warning("FUSE op %d on node %d: %s", opcode, nodeid, e)
            self._reply(unique, error=errno.EIO)
        except OSError as e:
            log.warning("FUSE op %d on node %d: %s", opcode, nodeid, e)
            self._reply(unique, error=errno.EIO)
        except Exception:
            log.exception("FUSE op %d on node %d failed", opcode, nodeid)
            self._reply(unique, error=errno.EIO)

    # -- operations: each returns the reply payload, or a positive errno ------------------------

    def _attr(self, nodeid: int) -> bytes | None:
        if nodeid == ROOT_ID:
            return ATTR.pack(ROOT_ID, 0, 0, 0, 0, 0, 0, 0, 0, 0o40555, 2, 0, 0, 0, 4096, 0)
        blob = self._by_ino.get(nodeid)
        if blob is None:
            return None
        return ATTR.pack(
            blob.ino,
            blob.size,
            (blob.size + 511) // 512,
            0,
            0,
            0,
            0,
            0,
            0,
            0o100444,
            1,
            0,
            0,
            0,
            4096,
            0,
        )

    def _lookup(self, nodeid: int, body: memoryview) -> bytes | int:
        name = bytes(body).split(b"\0", 1)[0].decode(errors="surrogateescape")
        blob = self._blobs.get(name) if nodeid == ROOT_ID else None
        if blob is None:
            return errno.ENOENT
        attr = self._attr(blob.ino)
        if attr is None:  # removed since the name lookup
            return errno.ENOENT
        return ENTRY_OUT.pack(blob.ino, 0, ENTRY_TTL, ENTRY_TTL, 0, 0) + attr

    def _getattr(self, nodeid: int, body: memoryview) -> bytes | int:
        attr = self._attr(nodeid)
        if attr is None:
            return errno.ENOENT
        return ATTR_OUT.pack(ENTRY_TTL, 0, 0) + attr

    def _open(self, nodeid: int, body: memoryview) -> bytes | int:
        if nodeid not in self._by_ino:
            return errno.ENOENT
        if struct.unpack_from("<I", body)[0] & os.O_ACCMODE != os.O_RDONLY:
            return errno.EROFS
        return OPEN_OUT.pack(0, FOPEN_KEEP_CACHE, 0)

    def _opendir(self, nodeid: int, body: memoryview) -> bytes | int:
        return OPEN_OUT.pack(0, 0, 0) if nodeid == ROOT_ID else errno.ENOTDIR

    def _read(self, nodeid: int, body: memoryview) -> list[bytes] | int:
        _fh, offset, size = READ_IN.unpack_from(body)[:3]
        blob = self._by_ino.get(nodeid)
        if blob is None:
            return errno.ENOENT
        size = min(size, max(0, blob.size - offset))
        if size == 0:
            return [b""]
        data = blob.read_fn(offset, size)
        if len(data) > size:
            data = data[:size]
        return [data]

    def _readdir(self, nodeid: int, body: memoryview) -> bytes | int:
        if nodeid != ROOT_ID:
            return errno.ENOTDIR
        _fh, offset, size = READ_IN.unpack_from(body)[:3]
        entries = [(ROOT_ID, b".", DT_DIR), (ROOT_ID, b"..", DT_DIR)]
        entries += [
            (b.ino, b.name.encode(errors="surrogateescape"), DT_REG)
            for b in sorted(self._blobs.values(), key=lambda b: b.name)
        ]
        out = bytearray()
        for i in range(offset, len(entries)):
            ino, name, kind = entries[i]
            rec = DIRENT.pack(ino, i + 1, len(name), kind) + name
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return bytes(out)

    def _statfs(self, nodeid: int, body: memoryview) -> bytes:
        blocks = sum(-(-b.size // 4096) for b in self._blobs.values())
        return STATFS_OUT.pack(blocks, 0, 0, len(self._blobs) + 1, 0, 4096, 255, 4096, 0, *[0] * 6)

    def _ok(self, nodeid: int, body: memoryview) -> int:
        return 0

    def _getxattr(self, nodeid: int, body: memoryview) -> int:
        return errno.ENODATA

    def _listxattr(self, nodeid: int, body: memoryview) -> bytes:
        size = struct.unpack_from("<I", body)[0]
        return XATTR_OUT.pack(0, 0) if size == 0 else b""


_HANDLERS: dict[int, Callable] = {
    LOOKUP: FuseServer._lookup,
    GETATTR: FuseServer._getattr,
    OPEN: FuseServer._open,
    OPENDIR: FuseServer._opendir,
    READ: FuseServer._read,
    READDIR: FuseServer._readdir,
    STATFS: FuseServer._statfs,
    RELEASE: FuseServer._ok,
    RELEASEDIR: FuseServer._ok,
    FLUSH: FuseServer._ok,
    ACCESS: FuseServer._ok,
    DESTROY: FuseServer._ok,
    GETXATTR: FuseServer._getxattr,
    LISTXATTR: FuseServer._listxattr,
}


def abort_connection(mountpoint: Path, scratch: Path) -> bool:
    """Abort the FUSE connection mounted at ``mountpoint`` (through a private ``fusectl``
    mount at ``scratch``, made and removed here): every request waiting on it, and every later
    one, fails with ENOTCONN instead of waiting for a server that is gone while some stray
    process still holds its fd. False if no FUSE file system is mounted there."""
    target = os.fspath(mountpoint)
    minor = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            point = fields[4].encode().decode("unicode_escape")
            if point == target and fstype.split(".")[0] == "fuse":
                minor = fields[2].split(":")[1]  # its connection's number in fusectl
    if minor is None:
        return False
    scratch.mkdir(parents=True, exist_ok=True)
    mount("fusectl", scratch, "fusectl", MS_NOSUID | MS_NODEV, "")
    try:
        (scratch / minor / "abort").write_text("1")
    except FileNotFoundError:  # the connection is gone already
        pass
    finally:
        unmount(scratch)
        scratch.rmdir()
    return True


def send_fuse_fd(sock: socket.socket, server: FuseServer) -> None:
    """Hand ``server``'s live connection to a successor over a unix socket (SCM_RIGHTS).

    The server stops serving first; requests arriving meanwhile queue in the kernel.
    """
    mountpoint = os.fspath(server.mountpoint or "")
    fd = server.detach()
    try:
        socket.send_fds(sock, [mountpoint.encode() or b"\0"], [fd])
    finally:
        os.close(fd)


def recv_fuse_fd(sock: socket.socket) -> tuple[int, Path | None]:
    """Receive what ``send_fuse_fd`` sent: (fd, mountpoint), ready for ``FuseServer.from_fd``."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
    if not fds:
        raise MountError("no FUSE fd received")
    os.set_inheritable(fds[0], False)  # SCM_RIGHTS fds come inheritable: see take_from_keeper
    mountpoint = msg.decode()
    return fds[0], (Path(mountpoint) if mountpoint.strip("\0") else None)
