#!/usr/bin/env python3
"""The cost of the disk quota: each sandbox's writable layer on a filesystem of its own (an ext4
image copied from a template, a loop device, a nosuid,nodev mount) against a plain directory on
the host filesystem, as before the quota, in one run.

1. The step alone, interleaved: set up a writable layer (upper/ and work/, owned by the
   sandbox's uid) and tear it down, empty and after writing 500 files of 4 KiB; and
   formatting each sandbox's image with mkfs.ext4 instead of copying the template.
2. Whole sandboxes: an in-process node (container backend, busybox layer) runs create -> exec
   `true` -> kill, alternating round by round between its real writable disks and a stand-in
   that makes plain directories, so both see the same load on the machine; the quota's cost
   is the median of the rounds' differences (other load on a shared machine swings single
   creates by tens of milliseconds).

    python bench/disk.py [--quick] [--rounds N]

--quick takes about half a minute. The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dsec_core.config import NodeConfig
from dsec_core.layers.store import LayerStore
from dsec_core.linux.ext4 import mkfs_ext4, mount_ext4
from dsec_core.linux.loop import attach_loop
from dsec_core.node.disks import WritableDisks
from dsec_core.node.node import Node
from dsec_core.records import SandboxSpec
from dsec_core.testing import build_busybox_layer, leftovers

UID = 100000
SIZE = 10 << 30


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


class PlainDirs(WritableDisks):
    """What the node did before the quota: the writable layer in a directory on the host's
    filesystem, removed file by file."""

    def mount(self, sandbox_id: str, size: int, target: Path) -> None:
        target.mkdir(mode=0o700)

    def remove(self, sandbox_id: str, target: Path) -> None:
        shutil.rmtree(target, ignore_errors=True)


def _layer_dirs(target: Path) -> None:
    for d in (target / "upper", target / "work"):
        d.mkdir()
        os.chown(d, UID, UID)


def _write_files(target: Path, n: int) -> None:
    d = target / "upper" / "files"
    d.mkdir()
    block = os.urandom(4096)
    for i in range(n):
        with open(d / f"f{i}", "wb") as f:
            f.write(block)


def step_alone(base: Path, rounds: int, files: int) -> dict[str, list[float]]:
    """Set-up and tear-down times (seconds) of one writable layer, by kind."""
    real = WritableDisks(base / "disks")
    plain = PlainDirs(base / "disks")
    real.dir.mkdir()
    (base / "sandboxes").mkdir()
    real.template(SIZE)
    out: dict[str, list[float]] = {}

    def mkfs_each(sid: str, size: int, target: Path) -> None:
        image = real.image(sid)
        mkfs_ext4(image, size)
        target.mkdir(mode=0o700)
        with attach_loop(image) as dev:
            mount_ext4(dev.path, target)

    kinds: list[tuple[str, Callable[[str, int, Path], None], WritableDisks]] = [
        ("plain", plain.mount, plain),
        ("own-fs", real.mount, real),
        ("own-fs-mkfs", mkfs_each, real),
    ]
    for i in range(rounds):
        for name, setup, owner in kinds:
            for n in (0, files) if name != "own-fs-mkfs" else (0,):
                sid = f"{name}-{n}-{i}"
                target = base / "sandboxes" / sid
                t0 = time.perf_counter()
                setup(sid, SIZE, target)
                _layer_dirs(target)
                t1 = time.perf_counter()
                if n:
                    _write_files(target, n)
                t2 = time.perf_counter()
                owner.remove(sid, target)
                t3 = time.perf_counter()
                if n == 0:
                    out.setdefault(f"{name} set-up", []).append(t1 - t0)
                out.setdefault(f"{name} tear-down, {n} files", []).append(t3 - t2)
    return out


async def whole_sandboxes(home: Path, rounds: int) -> dict[str, list[float]]:
    """create, and create -> exec -> kill, in seconds, with and without the quota."""
    config = NodeConfig(home=home)
    config.ensure_dirs()
    info = build_busybox_layer(LayerStore(config.layer_dir), name="bench-busybox")
    node = Node(config)
    await node.open()
    # the writable layers are made by the node's root filesystems: swapped there
    real, plain = node.disks, PlainDirs(config.disk_dir)
    spec = SandboxSpec(layers=(info.ref,), memory="64M")
    out: dict[str, list[float]] = {}
    try:
        for i in range(rounds + 2):
            for name, disks in (("quota", real), ("no quota", plain)):
                node.rootfs.disks = disks
                t0 = time.perf_counter()
                sb = await node.create(spec)
                t1 = time.perf_counter()
                r = await node.exec(sb.id, "true")
                assert r.exit_code == 0, r
                await node.kill(sb.id)
                t2 = time.perf_counter()
                if i >= 2:  # the first rounds mount the layer and warm caches
                    out.setdefault(f"{name} create", []).append(t1 - t0)
                    out.setdefault(f"{name} create+exec+kill", []).append(t2 - t0)
            if i >= 2:  # the pair's difference: what the quota cost under the same load
                for what in ("create", "create+exec+kill"):
                    q, nq = out[f"quota {what}"][-1], out[f"no quota {what}"][-1]
                    out.setdefault(f"difference {what}", []).append(q - nq)
    finally:
        node.rootfs.disks = real
        await node.close(kill_all=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (about half a minute)")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root (loop devices, mounts, runc)")
    rounds = args.rounds or (20 if args.quick else 100)
    step_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-disk-"))
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-disk-node-"))
    try:
        step = step_alone(step_dir, rounds, files=500)
        whole = asyncio.run(whole_sandboxes(home, rounds))
        left = leftovers(home)
        assert not any(left.values()), left
    finally:
        shutil.rmtree(step_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)

    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    print(f"\n{rounds} rounds each, p50 / p99 in ms\n")
    fig: dict[str, object] = {"rounds": rounds, "quick": args.quick}
    for title, table in (("the writable layer alone", step), ("whole sandboxes", whole)):
        print(title)
        for name, values in table.items():
            p50, p99 = ms(statistics.median(values)), ms(pct(values, 99))
            print(f"  {name:36} {p50:>8} / {p99:<8}")
            fig[name.replace(" ", "_").replace(",", "").replace("+", "_") + "_p50_ms"] = p50
    q = statistics.median(whole["quota create"])
    nq = statistics.median(whole["no quota create"])
    fig["create_cost_ms"] = ms(statistics.median(whole["difference create"]))
    fig["create_ratio"] = round(q / nq, 3)
    fig["cycle_cost_ms"] = ms(statistics.median(whole["difference create+exec+kill"]))
    print(
        f"\ncreate: {ms(q)} ms with the quota, {ms(nq)} ms without ({fig['create_ratio']}x); "
        f"the quota's cost, median of the rounds' differences: create "
        f"{fig['create_cost_ms']} ms, create+exec+kill {fig['cycle_cost_ms']} ms\n"
    )
    print(json.dumps(fig))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
