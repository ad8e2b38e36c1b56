"""The security contract's shared pieces: ``FileRules``, the settings both file-policy plugins
(Landlock, AppArmor) read, with typed errors naming the field."""

from __future__ import annotations

import pytest

from dsec_core.apiserver.app import open_networks_from_env
from dsec_core.errors import InvalidSpec
from dsec_core.security import FileRules, loosenings


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


def test_an_operator_may_open_a_network_mode_to_every_key():
    """``DSEC_OPEN_NETWORKS`` (the apiserver's): a mode named there is no loosening, so member
    and agent keys may ask for it (Harbor's ``allow_internet_access`` with a member's key);
    every other mode still is, and ``allowlist`` cannot be opened (its rules are the point)."""
    assert loosenings({}, "internet", {}) == [
        "network 'internet' opens the sandbox's network (the default is 'none')"
    ]
    opened = open_networks_from_env({"DSEC_OPEN_NETWORKS": " internet, "})
    assert opened == {"internet"}
    assert loosenings({}, "internet", {}, open_networks=opened) == []
    assert loosenings({}, "allowlist", {}, open_networks=opened) != []
    assert open_networks_from_env({}) == frozenset()
    with pytest.raises(InvalidSpec, match="allowlist"):
        open_networks_from_env({"DSEC_OPEN_NETWORKS": "internet,allowlist"})
