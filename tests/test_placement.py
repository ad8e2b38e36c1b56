"""Placement: ``NodeLoad`` records, eligibility, best-of-k over synthetic nodes, and the single
node's admission going through the placement hooks."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from dsec_core import placement, plugins
from dsec_core.errors import AdmissionRejected, InvalidSpec
from dsec_core.hookspecs import hookimpl
from dsec_core.records import SANDBOX_START_MEMORY, NodeLoad, SandboxSpec

SPEC = SandboxSpec(layers=("x@1",), cpu=1.0, memory="1G")


def node(
    name: str,
    cpu: float = 0.0,
    memory: int = 0,
    sandboxes: int = 0,
    backends: tuple[str, ...] = ("container",),
) -> NodeLoad:
    return NodeLoad(
        node=name,
        backends=backends,
        cpu_capacity=100.0,
        cpu_committed=cpu,
        memory_capacity=64 << 30,
        memory_committed=memory,
        sandboxes=sandboxes,
        max_sandboxes=1000,
    )


def test_load_is_the_fullest_resource():
    assert node("a").load == 0.0
    assert node("a", cpu=50.0).load == pytest.approx(0.5)
    assert node("a", cpu=10.0, memory=48 << 30).load == pytest.approx(0.75)
    assert node("a", sandboxes=900).load == pytest.approx(0.9)
    assert NodeLoad.from_dict(node("a", cpu=3.0).to_dict()) == node("a", cpu=3.0)


def test_refusal_says_why_a_node_cannot_take_a_sandbox():
    assert node("a").refusal(SPEC) is None
    cases = {
        "cpu": node("a", cpu=99.5),
        "memory": node("a", memory=(64 << 30) - (512 << 20)),
        "count": node("a", sandboxes=1000),
        "backend": node("a", backends=("microvm",)),
    }
    for reason, n in cases.items():
        refusal = n.refusal(SPEC)
        assert isinstance(refusal, AdmissionRejected) and refusal.reason == reason, reason
        assert refusal.http_status == 429


def test_memory_in_use_and_pressure_admit_or_refuse():
    """Admission by the host's memory: what is available beyond the reserve (less what a new
    sandbox takes at start), and memory pressure, whatever the limits add up to."""
    roomy = replace(
        node("a"), memory_total=24 << 30, memory_available=20 << 30, memory_reserve=1 << 30
    )
    assert roomy.refusal(SPEC) is None
    assert roomy.load == pytest.approx(1 - 19 / 23)  # in use, counting the reserve as used
    tight = replace(roomy, memory_available=(1 << 30) + SANDBOX_START_MEMORY - 1)
    refusal = tight.refusal(SPEC)
    assert refusal is not None and refusal.reason == "memory-available"
    assert "reserve" in str(refusal)
    # a sandbox asking less than the start estimate needs only what it asks
    small = SandboxSpec(layers=("x@1",), cpu=1.0, memory=SANDBOX_START_MEMORY // 2)
    assert tight.refusal(small) is None
    stalled = replace(roomy, memory_pressure=12.5, memory_pressure_limit=10.0)
    refusal = stalled.refusal(SPEC)
    assert refusal is not None and refusal.reason == "memory-pressure"
    assert "12.5%" in str(refusal)
    # not measured (a record from elsewhere): only the limits count
    assert replace(roomy, memory_available=None).refusal(SPEC) is None


def test_best_effort_cpu_is_not_counted_toward_admission():
    be = SandboxSpec(layers=("x@1",), cpu=1.0, memory="1G", qos="be")
    full = node("a", cpu=99.5)
    assert full.refusal(SPEC).reason == "cpu"
    assert full.refusal(be) is None  # it only takes what latency-sensitive work leaves idle
    too_big = SandboxSpec(layers=("x@1",), cpu=101.0, qos="be")
    assert full.refusal(too_big).reason == "cpu"  # more than the whole node
    # memory and count are reserved as for any sandbox
    assert node("a", memory=(64 << 30) - (512 << 20)).refusal(be).reason == "memory"
    assert node("a", sandboxes=1000).refusal(be).reason == "count"


def test_best_of_k_takes_the_least_loaded_of_its_sample():
    nodes = [node(f"n{i}", cpu=float(i * 10)) for i in range(8)]  # n0 emptiest, n7 fullest
    assert placement.best_of_k(nodes, k=len(nodes)).node == "n0"  # k >= n: the global best
    assert placement.best_of_k([], k=3) is None
    rng = random.Random(7)
    picks = Counter(placement.best_of_k(nodes, k=2, rng=rng).node for _ in range(4000))
    # never the fullest (it always loses its pair); the emptier, the likelier
    assert "n7" not in picks
    assert picks["n0"] > picks["n3"] > picks["n6"] > 0
    # sampling spreads work: with k=2 the emptiest gets about a quarter, not all of it
    assert 0.15 < picks["n0"] / 4000 < 0.35


def test_ties_break_by_name_so_placement_is_stable():
    assert placement.best_of_k([node("b"), node("a"), node("c")], k=3).node == "a"


def test_k_comes_from_the_environment(monkeypatch):
    assert placement.placement_k() == placement.DEFAULT_K
    monkeypatch.setenv("DSEC_PLACEMENT_K", "5")
    assert placement.placement_k() == 5
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("DSEC_PLACEMENT_K", bad)
        with pytest.raises(InvalidSpec):
            placement.placement_k()


def test_core_placement_answers_through_the_hook():
    nodes = [node("busy", cpu=90.0), node("idle", cpu=1.0), node("mid", cpu=40.0)]
    assert plugins.place(SPEC, nodes).node == "idle"  # k=3 samples all three
    assert plugins.place(SPEC, []) is None


class _Decline:
    @hookimpl
    def dsec_place(self, request, nodes):
        return None  # "no opinion": core's best-of-k still answers


class _Wrong:
    @hookimpl
    def dsec_place(self, request, nodes):
        return node("not-eligible")


def test_a_plugin_without_an_opinion_falls_through_and_a_wrong_answer_is_an_error():
    plugins.reset()
    pm = plugins.get_plugin_manager()
    pm.register(_Decline(), name="decline")
    try:
        assert plugins.place(SPEC, [node("only")]).node == "only"
        pm.register(_Wrong(), name="wrong")
        with pytest.raises(Exception) as e:
            plugins.place(SPEC, [node("only")])
        assert "not an eligible node" in str(e.value)
    finally:
        plugins.reset()


def test_loads_within_the_grain_are_equal_and_the_fewest_sandboxes_win():
    # b is a hair more loaded (a probe's memory reading), a holds more sandboxes: b wins
    a = node("a", cpu=10.0, sandboxes=5)
    b = node("b", cpu=10.0 + 100 * placement.LOAD_GRAIN / 2, sandboxes=1)
    assert placement.best_of_k([a, b], 3).node == "b"
    # past the grain, load decides
    c = node("c", cpu=10.0 + 100 * placement.LOAD_GRAIN * 2, sandboxes=0)
    assert placement.best_of_k([a, c], 3).node == "a"


def test_a_node_holding_the_layers_counts_warm_sandboxes_fewer():
    spec = SandboxSpec(environment="python", layers=("extra@1",))
    warm = replace(
        node("warm", sandboxes=3), environments=("python",), layers=("base@1", "extra@1")
    )
    cold = node("cold", sandboxes=0)
    half = replace(node("half", sandboxes=0), environments=("python",))  # lacks extra@1
    assert placement.holds(warm, spec) and not placement.holds(half, spec)
    assert placement.dsec_place(spec, [cold, warm, half]).node == "warm"
    # once it holds WARM_SANDBOXES more than the others, the batch spreads
    busy = replace(warm, sandboxes=placement.WARM_SANDBOXES + 1)
    assert placement.dsec_place(spec, [cold, busy]).node == "cold"
    # and past WARM_LOAD, being warm is worth nothing
    hot = replace(warm, cpu_committed=95.0)
    assert placement.dsec_place(spec, [replace(cold, cpu_committed=95.0), hot]).node == "cold"
    # a node holding none of them is warm for nothing
    assert not placement.holds(cold, spec)
