"""The apiserver on a 3-node local Ray cluster: it finds the node daemons ``dsec cluster up``
started through Ray, places on the home pool, and when one node's daemon is killed mid-run
its sandboxes report ``NodeLost``, new creates go to the other nodes, and nothing on the
surviving nodes is disturbed. (``dsec_cluster`` and ``dsec_ray_cluster`` are the kit's module
fixtures.)"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

import dsec
from dsec_core.apiserver import OVERFLOW_LABEL
from dsec_core.errors import NodeLost
from dsec_core.iam import Iam
from dsec_core.testing.apiserver import ApiserverProcess, start_apiserver
from dsec_core.testing.ray import KitCluster, ray_loopback_lock


@pytest.fixture(scope="module", autouse=True)
def _one_ray_module_at_a_time() -> Iterator[None]:
    """Ray clusters take the fixed loopback addresses 127.0.0.2-4: one module at a time on
    this machine (parallel test workers wait here)."""
    with ray_loopback_lock():
        yield


PROBE = ["--probe-interval", "0.5", "--probe-timeout", "0.5", "--probe-misses", "2"]


@pytest.fixture(scope="module")
def api(dsec_cluster: KitCluster, dsec_ray_cluster, tmp_path_factory) -> Iterator[tuple]:
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    with Iam.open(iam_url) as iam:
        iam.create_project("rl")
        _, key = iam.create_key("rl", "member")
    server: ApiserverProcess = start_apiserver(
        [], iam_url, ray=dsec_ray_cluster.address, args=PROBE
    )
    try:
        yield server, key
    finally:
        server.stop()
        server.log.unlink(missing_ok=True)


def _wait_nodes(c: dsec.Client, n: int) -> None:
    deadline = time.monotonic() + 30
    while c.node_info()["home"] != f"apiserver:{n}/{n} nodes":
        assert time.monotonic() < deadline, c.node_info()["home"]
        time.sleep(0.2)


def test_the_apiserver_finds_the_nodes_through_ray_and_places_on_the_home_pool(
    api, dsec_cluster: KitCluster
):
    server, key = api
    with dsec.Client(server.url, api_key=key) as c:
        _wait_nodes(c, 3)
        spec = dsec.SandboxSpec(layers=(dsec_cluster.layer.ref,), memory="64M", cpu=0.5)
        sbs = c.create_many(spec, n=10)  # past what warm layers draw to one node
        try:
            assert {sb.id.rsplit("-", 1)[1] for sb in sbs} == {"n1", "n2"}
            for sb in sbs:
                assert sb.exec("echo $((6*7))").stdout == b"42\n"
        finally:
            for sb in sbs:
                sb.kill()


def test_killing_a_node_daemon_mid_run(api, dsec_cluster: KitCluster):
    server, key = api
    with dsec.Client(server.url, api_key=key) as c:
        _wait_nodes(c, 3)
        spec = dsec.SandboxSpec(layers=(dsec_cluster.layer.ref,), memory="64M", cpu=0.5)
        sbs = c.create_many(spec, n=10)
        victims = [sb for sb in sbs if sb.id.endswith("-n2")]
        survivors = [sb for sb in sbs if sb.id.endswith("-n1")]
        assert victims and survivors
        for sb in survivors:
            sb.exec("echo kept > /tmp/state")
        os.kill(dsec_cluster.daemon_pids["n2"], signal.SIGKILL)
        t0 = time.monotonic()
        while True:
            try:
                victims[0].exec("true")
            except NodeLost as e:
                assert e.node == "n2"
                break
            except dsec.DsecError:
                pass
            assert time.monotonic() - t0 < 5, "the lost node was not noticed within 5 s"
            time.sleep(0.05)
        made = c.create_many(spec, n=3)
        try:
            assert all(sb.id.endswith("-n1") for sb in made)  # n3 is the overflow pool
            for sb in survivors:
                assert sb.read_file("/tmp/state") == b"kept\n"
        finally:
            for sb in made + survivors:
                sb.kill()
        dsec_cluster.up()  # its daemon back: it re-adopts the victims, and the module's
        # teardown kills them


def test_the_ray_overflow_group_takes_what_may_overflow_past_the_threshold(
    api, dsec_cluster: KitCluster, dsec_ray_cluster
):
    _, key = api
    iam_url = api[0].proc.args[api[0].proc.args.index("--iam") + 1]
    burst = start_apiserver(
        [], iam_url, ray=dsec_ray_cluster.address, args=[*PROBE, "--overflow-at", "0"]
    )
    try:
        with dsec.Client(burst.url, api_key=key) as c:
            _wait_nodes(c, 3)
            base = {"layers": (dsec_cluster.layer.ref,), "memory": "64M", "cpu": 0.5}
            may = dsec.SandboxSpec(**base, labels={OVERFLOW_LABEL: "true"})
            with c.create(may) as sb:
                assert sb.id.endswith("-n3")  # the Ray node with the dsec_overflow resource
            with c.create(dsec.SandboxSpec(**base)) as sb:
                assert not sb.id.endswith("-n3")
    finally:
        burst.stop()
        burst.log.unlink(missing_ok=True)
