#!/usr/bin/env python3
"""The control plane on a local 3-node Ray cluster, in one run: what the apiserver adds to a
create, creates per second through one apiserver against two, and how long a lost node takes
to be noticed.

1. A Ray cluster of three nodes on 127.0.0.2-4 (the third in the overflow pool), ``dsec
   cluster up`` on it (a node daemon per Ray node), an IAM store (SQLite) with one project
   and key, and ``dsec apiserver --ray`` processes finding the nodes through Ray.
2. Overhead, over plain HTTP: create of the kit's busybox sandbox through the apiserver, and
   directly on the node the apiserver chose (its TCP listener and token: the baseline), in
   pairs whose order alternates so drift hits both, each followed by five ``true`` execs.
   What the apiserver adds is read from each answer's ``Server-Timing``: the p50 of the
   client's time less the node's own (``upstream`` through the apiserver, ``total``
   directly), through the apiserver less directly; and, as before, the median of the pairs'
   differences (``*_paired_*``: end to end, but with the spread of the node's create times
   in it). Then the p50 of each stage of the apiserver's answers (auth, admit, place, node =
   upstream + hop, relay; its own work; docs/operators/observability.md), and the client's hop
   (its time less the apiserver's ``total``).
3. Throughput: C concurrent clients creating and killing sandboxes for T seconds through one
   apiserver, then split over two (same nodes): creates/s and the ratio. The load generator
   is lean (raw HTTP, bodies encoded once); the CPU each party used in the window is
   measured (the generator, the apiservers, the node daemons, the whole machine), so a
   ratio that the machine rather than the apiserver bounds says so: the apiserver's CPU per
   create gives the creates/s one apiserver process would serve on a core of its own.
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
from typing import Any

import dsec
from dsec_core.api.messages import CreateRequest, ExecRequest
from dsec_core.api.routes import ROUTES
from dsec_core.api.transport import AsyncHTTPTransport, HTTPTransport
from dsec_core.errors import DsecError, NodeLost
from dsec_core.iam import Iam
from dsec_core.testing.apiserver import ApiserverProcess, start_apiserver
from dsec_core.testing.ray import cluster_daemons, local_ray_cluster

TARGETS = {
    "apiserver_overhead_p50_ms": 3.0,
    "apiserver_exec_overhead_p50_ms": 3.0,
    "node_loss_detect_s": 5.0,
}
#: The Server-Timing stages read per request (``dsec_core.apiserver.timing``).
STAGES = ("auth", "admit", "place", "node", "upstream", "hop", "relay", "apiserver", "total")
PROBE = ["--probe-interval", "1", "--probe-timeout", "1", "--probe-misses", "2"]


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


Timed = tuple[float, dict[str, float]]  # a request's time at the client (ms), its stages


def _stages(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


def overhead(
    directs: dict[str, HTTPTransport], api: HTTPTransport, spec: dsec.SandboxSpec, rounds: int
) -> dict[str, list[Timed]]:
    """Pairs of creates over plain HTTP: one through the apiserver, one directly on the node
    the apiserver chose for it (its order alternating), each followed by five ``true`` execs
    and a kill. Each create's and exec's time at the client and its answer's
    ``Server-Timing``; ``exec_*_median`` has each sandbox's median exec (for pairing)."""
    create, exec_, kill = ROUTES["create"], ROUTES["exec"], ROUTES["kill"]
    body = create.encode_body(CreateRequest(spec))
    run = exec_.encode_body(ExecRequest(cmd=("true",)))
    out: dict[str, list[Timed]] = {}

    def timed(t: HTTPTransport, method: str, target: str, content: bytes | None) -> Any:
        t0 = time.perf_counter()
        r = t.request(method, target, body=content, content_type="application/json")
        ms = (time.perf_counter() - t0) * 1e3
        assert r.status_code < 300, r.text
        return r, (ms, _stages(r.headers.get("server-timing", "")))

    def one(t: HTTPTransport, via: str, keep: bool) -> str:
        r, made = timed(t, "POST", create.path, body)
        sid = r.json()["sandboxes"][0]["id"]
        execs = [timed(t, "POST", exec_.target({"sid": sid}), run)[1] for _ in range(5)]
        t.request("DELETE", kill.target({"sid": sid}))
        if keep:
            out.setdefault(f"create_{via}", []).append(made)
            out.setdefault(f"exec_{via}", []).extend(execs)
            mid = statistics.median(ms for ms, _ in execs)
            out.setdefault(f"exec_{via}_median", []).append((mid, {}))
        return sid.rsplit("-", 1)[1]

    node = "n1"
    for i in range(rounds + 2):
        keep = i >= 2  # the first rounds warm the connections and the layer mounts
        if i % 2:
            node = one(api, "api", keep)
            one(directs[node], "direct", keep)
        else:
            one(directs[node], "direct", keep)
            node = one(api, "api", keep)
    return out


