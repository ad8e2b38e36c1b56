"""The egress policy on a microVM, as on a container: the guest has a network card (a TAP in
the sandbox's own namespace, bridged to its veth), takes the sandbox's address, reaches what
its allowlist allows and nothing else (its packets are checked on the veth: the guest's own
kernel makes its sockets, which no cgroup hook sees), follows live changes and a daemon
restart and a pause, and leaves nothing behind: no veth, namespace, pinned link or map entry."""

from __future__ import annotations

import os
import shutil

import pytest
from dsec_security_ebpf import egress_namespace, veth_name
from dsec_security_ebpf.bpf import NodeMaps, port_index, port_pin, registered
from dsec_security_ebpf.testing import egress_kit_node, stale_registrations

from dsec_core.errors import ToolError
from dsec_core.linux.netns import links
from dsec_core.testing import leftovers, until

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-system-x86_64") is None, reason="QEMU is not installed"
)


def _ports() -> dict[int, int]:
    """The ``ports`` map's entries (every node's): veth index -> cgroup id."""
    with NodeMaps.open() as maps:
        return maps.ports()


def _allowing_8080(dsec_sandboxes, servers, netprobe):
    """A microVM allowed TCP 8080 of the test's server namespace, with the probe in it."""
    sb = dsec_sandboxes.create(
        backend="microvm",
        memory="256M",
        network="allowlist",
        policies={"egress": {"allow": [f"{servers.address}:8080/tcp"]}},
    )
    sb.write_file("/bin/netprobe", netprobe, mode=0o755)
    return sb


def _probe(sb, *args: str) -> str:
    return sb.exec(["/bin/netprobe", *args], timeout=30).text.strip()


def _stats(sb) -> dict:
    (state,) = [p for p in sb.policies() if p.name == "egress"]
    assert state.state == "enforced"
    return dict(state.stats)


def test_a_microvm_reaches_what_its_allowlist_allows_and_nothing_else(
    dsec_sandboxes, egress, servers, netprobe
):
    sb = _allowing_8080(dsec_sandboxes, servers, netprobe)
    stats = _stats(sb)
    address = stats["address"]
    assert address.startswith("10.231.")
    shown = sb.exec("/.dsec/busybox ip -4 addr show eth0; /.dsec/busybox ip route").text
    assert f"inet {address}/32" in shown and "default via 169.254.0.1" in shown

    # allowed: arrives, masqueraded by the egress namespace
    assert _probe(sb, "tcp", servers.address, "8080", "hello") == "ok"
    # refused: the guest's SYN and datagram are dropped on the veth and counted
    assert _probe(sb, "tcp", servers.address, "8081", "nope").startswith("connect: E")
    assert _probe(sb, "udp", servers.address, "5353", "dropped") == "ok"  # left the guest
    assert _probe(sb, "tcp", "169.254.0.1", "22", "gw").startswith("connect: E")
    got = servers.received()
    assert [(r.port, r.data) for r in got] == [(8080, "hello")]
    assert got[0].peer == servers.gateway
    stats = _stats(sb)
    assert stats["denied_by"].keys() == {"packet"} and stats["denied"] >= 3

    # a live change: 8081 opens, 8080 closes
    sb.set_policy("egress", {"allow": [f"{servers.address}:8081/tcp"]})
    assert _probe(sb, "tcp", servers.address, "8081", "after") == "ok"
    assert _probe(sb, "tcp", servers.address, "8080", "closed").startswith("connect: E")

    # paused, its QEMU is gone and its card with it; resumed, a new card joins the bridge
    sb.pause()
    sb.resume()
    assert _probe(sb, "tcp", servers.address, "8081", "resumed") == "ok"

    # a restarted daemon finds it enforced: the link and the maps are pinned
    egress.node.restart()
    with egress.node.client() as c:
        sb = c.get(sb.id)
        assert _probe(sb, "tcp", servers.address, "8080", "still").startswith("connect: E")
        assert _probe(sb, "tcp", servers.address, "8081", "again") == "ok"
        assert [(r.port, r.data) for r in servers.received()] == [
            (8080, "hello"),
            (8081, "after"),
            (8081, "resumed"),
            (8081, "again"),
        ]

        ns = egress_namespace(egress.node.home)
        index = None
        for line in os.popen(f"ip -n {ns} -o link show {veth_name(sb.id)}"):
            index = int(line.split(":", 1)[0])
        # the veth's index is made from the sandbox's cgroup id: unique on the host
        with NodeMaps.open() as maps:
            cgroup_id = maps.cgroup_of(sb.id)
        assert cgroup_id is not None and index == port_index(cgroup_id)
        assert _ports()[index] == cgroup_id and port_pin(sb.id).exists()
        c.kill(sb.id)
    assert not registered(sb.id)
    assert index not in _ports() and not port_pin(sb.id).exists()
    until(lambda: veth_name(sb.id) not in links(ns), timeout=5, every=0.1)
    left = leftovers(egress.node.home)
    assert left["mounts"] == [m for m in left["mounts"] if "/sandboxes/" not in m], left
    assert left["cgroups"] == [] and left["processes"] == []


