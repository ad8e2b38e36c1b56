"""The security contract's shared pieces: ``FileRules``, the settings both file-policy plugins
(Landlock, AppArmor) read, with typed errors naming the field."""

from __future__ import annotations

import pytest

from dsec_core.errors import InvalidSpec
from dsec_core.security import FileRules


def test_file_rules_are_read_and_normalised():
    rules = FileRules.parse(
        {
            "read_only": ["/usr/local/bin/", "/opt", "/opt"],
            "hidden": ["/judge"],
            "scope": ["signal", "abstract_unix", "signal"],
        },
        "landlock",
    )
    assert rules.read_only == ("/usr/local/bin", "/opt")
    assert rules.hidden == ("/judge",)
    assert rules.scope == ("abstract_unix", "signal")
    assert FileRules.parse({}, "landlock") == FileRules()


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"read_only": ["relative/path"]}, "policies.landlock.read_only[0]"),
        ({"hidden": ["/ok", "/a/../etc"]}, "policies.landlock.hidden[1]"),
        ({"hidden": ["/"]}, "policies.landlock.hidden[0]"),
        ({"hidden": ["/a\0b"]}, "policies.landlock.hidden[0]"),
        ({"read_only": "/usr"}, "policies.landlock.read_only"),
        ({"read_only": ["/p"] * 300}, "policies.landlock.read_only"),
        ({"scope": ["network"]}, "policies.landlock.scope"),
        ({"writable": ["/tmp"]}, "policies.landlock.writable"),
    ],
)
def test_bad_file_rules_are_typed_and_name_the_field(settings, field):
    with pytest.raises(InvalidSpec) as e:
        FileRules.parse(settings, "landlock")
    assert e.value.field == field
