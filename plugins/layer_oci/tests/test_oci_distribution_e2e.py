"""One node publishes a catalog to a real OCI registry; another node pulls it and runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from oci_registry import local_registry, registry_binary

import dsec
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.testing import make_busybox_rootfs, running_kit_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(registry_binary() is None, reason="docker-registry is not installed"),
]

CATALOG = """
name: shipped
layers: []
environments:
  - name: shipped-env
    base: ship-base@1
    workspaces: [ship-task@1]
    workdir: /workspace
    env: {GREETING: shipped}
"""


def dsec_cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSEC_HOME=os.fspath(home))
    return subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_publish_on_one_node_pull_and_run_on_another(tmp_path):
    author = Path(tempfile.mkdtemp(prefix="dsec-author-"))
    try:
        store = LayerStore(author / "layers")
        build_layer(
            make_busybox_rootfs(tmp_path / "rootfs"),
            name="ship-base",
            version="1",
            kind="base",
            store=store,
        )
        task = tmp_path / "task" / "workspace"
        task.mkdir(parents=True)
        (task / "check.sh").write_text('echo "$GREETING from $(pwd)"\n')
        build_layer(tmp_path / "task", name="ship-task", version="1", kind="workspace", store=store)
        (tmp_path / "shipped.yaml").write_text(CATALOG)

        with local_registry() as reg:
            url = f"oci://{reg.address}/dsec?insecure=1"
            out = dsec_cli(
                author, "catalog", "publish", str(tmp_path / "shipped.yaml"), "--to", url
            )
            assert out.returncode == 0, out.stderr
            assert "pushed ship-base@1" in out.stdout and "published catalog shipped" in out.stdout
            again = dsec_cli(
                author, "catalog", "publish", str(tmp_path / "shipped.yaml"), "--to", url
            )
            assert "present ship-base@1" in again.stdout  # pushing what exists is a no-op

            with running_kit_node("dsec-runner-") as runner:
                out = dsec_cli(runner.home, "catalog", "pull", "shipped", "--from", url)
                assert out.returncode == 0, out.stderr
                assert "registered catalog shipped" in out.stdout
                with (
                    runner.client() as client,
                    client.create(environment="shipped-env", memory="64M") as sb,
                ):
                    r = sb.exec("sh check.sh")
                    assert r.stdout == b"shipped from /workspace\n"
                    assert sb.info.layers == ("ship-task@1", "ship-base@1")

            out = dsec_cli(author, "catalog", "pull", "nope", "--from", url)
            assert out.returncode == 1 and "shipped" in out.stderr and "Traceback" not in out.stderr
    finally:
        shutil.rmtree(author, ignore_errors=True)
    with pytest.raises(dsec.SourceUnavailable):
        from dsec_core.plugins import open_source

        open_source(url).list()  # the registry is gone now
