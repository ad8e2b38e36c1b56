"""Fixtures of the apparmor plugin's tests: the kit's sandboxes run on the container backend (the
one that offers the "oci" enforcement point), and profile checks need apparmor_parser."""

from __future__ import annotations

import pytest
from dsec_security_apparmor.parser import find_parser


@pytest.fixture
def dsec_backend_name() -> str:
    return "container"


@pytest.fixture(scope="session")
def apparmor_parser() -> str:
    """The installed apparmor_parser (run.sh installs Debian's apparmor package)."""
    path = find_parser()
    if path is None:
        pytest.skip("apparmor_parser is not installed (apt-get install apparmor)")
    return path
