"""The BPF programs on their own, against a process with every capability: host root in a
cgroup and network namespaces of the test's own. In a sandbox, root has no CAP_NET_RAW; here
it has, so this shows what the programs themselves refuse."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dsec_security_ebpf.bpf import (
    NodeMaps,
    Programs,
    ensure_bpffs,
    ensure_object,
    maps_dir,
    registered,
)
from dsec_security_ebpf.rules import parse_settings, trie_entries
from dsec_security_ebpf.testing import build_probe, read_record, start_server, stop_server

from dsec_core.config import NodeConfig
from dsec_core.linux.netns import add_netns, delete_netns, ip_batch

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
UNIFIED = Path("/sys/fs/cgroup/unified")
SERVE = [sys.executable, "-m", "dsec_security_ebpf.testing", "serve"]


@pytest.fixture
def pair(tmp_path):
    """Namespaces ``client`` (10.79.0.1) and ``server`` (10.79.0.2, recording TCP 8080 and UDP
    5353) joined by a veth."""
    tag = secrets.token_hex(3)
    client, server = f"dsec-test-c{tag}", f"dsec-test-s{tag}"
    add_netns(client)
    add_netns(server)
    proc = None
    try:
        ip_batch(client, [f"link add eth0 type veth peer name eth0 netns {server}"], "veth")
        ip_batch(client, ["addr add 10.79.0.1/24 dev eth0", "link set eth0 up"], "client")
        ip_batch(server, ["addr add 10.79.0.2/24 dev eth0", "link set eth0 up"], "server")
        record = tmp_path / "got.jsonl"
        proc = start_server(
            [*SERVE, "--record", os.fspath(record), "--tcp", "8080", "--udp", "5353"],
            netns=server,
        )
        yield client, record
    finally:
        if proc is not None:
            stop_server(proc)
        delete_netns(client)
        delete_netns(server)


def run_in(cgroup: Path, netns: str, argv: list[str]) -> str:
    script = f'echo $$ > {cgroup}/cgroup.procs && exec "$@"'
    out = subprocess.run(
        ["nsenter", f"--net=/run/netns/{netns}", "sh", "-c", script, "sh", *argv],
        capture_output=True,
        text=True,
        timeout=20,
    )
    return out.stdout.strip()


def test_programs_refuse_what_full_root_tries(pair, tmp_path):
    client, record = pair
    probe = os.fspath(build_probe(tmp_path))
    cgroup = UNIFIED / f"dsec-test-{secrets.token_hex(4)}"
    sandbox = cgroup.name
    cgroup.mkdir()
    programs = None
    try:
        # before the programs: root gets a raw packet through
        assert run_in(cgroup, client, [probe, "raw", "10.79.0.2", "5353", "before"]) == "ok"
        ensure_bpffs()
        programs = Programs.load(ensure_object(NodeConfig.from_env().bin_dir), maps_dir())
        rules = parse_settings({"allow": ["10.79.0.2:8080/tcp"]})
        programs.attach(sandbox, cgroup)
        with NodeMaps.open() as node_maps:
            maps = node_maps.sandbox(sandbox)
            maps.sync(trie_entries(rules, {}))
            assert run_in(cgroup, client, [probe, "raw", "10.79.0.2", "5353", "raw"]) == (
                "socket: EPERM"
            )
            assert run_in(cgroup, client, [probe, "udp", "10.79.0.2", "5353", "udp"]) == (
                "sendto: EPERM"
            )
            assert run_in(cgroup, client, [probe, "tcp", "10.79.0.2", "8080", "tcp"]) == "ok"
            denied = maps.denied()
            assert denied["socket"] == 1 and denied["sendmsg4"] == 1
        time.sleep(0.5)
        assert [(r.kind, r.data) for r in read_record(record)] == [
            ("udp", "before"),
            ("tcp", "tcp"),
        ]
    finally:
        if programs is not None:
            with NodeMaps.open() as node_maps:
                node_maps.unregister(sandbox)
            programs.close()
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert not registered(sandbox) and not cgroup.exists()


def test_each_sandbox_matches_only_its_own_rules(pair, tmp_path):
    """One set of programs and maps serves every sandbox: a rule of one never lets another
    through, and a cgroup nobody registered (a child made inside a sandbox) gets nothing."""
    client, record = pair
    probe = os.fspath(build_probe(tmp_path))
    tag = secrets.token_hex(4)
    allowed, other = UNIFIED / f"dsec-test-a{tag}", UNIFIED / f"dsec-test-b{tag}"
    child = allowed / "child"
    made = [allowed, other]
    for d in made:
        d.mkdir()
    programs = None
    try:
        ensure_bpffs()
        programs = Programs.load(ensure_object(NodeConfig.from_env().bin_dir), maps_dir())
        for d in made:
            programs.attach(d.name, d)
        child.mkdir()
        with NodeMaps.open() as node_maps:
            node_maps.sandbox(allowed.name).sync(
                trie_entries(parse_settings({"allow": ["10.79.0.2:8080/tcp"]}), {})
            )
            node_maps.sandbox(other.name).sync(
                trie_entries(parse_settings({"allow": ["10.79.0.2:8081/tcp"]}), {})
            )
            assert run_in(allowed, client, [probe, "tcp", "10.79.0.2", "8080", "a"]) == "ok"
            assert run_in(other, client, [probe, "tcp", "10.79.0.2", "8080", "b"]) == (
                "connect: EPERM"
            )
            assert run_in(child, client, [probe, "tcp", "10.79.0.2", "8080", "c"]) == (
                "connect: EPERM"
            )
            assert node_maps.sandbox(other.name).denied()["connect4"] == 1
            assert node_maps.sandbox(allowed.name).denied()["connect4"] == 0
            assert list(node_maps.sandbox(other.name).keys("allow4")) == list(
                trie_entries(parse_settings({"allow": ["10.79.0.2:8081/tcp"]}), {})["allow4"]
            )
        time.sleep(0.5)
        assert [(r.kind, r.data) for r in read_record(record)] == [("tcp", "a")]
    finally:
        if programs is not None:
            with NodeMaps.open() as node_maps:
                for d in made:
                    node_maps.unregister(d.name)
            programs.close()
        for d in (child, *made):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
    assert not any(registered(d.name) for d in made)
    assert not any(d.exists() for d in (child, *made))
