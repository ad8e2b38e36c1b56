"""FnCall pool settings from the environment, pool keys and names by project, the wire shape of
a call's project and ``start``, and the pools' logic on a fake host (``fake_host``: members
are records, resets and commands answered in memory; the pools run on real sandboxes in
plugins/backend_fncall/tests, the backend that can reset its members)."""

from __future__ import annotations

import asyncio

import pytest
from fake_host import FakeCatalogs, FakeHost, PlainBackend

from dsec_core.api.messages import FnCallRequest, PoolStatus
from dsec_core.catalog.model import Environment
from dsec_core.errors import AdmissionRejected, BackendUnavailable, InvalidSpec
from dsec_core.node.pools import POOL_LABEL, PoolKey, Pools, PoolSettings
from dsec_core.records import PROJECT_LABEL, JudgeSpec, SandboxSpec


def test_defaults_and_per_environment_sizes():
    s = PoolSettings.from_env({})
    assert (s.min, s.max, s.idle, s.checkout_timeout) == (0, 16, 60.0, 30.0)
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


# --- pools on a fake host ---------------------------------------------------------------------
@pytest.fixture
def host(tmp_path) -> FakeHost:
    host = FakeHost(tmp_path)
    host.catalogs = FakeCatalogs(Environment(name="fizz", base="base@1"))
    host.backends["plain"] = PlainBackend()
    return host


async def test_a_member_serves_call_after_call_and_is_reset_between(host):
    pools = Pools(host, PoolSettings(max=2, checkout_timeout=1.0))
    first = await pools.call("fizz", ["cat"], stdin=b"hi", backend="fake", files={"a": b"x"})
    await host.settle()
    second = await pools.call("fizz", script="true", backend="fake", project="org/team")
    third = await pools.call("fizz", ["cat"], backend="fake")
    await host.settle()
    assert first.stdout == b"hi" and first.member == third.member
    assert sorted(host.fake.resets) == sorted([first.member, first.member, second.member])
    assert host.files[(first.member, "/work/a")] == b"x"  # relative to the pool's workdir
    assert all(kw["exclusive"] for _, _, kw in host.execs)  # a call runs alone in its member
    assert second.member != first.member  # a project's pool is its own
    specs = [spec for spec, _ in host.created]
    assert [spec.labels.get(PROJECT_LABEL) for spec in specs] == [None, "org/team"]
    assert all(POOL_LABEL in spec.labels and spec.workdir == "/work" for spec in specs)
    await pools.close()
    assert sorted(host.killed) == sorted(
        [(first.member, "fncall pool closed"), (second.member, "fncall pool closed")]
    )


async def test_a_full_pool_makes_a_call_wait_for_the_member_given_back(host):
    pools = Pools(host, PoolSettings(max=1, checkout_timeout=5.0))
    results = await asyncio.gather(*(pools.call("fizz", ["cat"], backend="fake") for _ in range(3)))
    assert len({r.member for r in results}) == 1 and len(host.created) == 1
    await host.settle()
    await pools.close()


async def test_a_member_that_fails_its_reset_is_replaced(host):
    pools = Pools(host, PoolSettings(max=2, checkout_timeout=1.0))
    first = await pools.call("fizz", ["cat"], backend="fake")
    host.fake.failing_resets.add(first.member)
    await pools.call("fizz", ["cat"], backend="fake")  # waits for the reset, which fails
    await host.settle()
    assert (first.member, "fncall pool") in host.killed
    (pool,) = pools.pools.values()
    assert pool.replaced == 1 and first.member not in pool.members
    await pools.close()


async def test_what_a_pool_refuses(host):
    pools = Pools(host, PoolSettings(max=1, checkout_timeout=0.1))
    with pytest.raises(AdmissionRejected) as e:
        await pools.call("fizz", ["true"], backend="fake", start=False)
    assert e.value.context["reason"] == "pool-start" and host.created == []
    with pytest.raises(BackendUnavailable, match=r"Feature\.RESET"):
        await pools.call("fizz", ["true"], backend="plain")
    with pytest.raises(InvalidSpec, match="one of cmd or script"):
        await pools.call("fizz", ["true"], script="true", backend="fake")
    host.failing_creates = 1
    with pytest.raises(Exception, match="the fake create failed"):
        await pools.call("fizz", ["true"], backend="fake")
    await pools.close()


async def test_members_a_previous_daemon_left_are_killed(host):
    left = host.add(spec=SandboxSpec(environment="fizz", labels={POOL_LABEL: "p"}))
    mine = host.add()
    await Pools(host).drop_left()
    assert host.killed == [(left.rt.id, "stale pool member")] and mine.rt.id in host.sandboxes
