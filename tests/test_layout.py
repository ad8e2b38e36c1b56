"""Profile-guided blob layout: the pure logic (permutations, index mapping, profiles) and, on
real parts, a catalog profiled, published to a shared source and run on demand by a node."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest

from dsec_core.catalog import parse_catalog
from dsec_core.config import NodeConfig
from dsec_core.errors import LayerCorrupt, UnknownEnvironment, UnknownLayer
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.lazy import ChunkCache, LazyBlob
from dsec_core.lazy.chunks import ChunkIndex
from dsec_core.lazy.layout import AccessTrace, ReadProfile, check_layout, plan_layout, write_packed
from dsec_core.lazy.split import LazyForm, compress_split, pack_split
from dsec_core.records import LayerRef
from dsec_core.testing import leftovers, make_busybox_rootfs

PAGE = 4096


def _apply(layout, data: bytes) -> bytes:
    """The physical blob a layout describes, built independently of write_packed."""
    out = bytearray(len(data))
    for logical, phys, n in layout:
        out[phys : phys + n] = data[logical : logical + n]
    return bytes(out)


@pytest.mark.parametrize("size", [PAGE * 10, PAGE * 10 + 123, 77, PAGE * 300 + 1])
def test_plan_layout_is_a_permutation_with_read_pages_first(size):
    rng = random.Random(size)
    ranges = [(rng.randrange(0, size), rng.randint(1, 3 * PAGE)) for _ in range(12)]
    ranges.append((size + 10 * PAGE, PAGE))  # past the end: ignored
    layout, hot = plan_layout(size, ranges)
    check_layout(layout, size)  # one-to-one on both sides
    # the first read page is stored first, then the next new page, ...
    first_pages = []
    for off, n in ranges:
        for p in range(off // PAGE, min(-(-size // PAGE), -(-(off + n) // PAGE))):
            if p not in first_pages:
                first_pages.append(p)
    last = -(-size // PAGE) - 1
    expect_front = [p for p in first_pages if not (size % PAGE and p == last)]
    phys_of = {}
    for logical, phys, n in layout:
        for k in range(-(-n // PAGE)):
            phys_of[logical // PAGE + k] = phys // PAGE + k
    assert [phys_of[p] for p in expect_front] == list(range(len(expect_front)))
    if size % PAGE:  # a short last page stays last, or it would leave a hole mid-blob
        assert phys_of[last] == last
    assert hot == min(size, len(first_pages) * PAGE)  # the prefix the read pages fill


def test_layout_round_trips_through_the_index_and_lazy_blob(tmp_path):
    rng = random.Random(1)
    data = rng.randbytes(PAGE * 700 + 999)
    ranges = [(rng.randrange(len(data)), rng.randint(1, 40_000)) for _ in range(30)]
    layout, _ = plan_layout(len(data), ranges)
    (tmp_path / "logical.blob").write_bytes(data)
    write_packed(tmp_path / "logical.blob", layout, tmp_path / "packed.blob")
    packed = (tmp_path / "packed.blob").read_bytes()
    assert packed == _apply(layout, data) and packed != data
    stored = ChunkIndex.build(tmp_path / "packed.blob", 64 << 10)
    logical_digest = "sha256:" + hashlib.sha256(data).hexdigest()
    index = ChunkIndex(
        stored.blob_digest,
        stored.blob_size,
        stored.chunk_size,
        stored.chunks,
        layout,
        logical_digest,
    )
    assert ChunkIndex.from_json(index.to_json()) == index
    for _ in range(200):
        off = rng.randrange(len(data))
        n = rng.randint(1, 300_000)
        got = b"".join(packed[p : p + k] for p, k in index.physical(off, n))
        assert got == data[off : off + n]

    reads = []
    blob = LazyBlob(
        index,
        ChunkCache(tmp_path / "cache", 1 << 30),
        lambda off, n: reads.append(off) or packed[off : off + n],
        trace=AccessTrace(),
    )
    for off, n in ranges:
        assert blob.read(off, n) == data[off : off + n]
    # the profile's reads were packed to the front: they need only the first few chunks
    hot = sum(-(-n // PAGE) + 1 for _, n in ranges) * PAGE
    assert max(reads) < hot + index.chunk_size
    # and the trace recorded the logical pages, so re-profiling a packed blob works
    assert blob.trace.ranges()[0][0] == ranges[0][0] // PAGE * PAGE


def test_bad_layouts_are_layer_corrupt():
    size = PAGE * 4
    good, _ = plan_layout(size, [(PAGE * 2, PAGE)])
    assert good[0] == (0, PAGE, 2 * PAGE)
    for bad in (
        [(0, 0, PAGE * 3)],  # too short
        [(0, 0, PAGE * 2), (PAGE * 2, PAGE, PAGE * 2)],  # stored ranges overlap
        [(0, 0, PAGE * 4), (0, 0, PAGE)],
    ):  # a logical range twice
        with pytest.raises(LayerCorrupt):
            check_layout(tuple(bad), size)
        with pytest.raises(LayerCorrupt):
            ChunkIndex(
                "sha256:" + "a" * 64,
                size,
                size,
                ("sha256:" + "b" * 64,),
                tuple(bad),
                "sha256:" + "c" * 64,
            )
    with pytest.raises(LayerCorrupt, match="logical digest"):
        ChunkIndex("sha256:" + "a" * 64, size, size, ("sha256:" + "b" * 64,), good)


def test_lazy_form_versions():
    index = ChunkIndex("sha256:" + "a" * 64, PAGE * 4, PAGE * 4, ("sha256:" + "b" * 64,))
    plain = LazyForm("sha256:" + "d" * 64, "sha256:" + "e" * 64, 10, index)
    assert json.loads(plain.to_json())["version"] == 1  # older nodes still read plain forms
    packed = LazyForm(
        plain.layer_digest,
        plain.meta_digest,
        10,
        ChunkIndex(
            index.blob_digest,
            index.blob_size,
            index.chunk_size,
            index.chunks,
            plan_layout(PAGE * 4, [(PAGE * 3, 1)])[0],
            "sha256:" + "c" * 64,
        ),
    )
    assert json.loads(packed.to_json())["version"] == 2
    assert LazyForm.from_json(packed.to_json()) == packed
    assert LazyForm.from_json(plain.to_json()) == plain
    doc = json.loads(packed.to_json())
    doc["version"] = 99
    with pytest.raises(LayerCorrupt):
        LazyForm.from_json(json.dumps(doc))


def test_trace_and_profiles():
    trace = AccessTrace()
    trace.touch(PAGE * 5, 10)
    trace.touch(PAGE * 6 - 1, 2)  # spans pages 5 and 6
    trace.touch(0, PAGE)
    trace.touch(PAGE * 5, PAGE)  # again: no change in order
    trace.touch(0, 0)
    assert trace.ranges() == [(PAGE * 5, PAGE * 2), (0, PAGE)]
    a = ReadProfile(
        "sha256:" + "1" * 64, "sha256:" + "2" * 64, PAGE * 10, tuple(trace.ranges()), "first"
    )
    assert ReadProfile.from_json(a.to_json()) == a
    assert a.read_bytes == PAGE * 3
    b = ReadProfile(a.layer_digest, a.blob_digest, a.blob_size, ((PAGE * 9, PAGE), (0, PAGE)), "b")
    merged = a.merged(b)
    assert merged.ranges == ((PAGE * 5, PAGE * 2), (0, PAGE), (PAGE * 9, PAGE))
    assert merged.workload == "first, b"
    with pytest.raises(LayerCorrupt):
        a.merged(ReadProfile(a.layer_digest, "sha256:" + "3" * 64, a.blob_size, ()))
    for text in ("{", json.dumps({"version": 7}), json.dumps({"version": 1, "ranges": 3})):
        with pytest.raises(LayerCorrupt):
            ReadProfile.from_json(text)


def test_pack_split_refuses_a_profile_of_another_blob(tmp_path):
    data = random.Random(2).randbytes(PAGE * 8)
    (tmp_path / "data.blob").write_bytes(data)
    index = ChunkIndex.build(tmp_path / "data.blob", PAGE * 2)
    form = LazyForm("sha256:" + "d" * 64, "sha256:" + "e" * 64, 10, index)
    other = ReadProfile(form.layer_digest, "sha256:" + "f" * 64, len(data), ((0, PAGE),))
    with pytest.raises(LayerCorrupt):
        pack_split(form, tmp_path / "data.blob", other)
    with pytest.raises(LayerCorrupt, match="is of layer"):
        pack_split(
            form,
            tmp_path / "data.blob",
            ReadProfile("sha256:" + "a" * 64, index.blob_digest, len(data), ((0, PAGE),)),
        )
    ok = ReadProfile(form.layer_digest, index.blob_digest, len(data), ((PAGE * 7, PAGE),))
    packed_form, packed = pack_split(form, tmp_path / "data.blob", ok)
    assert packed.read_bytes()[:PAGE] == data[PAGE * 7 :]
    assert packed_form.index.logical_digest == index.blob_digest
    assert packed_form.meta_digest == form.meta_digest
    assert packed_form.index.hot == PAGE and packed_form.index.hot_chunks == range(1)
    assert ChunkIndex.from_json(packed_form.index.to_json()) == packed_form.index
    with pytest.raises(LayerCorrupt, match="hot region"):
        ChunkIndex(index.blob_digest, index.blob_size, index.chunk_size, index.chunks, hot=PAGE)
    with pytest.raises(LayerCorrupt, match="hot region"):
        i = packed_form.index
        ChunkIndex(
            i.blob_digest,
            i.blob_size,
            i.chunk_size,
            i.chunks,
            i.layout,
            i.logical_digest,
            hot=i.blob_size + 1,
        )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_store_keeps_profiles_with_their_layer(tmp_path):
    store = LayerStore(tmp_path / "layers")
    info = build_layer(
        make_busybox_rootfs(tmp_path / "rootfs"),
        name="p-base",
        version="1",
        kind="base",
        store=store,
    )
    assert store.load_profile(info) is None
    profile = ReadProfile(info.digest, "sha256:" + "2" * 64, PAGE, ((0, PAGE),))
    store.save_profile(profile)
    assert store.load_profile(info) == profile
    with pytest.raises(UnknownLayer):
        store.save_profile(ReadProfile("sha256:" + "9" * 64, "sha256:" + "2" * 64, PAGE, ()))
    store.profile_path(info.digest).write_text("{broken")
    with pytest.raises(LayerCorrupt):
        store.load_profile(info)
    store.remove(info.ref)
    assert not store.profile_path(info.digest).exists()


# --- end to end on real parts ----------------------------------------------------------------

FILES = 48
FILE_BYTES = 256 << 10
READ = [i for i in range(FILES) if i % 6 == 0]  # 8 files, 1.5 MiB apart in directory order

CATALOG = {
    "name": "scatter",
    "environments": [
        {
            "name": "scatter-env",
            "base": "sc-base@1",
            "workspaces": ["sc-ws@1"],
            "workdir": "/workspace",
        }
    ],
    "tasks": [
        {
            "name": "read-some",
            "environment": "scatter-env",
            "timeout": 60,
            "reward": "exit_code",
            "command": "for i in "
            + " ".join(f"{i:02d}" for i in READ)
            + "; do head -c 3000 f$i.bin | md5sum; done",
        }
    ],
}


def dsec_cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSEC_HOME=os.fspath(home))
    return subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def author(tmp_path):
    """An author's home with a busybox base and a workspace of 48 random 256 KiB files."""
    home = Path(tempfile.mkdtemp(prefix="dsec-layout-"))
    store = LayerStore(home / "layers")
    build_layer(
        make_busybox_rootfs(tmp_path / "rootfs"),
        name="sc-base",
        version="1",
        kind="base",
        store=store,
    )
    ws = tmp_path / "ws" / "workspace"
    ws.mkdir(parents=True)
    rng = random.Random(5)
    for i in range(FILES):
        (ws / f"f{i:02d}.bin").write_bytes(rng.randbytes(FILE_BYTES))
    build_layer(tmp_path / "ws", name="sc-ws", version="1", kind="workspace", store=store)
    (tmp_path / "scatter.json").write_text(json.dumps(CATALOG))
    yield home, store, tmp_path / "scatter.json", ws
    shutil.rmtree(home, ignore_errors=True)


