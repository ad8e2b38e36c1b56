#!/usr/bin/env python3
"""FnCall against its alternatives, in one run, on the same busybox base image: a call in a warm
pool member (``client.fncall``), ``docker exec`` into a running container, and a fresh dsec
sandbox per call (create -> exec -> kill).

Two tasks: ``true``, and a small judge task (an awk FizzBuzz over 1..300 from stdin, its
output checked against the expected digest inside the call, exit 0 when accepted). Each at
concurrency 1 and 8: per-call p50/p99 and calls per second. docker runs in a dockerd this script
starts if none runs (no bridge, no iptables: its containers have no network, like the
sandboxes), on the image imported from the same EROFS layer (``bench/create.py``'s helper).

    python bench/fncall.py [--quick]

--quick takes under a minute. The last line printed is one JSON object with ``fncall_p50_ms``
(``true`` at concurrency 1), ``fncall_per_s_c8``, ``docker_exec_per_s_c8`` and
``ratio_vs_docker_exec_c8`` (both for ``true``); targets ``fncall_p50_ms`` <= 10 and the
ratio >= 10.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dsec
from dsec_core.catalog.model import Catalog, Environment
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.layers.store import LayerStore
from dsec_core.localnode import ensure_daemon, stop_daemon
from dsec_core.testing import build_busybox_layer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from create import Docker, docker_daemon, pct
from figures import add_plot_flag, bars, figure

ENV = "bench-fncall"
MEMORY = "64M"
FIZZ_N = 300
FIZZBUZZ = (
    '{ s = ""; if ($1 % 3 == 0) s = "Fizz"; if ($1 % 5 == 0) s = s "Buzz"; '
    'print (s == "" ? $1 : s) }'
)


def fizzbuzz(n: int) -> str:
    """What a right FizzBuzz prints for 1..n."""
    out = []
    for i in range(1, n + 1):
        s = ("Fizz" if i % 3 == 0 else "") + ("Buzz" if i % 5 == 0 else "")
        out.append(s or str(i))
    return "\n".join(out) + "\n"


def expected_digest() -> str:
    return hashlib.md5(fizzbuzz(FIZZ_N).encode()).hexdigest()


#: The judge task: run the submission on the input, compare the output's digest.
JUDGE = (
    f"""awk '{FIZZBUZZ}' > /tmp/out && test "$(md5sum < /tmp/out)" = "{expected_digest()}  -" """
)
JUDGE_STDIN = "".join(f"{i}\n" for i in range(1, FIZZ_N + 1)).encode()
TASKS = {"true": (["true"], None), "judge": (JUDGE, JUDGE_STDIN)}
WAYS = ("fncall", "docker exec", "fresh")


async def rounds(
    one: Callable[[], Awaitable[None]], n: int, conc: int
) -> tuple[list[float], float]:
    """``n`` calls of ``one``, ``conc`` at a time: latencies and calls per second."""
    lat: list[float] = []
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t = time.perf_counter()
            await one()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return lat, n / (time.perf_counter() - t0)


def docker_rounds(docker: Docker, cid: str, task: str, n: int, conc: int):
    cmd, stdin = TASKS[task]
    argv = [
        "exec",
        *(["-i"] if stdin else []),
        cid,
        *(["sh", "-c", cmd] if task != "true" else cmd),
    ]

    def one(_: int) -> float:
        t = time.perf_counter()
        r = docker.run(*argv, input=stdin)
        if r.returncode != 0:
            raise SystemExit(f"bench: docker exec failed: {r.stderr.decode()}")
        return time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        lat = list(pool.map(one, range(n)))
    return lat, n / (time.perf_counter() - t0)


async def dsec_side(address: str, layer: str, n_fn: int, n_fresh: int) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    async with dsec.AsyncClient(address) as client:
        for task, (cmd, stdin) in TASKS.items():

            async def fn(cmd=cmd, stdin=stdin) -> None:
                r = await client.fncall(ENV, cmd, stdin=stdin, memory=MEMORY, timeout=30)
                if not r.ok:
                    raise SystemExit(f"bench: fncall failed: {r}")

            async def fresh(cmd=cmd, stdin=stdin) -> None:
                sb = await client.create(layers=(layer,), memory=MEMORY, ttl=300)
                try:
                    (await sb.exec(cmd, stdin=stdin, timeout=30)).check()
                finally:
                    await sb.kill()

            await rounds(fn, 64, 8)  # warm: the pool grows to 8 members
            for conc in (1, 8):
                out[f"fncall {task} c{conc}"] = await rounds(fn, n_fn, conc)
            await rounds(fresh, 2, 1)
            for conc in (1, 8):
                out[f"fresh {task} c{conc}"] = await rounds(fresh, n_fresh, conc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls (under a minute)")
    add_plot_flag(ap)
    args = ap.parse_args()
    n_fn, n_fresh, n_docker = (300, 24, 32) if args.quick else (2000, 100, 160)

    home = Path(tempfile.mkdtemp(prefix="dsec-bench-fncall-", dir="/var/tmp"))
    config = NodeConfig(home=home)
    config.ensure_dirs()
    store = LayerStore(config.layer_dir)
    info = build_busybox_layer(store, name="bench-busybox")
    keep = Path(tempfile.mkdtemp(prefix="dsec-bench-fncall-img-", dir="/var/tmp"))
    image = keep / "base.erofs"  # for docker, after the node and its home are gone
    shutil.copyfile(store.image_path(info), image)
    CatalogStore(config.catalog_dir).save(
        Catalog(name=ENV, environments=(Environment(name=ENV, base=info.ref),))
    )
    os.environ["DSEC_HOME"] = os.fspath(home)
    os.environ.setdefault("DSEC_FNCALL_POOL_MAX", "8")
    ensure_daemon(config)
    try:
        res = asyncio.run(dsec_side(os.fspath(config.socket_path), info.ref, n_fn, n_fresh))
    finally:
        stop_daemon(config)
        shutil.rmtree(home, ignore_errors=True)

    # docker after dsec: dockerd's start and stop leave the kernel busy for a while after
    tag = "dsec-bench-fncall:busybox"
    cid = ""
    try:
        with docker_daemon() as docker:
            try:
                docker.import_layer(image, tag)
                run = docker.run("run", "-d", "--network", "none", tag, "sleep", "100000")
                cid = run.stdout.decode().strip()
                if run.returncode != 0 or not cid:
                    raise SystemExit(f"bench: docker run failed: {run.stderr.decode()}")
                docker_rounds(docker, cid, "true", 4, 1)  # warm
                for task in TASKS:
                    for conc in (1, 8):
                        res[f"docker exec {task} c{conc}"] = docker_rounds(
                            docker, cid, task, n_docker if conc == 8 else n_docker // 2, conc
                        )
            finally:
                if cid:
                    docker.run("rm", "-f", cid)
    finally:  # the image copy goes whatever happened, docker missing included
        shutil.rmtree(keep, ignore_errors=True)

    def ms(v: float) -> float:
        return round(1e3 * v, 2)

    print(f"{'':<22}{'p50 ms':>10}{'p99 ms':>10}{'calls/s':>10}")
    for task in TASKS:
        for conc in (1, 8):
            for way in ("fncall", "docker exec", "fresh"):
                lat, rate = res[f"{way} {task} c{conc}"]
                name = f"{way} {task} c{conc}"
                print(
                    f"{name:<22}{ms(statistics.median(lat)):>10}{ms(pct(lat, 99)):>10}{rate:>10.1f}"
                )
    fn1, _ = res["fncall true c1"]
    _, fn8 = res["fncall true c8"]
    _, dk8 = res["docker exec true c8"]
    _, fr8 = res["fresh true c8"]
    _, jfn8 = res["fncall judge c8"]
    _, jdk8 = res["docker exec judge c8"]
    fig = {
        "quick": args.quick,
        "fncall_p50_ms": ms(statistics.median(fn1)),
        "fncall_p99_ms": ms(pct(fn1, 99)),
        "fncall_per_s_c8": round(fn8, 1),
        "docker_exec_per_s_c8": round(dk8, 1),
        "docker_exec_p50_ms": ms(statistics.median(res["docker exec true c1"][0])),
        "fresh_sandbox_per_s_c8": round(fr8, 1),
        "ratio_vs_docker_exec_c8": round(fn8 / dk8, 2),
        "ratio_vs_fresh_c8": round(fn8 / fr8, 2),
        "judge_fncall_p50_ms": ms(statistics.median(res["fncall judge c1"][0])),
        "judge_fncall_per_s_c8": round(jfn8, 1),
        "judge_docker_exec_per_s_c8": round(jdk8, 1),
        "judge_ratio_vs_docker_exec_c8": round(jfn8 / jdk8, 2),
    }
    print("targets: fncall_p50_ms <= 10, ratio_vs_docker_exec_c8 >= 10")
    if args.plot:
        plot(res, args.quick)
    print(json.dumps(fig))


def plot(res: dict[str, tuple[list[float], float]], quick: bool) -> None:
    title = "One short call: FnCall's warm member, docker exec, a fresh sandbox (busybox)"
    with figure("fncall", title, quick, ncols=2, width=5.2) as (_, (lat, rate)):
        labels = [f"{'dsec fncall' if w == 'fncall' else w} {t}" for t in TASKS for w in WAYS]
        labels = [lb.replace("fresh", "dsec fresh sandbox") for lb in labels]
        p50 = [1e3 * statistics.median(res[f"{w} {t} c1"][0]) for t in TASKS for w in WAYS]
        bars(lat, labels, p50, unit="p50 ms, concurrency 1", log=True)
        per_s = [res[f"{w} {t} c8"][1] for t in TASKS for w in WAYS]
        bars(rate, labels, per_s, unit="calls/s, concurrency 8", log=True)


if __name__ == "__main__":
    main()
