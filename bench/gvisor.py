#!/usr/bin/env python3
"""Create -> first exec latency under runc and under gVisor (runsc), on the kit's busybox layer.

Each round creates a sandbox, runs ``true`` in it and kills it; runc and runsc rounds
alternate so both see the same machine. Also times ``true`` in a running sandbox and a
syscall-heavy loop (a shell counting to 20000) in each.

    python bench/gvisor.py [--rounds 10]

The last line printed is one JSON object of the figures (p50 and p90, milliseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dsec_core.testing import running_kit_node


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    runtimes = ("runc", "runsc")
    first: dict[str, list[float]] = {r: [] for r in runtimes}
    execs: dict[str, list[float]] = {r: [] for r in runtimes}
    loops: dict[str, list[float]] = {r: [] for r in runtimes}
    with running_kit_node("dsec-bench-gvisor-") as node, node.client() as client:
        for rt in runtimes:  # warm: the layer mounted, the agent built, runsc in page cache
            client.create(layers=[node.layer.ref], runtime=rt).kill()
        for _ in range(args.rounds):
            for rt in runtimes:
                t0 = time.perf_counter()
                sb = client.create(layers=[node.layer.ref], runtime=rt)
                sb.exec("true").check()
                first[rt].append(time.perf_counter() - t0)
                for _ in range(3):
                    t = time.perf_counter()
                    sb.exec("true").check()
                    execs[rt].append(time.perf_counter() - t)
                t = time.perf_counter()
                sb.exec("i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done").check()
                loops[rt].append(time.perf_counter() - t)
                sb.kill()
    out = {
        rt: {
            "create_first_exec_p50_ms": _pct(first[rt], 0.5),
            "create_first_exec_p90_ms": _pct(first[rt], 0.9),
            "exec_true_p50_ms": _pct(execs[rt], 0.5),
            "shell_loop_20000_p50_ms": _pct(loops[rt], 0.5),
            "rounds": len(first[rt]),
            "mean_create_first_exec_ms": round(statistics.mean(first[rt]) * 1000, 1),
        }
        for rt in runtimes
    }
    for rt, figures in out.items():
        print(rt, figures)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
