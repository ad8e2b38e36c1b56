"""``dsec plugin new``: the packages it writes install offline and pass their conformance kits
as generated, as a third party would run them; bad names and existing directories are typed
errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsec_core.cli.plugin import plugin_skeleton, write_plugin
from dsec_core.errors import InvalidSpec
from dsec_core.plugins import release_range


def dsec(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def install(pkg: Path, site: Path) -> None:
    """What a third party does, offline: build and install the package (entry point included)
    from the tree as generated."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            os.fspath(site),
            os.fspath(pkg),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"pip install {pkg.name} failed:\n{out.stdout}\n{out.stderr}"


def run_kit(pkg: Path, site: Path) -> subprocess.CompletedProcess:
    """``pytest <pkg>/tests`` from the directory above it, with only the installed copy on the
    path (the kit's daemon inherits the environment, so it loads the new entry point too). The
    package's own pyproject opts into the kit."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "DSEC_PLUGINS") and not k.startswith("PYTEST_")
    }
    env["PYTHONPATH"] = os.fspath(site)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", os.fspath(pkg / "tests")],
        cwd=pkg.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def summary(out: subprocess.CompletedProcess) -> dict[str, int]:
    last = out.stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last)}


def test_names_of_a_generated_plugin():
    s = plugin_skeleton("backend", "my-box")
    assert (s.dist, s.module, s.entry_point, s.class_name) == (
        "dsec-backend-my-box",
        "dsec_backend_my_box",
        "backend_my_box",
        "MyBoxBackend",
    )
    s = plugin_skeleton("source", "vault")
    assert (s.dist, s.module, s.entry_point, s.class_name) == (
        "dsec-layer-vault",
        "dsec_layer_vault",
        "layer_vault",
        "VaultLayerSource",
    )
    s = plugin_skeleton("policy", "read-only-paths")
    assert (s.dist, s.module, s.entry_point, s.class_name) == (
        "dsec-security-read-only-paths",
        "dsec_security_read_only_paths",
        "security_read_only_paths",
        "ReadOnlyPathsPolicy",
    )


@pytest.mark.parametrize(
    "name", ["", "Box", "my_box", "-box", "box-", "my--box", "9box", "b" * 41, "box/../x"]
)
def test_bad_names_are_typed_errors(name, tmp_path):
    with pytest.raises(InvalidSpec) as e:
        write_plugin("backend", name, tmp_path)
    assert e.value.field == "name"
    assert list(tmp_path.iterdir()) == []


def test_names_already_loaded_and_unknown_kinds_are_refused(tmp_path):
    with pytest.raises(InvalidSpec) as e:
        write_plugin("backend", "container", tmp_path)
    assert "already loaded" in str(e.value)
    with pytest.raises(InvalidSpec):
        write_plugin("source", "local", tmp_path)
    with pytest.raises(InvalidSpec) as e:
        write_plugin("policy", "seccomp", tmp_path)
    assert "already loaded" in str(e.value)
    with pytest.raises(InvalidSpec) as e:
        write_plugin("placement", "strict", tmp_path)
    assert e.value.field == "kind"
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_never_overwritten(tmp_path):
    (tmp_path / "dsec-layer-vault").mkdir()
    (tmp_path / "dsec-layer-vault" / "mine.txt").write_text("keep me")
    with pytest.raises(InvalidSpec) as e:
        write_plugin("source", "vault", tmp_path)
    assert "already exists" in str(e.value)
    assert [p.name for p in (tmp_path / "dsec-layer-vault").iterdir()] == ["mine.txt"]
    out = dsec("plugin", "new", "source", "vault", cwd=tmp_path)
    assert (
        out.returncode == 1 and out.stderr.startswith("Error: ") and "Traceback" not in out.stderr
    )


def test_the_cli_writes_a_whole_package(tmp_path):
    out = dsec("plugin", "new", "backend", "mybox", "--dir", "plugins", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    pkg = tmp_path / "plugins" / "dsec-backend-mybox"
    assert sorted(os.fspath(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file()) == [
        "README.md",
        "dsec_backend_mybox/__init__.py",
        "pyproject.toml",
        "tests/test_mybox.py",
    ]
    pyproject = (pkg / "pyproject.toml").read_text()
    assert 'backend_mybox = "dsec_backend_mybox"' in pyproject
    assert 'addopts = "-p dsec_core.testing"' in pyproject
    assert f'dependencies = ["dsec[node]{release_range()}"]' in pyproject  # written for this dsec
    assert "pytest dsec-backend-mybox/tests" in (pkg / "README.md").read_text()
    assert not [p for p in (tmp_path / "plugins").iterdir() if p.name.startswith(".")]
    out = dsec("plugin", "new", "policy", "masks", cwd=tmp_path)
    assert out.returncode == 0 and "as root" in out.stdout, out.stderr
    pkg = tmp_path / "dsec-security-masks"
    assert 'security_masks = "dsec_security_masks"' in (pkg / "pyproject.toml").read_text()
    assert (
        "class TestMasksPolicy(SecurityPolicyConformance)"
        in (pkg / "tests" / "test_masks.py").read_text()
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="mkfs.erofs layers need root")
def test_a_generated_source_installs_and_passes_its_kit(tmp_path):
    pkg = write_plugin("source", "vault", tmp_path / "src")
    install(pkg, tmp_path / "site")
    out = run_kit(pkg, tmp_path / "site")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    counts = summary(out)
    assert counts.get("passed", 0) >= 10 and not counts.get("failed"), out.stdout[-3000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="the policy kit runs a real node")
def test_a_generated_policy_installs_and_passes_its_kit(tmp_path):
    pkg = write_plugin("policy", "masks", tmp_path / "src")
    install(pkg, tmp_path / "site")
    out = run_kit(pkg, tmp_path / "site")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    counts = summary(out)
    assert counts.get("passed", 0) >= 12 and not counts.get("failed"), out.stdout[-3000:]
    # what it did is what the kit saw: enforced on real sandboxes, not skipped as unavailable
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 1 and "this host can run security policy 'masks'" in skips[0], skips
    assert f"rootdir: {pkg}" in out.stdout and "configfile: pyproject.toml" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the backend kit runs a real node")
def test_a_generated_backend_installs_and_passes_its_kit(tmp_path):
    pkg = write_plugin("backend", "mybox", tmp_path / "src")
    install(pkg, tmp_path / "site")
    out = run_kit(pkg, tmp_path / "site")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    counts = summary(out)
    assert counts.get("passed", 0) >= 15 and not counts.get("failed"), out.stdout[-3000:]
    # what it does not claim is skipped, by name; what it claims is checked
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert any("Feature.USERNS" in line for line in skips), skips
    assert any("Feature.CGROUPS" in line for line in skips), skips
    assert not [
        line
        for line in skips
        if "PID_NAMESPACE" in line or "NET_NAMESPACE" in line or "SHARED_KERNEL" in line
    ], skips
    assert f"rootdir: {pkg}" in out.stdout and "configfile: pyproject.toml" in out.stdout
