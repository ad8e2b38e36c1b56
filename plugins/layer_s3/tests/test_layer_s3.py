"""The s3 layer source against a real S3 server (``rclone serve s3`` on 127.0.0.1): push, resolve,
verified fetches, catalogs, and how an unreachable or refusing server is reported."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import pytest
from s3server import DIR_CACHE_SECONDS, S3Server, free_port, running_s3_server

from dsec_core import plugins
from dsec_core.config import NodeConfig
from dsec_core.errors import (
    InvalidSpec,
    LayerCorrupt,
    LayerExists,
    SourceUnavailable,
    UnknownEnvironment,
)
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.plugins import open_source
from dsec_core.records import LayerRef
from dsec_core.sources.chain import find_layer
from dsec_core.testing import LayerSourceConformance

boto3 = pytest.importorskip("boto3")
dsec_layer_s3 = pytest.importorskip("dsec_layer_s3")
S3LayerSource = dsec_layer_s3.S3LayerSource

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mkfs.erofs"),
    reason="building EROFS layers needs root and mkfs.erofs",
)


def _rclone_pids(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "rclone" in cmdline and marker in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def server() -> S3Server:
    with running_s3_server(buckets=("dsec",)) as s:
        root = str(s.data_dir.parent)
        assert _rclone_pids(root) == [s.pid]
        yield s
    assert _rclone_pids(root) == [], "rclone serve s3 outlived its test module"
    assert not Path(root).exists()


@pytest.fixture(autouse=True)
def aws_env(server, tmp_path, monkeypatch):
    """The server's credentials in the environment, and nothing of the host's ~/.aws."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no traffic off 127.0.0.1
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def node(tmp_path) -> NodeConfig:
    return NodeConfig(home=tmp_path / "node")


