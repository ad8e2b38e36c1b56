"""gVisor sandboxes (``runtime="runsc"``): the conformance kit, proof that the sandbox really
runs on gVisor's kernel, its limits, typed errors for runtimes that cannot be, and nothing left
behind. Skipped where runsc is not installed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from dsec_backend_container import gvisor

from dsec_core.api.shapes import decoder, encoder
from dsec_core.backend import Feature, cgroup_path
from dsec_core.cli import cli
from dsec_core.config import NodeConfig
from dsec_core.errors import BackendUnavailable, DsecError, InvalidSpec, PolicyUnavailable
from dsec_core.records import SandboxSpec
from dsec_core.testing import (
    BackendConformance,
    cgroup_hierarchies,
    leftovers,
    running_kit_node,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a dsec node needs root")
needs_runsc = pytest.mark.skipif(
    shutil.which("runsc") is None, reason="gVisor's runsc is not installed (apt-get install runsc)"
)

GVISOR = {"runtime": "runsc"}
#: What gVisor's Sentry answers in /proc/version, whatever the host runs.
GVISOR_VERSION = b"Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016"


@needs_root
@needs_runsc
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
    differs = {
        "test_root_inside_is_not_root_outside": (
            "gVisor shows its processes its own user namespace (uid_map 0 0 4294967295); on "
            "the host the Sentry runs as nobody and the gofer as the sandbox's root uid, never "
            "as host root (test_no_runsc_process_is_host_root)"
        ),
        "test_memory_limit": (
            "the memory cgroup holds the Sentry, gVisor's kernel, and the host's OOM killer "
            "takes it whole: the sandbox dies instead of its one command (test_limits_hold)"
        ),
        "test_pids_limit": (
            "the host's pids cgroup counts the Sentry's threads and ptrace stubs, not the "
            "sandbox's processes: its limit is gvisor.host_pids_limit(pids), and usage pids "
            "are host tasks (test_limits_hold)"
        ),
        "test_exec_leaves_nothing_running": (
            "gVisor (runsc 20221219) reparents orphans to PID 1, not to the exec's "
            "PR_SET_CHILD_SUBREAPER handler, so the agent cannot tell a finished command's "
            "setsid'd or double-forked leftovers from other work; timeouts and exclusive "
            "still kill them (test_timeout_kills_process_tree)"
        ),
    }


@pytest.fixture
def gvisor_sandboxes(dsec_sandboxes):
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    if shutil.which("runsc") is None:
        pytest.skip("gVisor's runsc is not installed (apt-get install runsc)")
    dsec_sandboxes.default_spec.update(backend="container", **GVISOR)
    return dsec_sandboxes


@pytest.fixture
def dsec_backend_name() -> str:
    return "container"


def test_the_kernel_is_gvisors(gvisor_sandboxes, dsec_client):
    """The sandbox's kernel is gVisor's: its /proc/version is the Sentry's (gVisor reports a
    fixed 4.4.0 of 2016), not the host's, and the host process behind it is runsc's."""
    sb = gvisor_sandboxes.create()
    assert sb.info.runtime == "runsc"
    inside = sb.exec("cat /proc/version").stdout
    assert inside != Path("/proc/version").read_bytes()
    assert GVISOR_VERSION in inside, inside
    pid = dsec_client.get(sb.id).info.pid
    assert os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("runsc"), pid
    # the kernel log is gVisor's too, where root inside may read it (klogctl wants CAP_SYSLOG)
    dmesg = sb.exec("dmesg 2>&1").stdout
    assert b"gVisor" in dmesg or b"not permitted" in dmesg, dmesg[:300]


def test_no_runsc_process_is_host_root(gvisor_sandboxes):
    """The Sentry (``runsc-sandbox``) and the gofer run as unprivileged host uids: the gofer
    as the sandbox's root (the first uid of its range), the Sentry as nobody."""
    sb = gvisor_sandboxes.create()
    host_root = int(sb.exec("cat /proc/self/uid_map").stdout.split()[1])  # gVisor's own: 0
    pids = _runsc_pids(sb.id)
    assert len(pids) >= 2, pids  # the sandbox and its gofer
    for pid in pids:
        uid = int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])
        assert uid != 0, f"runsc process {pid} runs as host root"
    assert host_root == 0  # what gVisor shows inside, whatever the host uid


@needs_root
def test_gvisor_is_not_the_default(dsec_sandboxes):
    """The default stays a native runtime: crun where it is installed (run.sh installs it),
    else runc; runc can still be asked for by name."""
    sb = dsec_sandboxes.create()
    assert sb.info.runtime == ("crun" if shutil.which("crun") else "runc")
    assert GVISOR_VERSION not in sb.exec("cat /proc/version").stdout
    sb = dsec_sandboxes.create(runtime="runc")
    assert sb.info.runtime == "runc"
    assert sb.exec("cat /proc/version").stdout == Path("/proc/version").read_bytes()


