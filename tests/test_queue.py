"""The fair create queue: ``FairQueue``'s order as pure logic, then on a real node daemon with
room for four sandboxes and two start slots: a create with ``wait`` waits for room and gets
it when a sandbox goes, is refused naming why when its deadline passes, projects and batches
get their share of freed room (not first come first served), no more than the start slots'
creates start at once, a cancelled caller leaves the queue with nothing made, the queue's
depth and waits are metrics; and through a real apiserver whose nodes are full, a create with
``wait`` is served once room frees."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dsec
from dsec_core.api.transport import HTTPTransport
from dsec_core.errors import AdmissionRejected
from dsec_core.fairqueue import FairQueue, project_of
from dsec_core.iam import Iam
from dsec_core.records import PROJECT_LABEL, SandboxSpec
from dsec_core.testing.apiserver import named_nodes, running_apiserver
from dsec_core.testing.fixtures import KitNode, running_kit_node
from dsec_core.testing.waits import until

ROOM = 4
STARTING = 2

# --- the fair order, as pure logic -----------------------------------------------------------


def _fill(q: FairQueue[str], project: str, n: int, batch: str = "") -> None:
    for i in range(n):
        q.push(f"{project}{batch}{i}", project, batch)


def _drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (item := q.pop()) is not None:
        out.append(item)
    return out


def test_a_flood_from_one_project_does_not_push_anothers_creates_behind_it():
    q: FairQueue[str] = FairQueue()
    _fill(q, "a", 100)
    _fill(q, "b", 3)
    assert q.order()[:7] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3"]
    assert q.position("b2") == 5
    assert q.depth() == {"a": 100, "b": 3}
    assert _drain(q)[:7] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3"]
    assert len(q) == 0 and q.peek() is None


def test_batches_share_their_project_and_go_in_arrival_order_inside():
    q: FairQueue[str] = FairQueue()
    _fill(q, "p", 5, batch="x")
    _fill(q, "p", 2, batch="y")
    _fill(q, "r", 2)
    # the projects alternate; inside p the batches alternate; inside a batch, arrival order
    assert _drain(q) == ["px0", "r0", "py0", "r1", "px1", "py1", "px2", "px3", "px4"]


def test_an_idle_project_banks_no_credit():
    q: FairQueue[str] = FairQueue()
    _fill(q, "a", 10)
    for _ in range(6):  # a alone: served six times
        q.pop()
    _fill(q, "b", 10)
    # b joins at the current virtual time: no run of six b's to make up for a's past turns
    assert q.order()[:6] == ["b0", "a6", "b1", "a7", "b2", "a8"]


def test_turns_taken_at_once_count_and_a_late_project_gets_at_most_its_credit():
    q: FairQueue[str] = FairQueue(credit=3)
    for _ in range(5):  # "early" got five creates through before anything waited
        q.charge("early")
    _fill(q, "early", 5)
    _fill(q, "late", 5)
    # late joins three turns behind the virtual time (that of early's last turn): it takes
    # those and the one early is ahead by, then the two alternate
    assert q.order()[:7] == ["late0", "late1", "late2", "late3", "early0", "late4", "early1"]
    q2: FairQueue[str] = FairQueue()  # no credit: a late project just joins the rotation
    for _ in range(5):
        q2.charge("early")
    _fill(q2, "early", 3)
    _fill(q2, "late", 3)
    assert q2.order()[:4] == ["late0", "early0", "late1", "early1"]


def test_ties_go_to_the_project_that_holds_least():
    q: FairQueue[str] = FairQueue()
    _fill(q, "a", 3)
    _fill(q, "b", 3)
    assert q.peek({"a": 5, "b": 1}) == "b0"
    assert q.order({"a": 2})[:4] == ["b0", "a0", "b1", "a1"]  # the tags still alternate
    assert q.pop({"a": 5}) == "b0"


def test_weights_give_shares_and_removal_leaves_the_order_fair():
    q: FairQueue[str] = FairQueue(weights={"a": 2.0})
    _fill(q, "a", 6)
    _fill(q, "b", 3)
    assert q.remove("a1") and not q.remove("a1")
    assert "a1" not in q and q.position("a1") is None
    assert _drain(q) == ["a0", "b0", "a2", "a3", "b1", "a4", "a5", "b2"]
    with pytest.raises(ValueError):
        q.push("x", "a")
        q.push("x", "b")


def test_the_project_comes_from_the_labels_or_a_default():
    assert project_of({"dsec.project": "iam/p", "owner": "o"}) == "iam/p"
    assert project_of({"project": "t1"}) == "t1"
    assert project_of({"owner": "t2"}) == "t2"
    assert project_of({}) == "default"


# --- on a node daemon ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node() -> Iterator[KitNode]:
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSEC_MAX_SANDBOXES", str(ROOM))
        mp.setenv("DSEC_MAX_STARTING", str(STARTING))
        with running_kit_node("dsec-queue-") as n:
            mp.undo()
            yield n


@pytest.fixture
def client(node: KitNode) -> Iterator[dsec.Client]:
    with node.client() as c:
        yield c
        for info in c.list():
            with contextlib.suppress(dsec.DsecError):
                c.kill(info.id)


def _spec(node: KitNode, project: str = "", **labels: str) -> SandboxSpec:
    if project:
        labels["project"] = project
    return SandboxSpec(layers=(node.layer.ref,), memory="64M", labels=labels)


def _metrics(node: KitNode) -> dict[tuple[str, frozenset], float]:
    transport = httpx.HTTPTransport(uds=os.fspath(node.config.socket_path))
    with httpx.Client(transport=transport, base_url="http://node", timeout=30) as c:
        text = c.get("/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _depth(node: KitNode, project: str) -> float:
    return _metrics(node).get(("dsec_create_queue_depth", frozenset({("project", project)})), 0.0)


def _full(client: dsec.Client, node: KitNode) -> list[str]:
    """Fill the node's room with sandboxes of project ``filler``; their ids."""
    return [sb.id for sb in client.create_many(_spec(node, "filler"), ROOM)]


