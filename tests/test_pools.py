"""FnCall pool settings from the environment, pool keys and names by project, and the wire shape
of a call's project and ``start`` (the pools themselves run on real sandboxes in
plugins/backend_fncall/tests, the backend that can reset its members)."""

from __future__ import annotations

import pytest

from dsec_core.api.messages import FnCallRequest, PoolStatus
from dsec_core.errors import InvalidSpec
from dsec_core.node.pools import PoolKey, PoolSettings
from dsec_core.records import JudgeSpec


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


def test_a_projects_pool_is_named_after_the_environment_then_the_project():
    key = PoolKey("fizzbuzz", "fncall", 1.0, 64 << 20, project="org/team")
    assert key.name == "fizzbuzz/fncall/1cpu/64M@org/team"
    assert key != PoolKey("fizzbuzz", "fncall", 1.0, 64 << 20)  # never the shared pool


def test_calls_without_project_or_start_decode_as_before():
    old = {"environment": "fizzbuzz", "cmd": "true"}
    call = FnCallRequest.from_dict(old)
    assert (call.project, call.start) == (None, True)
    new = FnCallRequest("fizzbuzz", "true", project="org/team", start=False)  # type: ignore[arg-type]
    assert FnCallRequest.from_dict(new.to_dict()) == new
    spec = JudgeSpec.from_dict({"environment": "fizzbuzz", "run": "./prog", "cases_dir": "c"})
    assert (spec.project, spec.start) == (None, True)
    assert (
        PoolStatus.from_dict(
            {"name": "p", "size": 1, "free": 1, "min": 0, "max": 2, "waiting": 0, "replaced": 0}
        ).project
        is None
    )


@pytest.mark.parametrize(
    "data, message",
    [
        ({"start": "no"}, "FnCallRequest.start"),
        ({"project": 5}, "FnCallRequest.project"),
    ],
)
def test_bad_project_or_start_is_invalid_spec(data, message):
    with pytest.raises(InvalidSpec, match=message):
        FnCallRequest.from_dict({"environment": "e", "cmd": "true", **data})
    with pytest.raises(InvalidSpec, match=message.split(".")[1]):
        JudgeSpec(environment="e", run="x", cases_dir="c", **data)
