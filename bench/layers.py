#!/usr/bin/env python3
"""DSec's two layer ablations at this machine's scale, in one run.

(a) The demo's tasks (several images and workspaces) pulled from a real OCI registry on
loopback, by a fresh node each time: eagerly (whole images, DSEC_ONDEMAND=0) vs on demand
(metadata first, 1 MiB data chunks on first read). Reports bytes fetched from the registry,
bytes written to local disk, time until all sandboxes are ready and until their tasks finish.
DSec: on demand was 1.71x faster with 57% fewer writes. The layers are published with read
profiles (``dsec catalog profile``: one sequential run of each task, so data blobs are stored in
first-read order); on demand is also run against the same layers published without profiles
(``ondemand_fetch_fraction_unprofiled``), to show what the profile buys. Each mode runs
``--repeat`` batches (3; 1 with --quick) on fresh nodes; figures are medians. A fresh node
has a fresh home, but the machine's caches are the machine's, as on any host that ran dsec
before: the build cache (``DSEC_BUILD_CACHE``) and the VM cache (``DSEC_VM_CACHE``: the guest
kernel, initramfs and start templates, keyed by content), so the microVM task starts from the
template an earlier batch or the profile run saved rather than fetching a kernel and booting.
On a machine that never ran it, the first eager batch boots that VM once (the on-demand
shape's template comes from the profile run), so only the unlimited run's ratio is off then;
the limited run comes after it.

(b) A workspace unpacked from tar.gz into each sandbox's writable layer vs the same workspace
mounted as a shared EROFS layer: time until a task can read it, and bytes written to disk
(the sandbox's upper directory). DSec: 79 -> 45 minutes with 1/5.5 of the writes.

    python bench/layers.py [--quick]

The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import shutil
import statistics
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import dsec
from dsec_core.catalog import CatalogStore, default_catalog_file, parse_catalog
from dsec_core.catalog.distribution import catalog_layer_refs
from dsec_core.config import NodeConfig
from dsec_core.demo import ensure_catalog
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.localnode import ensure_daemon
from dsec_core.node.node import Node
from dsec_core.plugins import open_source
from dsec_core.read_profiles import profile_catalog
from dsec_core.records import LayerRef, SandboxSpec
from dsec_core.sources.transfer import push_layer
from dsec_core.testing import make_busybox_rootfs

# The test registry lives with the plugin that needs it (plugins/layer_oci/tests).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins" / "layer_oci" / "tests"))
from oci_registry import local_registry

TASK = "cd /workspace && find . -type f | wc -l && cat src/mod_0001.py > /dev/null"


def make_workspace(root: Path, files: int, seed: int = 7) -> int:
    """A repository-like tree: many small source files and a few larger binaries."""
    rng = random.Random(seed)
    total = 0
    for i in range(files):
        if i % 50 == 49:
            path = root / "assets" / f"blob_{i:04d}.bin"
            data = rng.randbytes(rng.randint(200_000, 600_000))
        else:
            path = root / "src" / f"mod_{i:04d}.py"
            words = [
                rng.choice(("def", "return", "self", "value", "import", "class", "for"))
                for _ in range(rng.randint(100, 1500))
            ]
            data = (" ".join(words) + "\n").encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        total += len(data)
    return total


def tar_gz(root: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        tar.add(root, arcname=".")
    return buf.getvalue()


def upper_bytes(config: NodeConfig, sandbox_id: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(config.sandbox_dir / sandbox_id / "upper"):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def run_tar(
    client: dsec.Client, config: NodeConfig, base: str, archive: bytes
) -> tuple[float, int]:
    t = time.perf_counter()
    with client.create(layers=(base,), memory="512M") as sb:
        sb.write_file("/tmp/ws.tar.gz", archive)
        sb.exec(
            "mkdir -p /workspace && tar xzf /tmp/ws.tar.gz -C /workspace && rm /tmp/ws.tar.gz",
            timeout=600,
        ).check()
        sb.exec(TASK).check()
        elapsed = time.perf_counter() - t
        written = upper_bytes(config, sb.id) + len(archive)  # the upload was written too
    return elapsed, written


def run_erofs(client: dsec.Client, config: NodeConfig, base: str, ws: str) -> tuple[float, int]:
    t = time.perf_counter()
    with client.create(layers=(ws, base), memory="512M") as sb:
        sb.exec(TASK).check()
        elapsed = time.perf_counter() - t
        written = upper_bytes(config, sb.id)
    return elapsed, written


def _disk_written() -> int:
    """Bytes written to block devices so far (/proc/diskstats, 512-byte sectors)."""
    os.sync()
    total = 0
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            name = parts[2]
            # whole disks only (partitions would count writes twice), no virtual devices
            if not os.path.exists(f"/sys/block/{name}/device") or name.startswith(
                ("loop", "ram", "zram", "dm-")
            ):
                continue
            total += int(parts[9]) * 512
    return total


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _work_of(task) -> str:
    """What a sandbox of ``task`` runs: its command, or for a judge task (which has none) what
    the judge runs in its member: ``compile`` once, then ``run`` on each case's input."""
    if task.command or task.judge is None:
        return task.command
    j = task.judge
    run = f'for c in {j.cases}/*.in; do {j.run} < "$c" > /dev/null; done; true'
    return f"{j.compile} && {run}" if j.compile else run


