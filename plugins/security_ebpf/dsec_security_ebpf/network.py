"""Where egress goes: one network namespace per node, ``dsec-egress-<hash of DSEC_HOME>``, made
on first use. Each sandbox granted egress gets a veth pair: ``eth0`` in the sandbox's own
namespace, with one address from ``DSEC_EGRESS_SUBNET`` (/32) and a default route through
169.254.0.1, and ``dsv<sandbox id>`` in the egress namespace, which holds 169.254.0.1 and a /32
route back. IPv4 only: IPv6 is off on ``eth0``. The egress namespace forwards sandbox traffic
to every other interface in it (what an operator or a test attaches there: an uplink, a test's
server namespace) and masquerades it; it forwards nothing between sandboxes, accepts nothing
from them addressed to itself, and lets nothing new in. It has no link to the host's
namespace, so the host's loopback and anything listening on the host are out of reach by
construction, until a sandbox of ``network="internet"`` asks for the uplink.

The uplink (``EgressNetwork.ensure_uplink``) is a veth pair: ``uplink0`` in the egress
namespace, its default route, and ``dsu<hash>`` in the host's namespace, a /30 of link-local
addresses between them (169.254.128.0/18, one /30 picked by the same hash, away from the cloud
metadata address). The host's side is a dsec-owned nftables table ``inet dsec_uplink_<hash>``:
what comes in from the uplink is forwarded and masqueraded out of whatever route the host has
(its default one), answers come back, and nothing from the uplink reaches the host itself (its
own addresses, whatever they are) or starts towards the egress namespace. The table and the
pair go when the egress namespace goes. Which destinations a sandbox reaches through it is the
BPF programs' call (``policy``), not the route's.

Making the egress namespace (``ip netns add``, its sysctls and nftables ruleset) runs tools,
once per node. Per sandbox nothing runs: veths, addresses and routes are netlink requests from
the daemon (``dsec_core.linux.netlink``), about 2 ms per attach, and a veth is deleted in the
background after a kill (see ``EgressNetwork.detach``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import threading
from pathlib import Path

from dsec_core.errors import DsecError, InvalidSpec, ToolError
from dsec_core.linux.netlink import Netlink
from dsec_core.linux.netns import (
    NETNS_DIR,
    add_netns,
    call_in_netns,
    delete_netns,
    ip_batch,
    netns_exists,
    open_netns,
    run_in_netns,
)
from dsec_core.linux.tools import run_tool

__all__ = [
    "GATEWAY",
    "UPLINK_DEVICE",
    "EgressNetwork",
    "egress_namespace",
    "uplink_name",
    "uplink_table",
    "veth_name",
]

log = logging.getLogger("dsec.egress")

#: The sandboxes' gateway: the egress side of every sandbox's veth holds it.
GATEWAY = "169.254.0.1"
VETH_PREFIX = "dsv"
SANDBOX_DEVICE = "eth0"
LOOPBACK_INDEX = 1  # lo is the first device of every network namespace
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


#: The uplink's end in the egress namespace (not "dsv*": the ruleset forwards sandboxes to it).
UPLINK_DEVICE = "uplink0"
UPLINK_PREFIX = "dsu"
UPLINK_BLOCK = ipaddress.IPv4Network("169.254.128.0/18")  # 4096 /30s, below 169.254.169.254
# The host's side of the uplink: forward and masquerade what comes from it, let answers back,
# and keep it from the host's own addresses and from starting anything towards it.
UPLINK_RULESET = """
table inet {table}
delete table inet {table}
table inet {table} {{
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{dev}" accept
    oifname "{dev}" ct state established,related accept
    oifname "{dev}" drop
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{dev}" ct state established,related accept
    iifname "{dev}" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    iifname "{dev}" oifname != "{dev}" masquerade
  }}
}}
"""


def _digest(home: Path) -> str:
    return hashlib.sha256(os.fsencode(Path(home).resolve())).hexdigest()[:10]


def egress_namespace(home: Path) -> str:
    """The name (in /run/netns) of the egress namespace of the node at ``home``."""
    return f"dsec-egress-{_digest(home)}"


def uplink_name(home: Path) -> str:
    """The host's end of the uplink of the node at ``home`` (13 characters)."""
    return UPLINK_PREFIX + _digest(home)


def uplink_table(home: Path) -> str:
    """The name of the host's nftables table (family ``inet``) of that uplink."""
    return f"dsec_uplink_{_digest(home)}"


