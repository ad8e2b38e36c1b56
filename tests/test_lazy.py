"""On-demand layer loading: real EROFS layers, their data blob served over FUSE from a chunk cache.

Each test builds layers with ``mkfs.erofs --blobdev``, serves the blob through ``FuseServer`` +
``LazyBlob`` from a counted "remote" copy, mounts the metadata image with ``device=`` pointing at
the FUSE file, and checks what was fetched. Every mount and server is torn down by the fixture.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dsec_core.errors import LayerCorrupt, SourceUnavailable
from dsec_core.lazy import (
    ChunkCache,
    ChunkIndex,
    FuseServer,
    LazyBlob,
    mount_lazy_erofs,
    prefetch,
    recv_fuse_fd,
    send_fuse_fd,
)
from dsec_core.linux.mounts import unmount
from dsec_core.testing.fixtures import leaves_no_mounts_or_threads

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs"),
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse"),
]

MiB = 1 << 20


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Remote:
    """The blob on "the distributed filesystem": counts reads, can fail, stall or corrupt them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[tuple[int, int]] = []
        self.mode = "ok"  # ok | down | hang | corrupt
        self.release = threading.Event()  # ends every "hang"
        self.entered = threading.Event()
        self.delay = 0.0
        self._lock = threading.Lock()

    def read_range(self, offset: int, length: int) -> bytes:
        with self._lock:
            self.calls.append((offset, length))
        self.entered.set()
        if self.delay:
            time.sleep(self.delay)
        if self.mode == "down":
            raise ConnectionError("3fs: connection refused")
        if self.mode == "hang":
            self.release.wait(30)
        with open(self.path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if self.mode == "corrupt":
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    @property
    def bytes_read(self) -> int:
        return sum(n for _, n in self.calls)


class Layer:
    def __init__(self, src: Path, meta: Path, blob: Path) -> None:
        self.src, self.meta, self.blob = src, meta, blob
        self.index = ChunkIndex.build(blob, MiB)


def build_layer(where: Path, files: dict[str, bytes]) -> Layer:
    where.mkdir(parents=True, exist_ok=True)
    src = where / "src"
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    meta, blob = where / "meta.erofs", where / "data.blob"
    subprocess.run(
        ["mkfs.erofs", f"--blobdev={blob}", f"--chunksize={MiB}", str(meta), str(src)],
        check=True,
        capture_output=True,
    )
    return Layer(src, meta, blob)


class Lazy:
    """Records every FUSE server and EROFS mount a test made, and removes them all at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.servers: list[FuseServer] = []
        self.erofs: list[Path] = []
        self.fds: list[int] = []
        self.remotes: list[Remote] = []
        self._n = 0

    def _dir(self, kind: str) -> Path:
        self._n += 1
        d = self.tmp / f"{kind}{self._n}"
        d.mkdir()
        return d

    def serve(self, blobs: dict[str, LazyBlob], server: FuseServer | None = None) -> FuseServer:
        server = server or FuseServer()
        for name, blob in blobs.items():
            server.add_blob(name, blob.size, blob.read)
        server.mount(self._dir("fuse"))
        self.servers.append(server)
        return server

    def mount_layer(self, layer: Layer, blob_file: Path) -> Path:
        target = self._dir("erofs")
        mount_lazy_erofs(layer.meta, blob_file, target)
        self.erofs.append(target)
        return target

    def remote(self, layer: Layer) -> Remote:
        r = Remote(layer.blob)
        self.remotes.append(r)
        return r

    def teardown(self) -> None:
        for r in self.remotes:
            r.mode = "ok"
            r.release.set()
        for target in reversed(self.erofs):
            unmount(target)
        for server in reversed(self.servers):
            server.close()
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


@pytest.fixture
def lazy(tmp_path):
    rec = Lazy(tmp_path)
    with leaves_no_mounts_or_threads(tmp_path, "fuse-", "prefetch"):
        try:
            yield rec
        finally:
            rec.teardown()


@pytest.fixture
def layer(tmp_path) -> Layer:
    rnd = os.urandom
    big = rnd(5 * MiB + 12345)
    files = {
        "big1": big,
        "copy/big1-again": big,  # stored once in the blob
        "other": rnd(3 * MiB + 777),
        "etc/hostname": b"sandbox\n",
        "etc/motd": b"hello from a lazy layer\n" * 10,
        "empty": b"",
    }
    return build_layer(tmp_path / "layer", files)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _setup(
    lazy: Lazy,
    layer: Layer,
    tmp_path: Path,
    *,
    max_bytes: int = 256 * MiB,
    timeout: float = 5.0,
    cache: ChunkCache | None = None,
):
    remote = lazy.remote(layer)
    cache = cache or ChunkCache(tmp_path / "cache", max_bytes)
    blob = LazyBlob(layer.index, cache, remote.read_range, fetch_timeout=timeout)
    server = lazy.serve({"data.blob": blob})
    root = lazy.mount_layer(layer, server.path_of("data.blob"))
    return remote, cache, blob, server, root


def test_small_file_fetches_only_its_chunk_then_everything_matches(lazy, layer, tmp_path):
    remote, cache, blob, server, root = _setup(lazy, layer, tmp_path)
    assert sorted(os.listdir(server.mountpoint)) == ["data.blob"]
    assert os.stat(server.path_of("data.blob")).st_size == layer.index.blob_size
    # Mounting reads metadata from meta.erofs only: nothing fetched yet.
    assert remote.calls == []

    assert (root / "etc" / "hostname").read_bytes() == b"sandbox\n"
    assert 1 <= len(remote.calls) <= 2
    assert remote.bytes_read <= 2 * MiB < layer.index.blob_size
    assert all(off % MiB == 0 and n <= MiB for off, n in remote.calls)  # whole chunks only

    assert _tree(root) == _tree(layer.src)
    # Every chunk fetched exactly once, the duplicated file's data stored once in the blob.
    assert sorted(remote.calls) == sorted(set(remote.calls))
    assert remote.bytes_read == layer.index.blob_size
    assert layer.index.blob_size < 2 * (5 * MiB)
    assert cache.total_bytes == layer.index.blob_size


def test_identical_chunks_of_two_layers_are_fetched_once(lazy, tmp_path):
    shared = os.urandom(4 * MiB)
    a = build_layer(tmp_path / "a", {"lib/shared.so": shared, "a-only": os.urandom(MiB + 5)})
    b = build_layer(tmp_path / "b", {"lib/shared.so": shared, "b-only": os.urandom(2 * MiB + 9)})
    assert a.index.blob_digest != b.index.blob_digest
    common = set(a.index.chunks) & set(b.index.chunks)
    assert len(common) >= 4

    cache = ChunkCache(tmp_path / "cache", 256 * MiB)
    ra, rb = lazy.remote(a), lazy.remote(b)
    server = lazy.serve(
        {
            "a.blob": LazyBlob(a.index, cache, ra.read_range),
            "b.blob": LazyBlob(b.index, cache, rb.read_range),
        }
    )
    root_a = lazy.mount_layer(a, server.path_of("a.blob"))
    root_b = lazy.mount_layer(b, server.path_of("b.blob"))

    assert (root_a / "lib" / "shared.so").read_bytes() == shared
    fetched_a = len(ra.calls)
    assert (root_b / "lib" / "shared.so").read_bytes() == shared
    assert fetched_a >= 4
    # Layer b's copy came from the cache, filled by layer a: b fetched none of the common
    # chunks (kernel readahead may pull in a neighbouring chunk of b's own).
    fetched_b = {b.index.chunks[off // MiB] for off, _ in rb.calls}
    assert not fetched_b & common
    assert _tree(root_b) == _tree(b.src)
    assert len(rb.calls) == len(set(b.index.chunks) - common)


def test_concurrent_readers_of_a_missing_chunk_trigger_one_fetch(tmp_path):
    data = os.urandom(MiB)
    cache = ChunkCache(tmp_path / "cache", 16 * MiB)
    calls = []
    gate = threading.Event()

    def fetch() -> bytes:
        calls.append(1)
        gate.wait(5)
        return data

    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get(_digest(data), fetch, 10)))
        for _ in range(32)
    ]
    for t in threads:
        t.start()
    time.sleep(0.2)  # let them all pile up behind the one fetch
    gate.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert len(results) == 32 and all(r == data for r in results)
    assert cache.fetches == 1


def test_concurrent_reads_through_the_mount_fetch_each_chunk_once(lazy, layer, tmp_path):
    remote, cache, blob, server, root = _setup(lazy, layer, tmp_path)
    remote.delay = 0.2  # a slow source so the readers overlap
    errors: list[BaseException] = []
    want = (layer.src / "other").read_bytes()

    def reader() -> None:
        try:
            assert (root / "other").read_bytes() == want
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == []
    assert sorted(remote.calls) == sorted(set(remote.calls))


def test_lru_eviction_stays_under_budget_and_refetches(lazy, layer, tmp_path):
    remote, cache, blob, server, root = _setup(lazy, layer, tmp_path, max_bytes=3 * MiB)
    want = _tree(layer.src)
    got = _tree(root)
    assert got == want
    assert cache.total_bytes <= 3 * MiB
    on_disk = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert on_disk == cache.total_bytes
    assert len(cache) <= 3

    # Evicted chunks come back from the source with the right bytes.
    before = len(remote.calls)
    chunks = [blob.chunk(i) for i in range(len(layer.index.chunks))]
    assert b"".join(chunks) == layer.blob.read_bytes()
    assert len(remote.calls) > before
    assert cache.total_bytes <= 3 * MiB

    # The least recently used chunk goes first.
    cache2 = ChunkCache(tmp_path / "cache2", 2 * MiB)
    a, b, c = (os.urandom(MiB) for _ in range(3))
    for x in (a, b):
        cache2.get(_digest(x), lambda x=x: x)
    cache2.get(_digest(a), lambda: pytest.fail("a is cached"))
    cache2.get(_digest(c), lambda: c)
    assert _digest(a) in cache2 and _digest(c) in cache2 and _digest(b) not in cache2


def test_pinned_chunk_is_not_evicted_mid_read(tmp_path):
    cache = ChunkCache(tmp_path / "cache", 2 * MiB)
    a, b, c = (os.urandom(MiB) for _ in range(3))
    cache.get(_digest(a), lambda: a)
    with cache.pin(_digest(a)):  # a reader is in the middle of chunk a
        cache.get(_digest(b), lambda: b)
        cache.get(_digest(c), lambda: c)
        assert _digest(a) in cache
        assert cache.path_of(_digest(a)).read_bytes() == a
        assert _digest(b) not in cache  # evicted instead of the pinned, older a
    cache.get(_digest(b), lambda: b)
    assert cache.total_bytes <= 2 * MiB
    assert _digest(a) not in cache  # unpinned, least recently used, gone

    # A reader inside get() holds the pin while it copies the chunk out.
    seen = []
    real_read = cache._read_hit

    def slow_read(h):
        if not seen:
            seen.append(h)
            # Room pressure while the reader of c is between pinning and reading.
            cache.get(_digest(a), lambda: a)
            cache.get(_digest(b), lambda: b)
            seen.append(cache.path_of("sha256:" + h).exists())
        return real_read(h)

    cache._read_hit = slow_read
    try:
        assert cache.get(_digest(c), lambda: pytest.fail("c is cached")) == c
    finally:
        del cache._read_hit
    assert seen[1] is True


def test_cache_survives_restart_and_drops_temp_files(tmp_path):
    root = tmp_path / "cache"
    cache = ChunkCache(root, 8 * MiB)
    blobs = [os.urandom(MiB // 2) for _ in range(4)]
    for x in blobs:
        cache.get(_digest(x), lambda x=x: x)
    stale = cache.path_of(_digest(blobs[0])).parent / ".tmp-deadbeef-1234"
    stale.write_bytes(b"half a chunk")
    again = ChunkCache(root, 8 * MiB)
    assert not stale.exists()
    assert len(again) == 4 and again.total_bytes == 4 * (MiB // 2)
    assert again.get(_digest(blobs[2]), lambda: pytest.fail("cached")) == blobs[2]
    # A smaller budget on restart evicts down to it.
    small = ChunkCache(root, MiB)
    assert small.total_bytes <= MiB


def test_corrupt_remote_bytes_give_eio_and_cache_nothing(lazy, layer, tmp_path):
    remote, cache, blob, server, root = _setup(lazy, layer, tmp_path)
    remote.mode = "corrupt"
    with pytest.raises(OSError) as info:
        (root / "etc" / "hostname").read_bytes()
    assert info.value.errno == errno.EIO
    assert len(cache) == 0 and cache.total_bytes == 0
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
    with pytest.raises(LayerCorrupt):
        blob.chunk(0)

    remote.mode = "ok"  # a good copy later reads fine: nothing bad was remembered
    assert (root / "etc" / "hostname").read_bytes() == b"sandbox\n"


@pytest.mark.parametrize("failure", ["down", "hang"])
def test_source_down_gives_eio_in_bounded_time_then_recovers(lazy, layer, tmp_path, failure):
    timeout = 1.0
    remote, cache, blob, server, root = _setup(lazy, layer, tmp_path, timeout=timeout)
    remote.mode = failure
    start = time.monotonic()
    with pytest.raises(OSError) as info:
        (root / "etc" / "motd").read_bytes()
    took = time.monotonic() - start
    assert info.value.errno == errno.EIO
    assert took < timeout + 2
    with pytest.raises(SourceUnavailable):
        blob.chunk(0)

    remote.mode = "ok"
    remote.release.set()
    assert (root / "etc" / "motd").read_bytes() == b"hello from a lazy layer\n" * 10


def test_restart_hands_the_fd_to_a_successor(lazy, layer, tmp_path):
    remote, cache, blob, server, root = _setup(lazy, layer, tmp_path)
    assert (root / "etc" / "hostname").read_bytes() == b"sandbox\n"
    mountpoint = server.mountpoint

    # Old daemon passes the live connection over a unix socket and stops.
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        send_fuse_fd(a, server)
        fd, where = recv_fuse_fd(b)
    assert where == mountpoint and os.path.ismount(mountpoint)

    # A new daemon with a fresh view of the same on-disk cache adopts it.
    cache2 = ChunkCache(tmp_path / "cache", 256 * MiB)
    assert len(cache2) == len(cache)
    successor = FuseServer.from_fd(fd, where)
    successor.add_blob(
        "data.blob", blob.size, LazyBlob(layer.index, cache2, remote.read_range).read
    )
    successor.start()
    lazy.servers.append(successor)

    before = len(remote.calls)
    assert (root / "etc" / "hostname").read_bytes() == b"sandbox\n"  # page cache or cache2
    assert len(remote.calls) == before
    assert _tree(root) == _tree(layer.src)


def test_crashed_daemon_requests_are_resent_to_the_successor(lazy, layer, tmp_path):
    remote, cache, blob, server, root = _setup(lazy, layer, tmp_path)
    mountpoint = server.mountpoint
    holder = os.dup(server.fd)  # what a supervisor keeps so the connection outlives the daemon
    lazy.fds.append(holder)
    remote.mode = "hang"

    result: list[bytes] = []
    reader = threading.Thread(
        target=lambda: result.append((root / "other").read_bytes()), daemon=True
    )
    reader.start()
    assert remote.entered.wait(5)  # the old daemon took the READ and is fetching
    server.abandon()  # ... and dies without answering
    lazy.servers.remove(server)
    remote.mode = "ok"
    remote.release.set()  # its fetch still lands in the shared cache
    time.sleep(0.2)
    assert reader.is_alive()  # the reader waits for a daemon instead of seeing zeros

    successor = FuseServer.from_fd(os.dup(holder), mountpoint)
    successor.add_blob("data.blob", blob.size, blob.read)
    successor.start()  # FUSE_NOTIFY_RESEND re-queues the lost READ
    lazy.servers.append(successor)
    reader.join(10)
    assert not reader.is_alive()
    assert result == [(layer.src / "other").read_bytes()]


def test_prefetch_warms_the_cache(lazy, layer, tmp_path):
    remote, cache, blob, server, root = _setup(lazy, layer, tmp_path)
    assert prefetch(blob) == len(layer.index.chunks)
    n = len(remote.calls)
    assert n == len(set(layer.index.chunks))
    assert _tree(root) == _tree(layer.src)
    assert len(remote.calls) == n  # every read was served from the cache


def test_chunk_index_round_trip(layer):
    idx = layer.index
    assert ChunkIndex.from_json(idx.to_json()) == idx
    assert idx.chunk_range(len(idx.chunks) - 1)[1] == idx.blob_size - (len(idx.chunks) - 1) * MiB
    data = layer.blob.read_bytes()
    assert idx.blob_digest == _digest(data)
    assert idx.chunks[0] == _digest(data[:MiB])
    with pytest.raises(LayerCorrupt):
        ChunkIndex(idx.blob_digest, idx.blob_size, idx.chunk_size, idx.chunks[:-1])


def test_readahead_fetches_following_chunks_in_background(lazy, layer, tmp_path):
    remote = lazy.remote(layer)
    cache = ChunkCache(tmp_path / "cache", 256 * MiB)
    blob = LazyBlob(layer.index, cache, remote.read_range, readahead=2)
    assert blob.read(0, 10) == layer.blob.read_bytes()[:10]
    for t in threading.enumerate():
        if t.name.startswith("prefetch-chunk-"):
            t.join(5)
    assert [layer.index.chunks[i] in cache for i in range(4)] == [True, True, True, False]
