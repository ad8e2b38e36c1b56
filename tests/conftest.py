"""Fixtures shared by the suite's own tests (the node fixtures come from dsec_core.testing)."""

import contextlib
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec_core.config import NodeConfig
from dsec_core.testing import KitNode, free_port, running_kit_node


def built_catalog_home() -> Path:
    """The persistent home where ``run.sh test`` builds the default catalog before the suite
    (``DSEC_TEST_HOME``), so the debootstrap base is built once per machine, not per test."""
    return Path(os.environ.get("DSEC_TEST_HOME", "/var/lib/dsec-test"))


@pytest.fixture(scope="session")
def built_catalog_config() -> NodeConfig:
    return NodeConfig(home=built_catalog_home())


@pytest.fixture
def dsec_backend_name() -> str:
    """Core's own tests run the kit's sandboxes on the shipped container backend."""
    return "container"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private DSEC_HOME for tests that use stores directly, without a node."""
    home = tmp_path / "home"
    monkeypatch.setenv("DSEC_HOME", str(home))
    return home


def make_self_signed(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate for ``host`` (its own CA) and its key, made by openssl."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={host}",
            "-addext",
            f"subjectAltName=IP:{host}",
            "-keyout",
            os.fspath(key),
            "-out",
            os.fspath(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@dataclass
class NetworkNode:
    """A kit node that also listens on loopback TCP: plain http and https, one token."""

    node: KitNode
    http: str
    https: str
    token: str
    ca: Path


@pytest.fixture(scope="session")
def network_node(tmp_path_factory) -> Iterator[NetworkNode]:
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    cert, key = make_self_signed(tmp_path_factory.mktemp("tls"))
    token = secrets.token_urlsafe(24)
    http, https = f"http://127.0.0.1:{free_port()}", f"https://127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        # What the daemon reads as it starts; the rest of the session must not see it.
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DSEC_LISTEN", f"{http},{https}")
            mp.setenv("DSEC_API_TOKEN", token)
            mp.setenv("DSEC_TLS_CERT", os.fspath(cert))
            mp.setenv("DSEC_TLS_KEY", os.fspath(key))
            node = stack.enter_context(running_kit_node("dsec-net-"))
        yield NetworkNode(node, http, https, token, cert)