def overhead_figures(runs: dict[str, list[Timed]]) -> dict[str, float]:
    """What the apiserver adds to a create and to an exec, two ways. From ``Server-Timing``
    (``apiserver_overhead_p50_ms``, ``apiserver_exec_overhead_p50_ms``): the p50 of each
    request's time at the client less the node's own time (``upstream`` through the
    apiserver, ``total`` directly), through the apiserver less directly: all but the node's
    own work, so the spread of the node's create times (tens of ms on a shared machine) does
    not drown a few ms. Paired (``*_paired_p50_ms``): the median difference of back-to-back
    pairs' times at the client, which also shows any slowing of the node itself, with that
    spread. Then the p50 of each stage of the apiserver's answers, and the client's hop to
    the apiserver (its time less the apiserver's ``total``)."""
    fig: dict[str, float] = {}
    for what in ("create", "exec"):
        api, direct = runs[f"{what}_api"], runs[f"{what}_direct"]
        beyond_node = _p50([ms - st["upstream"] for ms, st in api if "upstream" in st])
        direct_beyond = _p50([ms - st["total"] for ms, st in direct if "total" in st])
        pa = runs[f"{what}_api_median"] if what == "exec" else api
        pd = runs[f"{what}_direct_median"] if what == "exec" else direct
        paired = _p50([a[0] - d[0] for a, d in zip(pa, pd, strict=True)])
        name = "apiserver_overhead" if what == "create" else "apiserver_exec_overhead"
        fig.update(
            {
                f"direct_{what}_p50_ms": round(_p50([ms for ms, _ in direct]), 3),
                f"apiserver_{what}_p50_ms": round(_p50([ms for ms, _ in api]), 3),
                f"{name}_p50_ms": round(beyond_node - direct_beyond, 3),
                f"{name}_paired_p50_ms": round(paired, 3),
                f"{what}_client_hop_ms": round(
                    _p50([ms - st["total"] for ms, st in api if "total" in st]), 3
                ),
            }
        )
        for stage in STAGES:
            values = [st[stage] for _, st in api if stage in st]
            if values:
                fig[f"{what}_{stage}_ms"] = round(_p50(values), 3)
    return fig


