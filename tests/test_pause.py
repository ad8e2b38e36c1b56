"""Pausing and resuming sandboxes in place (issue 10, deliverable 3, the freezer part): every
process stops where it is and goes on from there; memory, open files and sessions survive; a
paused sandbox counts no CPU toward admission and can still be killed. Real sandboxes."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dsec
from dsec_core.backend import cgroup_path
from dsec_core.errors import SandboxNotRunning, SandboxPaused, UnknownSandbox
from dsec_core.linux.cgroups import frozen, kill_members, place_process, remove_cgroups
from dsec_core.node.node import Node
from dsec_core.records import SandboxSpec
from dsec_core.sdk import GROUP_LABEL
from dsec_core.testing import async_until, leftovers, node_home

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

SPEC = SandboxSpec(layers=("kit-base@1",), memory="64M", cpu=1.0)
#: Each count replaces the file whole, so a reader never sees it truncated and empty.
COUNT = (
    "(i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; "
    "sleep 0.02; done) >/dev/null 2>&1 &"
)


def counter(node: Node, sid: str) -> int:
    """The loop's count, read from the host through the sandbox's root (its agent is frozen
    while it is paused)."""
    rootfs = node.sandboxes[sid].rt.rootfs
    assert rootfs is not None
    for _ in range(50):
        text = (Path(rootfs) / "tmp" / "count").read_text().strip()
        if text:
            return int(text)
        time.sleep(0.01)  # caught between the truncate and the write
    raise AssertionError("no count")


@pytest.fixture
async def node():
    with node_home("dsec-pause-") as config:
        n = Node(config)
        await n.open()
        try:
            yield n
        finally:
            await n.close(kill_all=True)


async def test_a_counting_loop_stops_and_goes_on_from_its_count(node):
    info = await node.create(SPEC)
    sid = info.id
    await node.exec(sid, COUNT, background=True)
    count = Path(node.sandboxes[sid].rt.rootfs or "/nonexistent") / "tmp" / "count"
    await async_until(
        lambda: count.exists() and count.read_text().strip() not in ("", "0"),
        what="the loop counting",
    )
    t0 = time.perf_counter()
    paused = await node.pause(sid)
    pause_ms = 1e3 * (time.perf_counter() - t0)
    assert paused.state == "paused" and frozen(cgroup_path(sid))
    at_pause = counter(node, sid)
    await asyncio.sleep(0.5)
    assert counter(node, sid) == at_pause  # nothing ran while paused
    t0 = time.perf_counter()
    resumed = await node.resume(sid)
    resume_ms = 1e3 * (time.perf_counter() - t0)
    assert resumed.state == "running" and not frozen(cgroup_path(sid))
    await asyncio.sleep(0.2)
    after = counter(node, sid)
    # it went on from its count (not restarted from 0), at its pace again
    assert at_pause < after <= at_pause + 20, (at_pause, after)
    assert pause_ms < 500 and resume_ms < 500, (pause_ms, resume_ms)


async def test_sessions_and_open_files_survive_a_pause(node):
    sid = (await node.create(SPEC)).id
    session = await node.session_open(sid)
    await node.session_exec(sid, session, "X=kept; exec 5>/tmp/held; echo one >&5")
    await node.pause(sid)
    await asyncio.sleep(0.2)
    await node.resume(sid)
    r = await node.session_exec(sid, session, "echo two >&5; echo $X; cat /tmp/held")
    assert r.stdout == b"kept\none\ntwo\n", r


async def test_a_paused_sandbox_refuses_work_counts_no_cpu_and_can_be_killed(node):
    sid = (await node.create(SPEC)).id
    other = (await node.create(SPEC)).id
    before = node.load().cpu_committed
    await node.pause(sid)
    assert node.load().cpu_committed == before - 1.0
    with pytest.raises(SandboxPaused):
        await node.exec(sid, "true")
    with pytest.raises(SandboxPaused):
        await node.read_file(sid, "/etc/passwd")
    again = await node.pause(sid)  # pausing a paused sandbox changes nothing
    assert again.state == "paused"
    assert (await node.exec(other, "echo up")).stdout == b"up\n"  # the other runs on
    await node.kill(sid)  # a frozen sandbox dies like a running one
    assert sid not in node.sandboxes
    assert not any(sid in c for c in leftovers(node.config.home)["cgroups"])
    with pytest.raises(UnknownSandbox):
        await node.resume(sid)


async def test_resuming_a_sandbox_that_is_not_paused_is_a_no_op(node):
    sid = (await node.create(SPEC)).id
    info = await node.resume(sid)
    assert info.state == "running"
    assert (await node.exec(sid, "echo fine")).stdout == b"fine\n"


async def test_a_restarted_node_knows_which_sandboxes_are_paused(node):
    sid = (await node.create(SPEC)).id
    await node.exec(sid, COUNT, background=True)
    await asyncio.sleep(0.1)
    await node.pause(sid)
    await node.close(kill_all=False)  # the daemon goes; the sandbox stays, frozen
    again = Node(node.config)
    await again.open()
    try:
        assert again.get(sid).state == "paused"
        with pytest.raises(SandboxPaused):
            await again.exec(sid, "true")
        at = counter(again, sid)
        await again.resume(sid)
        await async_until(lambda: counter(again, sid) > at, what="the loop counting on")
    finally:
        await again.close(kill_all=True)
    node.sandboxes.clear()  # the fixture's close has nothing left to do


async def test_pause_of_a_dead_sandbox_is_a_typed_error(node):
    sid = (await node.create(SPEC)).id
    pid = node.sandboxes[sid].backend_state["pid"]
    os.kill(pid, 9)
    for _ in range(100):
        if node.sandboxes.get(sid) is None or node.sandboxes[sid].status != "running":
            break
        await asyncio.sleep(0.05)
    with pytest.raises((SandboxNotRunning, UnknownSandbox)) as e:
        await node.pause(sid)
    assert sid in str(e.value)


def test_a_group_pauses_and_resumes_through_the_sdk_and_the_cli(dsec_client, dsec_node):
    a = dsec_client.create(layers=(dsec_node.layer.ref,), memory="64M")
    b = dsec_client.create(layers=(dsec_node.layer.ref,), memory="64M")
    try:
        infos = dsec_client.pause([a.id, b.id])
        assert [i.state for i in infos] == ["paused", "paused"]
        assert {i.id: i.state for i in dsec_client.list()}[a.id] == "paused"
        with pytest.raises(SandboxPaused):
            b.exec("true")
        env = dict(os.environ, DSEC_HOME=os.fspath(dsec_node.home))
        cli = [sys.executable, "-m", "dsec_core.cli", "sandbox"]
        out = subprocess.run([*cli, "resume", a.id, b.id], env=env, capture_output=True)
        assert out.returncode == 0 and out.stdout.split() == [
            b"resumed",
            a.id.encode(),
            b"resumed",
            b.id.encode(),
        ], out
        assert b.exec("echo back").stdout == b"back\n"
        out = subprocess.run([*cli, "pause", a.id], env=env, capture_output=True)
        assert out.returncode == 0 and a.refresh().state == "paused"
    finally:
        a.kill()
        b.kill()


async def test_reclaim_gives_back_a_paused_sandboxs_page_cache(node):
    """On this host (cgroup v1, no swap): ``memory.force_empty`` takes back the page cache of a
    64 MiB file the sandbox wrote and read, and the file is intact after the resume."""
    sid = (await node.create(SandboxSpec(layers=("kit-base@1",), memory="256M"))).id
    write = "dd if=/dev/urandom of=/tmp/big bs=1M count=64 2>/dev/null; md5sum < /tmp/big"
    digest = (await node.exec(sid, write)).stdout
    usage = node.usage(sid).memory
    assert usage is not None and usage > 60 << 20
    await node.pause(sid, reclaim=True)
    after = node.usage(sid).memory
    assert after is not None and after < usage - (48 << 20), (usage, after)
    await node.resume(sid)
    assert (await node.exec(sid, "md5sum < /tmp/big")).stdout == digest


def test_a_group_is_found_again_by_name_and_handled_whole(dsec_client, dsec_node):
    outsider = dsec_client.create(layers=(dsec_node.layer.ref,), memory="64M")
    group = dsec_client.group("rollout-7")
    try:
        made = group.create(layers=(dsec_node.layer.ref,), memory="64M", n=2)
        assert all(sb.info.labels[GROUP_LABEL] == "rollout-7" for sb in made)
        # another process (a restarted trainer) finds the same group by its name
        with dsec.Client(os.fspath(dsec_node.config.socket_path)) as other:
            again = other.group("rollout-7")
            assert [i.id for i in again.members()] == [sb.id for sb in made]
            assert [i.state for i in again.pause()] == ["paused", "paused"]
        assert dsec_client.get(outsider.id).info.state == "running"
        assert [i.state for i in group.resume()] == ["running", "running"]
        assert group.resume() == []  # nothing paused: nothing to do
        assert [i.state for i in dsec_client.pause(group)] == ["paused", "paused"]  # the handle
        assert [i.state for i in dsec_client.resume(group)] == ["running", "running"]
        lease = group.lease(ttl=0.3)
        lease.release()  # a trainer that ends its lease leaves the group running
        assert {i.state for i in group.members()} == {"running"}
        with group.lease(ttl=5) as lease:
            assert set(lease.info.sandboxes) == {sb.id for sb in made}
            assert lease.info.holder == "rollout-7"
        assert made[0].exec("echo on").stdout == b"on\n"
        assert group.kill() == 2 and group.members() == []
        assert dsec_client.get(outsider.id).info.state == "running"
    finally:
        group.kill()
        outsider.kill()
    with pytest.raises(dsec.InvalidSpec):
        dsec_client.group("")


async def test_an_async_group_pauses_and_kills_at_once(dsec_node):
    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:
        group = client.group("async-7")
        try:
            await group.create(layers=(dsec_node.layer.ref,), memory="64M", n=3)
            assert {i.state for i in await group.pause()} == {"paused"}
            assert {i.state for i in await group.members()} == {"paused"}
            assert len(await group.resume()) == 3
            assert {i.state for i in await client.pause(group)} == {"paused"}
            assert {i.state for i in await client.resume(group)} == {"running"}
        finally:
            assert await group.kill() == 3


def test_a_group_forks_a_member_into_new_members_that_each_write_their_own(dsec_client, dsec_node):
    spec = dict(memory="64M", disk="64M", ttl=600)
    outsider = dsec_client.create(layers=(dsec_node.layer.ref,), **spec)
    group = dsec_client.group("fork-7")
    try:
        (source,) = group.create(layers=(dsec_node.layer.ref,), **spec)
        assert source.exec(["sh", "-c", "echo step-k > /state"]).exit_code == 0
        kids = group.fork(source, n=2, **spec)
        source.exec(["sh", "-c", "echo later > /state"])  # after the fork: not theirs
        assert all(k.info.labels[GROUP_LABEL] == "fork-7" for k in kids)
        assert [k.exec(["cat", "/state"]).stdout for k in kids] == [b"step-k\n"] * 2
        kids[0].exec(["sh", "-c", "echo mine > /state"])  # its own writable layer
        assert kids[1].exec(["cat", "/state"]).stdout == b"step-k\n"
        assert source.exec(["cat", "/state"]).stdout == b"later\n"
        # from a snapshot taken before, here of a fork: a chain
        snap = kids[0].pack_diff()
        (grandkid,) = group.fork(snapshot=snap, **spec)
        assert grandkid.exec(["cat", "/state"]).stdout == b"mine\n"
        made = [source.id, *(k.id for k in kids), grandkid.id]
        assert [i.id for i in group.members()] == made
        with pytest.raises(dsec.InvalidSpec, match="not a member"):
            group.fork(outsider.id)
        with pytest.raises(dsec.InvalidSpec):
            group.fork(n=2)  # neither a source nor a snapshot
        with pytest.raises(dsec.InvalidSpec):
            group.fork(source, snapshot=snap)  # both
        assert group.kill() == 4 and group.members() == []
        assert dsec_client.get(outsider.id).info.state == "running"
    finally:
        group.kill()
        outsider.kill()


async def test_an_async_group_forks_a_member(dsec_node):
    spec = dict(memory="64M", disk="64M", ttl=600)
    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:
        group = client.group("async-fork-7")
        try:
            (source,) = await group.create(layers=(dsec_node.layer.ref,), **spec)
            await source.exec(["sh", "-c", "echo step-k > /state"])
            kids = await group.fork(source.id, n=2, **spec)
            await kids[0].exec(["sh", "-c", "echo mine > /state"])
            seen = [(await k.exec(["cat", "/state"])).stdout for k in kids]
            assert seen == [b"mine\n", b"step-k\n"]
            assert len(await group.members()) == 3
        finally:
            assert await group.kill() == 3


def test_kill_members_ends_what_a_cgroup_holds_so_it_can_be_removed():
    """Found by the soak: a VM sandbox a daemon was creating when it died held a QEMU its state
    did not name; stopping it found the cgroups busy and left them. The stop now kills what
    is left in them."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    relative = cgroup_path(f"killmembers-{secrets.token_hex(4)}")
    child = subprocess.Popen(["sleep", "60"])
    try:
        place_process(child.pid, relative, 0)
        assert remove_cgroups(relative)  # busy: it holds the sleep
        assert kill_members(relative) == [child.pid]
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert remove_cgroups(relative) == []
    finally:
        child.kill()
        child.wait()
        remove_cgroups(relative)
