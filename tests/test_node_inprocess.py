"""The ``Node`` driven in-process, so plugins registered by the test reach it: the security
policy, layer source and backend registration hooks each change what a real sandbox sees."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dsec_core import plugins
from dsec_core.config import NodeConfig
from dsec_core.hookspecs import hookimpl
from dsec_core.layers.build import build_layer
from dsec_core.layers.source import LayerSource
from dsec_core.layers.store import LayerStore
from dsec_core.node.node import Node
from dsec_core.records import LayerInfo, SandboxSpec
from dsec_core.security import SecurityPolicy
from dsec_core.testing import leftovers, make_busybox_rootfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


class ReadOnlyEtc(SecurityPolicy):
    """Makes /etc read-only, even for root in the sandbox."""

    name = "readonly-etc"
    released_ids: list[str] = []

    def apply_oci(self, rt, config):
        config["linux"]["readonlyPaths"].append("/etc")

    def released(self, rt):
        ReadOnlyEtc.released_ids.append(rt.id)


class ElsewhereSource(LayerSource):
    """A second layer source: a plain directory of images, to check source order."""

    scheme = "elsewhere"
    images: dict[str, tuple[LayerInfo, Path]] = {}

    def resolve(self, ref):
        hit = self.images.get(ref.name)
        return hit[0] if hit and ref.version in (None, hit[0].version) else None

    def list(self):
        return [info for info, _ in self.images.values()]

    def image_path(self, info):
        return self.images[info.name][1]


class PolicyAndSourcePlugin:
    @hookimpl
    def dsec_register_security_policies(self, register):
        register(ReadOnlyEtc)

    @hookimpl
    def dsec_register_layer_sources(self, register):
        register(ElsewhereSource)


@pytest.fixture
def node_with_plugin():
    plugins.reset()
    plugins.get_plugin_manager().register(PolicyAndSourcePlugin(), name="test_plugin")
    home = Path(tempfile.mkdtemp(prefix="dsec-inproc-"))
    config = NodeConfig(home=home, layer_sources=("local", "elsewhere"))
    config.ensure_dirs()
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = make_busybox_rootfs(Path(tmp) / "rootfs")
        store = LayerStore(config.layer_dir)
        build_layer(rootfs, name="kit-base", version="1", kind="base", store=store)
        # The same files as another layer, kept only in the second source.
        other = LayerStore(home / "other")
        info = build_layer(rootfs, name="only-elsewhere", version="2", kind="base", store=other)
        ElsewhereSource.images = {"only-elsewhere": (info, other.image_path(info))}
    try:
        yield config
    finally:
        plugins.reset()
        left = leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
        assert not any(left.values()), left


async def test_security_policy_and_layer_source_hooks(node_with_plugin):
    node = Node(node_with_plugin)
    await node.open()
    try:
        assert "readonly-etc" in node.registry.security_policies
        info = await node.create(SandboxSpec(layers=("kit-base@1",), memory="64M"))
        r = await node.exec(info.id, "echo x > /etc/new-file")
        assert r.exit_code != 0 and b"Read-only" in r.stderr
        assert (await node.exec(info.id, "echo x > /tmp/ok")).exit_code == 0
        await node.kill(info.id)
        assert info.id in ReadOnlyEtc.released_ids

        # a layer found only in the second source
        other = await node.create(SandboxSpec(layers=("only-elsewhere@2",), memory="64M"))
        assert (await node.exec(other.id, "echo from-elsewhere")).stdout == b"from-elsewhere\n"
        await node.kill(other.id)
    finally:
        await node.close(kill_all=True)
