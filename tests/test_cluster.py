"""dsec on Ray: a real 3-node Ray cluster on 127.0.0.2-4 (n3 in the overflow pool),
``dsec cluster up`` on it, sandboxes on every node through their TCP endpoints, a node daemon
killed mid-run, ``dsec cluster down``, and nothing left behind: no daemon, no actor, no Ray
process (each stopped by pid), no home, no temp dir."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_core.cli import main
from dsec_core.cluster import (
    ACTOR_PREFIX,
    NAMESPACE,
    ClusterPlan,
    ClusterUnavailable,
    discover,
    down,
    node_labels,
    status,
    up,
)
from dsec_core.errors import AuthenticationFailed, InvalidSpec, NodeUnavailable
from dsec_core.sdk import Client
from dsec_core.testing import (
    KitCluster,
    LocalRayCluster,
    free_port,
    leftovers,
    ray_importable,
    ray_loopback_lock,
)


@pytest.fixture(scope="module", autouse=True)
def _one_ray_module_at_a_time() -> Iterator[None]:
    """Ray clusters take the fixed loopback addresses 127.0.0.2-4: one module at a time on
    this machine (parallel test workers wait here)."""
    with ray_loopback_lock():
        yield


needs_cluster = pytest.mark.skipif(
    not ray_importable() or os.geteuid() != 0,
    reason="needs Ray (pip install 'dsec[cluster]') and root (node daemons)",
)


@pytest.fixture
def ray_cluster(dsec_ray_cluster: LocalRayCluster) -> LocalRayCluster:
    """The kit's module-wide 3-node Ray cluster (n3 in the overflow pool); at the end of the
    module it is stopped by pid and fails the last test if any of its processes survived."""
    return dsec_ray_cluster


@pytest.fixture
def kit(dsec_cluster: KitCluster) -> KitCluster:
    """The kit's module-wide daemons on it; ``down`` and checked at the end of the module."""
    return dsec_cluster


