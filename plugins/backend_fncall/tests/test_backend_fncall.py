"""The fncall backend: the conformance kit every backend runs, then isolation between calls
(issue 9, deliverable 7) and the node's pools over it, on real sandboxes.

Isolation is checked two ways: end to end through ``Node.fncall`` (a pool of one member, so
every call lands in the same sandbox as the one before), and on the reset itself, after work
left behind on purpose with ``background=True`` (which the agent's own end-of-exec kill spares),
so a pass does not rest on the agent having cleaned up already.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import dsec
from dsec_core.api.transport import HTTPTransport
from dsec_core.catalog.model import Catalog, Environment
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.errors import (
    AdmissionRejected,
    BackendUnavailable,
    UnknownEnvironment,
    error_from_wire,
)
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.node.node import Node
from dsec_core.node.pools import Pools, PoolSettings
from dsec_core.testing import (
    BackendConformance,
    async_until,
    daemon_config,
    leftovers,
    make_busybox_rootfs,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

ENV = "fn-bb"
WS_ENV = "fn-ws"
MEM = "64M"


class TestFnCallBackend(BackendConformance):
    backend_name = "fncall"
    writable_root = False  # only tmpfs work areas (/tmp, /root, /work, /dev/shm) take writes


# --- an in-process node with a busybox environment --------------------------------------------


@pytest.fixture
def fn_home():
    home = Path(tempfile.mkdtemp(prefix="dsec-fncall-"))
    config = daemon_config(home)  # this worker's uid ranges
    config.ensure_dirs()
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = make_busybox_rootfs(Path(tmp) / "rootfs")
        build_layer(
            rootfs, name="kit-base", version="1", kind="base", store=LayerStore(config.layer_dir)
        )
        ws = Path(tmp) / "ws"
        (ws / "srv" / "task" / "cases").mkdir(parents=True)
        (ws / "srv" / "task" / "given.txt").write_text("given\n")
        (ws / "srv" / "task" / "cases" / "1.in").write_text("1\n")
        (ws / "srv" / "task" / "run.sh").write_text("cat given.txt\n")
        (ws / "srv" / "task" / "run.sh").chmod(0o750)
        (ws / "srv" / "task" / "passwd").symlink_to("/etc/passwd")
        build_layer(
            ws, name="fn-ws", version="1", kind="workspace", store=LayerStore(config.layer_dir)
        )
    CatalogStore(config.catalog_dir).save(
        Catalog(
            name="fn",
            environments=(
                Environment(name=ENV, base="kit-base@1"),
                Environment(
                    name=WS_ENV, base="kit-base@1", workspaces=("fn-ws@1",), workdir="/srv/task"
                ),
            ),
        )
    )
    try:
        yield config
    finally:
        left = _settled_leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
        assert not any(left.values()), left


def _settled_leftovers(home: Path) -> dict[str, list[str]]:
    """``leftovers``, allowing loop devices a few seconds to go: a killed container's mount
    namespace is freed by the kernel after its init's death is reported, and its writable
    layer's loop device (autoclear) only detaches then. Everything else must be gone at once."""
    left = leftovers(home)
    for _ in range(50):
        if not left["loop_devices"]:
            break
        time.sleep(0.1)
        left = {**left, "loop_devices": leftovers(home)["loop_devices"]}
    return left


def _node(config: NodeConfig, **settings) -> Node:
    node = Node(config)
    node.pools = Pools(node, PoolSettings(**settings))
    return node


async def _opened(config, **settings) -> Node:
    node = _node(config, **settings)
    await node.open()
    return node


async def call(node: Node, cmd=None, **kw):
    return await node.fncall(ENV, cmd, memory=MEM, **kw)


async def settle(node: Node) -> None:
    """Wait for give-backs (resets, replacements) in flight."""
    for _ in range(200):
        if all(p.resetting == 0 and p.starting == 0 for p in node.pools.pools.values()):
            busy = [t for t in node.lifecycle.tasks if not t.done()]
            if not busy:
                return
        await asyncio.sleep(0.01)


