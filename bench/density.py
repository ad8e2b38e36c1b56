#!/usr/bin/env python3
"""How many idle sandboxes one node holds, and what each costs: create idle sandboxes in
batches until a target count or the first error, and measure on the way.

At 10, 500 and the target (2,000) live sandboxes it measures the create p50 (sequential
creates, which stay up) and the exec p50 (``true`` in random live sandboxes); at the end, the
host memory each idle sandbox holds (MemTotal - MemAvailable, before and after), the daemon's
memory, the time to list them all and to kill them all. The exec p50 at 10 live sandboxes is the
baseline in the same run: at the target it should be no worse than 2x; the create p50 at the
target no worse than 1.5x the one at 10.

Sandboxes ask 0.5 CPU and 256 MiB each, like a typical agent sandbox that sits idle most of
the time. Admission counts the memory really in use (docs/operators/admission.md), so 2,000 such
sandboxes, whose limits add up to 21 times this host's RAM, fit. CPU admission is a sum of
requests against ``DSEC_CPU_OVERCOMMIT`` times the cores; on this bench's node it is set to
1000, since two cores and 2,000 sandboxes of 0.5 CPU are 500x.

    python bench/density.py [--quick] [--target N]

--quick goes to 300 (milestones 10, 100, 300) in under a minute. The last line printed is one
JSON object with ``max_idle_sandboxes``, ``host_kib_per_idle_sandbox``,
``exec_p50_ms_at_max`` and ``create_ratio_max_vs_10`` (targets: >= 2000, <= 4096, at most 2x
the exec p50 at 10, at most 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from figures import COLOURS, add_plot_flag, figure, log_scale

import dsec
from dsec_core.config import NodeConfig
from dsec_core.errors import DsecError
from dsec_core.layers.store import LayerStore
from dsec_core.linux.hostmem import meminfo
from dsec_core.localnode import daemon_pid, ensure_daemon, stop_daemon
from dsec_core.testing import build_busybox_layer

BATCH = 100
SPEC: dict[str, Any] = {"cpu": 0.5, "memory": "256M", "pids": 128, "ttl": None}


def host_used() -> int:
    m = meminfo("MemTotal", "MemAvailable")
    return m["MemTotal"] - m["MemAvailable"]


def rss(pid: int | None) -> int:
    if pid is None:
        return 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of ``pid``."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(seconds: float = 2.0) -> None:
    """Let the daemon's background work (layer sweeps, deferred frees) finish."""
    time.sleep(seconds)


