"""gVisor sandboxes (``runtime="runsc"``): the conformance kit, proof that the sandbox really
runs on gVisor's kernel, its limits, typed errors for runtimes that cannot be, and nothing left
behind. Skipped where runsc is not installed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from dsec_backend_container import gvisor

from dsec_core.backend import Feature, cgroup_path
from dsec_core.errors import BackendUnavailable, InvalidSpec, PolicyUnavailable
from dsec_core.testing import BackendConformance, cgroup_hierarchies, leftovers

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a dsec node needs root"),
    pytest.mark.skipif(
        shutil.which("runsc") is None,
        reason="gVisor's runsc is not installed (apt-get install runsc)",
    ),
]

GVISOR = {"runtime": "runsc"}


class TestGvisorConformance(BackendConformance):
    backend_name = "container"
    sandbox_spec = GVISOR
    lacks = {
        Feature.SHARED_KERNEL: (
            "under gVisor the sandbox's processes run on the Sentry, gVisor's user-space kernel: "
            "the host's /proc shows the Sentry, not them"
        ),
        Feature.DEVICES: "gVisor implements /dev itself; host devices are not passed in",
    }


@pytest.fixture
def gvisor_sandboxes(dsec_sandboxes):
    dsec_sandboxes.default_spec.update(backend="container", **GVISOR)
    return dsec_sandboxes


@pytest.fixture
def dsec_backend_name() -> str:
    return "container"


def test_the_kernel_is_gvisors(gvisor_sandboxes):
    sb = gvisor_sandboxes.create()
    assert sb.info.runtime == "runsc"
    dmesg = sb.exec("dmesg 2>&1").stdout
    assert b"gVisor" in dmesg, dmesg[:300]
    inside = sb.exec("cat /proc/version").stdout
    assert inside != Path("/proc/version").read_bytes()


def test_runc_is_still_the_default(dsec_sandboxes):
    sb = dsec_sandboxes.create()
    assert sb.info.runtime == "runc"
    assert b"gVisor" not in sb.exec("dmesg 2>&1; true").stdout


def test_limits_hold(gvisor_sandboxes):
    sb = gvisor_sandboxes.create(memory="64M", cpu=0.5)
    rel = cgroup_path(sb.id)
    held = [h / rel for h in cgroup_hierarchies() if (h / rel).is_dir()]
    assert held, "no cgroup at the contract path"
    mem = Path("/sys/fs/cgroup/memory") / rel / "memory.limit_in_bytes"
    if mem.exists():
        assert int(mem.read_text()) == 64 << 20
    r = sb.exec("dd if=/dev/zero of=/dev/null bs=200M count=1", timeout=30)
    assert r.exit_code != 0
    u = sb.usage()
    assert u.memory and u.cpu_seconds is not None and u.pids


def test_unknown_runtime_is_invalid(gvisor_sandboxes):
    with pytest.raises(InvalidSpec) as e:
        gvisor_sandboxes.create(runtime="kata")
    assert e.value.field == "runtime"


def test_runtime_on_another_backend_is_invalid(dsec_client, dsec_node):
    with pytest.raises(InvalidSpec) as e:
        dsec_client.create(layers=[dsec_node.layer.ref], backend="fncall", runtime="runsc")
    assert e.value.field == "runtime"


def test_network_other_than_none_is_refused(gvisor_sandboxes, dsec_node):
    with pytest.raises((PolicyUnavailable, InvalidSpec)):
        gvisor_sandboxes.create(network="egress")
    assert not [d for d in leftovers(dsec_node.home)["sandbox_dirs"]]


def test_missing_runsc_names_the_package(monkeypatch):
    from dsec_backend_container.runc import find_runtime

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BackendUnavailable) as e:
        find_runtime("runsc")
    assert "apt-get install runsc" in str(e.value) and e.value.missing == "runsc"


def test_kill_leaves_no_runsc_process_or_state(gvisor_sandboxes, dsec_node):
    sb = gvisor_sandboxes.create()
    root = dsec_node.config.run_dir / "runsc" / sb.id
    assert root.is_dir()
    pids = _runsc_pids(sb.id)
    assert pids, "no runsc process names the sandbox"
    sb.kill()
    assert _runsc_pids(sb.id) == []
    assert not root.exists()
    left = leftovers(dsec_node.home)
    assert not [x for v in left.values() for x in v if sb.id in x], left


def test_platform_is_ptrace_without_real_kvm():
    if not gvisor.kvm_usable():
        assert gvisor.platform() == "ptrace"
    else:
        assert gvisor.platform() == "kvm"


def _runsc_pids(sandbox_id: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and b"runsc" in argv[0] and sandbox_id.encode() in argv:
                found.append(int(pid))
    return found
