"""The kit's private dockerd (``dsec_core.testing.private_dockerd``): a real daemon on a socket
of its own that answers, runs nothing on the machine's daemon, and leaves no process, mount or
file behind; no docker installed is a ``ToolError`` that says so."""

from __future__ import annotations

import os
import shutil

import pytest

from dsec_core.errors import ToolError
from dsec_core.linux.mounts import mounted_under
from dsec_core.linux.processes import proc_stat
from dsec_core.testing import private_dockerd

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dockerd needs root")


def test_a_private_dockerd_answers_and_leaves_nothing(tmp_path):
    try:
        with private_dockerd(tmp_path) as d:
            root, run_dir, pid = d.root, d.run_dir, d.pid
            assert root.parent == tmp_path and d.host == f"unix://{run_dir}/docker.sock"
            info = d.run("info", "--format", "{{.DockerRootDir}} {{.Containers}}", timeout=60)
            assert info.returncode == 0, info.stderr
            assert info.stdout.split() == [os.fspath(d.data_root), "0"]
            assert d.version and d.env["DOCKER_HOST"] == d.host
            assert d.argv("ps")[-3:] == ["-H", d.host, "ps"]
            assert proc_stat(pid) is not None
    except ToolError as e:
        pytest.skip(str(e))
    assert proc_stat(pid) is None  # stopped and reaped
    for gone in (root, run_dir):
        assert not gone.exists() and mounted_under(gone) == []


def test_without_docker_it_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(ToolError, match=r"docker\.io is not installed"), private_dockerd(tmp_path):
        pass
    assert list(tmp_path.iterdir()) == []
