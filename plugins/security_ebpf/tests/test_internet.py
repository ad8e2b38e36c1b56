"""``network="internet"`` on a real node: a sandbox reaches a server outside the node (a
namespace the test links to the host's, on TEST-NET addresses the host routes) through the
egress namespace's uplink and the host's NAT; private ranges, cloud metadata and the node's
own addresses stay out of reach unless an allow rule opens one; ``"none"`` stays loopback-only;
and a node's stop leaves no uplink, nftables table or route behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from dsec_security_ebpf import egress_namespace
from dsec_security_ebpf.network import uplink_name, uplink_table
from dsec_security_ebpf.testing import (
    HostServerNamespace,
    egress_kit_node,
    start_server,
    stop_server,
)

from dsec_core.linux.netns import links

PUBLIC = "198.51.100.0/24"  # TEST-NET-2: no private range, so "internet" lets it through
PRIVATE = "10.253.77.0/24"


@pytest.fixture
def public(egress, tmp_path):
    with HostServerNamespace(egress.node.home, tmp_path, PUBLIC) as ns:
        ns.serve(tcp=[8080], udp=[5353])
        yield ns


@pytest.fixture
def private(egress, tmp_path):
    with HostServerNamespace(egress.node.home, tmp_path, PRIVATE) as ns:
        ns.serve(tcp=[8080])
        yield ns


def online(dsec_sandboxes, netprobe, network="internet", **spec):
    sb = dsec_sandboxes.create(network=network, **spec)
    sb.write_file("/bin/netprobe", netprobe, mode=0o755)
    return sb


def probe(sb, *args) -> str:
    return sb.exec(["/bin/netprobe", *args], timeout=20).text.strip()


def host_tables() -> set[str]:
    out = subprocess.run(["nft", "-j", "list", "tables"], capture_output=True, text=True).stdout
    return {t["table"]["name"] for t in json.loads(out)["nftables"] if "table" in t}


def test_internet_reaches_outside_through_the_node(dsec_sandboxes, egress, public, netprobe):
    # no policies listed: the mode brings the egress policy with no rules
    sb = online(dsec_sandboxes, netprobe)
    assert probe(sb, "tcp", public.address, "8080", "hello") == "ok"
    assert probe(sb, "udp", public.address, "5353", "datagram") == "ok"
    got = public.received()
    for _ in range(30):  # the server records a datagram as it reads it: let it land
        if len(got) >= 2:
            break
        time.sleep(0.1)
        got = public.received()
    assert sorted((r.kind, r.data) for r in got) == [("tcp", "hello"), ("udp", "datagram")]
    # masqueraded by the host: the server sees the host's address on its link
    assert {r.peer for r in got} == {public.gateway}
    (state,) = [p for p in sb.policies() if p.name == "egress"]
    assert state.state == "enforced" and state.settings == {}
    home = egress.node.home
    assert uplink_name(home) in links(None) and "uplink0" in links(egress_namespace(home))
    assert uplink_table(home) in host_tables()


def test_private_metadata_and_the_nodes_own_addresses_are_refused(
    dsec_sandboxes, egress, public, private, netprobe, tmp_path
):
    # something listening on the host, on the address the host has on the test's link
    record = tmp_path / "host.jsonl"
    argv = [sys.executable, "-m", "dsec_security_ebpf.testing", "serve"]
    host = start_server([*argv, "--bind", public.gateway, "--record", str(record), "--tcp", "8081"])
    try:
        sb = online(dsec_sandboxes, netprobe)
        assert probe(sb, "tcp", private.address, "8080", "x") == "connect: EPERM"
        assert probe(sb, "tcp", "169.254.169.254", "80", "x") == "connect: EPERM"
        assert probe(sb, "udp", "192.168.1.1", "53", "x") == "sendto: EPERM"
        assert probe(sb, "tcp", "127.0.0.1", "8081", "x") == "connect: ECONNREFUSED"  # its own
        # the host's own address is public here, so the host's table drops it (no answer,
        # not even a refusal); the host's server got nothing
        assert probe(sb, "tcp", public.gateway, "8081", "x") == "connect: EINPROGRESS"
        assert record.read_text() == ""
        assert private.received() == []
        # an allow rule opens one private address, live, and the internet stays open
        with egress.node.client() as c:
            c.set_policy(sb.id, "egress", {"allow": [f"{private.address}/32:8080/tcp"]})
        assert probe(sb, "tcp", private.address, "8080", "opened") == "ok"
        assert probe(sb, "tcp", private.address, "8081", "x") == "connect: EPERM"
        assert probe(sb, "tcp", public.address, "8080", "still") == "ok"
        assert [r.data for r in private.received()] == ["opened"]
    finally:
        stop_server(host)


def test_an_allow_rule_at_create_opens_a_private_address(dsec_sandboxes, private, netprobe):
    rule = f"{private.address}/32:8080/tcp"
    sb = online(dsec_sandboxes, netprobe, policies={"egress": {"allow": [rule]}})
    assert probe(sb, "tcp", private.address, "8080", "allowed") == "ok"
    assert [r.data for r in private.received()] == ["allowed"]


def test_none_and_allowlist_do_not_reach_the_internet(dsec_sandboxes, public, netprobe):
    sb = online(dsec_sandboxes, netprobe, network="none")
    assert probe(sb, "tcp", public.address, "8080", "x") == "connect: ENETUNREACH"
    other = online(
        dsec_sandboxes, netprobe, network="allowlist", policies={"egress": {"allow": []}}
    )
    assert probe(other, "tcp", public.address, "8080", "x") == "connect: EPERM"
    assert public.received() == []


def test_internet_survives_a_daemon_restart(dsec_sandboxes, egress, public, private, netprobe):
    sb = online(dsec_sandboxes, netprobe)
    egress.node.restart()  # the old daemon keeps the uplink: a sandbox still uses it
    with egress.node.client() as c:
        sb = c.get(sb.id)
        assert probe(sb, "tcp", public.address, "8080", "after") == "ok"
        assert probe(sb, "tcp", private.address, "8080", "x") == "connect: EPERM"
        # a live change keeps the mode's networks (the new daemon knows the sandbox's mode)
        c.set_policy(sb.id, "egress", {"allow": [f"{private.address}/32:8080/tcp"]})
        assert probe(sb, "tcp", private.address, "8080", "opened") == "ok"
        assert probe(sb, "tcp", public.address, "8080", "still") == "ok"
        assert online(dsec_sandboxes, netprobe).id  # a new one beside it, same uplink
        c.kill(sb.id)
    assert [r.data for r in public.received()] == ["after", "still"]


def test_a_nodes_stop_leaves_no_uplink_behind(tmp_path, netprobe):
    with egress_kit_node(tmp_path) as egress:
        home = egress.node.home
        with egress.node.client() as c:
            sb = c.create(layers=(egress.node.layer.ref,), backend="container", network="internet")
            assert uplink_name(home) in links(None)
            c.kill(sb.id)
    # egress_kit_node checked that the egress namespace is gone; its uplink went with it
    assert uplink_name(home) not in links(None)
    assert uplink_table(home) not in host_tables()
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    assert uplink_name(home) not in routes
