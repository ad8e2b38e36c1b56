"""Fixtures shared by the suite's own tests (the node fixtures come from dsec_core.testing)."""

from pathlib import Path

import pytest


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private DSEC_HOME for tests that use stores directly, without a node."""
    home = tmp_path / "home"
    monkeypatch.setenv("DSEC_HOME", str(home))
    return home