def _create_in_thread(node: KitNode, spec: SandboxSpec, **kw) -> tuple[threading.Thread, dict]:
    """A create (with a client of its own) in a thread of its own: its answer or error goes
    in the dict."""
    out: dict = {}

    def run() -> None:
        try:
            with node.client() as c:
                out["result"] = c.create(spec, **kw)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_create_that_waits_gets_room_when_a_sandbox_goes(client, node):
    fillers = _full(client, node)
    with pytest.raises(AdmissionRejected):  # without wait: refused at once, as before
        client.create(_spec(node, "t"))
    t, out = _create_in_thread(node, _spec(node, "t"), wait=20)
    until(lambda: _depth(node, "t") == 1, timeout=5)
    assert t.is_alive()
    client.kill(fillers[0])
    t.join(15)
    assert "result" in out, out
    assert out["result"].info.labels["project"] == "t"
    assert _depth(node, "t") == 0
    got = _metrics(node)
    waited = [v for (n, _), v in got.items() if n == "dsec_create_queue_wait_seconds_sum"]
    assert waited and waited[0] > 0.05  # it waited until the kill


def test_a_create_whose_deadline_passes_is_refused_naming_why(client, node):
    _full(client, node)
    before = _metrics(node).get(
        ("dsec_create_queue_rejected_total", frozenset({("reason", "count")})), 0.0
    )
    t0 = time.monotonic()
    with pytest.raises(AdmissionRejected) as e:
        client.create(_spec(node, "late"), wait=0.6)
    assert time.monotonic() - t0 >= 0.6
    ctx = e.value.context
    assert ctx["reason"] == "count" and ctx["waited"] >= 0.6 and ctx["position"] == 0
    assert ctx["project"] == "late"
    assert "waited" in str(e.value) and "full" in str(e.value)
    after = _metrics(node)
    assert after[("dsec_create_queue_rejected_total", frozenset({("reason", "count")}))] == (
        before + 1
    )
    assert _depth(node, "late") == 0


