#!/usr/bin/env python3
"""The control plane at DSec's scale: real ``dsec apiserver`` processes over 160 simulated
nodes (``dsec_core.testing.fleet``: one process serving 160 node identities over the real
node API, each on its own loopback port, holding no sandboxes).

Four apiservers are started at once over the same nodes, with the watcher's defaults (a
probe each second, 1 s to answer, two misses).

1. Probe cost: no traffic for a few seconds; one apiserver's CPU per probe, the fleet's per
   probe answered, and a probe answer's size.
2. Creates through 1, 2 and then 4 of the apiservers: 64 concurrent clients creating for a
   window (sandboxes are kept: each is a record on its node); creates/s, latency p50/p99,
   the apiservers' CPU seconds and their ``Server-Timing`` (own work per create), and the
   fleet's and the clients' CPU per create. ``creates_per_s_per_apiserver`` is one
   apiserver's creates per CPU-second of its own: what one process does on a core of its
   own, which the wall-clock rate on a shared 2-core machine is not. The 4-apiserver phase
   goes on until the nodes hold 20,000 sandboxes (or for a time bound): placement quality is
   then the max/mean of the nodes' sandbox counts, placed by the apiservers' own best-of-k
   (``dsec_core.placement``) over their probes and ledgers.
3. Node loss under load: while clients create through one apiserver, 10 nodes fail (5 crash:
   connections reset and refused, 5 go silent: connections accepted, nothing answered). The
   time until the apiserver has marked all 10 unhealthy, and what became of every create
   sent meanwhile: made, a typed error, or lost (no answer within 10 s).
4. Placement policies compared: random, least-loaded and best-of-k, each over probes up to
   one interval old, with and without the ledger of the apiserver's own placements, for 1
   and 4 apiservers; simulated in this process over the same load model (20,000 creates
   arriving at the measured rate onto 160 nodes probed every second), because the apiserver
   offers one policy.

    python bench/fleet.py [--quick]

--quick: shorter windows and a 15 s bound on the way to 20,000 creates; under a minute. Every
process is stopped by its pid at the end. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import os
import random
import resource
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dsec_core.api.messages import CreateRequest
from dsec_core.api.routes import JSON, ROUTES
from dsec_core.api.transport import AsyncHTTPTransport, HTTPTransport, TransportError
from dsec_core.iam import Iam
from dsec_core.placement import placement_k
from dsec_core.records import SandboxSpec
from dsec_core.testing.apiserver import ApiserverProcess, start_apiserver
from dsec_core.testing.fleet import Behaviour, FleetProcess, running_fleet

NODES = 160
CAPACITY = 256
PLACEMENT_CREATES = 20_000
LOST = 10
TARGETS = {
    "creates_per_s_per_apiserver": (">=", 1500.0),
    "lost_creates": ("<=", 0),
    "best_of_k_max_over_mean": ("<=", 1.1),
}
#: The watcher's defaults (``WatchSettings``): probe every second, 1 s to answer, 2 misses.
PROBE = ["--probe-interval", "1", "--probe-timeout", "1", "--probe-misses", "2"]


def pct(values: Sequence[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def own_cpu() -> float:
    """This process's CPU seconds so far (the clients')."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    """What the clients of one phase saw."""

    made: int = 0
    typed: dict[str, int] = field(default_factory=dict)  # error type -> count
    lost: int = 0
    lost_why: list[str] = field(default_factory=list)  # when and what, for each lost one
    latencies: list[float] = field(default_factory=list)
    own_ms: list[float] = field(default_factory=list)  # Server-Timing: the apiserver's work
    seconds: float = 0.0
    by_node: dict[str, int] = field(default_factory=dict)

    @property
    def per_s(self) -> float:
        return self.made / self.seconds if self.seconds else 0.0


async def churn(
    urls: Sequence[str],
    key: str,
    clients: int,
    window: float,
    limit: int | None = None,
    timeout: float = 30.0,
    during: asyncio.Event | None = None,
) -> Phase:
    """``clients`` coroutines creating through ``urls`` (round robin) for ``window`` seconds
    or until ``limit`` creates were made; every answer classified."""
    route = ROUTES["create"]
    body = route.encode_body(
        CreateRequest(SandboxSpec(layers=("busybox@1",), cpu=1, memory="512M"))
    )
    phase = Phase()
    t0 = time.monotonic()
    stop = t0 + window

    async def client(url: str) -> None:
        t = AsyncHTTPTransport(url, token=key)
        try:
            while time.monotonic() < stop and (limit is None or phase.made < limit):
                if during is not None and during.is_set():
                    return
                t1 = time.perf_counter()
                try:
                    r = await t.request(
                        "POST", route.path, body=body, content_type=JSON, timeout=timeout
                    )
                except TransportError as e:
                    phase.lost += 1
                    phase.lost_why.append(f"{time.monotonic() - t0:.2f}s: {e}")
                    await t.aclose()
                    continue
                if r.status_code == 201:
                    phase.made += 1
                    phase.latencies.append(time.perf_counter() - t1)
                    timing = r.headers.get("server-timing", "")
                    for part in timing.split(","):
                        name, _, dur = part.strip().partition(";dur=")
                        if name == "apiserver":
                            phase.own_ms.append(float(dur))
                    node = r.content.split(b'"id":"', 1)[1].split(b'"', 1)[0].rsplit(b"-", 1)[1]
                    phase.by_node[node.decode()] = phase.by_node.get(node.decode(), 0) + 1
                    continue
                try:
                    kind = r.json()["error"]["type"]
                except (ValueError, KeyError, TypeError):
                    kind = f"untyped {r.status_code}"
                phase.typed[kind] = phase.typed.get(kind, 0) + 1
                if kind == "AdmissionRejected":
                    await asyncio.sleep(0.01)
        finally:
            await t.aclose()

    await asyncio.gather(*(client(urls[i % len(urls)]) for i in range(clients)))
    phase.seconds = time.monotonic() - t0
    return phase


def measured(
    apis: Sequence[ApiserverProcess], key: str, clients: int, window: float, **kw: object
) -> tuple[Phase, list[float]]:
    """A churn phase, with each apiserver's CPU seconds over it."""
    before = [cpu_seconds(a.proc.pid) for a in apis]
    phase = asyncio.run(churn([a.url for a in apis], key, clients, window, **kw))  # type: ignore[arg-type]
    return phase, [cpu_seconds(a.proc.pid) - b for a, b in zip(apis, before, strict=True)]


