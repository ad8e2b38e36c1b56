"""FnCall pool settings from the environment (the pools themselves run on real sandboxes in
plugins/backend_fncall/tests, the backend that can reset its members)."""

from __future__ import annotations

import pytest

from dsec_core.errors import InvalidSpec
from dsec_core.node.pools import PoolKey, PoolSettings


def test_defaults_and_per_environment_sizes():
    s = PoolSettings.from_env({})
    assert (s.min, s.max, s.idle, s.lease_timeout) == (0, 16, 60.0, 30.0)
    s = PoolSettings.from_env(
        {
            "DSEC_FNCALL_POOL_MIN": "1",
            "DSEC_FNCALL_POOL_MAX": "4",
            "DSEC_FNCALL_POOLS": " fizzbuzz=2:8, other=0:1 ,",
            "DSEC_FNCALL_IDLE": "0.5",
        }
    )
    assert s.size_of("fizzbuzz") == (2, 8)
    assert s.size_of("other") == (0, 1)
    assert s.size_of("anything-else") == (1, 4)
    assert s.idle == 0.5


@pytest.mark.parametrize(
    "env",
    [
        {"DSEC_FNCALL_POOL_MAX": "many"},
        {"DSEC_FNCALL_POOL_MIN": "5", "DSEC_FNCALL_POOL_MAX": "4"},
        {"DSEC_FNCALL_POOL_MAX": "0"},
        {"DSEC_FNCALL_IDLE": "-1"},
        {"DSEC_FNCALL_POOLS": "fizzbuzz=8:2"},
        {"DSEC_FNCALL_POOLS": "fizzbuzz=2"},
        {"DSEC_FNCALL_POOLS": "=1:2"},
    ],
)
def test_bad_settings_are_invalid_spec(env):
    with pytest.raises(InvalidSpec):
        PoolSettings.from_env(env)


def test_a_pool_is_named_by_what_makes_members_interchangeable():
    assert PoolKey("fizzbuzz", "fncall", 0.5, 256 << 20).name == "fizzbuzz/fncall/0.5cpu/256M"
