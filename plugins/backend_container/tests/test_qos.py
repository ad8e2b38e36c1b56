"""CPU classes on real container sandboxes, seen from the host: a best-effort sandbox's
processes are SCHED_IDLE and its cgroup idle at the lowest weight, a latency-sensitive one's
are not, root inside cannot leave SCHED_IDLE, the class survives a daemon restart, and a bad
class is a typed error on the API and in the SDK."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

import pytest
from dsec_backend_container.qos import BE_SHARES

import dsec
from dsec_core.api.transport import HTTPTransport
from dsec_core.backend import cgroup_path
from dsec_core.errors import error_from_wire
from dsec_core.linux.cgroups import cpu_cgroup_dir, cpu_idle
from dsec_core.linux.tools import compile_static
from dsec_core.plugins import registry

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

PROBE_SOURCE = Path(__file__).with_name("sched_probe.c")
#: cpu.shares of an idle cgroup: the kernel's WEIGHT_IDLEPRIO, whatever was asked before.
IDLE_SHARES = 3


@pytest.fixture
def dsec_backend_name() -> str:
    return "container"


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> bytes:
    """``sched_probe.c``, compiled static (the kit's sandboxes have busybox and no libc)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("the probe needs gcc and static glibc (apt-get install gcc libc6-dev)")
    out = tmp_path_factory.mktemp("sched-probe") / "sched-probe"
    return compile_static([PROBE_SOURCE], out, "the sched probe").read_bytes()


def run_probe(sb, probe: bytes, *attempts: str) -> list[tuple[str, str]]:
    sb.write_file("/tmp/sched-probe", probe, mode=0o755)
    res = sb.exec(["/tmp/sched-probe", *attempts]).check()
    return [tuple(line.split(" ", 1)) for line in res.text.splitlines()]  # type: ignore[misc]


def host_pids(marker: str) -> list[int]:
    """Host pids of processes whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd:
            found.append(int(pid))
    return found


def policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of host process ``pid``."""
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def sched_policy(pid: int) -> int:
    """The policy the scheduler reports in /proc/PID/sched (its "policy : N" line)."""
    for line in Path(f"/proc/{pid}/sched").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "policy":
            return int(value)
    raise AssertionError(f"no policy line in /proc/{pid}/sched")


def background_sleep(sb) -> list[int]:
    """Start ``sleep`` in the sandbox, in the background; its host pid(s)."""
    marker = str(100000 + secrets.randbelow(800000))
    sb.exec(f"sleep {marker} > /dev/null 2>&1 &", background=True).check()
    deadline = time.monotonic() + 5
    while not (pids := host_pids(f"sleep\0{marker}")):
        assert time.monotonic() < deadline, "the background sleep never showed on the host"
        time.sleep(0.05)
    return pids


def cpu_files(sandbox_id: str) -> dict[str, str]:
    d = cpu_cgroup_dir(cgroup_path(sandbox_id))
    assert d is not None and d.is_dir(), "no cpu cgroup for the sandbox"
    names = ["cpu.shares", "cpu.idle"] if (d / "cpu.shares").exists() else ["cpu.weight"]
    return {n: (d / n).read_text().strip() for n in names if (d / n).exists()}


# --- best effort ------------------------------------------------------------------------------


def test_best_effort_processes_are_sched_idle_on_the_host(dsec_sandboxes):
    sb = dsec_sandboxes.create(qos="be")
    info = sb.info
    assert info.qos == "be"
    assert policies(info.pid) == {os.SCHED_IDLE}, "every thread of the agent (its init)"
    for pid in background_sleep(sb):  # a process an exec started
        assert policies(pid) == {os.SCHED_IDLE}
        assert sched_policy(pid) == os.SCHED_IDLE
    # a command's own process, as the kernel reports it (policy 5: SCHED_IDLE)
    sched = sb.exec("grep '^policy' /proc/self/sched").check().text
    assert sched.split(":")[1].strip() == str(os.SCHED_IDLE)


def test_best_effort_covers_the_landlock_domain_thread(dsec_sandboxes):
    # With a Landlock policy every command is forked from the agent's domain thread, which
    # the agent starts before it answers: it must be SCHED_IDLE too.
    landlock = registry().security_policies.get("landlock")
    if landlock is None:
        pytest.skip("the landlock policy is not loaded")
    sb = dsec_sandboxes.create(qos="be", policies={"landlock": landlock.example[0]})
    assert sb.info.policies["landlock"] == "enforced"
    assert len(os.listdir(f"/proc/{sb.info.pid}/task")) >= 2, "no domain thread"
    assert policies(sb.info.pid) == {os.SCHED_IDLE}
    for pid in background_sleep(sb):
        assert policies(pid) == {os.SCHED_IDLE}


def test_best_effort_cgroup_is_idle_at_the_lowest_weight(dsec_sandboxes):
    sb = dsec_sandboxes.create(qos="be", cpu=1.0)
    files = cpu_files(sb.id)
    assert int(files["cpu.shares"]) <= max(BE_SHARES, IDLE_SHARES), files
    if cpu_idle().available:
        assert files["cpu.idle"] == "1", files
    else:
        assert files.get("cpu.idle", "0") == "0"


def test_latency_sensitive_keeps_normal_scheduling(dsec_sandboxes):
    sb = dsec_sandboxes.create(cpu=1.0)  # qos="ls" by default
    assert sb.info.qos == "ls"
    assert policies(sb.info.pid) == {os.SCHED_OTHER}
    for pid in background_sleep(sb):
        assert policies(pid) == {os.SCHED_OTHER}
    files = cpu_files(sb.id)
    assert files["cpu.shares"] == "1024" and files.get("cpu.idle", "0") == "0", files


@pytest.mark.parametrize("with_policies", [True, False], ids=["default-policies", "no-policies"])
def test_root_inside_cannot_leave_sched_idle(dsec_sandboxes, probe, with_policies):
    # With every security policy off too: the kernel refuses, not a seccomp filter.
    off = {name: {"enabled": False} for name in registry().security_policies}
    sb = dsec_sandboxes.create(qos="be", policies={} if with_policies else off)
    out = run_probe(
        sb, probe, "policy", "other", "batch", "setattr-other", "rlimit-nice", "nice-down", "policy"
    )
    assert out == [
        ("policy", str(os.SCHED_IDLE)),
        ("other", "EPERM"),
        ("batch", "EPERM"),
        ("setattr-other", "EPERM"),
        ("rlimit-nice", "EPERM"),  # RLIMIT_NICE's hard limit is 0
        ("nice-down", "EACCES"),
        ("policy", str(os.SCHED_IDLE)),
    ]
    assert policies(sb.info.pid) == {os.SCHED_IDLE}
    # nor through its cgroup, which it sees (read-only) at /sys/fs/cgroup
    for name, value in (("cpu.idle", "0"), ("cpu.shares", "1024")):
        wrote = sb.exec(f"echo {value} > /sys/fs/cgroup/cpu/{name}")
        assert wrote.exit_code != 0, f"root inside wrote its {name}"
    files = cpu_files(sb.id)
    assert int(files["cpu.shares"]) <= max(BE_SHARES, IDLE_SHARES), files
    assert files.get("cpu.idle", "0") == ("1" if cpu_idle().available else "0")


def test_the_probe_can_change_class_where_the_kernel_allows(dsec_sandboxes, probe):
    # The control for the test above: in a latency-sensitive sandbox the same calls work until
    # the process makes itself idle, after which it is as stuck as a best-effort one.
    sb = dsec_sandboxes.create()
    out = run_probe(sb, probe, "batch", "other", "idle", "policy", "other")
    assert out == [
        ("batch", "ok"),
        ("other", "ok"),
        ("idle", "ok"),
        ("policy", str(os.SCHED_IDLE)),
        ("other", "EPERM"),
    ]


def test_class_survives_a_daemon_restart(dsec_sandboxes, dsec_node):
    sb = dsec_sandboxes.create(qos="be")
    before = background_sleep(sb)
    try:
        dsec_node.restart()
    finally:
        dsec_node.ensure_running()
    with dsec_node.client() as client:
        again = client.get(sb.id)
        assert again.info.qos == "be"
        assert policies(again.info.pid) == {os.SCHED_IDLE}
        assert all(policies(pid) == {os.SCHED_IDLE} for pid in before)
        for pid in background_sleep(again):  # started by the adopted agent
            assert policies(pid) == {os.SCHED_IDLE}
        assert cpu_files(sb.id)["cpu.idle"] == ("1" if cpu_idle().available else "0")
        again.kill()


def cpu_share(client, first, second, seconds: float = 2.0) -> float:
    """Spin a loop in each sandbox, both on the host's CPU 0, for ``seconds``; the CPU time
    ``second`` got as a fraction of what ``first`` got."""
    for sb in (first, second):
        sb.exec("taskset -c 0 true").check()  # CPU 0 is in the sandbox's cpuset
        sb.exec("taskset -c 0 sh -c 'while :; do :; done' > /dev/null 2>&1 &", background=True)
    time.sleep(0.2)
    before = [client.usage(sb.id).cpu_seconds for sb in (first, second)]
    time.sleep(seconds)
    after = [client.usage(sb.id).cpu_seconds for sb in (first, second)]
    for sb in (first, second):
        sb.exec("true", exclusive=True).check()  # the spinner goes
    used = [b - a for a, b in zip(before, after, strict=True)]
    assert used[0] > 0.05 * seconds, f"the first spinner barely ran: {used}"
    return used[1] / used[0]


def test_best_effort_yields_a_cpu_to_latency_sensitive_work(dsec_sandboxes, dsec_client):
    # Shares of one CPU, not latencies: other work on the machine takes from both spinners
    # alike, so the ratio holds on a busy host where a timing would not.
    # as many cores as the host has: not pinned to some of them, so all can spin on CPU 0
    cores = float(os.cpu_count() or 1)
    ls = dsec_sandboxes.create(cpu=cores)
    peer = dsec_sandboxes.create(cpu=cores)
    be = dsec_sandboxes.create(cpu=cores, qos="be")
    assert cpu_share(dsec_client, ls, peer) > 0.5  # two latency-sensitive ones share it
    assert cpu_share(dsec_client, ls, be) < 0.05  # the best-effort one gets what is left


def test_best_effort_cpu_does_not_count_toward_the_nodes_budget(dsec_sandboxes, dsec_node):
    capacity = dsec_node.config.cpu_capacity
    if capacity >= 1024:
        pytest.skip(f"a spec asks for at most 1024 cores; this node has {capacity}")
    dsec_sandboxes.create(qos="be", cpu=capacity)  # the whole budget, asked best effort
    assert dsec_sandboxes.create(cpu=1.0).info.qos == "ls"  # still admitted
    with pytest.raises(dsec.AdmissionRejected) as e:
        dsec_sandboxes.create(qos="be", cpu=capacity + 1)
    assert e.value.reason == "cpu" and "best-effort" in str(e.value)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qos", ["rt", "LS", "", 5, None])
def test_a_bad_class_is_invalid_spec_in_the_sdk(dsec_client, dsec_node, qos):
    with pytest.raises(dsec.InvalidSpec) as e:
        dsec_client.create(layers=(dsec_node.layer.ref,), qos=qos)
    assert e.value.context["field"] == "qos"


def test_a_bad_class_is_a_typed_400_on_the_api(dsec_node):
    body = b'{"spec": {"layers": ["%s"], "qos": "realtime"}}' % dsec_node.layer.ref.encode()
    t = HTTPTransport(os.fspath(dsec_node.config.socket_path))
    try:
        r = t.request("POST", "/v1/sandboxes", body=body, content_type="application/json")
    finally:
        t.close()
    assert r.status_code == 422, r.text
    err = error_from_wire(r.json()["error"])
    assert isinstance(err, dsec.InvalidSpec) and err.context["field"] == "qos"
    assert "ls, be" in str(err)
