"""The scheduler primitives the CPU classes rest on, on this host's kernel: SCHED_IDLE for every
thread of a process (and what it starts later), and the core scheduling and ``cpu.idle`` probes,
checked against what the kernel's config and the cgroup files say."""

from __future__ import annotations

import errno
import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec_core.linux import sched
from dsec_core.linux.cgroups import cgroup2_root, cpu_hierarchy, cpu_idle

# A process with three threads that, once told (a line on stdin), starts a fourth and a child,
# and prints their thread ids and the child's pid.
THREADED = """
import os, sys, threading
stop = threading.Event()
for _ in range(2):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
late = []
t = threading.Thread(
    target=lambda: (late.append(threading.get_native_id()), stop.wait()), daemon=True
)
t.start()
while not late:
    pass
child = os.fork()
if child == 0:
    stop.wait()
    os._exit(0)
print(late[0], child, flush=True)
sys.stdin.readline()
os.kill(child, 9)
os.waitpid(child, 0)
"""


def test_set_idle_covers_every_thread_and_what_they_start_later():
    proc = subprocess.Popen(
        [sys.executable, "-c", THREADED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        tids = sched.set_idle(proc.pid)
        assert len(tids) >= 3 and sorted(tids) == sorted(sched.thread_ids(proc.pid))
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
        proc.stdin.write("go\n")
        proc.stdin.flush()
        late, child = map(int, proc.stdout.readline().split())
        assert os.sched_getscheduler(late) == os.SCHED_IDLE
        assert os.sched_getscheduler(child) == os.SCHED_IDLE
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ProcessLookupError):
        sched.set_idle(proc.pid)


def _config(option: str) -> str | None:
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return next((line.strip() for line in f if option in line), None)
    except OSError:
        return None


def test_core_scheduling_probe_matches_the_kernel():
    core = sched.core_scheduling()
    config = _config("CONFIG_SCHED_CORE")
    if config is None:
        pytest.skip("no /proc/config.gz to check the probe against")
    if config == "# CONFIG_SCHED_CORE is not set":
        assert not core.available
        assert "EINVAL" in core.detail and "CONFIG_SCHED_CORE" in core.detail
        with pytest.raises(OSError) as e:
            sched.create_core_cookie(os.getpid())
        assert e.value.errno == errno.EINVAL
    else:
        smt = Path("/sys/devices/system/cpu/smt/active")
        has_smt = smt.exists() and smt.read_text().strip() == "1"
        assert core.available == has_smt, core


def test_cpu_idle_probe_matches_the_cgroup_files():
    feature = cpu_idle()
    hier = cpu_hierarchy()
    if hier is None:
        assert not feature.available
    elif hier == cgroup2_root():
        if "cpu" not in (hier / "cgroup.subtree_control").read_text().split():
            assert not feature.available
    else:  # cgroup v1: every cgroup shows cpu.idle where the kernel has it, the root too
        assert feature.available == (hier / "cpu.idle").exists()
        assert "cgroup v1" in feature.detail


def test_sched_idle_probe_leaves_the_caller_alone():
    before = os.sched_getscheduler(0)
    assert sched.sched_idle().available
    assert os.sched_getscheduler(0) == before
