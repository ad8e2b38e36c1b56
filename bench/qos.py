#!/usr/bin/env python3
"""DSec's CPU-class experiment at this machine's scale: how much a latency-sensitive (LS)
sandbox's step slows down while best-effort (BE) sandboxes burn CPU, unprotected (the burners
are LS too) against with classes (the burners are BE), in one run.

The step: a fixed CPU-bound busybox shell loop (about 70 ms alone), run with ``exec`` in an LS
sandbox and timed from the client, so the agent and the daemon are on the measured path as in
a rollout. The load: one burner sandbox a CPU, each spinning a shell loop flat out under a
CPU limit of half a core (50% of the machine) or a whole one (100%), so the kernel's CPU
bandwidth control sets the load. The backend pins sandboxes below the host's core count to
cores (``DSEC_CPU_PINNING``, on by default): the burners are made first, so each group spreads
over all cores, and the step's 1-CPU sandbox shares its core with one burner of each group
(the output shows the cpusets). Each round measures every load and protection in random
order; each step under load is paired with one alone, in random order, a fraction of a second
apart, the burners stopped for it with the cgroup freezer, so drift on a shared machine hits
both alike. Inflation is the step's p50 under load over its p50 alone, minus one; "paired" is
the median over pairs of the loaded step over its partner, minus one; "waited" is the step's
time runnable but off a CPU (/proc/PID/schedstat), what the classes act on, untouched by the
host's own speed (this is a VM: its vCPUs share a host).

Besides "unprotected" and "classes" (SCHED_IDLE, cpu.idle and the lowest cpu.shares: what a
``qos="be"`` sandbox gets), the "sched_idle only" row is DSec's ablation: the BE burners with
their cgroups' cpu.idle turned off (cpu.shares back to 2), so only the tasks are SCHED_IDLE.

    python bench/qos.py [--quick]

A full run is 8 rounds of 10 pairs a setting (about two minutes); --quick does 3 of 6 (about
40 s). The last line printed is one JSON object with
``ls_inflation_unprotected`` and ``ls_inflation_be_idle`` at 50% load (target <= 0.15; DSec:
0.452 and 0.173), the same at 100% (``..._100``), and the paired figures at 50%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import dsec
from dsec_core.backend import cgroup_path
from dsec_core.linux.cgroups import CGROUP_ROOT, cgroup2_root, cpu_cgroup_dir, cpu_idle
from dsec_core.linux.sched import core_scheduling
from dsec_core.testing import running_kit_node

TARGET = 0.15
STEP_MS = 70.0  # the step alone, calibrated
LOADS = (0.5, 1.0)  # of the machine: each burner's CPU limit, in cores
BURN = "while :; do :; done"
MODES = ("unprotected", "sched_idle only", "classes")
Setting = tuple[str, float]  # (mode, load)


def loop(n: int) -> str:
    """A busybox shell loop of ``n`` iterations: pure CPU in one process."""
    return f"i=0; while [ $i -lt {n} ]; do i=$((i+1)); done"


def step(sb: dsec.Sandbox, n: int) -> tuple[float, float]:
    """Run the step in ``sb``: seconds until its result is back, and seconds its shell waited
    for a CPU while runnable (its /proc/PID/schedstat), which the host's own speed does not
    change."""
    started = time.perf_counter()
    out = sb.exec(f"{loop(n)}; cat /proc/$$/schedstat").check()
    wall = time.perf_counter() - started
    return wall, int(out.text.split()[1]) / 1e9


def timed_exec(sb: dsec.Sandbox, cmd: str) -> float:
    """Seconds from sending ``cmd`` to ``sb`` to having its (successful) result."""
    started = time.perf_counter()
    sb.exec(cmd).check()
    return time.perf_counter() - started


def calibrate(sb: dsec.Sandbox) -> int:
    """Iterations of ``loop`` that take about STEP_MS in ``sb``, alone (median of five)."""
    n = 20000
    for _ in range(3):
        overhead = statistics.median(timed_exec(sb, "true") for _ in range(5))
        took = statistics.median(timed_exec(sb, loop(n)) for _ in range(5))
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


def freeze(sandboxes: list[dsec.Sandbox], frozen: bool) -> None:
    """Stop or resume every process of the sandboxes at once with the cgroup freezer (v1's
    ``freezer.state``, else v2's ``cgroup.freeze``), returning once they are stopped."""
    for sb in sandboxes:
        v1 = CGROUP_ROOT / "freezer" / cgroup_path(sb.id) / "freezer.state"
        if v1.exists():
            v1.write_text("FROZEN" if frozen else "THAWED")
            while frozen and v1.read_text().strip() != "FROZEN":
                time.sleep(0.001)
            continue
        root = cgroup2_root()
        assert root is not None, "no cgroup freezer"
        d = root / cgroup_path(sb.id)
        (d / "cgroup.freeze").write_text("1" if frozen else "0")
        while frozen and "frozen 1" not in (d / "cgroup.events").read_text():
            time.sleep(0.001)


def cores_of(sb: dsec.Sandbox) -> str:
    """The cores the sandbox may run on (its cpuset), as the kernel lists them."""
    for path in (
        CGROUP_ROOT / "cpuset" / cgroup_path(sb.id) / "cpuset.cpus",
        (cgroup2_root() or CGROUP_ROOT) / cgroup_path(sb.id) / "cpuset.cpus.effective",
    ):
        try:
            return path.read_text().strip() or "all"
        except OSError:
            continue
    return "?"


def cpu_pressure() -> float | None:
    """The host's CPU pressure: % of the last minute some task waited for a CPU (PSI)."""
    try:
        first = Path("/proc/pressure/cpu").read_text().split("\n")[0]
    except OSError:
        return None
    return float(dict(f.split("=") for f in first.split()[1:])["avg60"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    args = ap.parse_args()
    rounds, pairs = (3, 6) if args.quick else (8, 10)
    ncpu = os.cpu_count() or 1
    can_idle = cpu_idle().available
    modes = MODES if can_idle else ("unprotected", "classes")
    settings = [(mode, load) for load in LOADS for mode in modes]
    alone: list[float] = []
    waits: dict[Setting | None, list[float]] = {None: [], **{k: [] for k in settings}}
    samples: dict[Setting, list[float]] = {k: [] for k in settings}
    paired: dict[Setting, list[float]] = {k: [] for k in settings}  # loaded over its own alone
    burner_load: dict[Setting, list[float]] = {k: [] for k in settings}

    pressure = cpu_pressure()  # before anything of ours runs: other work on the machine
    with running_kit_node("dsec-bench-qos-") as node, node.client() as client:
        base = dsec.SandboxSpec(layers=(node.layer.ref,), memory="64M", cpu=1.0, ttl=3600)
        # One burner a CPU, of each class and CPU limit, made first: the backend pins a sandbox
        # below the host's core count to the least committed cores, so each group spreads over
        # all of them, and the step's sandbox shares its core with one burner of each.
        burners = {
            (qos, load): [client.create(base, cpu=load, qos=qos) for _ in range(ncpu)]
            for qos in ("ls", "be")
            for load in LOADS
        }
        ls = client.create(base)
        layout = {"step": cores_of(ls)} | {
            f"{qos}@{load:g}": ",".join(cores_of(sb) for sb in group)
            for (qos, load), group in burners.items()
        }
        n = calibrate(ls)

        def cpu_seconds(group: list[dsec.Sandbox]) -> float:
            return sum(client.usage(sb.id).cpu_seconds or 0.0 for sb in group)

        def measure(setting: Setting) -> None:
            """``pairs`` steps under the setting's load, each beside one with its burners
            frozen (alone), the two in random order, a fraction of a second apart."""
            mode, load = setting
            qos = "ls" if mode == "unprotected" else "be"
            group = burners[(qos, load)]
            if qos == "be" and can_idle:
                set_cgroup_idle(group, idle=mode == "classes")
            for sb in group:
                sb.exec(f"{BURN} > /dev/null 2>&1 &", background=True).check()
            time.sleep(0.2)  # the burners are running
            loaded_for = 0.0
            burnt = cpu_seconds(group)
            try:
                for _ in range(pairs):
                    got: dict[bool, float] = {}
                    for loaded in random.sample((False, True), 2):
                        freeze(group, frozen=not loaded)
                        if loaded:
                            thawed = time.perf_counter()
                            time.sleep(0.02)  # back at full pace
                        got[loaded], wait = step(ls, n)
                        if loaded:
                            loaded_for += time.perf_counter() - thawed
                        waits[setting if loaded else None].append(wait)
                    alone.append(got[False])
                    samples[setting].append(got[True])
                    paired[setting].append(got[True] / got[False] - 1)
                freeze(group, frozen=True)  # nothing burns while usage is read
                burner_load[setting].append((cpu_seconds(group) - burnt) / loaded_for / ncpu)
            finally:
                freeze(group, frozen=False)
                for sb in group:
                    sb.exec("true", exclusive=True).check()  # kills the burner

        for _ in range(rounds):
            random.shuffle(settings)
            for setting in settings:
                measure(setting)
        for sb in [ls, *(b for group in burners.values() for b in group)]:
            sb.kill()

    med = statistics.median
    p50_alone = med(alone)

    def inflation(setting: Setting) -> float:
        return med(samples[setting]) / p50_alone - 1

    print(
        f"LS step: {n} shell-loop iterations, {1e3 * p50_alone:.1f} ms alone (p50); {ncpu} "
        f"CPUs; {rounds} rounds of {pairs} steps a setting, each paired with one alone; "
        f"burners: {ncpu} sandboxes spinning, each limited to the load's share of one CPU"
    )
    print(f"host CPU pressure before the run (PSI some avg60: other work): {pressure}%")
    print("cores (cpusets): " + "; ".join(f"{k} {v}" for k, v in layout.items()))
    print(f"BE cgroups' cpu.idle: {cpu_idle()}")
    print(f"core scheduling: {core_scheduling()}")
    print(
        f"{'load':<6}{'burners are':<21}{'step p50':>10}{'p90':>10}{'inflation':>11}"
        f"{'paired':>9}{'waited p50':>12}{'burners got':>13}"
    )
    print(
        f"{'-':<6}{'(none)':<21}{1e3 * p50_alone:>8.1f}ms{_p90(alone):>8.1f}ms{'':>20}"
        f"{1e3 * med(waits[None]):>10.1f}ms"
    )
    shown = {"unprotected": "LS (unprotected)", "sched_idle only": "BE, SCHED_IDLE only"}
    for setting in sorted(settings, key=lambda k: (k[1], MODES.index(k[0]))):
        mode, load = setting
        print(
            f"{f'{load:.0%}':<6}{shown.get(mode, 'BE (classes)'):<21}"
            f"{1e3 * med(samples[setting]):>8.1f}ms{_p90(samples[setting]):>8.1f}ms"
            f"{inflation(setting):>10.1%}{med(paired[setting]):>9.1%}"
            f"{1e3 * med(waits[setting]):>10.1f}ms{med(burner_load[setting]):>13.0%}"
        )
    print(
        "inflation: p50 over the p50 alone; paired: the median over steps of each step over the "
        "step alone paired with it; waited: the step's time runnable but off a CPU; "
        "burners got: the CPU they used meanwhile, as a share of the machine"
    )
    print(f"target: with classes at 50% load <= {TARGET:.0%} (DSec: 17.3%; 45.2% unprotected)")
    out: dict[str, Any] = {
        "quick": args.quick,
        "cpus": ncpu,
        "rounds": rounds,
        "steps_per_setting": pairs,
        "step_p50_ms_alone": round(1e3 * p50_alone, 2),
        "ls_inflation_unprotected": round(inflation(("unprotected", 0.5)), 3),
        "ls_inflation_be_idle": round(inflation(("classes", 0.5)), 3),
        "ls_inflation_unprotected_100": round(inflation(("unprotected", 1.0)), 3),
        "ls_inflation_be_idle_100": round(inflation(("classes", 1.0)), 3),
        "ls_inflation_unprotected_paired": round(med(paired[("unprotected", 0.5)]), 3),
        "ls_inflation_be_idle_paired": round(med(paired[("classes", 0.5)]), 3),
        "wait_p50_ms_alone": round(1e3 * med(waits[None]), 2),
        "wait_p50_ms_unprotected": round(1e3 * med(waits[("unprotected", 0.5)]), 2),
        "wait_p50_ms_be_idle": round(1e3 * med(waits[("classes", 0.5)]), 2),
        "burner_share_unprotected": round(med(burner_load[("unprotected", 0.5)]), 3),
        "burner_share_be_idle": round(med(burner_load[("classes", 0.5)]), 3),
        "host_cpu_pressure_pct": pressure,
        "cores": layout,
        "cpu_idle": can_idle,
        "core_scheduling": core_scheduling().available,
    }
    if can_idle:
        out["ls_inflation_sched_idle_only"] = round(inflation(("sched_idle only", 0.5)), 3)
        out["ls_inflation_sched_idle_only_100"] = round(inflation(("sched_idle only", 1.0)), 3)
    print(json.dumps(out))


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
