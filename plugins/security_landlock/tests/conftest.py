"""Fixtures of the landlock plugin's tests: the kit's sandboxes run on the container backend
(it offers the "agent" enforcement point), with the task layer stacked on the kit's base."""

from __future__ import annotations

import os

import pytest
from dsec_security_landlock.testing import task_layer

from dsec_core.layers.store import LayerStore


@pytest.fixture
def dsec_backend_name() -> str:
    return "container"


@pytest.fixture
def task(dsec_node) -> tuple[str, ...]:
    """``layers=`` for a sandbox of the task layer on the kit's base (top first)."""
    if os.geteuid() != 0:
        pytest.skip("sandboxes need root")
    info = task_layer(LayerStore(dsec_node.config.layer_dir))
    return (info.ref, dsec_node.layer.ref)
