"""Attacks the container sandbox held against before the security work: kernel page-info files,
output floods, fork and memory bombs, writes to shared layers."""

from __future__ import annotations

import pytest


@pytest.mark.attack("recursive grep over /proc and /sys")
def test_recursive_grep_over_proc_and_sys(dsec_sandboxes, witness):
    sb = dsec_sandboxes.create()
    # grep -r opens every file, the output pipe of its own shell too (/proc/<sh>/fd/1), where
    # it would wait for itself: the shell writes to a file instead.
    r = sb.exec(
        "exec > /tmp/grep.out 2>&1; grep -rs secret /proc /sys > /dev/null; echo done", timeout=60
    )
    assert not r.timed_out and sb.read_file("/tmp/grep.out").endswith(b"done\n")
    assert sb.exec("head -c 16 /proc/kpagecgroup | wc -c").stdout.strip() == b"0"
    assert sb.exec("head -c 16 /proc/kcore | wc -c").stdout.strip() == b"0"


@pytest.mark.attack("a `yes` flood")
def test_yes_flood(dsec_sandboxes, witness):
    sb = dsec_sandboxes.create()
    r = sb.exec("yes", timeout=3.0, max_output=1 << 20)
    assert r.truncated and r.timed_out and len(r.stdout) == 1 << 20
    assert sb.exec("echo after").stdout == b"after\n"


@pytest.mark.attack("a memory bomb")
def test_memory_bomb(dsec_sandboxes, witness):
    sb = dsec_sandboxes.create(memory="64M")
    r = sb.exec("awk 'BEGIN { s = \"x\"; while (1) s = s s }'", timeout=60)
    assert r.exit_code != 0
    assert sb.exec("echo alive").stdout == b"alive\n"


@pytest.mark.attack("overwrite /bin/sh and busybox in the shared base layer")
def test_overwriting_shared_binaries_stays_private(dsec_sandboxes, witness):
    sb = dsec_sandboxes.create()
    sb.exec(
        "rm -f /bin/busybox.bak; cp /bin/busybox /tmp/bb; "
        "echo 'echo pwned' > /bin/sh; echo junk > /bin/busybox",
        timeout=30,
    )
    other = dsec_sandboxes.create()
    assert other.exec("echo fine").stdout == b"fine\n"
