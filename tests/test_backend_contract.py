"""The backend contract fits a VM: a backend that asks for layer image files and a writable disk
(``RootfsForm.IMAGES``) and reaches its agent over a forwarded socket (``AgentChannel.FORWARDED``)
gets exactly that from the node, and nothing mounted on its behalf.

``ImageBackend`` plays a microVM without QEMU: it mounts the image files it is handed itself (as a
guest kernel would from virtio-pmem), runs ``dsec-agent`` in fresh namespaces on a socket of its
own (the "guest" side), and forwards each connection the node makes to ``rt.agent_socket`` to it
(as a vsock or serial forwarder would). Nothing here needs core changes: that is the point.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import shutil
import signal
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from dsec_core import plugins
from dsec_core.backend import AGENT_PATH, AgentChannel, Backend, Feature, RootfsForm, SandboxRuntime
from dsec_core.config import NodeConfig
from dsec_core.errors import PolicyUnavailable, SandboxError
from dsec_core.hookspecs import hookimpl
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.mounts import mount_erofs_file, mount_overlay, unmount
from dsec_core.node.node import Node
from dsec_core.plugins import open_source
from dsec_core.records import DEFAULT_DISK, SandboxSpec
from dsec_core.sources.transfer import push_layer
from dsec_core.testing import leftovers, make_busybox_rootfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


class ImageBackend(Backend):
    """Boots "guests" from image files, behind a forwarded agent socket."""

    name = "image-guest"
    rootfs = RootfsForm.IMAGES
    agent_channel = AgentChannel.FORWARDED
    features = frozenset({Feature.PID_NAMESPACE, Feature.NET_NAMESPACE})
    handed: dict[str, SandboxRuntime] = {}  # what the node handed each sandbox

    def __init__(self, config: NodeConfig) -> None:
        super().__init__(config)
        self.forwarders: dict[str, asyncio.AbstractServer] = {}

    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        ImageBackend.handed[rt.id] = rt
        guest = rt.dir / "guest"
        lowers = []
        try:
            for i, layer in enumerate(rt.images):  # the "guest kernel" mounts its pmem devices
                lower = guest / f"lower{i}"
                lower.mkdir(parents=True)
                mount_erofs_file(layer.image, lower, None, device=layer.device)
                lowers.append(lower)
            root, upper, work = guest / "root", guest / "upper", guest / "work"
            for d in (root, upper, work):
                d.mkdir()
            mount_overlay(lowers, upper, work, root)
            (root / ".dsec").mkdir()
            shutil.copy2(rt.agent_binary, root / AGENT_PATH.lstrip("/"))
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(os.fspath(guest / "agent.sock"))
            listener.listen(64)
            script = (
                'mount -t tmpfs -o size=1m tmpfs "$0/dev" && touch "$0/dev/null" && '
                'mount --bind /dev/null "$0/dev/null" && exec chroot "$0" '
                f"{AGENT_PATH} --fd 3"
            )
            argv = [
                "unshare",
                "--pid",
                "--net",
                "--ipc",
                "--uts",
                "--mount",
                "--fork",
                "--kill-child",
                f"--mount-proc={root}/proc",
                "sh",
                "-c",
                script,
                os.fspath(root),
            ]
            try:
                pid = os.posix_spawnp(
                    argv[0],
                    argv,
                    os.environ,
                    setsid=True,
                    file_actions=[(os.POSIX_SPAWN_DUP2, listener.fileno(), 3)],
                )
            finally:
                listener.close()
        except BaseException:
            self._unmount(rt)
            raise
        self.forwarders[rt.id] = await asyncio.start_unix_server(
            lambda r, w: _forward(r, w, guest / "agent.sock"), path=os.fspath(rt.agent_socket)
        )
        return {"pid": pid}

    async def alive(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        return state.get("pid") is not None and Path(f"/proc/{state['pid']}").exists()

    async def stop(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        server = self.forwarders.pop(rt.id, None)
        if server is not None:
            server.close()
            await server.wait_closed()
        pid = state.get("pid")
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # --kill-child takes the guest's init with it
            with contextlib.suppress(ChildProcessError):
                await asyncio.to_thread(os.waitpid, pid, 0)
        self._unmount(rt)

    @staticmethod
    def _unmount(rt: SandboxRuntime) -> None:
        guest = rt.dir / "guest"
        for mp in [guest / "root", *sorted(guest.glob("lower*"))]:
            unmount(mp)


class NoNetworkIsolation(ImageBackend):
    name = "image-guest-open-net"
    features = frozenset({Feature.PID_NAMESPACE})


async def _forward(
    client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, guest: Path
) -> None:
    """Pipe one connection to the guest's agent and back, half-closes included (the agent
    cancels a command when its client half-closes)."""
    try:
        guest_r, guest_w = await asyncio.open_unix_connection(os.fspath(guest))
    except OSError:
        client_w.close()
        return

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
            if w.can_write_eof():
                w.write_eof()
        except (ConnectionError, OSError):
            w.close()

    await asyncio.gather(pipe(client_r, guest_w), pipe(guest_r, client_w))
    client_w.close()
    guest_w.close()


class ImagePlugin:
    @hookimpl
    def dsec_register_backends(self, register):
        register(ImageBackend)
        register(NoNetworkIsolation)


@pytest.fixture
def image_node(tmp_path):
    """A node with the image backend, a local base layer and an on-demand workspace layer."""
    plugins.reset()
    plugins.get_plugin_manager().register(ImagePlugin(), name="image_plugin")
    shared = tmp_path / "shared"
    shared.mkdir()
    staging = LayerStore(tmp_path / "staging")
    ws = tmp_path / "ws" / "work"
    ws.mkdir(parents=True)
    (ws / "hello.txt").write_text("hello from an on-demand layer\n")
    (ws / "noise.bin").write_bytes(random.Random(1).randbytes(3 << 20))
    build_layer(tmp_path / "ws", name="guest-ws", version="1", kind="workspace", store=staging)
    push_layer("guest-ws@1", open_source(f"posix:{shared}"), staging)
    home = Path(tempfile.mkdtemp(prefix="dsec-imagebackend-"))
    config = NodeConfig(home=home, layer_sources=("local", f"posix:{shared}"))
    config.ensure_dirs()
    build_layer(
        make_busybox_rootfs(tmp_path / "rootfs"),
        name="guest-base",
        version="1",
        kind="base",
        store=LayerStore(config.layer_dir),
    )
    try:
        yield config
    finally:
        plugins.reset()
        left = leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
        assert not any(left.values()), left


async def test_the_node_hands_image_files_and_a_disk_and_mounts_nothing(image_node):
    node = Node(image_node)
    await node.open()
    try:
        info = await node.create(
            SandboxSpec(layers=("guest-ws@1", "guest-base@1"), backend="image-guest")
        )
        rt = ImageBackend.handed[info.id]
        # the files, top first, named and addressed as the layers are
        assert rt.rootfs is None
        assert [i.ref for i in rt.images] == ["guest-ws@1", "guest-base@1"]
        base = rt.images[1]
        assert base.device is None  # a local layer: its whole image, in place
        digest = "sha256:" + hashlib.sha256(base.image.read_bytes()).hexdigest()
        assert (
            digest == base.digest == LayerStore(image_node.layer_dir).resolve("guest-base@1").digest
        )
        ws = rt.images[0]
        assert ws.device is not None  # on demand: a metadata image plus a blob the node serves
        assert ws.device.is_relative_to(image_node.run_dir)
        # a writable disk: sparse, unformatted, the default size
        assert rt.disk is not None and rt.disk.is_relative_to(image_node.sandbox_dir)
        assert rt.disk_size == DEFAULT_DISK == rt.disk.stat().st_size
        assert rt.disk.stat().st_blocks == 0
        # nothing mounted for it: no shared layer mounts, no overlay
        assert node.mounts.refcounts() == {}
        assert not (rt.dir / "rootfs").exists()
        # the node reaches the agent only through the forwarded socket
        r = await node.exec(info.id, "cat /work/hello.txt; cut -d: -f1 /proc/net/dev | tail -n +3")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode().split() == ["hello", "from", "an", "on-demand", "layer", "lo"]
        session = await node.session_open(info.id)
        await node.session_exec(info.id, session, "cd /work; X=7")
        assert (await node.session_exec(info.id, session, "echo $X $PWD")).stdout == b"7 /work\n"
        data = os.urandom(1 << 20)
        await node.write_file(info.id, "/tmp/blob", data)
        assert await node.read_file(info.id, "/tmp/blob") == data
        await node.kill(info.id)
        assert not rt.disk.exists() and not rt.dir.exists()
    finally:
        await node.close(kill_all=True)


async def test_network_none_needs_a_backend_that_isolates_it(image_node):
    node = Node(image_node)
    await node.open()
    try:
        with pytest.raises(PolicyUnavailable) as e:
            await node.create(SandboxSpec(layers=("guest-base@1",), backend="image-guest-open-net"))
        assert "network" in str(e.value) and e.value.backend == "image-guest-open-net"
        assert node.sandboxes == {} and list(image_node.sandbox_dir.iterdir()) == []
    finally:
        await node.close(kill_all=True)


class FailingImageBackend(ImageBackend):
    name = "image-guest-broken"

    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        raise SandboxError("the guest did not boot", sandbox_id=rt.id)


async def test_a_failed_start_leaves_no_disk_or_registration(image_node):
    plugins.get_plugin_manager().register(
        type(
            "P",
            (),
            {
                "dsec_register_backends": hookimpl(
                    lambda self, register: register(FailingImageBackend)
                )
            },
        )(),
        name="broken",
    )
    plugins.registry.cache_clear()
    node = Node(image_node)
    await node.open()
    try:
        with pytest.raises(SandboxError):
            await node.create(SandboxSpec(layers=("guest-base@1",), backend="image-guest-broken"))
        assert node.sandboxes == {}
        assert list(image_node.sandbox_dir.iterdir()) == []
        assert list(image_node.runtime_dir.iterdir()) == []
    finally:
        await node.close(kill_all=True)
