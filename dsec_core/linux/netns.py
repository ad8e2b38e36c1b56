"""Network namespaces: named ones (``/run/netns/NAME``, as ``ip netns`` makes them), ones held
by a bind mount at a path of the caller's (``new_netns``, ``remove_netns``), a function
called in a namespace given by name or path (``/proc/PID/ns/net``) without moving this
process's threads, and, through iproute2, programs and batches of ``ip`` commands run in one
(set-up done once, and tests' independent view of what is there)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ..errors import NetlinkError, ToolError
from .tools import run_tool

__all__ = [
    "NETNS_DIR",
    "add_netns",
    "call_in_netns",
    "delete_netns",
    "ip_batch",
    "links",
    "netns_exists",
    "netns_path",
    "new_netns",
    "open_netns",
    "remove_netns",
    "run_in_netns",
]

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
THREAD_NETNS = "/proc/thread-self/ns/net"  # the calling thread's namespace

T = TypeVar("T")

# os.setns is Python 3.12's; glibc's setns(2) wrapper serves 3.11 alike.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MS_BIND = 0x1000
MNT_DETACH = 2
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def add_netns(name: str) -> Path:
    """Create the named network namespace (its loopback up); its path."""
    run_tool(["ip", "netns", "add", name], f"creating network namespace {name}")
    try:
        run_tool(["ip", "-n", name, "link", "set", "lo", "up"], f"bringing up lo in {name}")
    except ToolError:
        delete_netns(name)
        raise
    return NETNS_DIR / name


def delete_netns(name: str) -> None:
    """Remove the named namespace; the kernel frees it, and every device in it (a veth's peer
    included), once no process is left in it. A namespace that is not there is no error."""
    if netns_exists(name):
        run_tool(["ip", "netns", "delete", name], f"removing network namespace {name}")


def new_netns(path: Path, sysctls: dict[str, str] | None = None) -> Path:
    """A new network namespace held by a bind mount at ``path`` (a file made for it), with
    its loopback up and ``sysctls`` (``net/...`` paths under /proc/sys: its own) set before
    any other device is made; ``path``. It lives until ``remove_netns`` and the last process
    in it are gone. On failure nothing is left."""
    path = Path(path)
    path.touch(mode=0o600, exist_ok=False)

    def enter() -> None:
        if _libc.unshare(CLONE_NEWNET) != 0:
            raise _errno_error(f"making a network namespace for {path}", "unshare", path)

    def set_up() -> None:
        for key, value in (sysctls or {}).items():
            with open(f"/proc/sys/{key}", "w") as f:
                f.write(value)
        _loopback_up()
        if _libc.mount(THREAD_NETNS.encode(), os.fsencode(path), None, MS_BIND, None) != 0:
            raise _errno_error(f"holding the network namespace at {path}", "mount", path)

    try:
        _in_own_thread(enter, set_up)
    except BaseException:
        remove_netns(path)
        raise
    return path


def remove_netns(path: Path) -> None:
    """Let go of a namespace ``new_netns`` made: unmount and remove ``path``. The kernel frees
    the namespace, and every device in it, once no process is left in it. A path that is not
    there is no error."""
    path = Path(path)
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        error = _errno_error(f"releasing the network namespace at {path}", "umount", path)
        if error.errno not in (errno.EINVAL, errno.ENOENT):  # not mounted, or not there
            raise error
    path.unlink(missing_ok=True)


def _loopback_up() -> None:
    """Bring up ``lo`` of this thread's namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        ifr = struct.pack("16sH14x", b"lo", 0)
        (flags,) = struct.unpack_from("H", fcntl.ioctl(s, SIOCGIFFLAGS, ifr), 16)
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def netns_path(netns: str | os.PathLike[str]) -> Path:
    """The file of a namespace given by name (in /run/netns) or by path."""
    if isinstance(netns, str) and "/" not in netns:
        return NETNS_DIR / netns
    return Path(netns)


def open_netns(netns: str | os.PathLike[str]) -> int:
    """A descriptor of the namespace ``netns`` (a name in /run/netns or a path, such as
    ``/proc/PID/ns/net``); ``NetlinkError`` if it is not there (its process has gone)."""
    path = netns_path(netns)
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetlinkError(
            f"opening network namespace {path}: {e.strerror}",
            operation="open",
            errno=e.errno,
            netns=os.fspath(path),
        ) from e


def call_in_netns(netns: str | os.PathLike[str], fn: Callable[[], T]) -> T:
    """Call ``fn()`` in the network namespace ``netns`` (a name in /run/netns or a path); its
    result, or what it raised.

    It runs in a thread of its own that enters the namespace with setns(2), goes back to where
    it started before the caller wakes, and ends; were going back refused, the thread would
    still end there, its task with it. No other thread of this process, the caller included,
    ever changes namespace, whatever ``fn`` does or raises. What ``fn`` makes there stays
    there: a socket it opens belongs to ``netns`` for its whole life, used from any thread,
    and a /proc/sys/net file it opens is that namespace's."""
    path = netns_path(netns)
    fd = open_netns(path)
    try:
        return _in_own_thread(lambda: _setns(fd, path), fn)
    finally:
        os.close(fd)


def _in_own_thread(enter: Callable[[], None], fn: Callable[[], T]) -> T:
    """``enter()`` (into another network namespace, or a new one), then ``fn()``, in a
    short-lived thread of their own that goes back to the namespace it started in (its
    creator's) before it ends; ``fn``'s result, or what either raised."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            home = open_netns(THREAD_NETNS)  # a new thread starts in its creator's
        except BaseException as e:
            error.append(e)
            return
        try:
            enter()
            try:
                result.append(fn())
            finally:
                _setns(home, Path(THREAD_NETNS))
        except BaseException as e:
            error.append(e)
        finally:
            os.close(home)

    thread = threading.Thread(target=run, name="dsec-netns", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _setns(fd: int, path: Path) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise _errno_error(f"entering network namespace {path}", "setns", path)


def _errno_error(what: str, operation: str, path: Path) -> NetlinkError:
    """The error of a libc call that just failed (its errno) on namespace ``path``."""
    err = ctypes.get_errno()
    return NetlinkError(
        f"{what}: {os.strerror(err)}", operation=operation, errno=err, netns=os.fspath(path)
    )


def _enter(netns: str | os.PathLike[str] | None) -> list[str]:
    if netns is None:
        return []
    return ["nsenter", f"--net={os.fspath(netns_path(netns))}"]


def run_in_netns(
    netns: str | os.PathLike[str] | None, argv: Sequence[str], what: str, input: str | None = None
) -> str:
    """Run ``argv`` in a network namespace (a name in /run/netns or a path); its stdout."""
    return run_tool([*_enter(netns), *argv], what, input=input).stdout


def ip_batch(netns: str | os.PathLike[str] | None, commands: Sequence[str], what: str) -> None:
    """Run ``ip`` commands (each as after ``ip``) in one process, in a network namespace; the
    first that fails stops the batch and raises ``ToolError``."""
    if commands:
        run_in_netns(netns, ["ip", "-batch", "-"], what, input="\n".join(commands) + "\n")


def links(netns: str | os.PathLike[str] | None) -> list[str]:
    """The names of the network devices in a namespace."""
    out = run_in_netns(netns, ["ip", "-json", "link", "show"], "listing network devices")
    return [link["ifname"] for link in json.loads(out or "[]")]
