#!/usr/bin/env python3
"""Layer ablations at this machine's scale, DSec's (b): a workspace unpacked from tar.gz into
each sandbox's writable layer vs the same workspace mounted as a shared EROFS layer.

For each of N sandboxes, both ways, in one run: time until the workspace is usable (create ->
workspace ready -> a task that reads it), and the bytes written to local disk (the sandbox's
upper directory, measured on the host before the kill). DSec's figure: mounting EROFS
workspaces instead of unpacking tar.gz took a job from 79 to 45 minutes with 1/5.5 of the
writes. (a), eager vs on-demand pulls, joins this script with on-demand loading.

    python bench/layers.py [--quick]

The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import dsec
from dsec_core.config import NodeConfig
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.node.daemon import ensure_daemon
from dsec_core.testing import make_busybox_rootfs

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
            words = [rng.choice(("def", "return", "self", "value", "import", "class", "for"))
                     for _ in range(rng.randint(100, 1500))]
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


def run_tar(client: dsec.Client, config: NodeConfig, base: str, archive: bytes) -> tuple[float, int]:
    t = time.perf_counter()
    with client.create(layers=(base,), memory="512M") as sb:
        sb.write_file("/tmp/ws.tar.gz", archive)
        sb.exec("mkdir -p /workspace && tar xzf /tmp/ws.tar.gz -C /workspace && "
                "rm /tmp/ws.tar.gz", timeout=600).check()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller workspace, fewer sandboxes")
    ap.add_argument("--sandboxes", type=int, default=None)
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
            build_layer(make_busybox_rootfs(Path(tmp) / "rootfs"), name="bench-busybox",
                        version="1", kind="base", store=store)
    with tempfile.TemporaryDirectory() as tmp:
        ws_root = Path(tmp) / "ws"
        ws_bytes = make_workspace(ws_root / "workspace", files)
        archive = tar_gz(ws_root / "workspace")
        t = time.perf_counter()
        info = build_layer(ws_root, name="bench-workspace", version=f"{files}", kind="workspace",
                           store=store) if not store.exists(f"bench-workspace@{files}") \
            else store.resolve(f"bench-workspace@{files}")
        build_s = time.perf_counter() - t
    ensure_daemon(config)

    with dsec.Client(os.fspath(config.socket_path)) as client:
        run_erofs(client, config, base, info.ref)  # warm the layer mount
        tar_runs = [run_tar(client, config, base, archive) for _ in range(n)]
        erofs_runs = [run_erofs(client, config, base, info.ref) for _ in range(n)]

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
    }
    print(f"\nworkspace: {files} files, {ws_bytes / 1e6:.1f} MB "
          f"({len(archive) / 1e6:.1f} MB tar.gz, {info.size / 1e6:.1f} MB EROFS); {n} sandboxes\n")
    print(f"{'(b) workspace delivery':30} {'ready p50':>12} {'written':>14}")
    print(f"{'tar.gz into the upper layer':30} {tar_t * 1000:>10.0f}ms {tar_w / 1e6:>11.1f} MB")
    print(f"{'EROFS workspace layer':30} {erofs_t * 1000:>10.0f}ms {erofs_w / 1e6:>11.2f} MB")
    print(f"{'ratio':30} {fig['tar_vs_erofs_time_ratio']:>11}x "
          f"{fig['tar_vs_erofs_write_ratio']:>13}x")
    print("targets: tar_vs_erofs_time_ratio >= 5, tar_vs_erofs_write_ratio >= 10 "
          "(DSec: 79 -> 45 min, 1/5.5 of the writes)\n")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
