"""The README documents what a user can set: every ``DSEC_*`` variable the code reads has a
row in its configuration table (as datasette's docs tests keep its hooks documented)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READS = re.compile(r"""environ(?:\.get\(|\[)\s*["'](DSEC_[A-Z0-9_]+)|"""
                   r"""["'](DSEC_[A-Z0-9_]+)["']\s+(?:not\s+)?in\s+os\.environ""")


def _read_by_code() -> set[str]:
    sources = [*ROOT.glob("dsec_core/**/*.py"), *ROOT.glob("plugins/*/dsec_*/**/*.py")]
    found = set()
    for path in sources:
        for m in READS.finditer(path.read_text()):
            found.add(m.group(1) or m.group(2))
    return found


def test_every_variable_the_code_reads_is_in_the_readme_table():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| `DSEC_")]
    documented = {name for row in rows for name in re.findall(r"`(DSEC_[A-Z0-9_]+)`",
                                                               row.split("|")[1])}
    read = _read_by_code()
    assert {"DSEC_HOME", "DSEC_LISTEN", "DSEC_API_TOKEN", "DSEC_ADDRESS"} <= read
    assert read - documented == set()
