#!/usr/bin/env python3
"""Forking a trajectory at step k against replaying its k steps, and pause/resume latency, in
one run on a busybox image.

The environment's setup is k expensive steps, like a build: step i generates a file with an
awk loop seeded by step i-1's checksum, then checksums it (``sha256sum``), so each step needs
the one before. The loop's length is calibrated in the sandbox so a step takes ``--step-s``
seconds alone (k=5 steps of 1.2 s: 6 s; --quick: k=3 steps of 0.4 s, 1.2 s, said so in the
output). One sandbox of a rollout group runs the k steps; then, from that step-k state:

- ``fork``: ``pack_diff`` it, restore 8 members from the snapshot (``group.fork``), until all
  8 answer an exec; repeated, medians;
- ``replay``: 8 fresh sandboxes, created at once, each running the k steps, the 8 concurrently
  (as a trainer would start its rollouts); once, it is the expensive one.

All 16 (and the source) must end with the same final checksum. Then pause and resume through
the SDK, p50 and p99 over rounds, of an idle sandbox and of a busy one (a shell loop on its
CPU).

    python bench/fork.py [--quick]

--quick takes under a minute. Everything it makes (sandboxes, the node daemon, its temporary
DSEC_HOME) is removed at the end, on Ctrl-C and on SIGTERM too. The last line printed is one
JSON object: ``fork_s``, ``replay_s``, ``fork_vs_replay_ratio``, ``pack_diff_ms``,
``pack_diff_bytes``, ``restore8_s``, ``pause_ms``/``resume_ms`` (idle, p50), and p50/p99 of
``pause_idle``, ``resume_idle``, ``pause_busy`` and ``resume_busy`` in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dsec
from dsec_core.config import NodeConfig
from dsec_core.layers.store import LayerStore
from dsec_core.localnode import daemon_pid, ensure_daemon, stop_daemon
from dsec_core.testing import build_busybox_layer, leftovers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from create import pct

N = 8  # forks, and fresh sandboxes replaying
SPEC: dict[str, Any] = dict(memory="128M", cpu=1.0, ttl=900)
PROBE_ITERS = 200_000
# One step: an awk loop seeded by the last step's checksum writes a file, which is checksummed.
STEP = (
    "mkdir -p {dir} && cd {dir} && prev=$(cat step{prev}.sum 2>/dev/null || echo seed) && "
    'awk -v s="$prev" -v n={iters} \'BEGIN {{ h = length(s); '
    'for (j = 0; j < n; j++) {{ h = (h * 31 + j) % 1000003; if (j % 8 == 0) printf "%s %d %d\\n", '
    "substr(s, 1, 16), j, h }} }}' > step{i}.dat && "
    "sha256sum step{i}.dat | cut -d' ' -f1 > step{i}.sum && cat step{i}.sum"
)
BUSY = "while :; do :; done >/dev/null 2>&1 &"


def step_cmd(i: int, iters: int, where: str = "/build") -> list[str]:
    return ["sh", "-c", STEP.format(dir=where, prev=i - 1, i=i, iters=iters)]


@dataclass(frozen=True)
class Figures:
    """What the fork and replay part measured, in seconds (``snapshot_bytes`` in bytes)."""

    step_times: list[float]
    snapshot_bytes: int
    pack: list[float]
    restore: list[float]
    fork: list[float]
    replay: float
    same_state: int  # sandboxes seen with the step-k checksum, the source included


async def timed(coro: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = await coro
    return time.perf_counter() - t, out


async def run_steps(sb: dsec.AsyncSandbox, k: int, iters: int) -> list[float]:
    times = []
    for i in range(1, k + 1):
        took, r = await timed(sb.exec(step_cmd(i, iters), timeout=600))
        r.check()
        times.append(took)
    return times


async def final_sum(sb: dsec.AsyncSandbox, k: int) -> str:
    """The last step's file checksummed again now, and the checksum the step wrote: the same."""
    r = await sb.exec(["sh", "-c", f"sha256sum /build/step{k}.dat; cat /build/step{k}.sum"])
    r.check()
    now, _, saved = r.stdout.decode().split()
    if now != saved:
        raise SystemExit(f"bench: {sb.id}: step {k}'s file does not match its checksum")
    return now