def measure(client: dsec.Client, live: list[Any], spec: dict[str, Any]) -> dict[str, float]:
    """Create p50 over 10 sequential creates (they stay: ``live`` grows) and exec p50 over 60
    execs of ``true`` in random live sandboxes."""
    creates = []
    for _ in range(10):
        t = time.perf_counter()
        live.append(client.create(**spec))
        creates.append(time.perf_counter() - t)
    execs = []
    for sb in random.choices(live, k=60):
        t = time.perf_counter()
        sb.exec("true").check()
        execs.append(time.perf_counter() - t)
    t = time.perf_counter()
    listed = len(client.list())
    list_s = time.perf_counter() - t
    return {
        "live": listed,
        "create_p50_ms": round(1e3 * statistics.median(creates), 2),
        "exec_p50_ms": round(1e3 * statistics.median(execs), 3),
        "list_ms": round(1e3 * list_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 sandboxes (under a minute)")
    ap.add_argument("--target", type=int, help="how many idle sandboxes to reach")
    add_plot_flag(ap)
    args = ap.parse_args()
    target = args.target or (300 if args.quick else 2000)
    milestones = sorted({10, min(500, target // 3 if args.quick else 500), target})

    home = Path(tempfile.mkdtemp(prefix="dsec-bench-density-", dir="/var/tmp"))
    os.environ["DSEC_HOME"] = os.fspath(home)
    os.environ["DSEC_CPU_OVERCOMMIT"] = "1000"
    config = NodeConfig.from_env()
    config.ensure_dirs()
    info = build_busybox_layer(LayerStore(config.layer_dir), name="bench-busybox")
    spec = {**SPEC, "layers": (info.ref,)}
    ensure_daemon(config)
    rows: list[dict[str, float]] = []
    error = ""
    live: list[Any] = []
    try:
        with dsec.Client(os.fspath(config.socket_path)) as client:
            client.create(**spec).kill()  # warm: layer mounted once, disk template made
            settle()
            used0, daemon0 = host_used(), rss(daemon_pid(config))
            started = time.perf_counter()
            for mark in milestones:
                try:
                    while len(live) < mark - 10:
                        n = min(BATCH, mark - 10 - len(live))
                        live += client.create_many(n=n, **spec)
                    rows.append(measure(client, live, spec))
                except DsecError as e:
                    error = f"{type(e).__name__}: {e}"
                    break
                print(
                    f"  {len(live)} live after {time.perf_counter() - started:.0f} s",
                    flush=True,
                )
            settle()
            held = len(live)
            pid = daemon_pid(config)
            used1, daemon1 = host_used(), rss(pid)
            fds = len(os.listdir(f"/proc/{pid}/fd")) if pid else 0
            cpu0 = cpu_seconds(pid)
            time.sleep(5)
            idle_cpu = (cpu_seconds(pid) - cpu0) / 5
            t = time.perf_counter()
            for sb in live:
                sb.kill()
            kill_s = time.perf_counter() - t
    finally:
        stop_daemon(config)
        shutil.rmtree(home, ignore_errors=True)

    per_kib = (used1 - used0) / max(held, 1) / 1024
    daemon_kib = (daemon1 - daemon0) / max(held, 1) / 1024
    print(f"{'live':>6}{'create p50':>12}{'exec p50':>11}{'list':>9}")
    for r in rows:
        print(
            f"{r['live']:>6.0f}{r['create_p50_ms']:>10.2f}ms{r['exec_p50_ms']:>9.2f}ms"
            f"{r['list_ms']:>7.1f}ms"
        )
    base, top = rows[0], rows[-1]
    exec_ratio = top["exec_p50_ms"] / base["exec_p50_ms"]
    create_ratio = top["create_p50_ms"] / base["create_p50_ms"]
    print(f"host memory per idle sandbox: {per_kib:.0f} KiB (target <= 4096)")
    print(f"daemon: {daemon1 >> 20} MiB RSS at {held}, {daemon_kib:.1f} KiB per sandbox")
    print(f"daemon while they idle: {100 * idle_cpu:.1f}% of a core, {fds} open files")
    print(f"killing {held}: {kill_s:.1f} s ({held / kill_s:.0f}/s)")
    print(
        f"exec p50 at {top['live']:.0f} vs at {base['live']:.0f}: {exec_ratio:.2f}x (target <= 2)"
    )
    print(
        f"create p50 at {top['live']:.0f} vs at {base['live']:.0f}: {create_ratio:.2f}x "
        "(target <= 1.5)"
    )
    if error:
        print(f"stopped by: {error}")
    if args.plot:
        plot(rows, per_kib, args.quick)
    print(
        json.dumps(
            {
                "quick": args.quick,
                "target": target,
                "max_idle_sandboxes": held,
                "host_kib_per_idle_sandbox": round(per_kib),
                "daemon_rss_mib": daemon1 >> 20,
                "daemon_kib_per_sandbox": round(daemon_kib, 1),
                "daemon_fds_at_max": fds,
                "daemon_idle_cpu_pct_at_max": round(100 * idle_cpu, 1),
                "create_p50_ms": {str(int(r["live"])): r["create_p50_ms"] for r in rows},
                "exec_p50_ms": {str(int(r["live"])): r["exec_p50_ms"] for r in rows},
                "list_ms_at_max": top["list_ms"],
                "exec_p50_ms_at_max": top["exec_p50_ms"],
                "exec_ratio_max_vs_10": round(exec_ratio, 2),
                "create_ratio_max_vs_10": round(create_ratio, 2),
                "kill_per_s": round(held / kill_s, 1),
                "error": error or None,
            }
        )
    )


def plot(rows: list[dict[str, float]], per_kib: float, quick: bool) -> None:
    # host memory per sandbox is MemTotal - MemAvailable before and after: on a shared machine
    # other processes' work can outweigh it, and a negative figure means only that
    each = f"; {per_kib:.0f} KiB of host memory each" if per_kib > 0 else ""
    title = f"Idle sandboxes on one node (busybox, 0.5 CPU, 256 MiB{each})"
    with figure("density", title, quick, ncols=2) as (_, (create, other)):
        live = [r["live"] for r in rows]
        create.plot(live, [r["create_p50_ms"] for r in rows], "o-", color=COLOURS["dsec"])
        create.set(xlabel="live sandboxes", ylabel="create p50, ms", ylim=(0, None))
        other.plot(live, [r["exec_p50_ms"] for r in rows], "o-", label="exec `true` p50")
        other.plot(live, [r["list_ms"] for r in rows], "s--", label="list all", color="gray")
        other.set(xlabel="live sandboxes", ylabel="ms")
        log_scale(other)
        other.legend()
        for ax in (create, other):
            ax.grid(alpha=0.3)


if __name__ == "__main__":
    main()