def test_a_microvm_without_network_has_no_card(dsec_sandboxes, egress):
    sb = dsec_sandboxes.create(backend="microvm", memory="256M")
    assert sb.exec("ls /sys/class/net").text.split() == ["lo"]


def test_forks_of_a_microvm_get_addresses_of_their_own(dsec_sandboxes, egress, servers, netprobe):
    """A memory snapshot's forks wake with the parent's card and address: each is given its
    own, and its own veth and rules, before anything runs in it."""
    c = dsec_sandboxes.client
    sb = _allowing_8080(dsec_sandboxes, servers, netprobe)
    snap = sb.snapshot_memory(name=f"net-{sb.id}")
    forks = c.restore(snap.name, 2)
    try:
        addresses = {_stats(s)["address"] for s in (sb, *forks)}
        assert len(addresses) == 3
        for f in forks:
            mine = _stats(f)["address"]
            shown = f.exec("/.dsec/busybox ip -4 addr show eth0").text
            assert f"inet {mine}/32" in shown and shown.count("inet ") == 1
            assert _probe(f, "tcp", servers.address, "8080", f.id) == "ok"
        assert _probe(sb, "tcp", servers.address, "8080", sb.id) == "ok"
        assert sorted(r.data for r in servers.received()) == sorted([sb.id, *(f.id for f in forks)])
    finally:
        for f in forks:
            c.kill(f.id)
        c.remove_memory_snapshot(snap.name)


def test_a_microvm_whose_network_cannot_be_made_leaves_nothing(tmp_path):
    """The egress subnet has room for two sandboxes, which containers take: the microVM's
    veth cannot be made after its QEMU runs with its card in its namespace; the create fails
    and nothing of it stays (no QEMU, namespace mount, cgroup, registration or directory)."""
    with egress_kit_node(tmp_path, env={"DSEC_EGRESS_SUBNET": "10.233.0.0/30"}) as egress:
        with egress.node.client() as c:
            spec = dict(
                layers=(egress.node.layer.ref,),
                network="allowlist",
                policies={"egress": {"allow": ["10.77.9.9:80/tcp"]}},
            )
            made = [c.create(backend="container", **spec) for _ in range(2)]
            before = leftovers(egress.node.home)
            with NodeMaps.open() as maps:
                registered_before = set(maps.sandboxes())
            with pytest.raises(ToolError, match="no free address"):
                c.create(backend="microvm", memory="256M", **spec)
            assert sorted(s.id for s in c.list()) == sorted(s.id for s in made)
            assert stale_registrations(registered_before) == set()
            until(lambda: leftovers(egress.node.home) == before, timeout=10, every=0.2)
            for s in made:
                c.kill(s.id)
