"""The lazy (split) form of layers: ``split_image`` keeps the tree, and the posix, S3 and OCI
sources publish it on push, hand it back (``lazy_form``, verified ``fetch_meta``, raw
``read_blob`` ranges), and serve a real on-demand mount that reads only what it touches."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
import uuid
from pathlib import Path

import pytest

from dsec_core.errors import LayerBuildError, LayerCorrupt, ToolError, UnknownLayer
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.lazy import ChunkCache, FuseServer, LazyBlob, mount_lazy_erofs
from dsec_core.lazy.split import LazyForm, compress_split, split_image
from dsec_core.linux.mounts import mount_erofs_file, mounted_under, unmount
from dsec_core.records import LayerInfo
from dsec_core.sources.base import BlobStoreSource, LayerSource
from dsec_core.testing.fixtures import leaves_no_mounts_or_threads

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting EROFS images needs root"),
    pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs"),
]

MiB = 1 << 20
SMALL = b"hello from a lazy layer\n"


class Mounts:
    """Every EROFS mount and FUSE server a test made; all removed at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.erofs: list[Path] = []
        self.servers: list[FuseServer] = []
        self._n = 0

    def _dir(self, kind: str) -> Path:
        self._n += 1
        d = self.tmp / f"mnt-{kind}{self._n}"
        d.mkdir()
        return d

    def image(self, image: Path) -> Path:
        target = self._dir("whole")
        mount_erofs_file(image, target, None)
        self.erofs.append(target)
        return target

    def lazy(self, meta: Path, blob: Path) -> Path:
        target = self._dir("lazy")
        mount_lazy_erofs(meta, blob, target)
        self.erofs.append(target)
        return target

    def serve(self, name: str, blob: LazyBlob) -> Path:
        server = FuseServer()
        server.add_blob(name, blob.size, blob.read)
        server.mount(self._dir("fuse"))
        self.servers.append(server)
        return server.path_of(name)

    def teardown(self) -> None:
        for target in reversed(self.erofs):
            unmount(target)
        for server in reversed(self.servers):
            server.close()


@pytest.fixture
def mounts(tmp_path):
    rec = Mounts(tmp_path)
    with leaves_no_mounts_or_threads(tmp_path, "fuse-"):
        try:
            yield rec
        finally:
            rec.teardown()


def _make_tree(root: Path) -> Path:
    big = os.urandom(3 * MiB + 4321)
    (root / "data").mkdir(parents=True)
    (root / "data" / "big.bin").write_bytes(big)
    (root / "data" / "big-copy.bin").write_bytes(big)  # its chunks are stored once
    (root / "data" / "other.bin").write_bytes(os.urandom(2 * MiB + 99))
    (root / "etc").mkdir()
    (root / "etc" / "hello.txt").write_bytes(SMALL)
    (root / "etc" / "empty").write_bytes(b"")
    os.symlink("etc/hello.txt", root / "hello-link")
    os.symlink("/nowhere/at/all", root / "dangling")
    (root / "home" / "user").mkdir(parents=True)
    owned = root / "home" / "user" / "owned"
    owned.write_bytes(b"mine\n")
    os.chown(owned, 1234, 1234)
    os.chown(root / "home" / "user", 1234, 1234)
    (root / "bin").mkdir()
    suid = root / "bin" / "suid"
    suid.write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(suid, 0o4755)
    os.utime(root / "etc" / "hello.txt", (1_600_000_000, 1_600_000_000))
    return root


@pytest.fixture(scope="module")
def layer(tmp_path_factory) -> tuple[LayerInfo, Path]:
    """A real layer built with owners kept (``all_root=False``) and its monolithic image."""
    if os.geteuid() != 0 or not shutil.which("mkfs.erofs"):
        pytest.skip("building EROFS layers needs root and mkfs.erofs")
    tmp = tmp_path_factory.mktemp("split-layer")
    store = LayerStore(tmp / "store")
    info = build_layer(
        _make_tree(tmp / "src"),
        name="lazyws",
        version="1",
        kind="workspace",
        store=store,
        all_root=False,
    )
    return info, store.image_path(info)


