"""On-demand layers end to end: a node mounts a layer from a shared source by its metadata and
fetches data chunks only when a sandbox reads them."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from dsec_core.config import NodeConfig
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.localnode import daemon_pid, ensure_daemon, stop_daemon
from dsec_core.node.node import Node
from dsec_core.plugins import open_source
from dsec_core.records import LayerRef, SandboxSpec
from dsec_core.sdk import Client
from dsec_core.sources.transfer import push_layer
from dsec_core.testing import leftovers, make_busybox_rootfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@contextlib.contextmanager
def lazy_daemon(config: NodeConfig, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A daemon of ``config``'s node, its sources and home in the environment; at the end,
    every sandbox killed and the daemon stopped, whatever the test did to it meanwhile."""
    monkeypatch.setenv("DSEC_LAYER_SOURCES", ",".join(config.layer_sources))
    monkeypatch.setenv("DSEC_HOME", os.fspath(config.home))
    ensure_daemon(config)
    try:
        yield
    finally:
        if daemon_pid(config) is None:
            ensure_daemon(config)
        with Client(os.fspath(config.socket_path)) as client:
            for info in client.list():
                client.kill(info.id)
        stop_daemon(config)


def inheritable_fds(pid: int | None) -> dict[int, str]:
    """``pid``'s fds beyond 0-2 that a child it spawns would inherit, with what they are."""
    assert pid is not None
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        fd = int(name)
        try:
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
            what = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        flags = int(
            next(line for line in info.splitlines() if line.startswith("flags:")).split()[1], 8
        )
        if fd > 2 and not flags & os.O_CLOEXEC:
            out[fd] = what
    return out


@pytest.fixture
def setup(tmp_path):
    """A shared source holding a base layer and a 12 MiB workspace, and a node that has
    neither locally."""
    shared = tmp_path / "shared"
    shared.mkdir()
    staging = LayerStore(tmp_path / "staging")
    build_layer(
        make_busybox_rootfs(tmp_path / "rootfs"),
        name="od-base",
        version="1",
        kind="base",
        store=staging,
    )
    ws = tmp_path / "ws" / "workspace"
    ws.mkdir(parents=True)
    rng = random.Random(3)
    for i in range(6):
        (ws / f"big{i}.bin").write_bytes(rng.randbytes(2 << 20))
    (ws / "small.txt").write_text("tiny file\n")
    (ws / "text.txt").write_bytes(b"a line of text that compresses well\n" * 80_000)
    build_layer(tmp_path / "ws", name="od-ws", version="1", kind="workspace", store=staging)
    dest = open_source(f"posix:{shared}")
    for ref in ("od-base@1", "od-ws@1"):
        push_layer(ref, dest, staging)
    home = Path(tempfile.mkdtemp(prefix="dsec-lazy-layers-"))
    config = NodeConfig(home=home, layer_sources=("local", f"posix:{shared}"), fetch_timeout=2.0)
    yield config, shared
    left = leftovers(home)
    shutil.rmtree(home, ignore_errors=True)
    assert not any(left.values()), left


async def test_reads_fetch_only_what_they_touch(setup):
    config, shared = setup
    node = Node(config)
    await node.open()
    try:
        sb = await node.create(SandboxSpec(layers=("od-ws@1", "od-base@1"), memory="128M"))
        r = await node.exec(sb.id, "cat /workspace/small.txt")
        assert r.stdout == b"tiny file\n"
        cache = node.lazy_layers.cache
        ws_blob = next(b for b in node.lazy_layers.blobs.values() if b.index.blob_size > 10 << 20)
        fetched_after_small = cache.fetches
        assert fetched_after_small * ws_blob.index.chunk_size < ws_blob.index.blob_size / 4
        r = await node.exec(sb.id, "md5sum /workspace/big3.bin")
        assert r.exit_code == 0
        assert cache.fetches > fetched_after_small

        # a second sandbox reading the same file fetches nothing new
        before = cache.fetches
        other = await node.create(SandboxSpec(layers=("od-ws@1", "od-base@1"), memory="128M"))
        r2 = await node.exec(other.id, "md5sum /workspace/big3.bin")
        assert r2.stdout.split()[0] == r.stdout.split()[0]
        assert cache.fetches == before

        # the source goes away: an unread file fails with EIO in bounded time, never zeros
        shutil.move(shared, shared.with_name("shared-away"))
        started = time.monotonic()
        r = await node.exec(sb.id, "cat /workspace/big5.bin > /dev/null", timeout=60)
        assert r.exit_code != 0 and b"Input/output error" in r.stderr
        assert time.monotonic() - started < 30
        shutil.move(shared.with_name("shared-away"), shared)
        r = await node.exec(sb.id, "md5sum /workspace/big5.bin")  # back: reads recover
        assert r.exit_code == 0

        # prefetch warms the rest
        rows = await node.prefetch(["od-ws@1"])
        assert rows[0]["mode"] == "on-demand"
        before = cache.fetches
        await node.exec(sb.id, "cat /workspace/*.bin > /dev/null")
        assert cache.fetches == before
        await node.kill(sb.id)
        await node.kill(other.id)
    finally:
        await node.close(kill_all=True)