async def calibrate(client: dsec.AsyncClient, layer: str, step_s: float) -> int:
    """Loop iterations for one step to take ``step_s`` seconds in a sandbox of its own."""
    sb = await client.create(layers=(layer,), **SPEC)
    try:
        took = []
        for _ in range(3):
            t, r = await timed(sb.exec(step_cmd(1, PROBE_ITERS, "/probe"), timeout=120))
            r.check()
            took.append(t)
        return max(1000, round(PROBE_ITERS * step_s / min(took)))
    finally:
        await sb.kill()


async def fork_and_replay(
    client: dsec.AsyncClient, layer: str, k: int, iters: int, repeats: int
) -> Figures:
    group = client.group("bench-fork")
    (source,) = await group.create(layers=(layer,), **SPEC)
    step_times = await run_steps(source, k, iters)
    want = await final_sum(source, k)
    pack, restore, fork = [], [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        snap = await client.pack_diff(source.id, name=f"bench-fork-{r}")
        t1 = time.perf_counter()
        kids = await group.fork(snapshot=snap, n=N, **SPEC)
        await asyncio.gather(*(k_.exec(["true"]) for k_ in kids))
        t2 = time.perf_counter()
        pack.append(t1 - t0)
        restore.append(t2 - t1)
        fork.append(t2 - t0)
        sums = await asyncio.gather(*(final_sum(k_, k) for k_ in kids))
        if set(sums) != {want}:
            raise SystemExit(f"bench: a fork does not see the step-{k} state: {sums} != {want}")
        # each has its own writable layer: a write in one is not seen by a sibling
        await kids[0].exec(["sh", "-c", f"echo other > /build/step{k}.sum"])
        if await final_sum(kids[1], k) != want:
            raise SystemExit("bench: a fork's write showed in its sibling")
        await asyncio.gather(*(k_.kill() for k_ in kids))

    t0 = time.perf_counter()
    fresh = await client.create_many(layers=(layer,), n=N, **SPEC)
    try:
        await asyncio.gather(*(run_steps(sb, k, iters) for sb in fresh))
        replay = time.perf_counter() - t0
        sums = await asyncio.gather(*(final_sum(sb, k) for sb in fresh))
        if set(sums) != {want}:
            raise SystemExit(f"bench: a replay ended elsewhere: {sums} != {want}")
    finally:
        await asyncio.gather(*(sb.kill() for sb in fresh), return_exceptions=True)
        await group.kill()
    return Figures(step_times, snap.size, pack, restore, fork, replay, 1 + N * repeats + N)


def pause_rounds(client: dsec.Client, sid: str, rounds: int) -> tuple[list[float], list[float]]:
    paused, resumed = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if client.pause(sid).state != "paused":
            raise SystemExit(f"bench: {sid} did not pause")
        t1 = time.perf_counter()
        if client.resume(sid).state != "running":
            raise SystemExit(f"bench: {sid} did not resume")
        t2 = time.perf_counter()
        paused.append(t1 - t0)
        resumed.append(t2 - t1)
        time.sleep(0.02)  # let the loop run between rounds
    return paused, resumed


def pause_resume(address: str, layer: str, rounds: int) -> dict[str, tuple[list, list]]:
    out = {}
    with dsec.Client(address) as client:
        with client.create(layers=(layer,), **SPEC) as idle:
            idle.exec(["true"])
            pause_rounds(client, idle.id, 3)  # warm
            out["idle"] = pause_rounds(client, idle.id, rounds)
        with client.create(layers=(layer,), **SPEC) as busy:
            busy.exec(["sh", "-c", BUSY], background=True)
            before = client.usage(busy.id).cpu_seconds or 0.0
            pause_rounds(client, busy.id, 3)
            out["busy"] = pause_rounds(client, busy.id, rounds)
            time.sleep(0.3)
            spun = (client.usage(busy.id).cpu_seconds or 0.0) - before
            if spun < 0.2:  # it should have had most of a core between and after the rounds
                raise SystemExit(f"bench: the busy sandbox used only {spun:.2f} s of CPU")
    return out


def teardown(config: NodeConfig, home: Path) -> None:
    """Kill every sandbox of the run's node, stop it, and remove its home."""
    try:
        if daemon_pid(config) is not None:
            with dsec.Client(os.fspath(config.socket_path), retry=5) as client:
                for info in client.list():
                    try:
                        client.kill(info.id)
                    except dsec.DsecError:
                        pass
            stop_daemon(config)
        left = leftovers(home)
        if any(left.values()):
            print(f"bench: the node left things behind: {left}", file=sys.stderr)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 shorter steps, fewer rounds (< 1 min)")
    ap.add_argument("--steps", type=int, default=None, help="k (default 5; 3 with --quick)")
    ap.add_argument("--step-s", type=float, default=None, help="seconds a step takes alone")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root")
    k = args.steps or (3 if args.quick else 5)
    step_s = args.step_s or (0.4 if args.quick else 1.2)
    repeats, rounds = (3, 20) if args.quick else (5, 100)

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up as on Ctrl-C
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-fork-", dir="/var/tmp"))
    config = NodeConfig(home=home)
    try:
        config.ensure_dirs()
        layer = build_busybox_layer(LayerStore(config.layer_dir), name="bench-busybox").ref
        os.environ["DSEC_HOME"] = os.fspath(home)
        ensure_daemon(config)
        address = os.fspath(config.socket_path)

        async def measure() -> tuple[int, Figures]:
            async with dsec.AsyncClient(address) as client:
                iters = await calibrate(client, layer, step_s)
                return iters, await fork_and_replay(client, layer, k, iters, repeats)

        iters, res = asyncio.run(measure())
        pr = pause_resume(address, layer, rounds)
    finally:
        teardown(config, home)

    med = statistics.median
    ms = lambda v: round(1e3 * v, 2)  # noqa: E731
    steps = res.step_times
    fork_s, replay_s = med(res.fork), res.replay
    fig: dict[str, object] = {
        "quick": args.quick,
        "steps": k,
        "step_iters": iters,
        "setup_s": round(sum(steps), 2),
        "fork_s": round(fork_s, 3),
        "replay_s": round(replay_s, 2),
        "fork_vs_replay_ratio": round(replay_s / fork_s, 1),
        "pack_diff_ms": ms(med(res.pack)),
        "pack_diff_bytes": res.snapshot_bytes,
        "restore8_s": round(med(res.restore), 3),
        "same_state_sandboxes": res.same_state,
    }
    for kind in ("idle", "busy"):
        paused, resumed = pr[kind]
        for what, values in (("pause", paused), ("resume", resumed)):
            fig[f"{what}_{kind}_ms_p50"] = ms(med(values))
            fig[f"{what}_{kind}_ms_p99"] = ms(pct(values, 99))
    fig["pause_ms"] = fig["pause_idle_ms_p50"]
    fig["resume_ms"] = fig["resume_idle_ms_p50"]

    mode = "--quick: fewer and shorter steps than the full run" if args.quick else "full run"
    print(
        f"\n{mode}: k={k} steps of {iters} awk iterations + sha256sum each; one sandbox "
        f"alone took {' + '.join(f'{t:.2f}' for t in steps)} = {sum(steps):.2f} s\n"
    )
    rows = [
        (f"pack_diff at step k (p50 of {repeats})", f"{fig['pack_diff_ms']} ms"),
        ("snapshot size", f"{res.snapshot_bytes / 1e6:.2f} MB"),
        (f"restore {N} until all answer (p50)", f"{fig['restore8_s']} s"),
        (f"fork {N}: pack + restore + answer (p50)", f"{fig['fork_s']} s"),
        (f"replay {N}: create + k steps, concurrent", f"{fig['replay_s']} s"),
        ("fork_vs_replay_ratio (target >= 10)", f"{fig['fork_vs_replay_ratio']}x"),
    ]
    for kind in ("idle", "busy"):
        for what in ("pause", "resume"):
            p50, p99 = fig[f"{what}_{kind}_ms_p50"], fig[f"{what}_{kind}_ms_p99"]
            rows.append((f"{what} {kind} (p50 / p99 of {rounds})", f"{p50} / {p99} ms"))
    for name, value in rows:
        print(f"  {name:44} {value:>18}")
    if sum(steps) < 5 and not args.quick:
        print("\nnote: the setup took under 5 s (calibrated on a busier CPU); raise --step-s")
    print(
        f"\nsame final checksum in the source, {N * repeats} forks and {N} replays; "
        "targets: fork_vs_replay_ratio >= 10, idle pause and resume <= 50 ms (SDK round trip)\n"
    )
    print(json.dumps(fig))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
