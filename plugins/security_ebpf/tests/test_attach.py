"""The early attach: the policy attaches its programs to the cgroup the OCI config names while
the backend starts the container. A create that fails in between, and a sandbox that runs
somewhere else than the config said, leave no cgroup and no entry in the maps behind."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from dsec_security_ebpf import EgressPolicy
from dsec_security_ebpf.bpf import NodeMaps, registered
from dsec_security_ebpf.rules import MAX_RULES

from dsec_core.backend import SandboxRuntime, StartedSandbox, cgroup_path
from dsec_core.errors import ToolError
from dsec_core.linux.cgroups import cgroup2_root
from dsec_core.records import IdMap, SandboxSpec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (BPF, cgroups)")

SETTINGS = {"allow": ["192.0.2.10/32:443/tcp"]}


@pytest.fixture
def policy(tmp_path, monkeypatch):
    monkeypatch.setenv("DSEC_HOME", os.fspath(tmp_path / "home"))
    EgressPolicy.check_available()
    p = EgressPolicy()
    yield p
    p.close()


def runtime(tmp_path: Path) -> SandboxRuntime:
    sid = "t" + uuid.uuid4().hex[:11]
    spec = SandboxSpec(layers=("x@1",))
    d = tmp_path / sid
    d.mkdir()
    return SandboxRuntime(
        id=sid,
        spec=spec,
        limits=spec.limits,
        dir=d,
        data_dir=d,
        agent_socket=d / "agent.sock",
        agent_binary=d / "agent",
        idmap=IdMap(host_base=100000, size=65536),
    )


def oci_config(rt: SandboxRuntime) -> dict:
    return {"hostname": rt.id, "mounts": [], "linux": {"cgroupsPath": "/" + cgroup_path(rt.id)}}


def attached_programs(cgroup: Path) -> int:
    """How many BPF programs are attached to ``cgroup`` (bpftool reads the kernel's view)."""
    out = subprocess.run(
        ["bpftool", "-j", "cgroup", "show", os.fspath(cgroup)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len(json.loads(out or "[]"))


def test_a_create_failing_between_config_and_start_leaves_nothing(policy, tmp_path):
    root = cgroup2_root()
    assert root is not None
    rt = runtime(tmp_path)
    cgroup = root / cgroup_path(rt.id)
    policy.apply("oci", rt, SETTINGS, oci_config(rt))
    assert cgroup.is_dir()  # made for the attach, before the runtime would join it
    policy.released(rt)  # what the node calls when the backend's start failed
    assert not cgroup.exists()
    assert not registered(rt.id)


def test_programs_are_on_the_cgroup_before_anything_runs_there(policy, tmp_path):
    root = cgroup2_root()
    assert root is not None
    rt = runtime(tmp_path)
    cgroup = root / cgroup_path(rt.id)
    policy.apply("oci", rt, SETTINGS, oci_config(rt))
    try:
        policy.apply(
            "started",
            rt,
            SETTINGS,
            StartedSandbox(pid=os.getpid(), netns=Path("/proc/self/ns/net"), cgroup2=cgroup),
        )
        assert attached_programs(cgroup) >= 4  # connect, sendmsg and egress hooks, v4 and v6
        assert registered(rt.id)
        assert policy.stats(rt)["rules"] == 1
        # a domain that resolves to more addresses than a sandbox may hold changes nothing
        many = {"allow4": {bytes(12 - 4) + i.to_bytes(4, "big") for i in range(MAX_RULES + 1)}}
        with NodeMaps.open() as maps, pytest.raises(ToolError, match="may have"):
            maps.sandbox(rt.id).sync(many)
        assert policy.stats(rt)["rules"] == 1
    finally:
        policy.released(rt)
        cgroup.rmdir()  # the backend's part, here
    assert not registered(rt.id)


def test_a_sandbox_running_elsewhere_gets_the_programs_there(policy, tmp_path):
    root = cgroup2_root()
    assert root is not None
    rt = runtime(tmp_path)
    early = root / cgroup_path(rt.id)
    actual = root / "dsec" / f"{rt.id}-elsewhere"
    actual.mkdir(parents=True)
    try:
        policy.apply("oci", rt, SETTINGS, oci_config(rt))
        started = StartedSandbox(pid=os.getpid(), netns=Path("/proc/self/ns/net"), cgroup2=actual)
        policy.apply("started", rt, SETTINGS, started)
        assert not early.exists()  # the early attach is undone
        assert attached_programs(actual) >= 4
        assert policy.stats(rt)["rules"] == 1
    finally:
        policy.released(rt)
        actual.rmdir()
    assert not registered(rt.id)
