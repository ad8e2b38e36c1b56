#!/usr/bin/env python3
"""The control plane on a local 3-node Ray cluster, in one run: what the apiserver adds to a
create, creates per second through one apiserver against two, and how long a lost node takes
to be noticed.

1. A Ray cluster of three nodes on 127.0.0.2-4 (the third in the overflow pool), ``dsec
   cluster up`` on it (a node daemon per Ray node), an IAM store (SQLite) with one project
   and key, and ``dsec apiserver --ray`` processes finding the nodes through Ray.
2. Overhead: create of the kit's busybox sandbox through the apiserver, and directly on the
   node the apiserver chose (its TCP listener and token: the baseline), in pairs whose order
   alternates so drift hits both; the p50 of each, and the overhead as the median of the
   pairs' differences. The same for ``true`` execs in each.
   Then the apiserver's own work per create (its ``Server-Timing``: the handler's time without
   the wait for the node), over plain HTTP.
3. Throughput: C concurrent clients creating and killing sandboxes for T seconds through one
   apiserver, then split over two (same nodes): creates/s and the ratio.
4. Node loss: the daemon of the node holding a sandbox is killed (SIGKILL); the time until the
   apiserver answers that sandbox's exec with ``NodeLost`` (probe every 1 s, two missed).

    python bench/cluster.py [--quick]

--quick: fewer rounds and a shorter throughput window, under a minute once Ray is up. Every
process (Ray, daemons, apiservers) is stopped by pid and every home removed at the end. The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dsec
from dsec_core.api.messages import CreateRequest
from dsec_core.api.routes import ROUTES
from dsec_core.api.transport import HTTPTransport
from dsec_core.errors import DsecError, NodeLost
from dsec_core.iam import Iam
from dsec_core.testing.apiserver import ApiserverProcess, start_apiserver
from dsec_core.testing.ray import cluster_daemons, local_ray_cluster

TARGETS = {"apiserver_overhead_p50_ms": 5.0, "node_loss_detect_s": 5.0}
PROBE = ["--probe-interval", "1", "--probe-timeout", "1", "--probe-misses", "2"]


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def overhead(directs: dict[str, dsec.Client], api: dsec.Client, spec, rounds: int):
    """Pairs of creates: one through the apiserver, one directly on the node the apiserver
    chose for it (its order alternating), each followed by five ``true`` execs and a kill."""
    t_direct, t_api, e_direct, e_api = [], [], [], []

    def one(client: dsec.Client, times: list[float], execs: list[float], keep: bool) -> str:
        t0 = time.perf_counter()
        sb = client.create(spec)
        dt = time.perf_counter() - t0
        for _ in range(5):
            t1 = time.perf_counter()
            sb.exec("true")
            if keep:
                execs.append(time.perf_counter() - t1)
        sb.kill()
        if keep:
            times.append(dt)
        return sb.id.rsplit("-", 1)[1]

    node = "n1"
    for i in range(rounds + 2):
        keep = i >= 2  # the first rounds warm the connections and the layer mounts
        if i % 2:
            node = one(api, t_api, e_api, keep)
            one(directs[node], t_direct, e_direct, keep)
        else:
            one(directs[node], t_direct, e_direct, keep)
            node = one(api, t_api, e_api, keep)
    return t_direct, t_api, e_direct, e_api


def own_time(url: str, key: str, api: dsec.Client, spec: dsec.SandboxSpec, rounds: int):
    """Creates through the apiserver over plain HTTP, reading its ``Server-Timing``: the
    apiserver's own work per create (its handler, without the wait for the node)."""
    route = ROUTES["create"]
    body = route.encode_body(CreateRequest(spec))
    own = []
    t = HTTPTransport(url, token=key)
    try:
        for _ in range(rounds):
            r = t.request("POST", route.path, body=body, content_type="application/json")
            assert r.status_code == 201, r.text
            parts = dict(p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
            own.append(float(parts["apiserver"]))
            api.kill(r.json()["sandboxes"][0]["id"])
    finally:
        t.close()
    return own


async def _churn(urls: list[str], key: str, spec: dsec.SandboxSpec, clients: int, window: float):
    made = 0
    errors = 0
    stop = time.monotonic() + window

    async def worker(url: str) -> None:
        nonlocal made, errors
        async with dsec.AsyncClient(url, api_key=key) as c:
            while time.monotonic() < stop:
                try:
                    sb = await c.create(spec)
                except DsecError:
                    errors += 1
                    await asyncio.sleep(0.05)
                    continue
                made += 1
                await sb.kill()

    t0 = time.monotonic()
    await asyncio.gather(*(worker(urls[i % len(urls)]) for i in range(clients)))
    return made / (time.monotonic() - t0), errors


def detect_loss(api: dsec.Client, kit, spec: dsec.SandboxSpec) -> tuple[float, str]:
    sb = api.create(spec)
    node = sb.id.rsplit("-", 1)[1]
    pid = kit.daemon_pids[node]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while time.monotonic() - t0 < 30:
        try:
            sb.exec("true")
        except NodeLost:
            return time.monotonic() - t0, node
        except DsecError:
            pass
        time.sleep(0.05)
    return float("nan"), node


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (< 1 min once Ray is up)")
    args = ap.parse_args()
    rounds = 20 if args.quick else 100
    window = 5.0 if args.quick else 20.0
    clients = 6 if args.quick else 12
    t_start = time.monotonic()
    fig: dict[str, object] = {"quick": args.quick}
    apis: list[ApiserverProcess] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dsec-bench-iam-")))
        ray = stack.enter_context(local_ray_cluster(3, overflow=1))
        kit = stack.enter_context(cluster_daemons(ray))
        t_up = time.monotonic() - t_start
        iam_url = f"sqlite://{tmp / 'iam.db'}"
        with Iam.open(iam_url) as iam:
            iam.create_project("bench")
            _, key = iam.create_key("bench", "member")

        def stop_apis() -> None:
            for a in apis:
                a.stop()
                a.log.unlink(missing_ok=True)

        stack.callback(stop_apis)
        for _ in range(2):
            apis.append(start_apiserver([], iam_url, ray=ray.address, args=PROBE))
        spec = dsec.SandboxSpec(layers=(kit.layer.ref,), memory="64M", cpu=0.5)
        api = stack.enter_context(dsec.Client(apis[0].url, api_key=key))
        directs = {n: stack.enter_context(kit.client(n)) for n in ("n1", "n2", "n3")}
        deadline = time.monotonic() + 30
        while api.node_info()["home"] != "apiserver:3/3 nodes":
            if time.monotonic() > deadline:
                sys.exit(f"the apiserver did not find 3 nodes: {api.node_info()['home']}")
            time.sleep(0.2)

        t_direct, t_api, e_direct, e_api = overhead(directs, api, spec, rounds)
        d50, a50 = _p50(t_direct) * 1e3, _p50(t_api) * 1e3
        ed50, ea50 = _p50(e_direct) * 1e3, _p50(e_api) * 1e3
        # each pair ran back to back on one node: the median of their differences is what
        # the apiserver adds, with the drift of a shared machine taken out
        paired = _p50([a - d for a, d in zip(t_api, t_direct, strict=True)]) * 1e3
        fig.update(
            direct_create_p50_ms=round(d50, 2),
            apiserver_create_p50_ms=round(a50, 2),
            apiserver_overhead_p50_ms=round(paired, 2),
            create_p50_difference_ms=round(a50 - d50, 2),
            direct_exec_p50_ms=round(ed50, 3),
            apiserver_exec_p50_ms=round(ea50, 3),
            apiserver_exec_overhead_p50_ms=round(ea50 - ed50, 3),
            rounds=rounds,
        )
        own = own_time(apis[0].url, key, api, spec, rounds)
        fig.update(apiserver_own_p50_ms=round(_p50(own), 3))
        one, err1 = asyncio.run(_churn([apis[0].url], key, spec, clients, window))
        two, err2 = asyncio.run(_churn([a.url for a in apis], key, spec, clients, window))
        fig.update(
            cluster_creates_per_s=round(max(one, two), 1),
            creates_per_s_1_apiserver=round(one, 1),
            creates_per_s_2_apiservers=round(two, 1),
            two_vs_one_apiserver_ratio=round(two / one, 3) if one else None,
            churn_errors=err1 + err2,
            clients=clients,
            window_s=window,
        )
        detect, lost = detect_loss(api, kit, spec)
        fig.update(node_loss_detect_s=round(detect, 2), lost_node=lost, setup_s=round(t_up, 1))
        kit.up()  # the lost node's daemon back, so cluster down cleans up its sandbox
        api.close()

    rows = [
        ("create p50, direct on the node (baseline)", f"{fig['direct_create_p50_ms']} ms"),
        ("create p50, through the apiserver", f"{fig['apiserver_create_p50_ms']} ms"),
        (
            "apiserver overhead, p50 of pairs",
            f"{fig['apiserver_overhead_p50_ms']} ms (target <= 5)",
        ),
        ("difference of the p50s", f"{fig['create_p50_difference_ms']} ms"),
        ("the apiserver's own work per create, p50", f"{fig['apiserver_own_p50_ms']} ms"),
        (
            "exec p50, direct / apiserver",
            f"{fig['direct_exec_p50_ms']} / {fig['apiserver_exec_p50_ms']} ms",
        ),
        ("creates/s, 1 apiserver", fig["creates_per_s_1_apiserver"]),
        (
            "creates/s, 2 apiservers",
            f"{fig['creates_per_s_2_apiservers']} (x{fig['two_vs_one_apiserver_ratio']})",
        ),
        ("node loss detected after", f"{fig['node_loss_detect_s']} s (target <= 5)"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\ncontrol plane on a local 3-node Ray cluster ({'quick' if args.quick else 'full'})")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for name, limit in TARGETS.items():
        value = fig[name]
        ok = isinstance(value, float) and value <= limit
        print(f"  {'met' if ok else 'MISSED'}: {name} = {value} (<= {limit})")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
