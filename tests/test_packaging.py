"""What an installed wheel of dsec holds: the default catalog (with its executable toolkit), the
one catalog schema and the agent's C sources, all usable from the installed package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: pip builds in the source tree and would leave build/ behind.
    src = tmp_path_factory.mktemp("src") / "dsec"
    shutil.copytree(
        REPO,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", "plugins", "tests", "bench"
        ),
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("dsec-*.whl")
    return found


def test_the_wheel_carries_the_default_catalog_schema_and_agent(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        judge = z.getinfo("dsec_core/catalog/default/toolkit/usr/local/bin/dsec-judge")
        assert (judge.external_attr >> 16) & 0o111, "the toolkit's judge must stay executable"
    assert "dsec_core/catalog/schema.json" in names
    assert "dsec_core/catalog/default/default.yaml" in names
    assert any(n.startswith("dsec_core/catalog/default/tasks/textstats/") for n in names)
    assert {"dsec_core/agent/src/main.c", "dsec_core/agent/src/agent.h"} <= names
    assert not [n for n in names if n.endswith("schema.json") and "catalog/" not in n]


def test_the_installed_package_loads_its_default_catalog(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    code = (
        "from dsec_core.catalog import default_catalog_file, load_catalog; "
        "import dsec_core.agent as a; c = load_catalog(default_catalog_file()); "
        "print(default_catalog_file()); print(len(c.tasks), len(a.agent_sources()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(site)),
    )
    assert out.returncode == 0, out.stderr
    path, counts = out.stdout.splitlines()
    assert path.startswith(str(site)) and counts.split()[0] == "6"
    assert int(counts.split()[1]) >= 7