def _served_order(client: dsec.Client, node: KitNode, queued: list[tuple[str, dict]]) -> list:
    """Fill the room, queue creates of ``queued`` ((project, create kwargs), in this order,
    each waiting), free the room, and return the labels of the first ``ROOM`` served, in
    the order the node let them go."""
    fillers = _full(client, node)
    threads = []
    for i, (project, kw) in enumerate(queued):
        threads.append(_create_in_thread(node, _spec(node, project), wait=30, **kw))
        until(lambda i=i: sum(_metrics_depths(node).values()) == i + 1, timeout=5)
    for sid in fillers:
        client.kill(sid)
    until(lambda: sum("result" in out for _, out in threads) >= ROOM, timeout=20)
    made = sorted(
        (out["result"] for _, out in threads if "result" in out), key=lambda i: i.info.created
    )
    for info in made:  # room for the rest, which then go too
        client.kill(info.id)
    for t, out in threads:
        t.join(20)
        assert "result" in out, out
    return [(i.info.labels["project"], i.info.labels.get("n")) for i in made][:ROOM]


def _metrics_depths(node: KitNode) -> dict[str, float]:
    return {
        dict(labels)["project"]: v
        for (n, labels), v in _metrics(node).items()
        if n == "dsec_create_queue_depth"
    }


def test_a_flood_from_one_project_leaves_the_other_its_share(client, node):
    queued = [("flood", {})] * 6 + [("other", {})] * 2
    order = [p for p, _ in _served_order(client, node, queued)]
    assert order == ["flood", "other", "flood", "other"]


def test_batches_of_one_project_share_it(client, node):
    # project "p": a batch "big" of five queued first, then a batch "small" of two
    queued = [("p", {"batch": "big"})] * 5 + [("p", {"batch": "small"})] * 2
    fillers = _full(client, node)
    threads = []
    for i, (_, kw) in enumerate(queued):  # in arrival order: each queued before the next
        spec = _spec(node, "p", n=f"{kw['batch']}{i}")
        threads.append(_create_in_thread(node, spec, wait=30, **kw))
        until(lambda i=i: _depth(node, "p") == i + 1, timeout=5)
    for sid in fillers:
        client.kill(sid)
    until(lambda: sum("result" in out for _, out in threads) >= ROOM, timeout=20)
    made = sorted(
        (out["result"] for _, out in threads if "result" in out), key=lambda i: i.info.created
    )
    assert [i.info.labels["n"].rstrip("0123456789") for i in made] == [
        "big",
        "small",
        "big",
        "small",
    ]
    for info in made:
        client.kill(info.id)
    for t, out in threads:
        t.join(20)
        assert "result" in out, out


def test_no_more_creates_start_at_once_than_the_start_slots(client, node):
    def waits() -> tuple[float, float]:
        got = _metrics(node)
        fast = got[("dsec_create_queue_wait_seconds_bucket", frozenset({("le", "0.01")}))]
        return fast, got[("dsec_create_queue_wait_seconds_count", frozenset())]

    fast0, count0 = waits()
    client.create_many(_spec(node, "burst"), ROOM)  # all at once, room for all
    fast, count = waits()
    assert count - count0 == ROOM
    # two start at once; the others waited a whole create (tens of ms) for a slot
    assert fast - fast0 <= STARTING
    got = _metrics(node)
    assert got[("dsec_create_starting", frozenset())] == 0


def test_a_cancelled_caller_leaves_the_queue_and_nothing_is_made(client, node):
    fillers = _full(client, node)

    async def cancel_one() -> None:
        async with dsec.AsyncClient(os.fspath(node.config.socket_path)) as ac:
            task = asyncio.ensure_future(ac.create(_spec(node, "gone"), wait=30))
            deadline = time.monotonic() + 5
            while await asyncio.to_thread(_depth, node, "gone") != 1:
                assert time.monotonic() < deadline, "the create never queued"
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancel_one())
    until(lambda: _depth(node, "gone") == 0, timeout=5)
    client.kill(fillers[0])  # room: a create still queued would take it now
    time.sleep(0.5)
    projects = [i.labels.get("project") for i in client.list()]
    assert "gone" not in projects and len(projects) == ROOM - 1