async def _run_batch(node, catalog, rounds: int) -> tuple[float, float]:
    """Create one sandbox per task per round, all at once; run every task. Returns (seconds
    until all are ready, seconds until all tasks finished)."""

    started = time.perf_counter()
    specs = [t for t in catalog.tasks for _ in range(rounds)]
    infos = await asyncio.gather(
        *(
            node.create(SandboxSpec(environment=t.environment, memory="512M", ttl=600))
            for t in specs
        )
    )
    ready = time.perf_counter() - started
    results = await asyncio.gather(
        *(
            node.exec(i.id, _work_of(t), timeout=t.timeout)
            for i, t in zip(infos, specs, strict=True)
        )
    )
    done = time.perf_counter() - started
    bad = [(t.name, r.exit_code) for t, r in zip(specs, results, strict=True) if r.timed_out]
    if bad:
        raise SystemExit(f"bench: tasks timed out: {bad}")
    await asyncio.gather(*(node.kill(i.id) for i in infos))
    return ready, done


class SourceLink:
    """The node's share of the link to its layer store: ``mbps`` MB/s for all readers
    together (a token bucket), or unlimited when ``mbps`` is 0."""

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * 1e6
        self.lock = threading.Lock()
        self.free_at = time.monotonic()

    def carry(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self.lock:
            start = max(self.free_at, time.monotonic())
            self.free_at = start + nbytes / self.rate
            done = self.free_at
        time.sleep(max(0.0, done - time.monotonic()))


def _one_batch(mode: str, url: str, catalog, rounds: int, mbps: float) -> dict:
    """One fresh node pulls the catalog's layers from ``url`` (eagerly or on demand) and runs
    every task ``rounds`` times at once; its figures."""

    home = Path(tempfile.mkdtemp(prefix=f"dsec-bench-{mode}-"))
    config = replace(
        NodeConfig(home=home), layer_sources=("local", url), ondemand=(mode != "eager")
    )
    config.ensure_dirs()
    CatalogStore(config.catalog_dir).save(
        parse_catalog(catalog.to_document(), check_sources=False, check_layers=False)
    )

    async def run() -> tuple[float, float, int]:
        node = Node(config)
        await node.open()
        fetched = [0]
        link = SourceLink(mbps)
        for source in node.layer_sources:
            if source.scheme == "oci":  # count every blob byte the registry sends
                inner = source._request

                def counting(method, url, *a, _inner=inner, **kw):
                    response = _inner(method, url, *a, **kw)
                    if method == "GET" and "/blobs/" in url:
                        fetched[0] += len(response.content)
                        link.carry(len(response.content))
                    return response

                source._request = counting
        try:
            ready, done = await _run_batch(node, catalog, rounds)
        finally:
            await node.close(kill_all=True)
        return ready, done, fetched[0]

    try:
        written0 = _disk_written()
        ready, done, fetched = asyncio.run(run())
        written = _disk_written() - written0
        return {
            "ready_s": round(ready, 3),
            "tasks_done_s": round(done, 3),
            "fetched_bytes": fetched,
            "written_bytes": written,
            "cache_bytes": _tree_bytes(config.cache_dir),
        }
    finally:
        shutil.rmtree(home, ignore_errors=True)


def ablation_a(rounds: int, mbps: float = 0.0, unprofiled: bool = True, repeat: int = 1) -> dict:
    """Profile and publish the demo catalog to a registry on loopback, then time ``repeat``
    batches per mode (eager, on demand, on demand without profiles); medians per figure."""
    author = NodeConfig.from_env()
    author.ensure_dirs()
    catalog = ensure_catalog(default_catalog_file(), author)
    store = LayerStore(author.layer_dir)
    refs = catalog_layer_refs(catalog)
    image_bytes = sum(store.resolve(r).size for r in refs)
    out: dict = {"image_layers": len(refs), "image_bytes": image_bytes}
    # Read profiles: one sequential run of each task over on-demand layers (lazy.layout).
    t = time.perf_counter()
    profile_catalog(catalog, author)
    out["profile_seconds"] = round(time.perf_counter() - t, 2)
    with local_registry() as reg:
        urls = {
            "profiled": f"oci://{reg.address}/dsec?insecure=1",
            "unprofiled": f"oci://{reg.address}/dsec-plain?insecure=1",
        }
        for kind, url in urls.items():
            dest = open_source(url, author)
            for ref in refs:
                if kind == "profiled":
                    push_layer(ref, dest, store)
                else:  # the same layers with their data blobs in directory order
                    info = store.resolve(LayerRef.parse(ref))
                    dest.push(info, store.image_path(info))
        dest = open_source(urls["profiled"], author)
        blob_bytes = 0
        for ref in refs:
            form = dest.lazy_form(dest.resolve(LayerRef.parse(ref)))
            blob_bytes += form.blob_size + form.meta_size if form else 0
        out["lazy_form_bytes"] = blob_bytes
        modes = {"eager": urls["profiled"], "ondemand": urls["profiled"]}
        if unprofiled:
            modes["ondemand_unprofiled"] = urls["unprofiled"]
        for mode, url in modes.items():
            runs = [_one_batch(mode, url, catalog, rounds, mbps) for _ in range(repeat)]
            out[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            out[mode]["runs"] = repeat
    out["sandboxes"] = len(catalog.tasks) * rounds
    out["ondemand_fetch_fraction"] = round(out["ondemand"]["fetched_bytes"] / blob_bytes, 3)
    if unprofiled:
        out["ondemand_fetch_fraction_unprofiled"] = round(
            out["ondemand_unprofiled"]["fetched_bytes"] / blob_bytes, 3
        )
    out["eager_vs_ondemand_time_ratio"] = round(
        out["eager"]["tasks_done_s"] / out["ondemand"]["tasks_done_s"], 2
    )
    out["eager_vs_ondemand_write_ratio"] = round(
        out["eager"]["written_bytes"] / max(1, out["ondemand"]["written_bytes"]), 2
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller workspace, fewer sandboxes")
    ap.add_argument("--sandboxes", type=int, default=None)
    ap.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="batches per mode in (a), medians reported (default 3; 1 with --quick)",
    )
    ap.add_argument(
        "--source-mbps",
        type=float,
        default=None,
        help="also run (a) with the registry link limited to this many MB/s "
        "(default 100; 0 skips the limited run)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root")
    n = args.sandboxes or (4 if args.quick else 12)
    files = 1500 if args.quick else 6000

    config = NodeConfig.from_env()
    config.ensure_dirs()
    store = LayerStore(config.layer_dir)
    base = "bench-busybox@1"
    if not store.exists(base):
        with tempfile.TemporaryDirectory() as tmp:
            build_layer(
                make_busybox_rootfs(Path(tmp) / "rootfs"),
                name="bench-busybox",
                version="1",
                kind="base",
                store=store,
            )
    with tempfile.TemporaryDirectory() as tmp:
        ws_root = Path(tmp) / "ws"
        ws_bytes = make_workspace(ws_root / "workspace", files)
        archive = tar_gz(ws_root / "workspace")
        t = time.perf_counter()
        info = (
            build_layer(
                ws_root, name="bench-workspace", version=f"{files}", kind="workspace", store=store
            )
            if not store.exists(f"bench-workspace@{files}")
            else store.resolve(f"bench-workspace@{files}")
        )
        build_s = time.perf_counter() - t
    ensure_daemon(config)

    with dsec.Client(os.fspath(config.socket_path)) as client:
        run_erofs(client, config, base, info.ref)  # warm the layer mount
        tar_runs = [run_tar(client, config, base, archive) for _ in range(n)]
        erofs_runs = [run_erofs(client, config, base, info.ref) for _ in range(n)]

    rounds = 1 if args.quick else 3
    repeat = args.repeat or (1 if args.quick else 3)
    a = ablation_a(rounds, repeat=repeat)
    mbps = 100.0 if args.source_mbps is None else args.source_mbps
    limited = ablation_a(rounds, mbps, unprofiled=False, repeat=repeat) if mbps else None

    tar_t = statistics.median(r[0] for r in tar_runs)
    erofs_t = statistics.median(r[0] for r in erofs_runs)
    tar_w = sum(r[1] for r in tar_runs)
    erofs_w = sum(r[1] for r in erofs_runs)
    fig = {
        "quick": args.quick,
        "sandboxes": n,
        "workspace_files": files,
        "workspace_bytes": ws_bytes,
        "workspace_tar_gz_bytes": len(archive),
        "workspace_erofs_bytes": info.size,
        "erofs_build_seconds_once": round(build_s, 3),
        "tar_ready_p50_s": round(tar_t, 4),
        "erofs_ready_p50_s": round(erofs_t, 4),
        "tar_written_bytes": tar_w,
        "erofs_written_bytes": erofs_w,
        "tar_vs_erofs_time_ratio": round(tar_t / erofs_t, 2),
        # a sandbox that mounts its workspace writes next to nothing; floor at one page each
        "tar_vs_erofs_write_ratio": round(tar_w / max(erofs_w, 4096 * n), 1),
        "ondemand_fetch_fraction": a["ondemand_fetch_fraction"],
        "ondemand_fetch_fraction_unprofiled": a["ondemand_fetch_fraction_unprofiled"],
        "eager_vs_ondemand_time_ratio": a["eager_vs_ondemand_time_ratio"],
        "eager_vs_ondemand_write_ratio": a["eager_vs_ondemand_write_ratio"],
        "ablation_a": a,
        "source_mbps_limited": mbps,
        "eager_vs_ondemand_time_ratio_limited": limited["eager_vs_ondemand_time_ratio"]
        if limited
        else None,
        "ablation_a_limited": limited,
    }
    print(
        f"\n(a) {a['sandboxes']} sandboxes over {a['image_layers']} layers, median of "
        f"{repeat} batches per mode "
        f"({a['image_bytes'] / 1e6:.0f} MB of images, {a['lazy_form_bytes'] / 1e6:.0f} MB "
        "as metadata + data blobs) from an OCI registry on loopback\n"
    )
    print(f"{'pull':20} {'ready':>9} {'tasks done':>11} {'fetched':>11} {'written':>11}")
    for mode in ("eager", "ondemand", "ondemand_unprofiled"):
        m = a[mode]
        print(
            f"{mode:20} {m['ready_s']:>8.2f}s {m['tasks_done_s']:>10.2f}s "
            f"{m['fetched_bytes'] / 1e6:>9.1f}MB {m['written_bytes'] / 1e6:>9.1f}MB"
        )
    print(
        f"on demand fetched {a['ondemand_fetch_fraction']:.1%} of the blobs stored in read-"
        f"profile order ({a['profile_seconds']}s to profile), "
        f"{a['ondemand_fetch_fraction_unprofiled']:.1%} in directory order; eager/on-demand "
        f"time {a['eager_vs_ondemand_time_ratio']}x, writes {a['eager_vs_ondemand_write_ratio']}x"
        " (targets: fraction <= 0.2; DSec: 1.71x faster, 57% fewer writes)"
    )
    if limited:
        print(f"\n(a) again with the registry link limited to {mbps:.0f} MB/s for the node:")
        for mode in ("eager", "ondemand"):
            m = limited[mode]
            print(
                f"{mode:20} {m['ready_s']:>8.2f}s {m['tasks_done_s']:>10.2f}s "
                f"{m['fetched_bytes'] / 1e6:>9.1f}MB {m['written_bytes'] / 1e6:>9.1f}MB"
            )
        print(f"eager/on-demand time {limited['eager_vs_ondemand_time_ratio']}x")
    print(
        f"\n(b) workspace: {files} files, {ws_bytes / 1e6:.1f} MB "
        f"({len(archive) / 1e6:.1f} MB tar.gz, {info.size / 1e6:.1f} MB EROFS); {n} sandboxes\n"
    )
    print(f"{'(b) workspace delivery':30} {'ready p50':>12} {'written':>14}")
    print(f"{'tar.gz into the upper layer':30} {tar_t * 1000:>10.0f}ms {tar_w / 1e6:>11.1f} MB")
    print(f"{'EROFS workspace layer':30} {erofs_t * 1000:>10.0f}ms {erofs_w / 1e6:>11.2f} MB")
    print(
        f"{'ratio':30} {fig['tar_vs_erofs_time_ratio']:>11}x {fig['tar_vs_erofs_write_ratio']:>13}x"
    )
    print(
        "targets: tar_vs_erofs_time_ratio >= 5, tar_vs_erofs_write_ratio >= 10 "
        "(DSec: 79 -> 45 min, 1/5.5 of the writes)\n"
    )
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
