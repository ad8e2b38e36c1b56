"""Fixtures of the Harbor provider's tests: a real node holding the default catalog's ``python``
environment, and a task written by ``harbor init`` and then edited to use RUN, COPY, WORKDIR
and ENV."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harbor_kit import (
    DOCKERFILE,
    IMAGES,
    SOLVE,
    TEST,
    harbor_bin,
    harbor_env,
    install_python_env,
)

from dsec_core.iam import Iam
from dsec_core.testing import KitNode, running_kit_node
from dsec_core.testing.apiserver import named_nodes, running_apiserver


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


@dataclass
class Plane:
    """A ``dsec apiserver`` over one node with the ``python`` environment, and two keys of
    project ``harbor``: a member's and a builder's."""

    url: str
    member_key: str
    builder_key: str


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[Plane]:
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    harbor_bin()
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    try:
        iam.create_project("harbor")
        member = iam.create_key("harbor", "member")[1]
        builder = iam.create_key("harbor", "builder")[1]
        with contextlib.ExitStack() as stack:
            nodes = stack.enter_context(named_nodes({"h1": {}}))
            install_python_env(nodes[0].node)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("DSEC_E2B_IMAGES", IMAGES)  # read as the apiserver starts
                api = stack.enter_context(running_apiserver(nodes, iam_url))
            yield Plane(api.url, member, builder)
    finally:
        iam.close()
