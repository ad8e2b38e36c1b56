"""Where egress goes: one network namespace per node, ``dsec-egress-<hash of DSEC_HOME>``, made
on first use. Each sandbox granted egress gets a veth pair: ``eth0`` in the sandbox's own
namespace, with one address from ``DSEC_EGRESS_SUBNET`` (/32) and a default route through
169.254.0.1, and ``dsv<sandbox id>`` in the egress namespace, which holds 169.254.0.1 and a /32
route back. IPv4 only: IPv6 is off on ``eth0``. The egress namespace forwards sandbox traffic
to every other interface in it (what an operator or a test attaches there: an uplink, a test's
server namespace) and masquerades it; it forwards nothing between sandboxes, accepts nothing
from them addressed to itself, and lets nothing new in. It has no link to the host's
namespace, so the host's loopback and anything listening on the host are out of reach by
construction.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import threading
from pathlib import Path

from dsec_core.errors import InvalidSpec, ToolError
from dsec_core.linux.netns import (
    NETNS_DIR,
    add_netns,
    delete_netns,
    ip_batch,
    links,
    netns_exists,
    run_in_netns,
)

__all__ = ["GATEWAY", "EgressNetwork", "egress_namespace", "veth_name"]

#: The sandboxes' gateway: the egress side of every sandbox's veth holds it.
GATEWAY = "169.254.0.1"
VETH_PREFIX = "dsv"
DEFAULT_SUBNET = "10.231.0.0/16"

# Forwarding and masquerading out of the egress namespace. Sandboxes' veths are "dsv*";
# anything else there is a way onward.
RULESET = """
table inet dsec_egress {
  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "dsv*" oifname != "dsv*" accept
  }
  chain input {
    type filter hook input priority filter; policy accept;
    iifname "dsv*" ct state established,related accept
    iifname "dsv*" drop
  }
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    iifname "dsv*" oifname != "dsv*" masquerade
  }
}
"""
SYSCTLS = {
    "net/ipv4/ip_forward": "1",
    "net/ipv4/conf/all/rp_filter": "1",  # a sandbox cannot send with another's address
    "net/ipv4/conf/default/rp_filter": "1",
}


def egress_namespace(home: Path) -> str:
    """The name (in /run/netns) of the egress namespace of the node at ``home``."""
    digest = hashlib.sha256(os.fsencode(Path(home).resolve())).hexdigest()[:10]
    return f"dsec-egress-{digest}"


def veth_name(sandbox_id: str) -> str:
    """The egress side of a sandbox's veth (at most 15 characters, the kernel's limit)."""
    return VETH_PREFIX + sandbox_id[:12]


class EgressNetwork:
    """The egress namespace of one node and the sandboxes attached to it."""

    def __init__(self, home: Path, subnet: str | None = None) -> None:
        self.name = egress_namespace(home)
        text = subnet or os.environ.get("DSEC_EGRESS_SUBNET") or DEFAULT_SUBNET
        try:
            net = ipaddress.ip_network(text)
        except ValueError as e:
            raise InvalidSpec(f"DSEC_EGRESS_SUBNET: {e}", field="DSEC_EGRESS_SUBNET") from e
        if not isinstance(net, ipaddress.IPv4Network) or net.num_addresses < 4:
            raise InvalidSpec(
                f"DSEC_EGRESS_SUBNET {text!r}: an IPv4 network of at least 4 addresses",
                field="DSEC_EGRESS_SUBNET",
            )
        self.subnet = net
        self._lock = threading.Lock()
        self._used: dict[str, str] | None = None  # address -> sandbox veth

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    def exists(self) -> bool:
        return netns_exists(self.name)

    def ensure(self) -> None:
        """Make the egress namespace if it is not there."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        if self.exists():
            return
        add_netns(self.name)
        try:
            script = " && ".join(f"echo {v} > /proc/sys/{k}" for k, v in SYSCTLS.items())
            run_in_netns(
                self.name,
                ["sh", "-c", script + " && nft -f -"],
                f"setting up egress namespace {self.name}",
                input=RULESET,
            )
        except BaseException:
            delete_netns(self.name)
            raise
        self._used = {}

    def _addresses(self) -> dict[str, str]:
        if self._used is None:  # a namespace a previous daemon made: read what it holds
            out = run_in_netns(self.name, ["ip", "-json", "route", "show"], "listing routes")
            self._used = {
                r["dst"]: r.get("dev", "")
                for r in json.loads(out or "[]")
                if str(r.get("dev", "")).startswith(VETH_PREFIX)
            }
        return self._used

    def _allocate(self, veth: str, sandbox_id: str) -> str:
        used = self._addresses()
        hosts = self.subnet.num_addresses - 2
        start = int(hashlib.sha256(sandbox_id.encode()).hexdigest()[:8], 16) % hosts
        for i in range(hosts):
            addr = str(self.subnet.network_address + 1 + (start + i) % hosts)
            if addr not in used:
                used[addr] = veth
                return addr
        raise ToolError(f"egress: no free address left in {self.subnet}", subnet=str(self.subnet))

    def attach(self, sandbox_id: str, pid: int) -> str:
        """Give the sandbox whose init is ``pid`` a veth into the egress namespace; its
        address. On failure nothing is left."""
        veth = veth_name(sandbox_id)
        sandbox_ns = f"/proc/{pid}/ns/net"
        with self._lock:
            self._ensure()
            addr = self._allocate(veth, sandbox_id)
            try:
                ip_batch(
                    self.name,
                    [
                        f"link add {veth} type veth peer name eth0 netns {pid}",
                        f"addr add {GATEWAY}/32 dev {veth}",
                        f"link set {veth} up",
                        f"route add {addr}/32 dev {veth}",
                    ],
                    f"sandbox {sandbox_id}: its veth in {self.name}",
                )
                # IPv4 only: no IPv6 on eth0, so not even link-local neighbour discovery
                run_in_netns(
                    sandbox_ns,
                    [
                        "sh",
                        "-c",
                        "echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6 && exec ip -batch -",
                    ],
                    f"sandbox {sandbox_id}: its eth0",
                    input="\n".join(
                        [
                            "link set lo up",
                            f"addr add {addr}/32 dev eth0",
                            "link set eth0 up",
                            f"route add default via {GATEWAY} dev eth0 onlink",
                        ]
                    )
                    + "\n",
                )
            except BaseException:
                if self._used is not None:
                    self._used.pop(addr, None)
                self._delete_link(veth)
                raise
        return addr

    def _delete_link(self, veth: str) -> None:
        if not self.exists():
            return
        try:
            ip_batch(self.name, [f"link delete {veth}"], f"removing {veth}")
        except ToolError as e:
            if "Cannot find device" not in e.stderr:
                raise

    def detach(self, sandbox_id: str) -> None:
        """Remove the sandbox's veth (both ends go); no error if it is gone already."""
        veth = veth_name(sandbox_id)
        with self._lock:
            if self._used is not None:
                for addr in [a for a, v in self._used.items() if v == veth]:
                    del self._used[addr]
            self._delete_link(veth)

    def address_of(self, sandbox_id: str) -> str | None:
        veth = veth_name(sandbox_id)
        with self._lock:
            if not self.exists():
                return None
            return next((a for a, v in self._addresses().items() if v == veth), None)

    def users(self) -> list[str]:
        """The sandbox veths in the egress namespace."""
        if not self.exists():
            return []
        return [name for name in links(self.name) if name.startswith(VETH_PREFIX)]

    def remove_if_unused(self) -> bool:
        """Remove the egress namespace unless a sandbox still uses it; whether it is gone."""
        with self._lock:
            if self.users():
                return False
            delete_netns(self.name)
            self._used = None
            return True