# --- isolation between calls ------------------------------------------------------------------

LEAVE_FILES = (
    "echo secret > /tmp/t; echo secret > /work/w; echo secret > /dev/shm/s; "
    "mkdir -p /tmp/d/e && echo x > /tmp/d/e/f; ln -s /etc /tmp/link; echo x > /root/.cache; "
    "touch /dev/mqueue/q 2>/dev/null; ls -A /tmp /work /dev/shm"
)
SEE_FILES = "ls -A /tmp /root /work /dev/shm /dev/mqueue"
LISTENERS = "cat /proc/net/tcp /proc/net/tcp6 | grep -c ' 0A '"
EMPTY_AREAS = sorted([b"/tmp:", b"/root:", b"/work:", b"/dev/shm:", b"/dev/mqueue:"])


async def checked_out(node: Node, n: int = 1) -> None:
    """Until ``n`` members of the node's pools are checked out (started and not free): the
    calls just sent are on them."""
    await async_until(
        lambda: sum(len(p.members) - len(p.free) for p in node.pools.pools.values()) >= n,
        what=f"{n} member(s) checked out",
    )


async def test_a_call_sees_no_files_of_the_one_before(fn_home):
    node = await _opened(fn_home, max=1)
    try:
        first = await call(node, LEAVE_FILES)
        assert first.ok, first
        assert b"t" in first.stdout and b"w" in first.stdout and b"s" in first.stdout
        second = await call(node, SEE_FILES)
        assert second.member == first.member  # the same sandbox, reset
        assert sorted(second.stdout.split()) == EMPTY_AREAS, second.stdout
        # everywhere else, the root is read-only: there is nowhere else to leave anything
        for path in ("/etc/x", "/usr/x", "/x", "/dev/x", "/var/x", "/bin/sh"):
            r = await call(node, f"echo x > {path}")
            assert r.exit_code != 0 and b"Read-only file system" in r.stderr, (path, r)
    finally:
        await node.close(kill_all=True)


async def test_a_call_sees_no_processes_environment_or_listener_of_the_one_before(fn_home):
    node = await _opened(fn_home, max=1)
    try:
        first = await call(
            node,
            "sleep 1000 & (setsid sh -c 'sleep 1001 &' &) ; httpd -p 9000; sleep 0.2; "
            f"{LISTENERS}; echo $SECRET",
            env={"SECRET": "hunter2"},
        )
        assert first.stdout.split() == [b"1", b"hunter2"], first
        second = await call(node, f"ps -o pid,args; {LISTENERS}; env")
        assert second.member == first.member
        assert b"sleep" not in second.stdout and b"httpd" not in second.stdout
        assert b"hunter2" not in second.stdout
        assert b"\n0\n" in second.stdout  # no listener left on loopback
    finally:
        await node.close(kill_all=True)


async def test_reset_kills_what_the_agent_spared_and_empties_every_work_area(fn_home):
    """Work left on purpose (background execs outlive their command): only the reset undoes
    it."""
    node = await _opened(fn_home, max=1)
    try:
        sid = (await call(node, "true")).member
        await settle(node)
        await node.exec(sid, "sleep 1000 &", background=True)
        await node.exec(sid, "setsid sh -c 'sleep 1002 &'; httpd -p 9001", background=True)
        await node.exec(sid, LEAVE_FILES)
        await asyncio.sleep(0.2)
        before = await node.exec(sid, "ps -o args | grep -c '^sleep 100'")
        assert int(before.stdout) >= 2
        _sysv_in(node, sid, create=True)
        assert _sysv_in(node, sid) == (1, 1, 1)
        await node.reset(sid)
        after = await node.exec(sid, "ps -o args; " + SEE_FILES)
        assert b"sleep" not in after.stdout and b"httpd" not in after.stdout, after.stdout
        assert (await node.exec(sid, LISTENERS)).stdout == b"0\n"
        assert sorted(after.stdout.split()[-5:]) == EMPTY_AREAS, after.stdout
        assert _sysv_in(node, sid) == (0, 0, 0)
    finally:
        await node.close(kill_all=True)


