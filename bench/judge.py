#!/usr/bin/env python3
"""Judge mode against what a trainer would do without it, in one run, on the same busybox image
and the same submissions: an awk FizzBuzz judged on 10 cases (1..N for ten N), with a syntax
check as its compile step.

- ``judge``: ``client.judge``: a warm FnCall member compiles once and runs each case under its
  own CPU-time and memory limit (a memory window per case), verdicts computed on the node;
- ``fncall per case``: one ``client.fncall`` per case, each compiling again (nothing survives
  between calls), the output compared by the client;
- ``fresh sandbox``: a sandbox per submission: create, write, compile, one exec per case,
  compare, kill.

Each at concurrency 1 and 8: per-submission p50/p99 and submissions per second.

    python bench/judge.py [--quick]

--quick takes under a minute. The last line printed is one JSON object with
``judge_p50_ms`` (concurrency 1), ``judge_per_s_c8``, ``fresh_per_s_c8``,
``fncall_per_case_per_s_c8``, ``ratio_vs_fresh_c8`` and ``ratio_vs_fncall_per_case_c8``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import dsec
from dsec_core.catalog.model import Catalog, Environment
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.layers.store import LayerStore
from dsec_core.localnode import ensure_daemon, stop_daemon
from dsec_core.node.judge import outputs_match
from dsec_core.testing import build_busybox_layer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from create import pct
from figures import COLOURS, add_plot_flag, bars, figure
from fncall import FIZZBUZZ, fizzbuzz, rounds

ENV = "bench-judge"
MEMORY = "96M"  # a member's (and a fresh sandbox's) limit
CASE_MEMORY = "32M"
SOLUTION = FIZZBUZZ + "\n"
COMPILE = "cp solution.awk prog.awk && awk -f prog.awk < /dev/null"
RUN = "awk -f prog.awk"


CASES = [
    dsec.JudgeCase("".join(f"{i}\n" for i in range(1, n + 1)), fizzbuzz(n), str(n))
    for n in (1, 3, 5, 15, 30, 60, 100, 150, 200, 300)
]


async def measure(address: str, layer: str, n: int, n_fresh: int) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    files = {"solution.awk": SOLUTION}
    async with dsec.AsyncClient(address) as client:

        async def judged() -> None:
            r = await client.judge(
                ENV,
                RUN,
                compile=COMPILE,
                files=files,
                cases=CASES,
                time_limit=2.0,
                memory_limit=CASE_MEMORY,
                memory=MEMORY,
            )
            if r.verdict != "AC":
                raise SystemExit(f"bench: judge says {r.verdict}: {r.cases}")

        async def per_case() -> None:
            for case in CASES:
                r = await client.fncall(
                    ENV,
                    f"{COMPILE} && {RUN}",
                    files=files,
                    stdin=case.input,
                    memory=MEMORY,
                    timeout=4.0,
                )
                if not (r.ok and outputs_match(r.stdout, case.output)):
                    raise SystemExit(f"bench: fncall case {case.name} failed: {r}")

        async def fresh() -> None:
            sb = await client.create(layers=(layer,), memory=MEMORY, ttl=300, workdir="/tmp")
            try:
                await sb.write_file("/tmp/solution.awk", SOLUTION.encode())
                (await sb.exec(COMPILE, timeout=10)).check()
                for case in CASES:
                    r = await sb.exec(RUN, stdin=case.input, timeout=4.0, exclusive=True)
                    if not (r.ok and outputs_match(r.stdout, case.output)):
                        raise SystemExit(f"bench: fresh case {case.name} failed: {r}")
            finally:
                await sb.kill()

        for name, one, count in (
            ("judge", judged, n),
            ("fncall per case", per_case, max(4, n // 4)),
            ("fresh sandbox", fresh, n_fresh),
        ):
            await rounds(one, 16 if name != "fresh sandbox" else 2, 8)  # warm the pools
            for conc in (1, 8):
                out[f"{name} c{conc}"] = await rounds(one, count, conc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer submissions (under a minute)")
    add_plot_flag(ap)
    args = ap.parse_args()
    n, n_fresh = (48, 16) if args.quick else (400, 80)

    home = Path(tempfile.mkdtemp(prefix="dsec-bench-judge-", dir="/var/tmp"))
    config = NodeConfig(home=home)
    config.ensure_dirs()
    info = build_busybox_layer(LayerStore(config.layer_dir), name="bench-busybox")
    CatalogStore(config.catalog_dir).save(
        Catalog(name=ENV, environments=(Environment(name=ENV, base=info.ref),))
    )
    os.environ["DSEC_HOME"] = os.fspath(home)
    os.environ.setdefault("DSEC_FNCALL_POOL_MAX", "8")
    ensure_daemon(config)
    try:
        res = asyncio.run(measure(os.fspath(config.socket_path), info.ref, n, n_fresh))
    finally:
        stop_daemon(config)
        shutil.rmtree(home, ignore_errors=True)

    def ms(v: float) -> float:
        return round(1e3 * v, 2)

    print(f"{len(CASES)} cases per submission")
    print(f"{'':<22}{'p50 ms':>10}{'p99 ms':>10}{'subm/s':>10}")
    for conc in (1, 8):
        for way in ("judge", "fncall per case", "fresh sandbox"):
            lat, rate = res[f"{way} c{conc}"]
            name = f"{way} c{conc}"
            print(f"{name:<22}{ms(statistics.median(lat)):>10}{ms(pct(lat, 99)):>10}{rate:>10.1f}")
    j1, _ = res["judge c1"]
    _, j8 = res["judge c8"]
    _, f8 = res["fresh sandbox c8"]
    _, p8 = res["fncall per case c8"]
    fig = {
        "quick": args.quick,
        "cases": len(CASES),
        "judge_p50_ms": ms(statistics.median(j1)),
        "judge_p99_ms": ms(pct(j1, 99)),
        "judge_per_s_c8": round(j8, 1),
        "fresh_per_s_c8": round(f8, 1),
        "fncall_per_case_per_s_c8": round(p8, 1),
        "ratio_vs_fresh_c8": round(j8 / f8, 2),
        "ratio_vs_fncall_per_case_c8": round(j8 / p8, 2),
    }
    if args.plot:
        plot(res, args.quick)
    print(json.dumps(fig))


def plot(res: dict[str, tuple[list[float], float]], quick: bool) -> None:
    title = f"Judging a submission of {len(CASES)} cases (busybox, awk FizzBuzz)"
    ways = {"judge": "dsec judge", "fncall per case": "dsec fncall per case",
            "fresh sandbox": "dsec fresh sandbox"}  # fmt: skip
    colours = [COLOURS["dsec"], COLOURS["other"], COLOURS["baseline"]]
    with figure("judge", title, quick, ncols=2) as (_, (lat, rate)):
        p50 = [1e3 * statistics.median(res[f"{w} c1"][0]) for w in ways]
        bars(lat, list(ways.values()), p50, unit="p50 ms, concurrency 1", colours=colours)
        per_s = [res[f"{w} c8"][1] for w in ways]
        bars(rate, list(ways.values()), per_s, unit="submissions/s, concurrency 8", colours=colours)


if __name__ == "__main__":
    main()