def _snapshot(root: Path) -> dict[str, tuple]:
    """Everything a sandbox could observe of a tree: names, types, modes, owners, mtimes,
    symlink targets, and file contents (by digest)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                what: object = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                what = None
            out[str(p.relative_to(root))] = (
                st.st_mode,
                st.st_uid,
                st.st_gid,
                st.st_mtime_ns,
                st.st_nlink,
                what,
            )
    return out


# --- split_image ---------------------------------------------------------------------------
def test_split_mounts_as_the_same_tree(layer, mounts, tmp_path):
    info, image = layer
    form, meta, blob = split_image(image, tmp_path / "split")
    assert (meta, blob) == (tmp_path / "split" / "meta.erofs", tmp_path / "split" / "data.blob")
    assert form.layer_digest == info.digest
    assert form.meta_size == meta.stat().st_size
    assert form.meta_digest == "sha256:" + hashlib.sha256(meta.read_bytes()).hexdigest()
    assert form.index.blob_size == blob.stat().st_size
    assert form.index.blob_digest == "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()
    assert form.index.chunk_size == MiB
    # the duplicated 3 MiB file is stored once; metadata is a small fraction
    assert 5 * MiB < form.index.blob_size < 7 * MiB
    assert form.meta_size < 64 * 1024
    assert [p.name for p in (tmp_path / "split").iterdir()] in (
        ["meta.erofs", "data.blob"],
        ["data.blob", "meta.erofs"],
    )

    whole = _snapshot(mounts.image(image))
    lazy = _snapshot(mounts.lazy(meta, blob))
    assert lazy == whole
    assert whole["home/user/owned"][1:3] == (1234, 1234)
    assert stat.S_IMODE(whole["bin/suid"][0]) == 0o4755
    assert whole["hello-link"][-1] == "etc/hello.txt"
    assert whole["etc/hello.txt"][3] == 1_600_000_000 * 10**9


def test_split_is_reproducible(layer, tmp_path):
    _info, image = layer
    a, _, _ = split_image(image, tmp_path / "a")
    b, meta, blob = split_image(image, tmp_path / "b", chunk_size=MiB)
    assert a == b  # every node that splits an image agrees on the digests


def test_split_failures_leave_nothing_behind(layer, tmp_path, monkeypatch):
    _info, image = layer
    junk = tmp_path / "junk.erofs"
    junk.write_bytes(os.urandom(64 * 1024))
    out = tmp_path / "out"
    with pytest.raises(LayerBuildError):
        split_image(junk, out)
    assert list(out.iterdir()) == []
    with pytest.raises(LayerBuildError):
        split_image(image, out, chunk_size=3000)
    # mkfs.erofs failing after the image was mounted: unmounted again, out_dir untouched
    (out / "keep").write_text("not ours")
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    with pytest.raises(ToolError) as e:
        split_image(image, out)
    assert e.value.command and e.value.command[0] == "mkfs.erofs"
    assert [p.name for p in out.iterdir()] == ["keep"]
    assert mounted_under(tmp_path) == []


def test_lazy_form_json_round_trip(layer, tmp_path):
    _info, image = layer
    form, _, _ = split_image(image, tmp_path / "s")
    assert LazyForm.from_json(form.to_json()) == form
    assert LazyForm.from_json(form.to_json().encode()) == form
    for bad in ("not json", "{}", '{"version": 99}', "[]"):
        with pytest.raises(LayerCorrupt):
            LazyForm.from_json(bad)


def test_base_class_defaults_offer_whole_images_only(layer, tmp_path):
    class Plain(LayerSource):
        scheme = "plain"

        def resolve(self, ref):
            return None

        def list(self):
            return []

        def image_path(self, info):
            raise NotImplementedError

    info, image = layer
    form, _, _ = split_image(image, tmp_path / "s")
    src = Plain("x", cache_dir=tmp_path / "cache")
    assert src.lazy_form(info) is None
    with pytest.raises(UnknownLayer):
        src.fetch_meta(form)
    with pytest.raises(UnknownLayer):
        src.read_blob(form.index.blob_digest, 0, 10)


# --- sources -------------------------------------------------------------------------------
class Harness:
    """One kind of source: how to open it, count what a push uploads, and damage a blob."""

    def __init__(self, kind: str, make, damage) -> None:
        self.kind = kind
        self._make = make
        self.damage = damage  # damage(source, digest): flip a byte of the stored blob (again: undo)

    def open(self, cache: Path) -> LayerSource:
        return self._make(cache)


def _count_uploads(source: LayerSource) -> list[str]:
    """Record every write a push makes: keys for blob stores, POST/PUT for a registry."""
    seen: list[str] = []
    if isinstance(source, BlobStoreSource):
        write = source._write

        def counted(key, data):
            seen.append(key)
            return write(key, data)

        source._write = counted  # type: ignore[method-assign]
    else:
        request = source.client.do_request

        def counted_request(url, method="GET", *a, **kw):
            if method in ("POST", "PUT", "PATCH"):
                seen.append(f"{method} {url.split('?')[0]}")
            return request(url, method, *a, **kw)

        source.client.do_request = counted_request  # type: ignore[method-assign]
    return seen


@pytest.fixture(scope="module")
def s3_server():
    pytest.importorskip("boto3")
    pytest.importorskip("dsec_layer_s3")
    from s3server import running_s3_server

    with running_s3_server(buckets=("dsec",)) as s:
        yield s


@pytest.fixture(scope="module")
def registry():
    pytest.importorskip("dsec_layer_oci")
    from oci_registry import local_registry, registry_binary

    if registry_binary() is None:
        pytest.skip("docker-registry is not installed")
    with local_registry() as reg:
        yield reg
    assert reg.process.poll() is not None and not reg.storage.exists()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


@pytest.fixture(params=["posix", "s3", "oci"])
def harness(request, tmp_path, monkeypatch) -> Harness:
    if request.param == "posix":
        from dsec_layer_posix import PosixLayerSource

        shared = tmp_path / "shared-fs"
        shared.mkdir()
        return Harness(
            "posix",
            lambda cache: PosixLayerSource(str(shared), cache_dir=cache),
            lambda src, digest: _flip(shared / src.blob_key(digest)),
        )
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        from dsec_layer_s3 import S3LayerSource

        location = server.url("dsec", f"t-{uuid.uuid4().hex[:10]}").removeprefix("s3://")

        def damage_s3(src, digest):
            key = src.blob_key(digest)
            data = bytearray(src._read(key))
            data[len(data) // 2] ^= 0xFF
            src._write(key, bytes(data))

        return Harness("s3", lambda cache: S3LayerSource(location, cache_dir=cache), damage_s3)
    reg = request.getfixturevalue("registry")
    from dsec_layer_oci import OciLayerSource

    prefix = f"t{uuid.uuid4().hex[:8]}"
    return Harness(
        "oci",
        lambda cache: OciLayerSource(f"{reg.address}/{prefix}?insecure=1", cache_dir=cache),
        lambda src, digest: _flip(reg.blob_file(digest)),
    )


@pytest.fixture(scope="module")
def local_split(layer, tmp_path_factory) -> tuple[LazyForm, Path, Path]:
    """What a source publishes for the layer: its split form, chunks compressed."""
    _info, image = layer
    form, meta, blob = split_image(image, tmp_path_factory.mktemp("local-split"))
    form, blob = compress_split(form, blob)
    return form, meta, blob


def test_push_publishes_the_lazy_form_once(harness, layer, local_split, tmp_path):
    info, image = layer
    want, _, _ = local_split
    src = harness.open(tmp_path / "cache")
    assert src.lazy_form(info) is None  # nothing pushed yet
    uploads = _count_uploads(src)
    assert src.push(info, image) is True
    assert len(uploads) >= 4  # image, metadata image, data blob, form/index, ...
    form = src.lazy_form(info)
    assert form == want
    assert harness.open(tmp_path / "cache2").lazy_form(info) == want  # a fresh client agrees

    uploads.clear()
    assert src.push(info, image) is False
    assert uploads == []  # the same layer again: nothing uploaded

    # the same image under another version: only its name record goes up, no second split
    again = LayerInfo(
        name=info.name,
        version="2",
        kind=info.kind,
        digest=info.digest,
        size=info.size,
        created=info.created,
        source=info.source,
    )
    assert src.push(again, image) is True
    assert len(uploads) == 1, uploads
    assert src.lazy_form(again) == want


def test_fetch_meta_is_verified(harness, layer, local_split, tmp_path):
    info, image = layer
    _, meta, _ = local_split
    src = harness.open(tmp_path / "cache")
    src.push(info, image)
    form = src.lazy_form(info)
    path = src.fetch_meta(form)
    assert path.read_bytes() == meta.read_bytes()
    assert path.parent == tmp_path / "cache"
    assert src.fetch_meta(form) == path  # cached

    harness.damage(src, form.meta_digest)
    try:
        fresh = harness.open(tmp_path / "cache-b")
        form_b = fresh.lazy_form(info)
        with pytest.raises(LayerCorrupt):
            fresh.fetch_meta(form_b)
        assert not any((tmp_path / "cache-b").glob("*.erofs"))
    finally:
        # Flipping the byte back: the registry keeps one copy of a blob for every repository,
        # and later tests in this module push the same layer.
        harness.damage(src, form.meta_digest)


def test_read_blob_returns_exact_ranges(harness, layer, local_split, tmp_path):
    info, image = layer
    _, _, blob = local_split
    data = blob.read_bytes()
    src = harness.open(tmp_path / "cache")
    src.push(info, image)
    form = src.lazy_form(info)
    d = form.index.blob_digest
    for off, n in ((0, 10), (MiB - 5, 10), (MiB, MiB), (len(data) - 100, 100), (12345, 1)):
        assert src.read_blob(d, off, n) == data[off : off + n], (off, n)
    assert src.read_blob(d, len(data) - 3, 10) == data[-3:]  # short at the end
    assert src.read_blob(d, len(data) + 10, 10) == b""
    assert src.read_blob(d, 5, 0) == b""
    missing = "sha256:" + "0" * 64
    with pytest.raises(UnknownLayer):
        src.read_blob(missing, 0, 10)


def test_on_demand_mount_reads_only_what_it_touches(harness, layer, mounts, tmp_path):
    info, image = layer
    src = harness.open(tmp_path / "cache")
    src.push(info, image)
    node = harness.open(tmp_path / "node-cache")  # another node: knows only the source
    form = node.lazy_form(info)
    meta = node.fetch_meta(form)
    index = form.index
    fetched: list[tuple[int, int]] = []
    lock = threading.Lock()

    def read_range(off: int, n: int) -> bytes:
        with lock:
            fetched.append((off, n))
        return node.read_blob(index.blob_digest, off, n)

    cache = ChunkCache(tmp_path / "chunks", 64 * MiB)
    blob_file = mounts.serve("layer.blob", LazyBlob(index, cache, read_range, 10.0))
    root = mounts.lazy(meta, blob_file)

    assert (root / "etc" / "hello.txt").read_bytes() == SMALL
    small_read = sum(n for _, n in fetched)
    assert 0 < small_read <= index.chunk_size
    assert small_read * 4 < index.blob_size
    assert os.readlink(root / "hello-link") == "etc/hello.txt"
    assert (root / "home" / "user" / "owned").stat().st_uid == 1234

    # the whole tree still reads back right, and the duplicated file costs no extra fetches
    whole = mounts.image(image)
    assert _snapshot(root) == _snapshot(whole)
    assert sum(n for _, n in fetched) <= index.blob_size
    assert len(fetched) == len(set(fetched))
