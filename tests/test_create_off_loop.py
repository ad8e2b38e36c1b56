"""A create's blocking mount work runs in a thread (the event loop serves other requests
meanwhile), and a create cancelled while that thread mounts waits for it before undoing:
nothing it mounted is left behind."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from dsec_core.node.node import Node
from dsec_core.node.rootfs import RootFilesystems
from dsec_core.records import SandboxSpec
from dsec_core.testing import node_home

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")

SPEC = SandboxSpec(layers=("kit-base@1",), memory="64M", cpu=0.2)


async def test_a_create_cancelled_while_its_thread_mounts_leaves_nothing(monkeypatch):
    entered, finished = threading.Event(), threading.Event()
    real = RootFilesystems._mount_rootfs

    def slow_mount(self, *args):  # mounts, then lingers: the cancel lands meanwhile
        entered.set()
        try:
            real(self, *args)
            time.sleep(0.3)
        finally:
            finished.set()

    monkeypatch.setattr(RootFilesystems, "_mount_rootfs", slow_mount)
    with node_home("dsec-offloop-") as config:  # fails on any mount, dir or image left
        node = Node(config)
        await node.open()
        try:
            task = asyncio.create_task(node._admit_and_create(SPEC, None))
            await asyncio.to_thread(entered.wait, 10)
            # the loop is free while the thread works: other work runs at once
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            assert time.perf_counter() - t < 0.2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert finished.is_set()  # the undo waited for the thread's mounts
            assert node.sandboxes == {}
            assert list(config.sandbox_dir.iterdir()) == []
            assert list(config.runtime_dir.iterdir()) == []
            assert all(n == 0 for n in node.mounts.refcounts().values())
            assert node.admission.uids.in_use() == 0
            # and the node still creates
            monkeypatch.setattr(RootFilesystems, "_mount_rootfs", real)
            info = await node.create(SPEC)
            assert (await node.exec(info.id, "echo hi")).stdout == b"hi\n"
            await node.kill(info.id)
        finally:
            await node.close(kill_all=True)