def _cpu_s(pid: int) -> float:
    """Process ``pid``'s CPU time so far (user + system), in seconds; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (every core; /proc/stat)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


async def _churn(urls: list[str], key: str, spec: dsec.SandboxSpec, clients: int, window: float):
    """C workers creating and killing over raw HTTP (the create's body encoded once): a load
    generator that spends little of the machine the apiservers and nodes share."""
    route, kill = ROUTES["create"], ROUTES["kill"]
    body = route.encode_body(CreateRequest(spec))
    made = 0
    errors = 0
    stop = time.monotonic() + window

    async def worker(url: str) -> None:
        nonlocal made, errors
        t = AsyncHTTPTransport(url, token=key)
        try:
            while time.monotonic() < stop:
                r = await t.request(
                    "POST", route.path, body=body, content_type="application/json", timeout=300
                )
                if r.status_code != 201:
                    errors += 1
                    await asyncio.sleep(0.05)
                    continue
                made += 1
                sid = json.loads(r.content)["sandboxes"][0]["id"]
                await t.request("DELETE", kill.target({"sid": sid}), timeout=300)
        finally:
            await t.aclose()

    t0 = time.monotonic()
    await asyncio.gather(*(worker(urls[i % len(urls)]) for i in range(clients)))
    return made / (time.monotonic() - t0), errors, made


def churn(
    apis: list[ApiserverProcess],
    daemons: list[int],
    key: str,
    spec: dsec.SandboxSpec,
    clients: int,
    window: float,
) -> dict[str, float]:
    """``_churn`` through ``apis``, with the CPU each party used in the window: the load
    generator's (this process), the apiservers' and the node daemons' shares of the window
    (1.0: one core), the whole machine's busy share (of all its cores), and the apiservers'
    CPU per create and kill (less what they spend idle: their probes)."""
    pids = [a.proc.pid for a in apis]
    # what the apiservers spend idle (their probes), so the CPU per create is the creates'
    idle0, t_idle = sum(_cpu_s(p) for p in pids), time.monotonic()
    time.sleep(2.0)
    idle_rate = (sum(_cpu_s(p) for p in pids) - idle0) / (time.monotonic() - t_idle)
    gen0, api0 = time.process_time(), sum(_cpu_s(p) for p in pids)
    node0, busy0, t0 = sum(_cpu_s(p) for p in daemons), _machine_busy_s(), time.monotonic()
    per_s, errors, made = asyncio.run(_churn([a.url for a in apis], key, spec, clients, window))
    wall = time.monotonic() - t0
    api_s = sum(_cpu_s(p) for p in pids) - api0
    return {
        "per_s": per_s,
        "errors": errors,
        "generator_cpu": (time.process_time() - gen0) / wall,
        "apiserver_cpu": api_s / wall,
        "node_daemon_cpu": (sum(_cpu_s(p) for p in daemons) - node0) / wall,
        "machine_busy": (_machine_busy_s() - busy0) / wall / (os.cpu_count() or 1),
        "apiserver_cpu_ms_per_create": max(0.0, api_s - idle_rate * wall) / made * 1e3
        if made
        else float("nan"),
    }


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
        directs = {}
        for n in ("n1", "n2", "n3"):
            e = kit.endpoint(n)
            directs[n] = HTTPTransport(e.url, token=e.token)
            stack.callback(directs[n].close)
        api_http = HTTPTransport(apis[0].url, token=key)
        stack.callback(api_http.close)
        deadline = time.monotonic() + 30
        while api.node_info()["home"] != "apiserver:3/3 nodes":
            if time.monotonic() > deadline:
                sys.exit(f"the apiserver did not find 3 nodes: {api.node_info()['home']}")
            time.sleep(0.2)

        over = overhead_figures(overhead(directs, api_http, spec, rounds))
        fig.update(over, rounds=rounds)
        fig.update(
            create_p50_difference_ms=round(
                over["apiserver_create_p50_ms"] - over["direct_create_p50_ms"], 2
            ),
            apiserver_own_p50_ms=over.get("create_apiserver_ms"),
        )
        daemons = list(kit.daemon_pids.values())
        one = churn(apis[:1], daemons, key, spec, clients, window)
        two = churn(apis, daemons, key, spec, clients, window)
        fig.update(
            cluster_creates_per_s=round(max(one["per_s"], two["per_s"]), 1),
            creates_per_s_1_apiserver=round(one["per_s"], 1),
            creates_per_s_2_apiservers=round(two["per_s"], 1),
            two_vs_one_apiserver_ratio=round(two["per_s"] / one["per_s"], 3)
            if one["per_s"]
            else None,
            churn_errors=one["errors"] + two["errors"],
            clients=clients,
            window_s=window,
        )
        for tag, run in (("1", one), ("2", two)):
            fig.update(
                {
                    f"generator_cpu_{tag}": round(run["generator_cpu"], 3),
                    f"apiserver_cpu_{tag}": round(run["apiserver_cpu"], 3),
                    f"node_daemon_cpu_{tag}": round(run["node_daemon_cpu"], 3),
                    f"machine_busy_{tag}": round(run["machine_busy"], 3),
                }
            )
        per_create = one["apiserver_cpu_ms_per_create"]
        fig.update(
            apiserver_cpu_ms_per_create=round(per_create, 3),
            # what one apiserver process would serve with a core of its own, the nodes and
            # the clients never the limit
            apiserver_bound_creates_per_s=round(1e3 / per_create, 1) if per_create else None,
        )
        detect, lost = detect_loss(api, kit, spec)
        fig.update(node_loss_detect_s=round(detect, 2), lost_node=lost, setup_s=round(t_up, 1))
        kit.up()  # the lost node's daemon back, so cluster down cleans up its sandbox
        api.close()

    rows = [
        ("create p50, direct on the node (baseline)", f"{fig['direct_create_p50_ms']} ms"),
        ("create p50, through the apiserver", f"{fig['apiserver_create_p50_ms']} ms"),
        (
            "apiserver overhead on a create, p50 (beyond the node's own time)",
            f"{fig['apiserver_overhead_p50_ms']} ms (target <= 3)",
        ),
        ("  the same, p50 of back-to-back pairs", f"{fig['apiserver_overhead_paired_p50_ms']} ms"),
        (
            "apiserver overhead on an exec, p50 / of pairs",
            f"{fig['apiserver_exec_overhead_p50_ms']} / "
            f"{fig['apiserver_exec_overhead_paired_p50_ms']} ms (target <= 3)",
        ),
        ("difference of the p50s", f"{fig['create_p50_difference_ms']} ms"),
        ("the apiserver's own work per create, p50", f"{fig['apiserver_own_p50_ms']} ms"),
        (
            "create: auth / admit / place / relay",
            " / ".join(str(fig.get(f"create_{s}_ms")) for s in ("auth", "admit", "place", "relay"))
            + " ms",
        ),
        (
            "create: node = upstream + hop; client hop",
            f"{fig.get('create_node_ms')} = {fig.get('create_upstream_ms')} + "
            f"{fig.get('create_hop_ms')} ms; {fig.get('create_client_hop_ms')} ms",
        ),
        (
            "exec: apiserver / hop / client hop",
            f"{fig.get('exec_apiserver_ms')} / {fig.get('exec_hop_ms')} / "
            f"{fig.get('exec_client_hop_ms')} ms",
        ),
        (
            "exec p50, direct / apiserver",
            f"{fig['direct_exec_p50_ms']} / {fig['apiserver_exec_p50_ms']} ms",
        ),
        ("creates/s, 1 apiserver", fig["creates_per_s_1_apiserver"]),
        (
            "creates/s, 2 apiservers",
            f"{fig['creates_per_s_2_apiservers']} (x{fig['two_vs_one_apiserver_ratio']})",
        ),
        (
            "CPU in the window, 1 / 2 apiservers",
            f"generator {fig['generator_cpu_1']} / {fig['generator_cpu_2']}, apiservers "
            f"{fig['apiserver_cpu_1']} / {fig['apiserver_cpu_2']}, node daemons "
            f"{fig['node_daemon_cpu_1']} / {fig['node_daemon_cpu_2']} (cores); machine busy "
            f"{fig['machine_busy_1']} / {fig['machine_busy_2']}",
        ),
        (
            "apiserver CPU per create",
            f"{fig['apiserver_cpu_ms_per_create']} ms: "
            f"{fig['apiserver_bound_creates_per_s']} creates/s on a core of its own",
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
