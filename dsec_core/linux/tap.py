"""TAP devices: a virtual Ethernet card whose other end is a file descriptor (a VM's network
card, in QEMU's ``-netdev tap,fd=``), made in a given network namespace."""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

from ..errors import NetlinkError
from .netns import call_in_netns

__all__ = ["open_tap"]

TUN_DEVICE = "/dev/net/tun"
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000


def open_tap(netns: str | os.PathLike[str], name: str) -> int:
    """Make the TAP device ``name`` in the network namespace ``netns`` (a name in /run/netns
    or a path) and return its descriptor (close-on-exec; pass it on explicitly). Frames carry
    a virtio-net header (``IFF_VNET_HDR``), which QEMU uses for offloads. The device lives
    while the descriptor is open, down until brought up; ``NetlinkError`` if it cannot be made
    (a device of that name there already: EBUSY)."""

    def make() -> int:
        fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC)
        try:
            ifr = struct.pack("16sH14x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
            fcntl.ioctl(fd, TUNSETIFF, ifr)
        except OSError as e:
            os.close(fd)
            raise NetlinkError(
                f"making TAP device {name} in {Path(netns)}: {e.strerror}",
                operation="TUNSETIFF",
                errno=e.errno,
                netns=os.fspath(netns),
            ) from e
        except BaseException:
            os.close(fd)
            raise
        return fd

    try:
        return call_in_netns(netns, make)
    except FileNotFoundError as e:
        raise NetlinkError(
            f"{TUN_DEVICE} is missing: the kernel has no TUN/TAP (modprobe tun)",
            operation="open",
            errno=e.errno,
        ) from e
