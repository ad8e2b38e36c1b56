"""Plugins that fail, fail alone: a plugin that does not import, was written for another plugin
API, implements hooks dsec does not have, or raises while registering or adding commands is
listed by ``dsec plugins`` with its error and skipped; every other command and plugin works,
and a node refuses to start only when its configuration names what such a plugin would offer.

The broken plugins are one installed distribution, ``dsec-test-broken``, made here as pip
would leave it (a ``.dist-info`` with entry points in the ``dsec`` group) on ``PYTHONPATH``; the
plugins written for other dsec versions are a distribution each (``RANGES``), since the range
is their distribution's ``Requires-Dist``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from packaging.requirements import Requirement

from dsec_core import __version__, plugins
from dsec_core.config import NodeConfig
from dsec_core.errors import (
    NodeUnavailable,
    PluginApiMismatch,
    PluginVersionMismatch,
    UnknownBackend,
    UnknownSource,
)
from dsec_core.hookspecs import hookimpl
from dsec_core.localnode import ensure_daemon, stop_daemon
from dsec_core.testing import running_kit_node

#: entry point -> its module's source
BROKEN = {
    "broken_import": "import dsec_no_such_module_xyz  # noqa\n",
    "broken_first_contract": (
        "# written for the first contract: no DSEC_PLUGIN_API\n"
        "from dsec_core.hookspecs import hookimpl\n\n"
        "@hookimpl\ndef dsec_register_commands(cli):\n    pass\n"
    ),
    "broken_future_api": (
        "from dsec_core.hookspecs import hookimpl\n\nDSEC_PLUGIN_API = 3\n\n"
        "@hookimpl\ndef dsec_register_commands(cli):\n    pass\n"
    ),
    "broken_unknown_hook": (
        "from dsec_core.hookspecs import hookimpl\n\nDSEC_PLUGIN_API = 2\n\n"
        "@hookimpl\ndef dsec_register_sandboxes(register):\n    pass\n"
    ),
    "broken_register": (
        "from dsec_core.hookspecs import hookimpl\n\nDSEC_PLUGIN_API = 2\n\n"
        "@hookimpl\ndef dsec_register_layer_sources(register):\n"
        "    raise RuntimeError('the vault service is not configured')\n"
    ),
    # the first contract's home of the layer-source base classes
    "broken_moved": "from dsec_core.layers.source import BlobStoreSource  # noqa\n",
    # written for this API, and still importing what dsec does not have: its own bug
    "broken_current_import": (
        "DSEC_PLUGIN_API = 2\nfrom dsec_core.backend import NoSuchName  # noqa\n"
    ),
}
#: what each one's error says
SAYS = {
    "broken_import": "does not import: ModuleNotFoundError",
    "broken_first_contract": "written for dsec plugin API 1 (it declares no DSEC_PLUGIN_API)",
    "broken_future_api": "written for dsec plugin API 3, newer than this dsec's 2",
    "broken_unknown_hook": "implements hooks dsec does not have: dsec_register_sandboxes",
    "broken_register": "RuntimeError: the vault service is not configured",
    "broken_moved": "written for dsec plugin API 1 (it declares no DSEC_PLUGIN_API)",
    "broken_current_import": "does not import: ImportError: cannot import name 'NoSuchName'",
}
MIGRATION = "Migrating a plugin written before this change"


def broken_site(root: Path) -> Path:
    """A directory holding the ``dsec-test-broken`` distribution, as installed."""
    site = root / "site"
    for name, text in BROKEN.items():
        (site / f"dsec_test_{name}").mkdir(parents=True)
        (site / f"dsec_test_{name}" / "__init__.py").write_text(text)
    info = site / "dsec_test_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsec-test-broken\nVersion: 0.1\n")
    eps = "".join(f"{name} = dsec_test_{name}\n" for name in BROKEN)
    (info / "entry_points.txt").write_text(f"[dsec]\n{eps}")
    return site


#: distribution ``dsec-test-NAME`` -> its Requires-Dist lines and whether its plugin loads: the
#: plugin itself (``ranged_NAME``) is sound, only the dsec versions it says it fits differ
RANGES = {
    "elder": (["dsec[node]<0.1,>=0.0.1"], False),
    "newer": (["dsec>=0.2"], False),
    # its extras' requirements are not its own: the test extra's dsec>=9 refuses nothing
    "fitting": (["dsec[node]<0.2,>=0.1", 'dsec[node]>=9; extra == "test"'], True),
    "unranged": (["dsec"], True),  # it gives no range: nothing to refuse it for
}
RANGED_PLUGIN = (
    "from dsec_core.hookspecs import hookimpl\n\nDSEC_PLUGIN_API = 2\n\n"
    "@hookimpl\ndef dsec_register_commands(cli):\n    pass\n"
)


def ranged_site(root: Path) -> Path:
    """A directory holding the ``RANGES`` distributions, as installed."""
    site = root / "ranged-site"
    for name, (requires, _) in RANGES.items():
        (site / f"dsec_test_ranged_{name}").mkdir(parents=True)
        (site / f"dsec_test_ranged_{name}" / "__init__.py").write_text(RANGED_PLUGIN)
        info = site / f"dsec_test_{name}-0.1.dist-info"
        info.mkdir()
        lines = "".join(f"Requires-Dist: {r}\n" for r in requires)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: dsec-test-{name}\nVersion: 0.1\n{lines}"
        )
        (info / "entry_points.txt").write_text(f"[dsec]\nranged_{name} = dsec_test_ranged_{name}\n")
    return site


def dsec(*args: str, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DSEC_PLUGINS"}
    env["PYTHONPATH"] = os.fspath(site)
    return subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_lists_broken_plugins_and_goes_on(tmp_path):
    site = broken_site(tmp_path)
    out = dsec("plugins", "--json", site=site, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    shown = {p["name"]: p for p in data["plugins"]}
    for name, words in SAYS.items():
        assert shown[name]["error"] and words in shown[name]["error"], shown[name]
        assert shown[name]["hooks"] == [] and shown[name]["distribution"] == "dsec-test-broken"
        assert name in out.stderr  # said once, on stderr, by every command
    assert MIGRATION in shown["broken_first_contract"]["error"]
    assert MIGRATION in shown["broken_moved"]["error"]
    assert MIGRATION not in shown["broken_current_import"]["error"]
    assert shown["broken_first_contract"]["api"] == 1
    # everything else is there
    assert shown["backend_container"]["error"] is None and shown["backend_container"]["api"] == 2
    assert {"container", "fncall"} <= set(data["backends"])
    assert {"local", "posix", "s3", "oci"} <= set(data["layer_sources"])
    assert "seccomp" in data["security_policies"]
    table = dsec("plugins", site=site, cwd=tmp_path)
    assert table.returncode == 0 and "failed" in table.stdout and "broken_import" in table.stdout
    # other commands work: the builder plugin's commands among them
    helped = dsec("--help", site=site, cwd=tmp_path)
    assert helped.returncode == 0 and "build" in helped.stdout, helped.stderr
    made = dsec("plugin", "new", "source", "vault", "--dir", "pkgs", site=site, cwd=tmp_path)
    assert made.returncode == 0 and (tmp_path / "pkgs" / "dsec-layer-vault").is_dir()


def test_an_api_mismatch_is_typed_and_points_at_the_migration_section(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(broken_site(tmp_path))
    monkeypatch.delenv("DSEC_PLUGINS", raising=False)
    plugins.reset()
    try:
        failures = {f.plugin: f for f in plugins.registry().failures}
        for name in ("broken_first_contract", "broken_future_api"):
            error = failures[name].error
            assert isinstance(error, PluginApiMismatch) and failures[name].stage == "api"
            assert error.supported == plugins.PLUGIN_API and error.see == plugins.MIGRATION
        assert failures["broken_first_contract"].error.declared == 1
        assert failures["broken_future_api"].error.declared == 3
        assert failures["broken_import"].stage == "import"
        moved = failures["broken_moved"]
        assert moved.stage == "api" and moved.error.missing == "dsec_core.layers.source"
        assert "No module named 'dsec_core.layers.source'" in str(moved.error)
        assert failures["broken_current_import"].stage == "import"
        assert failures["broken_unknown_hook"].stage == "hooks"
        assert failures["broken_register"].stage == "register"
        pm = plugins.get_plugin_manager()
        assert all(pm.get_plugin(name) is None for name in BROKEN)  # skipped whole
        page = Path(__file__).parents[1] / "docs" / "plugins" / "migrating.md"
        assert page.read_text().startswith(f"# {MIGRATION}\n") and "migrating.md" in error.see
    finally:
        plugins.reset()


def test_a_plugin_written_for_other_dsec_versions_is_refused_before_it_imports(
    tmp_path, monkeypatch
):
    site = ranged_site(tmp_path)
    monkeypatch.syspath_prepend(site)
    monkeypatch.delenv("DSEC_PLUGINS", raising=False)
    plugins.reset()
    try:
        failures = {f.plugin: f for f in plugins.registry().failures}
        pm = plugins.get_plugin_manager()
        for name, (requires, loads) in RANGES.items():
            plugin = f"ranged_{name}"
            assert (pm.get_plugin(plugin) is not None) is loads, name
            assert (plugin in failures) is not loads, name
            if loads:
                continue
            failure = failures[plugin]
            error = failure.error
            assert failure.stage == "version" and isinstance(error, PluginVersionMismatch)
            assert failure.distribution == f"dsec-test-{name}"
            assert (error.plugin, error.running) == (plugin, __version__)
            assert error.requires == str(Requirement(requires[0]).specifier)
            assert f"{error.requires} (its distribution requires it)" in str(error)
            assert f"this is dsec {__version__}" in str(error)
            assert f"dsec_test_ranged_{name}" not in sys.modules  # refused unimported
        assert plugins.registry().backends  # everything else is there
    finally:
        plugins.reset()
    # the CLI lists them with why, and goes on
    out = dsec("plugins", "--json", site=site, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shown = {p["name"]: p for p in json.loads(out.stdout)["plugins"]}
    assert "written for dsec <0.1,>=0.0.1" in shown["ranged_elder"]["error"]
    assert shown["ranged_elder"]["dsec"] == "<0.1,>=0.0.1" and shown["ranged_elder"]["hooks"] == []
    assert shown["ranged_fitting"]["error"] is None and shown["ranged_fitting"]["dsec"]
    assert shown["ranged_unranged"]["error"] is None and shown["ranged_unranged"]["dsec"] == ""
    assert "ranged_newer" in out.stderr and "written for dsec >=0.2" in out.stderr


class _Commands:
    def __init__(self, name: str, fail: bool) -> None:
        self.command, self.fail = name, fail

    @hookimpl
    def dsec_register_commands(self, cli):
        cli.add_command(click.Command(self.command, callback=lambda: None))
        if self.fail:
            raise RuntimeError("half-way through")


def test_a_plugin_whose_commands_fail_adds_none():
    plugins.reset()
    pm = plugins.get_plugin_manager()
    pm.register(_Commands("half-made", fail=True), name="half")
    pm.register(_Commands("whole", fail=False), name="whole")
    try:
        group = click.Group()
        plugins.register_commands(group)
        assert "whole" in group.commands and "half-made" not in group.commands
        (failure,) = [f for f in plugins.failures() if f.plugin == "half"]
        assert failure.stage == "commands" and "half-way through" in str(failure.error)
        assert pm.get_plugin("half") is None
    finally:
        plugins.reset()


class _RaisingSource:
    @hookimpl
    def dsec_register_layer_sources(self, register):
        raise RuntimeError("no vault configured")


def test_a_node_config_naming_what_failed_is_refused(tmp_path, monkeypatch):
    plugins.reset()
    plugins.get_plugin_manager().register(_RaisingSource(), name="layer_vault")
    try:
        reg = plugins.registry()
        reg.check_node_config(NodeConfig(home=tmp_path, layer_sources=("local", "posix:/x")))
        with pytest.raises(UnknownSource) as e:
            reg.check_node_config(NodeConfig(home=tmp_path, layer_sources=("local", "vault:/x")))
        assert "'vault'" in str(e.value) and "no vault configured" in str(e.value)
        assert e.value.failed == ["layer_vault"]
        reg.check_node_config(NodeConfig(home=tmp_path, runtime="runsc"))  # the container's
    finally:
        plugins.reset()
    monkeypatch.setenv("DSEC_PLUGINS", "layer_posix")
    plugins.reset()
    try:
        with pytest.raises(UnknownBackend) as e:
            plugins.registry().check_node_config(NodeConfig(home=tmp_path, runtime="runsc"))
        assert "DSEC_RUNTIME='runsc'" in str(e.value)
    finally:
        plugins.reset()


@pytest.mark.skipif(os.geteuid() != 0, reason="a node needs root")
def test_a_node_goes_on_without_broken_plugins_unless_its_config_names_one(tmp_path):
    site = broken_site(tmp_path)
    path = os.pathsep.join(p for p in (os.fspath(site), os.environ.get("PYTHONPATH")) if p)
    with pytest.MonkeyPatch.context() as mp:  # what the daemon inherits as it starts
        mp.setenv("PYTHONPATH", path)
        mp.delenv("DSEC_PLUGINS", raising=False)
        with running_kit_node("dsec-broken-") as node:
            with node.client() as c:
                sb = c.create(layers=(node.layer.ref,), backend="container")
                assert sb.exec("echo fine").stdout == b"fine\n"
                sb.kill()
            log = node.config.log_path.read_text()
            assert "broken_register" in log and "it is skipped" in log
        # a node whose layer sources name the scheme the broken plugin would have offered
        mp.setenv("DSEC_LAYER_SOURCES", "local,vault:/srv/layers")
        home = Path(node.home.parent) / f"{node.home.name}-refused"
        config = NodeConfig(home=home)
        try:
            with pytest.raises(NodeUnavailable) as e:
                ensure_daemon(config)
            assert "unknown layer source scheme 'vault'" in str(e.value)
            assert "the vault service is not configured" in str(e.value)
        finally:
            stop_daemon(config)
            subprocess.run(["umount", "-R", os.fspath(config.run_dir)], capture_output=True)
            shutil.rmtree(home)
