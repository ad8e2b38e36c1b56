#!/usr/bin/env python3
"""Each bench's last run against the one before it, from the ledger (``bench/ledger.py``): a
table per bench of every figure, its change, the bench's measured noise, and a verdict; a figure
that moved the wrong way by more than ``K`` times its noise is flagged.

    python bench/compare.py [BENCH...] [--against COMMIT] [--all] [--fail-on-regression]
    python bench/compare.py --calibrate create [--runs 5] [-- --quick]
    python bench/compare.py --readme | --check-readme

Which way is better is declared, never guessed: ``DIRECTIONS`` below, per bench (exact names,
or patterns for the families a bench names by rule), or a ``"directions"`` object in the
bench's own last line (``{"warm_p50_ms": "lower", ...}``), which wins. A figure with none is
shown and never flagged, and the output names it. ``baseline`` figures (docker, the feature
off) are shown and never flagged: they are what dsec is measured against, not dsec.
``info`` ones (rounds, sizes of the run) are shown with ``--all`` and said when they differ,
since then the two runs did not measure the same thing.

The noise of a figure is its relative spread, ``(max - min) / |median|``, over the runs of the
newest calibration of that bench in that mode on that machine (``--calibrate``: ``--runs`` runs
in a row at one commit, each recorded, then the spread). Without one, ``DEFAULT_NOISE`` stands
in and the output says so. Never less than ``NOISE_FLOOR``: figures are rounded, and a 0.5%
change of a deterministic byte count is not worth a flag.

``K`` = 2: a comparison is two single runs, whose difference varies about 1.4 times as much as
one run, and the range of a handful of runs underestimates the spread as often as not. With
normally distributed noise, 2x the range of 5 calibration runs flags a figure that did not move
in about 2% of comparisons (7% with 3 runs) and catches a real shift of 5 standard deviations
(say +50% at 10% noise) in about 60% (3 runs: 75%); a larger K hides real regressions of that
size more often than it saves false alarms. The last line printed is one JSON object:
``flagged`` (bench, figure, last, previous, change and noise), ``failed`` benches,
``uncalibrated`` benches and each bench's figures ``without_direction``.

``--readme`` rewrites the block of README.md between ``<!-- ledger:begin -->`` and
``<!-- ledger:end -->`` from the ledger (``README_ROWS``); tests/test_bench_ledger.py fails when
the block and the ledger differ, so the README cannot quote a figure the ledger lacks.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger import LEDGER, REPO, Entry, bench_name, bench_script, calibrate, leaves, read
from rich.console import Console
from rich.table import Table

LOWER, HIGHER, BASELINE, INFO = "lower", "higher", "baseline", "info"
DIRECTION_NAMES = (LOWER, HIGHER, BASELINE, INFO)

#: Flag a figure that moved the wrong way by more than K times its noise (why 2: the docstring);
#: a fall counts as the rise of the inverse (``moved``), so that a halved throughput is flagged
#: as surely as a doubled latency.
K = 2.0
#: A bench's noise where it has no calibration on this machine in this mode: an assumption, not a
#: measurement, and a generous one (a figure must move 50% to be flagged), since a flag that
#: cries wolf is soon ignored: the --quick runs docs/benchmarks.md quotes from this 2-core
#: machine on different days spread 36-45% (fncall's p50 2.5-3.6 ms, its ratio 35-55x).
DEFAULT_NOISE = 0.25
#: No figure's noise is taken as less than this.
NOISE_FLOOR = 0.01

#: Which way is better, per bench: (pattern, direction), the first match wins. Exact names where
#: a bench writes its figures out; fnmatch patterns for the families a bench names by rule
#: (disk's table rows, vm's runtimes, density's milestones). Nested figures are ``outer.inner``.
# fmt: off
DIRECTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "create": (
        ("dsec_p50_ms", LOWER), ("dsec_p99_ms", LOWER), ("dsec_per_s_c1", HIGHER),
        ("dsec_c8_p50_ms", LOWER), ("dsec_c8_p99_ms", LOWER), ("dsec_per_s_c8", HIGHER),
        ("ratio_vs_docker_c8", HIGHER), ("ratio_vs_docker_p50", HIGHER),
        ("dsec_exec_p50_ms", LOWER), ("dsec_exec_p99_ms", LOWER),
        # warm claims (issue 24): named there, declared here ahead of the bench printing them
        ("warm_p50_ms", LOWER), ("warm_p99_ms", LOWER), ("warm_per_s_c8", HIGHER),
        ("warm_first_exec_p50_ms", LOWER), ("warm_c8_p50_ms", LOWER),
        ("warm_claim_rate", HIGHER), ("warm_vs_docker_c8", HIGHER),
        ("cold_create_p50_ms", LOWER), ("docker_*", BASELINE), ("rounds", INFO),
        ("image", INFO), ("quick", INFO),
    ),
    "queue": (
        ("completed_fraction", HIGHER), ("min_share", HIGHER), ("max_share", LOWER),
        ("creates_per_s", HIGHER), ("rate_vs_single", HIGHER), ("rejected", LOWER),
        ("errors", LOWER), ("single_rejected", LOWER), ("single_creates_per_s", BASELINE),
        ("trainers", INFO), ("creates_per_trainer", INFO), ("room", INFO),
        ("max_starting", INFO), ("window_s", INFO), ("windows", INFO), ("single_runs", INFO),
        ("peak_live", INFO),
    ),
    "seccomp": (
        ("*_off", BASELINE), ("create_p50_ms_on", LOWER), ("create_exec_kill_p50_ms_on", LOWER),
        ("getppid_ns_on", LOWER), ("ioctl_ns_on", LOWER), ("create_overhead_ms", LOWER),
        ("create_overhead_ratio", LOWER), ("rounds", INFO), ("rules", INFO),
        ("profile_bytes", INFO),
    ),
    "disk": (
        ("plain_*", BASELINE), ("no_quota_*", BASELINE), ("own-fs*_p50_ms", LOWER),
        ("quota_*_p50_ms", LOWER), ("difference_*_p50_ms", LOWER), ("create_cost_ms", LOWER),
        ("create_ratio", LOWER), ("cycle_cost_ms", LOWER), ("rounds", INFO),
    ),
    "fncall": (
        ("fncall_p50_ms", LOWER), ("fncall_p99_ms", LOWER), ("fncall_per_s_c8", HIGHER),
        ("ratio_vs_docker_exec_c8", HIGHER), ("ratio_vs_fresh_c8", HIGHER),
        ("judge_fncall_p50_ms", LOWER), ("judge_fncall_per_s_c8", HIGHER),
        ("judge_ratio_vs_docker_exec_c8", HIGHER), ("docker_exec_*", BASELINE),
        ("fresh_sandbox_per_s_c8", BASELINE), ("judge_docker_exec_per_s_c8", BASELINE),
    ),
    "judge": (
        ("judge_p50_ms", LOWER), ("judge_p99_ms", LOWER), ("judge_per_s_c8", HIGHER),
        ("ratio_vs_fresh_c8", HIGHER), ("ratio_vs_fncall_per_case_c8", HIGHER),
        ("fresh_per_s_c8", BASELINE), ("fncall_per_case_per_s_c8", BASELINE), ("cases", INFO),
    ),
    "vm": (
        ("container_*", BASELINE), ("blk_*", BASELINE), ("gvisor_*", LOWER),
        ("microvm_*", LOWER), ("vm_*", LOWER), ("pmem_vs_blk_*_ratio", LOWER),
        ("pmem_*_bytes", LOWER), ("other_qemus_during_memory", INFO), ("idle_vms", INFO),
        ("layer_mb", INFO),
    ),
    "cluster": (
        ("direct_*", BASELINE), ("apiserver_*_ms", LOWER), ("create_p50_difference_ms", LOWER),
        ("cluster_creates_per_s", HIGHER), ("creates_per_s_*", HIGHER),
        ("two_vs_one_apiserver_ratio", HIGHER), ("churn_errors", LOWER),
        ("node_loss_detect_s", LOWER), ("rounds", INFO), ("clients", INFO), ("window_s", INFO),
        ("setup_s", INFO),
    ),
    "build": (
        ("docker_*", BASELINE), ("builder_vs_docker_*", LOWER), ("builder_*", LOWER),
        ("variants", INFO),
    ),
    "layers": (
        ("workspace_erofs_bytes", LOWER), ("erofs_build_seconds_once", LOWER),
        ("erofs_ready_p50_s", LOWER), ("erofs_written_bytes", LOWER),
        ("tar_vs_erofs_time_ratio", HIGHER), ("tar_vs_erofs_write_ratio", HIGHER),
        ("ondemand_fetch_fraction", LOWER), ("eager_vs_ondemand_time_ratio", HIGHER),
        ("eager_vs_ondemand_write_ratio", HIGHER), ("eager_vs_ondemand_time_ratio_limited", HIGHER),
        ("ondemand_fetch_fraction_unprofiled", BASELINE), ("tar_*", BASELINE),
        ("workspace_tar_gz_bytes", BASELINE), ("sandboxes", INFO), ("workspace_files", INFO),
        ("workspace_bytes", INFO), ("source_mbps_limited", INFO), ("ablation_a*.*", INFO),
    ),
    "density": (
        ("max_idle_sandboxes", HIGHER), ("kill_per_s", HIGHER),
        ("host_kib_per_idle_sandbox", LOWER), ("daemon_*", LOWER), ("list_ms_at_max", LOWER),
        ("exec_p50_ms_at_max", LOWER), ("exec_ratio_max_vs_10", LOWER),
        ("create_ratio_max_vs_10", LOWER), ("create_p50_ms.*", LOWER), ("exec_p50_ms.*", LOWER),
        ("target", INFO),
    ),
    "fork": (
        ("fork_s", LOWER), ("fork_vs_replay_ratio", HIGHER), ("pack_diff_ms", LOWER),
        ("pack_diff_bytes", LOWER), ("restore8_s", LOWER), ("pause_*", LOWER),
        ("resume_*", LOWER), ("replay_s", BASELINE), ("setup_s", BASELINE), ("steps", INFO),
        ("step_iters", INFO), ("same_state_sandboxes", INFO),
    ),
    "fleet": (
        ("creates_per_s_per_apiserver", HIGHER), ("lost_creates", LOWER),
        ("best_of_k_max_over_mean", LOWER), ("best_of_k_max", LOWER),
        ("creates_per_s_*", HIGHER), ("create_p50_ms*", LOWER), ("create_p99_ms*", LOWER),
        ("apiserver_own_p50_ms*", LOWER), ("creates_per_apiserver_cpu_s*", HIGHER),
        ("scaling_*_vs_1", HIGHER), ("fleet_cpu_per_*", INFO), ("clients_cpu_per_*", INFO),
        ("apiserver_cores_used*", INFO), ("errors*", LOWER), ("loss_detect_*", LOWER),
        ("loss_creates_typed_errors", INFO), ("loss_creates_made", INFO),
        ("loss_creates_per_s", HIGHER), ("lost_creates_why", INFO), ("lost_nodes", INFO),
        ("apiserver_cpu_per_probe_us", LOWER), ("fleet_cpu_per_probe_us", INFO),
        ("probe_bytes", LOWER), ("probes_per_s", INFO), ("apiserver_idle_cpu_percent", LOWER),
        ("simulated_random", BASELINE), ("simulated_least_loaded_stale", BASELINE),
        ("simulated_best_of_k_ledger", LOWER), ("simulated_max_over_mean.*", INFO),
        ("placement_creates", INFO), ("setup_*", INFO), ("nodes", INFO), ("clients", INFO),
        ("create_latency_ms", INFO), ("cores", INFO), ("loadavg_at_start", INFO),
        ("quick", INFO),
    ),
    "soak": (
        ("lost", LOWER), ("untyped", LOWER), ("leaked", LOWER), ("orphans", LOWER),
        ("steps_twice", LOWER), ("steps_lost", LOWER), ("misattributed", LOWER),
        ("interrupted", INFO), ("rollouts_given_up_unmasked", LOWER), ("fault_kinds", HIGHER),
        ("creates_per_s_faults", HIGHER), ("creates_per_s_ratio", HIGHER),
        ("exec_p50_ms_faults", LOWER), ("creates_per_s_no_faults", BASELINE),
        ("exec_p50_ms_no_faults", BASELINE), ("drain_s", LOWER), ("faults", INFO),
        ("requests", INFO), ("rollouts_*", INFO), ("steps_checked", INFO), ("minutes", INFO),
        ("seed", INFO), ("quick", INFO), ("*_by_kind.*", INFO), ("masked_by_infra_kind.*", INFO),
        ("given_up_why.*", INFO), ("wrong_answers.*", LOWER),
    ),
    "api_memory": (("*.rss_*", LOWER), ("*.seconds", LOWER), ("*.bytes", INFO)),
    "egress": (
        ("create_p50_ms", BASELINE), ("connect_us", BASELINE), ("create_p50_ms_egress", LOWER),
        ("create_overhead_*", LOWER), ("connect_us_egress", LOWER),
        ("connect_overhead_ratio", LOWER),
    ),
    "gvisor": (("*.rounds", INFO), ("runc.*", BASELINE), ("runsc.*", LOWER)),
    "observe": (
        ("bare_us", BASELINE), ("observed_us", LOWER), ("observed_quiet_us", LOWER),
        ("overhead_us", LOWER), ("exec_p50_ms", LOWER), ("exec_mean_ms", LOWER),
    ),
    "qos": (
        ("*_unprotected*", BASELINE), ("*_alone", BASELINE), ("*sched_idle_only*", BASELINE),
        ("ls_inflation_be_idle*", LOWER), ("wait_p50_ms_be_idle", LOWER), ("cpus", INFO),
        ("rounds", INFO), ("steps_per_setting", INFO), ("host_cpu_pressure_pct", INFO),
    ),
    "security": (
        ("*_off", BASELINE), ("create_p50_ms_on", LOWER), ("exec_p50_ms_on", LOWER),
        ("*_ratio*", LOWER), ("rounds", INFO), ("execs", INFO),
    ),
}
# fmt: on


def direction(bench: str, figure: str, figures: dict[str, Any] | None = None) -> str | None:
    """Which way ``figure`` of ``bench`` is better: the bench's own ``directions`` first, then
    ``DIRECTIONS``; None when neither says."""
    own = (figures or {}).get("directions")
    if isinstance(own, dict) and own.get(figure) in DIRECTION_NAMES:
        return str(own[figure])
    for pattern, way in DIRECTIONS.get(bench, ()):
        if fnmatch.fnmatchcase(figure, pattern):
            return way
    return None


def numbers(figures: dict[str, Any]) -> dict[str, float]:
    """A run's figures as name -> number (nested ones ``outer.inner``; the bench's declared
    ``directions`` are not figures)."""
    return {n: v for n, v in leaves(figures) if not n.startswith("directions.")}


@dataclass(frozen=True)
class Row:
    figure: str
    last: float | None
    previous: float | None
    change: float | None  # relative, (last - previous) / |previous|
    noise: float
    direction: str | None
    verdict: str

    @property
    def flagged(self) -> bool:
        return self.verdict == "worse"


def relative_change(last: float, previous: float) -> float:
    if previous == 0:
        return 0.0 if last == 0 else math.copysign(math.inf, last)
    return (last - previous) / abs(previous)


def moved(change: float) -> float:
    """How far a figure moved, as a factor less one, the same up or down: a latency that
    doubled and a throughput that halved both moved 1.0 (a relative fall can never pass 100%,
    so a fall is read as the rise of the inverse, and a throughput's fall can be flagged)."""
    if change >= 0:
        return change
    return math.inf if change <= -1 else 1 / (1 + change) - 1


def verdict(way: str | None, change: float | None, noise: float, k: float = K) -> str:
    """``better``, ``worse`` (beyond k x noise, the wrong way), ``within noise``, or what a
    figure never judged is: ``no direction``, ``baseline`` or ``info``."""
    if change is None:
        return "n/a"
    if way is None:
        return "no direction"
    if way in (BASELINE, INFO):
        return way
    if moved(change) <= k * max(noise, NOISE_FLOOR):
        return "within noise"
    worse = change > 0 if way == LOWER else change < 0
    return "worse" if worse else "better"


def compare_figures(
    bench: str,
    last: dict[str, Any],
    previous: dict[str, Any] | None,
    noise: Callable[[str], float],
    k: float = K,
) -> list[Row]:
    """One row per figure of the last run (and per figure the previous had and it lacks)."""
    a = numbers(last)
    b = numbers(previous) if previous is not None else {}
    rows = []
    for name in [*a, *(n for n in b if n not in a)]:
        way = direction(bench, name, last)
        x, y = a.get(name), b.get(name)
        if x is None or y is None:
            v = "gone" if x is None else ("new" if previous is not None else "n/a")
            rows.append(Row(name, x, y, None, noise(name), way, v))
            continue
        ch = relative_change(x, y)
        rows.append(Row(name, x, y, ch, noise(name), way, verdict(way, ch, noise(name), k)))
    return rows


@dataclass(frozen=True)
class Comparison:
    """One bench: its last run, the run it is compared with (None: no earlier run on this
    machine in this mode), the rows, and where the noise came from."""

    bench: str
    last: Entry
    previous: Entry | None
    rows: list[Row]
    calibration: Entry | None
    others: int  # earlier runs of the bench not compared: another machine or mode

    @property
    def flagged(self) -> list[Row]:
        return [r for r in self.rows if r.flagged]

    @property
    def without_direction(self) -> list[str]:
        return [r.figure for r in self.rows if r.direction is None]


def noise_of(calibration: Entry | None) -> Callable[[str], float]:
    def noise(figure: str) -> float:
        if calibration is None or figure not in calibration.noise:
            return DEFAULT_NOISE
        return calibration.noise[figure]

    return noise


def comparable(a: Entry, b: Entry) -> bool:
    return a.quick == b.quick and a.machine.fingerprint == b.machine.fingerprint


def compare_bench(
    entries: Sequence[Entry], bench: str, against: str | None = None, k: float = K
) -> Comparison | None:
    """The newest run of ``bench`` against the newest ok run before it on the same machine in
    the same mode (or, with ``against``, the newest one of that commit)."""
    runs = [e for e in entries if e.bench == bench and e.kind == "run"]
    if not runs:
        return None
    last = runs[-1]
    earlier = [e for e in runs[:-1] if e.ok]
    if against:
        earlier = [e for e in runs if e.ok and e.commit.startswith(against) and e is not last]
    candidates = [e for e in earlier if comparable(e, last)]
    previous = candidates[-1] if candidates else None
    cals = [
        e for e in entries if e.bench == bench and e.kind == "calibration" and comparable(e, last)
    ]
    cal = cals[-1] if cals else None
    rows = (
        compare_figures(
            bench, last.figures, previous.figures if previous else None, noise_of(cal), k
        )
        if last.ok
        else []
    )
    return Comparison(bench, last, previous, rows, cal, len(earlier) - len(candidates))


def compare_all(
    entries: Sequence[Entry],
    benches: Iterable[str] | None = None,
    against: str | None = None,
    k: float = K,
) -> list[Comparison]:
    names = list(dict.fromkeys(e.bench for e in entries)) if benches is None else benches
    out = [compare_bench(entries, bench_name(b), against, k) for b in names]
    return [c for c in out if c is not None]


def summary(comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """The last line: what was flagged, what failed, what lacks a calibration or a direction."""

    def num(v: float | None) -> float | None:
        return None if v is None or not math.isfinite(v) else round(v, 4)

    return {
        "compared": [c.bench for c in comparisons],
        "flagged": [
            {
                "bench": c.bench,
                "figure": r.figure,
                "last": r.last,
                "previous": r.previous,
                "change": num(r.change),
                "noise": num(r.noise),
                "direction": r.direction,
            }
            for c in comparisons
            for r in c.flagged
        ],
        "failed": [c.bench for c in comparisons if not c.last.ok],
        "uncalibrated": [c.bench for c in comparisons if c.calibration is None],
        "without_direction": {
            c.bench: c.without_direction for c in comparisons if c.without_direction
        },
    }


# --- printing ---------------------------------------------------------------------------------


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.1f}"


def pct(v: float | None) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return "inf"
    return f"{100 * v:+.1f}%"


STYLE = {"worse": "bold red", "better": "green", "within noise": "", "no direction": "yellow"}


def describe(e: Entry) -> str:
    dirty = "+dirty" if e.dirty else ""
    return f"{e.commit[:10]}{dirty} {e.time} (load {e.load[0]:g})"


def render(c: Comparison, console: Console, show_all: bool = False) -> None:
    head = f"{c.bench} ({'--quick' if c.last.quick else 'full run'})"
    if not c.last.ok:
        console.print(f"[bold red]{head}: FAILED[/] at {describe(c.last)}: {c.last.error}")
        return
    if c.calibration is None:
        how = f"no calibration on this machine in this mode: default noise {DEFAULT_NOISE:.0%}"
    else:
        cal = c.calibration
        how = (
            f"noise from {cal.runs} runs at {cal.commit[:10]}, {cal.time[:10]} "
            f"(load {cal.load[0]:g} to {cal.load[1]:g})"
        )
    against = f"against {describe(c.previous)}" if c.previous else "nothing to compare with"
    if c.others:
        against += f"; {c.others} earlier run(s) on another machine or mode not compared"
    console.print(f"[bold]{head}[/]: {describe(c.last)}, {against}; {how}")
    table = Table()
    for col in ("figure", "last", "previous", "change", "noise", "verdict"):
        table.add_column(col, justify="left" if col in ("figure", "verdict") else "right")
    differ = []
    for r in c.rows:
        if r.direction == INFO and not show_all:
            if r.last != r.previous and r.previous is not None:
                differ.append(f"{r.figure} {fmt(r.previous)} -> {fmt(r.last)}")
            continue
        style = STYLE.get(r.verdict, "dim")
        shown = "WORSE beyond noise" if r.verdict == "worse" else r.verdict
        table.add_row(
            r.figure,
            fmt(r.last),
            fmt(r.previous),
            pct(r.change),
            f"{100 * max(r.noise, NOISE_FLOOR):.1f}%",
            shown,
            style=style,
        )
    console.print(table)
    if differ:
        console.print(f"  the runs differ in {', '.join(differ)}: not the same measurement")
    if c.without_direction:
        console.print(
            f"  [yellow]no declared direction (shown, never flagged):[/] "
            f"{', '.join(c.without_direction)}"
        )


# --- the README block -------------------------------------------------------------------------

BEGIN, END = "<!-- ledger:begin -->", "<!-- ledger:end -->"


@dataclass(frozen=True)
class ReadmeRow:
    """One row of the README's table: ``label`` and the two cells made from one bench's newest
    run (``dsec`` and ``baseline`` get its figures; None when they are missing)."""

    bench: str
    label: Callable[[Entry], str]
    dsec: Callable[[dict[str, Any]], str]
    baseline: Callable[[dict[str, Any]], str]


def _n(v: Any, unit: str = "") -> str:
    if not isinstance(v, (int, float)):
        return "?"
    text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return f"{text} {unit}".strip()


README_ROWS: tuple[ReadmeRow, ...] = (
    ReadmeRow(
        "create",
        lambda e: "create → first exec → kill, p50",
        lambda f: _n(f.get("dsec_p50_ms"), "ms"),
        lambda f: f"`docker run`: {_n(f.get('docker_p50_ms'), 'ms')}",
    ),
    ReadmeRow(
        "create",
        lambda e: "sandboxes created per second, concurrency 8",
        lambda f: _n(f.get("dsec_per_s_c8"), "/s"),
        lambda f: f"`docker run`: {_n(f.get('docker_per_s_c8'), '/s')}",
    ),
    ReadmeRow(
        "fncall",
        lambda e: "one short call (`true`) in a warm pool member, p50",
        lambda f: _n(f.get("fncall_p50_ms"), "ms"),
        lambda f: f"`docker exec`: {_n(f.get('docker_exec_p50_ms'), 'ms')}",
    ),
    ReadmeRow(
        "density",
        lambda e: f"idle sandboxes one {round(e.machine.memory_mib / 1024)} GiB node holds",
        lambda f: (
            f"{_n(f.get('max_idle_sandboxes'))} "
            f"({_n(f.get('host_kib_per_idle_sandbox'), 'KiB')} each"
            + (
                "; the run asked for no more)"
                if f.get("max_idle_sandboxes") == f.get("target")
                else ")"
            )
        ),
        lambda f: "",
    ),
    ReadmeRow(
        "fork",
        lambda e: (
            f"forking 8 sandboxes at step {e.figures.get('steps', '?')} against replaying "
            f"{e.figures.get('steps', '?')} steps"
        ),
        lambda f: _n(f.get("fork_s"), "s"),
        lambda f: _n(f.get("replay_s"), "s"),
    ),
)


def readme_source(entries: Sequence[Entry], bench: str) -> Entry | None:
    """The entry the README quotes for ``bench``: its newest ok full run or calibration, else its
    newest ok quick one (a full run's figures are the ones to quote; a quick one stands in until
    there is one). A calibration, written after its runs, quotes their medians."""
    ok = [e for e in entries if e.bench == bench and e.ok]
    full = [e for e in ok if not e.quick]
    if full or ok:
        return (full or ok)[-1]
    return None


def readme_block(entries: Sequence[Entry]) -> str:
    """The README's table of figures, made from the ledger alone."""
    lines = ["| | dsec | baseline |", "|---|---|---|"]
    used: dict[str, Entry] = {}
    for row in README_ROWS:
        e = readme_source(entries, row.bench)
        if e is None:
            lines.append(f"| {row.bench}: no run in the ledger yet | | |")
            continue
        used[row.bench] = e
        lines.append(f"| {row.label(e)} | {row.dsec(e.figures)} | {row.baseline(e.figures)} |")
    sources = "; ".join(
        f"`bench/{b}.py{' --quick' if e.quick else ''}`"
        f"{f' (median of {e.runs} runs)' if e.kind == 'calibration' else ''} at {e.commit[:7]}"
        f"{'+dirty' if e.dirty else ''}, {e.time[:10]}, load {e.load[0]:g}"
        f" on {e.machine.cores} cores"
        for b, e in used.items()
    )
    lines += ["", f"From `bench/results/ledger.jsonl` (`bench/compare.py --readme`): {sources}."]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between the ledger markers replaced by ``block``."""
    m = re.search(re.escape(BEGIN) + r"\n.*?" + re.escape(END), text, re.S)
    if m is None:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[: m.start()] + f"{BEGIN}\n{block}\n{END}" + text[m.end() :]


README = REPO / "README.md"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("benches", nargs="*", help="only these (default: every bench in the ledger)")
    ap.add_argument("--ledger", type=Path, default=LEDGER, help="default: %(default)s")
    ap.add_argument("--against", metavar="COMMIT", help="compare with that commit's newest run")
    ap.add_argument("--all", action="store_true", help="also show the runs' info figures")
    ap.add_argument(
        "--fail-on-regression",
        action="store_true",
        help="exit 1 when a figure is flagged or a bench's last run failed",
    )
    ap.add_argument("--calibrate", metavar="BENCH", help="run BENCH --runs times, record noise")
    ap.add_argument("--runs", type=int, default=5, help="runs of a calibration (default 5)")
    ap.add_argument("--readme", action="store_true", help="rewrite README.md's ledger block")
    ap.add_argument(
        "--check-readme",
        action="store_true",
        help="exit 1 when README.md's ledger block is not the ledger's",
    )
    args, rest = ap.parse_known_args(argv)
    extra = rest[1:] if rest[:1] == ["--"] else rest
    if extra and not args.calibrate:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.calibrate:
        if args.runs < 2:
            ap.error("a calibration needs at least 2 runs")
        bench_args = extra or ["--quick"]
        cal, _ = calibrate(bench_script(args.calibrate), bench_args, args.runs, args.ledger)
        args.benches = [cal.bench]
    entries = read(args.ledger)
    if args.readme or args.check_readme:
        text = README.read_text()
        new = replace_block(text, readme_block(entries))
        if args.check_readme:
            if new != text:
                print("README.md's ledger block differs from the ledger: bench/compare.py --readme")
                return 1
            return 0
        README.write_text(new)
        print(f"README.md: the ledger block rewritten from {len(entries)} entries")
        return 0
    comparisons = compare_all(entries, args.benches or None, args.against)
    console = Console(width=max(100, Console().width))
    for c in comparisons:
        render(c, console, args.all)
    if not comparisons:
        console.print(f"nothing to compare: no runs in {args.ledger}")
    s = summary(comparisons)
    console.print(
        f"{len(s['flagged'])} figure(s) worse beyond K={K:g} x noise, "
        f"{len(s['failed'])} bench(es) failed"
    )
    print(json.dumps(s))
    return 1 if args.fail_on_regression and (s["flagged"] or s["failed"]) else 0


if __name__ == "__main__":
    sys.exit(main())