@pytest.fixture
def prefix() -> str:
    """A fresh prefix in the shared bucket, so tests do not see each other's objects."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def source(server, node, prefix) -> S3LayerSource:
    src = open_source(server.url("dsec", prefix), node)
    assert isinstance(src, S3LayerSource)
    return src


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    """Two real EROFS layers named ws@1 (different contents) and one ws@2, in local stores."""
    if os.geteuid() != 0 or not shutil.which("mkfs.erofs"):
        pytest.skip("building EROFS layers needs root and mkfs.erofs")
    tmp = tmp_path_factory.mktemp("layers")
    out = {}
    for key, version, text in (("a", "1", "hello"), ("b", "1", "different"), ("c", "2", "v2")):
        src = tmp / f"src-{key}"
        (src / "etc").mkdir(parents=True)
        (src / "etc" / "greeting").write_text(text)
        store = LayerStore(tmp / f"store-{key}")
        info = build_layer(src, name="ws", version=version, kind="workspace", store=store)
        out[key] = (info, store.image_path(info))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


# --- URLs and the plugin registry ----------------------------------------------------------
def test_open_source_through_the_plugin_registry(server, node):
    plugins.reset()  # see entry points installed after the registry was first loaded
    assert "s3" in plugins.registry().layer_sources
    src = open_source(f"s3://dsec/a/b/?endpoint={server.endpoint}&region=us-east-1", node)
    assert isinstance(src, S3LayerSource)
    assert (src.bucket, src.prefix, src.endpoint, src.region) == (
        "dsec",
        "a/b/",
        server.endpoint,
        "us-east-1",
    )
    assert src.url.startswith("s3://dsec/a/b/")
    assert src.cache_dir == node.cache_dir
    bare = open_source("s3://bucket", node)
    assert (bare.bucket, bare.prefix, bare.endpoint, bare.profile) == ("bucket", "", None, None)
    with pytest.raises(InvalidSpec):
        open_source("s3://", node)
    with pytest.raises(InvalidSpec, match="bogus"):
        open_source("s3://bucket?bogus=1", node)


# --- the primitives ------------------------------------------------------------------------
def test_primitives_ranges_multipart_and_paging(source, server, prefix, tmp_path):
    source._write("a/one.json", b"0123456789")
    assert source._read("a/one.json") == b"0123456789"
    assert source._read("a/one.json", 2, 3) == b"234"
    assert source._read("a/one.json", 8, 10) == b"89"  # short: the object ends
    assert source._read("a/one.json", 20, 5) == b""  # past the end: a short read, not an error
    assert source._size("a/one.json") == 10 and source._size("a/none") is None
    with pytest.raises(KeyError):
        source._read("a/none")
    assert (server.data_dir / "dsec" / prefix / "a" / "one.json").read_bytes() == b"0123456789"

    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(11 << 20))
    source.multipart_threshold = source.multipart_chunksize = 5 << 20  # three parts
    source._write("blobs/big", big)
    assert source._size("blobs/big") == big.stat().st_size
    assert source._read("blobs/big", 6 << 20, 1 << 20) == big.read_bytes()[6 << 20 : 7 << 20]

    for i in range(5):
        source._write(f"many/{i}", b"x")
    source.list_page_size = 2  # three list_objects_v2 pages
    assert source._keys("many/") == [f"many/{i}" for i in range(5)]
    assert source._keys("nothing/") == []


# --- layers --------------------------------------------------------------------------------
@needs_root
def test_push_resolve_list_and_fetch(source, layers, node):
    info, image = layers["a"]
    assert source.push(info, image) is True
    assert source.push(info, image) is False  # already there: nothing done
    other, other_image = layers["b"]
    with pytest.raises(LayerExists):
        source.push(other, other_image)  # ws@1 is immutable
    v2, v2_image = layers["c"]
    time.sleep(0.01)
    assert source.push(v2, v2_image) is True

    assert source.resolve(LayerRef.parse("ws@1")).digest == info.digest
    assert source.resolve(LayerRef.parse("ws")).digest == v2.digest  # newest version
    assert source.resolve(LayerRef.parse("ws@9")) is None
    assert source.resolve(LayerRef.parse("nope")) is None
    assert [(i.ref, i.digest) for i in source.list()] == [
        ("ws@1", info.digest),
        ("ws@2", v2.digest),
    ]

    path = source.image_path(info)
    assert path.parent == node.cache_dir and path.exists()
    assert _sha256(path) == info.digest and path.stat().st_size == info.size
    assert source.image_path(info) == path  # cached: no second fetch


@needs_root
def test_corrupt_blob_is_rejected_and_leaves_nothing(source, layers, node, server, prefix):
    info, image = layers["a"]
    source.push(info, image)
    key = f"{prefix}/{source.blob_key(info.digest)}"
    client = server.client()
    good = image.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    client.put_object(Bucket="dsec", Key=key, Body=bytes(bad))  # same size, different bytes
    with pytest.raises(LayerCorrupt, match="does not match its digest"):
        source.image_path(info)
    assert not node.cache_dir.exists() or list(node.cache_dir.iterdir()) == []

    # Behind the server's back: the object's file in the served directory is truncated.
    on_disk = server.data_dir / "dsec" / key
    on_disk.write_bytes(good[: len(good) // 2])
    time.sleep(DIR_CACHE_SECONDS + 0.2)
    with pytest.raises(LayerCorrupt):
        source.image_path(info)
    assert not node.cache_dir.exists() or list(node.cache_dir.iterdir()) == []

    on_disk.write_bytes(good)  # repaired: the fetch now succeeds
    time.sleep(DIR_CACHE_SECONDS + 0.2)
    assert _sha256(source.image_path(info)) == info.digest


@needs_root
def test_node_takes_a_layer_the_local_store_lacks_from_s3(source, layers, node):
    info, image = layers["a"]
    source.push(info, image)
    local = open_source(f"local:{node.layer_dir}", node)
    found, got = find_layer([local, source], "ws@1")
    assert found is source and got.digest == info.digest
    assert _sha256(found.image_path(got)) == info.digest


# --- catalogs ------------------------------------------------------------------------------
def test_catalogs(source):
    assert source.catalogs() == []
    doc = {"name": "swe", "environments": {"py": {"layers": ["ws@1"]}}}
    source.put_catalog("swe", doc)
    source.put_catalog("other", {"name": "other"})
    assert source.get_catalog("swe") == doc
    assert source.catalogs() == ["other", "swe"]
    doc["environments"]["py"]["layers"].append("ws@2")
    source.put_catalog("swe", doc)  # replaces
    assert source.get_catalog("swe")["environments"]["py"]["layers"] == ["ws@1", "ws@2"]
    with pytest.raises(UnknownEnvironment) as e:
        source.get_catalog("missing")
    assert "other" in str(e.value) and "swe" in str(e.value)


# --- failures ------------------------------------------------------------------------------
def test_unreachable_endpoint_fails_fast(node):
    port = free_port()
    with socket.socket() as probe:  # nothing listens there
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    url = f"s3://dsec?endpoint=http://127.0.0.1:{port}"
    src = open_source(url, node)
    start = time.monotonic()
    with pytest.raises(SourceUnavailable) as e:
        src.list()
    assert time.monotonic() - start < 5
    assert url in str(e.value) and e.value.source == url
    with pytest.raises(SourceUnavailable):
        src.resolve(LayerRef.parse("ws@1"))


def test_bad_credentials(server, node, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    src = open_source(server.url("dsec"), node)
    with pytest.raises(SourceUnavailable, match="credentials"):
        src.list()
    with pytest.raises(SourceUnavailable, match="credentials"):
        src.put_catalog("x", {})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(SourceUnavailable, match="credentials"):
        open_source(server.url("dsec"), node).resolve(LayerRef.parse("ws@1"))


def test_credentials_from_a_profile(server, node, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    (tmp_path / "aws-credentials").write_text(
        f"[dsec-test]\naws_access_key_id = {server.access_key}\n"
        f"aws_secret_access_key = {server.secret_key}\n"
    )
    src = open_source(server.url("dsec", f"p-{uuid.uuid4().hex[:8]}") + "&profile=dsec-test", node)
    src.put_catalog("c", {"ok": True})
    assert src.get_catalog("c") == {"ok": True}
    with pytest.raises(SourceUnavailable, match="no-such-profile"):
        open_source(server.url("dsec") + "&profile=no-such-profile", node).list()


def test_missing_bucket(server, node):
    src = open_source(server.url("no-such-bucket"), node)
    with pytest.raises(SourceUnavailable, match="bucket 'no-such-bucket' does not exist"):
        src.list()
    with pytest.raises(SourceUnavailable, match="does not exist"):
        src.resolve(LayerRef.parse("ws@1"))
    with pytest.raises(SourceUnavailable, match="does not exist"):
        src.put_catalog("x", {})


@needs_root
class TestS3Conformance(LayerSourceConformance):
    """The layer-source conformance kit against the real S3 server."""

    @pytest.fixture
    def dsec_source(self, server, node, prefix):
        self.server, self.prefix = server, prefix
        return open_source(server.url("dsec", prefix), node)

    def corrupt(self, source, digest, how):
        key = f"{self.prefix}/{source.blob_key(digest)}"
        data = bytearray(self.server.client().get_object(Bucket="dsec", Key=key)["Body"].read())
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        # behind the server's back, as a failing disk would
        (self.server.data_dir / "dsec" / key).write_bytes(bytes(data))
        time.sleep(DIR_CACHE_SECONDS + 0.2)

    def unreachable(self, tmp_path):
        return open_source(
            f"s3://dsec?endpoint=http://127.0.0.1:{free_port()}",
            NodeConfig(home=tmp_path / "gone-node"),
        )
