"""Warm claims on a real node daemon: a create that matches a warm member claims it (its env,
labels, project and ttl applied, its id its own), one that does not, or finds none ready,
starts cold; members refill in the background, are never listed, counted or reused, survive
nothing of a claim, and a restarted daemon keeps both claimed sandboxes and members straight.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from fake_host import FakeCatalogs

from dsec_core.api.messages import WarmSettings, WarmTarget
from dsec_core.backend import cgroup_path
from dsec_core.catalog.model import Catalog, Environment, WarmEntry, parse_catalog
from dsec_core.catalog.store import CatalogStore
from dsec_core.errors import CatalogInvalid, InvalidSpec, UnknownSandbox
from dsec_core.localnode import daemon_pid
from dsec_core.node.node import Node
from dsec_core.node.sandbox import POOL_LABEL
from dsec_core.node.warm import shape_of
from dsec_core.records import PROJECT_LABEL, SandboxSpec
from dsec_core.testing import cgroup_hierarchies, node_home, running_kit_node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

SHAPE = {"cpu": 0.5, "memory": "128M", "pids": 128, "disk": "64M"}


def wait_ready(client, n: int, timeout: float = 30.0) -> dict:
    """The pool's status once ``n`` members are ready (one pool configured)."""
    deadline = time.monotonic() + timeout
    while True:
        pools = client.warm().pools
        if pools and sum(p.ready for p in pools) >= n:
            return pools[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"warm pools never had {n} ready: {pools}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def node():
    with running_kit_node("dsec-warm-") as node:
        node.environment("warmenv")
        yield node


@pytest.fixture
def client(node):
    with node.client() as c:
        yield c
        c.set_warm([], auto=False)
        deadline = time.monotonic() + 15
        while c.warm().pools and time.monotonic() < deadline:
            time.sleep(0.05)
        for info in c.list():
            c.kill(info.id)


def members(node) -> list[str]:
    """The ids of the node's warm members, from their state files (the API never names them)."""
    return [
        p.parent.name
        for p in node.config.runtime_dir.glob("*/state.json")
        if json.loads(p.read_text()).get("warm")
    ]


def spec(**kw) -> SandboxSpec:
    return SandboxSpec(environment="warmenv", **{**SHAPE, **kw})


def test_a_matching_create_claims_a_member_and_gets_its_own_env_labels_and_ttl(node, client):
    client.set_warm([(spec(), 2)])
    pool = wait_ready(client, 2)
    assert (pool.target, pool.sources) == (2, ("api",))
    assert client.list() == [], "warm members are never listed"
    assert client.node_info()["sandboxes"] == 0

    t = time.time()
    sb = client.create(
        spec(env={"TASK": "t-1"}, labels={PROJECT_LABEL: "team-a", "run": "7"}, ttl=120)
    )
    pool = client.warm().pools[0]
    assert pool.claimed == 1 and pool.missed == 0
    info = client.get(sb.id).info
    assert info.labels == {PROJECT_LABEL: "team-a", "run": "7"}
    assert info.environment == "warmenv" and info.state == "running"
    assert t - 1 <= info.created <= time.time() and 118 < info.expires - time.time() <= 120
    assert client.probe().projects["team-a"].sandboxes == 1  # its project's, as cold
    r = sb.exec("echo $TASK; hostname")
    assert r.stdout.decode().split() == ["t-1", f"dsec-{sb.id[:12]}"]
    # its record, state file and cgroups are all named by the id the create returned
    state = json.loads((node.config.runtime_dir / sb.id / "state.json").read_text())
    assert state["id"] == sb.id and state["warm"] is False
    assert state["spec"]["env"] == {"TASK": "t-1"} and state["spec"]["ttl"] == 120
    assert any((h / cgroup_path(sb.id)).exists() for h in cgroup_hierarchies())
    # the claimed one is refilled, in the background
    wait_ready(client, 2)
    sb.kill()
    with pytest.raises(UnknownSandbox):
        client.get(sb.id)


def test_a_create_of_another_shape_or_with_none_ready_starts_cold(client):
    client.set_warm([(spec(), 1)])
    wait_ready(client, 1)
    other = client.create(spec(cpu=1.0))  # another shape: cold, the pool untouched
    assert client.warm().pools[0].claimed == 0
    first = client.create(spec())
    second = client.create(spec())  # the one member is taken: this one goes cold
    pool = client.warm().pools[0]
    assert (pool.claimed, pool.missed) == (1, 1)
    assert len({other.id, first.id, second.id}) == 3
    for sb in (other, first, second):
        assert sb.exec("echo ok").stdout == b"ok\n"


def test_a_claimed_sandbox_is_never_a_member_again(client):
    client.set_warm([(spec(), 1)])
    wait_ready(client, 1)
    sb = client.create(spec())
    sb.write_file("/root/secret", b"of the first tenant")
    sb.exec("sleep 600 >/dev/null 2>&1 &", background=True).check()
    claimed_id = sb.id
    sb.kill()
    wait_ready(client, 1)
    again = client.create(spec())
    assert again.id != claimed_id
    assert again.exec("ls /root; ps -o args | grep -c '[s]leep 600'").stdout == b"0\n"


def test_targets_are_checked_and_kept_for_the_next_daemon(node, client):
    with pytest.raises(InvalidSpec):
        client.set_warm([WarmTarget(spec(devices=("kit-null:1",)), 1)])
    status = client.set_warm([(spec(), 1)], auto=True, budget="1G", window=30)
    assert (status.auto, status.budget, status.window) == (True, 1 << 30, 30.0)
    saved = json.loads((node.config.home / "warm.json").read_text())
    assert saved["auto"] is True and saved["targets"][0]["count"] == 1
    wait_ready(client, 1)


def test_a_restarted_daemon_keeps_claimed_sandboxes_and_takes_members_back(node, client):
    client.set_warm([(spec(), 2)])
    wait_ready(client, 2)
    sb = client.create(spec(env={"A": "1"}, labels={"k": "v"}))
    wait_ready(client, 2)
    node.restart()
    with node.client() as again:
        assert [i.id for i in again.list()] == [sb.id]
        info = again.get(sb.id).info
        assert info.labels == {"k": "v"}
        assert again.get(sb.id).exec("echo $A").stdout == b"1\n"
        pool = wait_ready(again, 2)  # the members the stopped daemon killed are started again
        assert pool.target == 2
        claimed = again.create(spec())
        assert claimed.id != sb.id and again.warm().pools[0].claimed == 1


def test_automatic_mode_learns_from_recent_creates_within_its_budget(client):
    client.set_warm([], auto=True, budget="256M", window=60)
    made = [client.create(spec(env={"N": str(i)})) for i in range(3)]
    # three creates of a 128M shape in the window, a budget for two of them
    deadline = time.monotonic() + 30
    while True:
        pools = client.warm().pools
        if pools and pools[0].ready == 2:
            break
        assert time.monotonic() < deadline, pools
        time.sleep(0.05)
    assert pools[0].sources == ("auto",) and pools[0].target == 2
    sb = client.create(spec(env={"N": "x"}))
    assert client.warm().pools[0].claimed == pools[0].claimed + 1
    assert sb.exec("echo $N").stdout == b"x\n"
    for m in made:
        m.kill()


def test_a_catalogs_warm_entries_are_kept_warm(node, client):
    store = CatalogStore(node.config.catalog_dir)
    env = Environment(name="warmcat", base=node.layer.ref)
    entry = WarmEntry(environment="warmcat", count=1, **SHAPE)
    store.save(Catalog(name="warmcat", environments=(env,), warm=(entry,)))
    try:
        pool = wait_ready(client, 1)
        assert pool.sources == ("catalog",)
        sb = client.create(SandboxSpec(environment="warmcat/warmcat", **SHAPE))
        assert client.warm().pools[0].claimed == 1
        sb.kill()
    finally:
        store.remove("warmcat")


def test_a_catalogs_warm_entry_is_checked():
    doc = {"name": "c", "warm": [{"environment": "e", "count": 1, "memory": "lots"}]}
    with pytest.raises(CatalogInvalid, match=r"\$\.warm\[0\]"):
        parse_catalog(doc, check_layers=False)
    doc = {"name": "c", "warm": [{"environment": "e", "count": 2, "cpu": 2}]}
    entry = parse_catalog(doc, check_layers=False).warm[0]
    assert entry.spec("c").environment == "c/e" and entry.to_document() == doc["warm"][0]


def test_the_cli_sets_targets_and_node_status_shows_the_pools(node, client):
    def dsec(*args: str) -> str:
        env = dict(os.environ, DSEC_HOME=os.fspath(node.home))
        out = subprocess.run(
            [sys.executable, "-m", "dsec_core.cli", *args], env=env, capture_output=True
        )
        assert out.returncode == 0, out.stderr.decode()
        return out.stdout.decode()

    shape = ["--cpu", "0.5", "--memory", "128M", "--pids", "128", "--disk", "64M"]
    dsec("node", "warm", "set", "warmenv", "1", *shape)
    wait_ready(client, 1)
    status = dsec("node", "status")
    assert "warm pool kit-base@1/container/0.5cpu/128M#" in status
    assert "(api): 1 ready of 1" in status
    sb = client.create(spec())  # the CLI's target is the create's shape
    assert client.warm().pools[0].claimed == 1
    sb.kill()
    dsec("node", "warm", "set", "warmenv", "0", *shape)
    assert client.warm().targets == ()
    assert "auto: on, budget 512 MiB" in dsec("node", "warm", "auto", "on", "--budget", "512M")


def test_members_give_their_room_to_creates_and_are_killed_first(monkeypatch):
    """On a node of 3 sandboxes with 3 warm members, 3 creates of another shape all start
    (members are not counted) and the members go to keep the node within its capacity."""
    monkeypatch.setenv("DSEC_MAX_SANDBOXES", "3")
    with running_kit_node("dsec-warm-room-") as node, node.client() as client:
        node.environment("warmenv")
        client.set_warm([(spec(), 3)])
        wait_ready(client, 3)
        made = [client.create(spec(cpu=1.0)) for _ in range(3)]
        deadline = time.monotonic() + 15
        while (status := client.warm()).evicted < 3:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert sum(p.ready + p.starting for p in status.pools) == 0
        time.sleep(0.5)  # no refill while the node, members counted, is full
        assert sum(p.ready + p.starting for p in client.warm().pools) == 0
        assert {i.id for i in client.list()} == {sb.id for sb in made}
        made[0].kill()
        wait_ready(client, 1)  # room again: refilled up to what the node holds
        client.set_warm([])


def test_a_crashed_daemons_members_are_taken_back(node, client):
    client.set_warm([(spec(), 1)])
    wait_ready(client, 1)
    (member,) = members(node)
    pid = daemon_pid(node.config)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while daemon_pid(node.config) == pid and time.monotonic() < deadline:
        time.sleep(0.05)
    node.ensure_running()
    with node.client() as again:
        wait_ready(again, 1)
        sb = again.create(spec(env={"B": "2"}))
        assert sb.id == member, "the member the crashed daemon left was not claimed"
        assert sb.exec("echo $B").stdout == b"2\n"


def test_what_a_create_may_differ_in_and_what_it_may_not(tmp_path):
    """Shapes on records alone (``fake_host``): env, labels, ttl and the like are applied at
    claim; what decides what runs must be equal, and some specs never claim."""
    catalogs = FakeCatalogs()
    base = SandboxSpec(layers=("base@1",), backend="fake", memory="128M")
    shape = shape_of(base, catalogs)[1]
    same = dict(env={"A": "1"}, labels={"k": "v"}, ttl=5, start_timeout=9, trajectory="t")
    assert shape_of(SandboxSpec(**{**base.to_dict(), **same}), catalogs)[1] == shape
    for differs in (
        {"cpu": 2.0},
        {"memory": "256M"},
        {"pids": 64},
        {"disk": "1G"},
        {"network": "internet"},
        {"policies": {"landlock": {}}},
        {"qos": "be"},
        {"runtime": "runsc"},
        {"workdir": "/root"},
        {"layers": ("top@1", "base@1")},
        {"backend": "other"},
    ):
        assert shape_of(SandboxSpec(**{**base.to_dict(), **differs}), catalogs)[1] != shape
    for never in ({"devices": ("gpu:1",)}, {"drives": ("sb1",)}, {"labels": {POOL_LABEL: "p"}}):
        assert shape_of(SandboxSpec(**{**base.to_dict(), **never}), catalogs) is None


def test_a_closing_node_leaves_no_member_behind():
    """Members being started when the node closes are killed, not left running."""

    async def run(config) -> None:
        node = Node(config)
        await node.open()
        member = SandboxSpec(layers=("kit-base@1",), **SHAPE)
        node.set_warm(WarmSettings(targets=(WarmTarget(member, 4),)))
        deadline = time.monotonic() + 30
        while not any(p.ready for p in node.warm_status().pools):  # one ready, more starting
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await node.close()

    with node_home("dsec-warm-close-") as config:  # fails on anything left behind
        asyncio.run(run(config))