def test_a_create_sent_again_makes_its_own_once_the_first_caller_leaves(client, node):
    """Two creates under one key wait for room: the second waits for the first's outcome
    rather than queueing a create of its own. The first's caller leaves (its create is called
    off); the second then makes the sandbox itself, once."""
    fillers = _full(client, node)

    async def race() -> str:
        sock = os.fspath(node.config.socket_path)
        async with dsec.AsyncClient(sock) as a, dsec.AsyncClient(sock) as b:
            spec = _spec(node, "again")
            first = asyncio.ensure_future(a.create(spec, wait=30, key="k-1"))
            deadline = time.monotonic() + 5
            while await asyncio.to_thread(_depth, node, "again") != 1:
                assert time.monotonic() < deadline, "the create never queued"
                await asyncio.sleep(0.05)
            second = asyncio.ensure_future(b.create(spec, wait=30, key="k-1"))
            await asyncio.sleep(0.3)
            assert await asyncio.to_thread(_depth, node, "again") == 1  # one in the queue
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            await asyncio.to_thread(client.kill, fillers[0])  # room for one
            return (await asyncio.wait_for(second, 30)).id

    made = asyncio.run(race())
    assert [i.id for i in client.list() if i.labels.get("project") == "again"] == [made]


# --- through an apiserver --------------------------------------------------------------------


@dataclass
class Api:
    url: str
    iam: Iam
    layer: str
    operator: str

    def client(self, project: str) -> dsec.Client:
        return dsec.Client(self.url, api_key=self.key(project))

    def key(self, project: str) -> str:
        if project not in {p.path for p in self.iam.projects()}:
            self.iam.create_project(project)
        return self.iam.create_key(project, "member")[1]

    def spec(self) -> SandboxSpec:
        return SandboxSpec(layers=(self.layer,), memory="64M")

    def depth(self, project: str) -> float:
        t = HTTPTransport(self.url, token=self.operator)
        try:
            text = t.request("GET", "/metrics", timeout=10).text
        finally:
            t.close()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "dsec_apiserver_create_queue_depth" and s.labels == {
                    "project": project
                }:
                    return s.value
        return 0.0


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[Api]:
    """An apiserver over one node with room for ``ROOM`` sandboxes."""
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    env = {"DSEC_MAX_SANDBOXES": str(ROOM), "DSEC_MAX_STARTING": str(STARTING)}
    try:
        with named_nodes({"q1": {}}, env) as nodes, running_apiserver(nodes, iam_url) as server:
            operator = iam.create_key("/", "admin")[1]
            yield Api(server.url, iam, nodes[0].node.layer.ref, operator)
    finally:
        iam.close()


def test_through_the_apiserver_a_create_waits_for_room_on_a_node(api):
    with api.client("fill") as c:
        fillers = c.create_many(api.spec(), ROOM, wait=10)  # past the last test's kills
        try:
            with pytest.raises(AdmissionRejected):  # without wait: refused at once
                c.create(api.spec())
            with pytest.raises(AdmissionRejected) as e:
                c.create(api.spec(), wait=0.5)
            assert e.value.context["waited"] >= 0.5 and "waited" in str(e.value)
            out: dict = {}

            def waiting() -> None:
                with api.client("later") as c2:
                    out["sb"] = c2.create(api.spec(), wait=30)

            t = threading.Thread(target=waiting, daemon=True)
            t.start()
            until(lambda: api.depth("later") == 1, timeout=10)
            fillers.pop().kill()
            t.join(20)
            assert "sb" in out, "the waiting create was not served"
            assert out["sb"].info.labels[PROJECT_LABEL] == "later"
            assert api.depth("later") == 0
            out["sb"].kill()
        finally:
            for sb in fillers:
                sb.kill()


def test_through_the_apiserver_a_cancelled_create_leaves_both_queues(api):
    key = api.key("gone")
    with api.client("fill2") as c:
        fillers = c.create_many(api.spec(), ROOM, wait=10)  # past the last test's kills

        async def cancel_one() -> None:
            async with dsec.AsyncClient(api.url, api_key=key) as ac:
                task = asyncio.ensure_future(ac.create(api.spec(), wait=30))
                deadline = time.monotonic() + 10
                while await asyncio.to_thread(api.depth, "gone") != 1:
                    assert time.monotonic() < deadline, "the create never queued"
                    await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        try:
            asyncio.run(cancel_one())
            until(lambda: api.depth("gone") == 0, timeout=5)
            fillers.pop().kill()
            time.sleep(1.5)  # past a probe: room a queued create would have taken
            with api.client("gone") as g:
                assert g.list() == []
        finally:
            for sb in fillers:
                sb.kill()