def healthy_count(api: ApiserverProcess, key: str) -> tuple[int, int]:
    """(healthy, registered) nodes, as the apiserver's node_info says."""
    t = HTTPTransport(api.url, token=key)
    try:
        home = t.request("GET", "/v1/node", timeout=5).json()["home"]
    finally:
        t.close()
    healthy, _, total = home.removeprefix("apiserver:").removesuffix(" nodes").partition("/")
    return int(healthy), int(total)


def wait_healthy(api: ApiserverProcess, key: str, want: int, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while healthy_count(api, key)[0] != want:
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"the apiserver did not see {want} healthy nodes in {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def sfx(n: int) -> str:
    """The figures' suffix for a phase through ``n`` apiservers."""
    return "_1_apiserver" if n == 1 else f"_{n}_apiservers"


def max_over_mean(counts: Sequence[int]) -> float:
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean else float("nan")


# --- placement policies, simulated over the same model ------------------------------------------


def simulate(
    policy: str,
    ledger: bool,
    apiservers: int,
    rate: float,
    creates: int = PLACEMENT_CREATES,
    nodes: int = NODES,
    interval: float = 1.0,
    seed: int = 1,
) -> float:
    """max/mean node load after ``creates`` creates arriving at ``rate``/s, split over
    ``apiservers``, each placing by ``policy`` over its own probes of every node (one per
    ``interval``, at a phase of its own) and, with ``ledger``, its own placements since.

    Nodes are alike and only their sandbox count moves, so a node's load is its count over
    its capacity and best-of-k's rule (``dsec_core.placement.best_of_k``: the least loaded
    of k sampled, the fewest sandboxes among loads within ``LOAD_GRAIN``) is the fewest of
    k; least-loaded takes the first of the fewest, as a scan does."""
    rng = random.Random(seed)
    k = placement_k()
    true = [0] * nodes
    # what each apiserver sees of each node: its last probe, plus (ledger) what it placed since
    view = [[0] * nodes for _ in range(apiservers)]
    probes = [(rng.uniform(0, interval), a, j) for a in range(apiservers) for j in range(nodes)]
    heapq.heapify(probes)
    for i in range(creates):
        now = i / rate
        while probes[0][0] <= now:
            at, a, j = heapq.heappop(probes)
            view[a][j] = true[j]
            heapq.heappush(probes, (at + interval, a, j))
        a = i % apiservers
        seen = view[a]
        if policy == "random":
            j = rng.randrange(nodes)
        elif policy == "least-loaded":
            j = seen.index(min(seen))
        else:
            j = min(rng.sample(range(nodes), k), key=seen.__getitem__)
        true[j] += 1
        if ledger:
            seen[j] += 1
    return max_over_mean(true)


# --- the run -----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter windows (< 1 min)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent creating clients")
    ap.add_argument("--latency", type=float, default=0.002, help="a simulated create's latency (s)")
    args = ap.parse_args()
    window = 2.5 if args.quick else 10.0
    bound = 15.0 if args.quick else 300.0
    idle = 3.0 if args.quick else 5.0
    loss_window = 5.0 if args.quick else 10.0
    fig: dict[str, object] = {
        "quick": args.quick,
        "nodes": NODES,
        "clients": args.clients,
        "create_latency_ms": args.latency * 1e3,
        "cores": os.cpu_count(),
        "loadavg_at_start": round(os.getloadavg()[0], 2),
    }
    t_start = time.monotonic()
    apis: list[ApiserverProcess] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dsec-bench-fleet-")))
        iam_url = f"sqlite://{tmp / 'iam.db'}"
        with Iam.open(iam_url) as iam:
            iam.create_project("bench")
            _, key = iam.create_key("bench", "member")
        behaviour = Behaviour(capacity=CAPACITY, create_latency=args.latency)
        fleet: FleetProcess = stack.enter_context(running_fleet(NODES, behaviour=behaviour))

        def stop_apis() -> None:
            for a in apis:
                a.stop()
                a.log.unlink(missing_ok=True)

        stack.callback(stop_apis)

        # four apiservers at once (each start is seconds of imports); the idle ones only
        # probe, which step 1 measures
        with ThreadPoolExecutor(4) as pool:
            apis += pool.map(lambda _: start_apiserver(fleet.nodes, iam_url, args=PROBE), range(4))
        for a in apis:
            wait_healthy(a, key, NODES)
        t_up = time.monotonic() - t_start

        # 1. probe cost: one apiserver's CPU, no traffic
        f0, a0 = fleet.stats(), cpu_seconds(apis[0].proc.pid)
        time.sleep(idle)
        f1, a1 = fleet.stats(), cpu_seconds(apis[0].proc.pid)
        probes = f1["served"].get("probe", 0) - f0["served"].get("probe", 0)
        mine = probes / len(apis)  # each apiserver probes every node
        probe_bytes = len(fleet_probe(fleet))
        fig.update(
            probes_per_s=round(mine / idle, 1),
            apiserver_cpu_per_probe_us=round((a1 - a0) / max(mine, 1) * 1e6, 1),
            fleet_cpu_per_probe_us=round((f1["cpu_s"] - f0["cpu_s"]) / max(probes, 1) * 1e6, 1),
            apiserver_idle_cpu_percent=round((a1 - a0) / idle * 100, 2),
            probe_bytes=probe_bytes,
        )

        # 2. creates through 1, 2 and 4 apiservers; they are kept, and the last phase goes
        # on until the nodes hold 20,000 of them (or for ``bound`` seconds): placement
        # quality is their spread then
        for n in (1, 2, 4):
            held = sum(fleet.counts().values())
            last = n == 4 and held < PLACEMENT_CREATES - 2 * window * 100
            f0, me0 = fleet.stats()["cpu_s"], own_cpu()
            ph, cpu = measured(
                apis[:n],
                key,
                args.clients,
                bound if last else window,
                limit=PLACEMENT_CREATES - held if last else None,
            )
            f1, me1 = fleet.stats()["cpu_s"], own_cpu()
            s = sfx(n)
            fig[f"creates_per_s{s}"] = round(ph.per_s, 1)
            fig[f"create_p50_ms{s}"] = round(pct(ph.latencies, 50) * 1e3, 2)
            fig[f"create_p99_ms{s}"] = round(pct(ph.latencies, 99) * 1e3, 2)
            fig[f"apiserver_own_p50_ms{s}"] = round(pct(ph.own_ms, 50), 3)
            fig[f"creates_per_apiserver_cpu_s{s}"] = round(ph.made / max(sum(cpu), 1e-9), 1)
            fig[f"apiserver_cores_used{s}"] = round(sum(cpu) / ph.seconds, 2)
            fig[f"fleet_cpu_per_create_us{s}"] = round((f1 - f0) / max(ph.made, 1) * 1e6, 1)
            fig[f"clients_cpu_per_create_us{s}"] = round((me1 - me0) / max(ph.made, 1) * 1e6, 1)
            fig[f"errors{s}"] = sum(ph.typed.values()) + ph.lost
        # what one apiserver process does with a core: its creates per CPU-second
        fig["creates_per_s_per_apiserver"] = fig["creates_per_apiserver_cpu_s_1_apiserver"]
        fig["create_p50_ms"] = fig["create_p50_ms_1_apiserver"]
        fig["create_p99_ms"] = fig["create_p99_ms_1_apiserver"]
        counts = list(fleet.counts().values())
        fig.update(
            placement_creates=sum(counts),
            best_of_k_max_over_mean=round(max_over_mean(counts), 3),
            best_of_k_max=max(counts),
        )
        fleet.clear()
        one_rate = float(fig["creates_per_s_1_apiserver"])  # type: ignore[arg-type]
        for n in (2, 4):
            ratio = float(fig[f"creates_per_s_{n}_apiservers"]) / one_rate  # type: ignore[arg-type]
            fig[f"scaling_{n}_vs_1"] = round(ratio, 3)

        # 3. node loss under load, through one apiserver
        time.sleep(1.0)
        lost_names = [n.name for n in fleet.nodes[:: NODES // LOST]][:LOST]
        loss = asyncio.run(
            lose_under_load(fleet, apis[0], key, lost_names, args.clients, loss_window)
        )
        fig.update(loss)
    fig["setup_s"] = round(t_up, 1)
    fig["setup_and_run_s"] = round(time.monotonic() - t_start, 1)

    # 4. policies, simulated at the measured rate
    rate = max(one_rate, 1.0)
    sims: dict[str, float] = {}
    for policy in ("random", "least-loaded", "best-of-k"):
        for ledger in (False, True):
            for n in (1, 4):
                if policy == "random" and ledger:
                    continue
                name = f"{policy}{' +ledger' if ledger else ''} x{n}"
                sims[name] = round(simulate(policy, ledger, n, rate), 3)
    fig["simulated_max_over_mean"] = sims
    fig["simulated_best_of_k_ledger"] = sims["best-of-k +ledger x1"]
    fig["simulated_random"] = sims["random x1"]
    fig["simulated_least_loaded_stale"] = sims["least-loaded x1"]
    report(fig, args.quick)


def fleet_probe(fleet: FleetProcess) -> bytes:
    """One node's probe answer, as the apiserver gets it."""
    node = fleet.nodes[0]
    t = HTTPTransport(node.url, token=node.token)
    try:
        return t.request("GET", ROUTES["probe"].path, timeout=5).content
    finally:
        t.close()


async def lose_under_load(
    fleet: FleetProcess,
    api: ApiserverProcess,
    key: str,
    names: Sequence[str],
    clients: int,
    window: float,
) -> dict[str, object]:
    """Clients create through ``api`` while ``names`` fail (half crash, half go silent); how
    long until the apiserver marks them all unhealthy, and what every create got."""
    half = len(names) // 2
    # every create gets its answer within the detection time (about 3 s): 10 s is lost
    load = asyncio.create_task(churn([api.url], key, clients, window, timeout=10.0))
    await asyncio.sleep(1.5)
    t0 = time.monotonic()
    await asyncio.to_thread(fleet.fail, names[:half], "crash")
    await asyncio.to_thread(fleet.fail, names[half:], "silent")
    first = None
    while True:
        healthy, total = await asyncio.to_thread(healthy_count, api, key)
        if healthy < total and first is None:
            first = time.monotonic() - t0
        if healthy <= total - len(names) or time.monotonic() - t0 > 30:
            break
        await asyncio.sleep(0.05)
    detect = time.monotonic() - t0
    phase = await load
    await asyncio.to_thread(fleet.fail, names, "up")
    return {
        "lost_nodes": len(names),
        "loss_detect_all_s": round(detect, 2),
        "loss_detect_first_s": round(first or float("nan"), 2),
        "loss_creates_made": phase.made,
        "loss_creates_typed_errors": phase.typed,
        "lost_creates": phase.lost,
        "lost_creates_why": phase.lost_why[:5],
        "loss_creates_per_s": round(phase.per_s, 1),
    }


def report(fig: dict[str, object], quick: bool) -> None:
    sims = fig["simulated_max_over_mean"]
    assert isinstance(sims, dict)
    rows = [
        ("probes/s of 160 nodes (1 apiserver, every 1 s)", fig["probes_per_s"]),
        (
            "CPU per probe: apiserver / fleet",
            f"{fig['apiserver_cpu_per_probe_us']} / {fig['fleet_cpu_per_probe_us']} us "
            f"({fig['probe_bytes']} B answers; idle apiserver "
            f"{fig['apiserver_idle_cpu_percent']}% CPU)",
        ),
        (
            "creates per apiserver CPU-second (1 apiserver)",
            f"{fig['creates_per_s_per_apiserver']} (what one process does on a core of its own)",
        ),
    ]
    for n in (1, 2, 4):
        s = sfx(n)
        rows += [
            (
                f"creates/s through {n} apiserver{'s' if n > 1 else ''} on this machine",
                f"{fig[f'creates_per_s{s}']}"
                + (f" (x{fig[f'scaling_{n}_vs_1']})" if n > 1 else "")
                + f"; p50 / p99 {fig[f'create_p50_ms{s}']} / {fig[f'create_p99_ms{s}']} ms",
            ),
            (
                "  apiservers' cores, creates per their CPU-second",
                f"{fig[f'apiserver_cores_used{s}']}, {fig[f'creates_per_apiserver_cpu_s{s}']} "
                f"(own work p50 {fig[f'apiserver_own_p50_ms{s}']} ms)",
            ),
            (
                "  CPU per create: fleet, clients",
                f"{fig[f'fleet_cpu_per_create_us{s}']} us, {fig[f'clients_cpu_per_create_us{s}']}"
                " us",
            ),
        ]
    rows += [
        (
            f"max/mean load after {fig['placement_creates']} creates (apiserver's best-of-k)",
            f"{fig['best_of_k_max_over_mean']} (max {fig['best_of_k_max']})",
        ),
        (
            f"{fig['lost_nodes']} nodes lost under load: all marked after",
            f"{fig['loss_detect_all_s']} s (first {fig['loss_detect_first_s']} s)",
        ),
        (
            "creates meanwhile: made / typed errors / lost",
            f"{fig['loss_creates_made']} / {fig['loss_creates_typed_errors']} / "
            f"{fig['lost_creates']}",
        ),
    ]
    width = max(len(str(r[0])) for r in rows)
    print(
        f"\napiservers over {NODES} simulated nodes ({'quick' if quick else 'full'}; "
        f"{fig['cores']} cores, load average {fig['loadavg_at_start']} at the start)"
    )
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(
        f"\n  placement simulated ({PLACEMENT_CREATES} creates at the measured rate, over "
        "probes up to 1 s old):"
    )
    for name, value in sims.items():
        print(f"    {name:<24} max/mean {value}")
    for name, (op, limit) in TARGETS.items():
        value = fig[name]
        ok = isinstance(value, (int, float)) and (value >= limit if op == ">=" else value <= limit)
        print(f"  {'met' if ok else 'MISSED'}: {name} = {value} ({op} {limit})")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
