"""The egress policy on a real node: allowed traffic arrives (masqueraded by the egress
namespace), domains resolve when set and again on schedule, the policy survives a daemon
restart, and neither a kill nor a failed create leaves a pinned map, a veth, a cgroup or the
egress namespace behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dsec_security_ebpf import egress_namespace, veth_name
from dsec_security_ebpf.bpf import NodeMaps, registered
from dsec_security_ebpf.testing import ServerNamespace, egress_kit_node, stale_registrations

from dsec_core.backend import cgroup_path
from dsec_core.errors import InvalidSpec, PolicyUnavailable, ToolError
from dsec_core.linux.netns import links
from dsec_core.testing import leftovers, until

UNIFIED = Path("/sys/fs/cgroup/unified")


def allowlisted(dsec_sandboxes, netprobe, *rules, network="allowlist"):
    sb = dsec_sandboxes.create(network=network, policies={"egress": {"allow": list(rules)}})
    sb.write_file("/bin/netprobe", netprobe, mode=0o755)
    return sb


def probe(sb, *args) -> str:
    return sb.exec(["/bin/netprobe", *args], timeout=20).text.strip()


def egress_stats(sb) -> dict:
    (state,) = [p for p in sb.policies() if p.name == "egress"]
    assert state.state == "enforced"
    return dict(state.stats)


def test_allowed_traffic_arrives_through_the_egress_namespace(dsec_sandboxes, servers, netprobe):
    sb = allowlisted(dsec_sandboxes, netprobe, f"{servers.address}:8080/tcp")
    assert probe(sb, "tcp", servers.address, "8080", "hello") == "ok"
    assert probe(sb, "tcp", servers.address, "8081", "nope") == "connect: EPERM"
    got = servers.received()
    assert [(r.port, r.data) for r in got] == [(8080, "hello")]
    assert got[0].peer == servers.gateway  # masqueraded on the way out of the egress namespace
    stats = egress_stats(sb)
    assert stats["denied"] == 1 and stats["denied_by"] == {"connect4": 1}
    assert stats["rules"] == 1 and stats["address"].startswith("10.231.")
    r = sb.exec("ip -4 addr show eth0; ip route").text
    assert stats["address"] in r and "default via 169.254.0.1" in r


def test_network_none_stays_loopback_only_and_counts(dsec_sandboxes, servers, netprobe):
    sb = allowlisted(dsec_sandboxes, netprobe, f"{servers.address}:8080/tcp", network="none")
    assert sb.exec("ls /sys/class/net").text.split() == ["lo"]
    assert probe(sb, "tcp", servers.address, "8080", "x") == "connect: ENETUNREACH"
    assert probe(sb, "udp", servers.address, "5353", "x") == "sendto: EPERM"
    assert egress_stats(sb)["denied_by"] == {"sendmsg4": 1}
    assert servers.received() == []


def test_bad_settings_fail_before_anything_starts(dsec_sandboxes, egress):
    with pytest.raises(InvalidSpec, match=r"allow\[1\].*unknown protocol 'gre'"):
        dsec_sandboxes.create(
            network="allowlist",
            policies={"egress": {"allow": ["10.0.0.1:80/tcp", "10.0.0.1:80/gre"]}},
        )
    with pytest.raises(InvalidSpec, match="port 70000 is out of range"):
        dsec_sandboxes.create(
            network="allowlist", policies={"egress": {"allow": ["a.b:70000/tcp"]}}
        )
    with pytest.raises(PolicyUnavailable, match="needs a security policy"):
        dsec_sandboxes.create(network="allowlist")
    assert dsec_sandboxes.created == []


def test_domains_resolve_when_set_and_on_schedule(
    dsec_sandboxes, egress, servers, netprobe, tmp_path
):
    with ServerNamespace(egress.node.home, tmp_path, 2) as other:
        other.serve(tcp=[8080])
        egress.set_zone({"svc.example": [servers.address]})
        sb = allowlisted(dsec_sandboxes, netprobe, "svc.example:8080/tcp", "gone.example:1/udp")
        stats = egress_stats(sb)
        assert stats["resolved"] == {"svc.example": [servers.address], "gone.example": []}
        assert stats["unresolved"] == ["gone.example"]
        assert f"{servers.address}\tsvc.example" in sb.exec("cat /etc/hosts").text
        # the sandbox finds the name in /etc/hosts, with no DNS of its own
        assert sb.exec("echo by-name | nc -w 2 svc.example 8080; true").exit_code == 0
        assert probe(sb, "tcp", servers.address, "8080", "first") == "ok"
        assert probe(sb, "tcp", other.address, "8080", "early") == "connect: EPERM"

        egress.set_zone({"svc.example": [other.address]})
        until(
            lambda: egress_stats(sb)["resolved"]["svc.example"] == [other.address],
            timeout=10 * egress.refresh,
            every=0.1,
        )
        assert probe(sb, "tcp", other.address, "8080", "moved") == "ok"
        assert probe(sb, "tcp", servers.address, "8080", "stale") == "connect: EPERM"
        assert f"{other.address}\tsvc.example" in sb.exec("cat /etc/hosts").text
        assert [r.data for r in servers.received()] == ["by-name\n", "first"]
        assert [r.data for r in other.received()] == ["moved"]
    assert {q.data for q in egress.queries()} >= {"svc.example", "gone.example"}


def test_cli_changes_it_live_and_inspect_shows_denials(dsec_sandboxes, egress, servers, netprobe):
    sb = allowlisted(dsec_sandboxes, netprobe, f"{servers.address}:8081/tcp")
    assert probe(sb, "tcp", servers.address, "8080", "x") == "connect: EPERM"
    env = {**os.environ, "DSEC_HOME": os.fspath(egress.node.home)}
    dsec = [sys.executable, "-m", "dsec_core.cli"]
    new = json.dumps({"allow": [f"{servers.address}:8080/tcp"]})
    out = subprocess.run(
        [*dsec, "sandbox", "policy", sb.id, "egress", new], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert probe(sb, "tcp", servers.address, "8080", "now") == "ok"
    assert probe(sb, "tcp", servers.address, "8081", "no more") == "connect: EPERM"
    shown = subprocess.run(
        [*dsec, "sandbox", "inspect", sb.id, "--json"], env=env, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    (pol,) = [p for p in json.loads(shown.stdout)["policies"] if p["name"] == "egress"]
    assert pol["stats"]["denied"] == 2 and pol["settings"] == json.loads(new)
    text = subprocess.run(
        [*dsec, "sandbox", "inspect", sb.id], env=env, capture_output=True, text=True
    ).stdout
    assert "denied=2" in text
    bad = subprocess.run(
        [*dsec, "sandbox", "policy", sb.id, "egress", '{"allow": ["10.1.1.1/33:1/tcp"]}'],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "bad CIDR" in bad.stderr
    assert probe(sb, "tcp", servers.address, "8080", "still") == "ok"  # the old rules stand


def test_survives_a_daemon_restart(dsec_sandboxes, egress, servers, netprobe):
    sb = allowlisted(dsec_sandboxes, netprobe, f"{servers.address}:8080/tcp")
    assert probe(sb, "udp", servers.address, "5353", "x") == "sendto: EPERM"
    egress.node.restart()
    with egress.node.client() as c:
        sb = c.get(sb.id)
        assert egress_stats(sb)["denied"] == 1  # the pinned counters, read by a new daemon
        assert probe(sb, "tcp", servers.address, "8081", "x") == "connect: EPERM"
        c.set_policy(sb.id, "egress", {"allow": [f"{servers.address}:8081/tcp"]})
        assert probe(sb, "tcp", servers.address, "8081", "after") == "ok"
        assert egress_stats(sb)["denied"] == 2
        c.kill(sb.id)
    assert not registered(sb.id)


def test_kill_leaves_nothing(dsec_sandboxes, egress, servers, netprobe):
    sb = allowlisted(dsec_sandboxes, netprobe, f"{servers.address}:8080/tcp")
    ns = egress_namespace(egress.node.home)
    assert registered(sb.id) and veth_name(sb.id) in links(ns)
    assert (UNIFIED / cgroup_path(sb.id)).is_dir()
    dsec_sandboxes.client.kill(sb.id)
    assert not registered(sb.id)
    # the veth goes in the background, after the kernel's RCU grace period (tens of ms)
    until(lambda: veth_name(sb.id) not in links(ns), timeout=5, every=0.1)
    assert not (UNIFIED / cgroup_path(sb.id)).exists()
    assert leftovers(egress.node.home)["cgroups"] == []


def test_a_failed_start_leaves_nothing(tmp_path, netprobe):
    # a subnet with room for two sandboxes: the third one's veth cannot be made, after its
    # programs are attached and its maps pinned
    with egress_kit_node(tmp_path, env={"DSEC_EGRESS_SUBNET": "10.232.0.0/30"}) as egress:
        ns = egress_namespace(egress.node.home)
        with egress.node.client() as c:
            spec = dict(
                layers=(egress.node.layer.ref,),
                backend="container",
                network="allowlist",
                policies={"egress": {"allow": ["10.77.9.9:80/tcp"]}},
            )
            made = [c.create(**spec) for _ in range(2)]
            with NodeMaps.open() as maps:
                before = set(maps.sandboxes())
            assert {s.id for s in made} <= before
            with pytest.raises(ToolError, match="no free address"):
                c.create(**spec)
            # the host's maps are shared with other nodes (parallel test workers' too): the
            # failed sandbox's entry, whatever its id, is one whose cgroup is gone
            assert stale_registrations(before) == set()
            with NodeMaps.open() as maps:
                assert {s.id for s in made} <= set(maps.sandboxes())
            assert sorted(links(ns)) == sorted(["lo", *(veth_name(s.id) for s in made)])
            assert len(c.list()) == 2
            left = leftovers(egress.node.home)
            assert sorted(left["sandbox_dirs"]) == sorted(s.id for s in made)
            assert {Path(g).name for g in left["cgroups"]} == {s.id for s in made}
            assert left["processes"] == []
            for s in made:
                c.kill(s.id)
