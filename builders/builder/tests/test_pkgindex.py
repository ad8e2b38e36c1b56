"""The package index a build installs from: its PEP 503 pages, real pip against it on
loopback, and real pip in a sandbox that reaches it through the node's egress namespace when
(and only when) its egress policy grants the index's address."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsec_builder.pkgindex import (
    EgressIndex,
    LoopbackIndex,
    SimpleIndex,
    normalize,
    project_of,
)
from dsec_security_ebpf.network import EgressNetwork

from dsec_core.catalog.store import CatalogStore
from dsec_core.errors import InvalidSpec, ToolError
from dsec_core.linux.netns import links
from dsec_core.records import SandboxSpec
from dsec_core.testing import KitNode

DATA = Path(__file__).resolve().parents[1] / "dsec_builder" / "demo_data"
WHEELS = DATA / "wheels"
PEPPERCORN = "peppercorn-0.6-py3-none-any.whl"
# Debian's own pip wheel (python3-pip-whl, which python3-venv brings): the default base has
# python3 but no pip, so the sandbox runs pip straight from its wheel
HOST_PIP = sorted(Path("/usr/share/python-wheels").glob("pip-*.whl"))


def test_names_are_normalized_as_pep_503_says():
    assert normalize("Foo.Bar__baz-QUX") == "foo-bar-baz-qux"
    assert project_of(PEPPERCORN) == "peppercorn"
    assert project_of("Zope.Interface-6.0-cp311-cp311-linux_x86_64.whl") == "zope-interface"
    assert project_of("my_pkg-1.0.tar.gz") == "my-pkg"
    assert project_of("README.txt") is None and project_of("bad.whl") is None


def test_pages_list_projects_and_files_with_their_hashes(tmp_path):
    (tmp_path / PEPPERCORN).write_bytes((WHEELS / PEPPERCORN).read_bytes())
    (tmp_path / "notes.txt").write_text("not a distribution")
    index = SimpleIndex(tmp_path)
    status, ctype, body = index.page("/simple/")
    assert (status, ctype) == (200, "text/html")
    assert b'href="/simple/peppercorn/"' in body and b"notes" not in body
    status, _, body = index.page("/simple/PepperCorn/")  # any spelling of the name
    assert status == 200
    assert b"#sha256=46125cad688a9cf3b08e463bcb797891ee73ece93602a8ea6f14e40d1042d454" in body
    status, _, body = index.page(f"/files/{PEPPERCORN}")
    assert status == 200 and body == (WHEELS / PEPPERCORN).read_bytes()
    assert index.page("/simple/nothing-here/")[0] == 404
    assert index.page("/files/notes.txt")[0] == 404  # only distributions are served
    assert index.page("/files/..%2Fetc%2Fpasswd")[0] == 404
    with pytest.raises(InvalidSpec, match="does not exist"):
        SimpleIndex(tmp_path / "missing")


def test_pip_downloads_from_the_loopback_index(tmp_path):
    record = tmp_path / "requests.jsonl"
    with LoopbackIndex(WHEELS, record) as index:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--index-url", index.url,
             "--disable-pip-version-check", "-d", os.fspath(tmp_path / "got"), "peppercorn"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "got" / PEPPERCORN).read_bytes() == (WHEELS / PEPPERCORN).read_bytes()
    paths = [line for line in record.read_text().splitlines()]
    assert any("/simple/peppercorn/" in p for p in paths)
    assert any(f"/files/{PEPPERCORN}" in p for p in paths)


@pytest.fixture(scope="module")
def base(python_node: KitNode) -> str:
    """The base layer of the test node's ``python`` environment (the conftest's node)."""
    if not HOST_PIP:
        pytest.skip("no pip wheel in /usr/share/python-wheels (apt install python3-pip-whl)")
    return CatalogStore(python_node.config.catalog_dir).environment("python").base


@contextlib.contextmanager
def sandbox(node: KitNode, base: str, **spec) -> Iterator:
    with node.client() as client:
        sb = client.create(SandboxSpec(layers=(base,), ttl=300, **spec))
        try:
            sb.write_file("/tmp/pip.whl", HOST_PIP[-1].read_bytes())
            yield sb
        finally:
            sb.kill()


def pip_install(sb, index: EgressIndex):
    # the wheel's own pip; fail fast: no retries, a short timeout
    return sb.exec(
        f"python3 /tmp/pip.whl/pip install --disable-pip-version-check --no-cache-dir "
        f"--break-system-packages --retries 0 --timeout 5 --index-url {index.url} "
        f"--trusted-host {index.address} peppercorn",
        timeout=120,
    )


def test_a_granted_sandbox_installs_from_the_index_and_others_fail_fast(
    python_node, base, tmp_path
):
    egress = EgressNetwork(python_node.home)
    with EgressIndex(python_node.home, WHEELS, tmp_path / "requests.jsonl") as index:
        assert index.address.startswith("10.78.") and index.url.endswith("/simple/")
        assert index.veth in links(egress.name)
        allowed = {"egress": {"allow": [index.allow_rule]}}
        with sandbox(python_node, base, network="allowlist", policies=allowed) as sb:
            r = pip_install(sb, index)
            assert r.exit_code == 0, r.stderr.decode()[-2000:]
            r = sb.exec("python3 -c 'import peppercorn; print(peppercorn.__file__)'")
            assert r.exit_code == 0 and "/usr/local/lib/python3" in r.text, r
        got = [(q.path, q.status) for q in index.requests()]
        assert ("/simple/peppercorn/", 200) in got and (f"/files/{PEPPERCORN}", 200) in got

        # the same index, but this sandbox's policy grants another port: refused at connect
        other = {"egress": {"allow": [f"{index.address}:{index.port + 1}/tcp"]}}
        for spec in (dict(network="allowlist", policies=other), dict(network="none")):
            before = len(index.requests())
            with sandbox(python_node, base, **spec) as sb:
                started = time.monotonic()
                r = pip_install(sb, index)
                assert r.exit_code != 0 and time.monotonic() - started < 30, (spec, r)
                assert b"peppercorn" in r.stderr + r.stdout
                assert sb.exec("python3 -c 'import peppercorn'").exit_code != 0
            assert len(index.requests()) == before  # nothing reached it
    assert not index.exists
    assert index.veth not in links(egress.name)


def test_a_failed_start_leaves_no_namespace(python_node, tmp_path):
    index = EgressIndex(python_node.home, WHEELS, tmp_path / "r.jsonl", port=70000)
    with pytest.raises(ToolError, match="did not start"):
        index.__enter__()
    assert not index.exists
    with pytest.raises(InvalidSpec, match="does not exist"):
        EgressIndex(python_node.home, tmp_path / "missing", tmp_path / "r.jsonl")
