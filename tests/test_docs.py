"""The docs hold to the code: every ``DSEC_*`` variable the code reads appears in the operators'
Configuration table (docs/operators/configuration.md), and every Python example of the trainer's
guide (docs/trainers/) that one node can run runs, against a real kit node."""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import dsec
from dsec_core.node.pools import POOL_LABEL
from dsec_core.testing import running_kit_node

REPO = Path(__file__).resolve().parent.parent
SOURCES = [
    REPO / "run.sh",
    *[
        p
        for d in ("dsec", "dsec_core", "plugins", "builders")
        for p in (REPO / d).rglob("*.py")
        if "tests" not in p.parts and "templates" not in p.parts
    ],
]


CONFIGURATION = REPO / "docs" / "operators" / "configuration.md"


def _configuration_table() -> str:
    text = CONFIGURATION.read_text()
    assert text.startswith("# Configuration\n"), f"{CONFIGURATION} is not the Configuration page"
    return text


def test_every_dsec_variable_is_in_the_configuration_table():
    used = {m for path in SOURCES for m in re.findall(r"\bDSEC_[A-Z0-9_]+", path.read_text())}
    documented = set(re.findall(r"`(DSEC_[A-Z0-9_]+)`", _configuration_table()))
    assert used, "the scan found no DSEC_ variables: it is broken"
    assert sorted(used - documented) == []


#: The trainer's guide, whose Python examples run here against a real node.
TRAINER_GUIDE = REPO / "docs" / "trainers"
#: ``<!-- skip: why -->`` on the line before a block: it needs more than one node can give
#: (several nodes, Ray, an apiserver, a GPU, a VM backend), and is not run.
SKIP = re.compile(r"^<!--\s*skip:\s*(?P<why>\S.*?)\s*-->$")
#: The environments the guide's examples name. Their commands are POSIX shell and awk, so the
#: kit's busybox base stands in for the default catalog's images, under the same names.
GUIDE_ENVIRONMENTS = ("fizzbuzz", "textstats", "sum-pairs")


@dataclass(frozen=True)
class Block:
    """One fenced ``python`` block of a page: where it starts, its code, why it is skipped."""

    page: Path
    line: int
    code: str
    skip: str | None


def python_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        m = SKIP.match(before)
        end = lines.index("```", i + 1)
        blocks.append(Block(page, i + 2, "\n".join(lines[i + 1 : end]) + "\n", m and m["why"]))
        i = end + 1
    return blocks


GUIDE_PAGES = sorted(p for p in TRAINER_GUIDE.glob("*.md") if python_blocks(p))


def test_the_extractor_reads_blocks_and_their_skip_notes(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# t\n\n```python\na = 1\n```\n\n<!-- skip: needs an apiserver -->\n\n```python\n"
        "b = 2\n```\n\n```sh\nls\n```\n<!-- skip -->\n```python\nc = 3\n```\n"
    )
    got = [(b.line, b.code, b.skip) for b in python_blocks(page)]
    assert got == [
        (4, "a = 1\n", None),
        (10, "b = 2\n", "needs an apiserver"),
        (18, "c = 3\n", None),
    ]


def test_most_of_the_guide_runs_and_what_does_not_says_why():
    blocks = [b for p in GUIDE_PAGES for b in python_blocks(p)]
    skipped = [b for b in blocks if b.skip]
    assert len(blocks) >= 10 and len(skipped) <= len(blocks) // 4, [
        (b.page.name, b.line) for b in skipped
    ]


@pytest.fixture(scope="module")
def guide_node():
    """A kit node with the guide's environments, which ``dsec.Client()`` reaches through
    ``DSEC_ADDRESS`` as a reader's would reach theirs."""
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    with running_kit_node("dsec-docs-") as node:
        for name in GUIDE_ENVIRONMENTS:
            node.environment(name)
        saved = os.environ.get("DSEC_ADDRESS")
        os.environ["DSEC_ADDRESS"] = f"unix://{node.config.socket_path}"
        try:
            yield node
        finally:
            if saved is None:
                os.environ.pop("DSEC_ADDRESS", None)
            else:
                os.environ["DSEC_ADDRESS"] = saved


@pytest.mark.parametrize("page", GUIDE_PAGES, ids=lambda p: p.name)
def test_the_trainer_guide_runs(page, guide_node, tmp_path, monkeypatch):
    """Each page's examples run top to bottom in one namespace, as a reader pastes them."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    out = io.StringIO()
    try:
        for block in python_blocks(page):
            if block.skip:
                continue
            code = compile(block.code, f"{page.relative_to(REPO)}:{block.line}", "exec")
            with contextlib.redirect_stdout(out):
                exec(code, namespace)
    finally:
        with guide_node.client() as client:
            for info in client.list():  # what a page left: the next page starts afresh
                if POOL_LABEL not in info.labels:
                    client.kill(info.id)
        if isinstance(namespace.get("client"), dsec.Client):
            namespace["client"].close()
