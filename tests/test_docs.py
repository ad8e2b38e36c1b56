"""The README documents what a user can set: every ``DSEC_*`` variable the code reads appears in
its Configuration table."""

from __future__ import annotations

import re
from pathlib import Path

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


def _configuration_table() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Configuration")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_every_dsec_variable_is_in_the_readme():
    used = {m for path in SOURCES for m in re.findall(r"\bDSEC_[A-Z0-9_]+", path.read_text())}
    documented = set(re.findall(r"`(DSEC_[A-Z0-9_]+)`", _configuration_table()))
    assert used, "the scan found no DSEC_ variables: it is broken"
    assert sorted(used - documented) == []
