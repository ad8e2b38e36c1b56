"""The oci layer source against a real registry (Debian's docker-registry on 127.0.0.1): push,
manifests and annotations, resolve/list, verified fetches, catalogs, and its failure modes."""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest
from oci_registry import local_registry, registry_binary

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
from dsec_core.records import LayerInfo, LayerRef
from dsec_core.sources.chain import find_layer
from dsec_core.testing import LayerSourceConformance, free_port

dsec_layer_oci = pytest.importorskip(
    "dsec_layer_oci", reason="pip install -e plugins/layer_oci first"
)
OciLayerSource = dsec_layer_oci.OciLayerSource

pytestmark = [
    pytest.mark.skipif(
        registry_binary() is None,
        reason="docker-registry is not installed (apt-get install docker-registry)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="mkfs.erofs layers need root"),
]

_started: list[int] = []


@pytest.fixture
def registry():
    with local_registry() as reg:
        _started.append(reg.process.pid)
        yield reg
    assert reg.process.poll() is not None, "registry still running after its context ended"
    assert not reg.storage.exists(), "registry data left behind"


@pytest.fixture
def store(tmp_path) -> LayerStore:
    return LayerStore(tmp_path / "layers")


def _source(reg, tmp_path: Path, prefix: str = "dsec") -> OciLayerSource:
    return OciLayerSource(f"{reg.address}/{prefix}?insecure=1", cache_dir=tmp_path / "cache")


def _layer(
    store: LayerStore, tmp: Path, name: str, text: str, version: str = "1", kind: str = "workspace"
) -> LayerInfo:
    src = tmp / f"src-{name}-{version}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    src.mkdir()
    (src / "file").write_text(text)
    return build_layer(src, name=name, version=version, kind=kind, store=store)


def _manifest(reg, repo: str, tag: str) -> dict:
    req = urllib.request.Request(
        f"{reg.base_url}/v2/{repo}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_push_stores_an_erofs_artifact_with_annotations(registry, store, tmp_path):
    src = _source(registry, tmp_path)
    info = _layer(store, tmp_path, "ws", "hello\n")
    assert src.push(info, store.image_path(info)) is True

    manifest = _manifest(registry, "dsec/ws", "1")
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    [blob] = manifest["layers"]
    assert blob["mediaType"] == "application/vnd.erofs.layer.v1"
    assert blob["digest"] == info.digest and blob["size"] == info.size
    notes = manifest["annotations"]
    assert notes["org.dsec.layer.kind"] == "workspace"
    assert notes["org.dsec.layer.name"] == "ws"
    assert notes["org.dsec.layer.version"] == "1"
    assert float(notes["org.dsec.layer.created"]) == pytest.approx(info.created)
    assert notes["org.dsec.layer.source"] == info.source
    # The registry's copy of the blob is byte for byte the image we built.
    assert _sha256(registry.blob_file(info.digest)) == info.digest

    assert src.push(info, store.image_path(info)) is False  # same digest again: nothing to do


def test_same_tag_different_digest_is_layer_exists(registry, tmp_path):
    a_store, b_store = LayerStore(tmp_path / "a"), LayerStore(tmp_path / "b")
    a = _layer(a_store, tmp_path, "ws", "one\n")
    b = _layer(b_store, tmp_path, "ws", "two\n")
    assert a.digest != b.digest
    src = _source(registry, tmp_path)
    src.push(a, a_store.image_path(a))
    with pytest.raises(LayerExists) as e:
        src.push(b, b_store.image_path(b))
    assert "ws@1" in str(e.value) and a.digest in str(e.value)
    assert _manifest(registry, "dsec/ws", "1")["layers"][0]["digest"] == a.digest


def test_resolve_and_list(registry, store, tmp_path):
    src = _source(registry, tmp_path)
    v1 = _layer(store, tmp_path, "ws", "one\n", version="1")
    v2 = _layer(store, tmp_path, "ws", "two\n", version="2")
    tools = _layer(store, tmp_path, "tools", "t\n", version="7", kind="toolkit")
    for info in (v1, v2, tools):
        src.push(info, store.image_path(info))
    src.put_catalog("main", {"environments": {}})  # catalogs are not layers

    assert src.resolve(LayerRef.parse("ws@1")) == v1
    assert src.resolve(LayerRef.parse("ws")) == v2  # newest
    assert src.resolve(LayerRef.parse("ws@3")) is None
    assert src.resolve(LayerRef.parse("nothing")) is None
    assert src.resolve(LayerRef.parse("Upper@1")) is None  # cannot be an OCI repository
    assert [i.ref for i in src.list()] == ["tools@7", "ws@1", "ws@2"]
    assert src.list() == sorted([v1, v2, tools], key=lambda i: (i.name, i.created))
    # Another prefix in the same registry is another source.
    assert _source(registry, tmp_path, prefix="other").list() == []


def test_image_path_fetches_and_verifies(registry, store, tmp_path):
    info = _layer(store, tmp_path, "ws", "payload\n" * 1000)
    pusher = _source(registry, tmp_path)
    pusher.push(info, store.image_path(info))

    reader = OciLayerSource(f"{registry.address}/dsec?insecure=1", cache_dir=tmp_path / "node")
    path = reader.image_path(info)
    assert path == tmp_path / "node" / f"{info.digest.split(':')[1]}.erofs"
    assert _sha256(path) == info.digest
    assert path.read_bytes() == store.image_path(info).read_bytes()
    assert reader.image_path(info) == path  # cached
    # Fetches go by Range; the registry must answer with just the bytes asked for.
    image = store.image_path(info).read_bytes()
    assert reader._read_range("dsec/ws", info.digest, 100, 50) == image[100:150]
    assert [p.name for p in (tmp_path / "node").iterdir()] == [path.name]


def test_corrupt_blob_is_rejected_and_nothing_is_cached(registry, store, tmp_path):
    info = _layer(store, tmp_path, "ws", "will be damaged\n")
    _source(registry, tmp_path).push(info, store.image_path(info))
    blob = registry.blob_file(info.digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    blob.write_bytes(bytes(data))

    cache = tmp_path / "node"
    reader = OciLayerSource(f"{registry.address}/dsec?insecure=1", cache_dir=cache)
    with pytest.raises(LayerCorrupt) as e:
        reader.image_path(info)
    assert info.digest in str(e.value)
    assert not cache.exists() or list(cache.iterdir()) == []

    blob.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(LayerCorrupt):
        reader.image_path(info)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_catalogs(registry, tmp_path):
    src = _source(registry, tmp_path)
    assert src.catalogs() == []
    with pytest.raises(UnknownEnvironment):
        src.get_catalog("main")
    src.put_catalog("main", {"version": 1, "environments": {"py": {"base": "rootfs@1"}}})
    src.put_catalog("extra", {"version": 1})
    src.put_catalog("main", {"version": 2})  # replaces
    assert src.get_catalog("main") == {"version": 2}
    assert src.catalogs() == ["extra", "main"]
    manifest = _manifest(registry, "dsec/catalogs/main", "latest")
    assert manifest["layers"][0]["mediaType"] == "application/vnd.dsec.catalog.v1+json"
    assert manifest["annotations"]["org.dsec.catalog.name"] == "main"
    with pytest.raises(UnknownEnvironment) as e:
        src.get_catalog("nope")
    assert "extra" in str(e.value) and "main" in str(e.value)
    with pytest.raises(InvalidSpec):
        src.put_catalog("Bad Name", {})


def test_unrepresentable_names_are_refused(registry, store, tmp_path):
    info = _layer(store, tmp_path, "WS", "x\n")
    with pytest.raises(InvalidSpec):
        _source(registry, tmp_path).push(info, store.image_path(info))
    with pytest.raises(InvalidSpec):
        OciLayerSource("/no-host", cache_dir=tmp_path)
    with pytest.raises(InvalidSpec):
        OciLayerSource("127.0.0.1:1/Upper", cache_dir=tmp_path)


def test_version_with_plus_round_trips(registry, store, tmp_path):
    src = _source(registry, tmp_path)
    info = _layer(store, tmp_path, "ws", "plus\n", version="1.0+build5")
    assert src.push(info, store.image_path(info)) is True
    assert src.resolve(LayerRef.parse("ws@1.0+build5")) == info
    assert src.resolve(LayerRef.parse("ws@1.0_build5")) is None


def test_unreachable_registry_fails_fast(store, tmp_path):
    port = free_port()  # nothing listens here
    src = OciLayerSource(f"127.0.0.1:{port}/dsec?insecure=1", cache_dir=tmp_path / "cache")
    info = _layer(store, tmp_path, "ws", "x\n")
    for call in (
        lambda: src.resolve(LayerRef.parse("ws@1")),
        src.list,
        src.catalogs,
        lambda: src.push(info, store.image_path(info)),
        lambda: src.image_path(info),
        lambda: src.get_catalog("main"),
    ):
        t0 = time.monotonic()
        with pytest.raises(SourceUnavailable) as e:
            call()
        assert time.monotonic() - t0 < 5
        assert f"oci://127.0.0.1:{port}/dsec?insecure=1" in str(e.value)
        assert e.value.source == src.url
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_refused_credentials(tmp_path):
    with local_registry(auth="silly") as reg:
        src = OciLayerSource(f"{reg.address}/dsec?insecure=1", cache_dir=tmp_path)
        t0 = time.monotonic()
        with pytest.raises(SourceUnavailable) as e:
            src.list()
        assert time.monotonic() - t0 < 5
        assert "credentials" in str(e.value) and "401" in str(e.value)
    assert reg.process.poll() is not None


def test_basic_auth_registry(store, tmp_path, monkeypatch):
    info = _layer(store, tmp_path, "ws", "secret\n")
    with local_registry(auth=("dsec", "s3cret")) as reg:
        _started.append(reg.process.pid)
        url = f"{reg.address}/dsec?insecure=1"
        monkeypatch.setenv("DSEC_OCI_USERNAME", "dsec")
        monkeypatch.setenv("DSEC_OCI_PASSWORD", "wrong")
        with pytest.raises(SourceUnavailable) as e:
            OciLayerSource(url, cache_dir=tmp_path / "c").list()
        assert "refused our credentials" in str(e.value)
        monkeypatch.setenv("DSEC_OCI_PASSWORD", "s3cret")
        src = OciLayerSource(url, cache_dir=tmp_path / "c")
        assert src.push(info, store.image_path(info)) is True
        assert src.list() == [info]
        assert _sha256(src.image_path(info)) == info.digest


def test_open_source_through_the_plugin_registry(registry, store, tmp_path):
    plugins.reset()
    try:
        node = NodeConfig(home=tmp_path / "node")
        url = f"oci://{registry.address}/dsec?insecure=1"
        src = open_source(url, node)
        assert isinstance(src, OciLayerSource)
        assert src.url == url and src.cache_dir == node.cache_dir
        info = _layer(store, tmp_path, "ws", "via plugin\n")
        assert src.push(info, store.image_path(info))
        found_in, found = find_layer([src], "ws@1")
        assert found_in is src and found == info
        assert _sha256(src.image_path(info)) == info.digest
    finally:
        plugins.reset()


def test_no_registry_process_remains():
    with local_registry() as reg:
        _started.append(reg.process.pid)
    for pid in _started:
        assert (
            not Path(f"/proc/{pid}").exists()
            or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        ), f"registry {pid} survived"


class TestOciConformance(LayerSourceConformance):
    """The layer-source conformance kit against the real registry."""

    @pytest.fixture
    def dsec_source(self, registry, tmp_path):
        self.registry = registry
        return _source(registry, tmp_path)

    def corrupt(self, source, digest, how):
        blob = self.registry.blob_file(digest)
        data = bytearray(blob.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        blob.write_bytes(bytes(data))

    def unreachable(self, tmp_path):
        return OciLayerSource(
            f"127.0.0.1:{free_port()}/dsec?insecure=1", cache_dir=tmp_path / "cache"
        )
