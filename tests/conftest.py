"""Fixtures shared by the suite's own tests (the node fixtures come from dsec_core.testing)."""

import os
from pathlib import Path

import pytest

from dsec_core.config import NodeConfig


def built_catalog_home() -> Path:
    """The persistent home where ``run.sh test`` builds the default catalog before the suite
    (``DSEC_TEST_HOME``), so the debootstrap base is built once per machine, not per test."""
    return Path(os.environ.get("DSEC_TEST_HOME", "/var/lib/dsec-test"))


@pytest.fixture(scope="session")
def built_catalog_config() -> NodeConfig:
    return NodeConfig(home=built_catalog_home())


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private DSEC_HOME for tests that use stores directly, without a node."""
    home = tmp_path / "home"
    monkeypatch.setenv("DSEC_HOME", str(home))
    return home
