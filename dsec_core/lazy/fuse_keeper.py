"""The FUSE keeper: keeps a node's FUSE connection open while the node daemon restarts.

The on-demand FUSE filesystem lives as long as some process holds its /dev/fuse fd. This tiny
process (``python -m dsec_core.lazy.fuse_keeper --fd N --socket PATH``, its own session,
nothing imported beyond the standard library) inherits the fd when the daemon first mounts,
and hands a copy to whichever daemon asks on its unix socket: a restarted daemon adopts the
live connection, the kernel re-sends requests the dead one had taken, and readers in sandboxes
never see the mount go away. ``EXIT`` on the socket lets it go (the daemon then unmounts).

Requests: ``GIVE`` -> the fd (SCM_RIGHTS) with the mountpoint as data; ``EXIT`` -> ``OK``.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys

from ..linux.processes import wait_for_exit

__all__ = ["ask_keeper", "dismiss_keeper", "main", "take_from_keeper"]


def ask_keeper(path: str, request: bytes, timeout: float = 2.0) -> tuple[bytes, list[int]]:
    """Send ``request`` to the keeper at ``path``; its answer and any fds it sent."""
    msg, fds, _pid = _ask(path, request, timeout)
    return msg, fds


def take_from_keeper(path: str, timeout: float = 2.0) -> tuple[int | None, int]:
    """A copy of the fd the keeper at ``path`` holds (None if it sent none), and the keeper's
    pid, for watching it. The fd is made close-on-exec: an fd that comes through SCM_RIGHTS is
    inheritable, and the daemon starts QEMU, runc and lxcfs with ``posix_spawn``, which closes
    nothing; a long-lived child holding a copy kept a connection alive that nobody served after
    the daemon died, and every look at the mount (the next daemon's first) hung for good."""
    _msg, fds, pid = _ask(path, b"GIVE", timeout)
    for extra in fds[1:]:
        os.close(extra)
    if not fds:
        return None, pid
    os.set_inheritable(fds[0], False)
    return fds[0], pid


def _ask(path: str, request: bytes, timeout: float) -> tuple[bytes, list[int], int]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        pid = struct.unpack(
            "3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )[0]
        s.sendall(request)
        msg, fds, _flags, _addr = socket.recv_fds(s, 4096, 1)
        return msg, fds, pid


def dismiss_keeper(path: str, timeout: float = 10.0) -> None:
    """Tell the keeper at ``path`` to exit and wait until its process is gone (it may be the
    child of a daemon that died, so the caller cannot wait for it the usual way)."""
    _msg, _fds, pid = _ask(path, b"EXIT", min(timeout, 2.0))
    wait_for_exit(pid, timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hold a FUSE fd across daemon restarts")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--mountpoint", required=True)
    args = ap.parse_args(argv)
    os.set_inheritable(args.fd, False)
    try:
        os.unlink(args.socket)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        srv.bind(args.socket)
    finally:
        os.umask(old)
    srv.listen(16)
    # tell the parent we are ready (it waits on our stdout); a parent killed meanwhile is no
    # reason to let the connection go: the next daemon asks on the socket
    try:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        sys.stdout.close()
    except OSError:  # BrokenPipeError
        pass
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                request = conn.recv(64)
                if request == b"GIVE":
                    socket.send_fds(conn, [args.mountpoint.encode()], [args.fd])
                elif request == b"EXIT":
                    conn.sendall(b"OK")
                    break
                else:
                    conn.sendall(b"?")
            except OSError:
                continue
    os.close(args.fd)
    try:
        os.unlink(args.socket)
    except FileNotFoundError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
