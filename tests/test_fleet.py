"""The simulated fleet (``dsec_core.testing.fleet``) serves the real node API to a real
apiserver process: creates, lists and kills go through it, a node's typed refusal comes back
as that error, and a node that goes silent is noticed, with a create that was waiting on it
answered ``NodeLost`` rather than left hanging."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import dsec
from dsec_core.errors import AdmissionRejected, FeatureUnavailable, NodeLost
from dsec_core.iam import Iam
from dsec_core.records import PROJECT_LABEL
from dsec_core.testing.apiserver import ApiserverProcess, running_apiserver
from dsec_core.testing.fleet import Behaviour, FleetProcess, running_fleet

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
