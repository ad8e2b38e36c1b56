"""A VM's network card and where it plugs in on the host.

A VM sandbox with a network mode other than ``"none"`` gets a network namespace of its own,
held by the file ``netns`` in its runtime directory (``make_netns``), and in it the TAP device
``tap0`` whose descriptor QEMU's virtio-net card uses (``open_card``). The security policy that
enforces the mode (``egress``) sets the namespace up as it does a container's: ``eth0``, one
end of a veth into the node's egress namespace, with the sandbox's address and a default route.
``hand_over`` then moves that configuration into the guest: it takes the address and the
gateway off ``eth0`` and puts ``eth0`` and ``tap0`` on a bridge, so the guest's card is where
``eth0`` was, and the guest's agent gives its card the address and routes
(``AgentClient.ifup``). QEMU itself stays in the host's
namespace: it holds the TAP's descriptor and needs no device of its own.

A paused VM's QEMU is gone, and its TAP with it; the namespace, the bridge and ``eth0`` stay,
and the card a resumed QEMU opens joins the bridge again (``open_card``). Removing the
namespace's file (``remove_netns``) once QEMU has ended frees all of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import NetlinkError
from ..linux.netlink import Netlink
from ..linux.netns import new_netns, remove_netns
from ..linux.tap import open_tap

__all__ = [
    "BRIDGE",
    "GUEST_DEVICE",
    "NETNS_FILE",
    "TAP",
    "GuestAddress",
    "hand_over",
    "make_netns",
    "open_card",
    "release_netns",
]

NETNS_FILE = "netns"
TAP = "tap0"
BRIDGE = "br0"
SANDBOX_DEVICE = "eth0"  # what a policy sets up in a sandbox's namespace (``egress``)
GUEST_DEVICE = "eth0"  # the guest's first (only) card
#: In the namespace: no IPv6 on any device made there (a bridge or TAP would send router
#: solicitations out of the sandbox's veth otherwise).
SYSCTLS = {"net/ipv6/conf/default/disable_ipv6": "1", "net/ipv6/conf/all/disable_ipv6": "1"}


@dataclass(frozen=True)
class GuestAddress:
    """What the guest's card takes over: its address and the gateway of its default route."""

    address: str
    prefixlen: int
    gateway: str | None


def netns_file(run_dir: Path) -> Path:
    return Path(run_dir) / NETNS_FILE


def make_netns(run_dir: Path) -> Path:
    """The sandbox's namespace (``run_dir/netns``), made if it is not there."""
    path = netns_file(run_dir)
    if path.exists():
        return path
    return new_netns(path, SYSCTLS)


def release_netns(run_dir: Path) -> None:
    """Let the sandbox's namespace go (its devices go once QEMU has closed its TAP)."""
    remove_netns(netns_file(run_dir))


def open_card(netns: Path) -> int:
    """The TAP device of the guest's card in ``netns``, up, and on the bridge if
    ``hand_over`` has made it (a resumed VM's card); its descriptor."""
    fd = open_tap(netns, TAP)
    try:
        with Netlink.open(netns) as nl:
            tap = nl.link_index(TAP)
            bridge = {link.name: link.index for link in nl.links()}.get(BRIDGE)
            if bridge is not None:
                nl.set_master(tap, bridge)
            nl.set_up(tap)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hand_over(netns: Path) -> GuestAddress | None:
    """Move what a policy set up on ``eth0`` in ``netns`` to the guest's card: ``eth0``'s
    IPv4 address and default gateway come off it, and ``eth0`` and the TAP go on a bridge.
    Returns what the guest is to take, or None if there is no ``eth0`` (the sandbox's card is
    then connected to nothing) or it has no address."""
    with Netlink.open(netns) as nl:
        links = {link.name: link.index for link in nl.links()}
        eth, tap = links.get(SANDBOX_DEVICE), links.get(TAP)
        if eth is None:
            return None
        if tap is None:  # checked before anything changes
            raise NetlinkError(
                f"no {TAP} in {netns}: the VM has no network card", operation="hand_over"
            )
        addresses = [a for a in nl.addresses() if a.index == eth]
        gateway = next(
            (r.gateway for r in nl.routes() if r.oif == eth and r.prefixlen == 0 and r.gateway),
            None,
        )
        for a in addresses:
            nl.delete_address(eth, a.address, a.prefixlen)
        bridge = links.get(BRIDGE)
        if bridge is None:
            nl.add_link(BRIDGE, "bridge")
            bridge = nl.link_index(BRIDGE)
        for port in (eth, tap):
            nl.set_master(port, bridge)
            nl.set_up(port)
        nl.set_up(bridge)
    if not addresses:
        return None
    first = addresses[0]
    return GuestAddress(first.address, first.prefixlen, gateway)