def uplink_addresses(home: Path) -> tuple[str, str]:
    """The host's and the egress namespace's addresses on that uplink (a /30 each)."""
    n = int(_digest(home), 16) % (UPLINK_BLOCK.num_addresses // 4)
    base = UPLINK_BLOCK.network_address + 4 * n
    return str(base + 1), str(base + 2)


def veth_name(sandbox_id: str) -> str:
    """The egress side of a sandbox's veth (at most 15 characters, the kernel's limit)."""
    return VETH_PREFIX + sandbox_id[:12]


class EgressNetwork:
    """The egress namespace of one node and the sandboxes attached to it."""

    def __init__(self, home: Path, subnet: str | None = None) -> None:
        self.name = egress_namespace(home)
        self.uplink = uplink_name(home)
        self.uplink_table = uplink_table(home)
        self.uplink_addresses = uplink_addresses(home)
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
        self._changed = threading.Condition(self._lock)  # a queued removal is done
        self._used: dict[str, str] | None = None  # address -> sandbox veth
        self._removing: list[str] = []  # detached veths the reaper has yet to delete
        self._reaper: threading.Thread | None = None
        # attaches' socket in the egress namespace, kept (opening one takes a thread that
        # enters the namespace); used under _lock, closed with the namespace
        self._nl: Netlink | None = None

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
        self._close_socket()  # one from a namespace of this name that is gone
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

    def ensure_uplink(self) -> None:
        """Make the egress namespace and its uplink to the host's namespace if they are not
        there (see the module's docs). On failure nothing of the uplink is left."""
        with self._lock:
            self._ensure()
            if self.has_uplink():
                return
            host, inside = self.uplink_addresses
            try:
                _host_forwards()
                ip_batch(
                    None,
                    [
                        f"link add {self.uplink} type veth peer name {UPLINK_DEVICE} "
                        f"netns {self.name}",
                        f"addr add {host}/30 dev {self.uplink}",
                        f"link set {self.uplink} up",
                    ],
                    f"making the uplink of {self.name}",
                )
                ip_batch(
                    self.name,
                    [
                        f"addr add {inside}/30 dev {UPLINK_DEVICE}",
                        f"link set {UPLINK_DEVICE} up",
                        f"route replace default via {host} dev {UPLINK_DEVICE}",
                    ],
                    f"the egress side of the uplink of {self.name}",
                )
                rules = UPLINK_RULESET.format(table=self.uplink_table, dev=self.uplink)
                run_tool(["nft", "-f", "-"], f"the host's rules of {self.uplink}", input=rules)
            except BaseException:
                self._remove_uplink()
                raise
            log.info("egress namespace %s: uplink %s to the host made", self.name, self.uplink)

    def has_uplink(self) -> bool:
        """Whether the egress namespace has its uplink to the host."""
        return self.exists() and self._host_end()

    def _host_end(self) -> bool:
        with Netlink.open() as nl:  # the host's namespace: this process's
            return any(link.name == self.uplink for link in nl.links())

    def _remove_uplink(self) -> None:
        """Remove the uplink's host end (its peer goes with it) and its host table; no error if
        they are gone already."""
        if self._host_end():
            try:
                ip_batch(None, [f"link delete {self.uplink}"], f"removing {self.uplink}")
            except ToolError as e:  # gone meanwhile (its namespace was freed)
                log.debug("removing %s: %s", self.uplink, e)
        run_tool(
            ["nft", "-f", "-"],
            f"removing the host's table {self.uplink_table}",
            input=f"table inet {self.uplink_table}\ndelete table inet {self.uplink_table}\n",
        )

    def _addresses(self) -> dict[str, str]:
        if self._used is None:  # a namespace a previous daemon made: read what it holds
            with Netlink.open(self.path) as nl:
                names = {link.index: link.name for link in nl.links()}
                routes = nl.routes()
            self._used = {}
            for r in routes:
                dev = names.get(r.oif or 0, "")
                if dev.startswith(VETH_PREFIX) and r.prefixlen == 32:
                    self._used[r.dst] = dev
        return self._used

    def _allocate(self, veth: str, sandbox_id: str) -> str:
        hosts = self.subnet.num_addresses - 2
        start = int(hashlib.sha256(sandbox_id.encode()).hexdigest()[:8], 16) % hosts
        while True:
            self._ensure()
            used = self._addresses()
            for i in range(hosts):
                addr = str(self.subnet.network_address + 1 + (start + i) % hosts)
                if addr not in used:
                    used[addr] = veth
                    return addr
            if not self._removing:
                raise ToolError(
                    f"egress: no free address left in {self.subnet}", subnet=str(self.subnet)
                )
            # a detached sandbox's address is free once its veth (and route) is gone
            self._changed.wait()

    def attach(
        self, sandbox_id: str, netns: str | os.PathLike[str], index: int | None = None
    ) -> str:
        """Give the sandbox whose network namespace is ``netns`` (``/proc/<pid>/ns/net``) a
        veth into the egress namespace; its address. ``index``: the index the veth's egress
        side takes there (a VM's: ``bpf.port_index``), else the next free one. On failure
        nothing is left.

        All through netlink from this process (``dsec_core.linux.netlink``, on a socket in the
        egress namespace kept between attaches): no program runs per sandbox. The sandbox's
        end is made in its namespace, never anywhere else; its side is set up by a
        short-lived thread that enters the namespace (``call_in_netns``)."""
        veth = veth_name(sandbox_id)
        with self._lock:
            # the same sandbox again (a test; ids are unique): its old veth must go first
            self._changed.wait_for(lambda: veth not in self._removing)
            addr = self._allocate(veth, sandbox_id)  # makes the egress namespace if need be
            made = False
            try:
                if self._nl is None:
                    self._nl = Netlink.open(self.path)
                nl = self._nl
                fd = open_netns(netns)
                try:
                    nl.add_veth(veth, SANDBOX_DEVICE, fd, index=index)
                finally:
                    os.close(fd)
                made = True
                index = nl.link_index(veth)
                nl.add_address(index, GATEWAY)
                nl.set_up(index)
                nl.add_route(addr, 32, index)
                where = os.fspath(netns)
                call_in_netns(netns, lambda: _set_up_sandbox_side(addr, where))
            except BaseException:
                self._close_socket()  # whatever it was in the middle of, the next one is new
                if self._used is not None:
                    self._used.pop(addr, None)
                if made:
                    try:
                        self._delete_link(veth)
                    except DsecError:  # the first failure is the one to report
                        log.exception("sandbox %s: removing its half-made veth", sandbox_id)
                raise
        return addr

    def _delete_link(self, veth: str) -> None:
        if self.exists():
            with Netlink.open(self.path) as nl:
                nl.delete_link(veth)

    def detach(self, sandbox_id: str) -> None:
        """Remove the sandbox's veth (both ends go), in the background: no error if it is gone
        already. Its address stays taken until the veth is gone; ``settle()`` waits for that.

        Deleting a device makes the kernel wait for an RCU grace period (``rcu_barrier`` in
        ``netdev_run_todo``), 15-30 ms on a busy 2-core machine, whoever asks: a kill need not
        wait for it. The sandbox is dead by then (on a failed create, about to be), and the
        kernel's own clean-up of its namespace removes the pair as well; the reaper's delete
        makes the removal certain and prompt, whatever else holds the namespace."""
        veth = veth_name(sandbox_id)
        with self._lock:
            if not self.exists() or veth in self._removing:
                return
            self._removing.append(veth)
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="dsec-egress-reap", daemon=True
                )
                self._reaper.start()

    def _reap(self) -> None:
        while True:
            with self._lock:
                if not self._removing:
                    self._reaper = None
                    self._changed.notify_all()
                    return
                veth = self._removing[0]
            try:
                # outside the lock: attaches go on while the kernel waits
                self._delete_link(veth)
            except Exception:  # the next kill's removal must still happen
                log.exception("removing %s from %s", veth, self.name)
            with self._lock:
                self._removing.remove(veth)
                if self._used is not None:
                    for addr in [a for a, v in self._used.items() if v == veth]:
                        del self._used[addr]
                self._changed.notify_all()

    def settle(self, timeout: float | None = 30.0) -> bool:
        """Wait until every detached veth is gone; whether they all are."""
        with self._lock:
            return self._changed.wait_for(lambda: not self._removing, timeout)

    def address_of(self, sandbox_id: str) -> str | None:
        veth = veth_name(sandbox_id)
        with self._lock:
            if not self.exists() or veth in self._removing:
                return None
            return next((a for a, v in self._addresses().items() if v == veth), None)

    def users(self) -> list[str]:
        """The sandbox veths in the egress namespace."""
        if not self.exists():
            return []
        with Netlink.open(self.path) as nl:
            return [link.name for link in nl.links() if link.name.startswith(VETH_PREFIX)]

    def remove_if_unused(self) -> bool:
        """Remove the egress namespace unless a sandbox still uses it; whether it is gone."""
        with self._lock:
            self._changed.wait_for(lambda: not self._removing, 30.0)
            if self.users():
                return False
            self._close_socket()
            delete_netns(self.name)
            self._remove_uplink()
            self._used = None
            return True

    def _close_socket(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None


def _host_forwards() -> None:
    """Turn on the host's IPv4 forwarding if it is off (Docker and most NAT setups have it on
    already). It stays on: other things on the host may have come to rely on it since."""
    path = Path("/proc/sys/net/ipv4/ip_forward")
    if path.read_text().strip() != "1":
        log.warning("egress: turning on the host's IPv4 forwarding for the uplink")
        path.write_text("1")


def _set_up_sandbox_side(address: str, where: str) -> None:
    """In the sandbox's namespace: ``eth0`` up with ``address`` and a default route through the
    gateway, and loopback up. IPv6 goes off on eth0 first, so it never has even a link-local
    address or neighbour discovery (this /proc/sys file is the namespace's this thread is in)."""
    with open(f"/proc/sys/net/ipv6/conf/{SANDBOX_DEVICE}/disable_ipv6", "w") as f:
        f.write("1")
    with Netlink.open(label=where) as nl:
        nl.set_up(LOOPBACK_INDEX)
        index = nl.link_index(SANDBOX_DEVICE)
        nl.add_address(index, address)
        nl.set_up(index)
        nl.add_route("0.0.0.0", 0, index, gateway=GATEWAY, onlink=True)
