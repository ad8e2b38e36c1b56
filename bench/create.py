#!/usr/bin/env python3
"""Sandbox creation and exec latency: dsec against docker, on the same base image, in one run.

dsec: create -> first exec (`true`) -> kill, through the SDK and the node daemon.
docker: `docker run --rm --network none IMAGE true`, the image imported from the same EROFS
base layer into a dockerd this script starts if none runs. Both at concurrency 1 and 8.
Then exec of `true` in a running sandbox against `docker exec`.

Warm claims: the node is told to keep sandboxes of the bench's shape warm (``set_warm``), and
creates of that shape claim them; their create latency (the create call alone, against the
cold create call alone in the rounds above) at concurrency 1 and their creates/s at
concurrency 8 from full pools (the members claimed are killed after each phase, untimed).

    python bench/create.py [--quick] [--image debian-python@12-2]

--quick uses a busybox base layer (built on the fly) and fewer rounds; it takes under a minute.
The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from figures import COLOURS, add_plot_flag, bars, figure, log_scale

import dsec
from dsec_core.catalog import default_catalog_file
from dsec_core.config import NodeConfig
from dsec_core.demo import ensure_catalog
from dsec_core.errors import ToolError
from dsec_core.layers.store import LayerStore
from dsec_core.linux.mounts import mount_erofs_file, unmount
from dsec_core.localnode import daemon_pid, ensure_daemon, stop_daemon
from dsec_core.testing import build_busybox_layer, private_dockerd


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


# --- docker side ------------------------------------------------------------------------------


class Docker:
    """A docker CLI bound to one daemon (``host``; None: the CLI's default one)."""

    def __init__(self, cli: str, host: str | None) -> None:
        self.cli, self.host = cli, host

    def argv(self, *args: str) -> list[str]:
        return [self.cli, *(["-H", self.host] if self.host else []), *args]

    def run(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), capture_output=True, input=input)

    def works(self) -> bool:
        return self.run("version", "--format", "{{.Server.Version}}").returncode == 0

    def import_layer(self, image: Path, tag: str) -> None:
        if self.run("image", "inspect", tag).returncode == 0:
            return
        with tempfile.TemporaryDirectory() as mnt:
            mount_erofs_file(image, Path(mnt), None)
            try:
                tar = subprocess.Popen(["tar", "-C", mnt, "-c", "."], stdout=subprocess.PIPE)
                imp = subprocess.run(
                    self.argv("import", "-", tag), stdin=tar.stdout, capture_output=True
                )
                tar.wait()
            finally:
                unmount(mnt)
        if imp.returncode != 0:
            raise SystemExit(f"bench: docker import failed: {imp.stderr.decode()}")


@contextlib.contextmanager
def docker_daemon() -> Iterator[Docker]:
    """The machine's dockerd if one answers, else a private one started here (the kit's
    ``private_dockerd``: no bridge and no iptables, so the benchmark's containers get no
    network at all), stopped and removed at the end."""
    cli = shutil.which("docker", path="/usr/bin") or shutil.which("docker")
    if not cli or not shutil.which("dockerd"):
        raise SystemExit("bench: docker.io is not installed (apt-get install docker.io)")
    if Docker(cli, None).works():
        yield Docker(cli, None)
        return
    with contextlib.ExitStack() as stack:
        try:
            private = stack.enter_context(private_dockerd())
        except ToolError as e:
            raise SystemExit(f"bench: {e}") from e
        yield Docker(cli, private.host)


def docker_run_once(docker: Docker, tag: str) -> float:
    t = time.perf_counter()
    r = docker.run("run", "--rm", "--network", "none", tag, "true")
    if r.returncode != 0:
        raise SystemExit(f"bench: docker run failed: {r.stderr.decode()}")
    return time.perf_counter() - t


def docker_rounds(docker: Docker, tag: str, n: int, conc: int) -> tuple[list[float], float]:
    t = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        lat = list(pool.map(lambda _: docker_run_once(docker, tag), range(n)))
    return lat, n / (time.perf_counter() - t)


def docker_exec(docker: Docker, tag: str, n: int) -> list[float]:
    cid = (
        docker.run("run", "-d", "--network", "none", tag, "sleep", "100000").stdout.decode().strip()
    )
    try:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            docker.run("exec", cid, "true")
            lat.append(time.perf_counter() - t)
        return lat
    finally:
        docker.run("rm", "-f", cid)


# --- dsec side --------------------------------------------------------------------------------


#: The create call alone of each cold round (dsec_once), beside the claims' (dsec_warm).
COLD_CREATES: list[float] = []


async def dsec_once(client: dsec.AsyncClient, layer: str) -> float:
    t = time.perf_counter()
    sb = await client.create(layers=(layer,), ttl=120, **WARM_SHAPE)  # type: ignore[arg-type]
    COLD_CREATES.append(time.perf_counter() - t)
    try:
        r = await sb.exec(["true"])
        if r.exit_code != 0:
            raise SystemExit(f"bench: exec in sandbox failed: {r.stderr!r}")
    finally:
        await sb.kill()
    return time.perf_counter() - t


