"""Fixtures of the seccomp plugin's tests: the kit's sandboxes run on the container backend
(the one that offers the "oci" enforcement point), and the probe is compiled once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from dsec_security_seccomp.probe import build_probe


@pytest.fixture
def dsec_backend_name() -> str:
    return "container"


@pytest.fixture(scope="session")
def probe(tmp_path_factory) -> Path:
    """The static probe of dangerous syscalls, compiled from the plugin's probe.c."""
    if os.geteuid() != 0:
        pytest.skip("sandboxes need root")
    if not shutil.which("gcc"):
        pytest.skip("the probe needs gcc (apt-get install gcc libc6-dev)")
    return build_probe(tmp_path_factory.mktemp("seccomp-probe"))
