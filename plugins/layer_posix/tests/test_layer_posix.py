"""Layer distribution through a shared-filesystem (posix) source: push, pull, publish, verify."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from dsec_layer_posix import PosixLayerSource

from dsec_core.catalog import CatalogStore, parse_catalog
from dsec_core.catalog.distribution import publish_catalog, pull_catalog
from dsec_core.config import NodeConfig
from dsec_core.errors import (
    CatalogInvalid,
    InvalidSpec,
    LayerCorrupt,
    LayerExists,
    SourceUnavailable,
    UnknownEnvironment,
    UnknownLayer,
    UnknownSource,
)
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.plugins import open_source
from dsec_core.sources.chain import find_layer, split_url
from dsec_core.sources.transfer import pull_layer, push_layer
from dsec_core.testing import LayerSourceConformance

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mkfs.erofs layers need root")


@pytest.fixture
def node(tmp_path) -> NodeConfig:
    return NodeConfig(home=tmp_path / "node")


@pytest.fixture
def shared(tmp_path) -> Path:
    d = tmp_path / "shared-fs"
    d.mkdir()
    return d


def _layer(
    store: LayerStore, tmp: Path, name: str, text: str, version: str = "1", kind: str = "workspace"
):
    src = tmp / f"src-{name}-{version}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    src.mkdir()
    (src / "file").write_text(text)
    return build_layer(src, name=name, version=version, kind=kind, store=store)


def test_urls_and_unknown_scheme(node):
    assert split_url("s3://b/p?x=1") == ("s3", "b/p?x=1")
    assert split_url("posix:/mnt/x") == ("posix", "/mnt/x")
    assert split_url("local") == ("local", "")
    with pytest.raises(UnknownSource) as e:
        open_source("ftp://somewhere", node)
    assert "posix" in str(e.value) and "local" in str(e.value)
    with pytest.raises(InvalidSpec):
        open_source("posix:relative/path", node)


def test_missing_mount_is_source_unavailable(node, tmp_path):
    src = open_source(f"posix:{tmp_path}/not-mounted", node)
    with pytest.raises(SourceUnavailable) as e:
        src.list()
    assert "not-mounted" in str(e.value)


def test_push_pull_roundtrip(node, shared, tmp_path):
    a = LayerStore(tmp_path / "a")
    info = _layer(a, tmp_path, "ws", "hello")
    dest = open_source(f"posix:{shared}", node)
    assert push_layer("ws@1", dest, a).moved
    assert not push_layer("ws@1", dest, a).moved  # already there: no-op
    assert (shared / "blobs" / "sha256" / info.digest.split(":")[1]).stat().st_size == info.size
    other = _layer(LayerStore(tmp_path / "c"), tmp_path, "ws", "different")
    with pytest.raises(LayerExists):
        dest.push(other, LayerStore(tmp_path / "c").image_path(other))

    b = LayerStore(tmp_path / "b")
    t = pull_layer("ws@1", dest, b)
    assert t.moved and b.resolve("ws@1").digest == info.digest
    assert not pull_layer("ws", dest, b).moved
    data = b.image_path(b.resolve("ws@1")).read_bytes()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == info.digest
    with pytest.raises(UnknownLayer) as e:
        pull_layer("nope@1", dest, b)
    assert "ws@1" in str(e.value)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_blob_never_reaches_the_store(node, shared, tmp_path, damage):
    a = LayerStore(tmp_path / "a")
    info = _layer(a, tmp_path, "ws", "precious")
    dest = open_source(f"posix:{shared}", node)
    push_layer("ws@1", dest, a)
    blob = shared / "blobs" / "sha256" / info.digest.split(":")[1]
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    blob.write_bytes(bytes(data))
    b = LayerStore(tmp_path / "b")
    with pytest.raises(LayerCorrupt):
        pull_layer("ws@1", dest, b)
    assert b.list() == []
    cached = (
        [p for p in node.cache_dir.rglob("*") if p.is_file()] if node.cache_dir.exists() else []
    )
    assert cached == []


def test_publish_and_pull_catalog(node, shared, tmp_path):
    a = LayerStore(tmp_path / "a")
    _layer(a, tmp_path, "base", "b", kind="base")
    _layer(a, tmp_path, "ws", "w")
    doc = {
        "name": "mini",
        "layers": [],
        "environments": [{"name": "mini-env", "base": "base@1", "workspaces": ["ws@1"]}],
    }
    cat = parse_catalog(doc, store=a)
    dest = open_source(f"posix:{shared}", node)
    lines = []
    publish_catalog(cat, dest, a, report=lines.append)
    assert dest.catalogs() == ["mini"] and any("published" in line for line in lines)

    b, catalogs = LayerStore(tmp_path / "b"), CatalogStore(tmp_path / "b-catalogs")
    pulled_cat, infos = pull_catalog("mini", dest, b, catalogs)
    assert {i.ref for i in infos} == {"base@1", "ws@1"}
    assert catalogs.environment("mini-env").layer_refs() == ["ws@1", "base@1"]
    with pytest.raises(UnknownEnvironment) as e:
        pull_catalog("maxi", dest, b, catalogs)
    assert "mini" in str(e.value)


def test_publish_rejects_a_catalog_naming_a_missing_layer(node, shared, tmp_path):
    a = LayerStore(tmp_path / "a")
    _layer(a, tmp_path, "base", "b", kind="base")
    doc = {
        "name": "broken",
        "layers": [],
        "environments": [{"name": "e", "base": "base@1", "workspaces": ["ghost@3"]}],
    }
    cat = parse_catalog(doc, check_layers=False)
    dest = open_source(f"posix:{shared}", node)
    with pytest.raises(CatalogInvalid) as e:
        publish_catalog(cat, dest, a)
    assert "ghost@3" in str(e.value)
    assert dest.catalogs() == [] and dest.list() == []  # nothing uploaded


def test_source_order(node, shared, tmp_path):
    local = open_source(f"local:{tmp_path / 'local'}", node)
    remote = open_source(f"posix:{shared}", node)
    a = LayerStore(tmp_path / "a")
    _layer(a, tmp_path, "ws", "remote copy")
    push_layer("ws@1", remote, a)
    source, info = find_layer([local, remote], "ws@1")
    assert source is remote
    path = source.image_path(info)  # fetched into the node's cache, verified
    assert path.parent == node.cache_dir
    push_layer("ws@1", local, a)
    assert find_layer([local, remote], "ws@1")[0] is local


def test_cli_push_pull_and_errors(shared, tmp_path):
    home_a, home_b = tmp_path / "ha", tmp_path / "hb"
    _layer(LayerStore(home_a / "layers"), tmp_path, "ws", "cli")

    def dsec(home, *args):
        env = dict(os.environ, DSEC_HOME=str(home))
        return subprocess.run(
            [sys.executable, "-m", "dsec_core.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = dsec(home_a, "layer", "push", "ws@1", "--to", f"posix:{shared}")
    assert out.returncode == 0 and out.stdout.startswith("pushed"), out.stderr
    assert dsec(home_a, "layer", "push", "ws@1", "--to", f"posix:{shared}").stdout.startswith(
        "present"
    )
    out = dsec(home_b, "layer", "pull", "ws@1", "--from", f"posix:{shared}")
    assert out.returncode == 0 and out.stdout.startswith("pulled"), out.stderr
    listing = json.loads(dsec(home_b, "layer", "ls", "--json").stdout)
    assert [entry["name"] for entry in listing] == ["ws"]
    out = dsec(home_b, "layer", "pull", "ws@1", "--from", "gopher://x")
    assert out.returncode == 1 and out.stderr.startswith("Error: unknown layer source scheme")
    assert "Traceback" not in out.stderr
    out = dsec(home_b, "layer", "pull", "ws@1", "--from", f"posix:{tmp_path}/gone")
    assert out.returncode == 1 and "no such directory" in out.stderr
    assert "Traceback" not in out.stderr


async def test_node_runs_a_sandbox_from_a_layer_only_in_the_shared_source(tmp_path, shared):
    from dsec_core.node.node import Node
    from dsec_core.records import SandboxSpec
    from dsec_core.testing import leftovers, make_busybox_rootfs

    staging = LayerStore(tmp_path / "staging")
    info = build_layer(
        make_busybox_rootfs(tmp_path / "rootfs"),
        name="shared-base",
        version="1",
        kind="base",
        store=staging,
    )
    push_layer("shared-base@1", open_source(f"posix:{shared}"), staging)
    # pytest's tmp_path sits in a 0700 directory that the sandbox's uid cannot enter
    home = Path(tempfile.mkdtemp(prefix="dsec-posix-"))
    config = NodeConfig(home=home, layer_sources=("local", f"posix:{shared}"))
    node = Node(config)
    await node.open()
    try:
        sb = await node.create(SandboxSpec(layers=("shared-base@1",), memory="64M"))
        assert (await node.exec(sb.id, "echo from shared")).stdout == b"from shared\n"
        # the shared source publishes the lazy form, so the node mounts it on demand
        assert [b.index.blob_digest for b in node.lazy_layers.blobs.values()]
        assert not (config.cache_dir / (info.digest.split(":")[1] + ".erofs")).exists()
        await node.kill(sb.id)
    finally:
        await node.close(kill_all=True)
    left = leftovers(config.home)
    shutil.rmtree(home, ignore_errors=True)
    assert not any(left.values()), left


def test_home_in_an_unenterable_directory_is_refused(tmp_path):
    with pytest.raises(InvalidSpec) as e:
        NodeConfig(home=tmp_path / "home").ensure_dirs()
    assert "chmod o+x" in str(e.value)


class TestPosixConformance(LayerSourceConformance):
    """The layer-source conformance kit against a shared directory."""

    @pytest.fixture
    def dsec_source(self, tmp_path):
        (tmp_path / "shared").mkdir()
        return PosixLayerSource(str(tmp_path / "shared"), cache_dir=tmp_path / "cache")

    def corrupt(self, source, digest, how):
        blob = source.root / source.blob_key(digest)
        data = bytearray(blob.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        os.chmod(blob, 0o644)
        blob.write_bytes(bytes(data))

    def unreachable(self, tmp_path):
        return PosixLayerSource(str(tmp_path / "unmounted"), cache_dir=tmp_path / "cache")


def test_chunk_size_of_published_lazy_forms(node, shared, tmp_path, monkeypatch):
    a = LayerStore(tmp_path / "a")
    info = _layer(a, tmp_path, "ws", "x" * 300_000)
    dest = open_source(f"posix:{shared}", node)
    monkeypatch.setenv("DSEC_CHUNK_SIZE", "256K")
    push_layer("ws@1", dest, a)
    assert dest.lazy_form(info).index.chunk_size == 256 << 10
    monkeypatch.setenv("DSEC_CHUNK_SIZE", "100K")  # not a power of two
    with pytest.raises(InvalidSpec):
        push_layer("ws@1", open_source(f"posix:{tmp_path}", node), a)
