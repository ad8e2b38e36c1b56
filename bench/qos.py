#!/usr/bin/env python3
"""DSec's CPU-class experiment at this machine's scale: how much a latency-sensitive (LS)
sandbox's step slows down while best-effort (BE) sandboxes burn CPU, unprotected (the burners
are LS too) against with classes (the burners are BE), in one run.

The step: a fixed CPU-bound busybox shell loop (about 70 ms alone), run with ``exec`` in an LS
sandbox and timed from the client, so the agent and the daemon are on the measured path as in
a rollout. The load: one burner sandbox a CPU, each spinning a shell loop flat out under a
CPU limit of half a core (50% of the machine) or a whole one (100%), so the kernel's CPU
bandwidth control sets the load. Each round measures the step alone (the baseline), then every
load and protection in random order, so drift on a shared machine hits all alike. Inflation is
the step's p50 under load over its p50 alone, minus one.

Besides "unprotected" and "classes" (SCHED_IDLE, cpu.idle and the lowest cpu.shares: what a
``qos="be"`` sandbox gets), the "sched_idle only" row is DSec's ablation: the BE burners with
their cgroups' cpu.idle turned off (cpu.shares back to 2), so only the tasks are SCHED_IDLE.

    python bench/qos.py [--quick]

A full run is 8 rounds of 12 steps a setting (about two minutes); --quick does 3 of 8 (under a
minute). The last line printed is one JSON object with ``ls_inflation_unprotected`` and
``ls_inflation_be_idle`` at 50% load (target <= 0.15; DSec: 0.452 and 0.173) and the same at
100% (``..._100``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import dsec
from dsec_core.backend import cgroup_path
from dsec_core.linux.cgroups import cpu_cgroup_dir, cpu_idle
from dsec_core.linux.sched import core_scheduling
from dsec_core.testing import running_kit_node

TARGET = 0.15
STEP_MS = 70.0  # the step alone, calibrated
LOADS = (0.5, 1.0)  # of the machine: each burner's CPU limit, in cores
BURN = "while :; do :; done"
MODES = ("unprotected", "sched_idle only", "classes")


def loop(n: int) -> str:
    """A busybox shell loop of ``n`` iterations: pure CPU in one process."""
    return f"i=0; while [ $i -lt {n} ]; do i=$((i+1)); done"


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def calibrate(sb: dsec.Sandbox) -> int:
    """Iterations of ``loop`` that take about STEP_MS in ``sb``, alone (median of five)."""
    n = 20000
    for _ in range(3):
        step = loop(n)
        overhead = statistics.median(timed(lambda: sb.exec("true").check()) for _ in range(5))
        took = statistics.median(timed(lambda s=step: sb.exec(s).check()) for _ in range(5))
        n = max(1000, int(n * STEP_MS / 1e3 / max(took - overhead, 1e-3)))
    return n


def set_cgroup_idle(sandboxes: list[dsec.Sandbox], idle: bool) -> None:
    """Turn the BE burners' cgroup-level idleness on or off (off: cpu.shares back to the
    BE sandbox's 2, which the kernel reset to 1024 when idleness went)."""
    for sb in sandboxes:
        d = cpu_cgroup_dir(cgroup_path(sb.id))
        assert d is not None
        (d / "cpu.idle").write_text("1" if idle else "0")
        if not idle and (d / "cpu.shares").exists():
            (d / "cpu.shares").write_text("2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    args = ap.parse_args()
    rounds, steps = (3, 8) if args.quick else (8, 12)
    ncpu = os.cpu_count() or 1
    can_idle = cpu_idle().available
    modes = MODES if can_idle else ("unprotected", "classes")
    samples: dict[tuple[str, float], list[float]] = {("alone", 0.0): []}
    for load in LOADS:
        for mode in modes:
            samples[(mode, load)] = []

    with running_kit_node("dsec-bench-qos-") as node, node.client() as client:
        base = {"layers": (node.layer.ref,), "memory": "64M", "cpu": 1.0, "ttl": 3600}
        ls = client.create(**base)
        # one burner a CPU, of each class and CPU limit
        burners = {
            (qos, load): [client.create(**{**base, "cpu": load}, qos=qos) for _ in range(ncpu)]
            for qos in ("ls", "be")
            for load in LOADS
        }
        n = calibrate(ls)

        def measure(key: tuple[str, float]) -> None:
            mode, load = key
            group = burners[("ls" if mode == "unprotected" else "be", load)] if load else []
            if mode != "alone":
                if can_idle:
                    set_cgroup_idle(group, idle=mode == "classes")
                for sb in group:
                    sb.exec(f"{BURN} > /dev/null 2>&1 &", background=True).check()
                time.sleep(0.3)  # let the burners reach their pace
            try:
                for _ in range(steps):
                    samples[key].append(timed(lambda: ls.exec(loop(n)).check()))
            finally:
                for sb in group:
                    sb.exec("true", exclusive=True).check()  # kills the burner

        for _ in range(rounds):
            measure(("alone", 0.0))
            keys = [k for k in samples if k[0] != "alone"]
            random.shuffle(keys)
            for key in keys:
                measure(key)
        for sb in [ls, *(b for group in burners.values() for b in group)]:
            sb.kill()

    med = {k: statistics.median(v) for k, v in samples.items()}
    alone = med[("alone", 0.0)]

    def inflation(mode: str, load: float) -> float:
        return med[(mode, load)] / alone - 1

    print(
        f"LS step: {n} shell-loop iterations, {1e3 * alone:.1f} ms alone (p50); {ncpu} CPUs; "
        f"{rounds} rounds x {steps} steps a setting; burners: {ncpu} sandboxes spinning, "
        "each limited to the load's share of one CPU"
    )
    print(f"BE cgroups' cpu.idle: {cpu_idle()}; core scheduling: {core_scheduling()}")
    print(f"{'BE load':<10}{'burners are':<18}{'step p50':>10}{'p90':>10}{'inflation':>11}")
    print(f"{'-':<10}{'(none)':<18}{1e3 * alone:>8.1f}ms{_p90(samples[('alone', 0.0)]):>8.1f}ms")
    shown = {"unprotected": "LS (unprotected)", "sched_idle only": "BE, SCHED_IDLE only"}
    for load in LOADS:
        for mode in modes:
            key = (mode, load)
            print(
                f"{f'{load:.0%}':<10}{shown.get(mode, 'BE (classes)'):<18}"
                f"{1e3 * med[key]:>8.1f}ms{_p90(samples[key]):>8.1f}ms"
                f"{inflation(mode, load):>10.1%}"
            )
    print(f"target: with classes at 50% load <= {TARGET:.0%} (DSec: 17.3%; 45.2% unprotected)")
    out: dict[str, Any] = {
        "quick": args.quick,
        "cpus": ncpu,
        "rounds": rounds,
        "steps_per_setting": steps,
        "step_p50_ms_alone": round(1e3 * alone, 2),
        "ls_inflation_unprotected": round(inflation("unprotected", 0.5), 3),
        "ls_inflation_be_idle": round(inflation("classes", 0.5), 3),
        "ls_inflation_unprotected_100": round(inflation("unprotected", 1.0), 3),
        "ls_inflation_be_idle_100": round(inflation("classes", 1.0), 3),
        "cpu_idle": can_idle,
        "core_scheduling": core_scheduling().available,
    }
    if can_idle:
        out["ls_inflation_sched_idle_only"] = round(inflation("sched_idle only", 0.5), 3)
        out["ls_inflation_sched_idle_only_100"] = round(inflation("sched_idle only", 1.0), 3)
    print(json.dumps(out))


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
