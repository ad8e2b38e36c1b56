"""Attacks on what shows a sandbox its own limits: its read-only cgroups at /sys/fs/cgroup and
the node's lxcfs files over /proc."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dsec_core.backend import cgroup_path
from dsec_core.linux.cgroups import hierarchies

MiB = 1 << 20


def _mem_total_kib(text: bytes) -> int:
    line = next(x for x in text.decode().splitlines() if x.startswith("MemTotal:"))
    return int(line.split()[1])


@pytest.mark.attack("raise its own limits or leave its cgroup through /sys/fs/cgroup")
def test_cgroup_view_is_read_only(dsec_sandboxes, witness):
    sb = dsec_sandboxes.create(memory="64M", cpu=0.5)
    r = sb.exec(
        "for f in memory/memory.limit_in_bytes cpu/cpu.cfs_quota_us cpuset/cpuset.cpus "
        "pids/pids.max memory/cgroup.procs; do "
        "  echo -1 > /sys/fs/cgroup/$f && echo WROTE $f; done; "
        "mkdir /sys/fs/cgroup/memory/escape && echo MADE; "
        "echo $$ > /sys/fs/cgroup/memory/escape/cgroup.procs && echo MOVED; "
        "mount -o remount,rw /sys/fs/cgroup/memory && echo REMOUNTED; "
        "mount -o remount,rw /sys/fs/cgroup && echo REMOUNTED; "
        "umount /sys/fs/cgroup/memory && echo UNMOUNTED; "
        "touch /sys/fs/cgroup/planted && echo PLANTED; true"
    )
    assert r.exit_code == 0
    assert not any(w in r.stdout for w in (b"WROTE", b"MADE", b"MOVED", b"REMOUNTED", b"PLANT"))
    assert b"UNMOUNTED" not in r.stdout
    # the host's view: limits as created, no child cgroup
    for hier in hierarchies():
        d = hier / cgroup_path(sb.id)
        for name, value in (("memory.limit_in_bytes", 64 * MiB), ("memory.max", 64 * MiB)):
            if (d / name).exists():
                assert int((d / name).read_text()) == value
        assert not (d / "escape").exists()
    root = Path("/sys/fs/cgroup")
    for quota in (
        root / "cpu" / cgroup_path(sb.id) / "cpu.cfs_quota_us",
        root / cgroup_path(sb.id) / "cpu.max",
    ):
        if quota.exists():
            assert quota.read_text().split()[0] == "50000"


@pytest.mark.attack("uncover the host's /proc/meminfo under lxcfs's file")
def test_lxcfs_files_cannot_be_unmounted(dsec_sandboxes, witness):
    sb = dsec_sandboxes.create(memory="64M")
    r = sb.exec(
        "for f in /proc/meminfo /proc/cpuinfo /proc/stat /sys/devices/system/cpu/online; do "
        "  umount $f && echo GONE $f; umount -l $f && echo GONE $f; done; true"
    )
    assert b"GONE" not in r.stdout
    assert _mem_total_kib(sb.exec("cat /proc/meminfo").stdout) == 64 * 1024


@pytest.mark.attack("flood the node's lxcfs with reads to starve other sandboxes' /proc")
def test_lxcfs_flood_does_not_starve_a_bystander(dsec_sandboxes, witness):
    attacker = dsec_sandboxes.create(memory="64M", cpu=1)
    attacker.exec(
        "for i in 1 2 3 4 5 6 7 8; do (end=$(($(date +%s) + 6)); "
        "while [ $(date +%s) -lt $end ]; do "
        "cat /proc/meminfo /proc/cpuinfo /proc/stat /proc/uptime /proc/loadavg > /dev/null; "
        "done) & done; wait",
        background=True,
    ).check()
    bystander = dsec_sandboxes.create(memory="96M")
    slowest = 0.0
    for _ in range(20):
        t = time.monotonic()
        r = bystander.exec("cat /proc/meminfo")
        slowest = max(slowest, time.monotonic() - t)
        assert r.exit_code == 0 and _mem_total_kib(r.stdout) == 96 * 1024
    # slower perhaps (lxcfs is shared), never failing nor stuck
    assert slowest < 5.0, slowest
