"""What a node of thousands of sandboxes needs beyond uid ranges (tests/test_uid_ranges.py): host
limits raised, and sandboxes that stop on their own noticed without polling each of them."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time
from pathlib import Path

import pytest

from dsec_core.linux import sysctl
from dsec_core.node.node import Node
from dsec_core.records import SandboxSpec
from dsec_core.testing import node_home

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
SPEC = SandboxSpec(layers=("kit-base@1",), memory="64M", cpu=0.2)


@pytest.fixture
def config():
    with node_home("dsec-scale-") as cfg:
        yield cfg


async def test_an_open_node_has_pids_for_thousands_of_sandboxes(config):
    node = Node(config)
    await node.open()
    await node.close()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert pid_max >= sysctl.NODE_MINIMUMS["kernel.pid_max"]
    # only ever raised: asking for less changes nothing, and an unknown name is skipped
    assert sysctl.raise_to({"kernel.pid_max": 1000, "kernel.no_such_knob": 5}) == {}
    assert int(Path("/proc/sys/kernel/pid_max").read_text()) == pid_max


async def _gone(node: Node, sid: str, within: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < within:
        if sid not in node.sandboxes:
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    return None


async def test_a_sandbox_that_dies_is_heard_of_not_polled(config, monkeypatch):
    """The loop watches each container's pidfd: a sandbox killed from outside is cleaned up at
    once, with the every-second poll of ``alive`` out of the picture, and after a daemon
    restart too."""
    node = Node(config)
    await node.open()
    try:
        a = await node.create(SPEC)
        b = await node.create(SPEC)
        assert all(node.sandboxes[s.id].exit_fd is not None for s in (a, b))
        polled = []
        backend = node.sandboxes[a.id].backend
        real_alive = backend.alive

        async def counting_alive(rt, state):
            polled.append(rt.id)
            return await real_alive(rt, state)

        monkeypatch.setattr(backend, "alive", counting_alive)
        os.kill(a.pid, signal.SIGKILL)
        took = await _gone(node, a.id, within=0.9)  # the poll comes every 1 s
        assert took is not None, "the node did not notice within 0.9 s"
        await asyncio.sleep(1.2)  # a watch loop round
        assert polled == []  # nobody asked alive() about watched sandboxes
        # a restarted node watches the sandboxes it adopts
        await node.close()
        node = Node(config)
        await node.open()
        assert node.sandboxes[b.id].exit_fd is not None
        os.kill(b.pid, signal.SIGKILL)
        assert await _gone(node, b.id, within=0.9) is not None
    finally:
        await node.close(kill_all=True)


def test_the_open_file_limit_is_raised_and_never_lowered():
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, before[1]))
        assert sysctl.raise_nofile(4096) == (1024, 4096)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 4096
        assert sysctl.raise_nofile(2048) is None  # already enough
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 4096
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
