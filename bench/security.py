#!/usr/bin/env python3
"""What security policies cost: create and exec latency with every loaded policy on, against all
of them off, on the same node and base layer, alternating in one run.

"On" is each registered policy with its ``example`` settings (and the network mode they need),
best effort, so one the host cannot enforce is left out and the output says which were on;
"off" turns every one off (``{"enabled": false}``), defaults included. Each round is
create -> exec ``true`` -> kill; exec latency is measured on a sandbox that stays up.

    python bench/security.py [--quick]

A full run is 200 rounds and 600 execs of each (about a minute); --quick does 12 and 60. The
last line printed is one JSON object with ``create_overhead_ratio`` and
``exec_overhead_ratio`` (on / off, ratios of the medians; target <= 1.15), and
``create_overhead_ratio_paired``, the median of each round's on / off.
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

import dsec
from dsec_core.config import NodeConfig
from dsec_core.layers.store import LayerStore
from dsec_core.localnode import ensure_daemon, stop_daemon
from dsec_core.plugins import registry
from dsec_core.testing import build_busybox_layer

TARGET = 1.15


def specs(layer: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The spec with every policy on (example settings), the spec with all off, and the
    names of the policies that are on."""
    on: dict[str, Any] = {}
    off: dict[str, Any] = {}
    network = "none"
    for name, cls in sorted(registry().security_policies.items()):
        settings, mode = cls.example
        # best effort: a policy this host cannot enforce (AppArmor without AppArmor) is skipped
        # by the node instead of failing every create; "policies on" prints what was in force
        on[name] = {**settings, "best_effort": True}
        off[name] = {"enabled": False}
        if mode != "none":
            network = mode
    base = {"layers": (layer,), "memory": "128M", "ttl": 300}
    return {**base, "policies": on, "network": network}, {**base, "policies": off}, sorted(on)


def round_trip(client: dsec.Client, spec: dict[str, Any]) -> float:
    started = time.perf_counter()
    sb = client.create(**spec)
    sb.exec("true").check()
    sb.kill()
    return time.perf_counter() - started


def exec_latency(
    client: dsec.Client, on: dict[str, Any], off: dict[str, Any], n: int
) -> tuple[list[float], list[float]]:
    """Exec ``true`` ``n`` times in a sandbox of each spec, alternating between the two."""
    sandboxes = (client.create(**on), client.create(**off))
    times: tuple[list[float], list[float]] = ([], [])
    try:
        pairs = list(zip(sandboxes, times, strict=True))
        for _ in range(n):
            random.shuffle(pairs)  # neither always goes first
            for sb, out in pairs:
                started = time.perf_counter()
                sb.exec("true").check()
                out.append(time.perf_counter() - started)
        return times
    finally:
        for sb in sandboxes:
            sb.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    args = ap.parse_args()
    rounds, execs = (12, 60) if args.quick else (200, 600)

    home = Path(tempfile.mkdtemp(prefix="dsec-bench-sec-", dir="/var/tmp"))
    config = NodeConfig(home=home)
    config.ensure_dirs()
    info = build_busybox_layer(LayerStore(config.layer_dir), name="bench-busybox")
    os.environ["DSEC_HOME"] = os.fspath(home)
    ensure_daemon(config)
    on, off, names = specs(info.ref)
    try:
        with dsec.Client(os.fspath(config.socket_path)) as client:
            for spec in (on, off):  # warm both paths (filters compiled, programs built)
                round_trip(client, spec)
            t_on: list[float] = []
            t_off: list[float] = []
            for _ in range(rounds):  # alternate in random order, so drift hits both alike
                order = [(on, t_on), (off, t_off)]
                random.shuffle(order)
                for spec, out in order:
                    out.append(round_trip(client, spec))
            e_on, e_off = exec_latency(client, on, off, execs)
            in_force = [p.name for p in client.create(**on).policies() if p.state == "enforced"]
            for info_ in client.list():
                client.kill(info_.id)
    finally:
        stop_daemon(config)
        shutil.rmtree(home, ignore_errors=True)

    med = statistics.median
    create_ratio = med(t_on) / med(t_off)
    exec_ratio = med(e_on) / med(e_off)
    # the same, round by round: each on against the off of its own round (drift cancels)
    paired = med(a / b for a, b in zip(t_on, t_off, strict=True))
    print(f"policies on: {', '.join(in_force) or '-'} (loaded: {', '.join(names) or '-'})")
    print(f"{'measure':<34}{'all off':>12}{'all on':>12}{'ratio':>8}")
    print(
        f"{'create -> exec -> kill, p50':<34}{1e3 * med(t_off):>10.2f}ms{1e3 * med(t_on):>10.2f}ms"
        f"{create_ratio:>8.3f}"
    )
    print(
        f"{'exec `true`, p50':<34}{1e3 * med(e_off):>10.2f}ms{1e3 * med(e_on):>10.2f}ms"
        f"{exec_ratio:>8.3f}"
    )
    print(f"{'create, median of per-round ratios':<58}{paired:>8.3f}")
    print(f"target: both ratios <= {TARGET}")
    print(
        json.dumps(
            {
                "quick": args.quick,
                "policies_on": in_force,
                "rounds": rounds,
                "execs": execs,
                "create_p50_ms_off": round(1e3 * med(t_off), 2),
                "create_p50_ms_on": round(1e3 * med(t_on), 2),
                "exec_p50_ms_off": round(1e3 * med(e_off), 3),
                "exec_p50_ms_on": round(1e3 * med(e_on), 3),
                "create_overhead_ratio": round(create_ratio, 3),
                "create_overhead_ratio_paired": round(paired, 3),
                "exec_overhead_ratio": round(exec_ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
