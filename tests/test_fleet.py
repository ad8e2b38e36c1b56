"""The simulated fleet (``dsec_core.testing.fleet``) serves the real node API to a real
apiserver process: creates, lists and kills go through it, a node's typed refusal comes back
as that error, and a node that goes silent is noticed, with a create that was waiting on it
answered ``NodeLost`` rather than left hanging. And what placement keeps up to date between
creates (the ledger's sums, the nodes that fit) follows what changed."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

import dsec
from dsec_core.apiserver.nodes import Ledger, NodeAddress, NodeSet, WatchSettings
from dsec_core.errors import AdmissionRejected, FeatureUnavailable, NodeLost
from dsec_core.iam import Iam
from dsec_core.records import PROJECT_LABEL, SandboxSpec
from dsec_core.testing.apiserver import ApiserverProcess, running_apiserver
from dsec_core.testing.fleet import Behaviour, FleetProcess, SimulatedFleet, running_fleet

PROBE = ["--probe-interval", "0.2", "--probe-timeout", "0.3", "--probe-misses", "2"]
SPEC = dsec.SandboxSpec(layers=("busybox@1",), memory="64M", cpu=0.5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[FleetProcess, ApiserverProcess, str]]:
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    with Iam.open(iam_url) as iam:
        iam.create_project("sim")
        _, key = iam.create_key("sim", "member")
    with (
        running_fleet(3, behaviour=Behaviour(capacity=8)) as nodes,
        running_apiserver(nodes.nodes, iam_url, args=PROBE) as api,
    ):
        _wait(lambda: _healthy(api, key) == 3)
        yield nodes, api, key


def _healthy(api: ApiserverProcess, key: str) -> int:
    with dsec.Client(api.url, api_key=key) as c:
        return int(c.node_info()["home"].split(":")[1].split("/")[0])


def _wait(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_creates_lists_and_kills_go_through_an_apiserver(fleet):
    nodes, api, key = fleet
    with dsec.Client(api.url, api_key=key) as c:
        sbs = c.create_many(SPEC, n=6)
        assert {sb.id.rsplit("-", 1)[1] for sb in sbs} <= {n.name for n in nodes.nodes}
        assert sum(nodes.counts().values()) == 6
        listed = {i.id: i for i in c.list()}
        assert set(listed) == {sb.id for sb in sbs}
        assert listed[sbs[0].id].labels == {PROJECT_LABEL: "sim"}
        assert listed[sbs[0].id].limits["memory"] == 64 << 20
        with pytest.raises(FeatureUnavailable):  # nothing runs in a simulated sandbox
            sbs[0].exec("true")
        for sb in sbs:
            sb.kill()
        assert c.list() == []
        assert sum(nodes.counts().values()) == 0


def test_a_nodes_typed_refusal_comes_back_as_it_is(fleet):
    nodes, api, key = fleet
    names = [n.name for n in nodes.nodes]
    nodes.fail(names, "full")  # their probes still show room: the node says no
    try:
        with dsec.Client(api.url, api_key=key) as c, pytest.raises(AdmissionRejected) as e:
            c.create(SPEC)
        assert e.value.context["reason"] == "count"
    finally:
        nodes.fail(names, "up")


def test_a_silent_node_is_lost_and_a_create_waiting_on_it_gets_node_lost(fleet):
    nodes, api, key = fleet
    slow, *others = [n.name for n in nodes.nodes]
    nodes.configure(others, capacity=0)  # placement has only the slow node left
    nodes.configure([slow], create_latency=30.0)
    _wait(lambda: _placeable(api, key) == 8)
    got: list[BaseException | str] = []

    def create() -> None:
        with dsec.Client(api.url, api_key=key) as c:
            try:
                got.append(c.create(SPEC).id)
            except BaseException as e:  # what the create got is the point
                got.append(e)

    t = threading.Thread(target=create)
    t.start()
    try:
        _wait(lambda: _creating(nodes, slow))
        t0 = time.monotonic()
        nodes.fail([slow], "silent")
        t.join(timeout=15)
        assert not t.is_alive(), "the create was left waiting on a lost node"
        assert isinstance(got[0], NodeLost), got
        assert got[0].context["node"] == slow
        assert time.monotonic() - t0 < 5  # probes 0.2 s apart, two missed, 0.3 s to answer
        _wait(lambda: _healthy(api, key) == 2)
    finally:
        nodes.fail([slow], "up")
        nodes.configure([slow], create_latency=0.0)
        nodes.configure(others, capacity=8)
        t.join(timeout=15)
    _wait(lambda: _healthy(api, key) == 3)


def _placeable(api: ApiserverProcess, key: str) -> int:
    with dsec.Client(api.url, api_key=key) as c:
        return int(c.node_info()["capacity"]["sandboxes"])


def _creating(nodes: FleetProcess, name: str) -> bool:
    return bool(nodes.stats()["creating"].get(name))


def test_the_ledgers_sums_follow_its_holds():
    """The ledger keeps its sums by node and by project as holds come and go: after any
    sequence of holds, settles and probes they equal the sums of the holds it keeps."""
    rng = random.Random(7)
    clock = [0.0]
    ledger = Ledger(clock=lambda: clock[0])
    holds = []
    for _ in range(2000):
        clock[0] += 0.01
        r = rng.random()
        if r < 0.4 or not holds:
            node = rng.choice(["a", "b", "c", None])
            holds.append(ledger.hold(rng.choice(["p", "q"]), node, rng.randint(1, 3), 0.5, 64))
        elif r < 0.8:
            h = holds.pop(rng.randrange(len(holds)))
            made = rng.randint(0, h.count)
            ledger.settle(h, made, node=h.node or "a", created=clock[0])
            ledger.settle(h, made)  # twice is once
        else:
            ledger.probed(rng.choice("abc"), clock[0] - 0.05, clock[0] - 0.05)
        kept = [h for filed in ledger._holds.values() for h in filed]
        by_node: dict[str, list[float]] = {}
        by_project: dict[str, list[float]] = {}
        for h in kept:
            for table, key in ((by_project, h.project), (by_node, h.node)):
                if key is not None:
                    s = table.setdefault(key, [0, 0.0, 0])
                    s[0], s[1], s[2] = s[0] + h.count, s[1] + h.cpu, s[2] + h.memory
        for want, got in ((by_node, ledger.by_node()), (by_project, ledger.by_project())):
            want = {k: v for k, v in want.items() if v[0]}
            assert set(got) == set(want)
            for k, (n, cpu, memory) in got.items():
                assert n == want[k][0] and memory == want[k][2]
                assert cpu == pytest.approx(want[k][1])


async def test_placement_sees_what_changed_on_the_nodes():
    """``NodeSet.eligible`` (what a create is placed among) follows probes, health and holds:
    a node that filled up, went away or came back is seen so at the next create."""
    fleet = SimulatedFleet(["a", "b", "c"], Behaviour(capacity=2))
    await fleet.start()
    nodes = NodeSet(
        [NodeAddress(a.name, a.url, a.token) for a in fleet.addresses()],
        settings=WatchSettings(interval=0.1, timeout=0.2, misses=1),
    )
    spec = SandboxSpec(layers=("x@1",))
    try:
        await nodes.refresh()
        assert sorted(n.node for n in nodes.eligible(spec)) == ["a", "b", "c"]
        hold = nodes.ledger.hold("p", "a", 2, 1.0, 64 << 20)  # a is full while it is held
        assert sorted(n.node for n in nodes.eligible(spec)) == ["b", "c"]
        assert sorted(n.node for n in nodes.eligible(replace(spec, cpu=2))) == ["b", "c"]
        nodes.ledger.settle(hold, 0)
        assert sorted(n.node for n in nodes.eligible(spec)) == ["a", "b", "c"]
        fleet.configure(["b"], capacity=0)
        await fleet.fail(["c"], "crash")
        await nodes.refresh()
        assert [n.node for n in nodes.eligible(spec)] == ["a"]
        await fleet.fail(["c"], "up")
        await nodes.refresh()
        assert sorted(n.node for n in nodes.eligible(spec)) == ["a", "c"]
    finally:
        await nodes.stop()
        await fleet.stop()


def test_one_body_sent_by_two_projects_makes_each_its_own_sandbox(tmp_path):
    """An apiserver keeps the create bodies it decoded lately, and what each became for the
    nodes, by their bytes: the same bytes from another project still make that project's
    sandbox, labelled with that project and no other, and each project lists only its own."""
    iam_url = f"sqlite://{tmp_path / 'iam.db'}"
    with Iam.open(iam_url) as iam:
        keys = {}
        for project in ("a", "b"):
            iam.create_project(project)
            keys[project] = iam.create_key(project, "member")[1]
    spec = replace(SPEC, labels={"run": "1"})
    with (
        running_fleet(2, behaviour=Behaviour(capacity=8)) as nodes,
        running_apiserver(nodes.nodes, iam_url, args=PROBE) as api,
    ):
        _wait(lambda: _healthy(api, keys["a"]) == 2)
        made: dict[str, list[str]] = {"a": [], "b": []}
        for project in ("a", "b", "a", "b"):
            with dsec.Client(api.url, api_key=keys[project]) as c:
                made[project].append(c.create(spec).id)
        for project, ids in made.items():
            with dsec.Client(api.url, api_key=keys[project]) as c:
                listed = {i.id: i.labels for i in c.list()}
            assert sorted(listed) == sorted(ids)
            assert all(labels == {"run": "1", PROJECT_LABEL: project} for labels in listed.values())