def _sysv_in(node: Node, sid: str, create: bool = False) -> tuple[int, int, int]:
    """In the sandbox's IPC namespace (from a thread of our own that joins it): make a shared
    memory segment, a message queue and a semaphore set, or count them. The busybox base has
    no ipcmk; what a call's own code would make is the same kernel object."""
    pid = node.sandboxes[sid].backend_state["pid"]
    out: list[tuple[int, int, int]] = []

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY)
        theirs = os.open(f"/proc/{pid}/ns/ipc", os.O_RDONLY)
        try:
            assert libc.setns(theirs, 0x08000000) == 0
            try:
                if create:
                    assert libc.shmget(0, 4096, 0o1600) >= 0  # IPC_PRIVATE | IPC_CREAT
                    assert libc.msgget(0, 0o1600) >= 0
                    assert libc.semget(0, 1, 0o1600) >= 0
                counts = []
                for kind in ("shm", "msg", "sem"):
                    with open(f"/proc/sysvipc/{kind}") as f:
                        counts.append(len(f.read().splitlines()) - 1)
                out.append((counts[0], counts[1], counts[2]))
            finally:
                assert libc.setns(own, 0x08000000) == 0
        finally:
            os.close(own)
            os.close(theirs)

    import threading

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out[0]


async def test_the_images_files_at_the_working_directory_come_back_after_each_call(fn_home):
    """A workspace's task files sit where the call's working directory (a tmpfs) is: members
    start with a copy of them, and every reset restores it, whatever the call did to it."""
    node = await _opened(fn_home, max=1)
    try:
        look = "pwd; ls -lA; ls -l passwd | cut -d'>' -f2; cat given.txt cases/1.in; ./run.sh"
        first = await node.fncall(WS_ENV, look, memory=MEM)
        assert first.ok, first
        lines = first.stdout.decode().splitlines()
        assert lines[0] == "/srv/task" and lines[-4:] == [" /etc/passwd", "given", "1", "given"]
        assert "-rwxr-x---" in first.stdout.decode()  # modes come along
        ruin = await node.fncall(
            WS_ENV, "rm -r cases passwd; echo ruined > given.txt; echo new > extra", memory=MEM
        )
        assert ruin.ok and ruin.member == first.member, ruin
        again = await node.fncall(WS_ENV, look, memory=MEM)
        assert again.member == first.member
        assert again.stdout == first.stdout
    finally:
        await node.close(kill_all=True)


async def test_a_call_that_filled_tmp_does_not_break_the_next(fn_home):
    node = await _opened(fn_home, max=1)
    try:
        full = await call(node, "dd if=/dev/zero of=/tmp/big bs=1M count=200; df -k /tmp")
        assert b"No space left" in full.stderr, full
        nxt = await call(node, "echo ok > /tmp/x && cat /tmp/x && ls -A /tmp")
        assert nxt.member == full.member
        assert nxt.stdout == b"ok\nx\n", nxt
    finally:
        await node.close(kill_all=True)


# --- bad input and broken members -------------------------------------------------------------


async def test_a_timeout_is_a_verdict_and_the_member_is_reset(fn_home):
    node = await _opened(fn_home, max=1)
    try:
        slow = await call(node, "echo started > /tmp/mark; sleep 30", timeout=0.5)
        assert slow.timed_out and not slow.ok and not slow.error
        nxt = await call(node, "ps -o args; ls -A /tmp")
        assert nxt.member == slow.member and nxt.ok
        assert b"sleep" not in nxt.stdout and b"mark" not in nxt.stdout
    finally:
        await node.close(kill_all=True)


