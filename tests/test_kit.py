"""The conformance kit's own rules: a backend kit names its backend (there is no default), a
test outside a kit class says which backend its sandboxes use, loading the kit twice is
harmless, and the kit's nodes live where configuration says."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsec_core.backend import Feature
from dsec_core.errors import PluginInvalid
from dsec_core.testing import (
    BackendConformance,
    SecurityPolicyConformance,
    kit_home_parent,
    running_kit_node,
)

#: The backend contract's page, whose feature table must have a row per ``Feature``.
BACKENDS = Path(__file__).resolve().parents[1] / "docs" / "plugins" / "backends.md"


@pytest.mark.parametrize("feature", list(Feature), ids=lambda f: f.name)
def test_every_feature_is_documented_and_checked(feature):
    # datasette's rule, for the backend contract: a feature nobody documents or checks is a
    # promise nobody can rely on.
    rows = [
        line
        for line in BACKENDS.read_text().splitlines()
        if line.startswith(f"| `{feature.name}` | `{feature.value}` |")
    ]
    assert rows, f"the feature table of {BACKENDS.name} has no row for {feature.name}"
    checks = [
        name
        for name, fn in inspect.getmembers(BackendConformance, inspect.isfunction)
        if name.startswith("test_")
        and re.search(rf"self\.need\([^)]*Feature\.{feature.name}\b", inspect.getsource(fn))
    ]
    assert checks, f"no kit check needs Feature.{feature.name}"


def test_a_backend_kit_without_backend_name_fails_at_class_creation():
    with pytest.raises(PluginInvalid) as e:

        class TestForgotTheName(BackendConformance):
            pass

    assert "backend_name" in str(e.value) and "TestForgotTheName" in str(e.value)


def test_an_abstract_base_leaves_the_name_to_its_subclasses():
    class MyChecks(BackendConformance, abstract=True):
        def test_extra(self):
            pass

    class TestMine(MyChecks):
        backend_name = "container"

    assert TestMine.backend_name == "container"
    with pytest.raises(PluginInvalid):

        class TestNamesNothing(MyChecks):
            pass


def test_a_policy_kit_names_its_policy_or_is_abstract():
    with pytest.raises(PluginInvalid) as e:

        class TestForgotThePolicy(SecurityPolicyConformance):
            backend_name = "container"

    assert "policy_name" in str(e.value) and "TestForgotThePolicy" in str(e.value)

    class MyPolicyChecks(SecurityPolicyConformance, abstract=True):
        backend_name = "container"

    class TestSeccompToo(MyPolicyChecks):
        policy_name = "seccomp"

    assert TestSeccompToo().policy_class().name == "seccomp"


def test_kit_home_follows_configuration(monkeypatch, tmp_path):
    monkeypatch.delenv("DSEC_KIT_HOME", raising=False)
    monkeypatch.delenv("DSEC_HOME", raising=False)
    assert kit_home_parent() == Path(tempfile.gettempdir())
    monkeypatch.setenv("DSEC_HOME", os.fspath(tmp_path / "home"))
    assert kit_home_parent() == tmp_path / "home"
    monkeypatch.setenv("DSEC_KIT_HOME", os.fspath(tmp_path / "kit"))
    assert kit_home_parent() == tmp_path / "kit"


@pytest.mark.skipif(os.geteuid() != 0, reason="a node needs root")
def test_a_kit_node_lives_in_DSEC_KIT_HOME_and_leaves_it_empty(monkeypatch):
    # not under tmp_path: pytest makes it 0700, and a sandbox's root must reach its rootfs
    parent = Path(tempfile.mkdtemp(prefix="dsec-kit-parent-"))
    os.chmod(parent, 0o755)
    monkeypatch.setenv("DSEC_KIT_HOME", os.fspath(parent))
    try:
        with running_kit_node() as node:
            assert node.home.parent == parent and node.home.name.startswith("dsec-kit-")
            assert node.config.socket_path.is_socket()
        assert list(parent.iterdir()) == []
    finally:
        parent.rmdir()


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="a node needs root")
def test_sandboxes_outside_a_kit_class_must_name_their_backend(tmp_path):
    (tmp_path / "test_no_backend.py").write_text(
        "def test_makes_a_sandbox(dsec_sandboxes):\n    dsec_sandboxes.create()\n"
    )
    out = _pytest(tmp_path, "-p", "dsec_core.testing", "test_no_backend.py")
    assert out.returncode != 0
    assert "backend_name" in out.stdout and "dsec_backend_name" in out.stdout, out.stdout
    assert "1 error" in out.stdout


def test_loading_the_kit_twice_is_harmless(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["dsec_core.testing"]\n')
    (tmp_path / "test_twice.py").write_text(
        "def test_loaded(request):\n"
        "    assert request.config.pluginmanager.get_plugin('dsec_core.testing')\n"
    )
    out = _pytest(tmp_path, "-p", "dsec_core.testing", "test_twice.py")
    assert out.returncode == 0, out.stdout + out.stderr
