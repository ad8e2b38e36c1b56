"""Docker images in the registry an oci source reads: ``find_image``/``fetch_image`` against a
real registry (Debian's docker-registry on 127.0.0.1), and a node that resolves ``FROM
tools/busy:1.0`` from it into a base layer whose sandboxes run, once (then a cache hit)."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import tarfile
import urllib.request
from pathlib import Path

import pytest
from oci_registry import local_registry, registry_binary

from dsec_core.errors import UnknownImage
from dsec_core.layers.image import flatten_oci_layout
from dsec_core.layers.store import LayerStore
from dsec_core.node.node import Node
from dsec_core.records import SandboxSpec
from dsec_core.testing import make_busybox_rootfs, node_home

dsec_layer_oci = pytest.importorskip(
    "dsec_layer_oci", reason="pip install -e plugins/layer_oci first"
)
OciLayerSource = dsec_layer_oci.OciLayerSource

pytestmark = [
    pytest.mark.skipif(registry_binary() is None, reason="docker-registry is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _put(reg, path: str, data: bytes, content_type: str | None = None) -> None:
    req = urllib.request.Request(f"{reg.base_url}{path}", data=data, method="PUT")
    if content_type:
        req.add_header("Content-Type", content_type)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status in (201, 202), r.status


def _blob(reg, repo: str, data: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    post = urllib.request.Request(f"{reg.base_url}/v2/{repo}/blobs/uploads/", method="POST")
    with urllib.request.urlopen(post, timeout=10) as r:
        location = r.headers["Location"]
    sep = "&" if "?" in location else "?"
    url = location if location.startswith("http") else f"{reg.base_url}{location}"
    req = urllib.request.Request(f"{url}{sep}digest={digest}", data=data, method="PUT")
    req.add_header("Content-Type", "application/octet-stream")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 201
    return {"digest": digest, "size": len(data)}


def _push_image(reg, repo: str, tag: str, rootfs: Path, *, indexed: bool) -> None:
    """Push ``rootfs`` as a one-layer gzip OCI image with an env and a workdir; ``indexed``:
    behind an index that also lists an image for another architecture."""
    layer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=layer, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        tar.add(rootfs, arcname=".")
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin:/usr/bin", "TOOL=busy"], "WorkingDir": "/srv", "Cmd": ["sh"]},
        "rootfs": {"type": "layers", "diff_ids": []},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **_blob(reg, repo, json.dumps(config).encode()),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                **_blob(reg, repo, layer.getvalue()),
            }
        ],
    }
    raw = json.dumps(manifest).encode()
    if not indexed:
        _put(reg, f"/v2/{repo}/manifests/{tag}", raw, MANIFEST)
        return
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    _put(reg, f"/v2/{repo}/manifests/{digest}", raw, MANIFEST)
    # the other architecture's image: the registry checks that an index names real manifests
    other = json.dumps({**manifest, "annotations": {"arch": "arm64"}}).encode()
    other_digest = "sha256:" + hashlib.sha256(other).hexdigest()
    _put(reg, f"/v2/{repo}/manifests/{other_digest}", other, MANIFEST)
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [
            {
                "mediaType": MANIFEST,
                "digest": other_digest,
                "size": len(other),
                "platform": {"architecture": "arm64", "os": "linux"},
            },
            {
                "mediaType": MANIFEST,
                "digest": digest,
                "size": len(raw),
                "platform": {"architecture": "amd64", "os": "linux"},
            },
        ],
    }
    _put(reg, f"/v2/{repo}/manifests/{tag}", json.dumps(index).encode(), INDEX)


@pytest.fixture
def registry():
    with local_registry() as reg:
        yield reg


def test_find_and_fetch_an_image(registry, tmp_path):
    rootfs = make_busybox_rootfs(tmp_path / "rootfs")
    (rootfs / "marker").write_text("from the registry\n")
    _push_image(registry, "dsec/tools/busy", "1.0", rootfs, indexed=True)
    source = OciLayerSource(f"{registry.address}/dsec?insecure=1", cache_dir=tmp_path / "c")

    digest = source.find_image("tools/busy:1.0")
    assert digest is not None and digest.startswith("sha256:")
    # a registry host in the reference is left out: the source's own registry is asked
    assert source.find_image("registry.example:5000/tools/busy:1.0") == digest
    assert source.find_image("tools/busy:2.0") is None
    assert source.find_image("tools/other") is None

    config = source.fetch_image("tools/busy:1.0", tmp_path / "layout")
    assert config["Env"] == ["PATH=/bin:/usr/bin", "TOOL=busy"] and config["WorkingDir"] == "/srv"
    tree = flatten_oci_layout(tmp_path / "layout", tmp_path / "tree")
    assert (tree / "marker").read_text() == "from the registry\n"
    assert source.fetch_image("tools/busy:1.0", None) == config  # the config alone
    with pytest.raises(UnknownImage, match="tools/busy:9"):
        source.fetch_image("tools/busy:9", tmp_path / "none")


def test_a_node_resolves_from_its_oci_source_once(registry, tmp_path):
    asyncio.run(_resolves_once(registry, tmp_path))


async def _resolves_once(registry, tmp_path: Path) -> None:
    rootfs = make_busybox_rootfs(tmp_path / "rootfs")
    (rootfs / "marker").write_text("resolved\n")
    _push_image(registry, "dsec/busy", "1.0", rootfs, indexed=False)
    url = f"oci://{registry.address}/dsec?insecure=1"
    with node_home("dsec-ociimg-", layer_sources=("local", url)) as config:
        node = Node(config)
        await node.open()
        try:
            first = await node.resolve_image("busy:1.0")
            assert (first.source, first.cached, first.workdir) == (url, False, "/srv")
            assert "TOOL=busy" in first.env and first.cmd == ("sh",)
            again = await node.resolve_image("busy:1.0")
            assert again.cached and again.layer == first.layer
            assert LayerStore(config.layer_dir).resolve(first.layer).kind == "base"
            sid = (await node.create(SandboxSpec(layers=(first.layer,), memory="128M"))).id
            r = await node.exec(sid, ["cat", "/marker"], timeout=30)
            assert r.stdout == b"resolved\n"
            with pytest.raises(UnknownImage, match=r"busy:2\.0") as e:
                await node.resolve_image("busy:2.0")
            assert url in str(e.value)
        finally:
            await node.close(kill_all=True)
