"""The agent channel of VM sandboxes (``src/mux.c``), run for real on the host: an agent serving
the streams of a "port" (one end of a socketpair, as QEMU's virtio-serial chardev would carry
it) and ``dsec-agent forward`` turning the node's connections into those streams."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from dsec_core.agent import ensure_agent
from dsec_core.agent.rpc import AgentClient
from dsec_core.errors import SandboxNotRunning


def _spawn(argv: list[str], fds: list[int]) -> int:
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in fds]
    try:
        actions = [(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(high)]
        return os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)
    finally:
        for fd in high:
            os.close(fd)


@pytest.fixture
def channel(tmp_path):
    """(client, guest agent pid, forwarder pid): a node-side client whose every connection
    crosses the forwarder and one byte stream to an agent serving that stream."""
    agent = ensure_agent(tmp_path / "bin")
    host, guest = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(tmp_path / "agent.sock"))
    listener.listen(64)
    pids = [
        _spawn([os.fspath(agent), "--serial-fd", "3"], [guest.fileno()]),
        _spawn(
            [os.fspath(agent), "forward", "--listen-fd", "3", "--serial-fd", "4"],
            [listener.fileno(), host.fileno()],
        ),
    ]
    for s in (host, guest, listener):
        s.close()
    try:
        yield AgentClient(tmp_path / "agent.sock"), pids[0], pids[1]
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass  # the test reaped it


async def test_requests_cross_the_channel(channel, tmp_path):
    client, _, _ = channel
    assert (await client.ping())["version"]
    r = await client.exec("echo out; echo err >&2; exit 3", timeout=10)
    assert (r.stdout, r.stderr, r.exit_code) == (b"out\n", b"err\n", 3)
    # stdin ends with the request's half-close, which must cross as well
    r = await client.exec("wc -c", stdin=b"x" * (2 << 20), timeout=10)
    assert r.stdout.strip() == str(2 << 20).encode()


async def test_concurrent_streams_do_not_mix(channel):
    client, _, _ = channel
    started = time.monotonic()
    results = await asyncio.gather(
        *(client.exec(f"sleep 0.3; echo {i}", timeout=10) for i in range(12))
    )
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(12)]
    assert time.monotonic() - started < 3


async def test_big_transfers_both_ways_under_flow_control(channel, tmp_path):
    """More than a stream's window (256 KiB) each way, twice over at once: the window and the
    acknowledgements keep the bytes in order and the buffers bounded."""
    client, _, _ = channel
    blobs = [os.urandom(5 << 20), os.urandom(3 << 20)]
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    await asyncio.gather(*(client.write_file(p, b) for p, b in zip(paths, blobs, strict=True)))
    back = await asyncio.gather(*(client.read_file(p) for p in paths))
    assert back == blobs
    r = await client.exec("head -c 4000000 /dev/zero", timeout=10, max_output=8 << 20)
    assert r.stdout == bytes(4000000)


async def test_the_forwarder_ends_with_the_port_and_the_node_hears_of_it(channel):
    client, agent_pid, forwarder_pid = channel
    await client.ping()
    os.kill(agent_pid, signal.SIGKILL)  # the guest (its end of the port) goes away
    os.waitpid(agent_pid, 0)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{forwarder_pid}").exists():
        if os.waitpid(forwarder_pid, os.WNOHANG)[0] == forwarder_pid:
            break
        assert time.monotonic() < deadline, "the forwarder outlived its port"
        await asyncio.sleep(0.02)
    with pytest.raises(SandboxNotRunning):
        await client.ping()