async def _run_on_demand(
    shared: Path, ws: Path, backend: str | None = None
) -> tuple[int, int, int, int]:
    """A fresh node runs the task from ``shared`` on demand (in a sandbox of ``backend``, by
    default the node's): (chunks of the workspace fetched by the end of the task, chunk size,
    chunks warmed before the task read anything, hot chunks the index names). Every file the
    sandbox reads must match the original."""
    from dsec_core.catalog import CatalogStore
    from dsec_core.node.node import Node
    from dsec_core.records import SandboxSpec

    home = Path(tempfile.mkdtemp(prefix="dsec-layout-node-"))
    config = NodeConfig(home=home, layer_sources=(f"posix:{shared}",), layer_linger=0.0)
    config.ensure_dirs()
    CatalogStore(config.catalog_dir).save(
        parse_catalog(CATALOG, check_sources=False, check_layers=False)
    )
    node = Node(config)
    await node.open()
    try:
        sb = await node.create(
            SandboxSpec(environment="scatter-env", backend=backend, memory="256M")
        )
        for warmer in list(node.lazy_layers._warmers):
            warmer.join(30)
        ws_blob = next(
            b
            for b in node.lazy_layers.blobs.values()
            if b.index.blob_size > FILES * FILE_BYTES // 2
        )
        warmed = sum(1 for c in ws_blob.index.chunks if c in node.lazy_layers.cache)
        r = await node.exec(sb.id, CATALOG["tasks"][0]["command"])
        want = [hashlib.md5((ws / f"f{i:02d}.bin").read_bytes()[:3000]).hexdigest() for i in READ]
        assert [line.split()[0] for line in r.stdout.decode().splitlines()] == want
        fetched = sum(1 for c in ws_blob.index.chunks if c in node.lazy_layers.cache)
        chunk = ws_blob.index.chunk_size
        # then every byte of every file reads back right through the packed layout
        r = await node.exec(sb.id, "md5sum f*.bin")
        sums = {line.split()[1]: line.split()[0] for line in r.stdout.decode().splitlines()}
        assert sums == {
            f"f{i:02d}.bin": hashlib.md5((ws / f"f{i:02d}.bin").read_bytes()).hexdigest()
            for i in range(FILES)
        }
    finally:
        await node.close(kill_all=True)
        left = leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
    assert not any(left.values()), left
    return fetched, chunk, warmed, len(ws_blob.index.hot_chunks)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs")