def dsec(capsys, *args: str) -> tuple[int, str, str]:
    """Run the ``dsec`` command in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if b"=" in item)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _state(pid) in ("gone", "Z"):
            return True
        time.sleep(0.05)
    return False


# --- pure logic, no cluster ----------------------------------------------------------------


def test_pool_labels_come_from_the_overflow_resource_or_dsec_labels():
    assert node_labels({"Resources": {"CPU": 1.0}}) == {"dsec.pool": "home"}
    assert node_labels({"Resources": {"dsec_overflow": 1.0}}) == {"dsec.pool": "overflow"}
    labels = {"dsec.pool": "overflow", "dsec.zone": "a", "ray.io/node-id": "x"}
    assert node_labels({"Resources": {}, "Labels": labels}) == {
        "dsec.pool": "overflow",
        "dsec.zone": "a",
    }


def test_uid_slots_are_disjoint_and_bounded():
    plan = ClusterPlan(uid_base=100000, uid_size=65536, uid_ranges=4096)
    bases = [plan.uid_slot_base(k) for k in range(3)]
    assert [b - bases[0] for b in bases] == [0, 4096 * 65536, 2 * 4096 * 65536]
    with pytest.raises(InvalidSpec, match="--uid-ranges"):
        plan.uid_slot_base(16)  # 16 nodes of 2**28 ids each end past 2**32 - 2
    # a host's nodes laid out by an earlier plan: a new one goes past all of them
    other = ClusterPlan(uid_base=100000, uid_size=65536, uid_ranges=1024)
    held = [(other.uid_slot_base(k), other.uid_slot_base(k) + other.uid_span) for k in (0, 5)]
    assert plan.free_slot(held) == 2  # slot 1 overlaps other's slot 5
    assert plan.free_slot([]) == 0


def test_without_ray_the_cluster_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ClusterUnavailable, match=r"pip install 'dsec\[cluster\]'"):
        discover("127.0.0.2:6379")
    # and in a process that never had it: the package and the CLI import, the command says so
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import dsec_core.cluster\n"
        "from dsec_core.cli import main\n"
        "main(['cluster', 'ls', '--address', '127.0.0.2:6379'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "Error: dsec cluster needs Ray" in out.stderr and "dsec[cluster]" in out.stderr


@needs_cluster
def test_no_address_or_nothing_there_fails_fast(tmp_path):
    # in a process of its own: this one is connected to the module's cluster
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "dsec_core.cli", "cluster", "ls"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Error: no Ray cluster address" in out.stderr
    t0 = time.monotonic()
    out = subprocess.run(
        [*cmd, "--address", f"127.0.0.2:{free_port()}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "Error: no Ray cluster answers at" in out.stderr
    assert time.monotonic() - t0 < 20


def test_a_cluster_is_stopped_by_pid_to_its_last_process(tmp_path):
    # the stop of LocalRayCluster on a stand-in tree: a process whose child outlives it
    root = tmp_path / "ray"
    root.mkdir()
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & exec sleep 61"], start_new_session=True)
    stand_in = LocalRayCluster(address="127.0.0.2:1", nodes=[], root=root, procs=[proc])
    deadline = time.monotonic() + 5
    while len(stand_in.pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = stand_in.pids()
    assert len(pids) == 2 and len(stand_in.left_behind()) == 3  # two processes, the dir
    stand_in.stop(grace=0.5)
    assert stand_in.left_behind() == []
    assert all(_gone(p) for p in pids) and not root.exists()


# --- a real cluster ------------------------------------------------------------------------


@needs_cluster
def test_up_gives_every_ray_node_its_own_daemon(kit: KitCluster, ray_cluster: LocalRayCluster):
    eps = kit.endpoints
    assert [e.name for e in eps] == ["n1", "n2", "n3"]
    by_ip = {n.ip: n for n in ray_cluster.nodes}
    assert len({e.url for e in eps}) == 3
    for e, ip in zip(eps, ["127.0.0.2", "127.0.0.3", "127.0.0.4"], strict=True):
        assert e.url.startswith(f"http://{ip}:") and e.alive
        assert e.ray_node_id == by_ip[ip].node_id  # pinned to its node
        assert e.token and e.token not in {o.token for o in eps if o is not e}
    states = {s.endpoint.name: s for s in status(ray_cluster.address)}
    homes = {s.home for s in states.values()}
    assert len(homes) == 3
    spans = sorted((s.uid_base, s.uid_base + s.uid_count) for s in states.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # disjoint
    for name, s in states.items():
        assert s.pid == kit.daemon_pids[name]
        env = _environ(s.pid)
        assert env["DSEC_HOME"] == s.home and env["DSEC_UID_BASE"] == str(s.uid_base)
        assert env["DSEC_NODE_NAME"] == name
        assert env["DSEC_LISTEN"] == s.endpoint.url
        assert env["DSEC_LAYER_SOURCES"] == kit.plan.layer_sources[0]
        # the daemon runs on its Ray node: below that node's `ray start`
        assert s.pid in ray_cluster.node_pids(s.node_ip)


@needs_cluster
def test_sandboxes_run_on_every_node_in_its_uid_range(kit: KitCluster, ray_cluster):
    states = {s.endpoint.name: s for s in status(ray_cluster.address)}
    for e in kit.endpoints:
        with Client(e.url, token=e.token, autostart=False) as client:
            sb = client.create(layers=(kit.layer.ref,), memory="128M", ttl=300)
            try:
                assert sb.exec("echo hello from $(hostname)").check().stdout.startswith(b"hello")
                inside, host, size = sb.exec("cat /proc/self/uid_map").stdout.split()[:3]
                s = states[e.name]
                assert inside == b"0" and s.uid_base <= int(host) < s.uid_base + s.uid_count
                assert [i.id for i in client.list()] == [sb.id]  # its own node only
                assert sb.id.endswith(f"-{e.name}")  # what routes it to its node
            finally:
                sb.kill()


@needs_cluster
def test_the_overflow_label_reaches_its_node(kit: KitCluster):
    pools = {e.name: e.pool for e in kit.endpoints}
    assert pools == {"n1": "home", "n2": "home", "n3": "overflow"}
    for e in kit.endpoints:
        env = _environ(kit.daemon_pids[e.name])
        assert env["DSEC_NODE_LABELS"] == f"dsec.pool={pools[e.name]}"
        with kit.client(e.name) as client:  # the node itself says so to the watcher
            probe = client.probe()
            assert probe.name == e.name and probe.load.node == e.name
            assert dict(probe.load.labels) == {"dsec.pool": pools[e.name]}


@needs_cluster
def test_a_wrong_token_is_refused(kit: KitCluster):
    e = kit.endpoint("n1")
    with Client(e.url, token="not-" + e.token, autostart=False) as client:
        with pytest.raises(AuthenticationFailed):
            client.node_info()


@needs_cluster
def test_cli_ls_and_a_second_up_change_nothing(kit: KitCluster, ray_cluster, capsys):
    code, out, err = dsec(capsys, "cluster", "ls", "--json", "--address", ray_cluster.address)
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["name"], r["pid"], r["alive"]) for r in rows] == [
        (n, kit.daemon_pids[n], True) for n in ("n1", "n2", "n3")
    ]
    assert all("token" not in r for r in rows)
    code, out, err = dsec(
        capsys, "cluster", "up", "--json", "--address", ray_cluster.address, "--home-root", "/no"
    )
    assert code == 0, err
    again = json.loads(out)
    assert [(r["name"], r["url"], r["token"]) for r in again] == [
        (e.name, e.url, e.token) for e in kit.endpoints
    ]
    assert {s.endpoint.name: s.pid for s in status(ray_cluster.address)} == kit.daemon_pids
    code, out, err = dsec(capsys, "cluster", "ls", "--tokens")
    assert code != 0 and "--tokens needs --json" in err


@needs_cluster
def test_a_killed_daemon_is_seen_and_the_others_are_untouched(kit: KitCluster, ray_cluster):
    clients = {e.name: kit.client(e.name) for e in kit.endpoints}
    made = {
        n: c.create(layers=(kit.layer.ref,), memory="128M", ttl=300) for n, c in clients.items()
    }
    try:
        for sb in made.values():
            sb.exec("echo 1 > /tmp/state").check()
        victim = kit.daemon_pids["n2"]
        os.kill(victim, signal.SIGKILL)
        assert _gone(victim)
        # a killed process is a zombie to /proc before its last thread has exited, and only
        # then can its parent reap it: the keeper sees the death within moments, not at once
        t0 = time.monotonic()
        seen = {e.name: e.alive for e in discover(ray_cluster.address)}
        while seen["n2"] and time.monotonic() - t0 < 5:
            time.sleep(0.05)
            seen = {e.name: e.alive for e in discover(ray_cluster.address)}
        assert seen == {"n1": True, "n2": False, "n3": True}
        assert time.monotonic() - t0 < 5
        assert [e.name for e in discover(ray_cluster.address, alive_only=True)] == ["n1", "n3"]
        with Client(kit.endpoint("n2").url, token=kit.endpoint("n2").token, retry=0) as dead:
            with pytest.raises(NodeUnavailable):
                dead.node_info()
        for n in ("n1", "n3"):  # the others serve, their sandboxes as they were
            assert [i.id for i in clients[n].list()] == [made[n].id]
            assert made[n].exec("cat /tmp/state").check().stdout == b"1\n"
            assert kit.daemon_pids[n] == {s.endpoint.name: s.pid for s in status()}[n]
        # `up` again starts n2's daemon at the same URL with the same token; it re-adopts
        before = {e.name: (e.url, e.token) for e in kit.endpoints}
        kit.up()
        assert {e.name: (e.url, e.token) for e in kit.endpoints} == before
        assert kit.daemon_pids["n2"] != victim
        with kit.client("n2") as n2:
            assert n2.get(made["n2"].id).exec("cat /tmp/state").check().stdout == b"1\n"
    finally:
        for n, sb in made.items():
            with kit.client(n) as c:
                c.kill(sb.id)
        for c in clients.values():
            c.close()


@needs_cluster
def test_down_kills_sandboxes_and_leaves_no_daemon_or_actor(kit: KitCluster, ray_cluster, capsys):
    with kit.client("n1") as c:
        c.create(layers=(kit.layer.ref,), memory="128M", ttl=300)
    pids = dict(kit.daemon_pids)
    with pytest.raises(InvalidSpec, match="no cluster node named n9"):
        down(ray_cluster.address, names=["n9"])
    code, out, err = dsec(capsys, "cluster", "down", "--json", "--address", ray_cluster.address)
    assert code == 0, err
    results = json.loads(out)
    assert [(r["name"], r["pid"]) for r in results] == sorted(pids.items())
    assert {r["name"]: r["killed"] for r in results} == {"n1": 1, "n2": 0, "n3": 0}
    assert all(_gone(p) for p in pids.values())
    import ray

    names = ray.util.list_named_actors(all_namespaces=True)
    assert [
        a for a in names if a["namespace"] == NAMESPACE and a["name"].startswith(ACTOR_PREFIX)
    ] == []
    assert discover(ray_cluster.address) == [] and status(ray_cluster.address) == []
    # nothing of a node is left in its home but what the next `up` reuses (layers, caches)
    for name in pids:
        home = Path(kit.plan.home_root) / name
        assert not os.path.ismount(home / "run")
        assert not list((home / "sandboxes").iterdir())
    # and up again on the same homes works (the fixture's teardown takes it down)
    assert [e.name for e in up(ray_cluster.address, kit.plan)] == ["n1", "n2", "n3"]


@needs_cluster
def test_a_daemon_that_cannot_start_is_a_typed_error_and_down_still_cleans(
    kit: KitCluster, ray_cluster
):
    down(ray_cluster.address)
    bad = dataclasses.replace(kit.plan, env={"DSEC_MAX_BATCH": "0"})
    with pytest.raises(NodeUnavailable, match="DSEC_MAX_BATCH must be a positive integer"):
        up(ray_cluster.address, bad)
    states = status(ray_cluster.address)
    assert [(s.endpoint.name, s.endpoint.alive, s.pid) for s in states] == [
        ("n1", False, None),
        ("n2", False, None),
        ("n3", False, None),
    ]
    assert [r["pid"] for r in down(ray_cluster.address)] == [None, None, None]
    assert status(ray_cluster.address) == []
    kit.up()  # as the module found it, for the fixture's own checks at teardown


@needs_cluster
def test_a_lost_machine_comes_back_under_its_name_and_its_home_is_cleaned(
    kit: KitCluster, ray_cluster: LocalRayCluster
):
    """Found by the chaos soak: a Ray node lost (every process of it SIGKILLed: raylet,
    keeper, daemon, its sandboxes' helpers) and started again got a new name from ``up``,
    so what the dead daemon left in its home (its sandboxes, mounts, cgroups, loop devices)
    was never looked at again. It takes its old name back, and the new daemon adopts the
    sandbox (here its processes outlived Ray's: they are not in its process tree)."""
    with kit.client("n2") as c:
        sb = c.create(layers=(kit.layer.ref,), memory="64M", ttl=300)
        sb.exec("echo 1 > /tmp/state").check()
    ip = next(n.ip for n in ray_cluster.nodes if n.node_id == kit.endpoint("n2").ray_node_id)
    ray_cluster.lose_node(ip)
    ray_cluster.restart_node(ip)
    deadline = time.monotonic() + 90
    while True:  # until Ray has noticed the old node is gone: a typed error meanwhile
        try:
            kit.up()
            break
        except NodeUnavailable:
            assert time.monotonic() < deadline
            time.sleep(1)
    assert [e.name for e in kit.endpoints] == ["n1", "n2", "n3"]
    with kit.client("n2") as c:
        assert [i.id for i in c.list()] == [sb.id]
        assert c.exec(sb.id, "cat /tmp/state").check().stdout == b"1\n"
        made = c.create(layers=(kit.layer.ref,), memory="64M", ttl=300)
        assert made.exec("echo ok").check().stdout == b"ok\n"
        made.kill()
        c.kill(sb.id)
    home = Path(kit.plan.home_root) / "n2"
    left = leftovers(home)
    assert not [m for m in left["mounts"] if sb.id in m], left
    assert not [g for g in left["cgroups"] if sb.id in g], left
