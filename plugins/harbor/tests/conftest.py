"""Fixtures of the Harbor provider's tests: a real node holding the default catalog's ``python``
environment, and a task written by ``harbor init`` and then edited to use RUN, COPY, WORKDIR
and ENV."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from harbor_kit import DOCKERFILE, SOLVE, TEST, harbor_bin, harbor_env, install_python_env

from dsec_core.testing import KitNode, running_kit_node


@pytest.fixture(scope="session")
def harbor_task(tmp_path_factory) -> Path:
    """A task made by ``harbor init`` (shared verifier), then given its Dockerfile (RUN, COPY,
    WORKDIR, ENV), solution, test and no network."""
    harbor = harbor_bin()
    root = tmp_path_factory.mktemp("harbor-tasks")
    subprocess.run(
        [str(harbor), "init", "--task", "dsec/greet", "-o", str(root), "--no-pytest",
         "--no-package", "--verifier-mode", "shared"],
        check=True, capture_output=True, env=harbor_env(), timeout=120,
    )  # fmt: skip
    task = root / "greet"
    (task / "instruction.md").write_text("Write greet's output, then count.txt, to answer.txt.\n")
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (task / "environment" / "words.txt").write_text("one two three\n")
    (task / "environment" / "data").mkdir()
    (task / "environment" / "data" / "note.txt").write_text("from data/\n")
    for i in range(20):  # enough files that the COPY goes as one tar
        (task / "environment" / "data" / f"part-{i:02d}.txt").write_text(f"{i}\n")
    (task / "environment" / "data" / "bin").mkdir()
    (task / "environment" / "data" / "bin" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (task / "environment" / "data" / "bin" / "run.sh").chmod(0o755)
    (task / "solution" / "solve.sh").write_text(SOLVE)
    (task / "tests" / "test.sh").write_text(TEST)
    toml = (task / "task.toml").read_text()
    assert 'network_mode = "public"' in toml, toml  # harbor init's default, made explicit here
    toml = toml.replace('network_mode = "public"', 'network_mode = "no-network"')
    toml = toml.replace("timeout_sec = 600.0", "timeout_sec = 120.0")
    (task / "task.toml").write_text(toml)
    return task


@pytest.fixture(scope="module")
def python_node() -> Iterator[KitNode]:
    """A kit node with the default catalog's ``python`` environment."""
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    harbor_bin()
    with running_kit_node("dsec-harbor-") as node:
        install_python_env(node)
        yield node