async def dsec_rounds(address: str, layer: str, n: int, conc: int) -> tuple[list[float], float]:
    async with dsec.AsyncClient(address) as client:
        await dsec_once(client, layer)  # warm the layer mount and connection pool
        sem = asyncio.Semaphore(conc)

        async def one() -> float:
            async with sem:
                return await dsec_once(client, layer)

        t = time.perf_counter()
        lat = await asyncio.gather(*(one() for _ in range(n)))
        return list(lat), n / (time.perf_counter() - t)


WARM_SHAPE = {"memory": "128M", "cpu": 0.5}


async def _wait_ready(client: dsec.AsyncClient, n: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(p.ready for p in (await client.warm()).pools) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: the warm pool never reached {n} ready members")
        await asyncio.sleep(0.05)


async def dsec_warm(address: str, layer: str, n1: int, n8: int) -> dict[str, list[float] | float]:
    """Claims from a warm pool: create latency at c=1 (then the first exec's, apart), and
    creates/s at c=8; each phase starts from a full pool."""
    spec = dsec.SandboxSpec(layers=(layer,), ttl=120, **WARM_SHAPE)  # type: ignore[arg-type]
    async with dsec.AsyncClient(address) as client:
        await client.set_warm([(spec, max(n1, n8))])
        try:
            await _wait_ready(client, n1)
            c1, first_exec, made = [], [], []
            for _ in range(n1):
                t = time.perf_counter()
                sb = await client.create(spec)
                c1.append(time.perf_counter() - t)
                made.append(sb)
                t = time.perf_counter()
                await sb.exec(["true"])
                first_exec.append(time.perf_counter() - t)
            await asyncio.gather(*(sb.kill() for sb in made))
            await _wait_ready(client, n8)
            sem = asyncio.Semaphore(8)

            async def one() -> tuple[float, object]:
                async with sem:
                    t = time.perf_counter()
                    sb = await client.create(spec)
                    return time.perf_counter() - t, sb

            t = time.perf_counter()
            got = await asyncio.gather(*(one() for _ in range(n8)))
            rate = n8 / (time.perf_counter() - t)
            pool = (await client.warm()).pools[0]
            await asyncio.gather(*(sb.kill() for _, sb in got))  # type: ignore[attr-defined]
        finally:
            await client.set_warm([])
    return {
        "c1": c1,
        "first_exec": first_exec,
        "c8": [lat for lat, _ in got],
        "rate": rate,
        "hits": pool.claimed / (n1 + n8),
    }


def dsec_exec(address: str, layer: str, n: int) -> list[float]:
    with dsec.Client(address) as client, client.create(layers=(layer,), memory="128M") as sb:
        sb.exec(["true"])
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            sb.exec(["true"])
            lat.append(time.perf_counter() - t)
        return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="busybox base, few rounds (< 1 min)")
    ap.add_argument(
        "--image",
        default=None,
        help="base layer name@version "
        "(default: debian-python@12-2 from the default catalog; busybox with --quick)",
    )
    ap.add_argument("--rounds", type=int, default=None)
    add_plot_flag(ap)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root")
    n = args.rounds or (24 if args.quick else 200)
    n_docker = 16 if args.quick else max(32, n // 4)

    config = NodeConfig.from_env()
    config.ensure_dirs()
    store = LayerStore(config.layer_dir)
    ref = args.image or ("bench-busybox@1" if args.quick else "debian-python@12-2")
    if ref == "bench-busybox@1":
        try:
            info = store.resolve(ref)
        except dsec.UnknownLayer:
            info = build_busybox_layer(store, name="bench-busybox")
    else:
        if ref == "debian-python@12-2":
            ensure_catalog(default_catalog_file(), config)
        info = store.resolve(ref)
    started = daemon_pid(config) is None  # a node this run starts, it stops
    ensure_daemon(config)
    address = os.fspath(config.socket_path)

    # dsec first: dockerd's start and stop leave the kernel busy for a while after.
    try:
        s1, s1_rate = asyncio.run(dsec_rounds(address, ref, n, 1))
        cold_create = list(COLD_CREATES)
        s8, s8_rate = asyncio.run(dsec_rounds(address, ref, n * 4, 8))
        warm = asyncio.run(dsec_warm(address, ref, max(24, n), 64 if args.quick else 256))
        sexec = dsec_exec(address, ref, max(50, n))
    finally:
        if started:
            stop_daemon(config)

    tag = f"dsec-bench:{info.digest.split(':')[1][:12]}"
    with docker_daemon() as docker:
        docker.import_layer(store.image_path(info), tag)
        docker_run_once(docker, tag)  # warm
        d1, _ = docker_rounds(docker, tag, max(5, n_docker // 2), 1)
        d8, d8_rate = docker_rounds(docker, tag, n_docker, 8)
        dexec = docker_exec(docker, tag, max(10, n // 2))

    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    fig = {
        "image": ref,
        "quick": args.quick,
        "dsec_p50_ms": ms(statistics.median(s1)),
        "dsec_p99_ms": ms(pct(s1, 99)),
        "dsec_per_s_c1": round(s1_rate, 1),
        "dsec_c8_p50_ms": ms(statistics.median(s8)),
        "dsec_c8_p99_ms": ms(pct(s8, 99)),
        "dsec_per_s_c8": round(s8_rate, 1),
        "docker_p50_ms": ms(statistics.median(d1)),
        "docker_p99_ms": ms(pct(d1, 99)),
        "docker_c8_p50_ms": ms(statistics.median(d8)),
        "docker_per_s_c8": round(d8_rate, 1),
        "ratio_vs_docker_c8": round(s8_rate / d8_rate, 2),
        "ratio_vs_docker_p50": round(statistics.median(d1) / statistics.median(s1), 2),
        "dsec_exec_p50_ms": ms(statistics.median(sexec)),
        "dsec_exec_p99_ms": ms(pct(sexec, 99)),
        "docker_exec_p50_ms": ms(statistics.median(dexec)),
        "rounds": n,
        "cold_create_p50_ms": ms(statistics.median(cold_create)),
        "warm_p50_ms": ms(statistics.median(warm["c1"])),  # type: ignore[arg-type]
        "warm_p99_ms": ms(pct(warm["c1"], 99)),  # type: ignore[arg-type]
        "warm_first_exec_p50_ms": ms(statistics.median(warm["first_exec"])),  # type: ignore[arg-type]
        "warm_c8_p50_ms": ms(statistics.median(warm["c8"])),  # type: ignore[arg-type]
        "warm_per_s_c8": round(warm["rate"], 1),  # type: ignore[arg-type]
        "warm_claim_rate": round(warm["hits"], 3),  # type: ignore[arg-type]
        "warm_vs_docker_c8": round(warm["rate"] / d8_rate, 2),  # type: ignore[operator]
    }
    rows = [
        (
            "create+exec+kill, c=1",
            f"{fig['dsec_p50_ms']} / {fig['dsec_p99_ms']} ms",
            f"{fig['docker_p50_ms']} / {fig['docker_p99_ms']} ms",
            f"{fig['ratio_vs_docker_p50']}x",
        ),
        (
            "throughput, c=8",
            f"{fig['dsec_per_s_c8']}/s",
            f"{fig['docker_per_s_c8']}/s",
            f"{fig['ratio_vs_docker_c8']}x",
        ),
        (
            "latency at c=8 (p50/p99)",
            f"{fig['dsec_c8_p50_ms']} / {fig['dsec_c8_p99_ms']} ms",
            f"{fig['docker_c8_p50_ms']} ms",
            "",
        ),
        (
            "create call alone, c=1 (p50)",
            f"cold {fig['cold_create_p50_ms']} / warm {fig['warm_p50_ms']} ms",
            "",
            "",
        ),
        (
            "warm claims/s, c=8",
            f"{fig['warm_per_s_c8']}/s",
            f"{fig['docker_per_s_c8']}/s",
            f"{fig['warm_vs_docker_c8']}x",
        ),
        (
            "exec `true` (p50)",
            f"{fig['dsec_exec_p50_ms']} ms",
            f"{fig['docker_exec_p50_ms']} ms",
            f"{round(fig['docker_exec_p50_ms'] / fig['dsec_exec_p50_ms'], 1)}x",
        ),
    ]
    print(f"\nimage {ref}, {n} dsec rounds (x4 at c=8), {n_docker} docker rounds\n")
    print(f"{'measure':28} {'dsec':>22} {'docker':>22} {'dsec advantage':>15}")
    for name, a, b, c in rows:
        print(f"{name:28} {a:>22} {b:>22} {c:>15}")
    print("targets: ratio_vs_docker_c8 >= 10, dsec_p50_ms <= 40, dsec_exec_p50_ms <= 10")
    print("         warm_p50_ms <= 5, warm_per_s_c8 >= 300\n")
    if args.plot:
        plot(s1, d1, fig)
    print(json.dumps(fig))
    sys.stdout.flush()


def plot(s1: list[float], d1: list[float], fig: dict) -> None:
    title = f"Create -> first exec -> kill, dsec vs docker ({fig['image']})"
    with figure("create", title, fig["quick"], ncols=3, width=4.2) as (_, (lat, rate, ex)):
        for name, xs, colour in (("dsec", s1, "dsec"), ("docker run", d1, "baseline")):
            lat.ecdf([1000 * x for x in xs], label=name, color=COLOURS[colour])
        log_scale(lat, "x")
        lat.set(xlabel="ms, concurrency 1", ylabel="fraction of rounds")
        lat.legend()
        rates = [fig["dsec_per_s_c8"], fig["docker_per_s_c8"]]
        bars(rate, ["dsec", "docker run"], rates, unit="sandboxes/s at concurrency 8")
        execs = [fig["dsec_exec_p50_ms"], fig["docker_exec_p50_ms"]]
        bars(ex, ["dsec exec", "docker exec"], execs, unit="exec `true`, p50 ms", log=True)


if __name__ == "__main__":
    main()
