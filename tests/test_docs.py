"""The docs document what a user can set: every ``DSEC_*`` variable the code reads appears in the
operators' Configuration table (docs/operators/configuration.md)."""

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
