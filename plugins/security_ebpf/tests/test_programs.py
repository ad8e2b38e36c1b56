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
from dsec_security_ebpf.bpf import attach_programs, ensure_bpffs, ensure_object, remove_pins
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
    pins = Path("/sys/fs/bpf/dsec") / cgroup.name
    cgroup.mkdir()
    try:
        # before the programs: root gets a raw packet through
        assert run_in(cgroup, client, [probe, "raw", "10.79.0.2", "5353", "before"]) == "ok"
        ensure_bpffs()
        obj = ensure_object(NodeConfig.from_env().bin_dir)
        rules = parse_settings({"allow": ["10.79.0.2:8080/tcp"]})
        with attach_programs(obj, cgroup, pins) as maps:
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
        remove_pins(pins)
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert not pins.exists() and not cgroup.exists()