async def test_damaged_compressed_chunk_gives_eio_not_garbage(setup):
    """Published chunks are zstd-compressed; a stored chunk damaged at the source fails the
    read in the sandbox, and the file reads right once the source is repaired."""
    config, shared = setup
    src = open_source(f"posix:{shared}")
    form = src.lazy_form(src.resolve(LayerRef("od-ws", "1")))
    index = form.index
    assert index.compression == "zstd" and form.blob_size < index.blob_size
    packed = [
        i for i in range(len(index.chunks)) if index.stored_range(i)[1] < index.chunk_range(i)[1]
    ]
    assert packed  # text.txt's chunks shrank
    blob_file = shared / src.blob_key(index.blob_digest)
    off, n = index.stored_range(packed[0])
    with open(blob_file, "r+b") as f:
        f.seek(off + n // 2)
        byte = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    node = Node(config)
    await node.open()
    try:
        sb = await node.create(SandboxSpec(layers=("od-ws@1", "od-base@1"), memory="128M"))
        r = await node.exec(sb.id, "md5sum /workspace/*.txt", timeout=60)
        assert r.exit_code != 0 and b"Input/output error" in r.stderr
        assert index.chunks[packed[0]] not in node.lazy_layers.cache
        with open(blob_file, "r+b") as f:
            f.seek(off + n // 2)
            f.write(byte)
        r = await node.exec(sb.id, "md5sum /workspace/text.txt")
        assert r.exit_code == 0
        want = hashlib.md5(b"a line of text that compresses well\n" * 80_000).hexdigest()
        assert r.stdout.split()[0].decode() == want
        await node.kill(sb.id)
    finally:
        await node.close(kill_all=True)


async def test_eager_mode_fetches_whole_images(setup):
    config, shared = setup
    from dataclasses import replace

    node = Node(replace(config, ondemand=False))
    await node.open()
    try:
        sb = await node.create(SandboxSpec(layers=("od-ws@1", "od-base@1"), memory="128M"))
        assert (await node.exec(sb.id, "cat /workspace/small.txt")).stdout == b"tiny file\n"
        assert node.lazy_layers.server is None  # nothing went through the on-demand path
        cached = [p for p in config.cache_dir.glob("*.erofs")]
        assert len(cached) == 2
        await node.kill(sb.id)
    finally:
        await node.close(kill_all=True)


def test_daemon_restart_keeps_ondemand_layers_readable(setup, monkeypatch):
    import signal

    config, shared = setup
    with lazy_daemon(config, monkeypatch):
        with Client(os.fspath(config.socket_path)) as client:
            sb = client.create(layers=("od-ws@1", "od-base@1"), memory="128M")
            first = sb.exec("md5sum /workspace/big0.bin").check().stdout
            chunks_before = {
                p.name for p in (config.cache_dir / "chunks").rglob("*") if p.is_file()
            }
            old = daemon_pid(config)
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{old}") and time.monotonic() < deadline:
                time.sleep(0.05)
            # the keeper holds the connection: the layer mount is still there
            assert os.path.ismount(config.run_dir / "lazy")
            ensure_daemon(config)
            # the daemon posix_spawns QEMU, runc and lxcfs, which closes no fd: every fd of
            # it beyond 0-2 must be close-on-exec, the connection it took over too (a child
            # holding a copy kept a dead daemon's connection open, and the mount hung)
            assert inheritable_fds(daemon_pid(config)) == {}
        with Client(os.fspath(config.socket_path)) as client:
            again = client.get(sb.id)
            assert again.exec("md5sum /workspace/big0.bin").check().stdout == first
            again.exec("md5sum /workspace/big1.bin").check()  # chunks nobody had fetched
            chunks_after = {p.name for p in (config.cache_dir / "chunks").rglob("*") if p.is_file()}
            assert chunks_before <= chunks_after  # the cache survived as it was
            again.kill()


def test_a_killed_fuse_keeper_is_replaced_so_a_restart_keeps_the_layers(setup, monkeypatch):
    """The keeper is what holds the FUSE connection while no daemon runs: one killed from
    outside is replaced, and a daemon killed after that still hands its successor a live
    connection (before, the mount died with the daemon and every read under it failed)."""
    import signal

    from dsec_core.lazy.fuse_keeper import ask_keeper
    from dsec_core.linux.processes import start_time
    from dsec_core.testing import pids_matching, until

    config, shared = setup

    def keepers() -> list[int]:
        return pids_matching("dsec_core.lazy.fuse_keeper", os.fspath(config.home))

    def replaced(dead: int) -> bool:
        """A new keeper answers on the socket (it has the fd, and told its daemon so)."""
        if not keepers() or keepers() == [dead]:
            return False
        try:
            return ask_keeper(os.fspath(config.run_dir / "lazy-keeper.sock"), b"?")[0] == b"?"
        except OSError:
            return False

    with lazy_daemon(config, monkeypatch):
        with Client(os.fspath(config.socket_path)) as client:
            sb = client.create(layers=("od-ws@1", "od-base@1"), memory="128M")
            first = sb.exec("md5sum /workspace/big0.bin").check().stdout
            (keeper,) = keepers()
            os.kill(keeper, signal.SIGKILL)
            until(lambda: replaced(keeper), timeout=15, what="a new keeper")
            old = daemon_pid(config)
            assert old is not None
            os.kill(old, signal.SIGKILL)
            until(lambda: start_time(old) is None, timeout=10, what="the daemon's end")
            ensure_daemon(config)
        with Client(os.fspath(config.socket_path)) as client:
            again = client.get(sb.id)
            assert again.exec("md5sum /workspace/big0.bin").check().stdout == first
            # chunks nobody had fetched: served through the connection the new keeper held
            expected = hashlib.md5((shared.parent / "ws" / "workspace" / "big3.bin").read_bytes())
            out = again.exec("md5sum /workspace/big3.bin").check().stdout
            assert out.split()[0].decode() == expected.hexdigest()
            (survivor,) = keepers()  # the new daemon watches the keeper it took the fd from
            os.kill(survivor, signal.SIGKILL)
            until(lambda: replaced(survivor), timeout=15, what="a new keeper")
            again.kill()


@pytest.mark.parametrize("stray", [False, True], ids=["unheld", "held-by-a-stray"])
def test_a_connection_nobody_serves_is_dropped_not_stacked_on(setup, monkeypatch, stray):
    """Keeper and daemon killed at once: nobody serves the FUSE connection, so the next
    daemon mounts a new one in its place (one mount there, not two), the sandbox that read
    through the dead one is SandboxDied, and new sandboxes read the layers again. With a
    stray process still holding the connection's fd (as QEMU or lxcfs did when an adopted fd
    was inheritable), it stays alive unserved and any look at the mount would wait for good:
    the daemon aborts it and starts all the same."""
    import signal

    from dsec_core.lazy.fuse_keeper import take_from_keeper
    from dsec_core.linux.mounts import mounted_under
    from dsec_core.linux.processes import start_time
    from dsec_core.testing import pids_matching, until

    config, shared = setup
    lazy = config.run_dir / "lazy"
    with lazy_daemon(config, monkeypatch), contextlib.ExitStack() as held_fds:
        with Client(os.fspath(config.socket_path)) as client:
            sb = client.create(layers=("od-ws@1", "od-base@1"), memory="128M")
            sb.exec("md5sum /workspace/small.txt").check()
            (keeper,) = pids_matching("dsec_core.lazy.fuse_keeper", os.fspath(config.home))
            held, _ = take_from_keeper(os.fspath(config.run_dir / "lazy-keeper.sock"))
            if stray:
                held_fds.callback(os.close, held)  # held until the test is over
            else:
                os.close(held)
            old = daemon_pid(config)
            assert old is not None
            os.kill(keeper, signal.SIGKILL)
            os.kill(old, signal.SIGKILL)
            until(lambda: start_time(old) is None, timeout=10, what="the daemon's end")
            t0 = time.monotonic()
            ensure_daemon(config)
            assert time.monotonic() - t0 < 20
        with Client(os.fspath(config.socket_path)) as client:
            # its layers cannot be read again: it died with the connection, and says so
            with pytest.raises(dsec.SandboxDied, match="connection was lost"):
                client.exec(sb.id, "true")
            fresh = client.create(layers=("od-ws@1", "od-base@1"), memory="128M")
            assert mounted_under(lazy) == [lazy]
            expected = hashlib.md5((shared.parent / "ws" / "workspace" / "big4.bin").read_bytes())
            out = fresh.exec("md5sum /workspace/big4.bin").check().stdout
            assert out.split()[0].decode() == expected.hexdigest()
            fresh.kill()