async def test_profiled_layers_fetch_fewer_chunks_and_read_the_same(author, tmp_path):
    home, store, catalog_file, ws = author
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    plain.mkdir()
    profiled.mkdir()

    out = dsec_cli(home, "catalog", "publish", str(catalog_file), "--to", f"posix:{plain}")
    assert out.returncode == 0, out.stderr
    assert "read-profile order" not in out.stdout

    out = dsec_cli(home, "catalog", "profile", str(catalog_file))
    assert out.returncode == 0, out.stderr
    assert "profiled sc-ws@1" in out.stdout and "ran read-some (exit 0)" in out.stdout
    ws_info = store.resolve("sc-ws@1")
    profile = store.load_profile(ws_info)
    assert profile is not None and profile.workload == "catalog scatter: read-some"
    assert profile.read_bytes < ws_info.size / 4  # the task read a few pages of 8 files
    assert not list(Path(tempfile.gettempdir()).glob("dsec-profile-*"))  # cleaned up
    listed = {
        row["name"]: row["read_profile"]
        for row in json.loads(dsec_cli(home, "layer", "ls", "--json").stdout)
    }
    assert listed["sc-ws"]["read_bytes"] == profile.read_bytes
    assert listed["sc-ws"]["workload"] == "catalog scatter: read-some"
    table = dsec_cli(home, "layer", "ls").stdout.splitlines()
    assert "PROFILED" in table[0]
    assert f"{profile.read_bytes / profile.blob_size:.1%}" in next(
        r for r in table if r.startswith("sc-ws@1")
    )

    out = dsec_cli(home, "catalog", "publish", str(catalog_file), "--to", f"posix:{profiled}")
    assert out.returncode == 0, out.stderr
    assert "sc-ws@1" in out.stdout and "read-profile order" in out.stdout

    fetched_plain, chunk, warmed_plain, hot_plain = await _run_on_demand(plain, ws)
    fetched_profiled, _, warmed, hot = await _run_on_demand(profiled, ws)
    # directory order: the 8 files lie in different 1 MiB chunks; read order: one or two
    assert fetched_plain >= len(READ) - 1
    assert fetched_profiled <= -(-profile.read_bytes // chunk) + 1 < fetched_plain
    # the profiled layer's hot chunks were fetched on mount, before the task read anything
    assert (warmed_plain, hot_plain) == (0, 0)
    assert warmed == hot == -(-profile.read_bytes // chunk) >= 1
    assert fetched_profiled <= warmed + 1


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="QEMU is not installed")
async def test_a_microvm_reads_on_demand_layers_chunk_by_chunk(author, tmp_path):
    """A microVM gets an on-demand layer as its metadata image and data blob (two disks, one
    multi-device EROFS in the guest), so its task reads, and its profile records, only the
    pages it touches; the guest then fetches few chunks of the profiled layer. Before, every
    layer of a microVM was unpacked through the node (every page read, every chunk fetched):
    the default catalog's microVM task made every profile whole, and profiles bought nothing
    in ``bench/layers.py`` (24.2% of the image fetched with them, 24.0% without)."""
    home, store, _, ws = author
    doc = json.loads(json.dumps(CATALOG))
    doc["environments"][0]["backend"] = "microvm"
    (tmp_path / "scatter-vm.json").write_text(json.dumps(doc))
    out = dsec_cli(home, "catalog", "profile", str(tmp_path / "scatter-vm.json"))
    assert out.returncode == 0, out.stderr
    ws_info = store.resolve("sc-ws@1")
    profile = store.load_profile(ws_info)
    assert profile is not None and profile.read_bytes < ws_info.size / 4
    profiled = tmp_path / "profiled"
    profiled.mkdir()
    out = dsec_cli(
        home, "catalog", "publish", str(tmp_path / "scatter-vm.json"), "--to", f"posix:{profiled}"
    )
    assert out.returncode == 0 and "read-profile order" in out.stdout, out.stderr
    fetched, chunk, warmed, hot = await _run_on_demand(profiled, ws, backend="microvm")
    assert warmed == hot == -(-profile.read_bytes // chunk) >= 1
    assert fetched <= warmed + 1 < -(-(FILES * FILE_BYTES) // chunk)


def test_profile_bad_input(tmp_path):
    home = Path(tempfile.mkdtemp(prefix="dsec-layout-bad-"))
    try:
        (tmp_path / "scatter.json").write_text(json.dumps(CATALOG))
        out = dsec_cli(home, "catalog", "profile", "no-such-catalog")
        assert out.returncode == 1 and "Error:" in out.stderr and "Traceback" not in out.stderr
        from dsec_core.read_profiles import profile_catalog

        cat = parse_catalog(CATALOG, check_sources=False, check_layers=False)
        with pytest.raises(UnknownEnvironment, match="no task 'nope'"):
            profile_catalog(cat, NodeConfig(home=home), ["nope"])
        with pytest.raises(UnknownLayer):  # layers not built here
            profile_catalog(cat, NodeConfig(home=home))
        assert not list(Path(tempfile.gettempdir()).glob("dsec-profile-*"))
    finally:
        shutil.rmtree(home, ignore_errors=True)


# --- chunk compression ----------------------------------------------------------------------


def _compressed(tmp_path, data: bytes, compression: str, chunk: int = 64 << 10):
    (tmp_path / "data.blob").write_bytes(data)
    index = ChunkIndex.build(tmp_path / "data.blob", chunk)
    form = LazyForm("sha256:" + "d" * 64, "sha256:" + "e" * 64, 10, index)
    return index, compress_split(form, tmp_path / "data.blob", compression)


@pytest.mark.parametrize("compression", ["zstd", "zlib"])
def test_compressed_chunks_read_back_and_shrink(tmp_path, compression):
    rng = random.Random(4)
    text = b"".join(
        rng.choice((b"import os\n", b"def f(x):\n", b"    return x\n")) for _ in range(30_000)
    )
    data = text + rng.randbytes(200_000) + text[:77_777]  # compressible, random, compressible
    index, (form, path) = _compressed(tmp_path, data, compression)
    stored = path.read_bytes()
    assert form.index.compression == compression
    assert form.blob_size == len(stored) < len(data) / 2
    assert form.index.blob_digest == "sha256:" + hashlib.sha256(stored).hexdigest()
    assert form.index.chunks == index.chunks  # digests of what the cache keeps: uncompressed
    assert form.index.logical_digest == index.blob_digest  # profiles still match
    # random chunks do not shrink and are stored as they are
    assert any(
        form.index.stored_range(i)[1] == form.index.chunk_range(i)[1]
        for i in range(len(index.chunks))
    )
    assert LazyForm.from_json(form.to_json()) == form
    assert json.loads(form.to_json())["version"] == 2
    blob = LazyBlob(
        form.index, ChunkCache(tmp_path / "cache", 1 << 30), lambda off, n: stored[off : off + n]
    )
    for off, n in ((0, 10), (100_000, 300_000), (len(data) - 5, 50), (0, len(data))):
        assert blob.read(off, n) == data[off : off + n]
    assert compress_split(form, path) == (form, path)  # already compressed: unchanged


def _bomb(compression: str, size: int, n: int) -> bytes:
    """``n`` bytes of a valid stream that inflates to ``size`` bytes."""
    if compression == "zstd":
        import zstandard

        # no content size in the header: the decoder must bound the output by itself
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * size)
    else:
        frame = zlib.compress(b"x" * size, 9)
    assert len(frame) <= n
    return frame.ljust(n, b"\0") if compression == "zlib" else frame + b"\0" * (n - len(frame))


@pytest.mark.parametrize("compression", ["zstd", "zlib"])
def test_damaged_compressed_chunks_are_layer_corrupt(tmp_path, compression):
    rng = random.Random(6)
    data = b"".join(rng.choice((b"dsec ", b"sandbox ", b"layer\n")) for _ in range(80_000))
    _, (form, path) = _compressed(tmp_path, data, compression)
    stored = bytearray(path.read_bytes())
    index = form.index
    off, n = index.stored_range(1)
    piece = bytes(stored[off : off + n])
    with pytest.raises(LayerCorrupt, match="expected"):
        index.decode(1, piece[:-1])  # truncated
    flipped = bytearray(piece)
    flipped[len(flipped) // 2] ^= 0xFF
    with pytest.raises(LayerCorrupt):
        index.decode(1, bytes(flipped))
    with pytest.raises(LayerCorrupt):  # inflates past the chunk: refused, memory stays bounded
        index.decode(1, _bomb(compression, index.chunk_size * 64, n))
    # through the cache, a damaged stored chunk never reaches a reader as data
    stored[off + n // 2] ^= 0xFF
    blob = LazyBlob(
        index, ChunkCache(tmp_path / "cache", 1 << 30), lambda o, k: bytes(stored[o : o + k])
    )
    with pytest.raises(LayerCorrupt):
        blob.read(index.chunk_range(1)[0], 10)
    assert blob.read(0, 10) == data[:10]  # other chunks are fine


def test_bad_compressed_indexes_are_layer_corrupt():
    size, cs = PAGE * 4, PAGE * 2
    chunks = ("sha256:" + "b" * 64, "sha256:" + "c" * 64)
    kw = dict(logical_digest="sha256:" + "c" * 64)
    ChunkIndex(
        "sha256:" + "a" * 64, size, cs, chunks, compression="zlib", stored=((0, 10), (10, 20)), **kw
    )  # fine
    for compression, stored in (
        ("zlib", ((0, 10), (11, 20))),  # gap
        ("zlib", ((0, 10),)),  # a chunk missing
        ("zlib", ((0, cs + 1), (cs + 1, 5))),  # bigger than the chunk
        ("lz77", ((0, 10), (10, 20))),  # unknown
        ("", ((0, 10), (10, 20))),
    ):  # ranges but no compression
        with pytest.raises(LayerCorrupt):
            ChunkIndex(
                "sha256:" + "a" * 64, size, cs, chunks, compression=compression, stored=stored, **kw
            )


def test_publish_compression_setting(monkeypatch):
    from dsec_core.errors import InvalidSpec
    from dsec_core.sources.base import publish_compression

    monkeypatch.delenv("DSEC_CHUNK_COMPRESSION", raising=False)
    assert publish_compression() == "zstd"
    monkeypatch.setenv("DSEC_CHUNK_COMPRESSION", "zlib")
    assert publish_compression() == "zlib"
    monkeypatch.setenv("DSEC_CHUNK_COMPRESSION", "none")
    assert publish_compression() == ""
    monkeypatch.setenv("DSEC_CHUNK_COMPRESSION", "brotli")
    with pytest.raises(InvalidSpec, match="DSEC_CHUNK_COMPRESSION"):
        publish_compression()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs")
def test_a_stale_profile_publishes_in_original_order(author, tmp_path, caplog):
    """A profile recorded on another split of the layer (say, at another chunk size, where
    dedupe laid the blob out differently) cannot be applied: the layer is published anyway,
    in directory order, with a warning."""
    from dsec_core.plugins import open_source
    from dsec_core.sources.transfer import push_layer

    _, store, _, _ = author
    info = store.resolve("sc-ws@1")
    store.save_profile(ReadProfile(info.digest, "sha256:" + "0" * 64, info.size, ((0, PAGE),)))
    (tmp_path / "shared").mkdir()
    dest = open_source(f"posix:{tmp_path / 'shared'}")
    t = push_layer("sc-ws@1", dest, store)
    assert t.moved and not t.profiled
    form = dest.lazy_form(dest.resolve(LayerRef.parse("sc-ws@1")))
    assert form.index.layout == () and not form.index.hot
    assert form.index.compression == "zstd"
    assert "in its original order" in caplog.text
