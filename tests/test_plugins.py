"""The plugin core: hookspecs are documented, shipped plugins load through entry points, and a
third-party plugin registered the same way is picked up."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pluggy
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from dsec_core import hookspecs, plugins
from dsec_core.backend import Backend
from dsec_core.errors import PluginInvalid, UnknownBackend, UnknownSource
from dsec_core.records import NodeLoad, SandboxSpec

HOOKS = [
    name
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
    if name.startswith("dsec_")
]


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_is_documented(name):
    fn = getattr(hookspecs, name)
    assert fn.__doc__ and fn.__doc__.strip(), f"hook {name} has no docstring"


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_is_tested(name):
    # datasette's rule: a hook no test implements or calls is a hook nobody knows works.
    import pathlib

    here = pathlib.Path(__file__).parent
    uses = [
        p
        for p in here.glob("test_*.py")
        if f"def {name}(" in p.read_text() or f"hook.{name}(" in p.read_text()
    ]
    assert uses, f"hook {name} is not exercised by any test"


def test_placement_is_firstresult():
    assert hookspecs.dsec_place.dsec_spec["firstresult"] is True


def test_shipped_plugins_load_through_entry_points():
    descs = {d["name"]: d for d in plugins.plugin_descriptions()}
    assert descs["backend_container"]["hooks"] == ["dsec_register_backends"]
    assert descs["backend_container"]["distribution"] == "dsec-backend-container"
    assert descs["layer_posix"]["hooks"] == ["dsec_register_layer_sources"]
    assert descs["layer_posix"]["version"]
    # core's own plugins: the node's store as the "local" source, best-of-k placement
    assert descs["core_local_source"]["hooks"] == ["dsec_register_layer_sources"]
    assert descs["core_placement"]["hooks"] == ["dsec_place"]
    assert descs["core_placement"]["distribution"] == "dsec"
    reg = plugins.registry()
    assert "container" in reg.backends and "local" in reg.layer_sources


def test_every_shipped_plugin_declares_the_dsec_versions_it_was_written_for():
    """Each plugin and builder requires ``dsec[node]`` within this release's series
    (``release_range``): in its pyproject, in its installed metadata, and in ``dsec plugins``."""
    repo = Path(__file__).resolve().parents[1]
    series = SpecifierSet(plugins.release_range())
    assert plugins.__version__ in series
    projects = sorted(
        [*repo.glob("plugins/*/pyproject.toml"), *repo.glob("builders/*/pyproject.toml")]
    )
    assert len(projects) >= 12
    for path in projects:
        project = tomllib.loads(path.read_text())["project"]
        (dsec,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "dsec"]
        # a client-side integration (no dsec entry point: plugins/harbor) needs the client only
        client_side = "dsec" not in project.get("entry-points", {})
        assert dsec.extras == (set() if client_side else {"node"}), path
        assert dsec.specifier == series, path
        assert plugins.dsec_range(importlib.metadata.distribution(project["name"])) == series
    descs = plugins.plugin_descriptions()
    shipped = [d for d in descs if d["distribution"] not in (None, "dsec")]
    assert shipped and all(SpecifierSet(d["dsec"]) == series for d in shipped), shipped


def test_the_release_range_is_the_version_series():
    assert plugins.release_range("0.1.0") == ">=0.1,<0.2"
    assert plugins.release_range("0.3.2rc1") == ">=0.3,<0.4"
    assert plugins.release_range("1.2.3") == ">=1.2,<2"


def test_cli_plugins_json():
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "plugins", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout)
    names = {p["name"]: p for p in data["plugins"]}
    assert {"backend_container", "layer_posix", "core_local_source"} <= set(names)
    assert all(p["version"] for p in names.values())
    assert "container" in data["backends"] and "local" in data["layer_sources"]


def test_env_var_limits_plugins_but_core_always_loads(monkeypatch):
    monkeypatch.setenv("DSEC_PLUGINS", "layer_posix")
    plugins.reset()
    try:
        assert [d["name"] for d in plugins.plugin_descriptions()] == [
            "core_local_source",
            "core_placement",
            "layer_posix",
        ]
        with pytest.raises(UnknownBackend) as e:
            plugins.registry().backend("container")
        assert "container" in str(e.value)
        # a node limited to other plugins still sees its own layers
        assert plugins.registry().open_source("local").local
    finally:
        monkeypatch.delenv("DSEC_PLUGINS")
        plugins.reset()


class _ThirdPartyBackend(Backend):
    name = "third-party"

    async def start(self, rt):
        return {}

    async def alive(self, rt, state):
        return False

    async def stop(self, rt, state):
        pass


class _ThirdPartyPlugin:
    @plugins.hookspecs.hookimpl
    def dsec_register_backends(self, register):
        register(_ThirdPartyBackend)

    @plugins.hookspecs.hookimpl
    def dsec_place(self, request, nodes):
        # this plugin prefers the *most* loaded node (bin packing), unlike core's best-of-k
        return max(nodes, key=lambda n: n.load) if nodes else None

    @plugins.hookspecs.hookimpl
    def dsec_register_commands(self, cli):
        import click

        @cli.command("hello-plugin")
        def hello():
            click.echo("hello from a plugin")


def test_third_party_plugin_registers():
    plugins.reset()
    pm = plugins.get_plugin_manager()
    pm.register(_ThirdPartyPlugin(), name="third_party")
    try:
        plugins.registry.cache_clear()
        assert plugins.registry().backend("third-party") is _ThirdPartyBackend
        nodes = [_load("a", 0.9), _load("b", 0.1)]
        picked = pm.hook.dsec_place(request=SandboxSpec(layers=("x@1",)), nodes=nodes)
        assert picked.node == "a"  # firstresult: one answer, the plugin's, before core's
        assert plugins.place(SandboxSpec(layers=("x@1",)), nodes).node == "a"
        import click

        group = click.Group()
        pm.hook.dsec_register_commands(cli=group)
        assert "hello-plugin" in group.commands
        with pytest.raises(UnknownSource) as e:
            plugins.registry().layer_source("ftp")
        assert "local" in str(e.value)
    finally:
        plugins.reset()


def _load(name: str, fraction: float) -> NodeLoad:
    return NodeLoad(
        node=name,
        backends=("container",),
        cpu_capacity=100.0,
        cpu_committed=100.0 * fraction,
        memory_capacity=1 << 30,
        memory_committed=0,
    )


def test_registering_a_class_that_breaks_the_contract_is_typed_and_fails_alone():
    class NotABackend:
        name = "nope"

    class BadFeatures(_ThirdPartyBackend):
        name = "bad-features"
        features = frozenset({"gpu-teleport"})

    for offered, words in ((NotABackend, "not a subclass"), (BadFeatures, "gpu-teleport")):

        class Plugin:
            @plugins.hookspecs.hookimpl
            def dsec_register_backends(self, register, _cls=offered):
                register(_cls)

        plugins.reset()
        plugins.get_plugin_manager().register(Plugin(), name="breaks_contract")
        try:
            reg = plugins.registry()  # the others load
            (failure,) = [f for f in reg.failures if f.plugin == "breaks_contract"]
            assert failure.stage == "register" and isinstance(failure.error, PluginInvalid)
            assert words in str(failure.error) and "'breaks_contract'" in str(failure.error)
            assert plugins.get_plugin_manager().get_plugin("breaks_contract") is None
            assert "container" in reg.backends and offered.name not in reg.backends
            with pytest.raises(UnknownBackend) as e:
                reg.backend(offered.name)
            assert words in str(e.value) and e.value.failed == ["breaks_contract"]
        finally:
            plugins.reset()


def test_two_plugins_claiming_one_name_both_lose_it():
    class Twin(_ThirdPartyBackend):
        name = "container"  # the shipped runc backend's name

    class Plugin:
        @plugins.hookspecs.hookimpl
        def dsec_register_backends(self, register):
            register(Twin)
            register(_ThirdPartyBackend)

    plugins.reset()
    plugins.get_plugin_manager().register(Plugin(), name="twin")
    try:
        reg = plugins.registry()
        assert "container" not in reg.backends  # neither: which one a node meant is unknown
        assert reg.backends["third-party"] is _ThirdPartyBackend  # the rest of it stands
        assert "fncall" in reg.backends
        lost = {f.plugin: f for f in reg.failures if f.stage == "conflict"}
        assert set(lost) == {"twin", "backend_container"}
        assert not any(f.skipped for f in lost.values())
        with pytest.raises(UnknownBackend) as e:
            reg.backend("container")
        assert "'container'" in str(e.value) and "Twin" in str(e.value)
        assert "neither is used" in str(e.value)
        descs = {d["name"]: d for d in plugins.plugin_descriptions()}
        assert descs["twin"]["hooks"] == ["dsec_register_backends"]
        said = descs["twin"]["error"]
        assert "conflict: two plugins register a backend named 'container'" in said
    finally:
        plugins.reset()


def test_unimplemented_hookimpl_is_rejected():
    class Bad:
        @plugins.hookspecs.hookimpl
        def dsec_not_a_hook(self):
            pass

    plugins.reset()
    pm = plugins.get_plugin_manager()
    pm.register(Bad(), name="bad")
    try:
        with pytest.raises(pluggy.PluginValidationError):
            pm.check_pending()
    finally:
        plugins.reset()
