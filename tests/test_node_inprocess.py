"""The ``Node`` driven in-process, so plugins registered by the test reach it: security policies
chosen per sandbox, a second layer source, and placement each change what a real sandbox sees
(or whether it is created at all)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dsec_core import plugins
from dsec_core.config import NodeConfig
from dsec_core.errors import InvalidSpec, PolicyUnavailable, UnknownPolicy
from dsec_core.hookspecs import hookimpl
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.node.node import Node
from dsec_core.records import LayerInfo, SandboxSpec
from dsec_core.security import SecurityPolicy
from dsec_core.sources.base import LayerSource
from dsec_core.testing import leftovers, make_busybox_rootfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


class ReadOnlyPaths(SecurityPolicy):
    """Makes paths read-only, even for root in the sandbox (settings: ``{"paths": [...]}``)."""

    name = "readonly-paths"
    targets = frozenset({"oci"})
    released_ids: list[str] = []

    def validate(self, settings):
        paths = settings.get("paths")
        if not isinstance(paths, list) or not all(
            isinstance(p, str) and p.startswith("/") for p in paths
        ):
            raise InvalidSpec("readonly-paths needs paths: a list of absolute paths")

    def apply_oci(self, rt, settings, config):
        config["linux"]["readonlyPaths"].extend(settings["paths"])

    def released(self, rt):
        ReadOnlyPaths.released_ids.append(rt.id)


class CgroupBpfOnly(SecurityPolicy):
    """A policy that works only through an enforcement point the container backend lacks."""

    name = "cgroup-bpf-only"
    targets = frozenset({"cgroup-bpf"})


class LabelNetwork(SecurityPolicy):
    """Stands in for an allowlist policy: declares the mode and marks the sandbox it applies
    to, so the test sees the node route ``network="allowlist"`` to it."""

    name = "label-network"
    targets = frozenset({"oci"})
    network_modes = frozenset({"allowlist"})

    def apply_oci(self, rt, settings, config):
        config["hostname"] = f"allowlist-{','.join(settings['allow'])}"


class RecordPlacement:
    seen: list = []

    @hookimpl
    def dsec_place(self, request, nodes):
        RecordPlacement.seen.append((request, list(nodes)))
        return None  # no opinion: core's best-of-k decides


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


class HostnameByDefault(SecurityPolicy):
    """A default policy: every sandbox gets it unless its spec turns it off."""

    name = "hostname-default"
    targets = frozenset({"oci"})
    default = True

    def apply_oci(self, rt, settings, config):
        config["hostname"] = "by-default"


class LiveMarker(SecurityPolicy):
    """A live policy: its settings land in the sandbox at start and again on each update, and
    it counts updates (its stats)."""

    name = "live-marker"
    targets = frozenset({"oci"})
    live = True
    updates: dict[str, int] = {}

    def validate(self, settings):
        if not isinstance(settings.get("mark"), str):
            raise InvalidSpec("live-marker needs mark: a string")

    def apply_oci(self, rt, settings, config):
        self.update(rt, settings)

    def update(self, rt, settings):
        (rt.data_dir / "upper" / "mark").write_text(settings["mark"])
        LiveMarker.updates[rt.id] = LiveMarker.updates.get(rt.id, 0) + 1

    def stats(self, rt):
        return {"updates": LiveMarker.updates.get(rt.id, 0)}


class NeverHere(SecurityPolicy):
    """A policy this host can never run, with settings of its own to get wrong."""

    name = "never-here"
    targets = frozenset({"oci"})

    @classmethod
    def check_available(cls):
        raise PolicyUnavailable("never-here needs a kernel this host does not have")

    def validate(self, settings):
        if set(settings) - {"level"}:
            raise InvalidSpec("never-here takes only level", field="policies.never-here")


class PolicyAndSourcePlugin:
    @hookimpl
    def dsec_register_security_policies(self, register):
        for policy in (
            ReadOnlyPaths,
            CgroupBpfOnly,
            LabelNetwork,
            HostnameByDefault,
            LiveMarker,
            NeverHere,
        ):
            register(policy)

    @hookimpl
    def dsec_register_layer_sources(self, register):
        register(ElsewhereSource)


@pytest.fixture
def node_with_plugin():
    plugins.reset()
    plugins.get_plugin_manager().register(PolicyAndSourcePlugin(), name="test_plugin")
    plugins.get_plugin_manager().register(RecordPlacement(), name="record_placement")
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


async def test_policies_apply_only_to_the_sandboxes_that_ask(node_with_plugin):
    node = Node(node_with_plugin)
    await node.open()
    try:
        plain = await node.create(SandboxSpec(layers=("kit-base@1",), memory="64M"))
        assert (await node.exec(plain.id, "echo x > /etc/new-file")).exit_code == 0
        guarded = await node.create(
            SandboxSpec(
                layers=("kit-base@1",),
                memory="64M",
                policies={"readonly-paths": {"paths": ["/etc", "/root"]}},
            )
        )
        for path in ("/etc/new-file", "/root/new-file"):
            r = await node.exec(guarded.id, f"echo x > {path}")
            assert r.exit_code != 0 and b"Read-only" in r.stderr, path
        assert (await node.exec(guarded.id, "echo x > /tmp/ok")).exit_code == 0
        await node.kill(guarded.id)
        assert guarded.id in ReadOnlyPaths.released_ids
        assert plain.id not in ReadOnlyPaths.released_ids
        await node.kill(plain.id)
        # the placement hooks saw every create, with this node's load
        request, nodes = RecordPlacement.seen[-1]
        assert [n.node for n in nodes] == [str(node_with_plugin.home)]
        assert request.policies == {"readonly-paths": {"paths": ["/etc", "/root"]}}
    finally:
        await node.close(kill_all=True)


async def test_a_policy_that_cannot_be_enforced_fails_the_create_and_leaves_nothing(
    node_with_plugin,
):
    node = Node(node_with_plugin)
    await node.open()
    try:
        with pytest.raises(PolicyUnavailable) as e:
            await node.create(
                SandboxSpec(layers=("kit-base@1",), memory="64M", policies={"cgroup-bpf-only": {}})
            )
        assert e.value.policy == "cgroup-bpf-only" and e.value.backend == "container"
        assert "cgroup-bpf" in str(e.value) and "oci" in str(e.value)
        with pytest.raises(UnknownPolicy) as e2:
            await node.create(SandboxSpec(layers=("kit-base@1",), policies={"nope": {}}))
        assert "readonly-paths" in str(e2.value)  # names the known ones
        with pytest.raises(InvalidSpec):
            await node.create(
                SandboxSpec(layers=("kit-base@1",), policies={"readonly-paths": {"paths": "etc"}})
            )
        assert node.sandboxes == {}
        assert list(node_with_plugin.sandbox_dir.iterdir()) == []
        assert list(node_with_plugin.runtime_dir.iterdir()) == []
    finally:
        await node.close(kill_all=True)


async def test_network_modes_are_enforced_by_a_policy_or_refused(node_with_plugin):
    node = Node(node_with_plugin)
    await node.open()
    try:
        with pytest.raises(PolicyUnavailable) as e:
            await node.create(SandboxSpec(layers=("kit-base@1",), network="allowlist"))
        assert "label-network" in str(e.value)  # says which loaded policy could do it
        with pytest.raises(PolicyUnavailable):
            await node.create(SandboxSpec(layers=("kit-base@1",), network="wide-open"))
        sb = await node.create(
            SandboxSpec(
                layers=("kit-base@1",),
                memory="64M",
                network="allowlist",
                policies={
                    "label-network": {"allow": ["pypi.org:443/tcp"]},
                    "hostname-default": {"enabled": False},  # it would set the hostname too
                },
            )
        )
        # PID 1's environment (the OCI config's) is out of the sandbox's reach; the config's
        # hostname is in plain sight
        r = await node.exec(sb.id, "hostname")
        assert r.stdout == b"allowlist-pypi.org:443/tcp\n"
        await node.kill(sb.id)
    finally:
        await node.close(kill_all=True)


async def test_a_second_layer_source(node_with_plugin):
    node = Node(node_with_plugin)
    await node.open()
    try:
        # a layer found only in the second source
        other = await node.create(SandboxSpec(layers=("only-elsewhere@2",), memory="64M"))
        assert (await node.exec(other.id, "echo from-elsewhere")).stdout == b"from-elsewhere\n"
        await node.kill(other.id)
    finally:
        await node.close(kill_all=True)


async def test_default_policies_apply_unless_turned_off_and_best_effort_skips(node_with_plugin):
    node = Node(node_with_plugin)
    await node.open()
    try:
        plain = await node.create(SandboxSpec(layers=("kit-base@1",), memory="64M"))
        assert (await node.exec(plain.id, "hostname")).stdout == b"by-default\n"
        # installed plugins may bring default policies of their own (seccomp): those only
        others = {n for n, c in node.registry.security_policies.items() if c.default}
        assert plain.policies["hostname-default"] == "enforced"
        assert set(plain.policies) - {"hostname-default"} <= others - {"hostname-default"}
        off = await node.create(
            SandboxSpec(
                layers=("kit-base@1",),
                memory="64M",
                policies={
                    "hostname-default": {"enabled": False},
                    "cgroup-bpf-only": {"best_effort": True},
                },
            )
        )
        assert (await node.exec(off.id, "hostname")).stdout != b"by-default\n"
        assert off.policies["hostname-default"].startswith("off:")
        assert off.policies["cgroup-bpf-only"].startswith("skipped:")
        assert "cgroup-bpf" in off.policies["cgroup-bpf-only"]
        # what the node reports is what is in force
        states = {p.name: p.state for p in node.policy_states(off.id)}
        assert states == off.policies
        await node.kill(plain.id)
        await node.kill(off.id)
    finally:
        await node.close(kill_all=True)


async def test_a_live_policy_changes_on_a_running_sandbox_and_survives_a_restart(node_with_plugin):
    node = Node(node_with_plugin)
    await node.open()
    try:
        sb = await node.create(
            SandboxSpec(
                layers=("kit-base@1",), memory="64M", policies={"live-marker": {"mark": "one"}}
            )
        )
        assert (await node.exec(sb.id, "cat /mark")).stdout == b"one"
        state = node.set_policy(sb.id, "live-marker", {"mark": "two"})
        assert state.settings == {"mark": "two"} and state.stats == {"updates": 2}
        assert (await node.exec(sb.id, "cat /mark")).stdout == b"two"
        with pytest.raises(InvalidSpec):
            node.set_policy(sb.id, "live-marker", {"mark": 3})
        with pytest.raises(PolicyUnavailable):  # in force, but not live
            node.set_policy(sb.id, "hostname-default", {})
        with pytest.raises(PolicyUnavailable):  # not in force on this sandbox
            node.set_policy(sb.id, "readonly-paths", {"paths": ["/etc"]})
        await node.close()  # the daemon goes; the sandbox stays
        node = Node(node_with_plugin)
        await node.open()
        states = {p.name: p for p in node.policy_states(sb.id)}
        assert states["live-marker"].settings == {"mark": "two"}  # as last set, not as created
        await node.kill(sb.id)
    finally:
        await node.close(kill_all=True)


async def test_bad_settings_are_typed_even_where_the_policy_cannot_run(node_with_plugin):
    node = Node(node_with_plugin)
    await node.open()
    try:
        spec = {"layers": ("kit-base@1",), "memory": "64M"}
        with pytest.raises(PolicyUnavailable) as e:  # asked for, not available: refused
            await node.create(SandboxSpec(**spec, policies={"never-here": {"level": 1}}))
        assert "kernel" in str(e.value)
        for best_effort in (False, True):  # bad settings are the caller's mistake anywhere
            with pytest.raises(InvalidSpec) as e2:
                await node.create(
                    SandboxSpec(
                        **spec, policies={"never-here": {"levle": 1, "best_effort": best_effort}}
                    )
                )
            assert e2.value.field == "policies.never-here"
        sb = await node.create(
            SandboxSpec(**spec, policies={"never-here": {"level": 1, "best_effort": True}})
        )
        assert (
            sb.policies["never-here"].startswith("skipped:")
            and "kernel" in sb.policies["never-here"]
        )
        await node.kill(sb.id)
        assert node.sandboxes == {} and list(node_with_plugin.sandbox_dir.iterdir()) == []
    finally:
        await node.close(kill_all=True)