async def test_a_member_killed_under_a_call_is_a_runtime_error_and_is_replaced(fn_home):
    node = await _opened(fn_home, max=1)
    try:
        first = await call(node, "true")
        await settle(node)
        pid = node.sandboxes[first.member].backend_state["pid"]
        task = asyncio.ensure_future(call(node, "sleep 30", timeout=20))
        await checked_out(node)
        os.kill(pid, signal.SIGKILL)  # the agent, PID 1 of the member, from the host
        dead = await task
        assert dead.error == "runtime-error" and not dead.ok, dead
        assert isinstance(dead, dsec.FnCallResult)
        nxt = await call(node, "echo fine")
        assert nxt.ok and nxt.stdout == b"fine\n" and nxt.member != first.member
        assert node.pools.status()[0]["replaced"] >= 1
    finally:
        await node.close(kill_all=True)


async def test_a_free_member_that_died_is_never_checked_out(fn_home):
    node = await _opened(fn_home, max=1)
    try:
        first = await call(node, "true")
        await settle(node)
        os.kill(node.sandboxes[first.member].backend_state["pid"], signal.SIGKILL)
        be = node.backend("fncall")
        for _ in range(100):  # a death at the very moment of a checkout is a runtime error (above)
            sb = node.sandboxes.get(first.member)
            if sb is None or not await be.alive(sb.rt, sb.backend_state):
                break
            await asyncio.sleep(0.01)
        nxt = await call(node, "echo fresh")
        assert nxt.ok and nxt.stdout == b"fresh\n" and nxt.member != first.member
        await settle(node)
        assert first.member not in node.sandboxes
        assert node.pools.status()[0]["members"] == [nxt.member]
    finally:
        await node.close(kill_all=True)


async def test_a_script_that_kills_pid_1_from_inside_changes_nothing(fn_home):
    node = await _opened(fn_home, max=1)
    try:
        r = await call(node, script="kill -9 1; kill -TERM 1; echo still")
        assert r.ok and r.stdout == b"still\n"
        # killing everything it can see takes its own exec handler with it: a runtime error
        r = await call(node, script="kill -9 -1; sleep 1; echo unreachable")
        assert r.error == "runtime-error" and b"unreachable" not in r.stdout, r
        nxt = await call(node, "echo next")
        assert nxt.ok and nxt.stdout == b"next\n"
    finally:
        await node.close(kill_all=True)


async def test_unknown_environment_and_a_backend_without_reset_are_typed_errors(fn_home):
    node = await _opened(fn_home)
    try:
        with pytest.raises(UnknownEnvironment):
            await node.fncall("no-such-env", "true")
        with pytest.raises(BackendUnavailable, match=r"Feature\.RESET"):
            await node.fncall(ENV, "true", backend="container", memory=MEM)
        assert not node.sandboxes
    finally:
        await node.close(kill_all=True)


async def test_a_full_pool_rejects_with_its_name(fn_home):
    node = await _opened(fn_home, max=1, checkout_timeout=0.3)
    try:
        busy = asyncio.ensure_future(call(node, "sleep 2", timeout=10))
        await checked_out(node)
        with pytest.raises(AdmissionRejected) as e:
            await call(node, "true")
        assert e.value.pool == f"{ENV}/fncall/1cpu/64M" and e.value.reason == "fncall-pool"
        assert (await busy).ok
    finally:
        await node.close(kill_all=True)