def test_limits_hold(gvisor_sandboxes, dsec_client):
    """The cgroup limits are set at the contract path and hold: CPU time at its quota, a
    memory hog stopped (under gVisor the OOM killer takes the Sentry, so the sandbox goes),
    and host tasks bounded by ``host_pids_limit``."""
    sb = gvisor_sandboxes.create(memory="64M", cpu=0.25, pids=50)
    rel = cgroup_path(sb.id)
    assert [h / rel for h in cgroup_hierarchies() if (h / rel).is_dir()]
    v1 = Path("/sys/fs/cgroup")
    assert int((v1 / "memory" / rel / "memory.limit_in_bytes").read_text()) == 64 << 20
    assert int((v1 / "pids" / rel / "pids.max").read_text()) == gvisor.host_pids_limit(50)
    before = sb.usage().cpu_seconds
    sb.exec("timeout 2 sh -c 'while :; do :; done'", timeout=10)
    used = sb.usage().cpu_seconds - before
    assert 0.1 < used < 0.25 * 2 * 1.6 + 0.3, used
    try:
        r = sb.exec("dd if=/dev/zero of=/dev/null bs=200M count=1", timeout=30)
    except DsecError:
        pass  # the sandbox died with its Sentry
    else:
        assert r.exit_code != 0, r


def test_unknown_runtime_is_invalid(gvisor_sandboxes):
    with pytest.raises(InvalidSpec) as e:
        gvisor_sandboxes.create(runtime="kata")
    assert e.value.field == "runtime"


@needs_root
def test_runtime_on_another_backend_is_invalid(dsec_client, dsec_node):
    with pytest.raises(InvalidSpec) as e:
        dsec_client.create(layers=[dsec_node.layer.ref], backend="fncall", runtime="runsc")
    assert e.value.field == "runtime"


def test_network_other_than_none_is_refused(gvisor_sandboxes, dsec_node):
    with pytest.raises((PolicyUnavailable, InvalidSpec)):
        gvisor_sandboxes.create(network="egress")
    assert not [d for d in leftovers(dsec_node.home)["sandbox_dirs"]]


def test_landlock_is_refused_clearly(gvisor_sandboxes, dsec_node):
    """gVisor has no Landlock: a file policy is PolicyUnavailable saying so, and the failed
    create leaves nothing behind."""
    with pytest.raises(PolicyUnavailable) as e:
        gvisor_sandboxes.create(policies={"landlock": {"read_only": ["/usr"]}})
    assert e.value.policy == "landlock" and "gVisor" in str(e.value), e.value
    left = leftovers(dsec_node.home)  # the node's own mounts (run/, layers, lxcfs) stay
    sandbox_mounts = [m for m in left["mounts"] if "/sandboxes/" in m]
    assert not left["sandbox_dirs"] and not sandbox_mounts and not left["cgroups"], left
    assert not any((dsec_node.config.run_dir / "runsc").iterdir())
    assert _runsc_pids(os.fspath(dsec_node.home)) == []  # no sandbox of the node is left


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
    gofer = gvisor.gofer_pid(root)
    assert gofer is not None and gofer in _runsc_pids(sb.id), "runsc's state names no gofer"
    pids = _runsc_pids(sb.id)
    assert pids, "no runsc process names the sandbox"
    sb.kill()
    assert _runsc_pids(sb.id) == [] and not _running(gofer)
    assert not root.exists()
    left = leftovers(dsec_node.home)
    assert not [x for v in left.values() for x in v if sb.id in x], left


def test_platform_is_ptrace_without_real_kvm():
    if not gvisor.kvm_usable():
        assert gvisor.platform() == "ptrace"
    else:
        assert gvisor.platform() == "kvm"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie (a killed gofer waits for the host's
    init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _runsc_pids(needle: str) -> list[int]:
    """Host pids of runsc processes (sandbox, gofer, ...) whose command line has ``needle``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            argv0 = os.path.basename(cmdline.split(b"\0")[0])
            if argv0.startswith(b"runsc") and needle.encode() in cmdline:
                found.append(int(pid))
    return found


def test_the_runtime_is_a_spec_field_on_the_wire():
    spec = SandboxSpec(layers=["base@1"], runtime="runsc")
    encode = encoder(SandboxSpec)
    assert encode is not None
    wire = encode(spec)
    assert wire["runtime"] == "runsc"
    assert decoder(SandboxSpec)(wire, "spec") == spec
    assert SandboxSpec(layers=["base@1"]).runtime is None
    with pytest.raises(InvalidSpec) as e:
        SandboxSpec(layers=["base@1"], runtime=3)
    assert e.value.field == "runtime"


def test_the_node_default_comes_from_dsec_runtime(monkeypatch, tmp_path):
    monkeypatch.setenv("DSEC_HOME", os.fspath(tmp_path))
    monkeypatch.delenv("DSEC_RUNTIME", raising=False)
    assert NodeConfig.from_env().runtime is None
    monkeypatch.setenv("DSEC_RUNTIME", "runsc")
    assert NodeConfig.from_env().runtime == "runsc"


def test_cli_create_takes_runtime():
    out = CliRunner().invoke(cli, ["sandbox", "create", "--help"]).output
    assert "--runtime" in out and "runsc" in out


@needs_root
@needs_runsc
def test_a_node_with_dsec_runtime_runsc_runs_every_sandbox_under_gvisor(monkeypatch):
    monkeypatch.setenv("DSEC_RUNTIME", "runsc")
    with running_kit_node("dsec-gvisor-default-") as node, node.client() as client:
        sb = client.create(layers=[node.layer.ref])
        assert sb.info.runtime == "runsc"
        assert GVISOR_VERSION in sb.exec("cat /proc/version").stdout
        runc = client.create(layers=[node.layer.ref], runtime="runc")
        assert runc.info.runtime == "runc"
        sb.kill()
        runc.kill()
        # FnCall members stay on runc (their reset works from the host's side)
        r = client.fncall(node.environment("kit-fncall"), "cat /proc/version", timeout=30)
        assert r.ok and GVISOR_VERSION not in r.stdout, r
