"""The egress policy's tests run against a node of their own: its DNS server is one the tests
start on loopback, and it re-resolves every second."""

from __future__ import annotations

import os

import pytest
from dsec_security_ebpf.testing import ServerNamespace, build_probe, egress_kit_node


@pytest.fixture(scope="module")
def egress(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with egress_kit_node(tmp_path_factory.mktemp("egress")) as node:
        yield node


@pytest.fixture
def dsec_node(egress):
    return egress.node


@pytest.fixture
def dsec_backend_name(request):
    """A kit class's ``backend_name``; elsewhere the container backend."""
    return getattr(request.instance, "backend_name", None) or "container"


@pytest.fixture(scope="session")
def netprobe(tmp_path_factory):
    return build_probe(tmp_path_factory.mktemp("netprobe")).read_bytes()


@pytest.fixture
def servers(egress, tmp_path):
    """A namespace of the test's own on the egress side, 10.77.1.2, serving TCP 8080 and 8081
    and UDP 5353."""
    with ServerNamespace(egress.node.home, tmp_path, 1) as ns:
        ns.serve(tcp=[8080, 8081], udp=[5353])
        yield ns