async def test_a_caller_that_goes_away_while_waiting_loses_no_member(fn_home):
    node = await _opened(fn_home, max=1)
    try:
        busy = asyncio.ensure_future(call(node, "sleep 0.5"))
        await checked_out(node)
        waiting = asyncio.ensure_future(call(node, "true"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        first = await busy
        nxt = await asyncio.wait_for(call(node, "echo back"), 10)
        assert nxt.ok and nxt.member == first.member
        assert node.pools.status()[0]["size"] == 1
    finally:
        await node.close(kill_all=True)


async def test_a_node_without_room_for_a_member_rejects_naming_the_pool(fn_home):
    """The node refuses a second member (one sandbox at most): a call waits for the busy one
    instead, and past the checkout timeout gets the node's refusal naming the pool."""
    node = await _opened(dataclasses.replace(fn_home, max_sandboxes=1), max=4, checkout_timeout=0.5)
    try:
        busy = asyncio.ensure_future(call(node, "sleep 2", timeout=10))
        await checked_out(node)
        t0 = time.monotonic()
        with pytest.raises(AdmissionRejected) as e:
            await call(node, "true")
        assert e.value.pool == f"{ENV}/fncall/1cpu/64M" and e.value.reason == "count"
        assert time.monotonic() - t0 >= 0.45  # it waited for the member first
        (pool,) = node.pools.pools.values()
        pool.settings = dataclasses.replace(pool.settings, checkout_timeout=10.0)
        waited = await call(node, "echo waited")
        assert waited.ok and waited.wait > 0.5 and pool.size == 1
        assert (await busy).ok
        assert (await call(node, "echo again")).ok  # the one member serves on
    finally:
        await node.close(kill_all=True)


async def test_files_and_stdin_reach_the_call(fn_home):
    node = await _opened(fn_home)
    try:
        r = await call(
            node,
            script="cat in.txt sub/dir/x /tmp/abs; cat",
            files={"in.txt": b"one\n", "sub/dir/x": "two\n", "/tmp/abs": b"three\n"},
            stdin=b"four\n",
        )
        assert r.stdout == b"one\ntwo\nthree\nfour\n", r
    finally:
        await node.close(kill_all=True)


# --- the pool's size --------------------------------------------------------------------------


async def test_the_pool_grows_to_max_under_concurrency_and_shrinks_when_idle(fn_home):
    node = await _opened(fn_home, min=1, max=3, idle=0.5)
    try:
        rs = await asyncio.gather(*(call(node, "sleep 0.3; echo $$") for _ in range(8)))
        assert all(r.ok for r in rs)
        assert len({r.member for r in rs}) == 3  # grew to max, never past it
        (status,) = node.pools.status()
        assert status["size"] == 3
        await settle(node)
        for _ in range(60):
            await asyncio.sleep(0.1)
            if node.pools.status()[0]["size"] == 1:
                break
        assert node.pools.status()[0]["size"] == 1  # back to min
        await settle(node)
        assert len(node.sandboxes) == 1
    finally:
        await node.close(kill_all=True)
    assert not node.sandboxes


async def test_an_environment_can_have_pool_sizes_of_its_own(fn_home):
    node = _node(fn_home, max=4, sizes={WS_ENV: (1, 1)})
    await node.open()
    try:
        r = await node.fncall(WS_ENV, "true", memory=MEM)  # its pool starts its min of one
        await settle(node)
        (ws,) = [p for p in node.pools.status() if p["name"].startswith(WS_ENV)]
        assert (ws["min"], ws["max"], ws["size"]) == (1, 1, 1) and ws["members"] == [r.member]
        rs = await asyncio.gather(*(call(node, "sleep 0.2") for _ in range(3)))
        (bb,) = [p for p in node.pools.status() if p["name"].startswith(ENV + "/")]
        assert bb["max"] == 4 and len({x.member for x in rs}) == 3
    finally:
        await node.close(kill_all=True)


async def test_a_restarted_node_kills_the_members_a_previous_one_left(fn_home):
    node = await _opened(fn_home, max=2)
    r = await call(node, "true")
    await settle(node)

    async def crash() -> None:  # as a crashed daemon would: members stay behind
        pass

    node.pools.close = crash  # type: ignore[method-assign]
    await node.close(kill_all=False, release_runtime=False)
    assert r.member in {p.name for p in (fn_home.runtime_dir).iterdir()}
    again = await _opened(fn_home)
    try:
        assert r.member not in again.sandboxes
    finally:
        await again.close(kill_all=True)


# --- pools by project (issue 20) ---------------------------------------------------------------


async def test_projects_never_share_a_member_and_their_members_count_for_them(fn_home):
    node = await _opened(fn_home, max=2)
    try:
        rs = {
            p: await asyncio.gather(
                *(call(node, "sleep 0.2; echo $$", project=p) for _ in range(4))
            )
            for p in ("org/a", "org/b")
        }
        # one more round at once, both projects on the node together
        both = await asyncio.gather(
            *(call(node, "echo hi", project=p) for p in ("org/a", "org/b") for _ in range(3))
        )
        rs["org/a"] += both[:3]
        rs["org/b"] += both[3:]
        shared = await call(node, "true")  # a direct caller: the node's shared pool
        members = {p: {r.member for r in got} for p, got in rs.items()}
        assert all(r.ok for got in rs.values() for r in got)
        assert members["org/a"].isdisjoint(members["org/b"])
        assert shared.member not in members["org/a"] | members["org/b"]
        assert {r.pool for r in rs["org/a"]} == {f"{ENV}/fncall/1cpu/64M@org/a"}
        await settle(node)
        for p, sids in members.items():
            for sid in sids:
                assert node.sandboxes[sid].rt.spec.labels["dsec.project"] == p
                assert node.sandboxes[sid].rt.spec.labels["dsec.fncall-pool"].endswith("@" + p)
        assert "dsec.project" not in node.sandboxes[shared.member].rt.spec.labels
        # idle members count for their project: one sandbox, its CPU and memory, each
        usage = node.project_usage()
        assert set(usage) == {"org/a", "org/b"}
        for p, sids in members.items():
            assert usage[p] == (len(sids), float(len(sids)), len(sids) * (64 << 20)), usage
        status = {s["project"]: s for s in node.pools.status()}
        assert set(status) == {"org/a", "org/b", None}
        assert sorted(status["org/a"]["members"]) == sorted(members["org/a"])
        assert status["org/b"]["max"] == 2  # the pool's sizes apply to each project's pool
    finally:
        await node.close(kill_all=True)


async def test_a_project_pool_shrinks_away_and_its_use_goes_with_it(fn_home):
    node = await _opened(fn_home, max=2, idle=0.3)
    try:
        assert (await call(node, "true", project="org/a")).ok
        await settle(node)
        assert node.project_usage()["org/a"][0] == 1
        for _ in range(60):
            await asyncio.sleep(0.1)
            if "org/a" not in node.project_usage():
                break
        assert "org/a" not in node.project_usage()
    finally:
        await node.close(kill_all=True)


async def test_start_false_on_an_empty_pool_fails_at_once(fn_home):
    node = await _opened(fn_home, max=2, checkout_timeout=5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(AdmissionRejected) as e:
            await call(node, "true", project="org/a", start=False)
        assert time.monotonic() - t0 < 1.0  # no checkout timeout waited: nothing would come
        assert e.value.reason == "pool-start" and e.value.pool == f"{ENV}/fncall/1cpu/64M@org/a"
        assert "could not start a member" in str(e.value)
        assert not node.sandboxes and not node.pools.pools  # nothing was started or made
        # another project's member is no member of this project's pool
        assert (await call(node, "true", project="org/b")).ok
        with pytest.raises(AdmissionRejected, match="could not start a member"):
            await call(node, "true", project="org/a", start=False)
        # the judge takes the same path
        spec = dsec.JudgeSpec(
            environment=ENV,
            run="cat",
            cases=(dsec.JudgeCase("1\n", "1\n"),),
            memory="64M",
            memory_limit="32M",
            project="org/a",
            start=False,
        )
        with pytest.raises(AdmissionRejected) as e:
            await node.judge(spec)
        assert e.value.reason == "pool-start"
        await settle(node)
        assert "org/a" not in node.project_usage()
    finally:
        await node.close(kill_all=True)


async def test_start_false_takes_an_idle_member(fn_home):
    node = await _opened(fn_home, max=2, checkout_timeout=5.0)
    try:
        first = await call(node, "true", project="org/a")
        await settle(node)
        r = await call(node, "echo again", project="org/a", start=False)
        assert r.ok and r.stdout == b"again\n" and r.member == first.member
        spec = dsec.JudgeSpec(
            environment=ENV,
            run="cat",
            cases=(dsec.JudgeCase("1\n", "1\n"),),
            memory="64M",
            memory_limit="32M",
            project="org/a",
            start=False,
        )
        await settle(node)
        j = await node.judge(spec)
        assert j.verdict == "AC" and j.member == first.member
        await settle(node)
        assert len(node.sandboxes) == 1
    finally:
        await node.close(kill_all=True)


async def test_start_false_waits_for_a_busy_member(fn_home):
    node = await _opened(fn_home, max=4, checkout_timeout=10.0)
    try:
        busy = asyncio.ensure_future(call(node, "sleep 0.6; echo busy", project="org/a"))
        await checked_out(node)
        t0 = time.monotonic()
        r = await call(node, "echo waited", project="org/a", start=False)
        assert r.ok and r.stdout == b"waited\n"
        first = await busy
        assert r.member == first.member and r.wait > 0.1  # the busy one, once given back
        assert time.monotonic() - t0 < 5.0
        await settle(node)
        assert len(node.sandboxes) == 1  # though the pool could have grown to 4
    finally:
        await node.close(kill_all=True)


async def test_start_false_fails_after_the_checkout_timeout_if_no_member_frees(fn_home):
    node = await _opened(fn_home, max=4, checkout_timeout=0.4)
    try:
        busy = asyncio.ensure_future(call(node, "sleep 2; echo busy", project="org/a"))
        await checked_out(node)
        t0 = time.monotonic()
        with pytest.raises(AdmissionRejected) as e:
            await call(node, "true", project="org/a", start=False)
        assert 0.35 <= time.monotonic() - t0 < 1.5
        assert e.value.reason == "pool-start" and "came free" in str(e.value)
        assert (await busy).ok
        await settle(node)
        assert len(node.sandboxes) == 1
    finally:
        await node.close(kill_all=True)


async def test_start_false_waiting_on_a_member_that_dies_fails_at_once(fn_home):
    node = await _opened(fn_home, max=1, checkout_timeout=10.0)
    try:
        first = await call(node, "true", project="org/a")
        await settle(node)
        pid = node.sandboxes[first.member].backend_state["pid"]
        busy = asyncio.ensure_future(call(node, "sleep 30", timeout=20, project="org/a"))
        await checked_out(node)
        waiting = asyncio.ensure_future(call(node, "true", project="org/a", start=False))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # the only member: the waiter has nothing to wait for
        assert (await busy).error == "runtime-error"
        with pytest.raises(AdmissionRejected) as e:
            await waiting
        assert e.value.reason == "pool-start" and time.monotonic() - t0 < 5.0
        await settle(node)
        assert not node.sandboxes  # and no member was started for it
    finally:
        await node.close(kill_all=True)


async def test_a_restarted_node_kills_a_projects_leftover_members(fn_home):
    node = await _opened(fn_home, max=2)
    r = await call(node, "true", project="org/a")
    await settle(node)

    async def crash() -> None:  # as a crashed daemon would: members stay behind
        pass

    node.pools.close = crash  # type: ignore[method-assign]
    await node.close(kill_all=False, release_runtime=False)
    again = await _opened(fn_home)
    try:
        assert r.member not in again.sandboxes and not again.project_usage()
    finally:
        await again.close(kill_all=True)


# --- over the API: the SDK and the kit's daemon -----------------------------------------------


@pytest.fixture
def kit_env(dsec_node):
    return dsec_node.environment(ENV)


def test_fncall_through_the_sdk(dsec_client, kit_env):
    r = dsec_client.fncall(kit_env, "echo $X > f; cat f; pwd", env={"X": "1"}, memory=MEM)
    assert isinstance(r, dsec.FnCallResult)
    assert r.stdout == b"1\n/work\n" and r.ok and r.member and r.pool.startswith(kit_env)
    slow = dsec_client.fncall(kit_env, ["sleep", "10"], timeout=0.3, memory=MEM)
    assert slow.timed_out
    with pytest.raises(dsec.UnknownEnvironment):
        dsec_client.fncall("nope-env", "true")
    with pytest.raises(dsec.InvalidSpec):
        dsec_client.fncall(kit_env, "true", script="true")


async def test_fncall_through_the_async_sdk(dsec_node, kit_env):
    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:
        rs = await asyncio.gather(
            *(client.fncall(kit_env, script="echo $((6*7))", memory=MEM) for _ in range(6))
        )
    assert all(r.stdout == b"42\n" for r in rs)


def test_a_calls_project_and_start_reach_the_node_over_the_api(dsec_node, dsec_client, kit_env):
    """The apiserver's way in: ``project`` and ``start`` in the bodies of fncall and judge."""
    project = "kit-fncall/api"  # no other test's project: the session's node keeps members

    def post(body: dict) -> tuple[int, dict]:
        t = HTTPTransport(os.fspath(dsec_node.config.socket_path))
        try:
            r = t.request(
                "POST",
                "/v1/fncall",
                body=json.dumps(body).encode(),
                content_type="application/json",
                timeout=60,
            )
        finally:
            t.close()
        return r.status_code, r.json()

    base = {"environment": kit_env, "cmd": "echo hi", "memory": MEM, "project": project}
    status, answer = post({**base, "start": False})
    assert status == 429, answer
    err = error_from_wire(answer["error"])
    assert isinstance(err, AdmissionRejected) and err.reason == "pool-start"
    status, answer = post(base)
    assert status == 200 and answer["pool"].endswith("@" + project), answer
    status, again = post({**base, "start": False})
    assert status == 200 and again["member"] == answer["member"], again
    j = dsec_client.judge(
        kit_env,
        "cat",
        cases=[dsec.JudgeCase("1\n", "1\n")],
        memory=MEM,
        memory_limit="32M",
        project=project,
        start=False,
    )
    assert j.verdict == "AC" and j.member == answer["member"]
    (pool,) = [p for p in dsec_client.node_info()["pools"] if p["project"] == project]
    assert pool["name"] == answer["pool"] and pool["size"] == 1
    env = dict(os.environ, DSEC_HOME=os.fspath(dsec_node.home))
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "node", "status"],
        env=env,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert f"fncall pool {answer['pool']} (project {project}): 1 members" in out.stdout, out


def test_fncall_through_the_cli(dsec_node, kit_env, tmp_path):
    src = tmp_path / "prog.sh"
    src.write_text("echo from-file\n")
    env = dict(os.environ, DSEC_HOME=os.fspath(dsec_node.home))
    cli = [sys.executable, "-m", "dsec_core.cli", "fncall", kit_env, "--memory", MEM]
    out = subprocess.run(
        [*cli, "-f", f"prog.sh={src}", "--", "sh prog.sh; exit 3"],
        env=env,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 3 and out.stdout == b"from-file\n", out
    out = subprocess.run(
        [*cli, "--json", "--", "echo", "hi"], env=env, capture_output=True, stdin=subprocess.DEVNULL
    )
    assert out.returncode == 0 and json.loads(out.stdout)["stdout"] == "hi\n", out
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "fncall", "nope-env", "--", "true"],
        env=env,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode != 0 and b"Error:" in out.stderr and b"nope-env" in out.stderr
