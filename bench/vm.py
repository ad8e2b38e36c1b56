#!/usr/bin/env python3
"""Sandboxes as VMs against containers, in one run: create -> first exec, exec latency, and the
host memory of idle microVMs with their layers over virtio-pmem (DAX) against virtio-blk.

1. Latency, one node (layers over pmem, fast start on), the kit's busybox layer ``kit-base@1``:
   create -> first ``true`` p50/p90 for the container backend under runc (the baseline) and
   gVisor (runsc), the microVM (fast start: the run's first VM boots and is saved as its shape's
   template, reported apart as the cold boot; later ones load it), the microVM with a network
   card under the egress policy (``network="allowlist"``), and the full VM backend
   ``vm`` when the node has it (its row says so when not); then ``true`` in a running sandbox of
   each, many rounds.
   Then clones: a running 512M microVM of the latency rows' shape (started from its template,
   as microVMs are) holding 128 MiB of its own data, its memory snapshot, and 8 clones of
   it (``restore(snapshot, 8)``): the time until all 8 have answered an exec
   (``clone8_s``; target 1 s under TCG), and the memory they add, the sum of their QEMUs' PSS
   once each has read its data, against the parent's PSS (``clone8_added_mem_vs_one``;
   target 1.5x, not 8x): clones map the snapshot's RAM file privately and share what they
   do not write.
2. Boot every time: a node with ``DSEC_VM_SNAPSHOT_START=0``, create -> first exec p50.
3. Memory: a ``toolkit`` layer of incompressible files (200 MB; 16 MB with --quick) built in
   the bench; with the balloon off (``DSEC_VM_BALLOON=0``, ``DSEC_VM_RECLAIM=0``), for pmem
   and then blk (``DSEC_VM_LAYERS``, read by the daemon at its start, so a
   node each), the same N idle microVMs (8; 3 with --quick) with the same RAM each ``cat`` every
   file of the layer to /dev/null and are then left idle. Host memory is the rise of
   MemTotal - MemAvailable (/proc/meminfo) from before the N start to when all are idle, page
   cache dropped before each variant; what the VMs' memory cgroups hold (anonymous and mapped
   file pages, a page shared by VMs charged once) and the sum of the QEMU processes' PSS are
   the others. ``pmem_vs_blk_host_mem_ratio`` is the cgroups' figure: on a shared host the
   system-wide one also counts whatever other processes did meanwhile (the table says when
   other QEMUs ran; it is in the JSON as ``pmem_vs_blk_system_used_ratio``). Each variant's
   template VM is made (and killed) before the drop, so both count only the N.
4. Memory given back: on the blk node (balloon and reclaim off) and then on a node with both
   on (reclaim passes every second), N microVMs each read the data layer (with --quick also
   write 5 copies of it to their disks: 96 MB of page cache each) and go idle (10 s; 5 s);
   what their memory cgroups hold then, on against off (``balloon_damon_vs_off_host_mem_ratio``;
   target 0.8, DSec's -21.2%). Cold memory is found by referenced bits, not DAMON: this host's
   own kdamond holds DAMON's sysfs interface (``dsec node status`` says so).
5. Density: on a node of the defaults (balloon and reclaim on, a pass every 30 s), N idle
   microVMs of 512M (8; 32 without --quick) started from their template, each having run
   ``true``: the host memory one holds (its cgroup, median; ``idle_microvm_host_bytes``), the
   CPU one burns idle (``idle_microvm_cpu_share``), and how many such VMs this host holds by
   each (90% of its memory; half its cores): ``idle_microvms_fit`` is the smaller (DSec
   reports 800 microVMs per node).

    python bench/vm.py [--quick]

The VMs use a private copy of the VM cache (``DSEC_VM_CACHE``'s kernels, initramfs and
vmlinux linked, its own pmem images and templates), so the run leaves nothing in the shared
cache. Everything it makes (sandboxes, node daemons, homes, that cache) is removed at the end,
on Ctrl-C and SIGTERM too. --quick: fewer rounds, fewer VMs and a smaller layer, no full-VM
latency row and no boot-every-time row; it says so. It takes about 100-115 s, not the minute
a quick run should: five VM shapes each boot once cold (5-6 s each under TCG), four nodes
start, and the 8 clones, the reclaim passes and the idle VMs take what they take. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from figures import COLOURS, add_plot_flag, bars, figure

import dsec
from dsec_core.backend import cgroup_path
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.cgroups import CGROUP_ROOT
from dsec_core.linux.processes import proc_stat
from dsec_core.testing import KitNode, running_kit_node
from dsec_core.vm.runner import vm_cache_dir

TARGETS = {  # figure: (limit, "le" for at most)
    "clone8_s": 1.0,
    "clone8_added_mem_vs_one": 1.5,
    "pmem_vs_blk_host_mem_ratio": 0.6,  # DSec: 0.598
    "balloon_damon_vs_off_host_mem_ratio": 0.8,
    "gvisor_create_p50_ms": 300.0,
    "microvm_exec_p50_ms": 20.0,
}
VM_MEMORY = "512M"  # every microVM of the memory parts, pmem and blk alike
CLONES = 8  # the clone part: 8 clones of one running microVM
FILE_BYTES = 512 << 10
STOPS = (signal.SIGINT, signal.SIGTERM)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def ms(v: float) -> float:
    return round(v * 1000, 1)


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """``values`` in os.environ (which a node daemon started meanwhile inherits), then back."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def phase(what: str, since: float) -> float:
    """Say on stderr that ``what`` is done and how long it took; returns now."""
    now = time.perf_counter()
    print(f"bench: {what} ({now - since:.1f} s)", file=sys.stderr, flush=True)
    return now


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block is done (a node half started or half stopped
    would leave its daemon, mounts or home behind), then interrupt as usual."""
    caught: list[int] = []
    saved = {s: signal.signal(s, lambda n, _f: caught.append(n)) for s in STOPS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def bench_node(prefix: str) -> Iterator[KitNode]:
    """``running_kit_node`` whose start and stop a signal does not cut short."""
    running = running_kit_node(prefix)
    with signals_held():
        node = running.__enter__()
    try:
        yield node
    except BaseException:
        with signals_held():
            if not running.__exit__(*sys.exc_info()):
                raise
    else:
        with signals_held():
            running.__exit__(None, None, None)


def create(client: dsec.Client, spec: dict) -> dsec.Sandbox:
    """``client.create`` that a signal does not cut short: an interrupted call would leave the
    daemon making a sandbox that the node's stop does not yet list, and so does not kill."""
    with signals_held():
        return client.create(**spec)


def private_vm_cache(scratch: Path) -> Path:
    """A VM cache under ``scratch`` sharing the slow-to-make boot files of the machine's
    (``DSEC_VM_CACHE``, ``vm_cache_dir``) but with pmem images and templates of its own (so
    cold boots are measured), removed with ``scratch``."""
    cache = scratch / "vm-cache"
    cache.mkdir()
    shared = vm_cache_dir()
    for part in ("kernels", "initramfs", "vmlinux"):
        (shared / part).mkdir(parents=True, exist_ok=True)
        (cache / part).symlink_to(shared / part)
    return cache


# --- latency ----------------------------------------------------------------------------------
def create_rounds(
    client: dsec.Client, spec: dict, rounds: int, execs: int
) -> tuple[list[float], list[float]]:
    """``rounds`` times: create, first ``true`` (timed together), ``execs`` more (each timed)."""
    first, each = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sb = create(client, spec)
        try:
            sb.exec("true").check()
            first.append(time.perf_counter() - t0)
            for _ in range(execs):
                t = time.perf_counter()
                sb.exec("true").check()
                each.append(time.perf_counter() - t)
        finally:
            sb.kill()
    return first, each


def latency(
    node: KitNode, layers: list[str], rounds: int, execs: int, full_vm: bool = True
) -> dict[str, dict]:
    common = dict(layers=layers, memory=VM_MEMORY)
    kinds = {
        "container": dict(common, backend="container", runtime="runc"),
        "gvisor": dict(common, backend="container", runtime="runsc"),
        "microvm": dict(common, backend="microvm"),
        # a network card, a namespace, a veth and the egress policy (one TEST-NET-1 rule):
        # what a VM's network adds to its create
        "microvm_net": dict(
            common,
            backend="microvm",
            network="allowlist",
            policies={"egress": {"allow": ["192.0.2.10/32:443/tcp"]}},
        ),
        "vm": dict(common, backend="vm"),
    }
    out: dict[str, dict] = {}
    with node.client() as client:
        have = set(client.node_info()["backends"])
        for name, spec in kinds.items():
            if spec["backend"] not in have:
                out[name] = {"skipped": f"backend {spec['backend']!r} is not registered"}
                continue
            if name == "vm" and not full_vm:
                out[name] = {"skipped": "--quick (its cold boot alone takes 6 s)"}
                continue
            # warm: the layer mounted, runsc in page cache; for a VM, the cold boot that
            # saves its shape's template, timed apart
            t0 = time.perf_counter()
            try:
                create(client, spec).kill()
            except dsec.DsecError as e:
                out[name] = {"skipped": f"create failed: {e}"}
                continue
            warm = time.perf_counter() - t0
            first, each = create_rounds(client, spec, rounds, execs)
            out[name] = {"first": first, "exec": each, "warm": warm}
    return out


# --- memory -----------------------------------------------------------------------------------
def data_tree(root: Path, total: int) -> Path:
    """``total`` bytes of incompressible files (a fixed seed), like a toolkit's libraries."""
    rng = random.Random(11)
    tree = root / "data"
    for i in range(total // FILE_BYTES):
        d = tree / "opt" / "bench" / f"d{i // 16:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:03d}.so").write_bytes(rng.randbytes(FILE_BYTES))
    return tree


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            out[key] = int(rest.split()[0]) * 1024
    return out


def used() -> int:
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]


def pss(pid: int) -> dict[str, int]:
    """``Pss``, ``Pss_Anon`` and ``Pss_File`` of ``pid`` in bytes (zero where absent)."""
    out = dict.fromkeys(("Pss", "Pss_Anon", "Pss_File"), 0)
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1]) * 1024
    return out


def qemu_pids() -> set[int]:
    """Every QEMU system emulator on the host (ours and anyone else's)."""
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().startswith("qemu-system"):
                    found.add(int(pid))
    return found


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cgroup_held(sandbox_id: str) -> int:
    """What the sandbox's memory cgroup (v1) holds in anonymous and mapped file pages: a page
    is charged to one cgroup, so page cache shared by VMs counts once in a sum; unmapped cache
    (the template's state file read at load) does not count."""
    stat = CGROUP_ROOT / "memory" / cgroup_path(sandbox_id) / "memory.stat"
    try:
        fields = dict(line.split() for line in stat.read_text().splitlines())
    except OSError:
        return 0
    return int(fields.get("rss", 0)) + int(fields.get("mapped_file", 0))


def with_data_layer(node: KitNode, tree: Path) -> list[str]:
    """The kit's base and a toolkit layer of ``tree`` built into the node's store."""
    store = LayerStore(node.config.layer_dir)
    data = build_layer(tree, name="bench-data", version="1", kind="toolkit", store=store)
    return [node.layer.ref, data.ref]


def idle_vms_memory(node: KitNode, layers: list[str], n: int, settle: float) -> dict:
    """Start ``n`` microVMs over ``layers``, each reading all of the data layer; the host
    memory they add once idle, and what the guests say about their mounts and page cache."""
    spec = dict(layers=layers, backend="microvm", memory=VM_MEMORY)
    read = "cat $(find /opt/bench -type f) > /dev/null"
    with node.client() as client:
        create(client, spec).kill()  # the shape's template (if none yet), before the measure
        drop_caches()
        time.sleep(1)
        before, others = used(), qemu_pids()
        vms = []
        try:
            for _ in range(n):
                sb = create(client, spec)
                vms.append(sb)
                sb.exec(["sh", "-c", read]).check()
            time.sleep(settle)  # idle: let QEMU's threads and the guests settle
            after = used()
            pids = [client.get(sb.id).info.pid for sb in vms]
            others |= qemu_pids() - set(pids)
            rollups = [pss(p) for p in pids if p]
            held = sum(cgroup_held(sb.id) for sb in vms)
            probe = (
                vms[0]
                .exec(
                    [
                        "sh",
                        "-c",
                        "grep erofs /proc/mounts; grep -E '^(Cached|MemFree):' /proc/meminfo",
                    ]
                )
                .stdout.decode()
            )
        finally:
            for sb in vms:
                with contextlib.suppress(dsec.DsecError):
                    sb.kill()
    guest_cached = next(
        (int(line.split()[1]) << 10 for line in probe.splitlines() if line.startswith("Cached:")),
        0,
    )
    return {
        "host_used_bytes": after - before,
        "cgroup_bytes": held,
        "other_qemus": len(others),
        "qemu_pss_bytes": sum(r["Pss"] for r in rollups),
        "qemu_pss_anon_bytes": sum(r["Pss_Anon"] for r in rollups),
        "qemu_pss_file_bytes": sum(r["Pss_File"] for r in rollups),
        "guest_cached_bytes": guest_cached,
        "guest_mounts": [line for line in probe.splitlines() if "erofs" in line],
    }


def clones(node: KitNode, layers: list[str], memory: str, fill_mb: int) -> dict:
    """A running microVM of ``memory`` holding ``fill_mb`` MiB of its own data (random bytes in
    a tmpfs), its memory snapshot, then 8 clones of it: the time from the restore call until
    all 8 have answered an exec, and the memory they add: the sum of their QEMUs' PSS (a page
    they share counted once, split between them) against the parent QEMU's PSS."""
    spec = dict(layers=layers, backend="microvm", memory=memory)
    # 8 MiB of random bytes copied over and over (urandom itself runs at 13 MB/s under TCG);
    # no page is zero, and nothing on this host merges equal pages
    fill = (
        "mkdir -p /mnt/ram && mount -t tmpfs -o size=200m tmpfs /mnt/ram && "
        "dd if=/dev/urandom of=/mnt/ram/seed bs=1048576 count=8 2>/dev/null && "
        f"for i in $(seq {fill_mb // 8}); do cat /mnt/ram/seed; done > /mnt/ram/blob && "
        "rm /mnt/ram/seed"
    )
    with node.client() as client:
        parent = create(client, spec)
        made: list[dsec.Sandbox] = []
        snap = None
        try:
            parent.exec(["sh", "-c", fill]).check()
            time.sleep(0.5)
            one = pss(client.get(parent.id).info.pid)["Pss"]
            t = time.perf_counter()
            snap = client.snapshot_memory(parent.id, f"bench-clone-{parent.id}")
            saved = time.perf_counter() - t
            t0 = time.perf_counter()
            with signals_held():
                made = client.restore(snap.name, CLONES)
            with cf.ThreadPoolExecutor(CLONES) as pool:
                list(pool.map(lambda sb: sb.exec("true").check(), made))
            took = time.perf_counter() - t0
            # each clone reads its data once: the pages it shares with the others
            with cf.ThreadPoolExecutor(CLONES) as pool:
                list(pool.map(lambda sb: sb.exec("md5sum /mnt/ram/blob").check(), made))
            time.sleep(0.5)
            rollups = [pss(client.get(sb.id).info.pid) for sb in made]
        finally:
            for sb in [*made, parent]:
                with contextlib.suppress(dsec.DsecError):
                    sb.kill()
            if snap is not None:
                with contextlib.suppress(dsec.DsecError):
                    client.remove_memory_snapshot(snap.name)
    added = sum(r["Pss"] for r in rollups)
    return {
        "clone_memory": memory,
        "clone_fill_mb": fill_mb,
        "clone8_s": round(took, 3),
        "clone8_amortised_ms": round(took / CLONES * 1e3, 1),
        "snapshot_s": round(saved, 3),
        "one_vm_pss_bytes": one,
        "clone8_pss_bytes": added,
        "clone8_added_mem_vs_one": round(added / one, 3) if one else None,
        "clone8_anon_pss_bytes": sum(r["Pss_Anon"] for r in rollups),
        "clone8_file_pss_bytes": sum(r["Pss_File"] for r in rollups),
    }


def given_back(node: KitNode, layers: list[str], n: int, wait: float, copies: int) -> dict:
    """``n`` microVMs (layers over virtio-blk: what a guest reads stays in its page cache)
    each read all of the data layer, write ``copies`` copies of it to their disks (page cache
    too), and go idle for ``wait`` seconds; then what their memory cgroups hold (anonymous and
    mapped file pages). Run on a node with the balloon and the reclaim on, and on one with
    both off."""
    spec = dict(layers=layers, backend="microvm", memory=VM_MEMORY)
    # md5sum reads into its own buffer: a cat to /dev/null splices, touching nothing
    read = "md5sum $(find /opt/bench -type f) > /dev/null"
    read += "".join(f"; cat $(find /opt/bench -type f) > /root/copy{i}" for i in range(copies))
    read += "; sync"
    with node.client() as client:
        create(client, spec).kill()  # the shape's template, before the measure
        vms = []
        try:
            for _ in range(n):
                vms.append(create(client, spec))
            with cf.ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda sb: sb.exec(["sh", "-c", read]).check(), vms))
            read_at = sum(cgroup_held(sb.id) for sb in vms)
            time.sleep(wait)
            held = sum(cgroup_held(sb.id) for sb in vms)
            reclaim = client.node_info().get("reclaim") or {}
        finally:
            for sb in vms:
                with contextlib.suppress(dsec.DsecError):
                    sb.kill()
    return {"read_bytes": read_at, "held_bytes": held, "given_back": reclaim.get("given_back", 0)}


def idle_density(node: KitNode, layers: list[str], n: int, wait: float) -> dict:
    """``n`` idle microVMs of ``VM_MEMORY`` each (started from their template, one ``true``
    run in each, then left alone for ``wait`` seconds on a node with the balloon and reclaim
    on): the host memory one holds (its cgroup: QEMU's anonymous and mapped file pages; and
    its QEMU's PSS), the CPU one burns idle (QEMU's CPU time over the wait: the guest's timer
    ticks, under TCG), and how many of them this host holds by each: the smaller is the
    figure."""
    # the shape of given_back's VMs with the balloon: its template is in the cache already
    spec = dict(layers=layers, backend="microvm", memory=VM_MEMORY)
    with node.client() as client:
        vms = []
        try:
            for _ in range(n):
                sb = create(client, spec)
                vms.append(sb)
                sb.exec("true").check()
            pids = [client.get(sb.id).info.pid for sb in vms]
            time.sleep(min(wait, 2.0))  # the last ones' start settles
            began, cpu0 = time.monotonic(), [cpu_seconds(p) for p in pids]
            time.sleep(wait)
            took = time.monotonic() - began
            cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
            held = [cgroup_held(sb.id) for sb in vms]
            pss_sum = sum(pss(p)["Pss"] for p in pids if p)
        finally:
            for sb in vms:
                with contextlib.suppress(dsec.DsecError):
                    sb.kill()
    per_vm = statistics.median(held)
    share = statistics.median(cpu) / took
    total = meminfo()["MemTotal"]
    # the node keeps a tenth of the host for itself, the page cache and the page tables, and
    # half of its CPUs for the work of the VMs that are not idle
    by_memory = int(total * 0.9 // per_vm) if per_vm else None
    by_cpu = int((os.cpu_count() or 1) * 0.5 / share) if share > 0 else None
    fits = [f for f in (by_memory, by_cpu) if f is not None]
    return {
        "idle_microvm_host_bytes": int(per_vm),
        "idle_microvm_pss_bytes": pss_sum // n,
        "idle_microvm_cpu_share": round(share, 4),
        "idle_microvms_fit_by_memory": by_memory,
        "idle_microvms_fit_by_cpu": by_cpu,
        "idle_microvms_fit": min(fits) if fits else None,
        "idle_microvms_run": n,
    }


def cpu_seconds(pid: int | None) -> float:
    """``pid``'s CPU time so far (0 if it is gone)."""
    stat = proc_stat(pid) if pid else None
    return stat.cpu_seconds if stat is not None else 0.0


# --- the run ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and VMs (< 1 min)")
    add_plot_flag(ap)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root")
    if args.quick:
        rounds, execs, boots, n_vms, data_mb, settle, n_idle = 3, 6, 0, 3, 16, 1.0, 8
        settle_reclaim, copies = 5.0, 5  # 16 MB read and 80 MB written by each VM
    else:
        rounds, execs, boots, n_vms, data_mb, settle, n_idle = 20, 5, 5, 8, 200, 3.0, 32
        settle_reclaim, copies = 10.0, 0  # 200 MB read by each VM

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up as on Ctrl-C
    scratch = Path(tempfile.mkdtemp(prefix="dsec-bench-vm-", dir="/var/tmp"))
    started = time.perf_counter()
    try:
        cache = os.fspath(private_vm_cache(scratch))
        tree = data_tree(scratch, data_mb << 20)
        mem = {}
        # the latency node is the pmem variant's node too: one cold boot fewer
        # the layer transports compared without the balloon (a guest's freed memory stays)
        off = {"DSEC_VM_BALLOON": "0", "DSEC_VM_RECLAIM": "0"}
        with environment(
            DSEC_VM_CACHE=cache, DSEC_VM_LAYERS="pmem", DSEC_VM_SNAPSHOT_START="1", **off
        ):
            with bench_node("dsec-bench-vm-") as node:
                layers = with_data_layer(node, tree)
                t = phase("node, layers", started)
                lat = latency(node, layers, rounds, execs, full_vm=not args.quick)
                t = phase("latency", t)
                clone = clones(node, layers, VM_MEMORY, 128)  # the latency rows' shape
                t = phase("clones", t)
                mem["pmem"] = idle_vms_memory(node, layers, n_vms, settle)
                t = phase("memory, pmem", t)
        gave = {}
        with environment(
            DSEC_VM_CACHE=cache, DSEC_VM_LAYERS="blk", DSEC_VM_SNAPSHOT_START="1", **off
        ):
            with bench_node("dsec-bench-vm-blk-") as node:
                t = phase("node stopped; node started", t)
                layers = with_data_layer(node, tree)
                mem["blk"] = idle_vms_memory(node, layers, n_vms, settle)
                t = phase("memory, blk", t)
                gave["off"] = given_back(node, layers, n_vms, settle_reclaim, copies)
                t = phase("balloon and reclaim off", t)
        with environment(
            DSEC_VM_CACHE=cache,
            DSEC_VM_LAYERS="blk",
            DSEC_VM_BALLOON="1",
            DSEC_VM_RECLAIM="1",
            DSEC_VM_RECLAIM_INTERVAL="1",
        ):
            with bench_node("dsec-bench-vm-balloon-") as node:
                layers = with_data_layer(node, tree)
                gave["on"] = given_back(node, layers, n_vms, settle_reclaim, copies)
                t = phase("balloon and reclaim on", t)
        # the node's defaults (a reclaim pass every 30 s: each asks every guest for its
        # /proc/stat, which the 1 s passes above would add to the idle CPU)
        with environment(DSEC_VM_CACHE=cache, DSEC_VM_LAYERS="blk"):
            with bench_node("dsec-bench-vm-idle-") as node:
                layers = with_data_layer(node, tree)
                density = idle_density(node, layers, n_idle, settle_reclaim)
                t = phase("idle density", t)
        boot: list[float] = []
        if boots:
            with environment(DSEC_VM_CACHE=cache, DSEC_VM_SNAPSHOT_START="0"):
                with bench_node("dsec-bench-vm-boot-") as node, node.client() as client:
                    layers = with_data_layer(node, tree)
                    spec = dict(layers=layers, backend="microvm", memory=VM_MEMORY)
                    boot, _ = create_rounds(client, spec, boots, 0)
                    t = phase("boot every time", t)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    took = time.perf_counter() - started
    report(args.quick, lat, boot, mem, clone, gave, density, rounds, execs, n_vms, data_mb, took)
    if args.plot:
        plot(args.quick, lat, mem, n_vms, data_mb)


def plot(quick: bool, lat: dict[str, dict], mem: dict[str, dict], n_vms: int, data_mb: int) -> None:
    names = {"container": "dsec container (runc)", "gvisor": "dsec gVisor (runsc)"}
    names |= {"microvm": "dsec microVM", "vm": "dsec full VM"}
    ran = [n for n in names if n in lat and "skipped" not in lat[n]]
    title = "Sandboxes as VMs against containers, create and idle memory"
    with figure("vm", title, quick, ncols=2, width=5.4) as (_, (create, memory)):
        p50 = [1e3 * statistics.median(lat[n]["first"]) for n in ran]
        colours = [COLOURS["baseline"] if n == "container" else COLOURS["dsec"] for n in ran]
        bars(create, [names[n] for n in ran], p50, unit="create -> first exec, p50 ms", log=True,
             colours=colours)  # fmt: skip
        # the host's rise (MemTotal - MemAvailable) counts the page cache that pmem's DAX
        # shares; the VMs' cgroups count what each guest holds of its own
        kinds = {"host_used_bytes": "host", "cgroup_bytes": "cgroups"}
        rows = [(f"{over} layers, {name}", mem[over][k] / 1e6) for k, name in kinds.items()
                for over in mem]  # fmt: skip
        colours = [COLOURS["dsec"] if "pmem" in r[0] else COLOURS["baseline"] for r in rows]
        bars(memory, [r[0] for r in rows], [r[1] for r in rows], colours=colours,
             unit=f"MB added by {n_vms} idle VMs that read a {data_mb} MB layer")  # fmt: skip


def report(
    quick: bool,
    lat: dict[str, dict],
    boot: list[float],
    mem: dict[str, dict],
    clone: dict,
    gave: dict,
    density: dict,
    rounds: int,
    execs: int,
    n_vms: int,
    data_mb: int,
    took: float,
) -> None:
    fig: dict[str, object] = {"quick": quick}
    names = {"container": "container (runc)", "gvisor": "gVisor (runsc)"}
    names |= {"microvm": "microVM (fast start)", "vm": "full VM"}
    names["microvm_net"] = "microVM, allowlist net"
    mode = "--quick: fewer rounds, fewer and smaller VMs, no boot-every-time row"
    print(
        f"\n{mode if quick else 'full run'}"
        f" ({took:.0f} s); create -> first exec over {rounds} rounds, exec `true` over "
        f"{rounds * execs}\n"
    )
    print(f"  {'':22} {'create p50':>11} {'create p90':>11} {'exec p50':>9} {'vs runc':>8}")
    base = statistics.median(lat["container"]["first"])
    for name, r in lat.items():
        if "skipped" in r:
            print(f"  {names[name]:22} skipped: {r['skipped']}")
            continue
        p50, p90, ex = (
            statistics.median(r["first"]),
            pct(r["first"], 0.9),
            statistics.median(r["exec"]),
        )
        print(
            f"  {names[name]:22} {ms(p50):>8} ms {ms(p90):>8} ms {ms(ex):>6} ms {p50 / base:>7.1f}x"
        )
        fig[f"{name}_create_p50_ms"] = ms(p50)
        fig[f"{name}_create_p90_ms"] = ms(p90)
        fig[f"{name}_exec_p50_ms"] = ms(ex)
        if name in ("microvm", "microvm_net", "vm"):
            fig[f"{name}_cold_boot_s"] = round(r["warm"], 2)
            fig[f"{name}_create_p50_s"] = round(p50, 3)
    if "microvm_cold_boot_s" in fig:
        print(
            f"  {'microVM first (cold)':22} {fig['microvm_cold_boot_s']:>9} s   "
            "boot + template save"
        )
    if boot:
        fig["microvm_boot_create_p50_s"] = round(statistics.median(boot), 3)
        line = f"{fig['microvm_boot_create_p50_s']:>9} s   p50 of {len(boot)}, snapshot start off"
        print(f"  {'microVM boot each time':22} {line}")

    mb = lambda v: f"{v / 1e6:.0f} MB"  # noqa: E731
    print(
        f"\n{CLONES} clones of a running {clone['clone_memory']} microVM holding "
        f"{clone['clone_fill_mb']} MiB of its own data (a memory snapshot, then restore n)\n"
    )
    print(f"  snapshot                              {clone['snapshot_s']:>8} s")
    print(
        f"  restore until all {CLONES} answer an exec       {clone['clone8_s']:>8} s "
        f"({clone['clone8_amortised_ms']} ms each)"
    )
    print(
        f"  memory: one VM's QEMU PSS / the {CLONES}'s   {mb(clone['one_vm_pss_bytes']):>8} / "
        f"{mb(clone['clone8_pss_bytes'])} ({clone['clone8_added_mem_vs_one']}x; anon "
        f"{mb(clone['clone8_anon_pss_bytes'])}, shared file {mb(clone['clone8_file_pss_bytes'])})"
    )
    fig.update(clone)

    def ratio(key: str) -> float | None:
        pm, bl = mem["pmem"][key], mem["blk"][key]
        return round(pm / bl, 3) if pm > 0 and bl > 0 else None

    print(
        f"\n{n_vms} idle microVMs of {VM_MEMORY} each having read all of a "
        f"{mb(data_mb << 20)} layer: host memory they added\n"
    )
    head = ("system used", "cgroups", "QEMU PSS", "anon", "file", "guest Cached")
    print(f"  {'':18} " + " ".join(f"{h:>12}" for h in head))
    keys = ("host_used_bytes", "cgroup_bytes", "qemu_pss_bytes")
    keys += ("qemu_pss_anon_bytes", "qemu_pss_file_bytes", "guest_cached_bytes")
    for over, r in mem.items():
        print(f"  {'layers over ' + over:18} " + " ".join(f"{mb(r[k]):>12}" for k in keys))
    print(f"  {'pmem / blk':18} " + " ".join(f"{ratio(k)!s:>12}" for k in keys[:3]))
    for over, r in mem.items():
        print(f"  {over} guest: {'; '.join(r['guest_mounts'])}")
    others = max(r["other_qemus"] for r in mem.values())
    if others:
        print(
            f"  note: {others} QEMU processes of others ran on this host during a measure; the "
            "system-wide figure counts whatever they did (the cgroup and PSS ones do not)"
        )
    print(
        "  system used: rise of MemTotal - MemAvailable, page cache dropped before; cgroups: "
        "anon + mapped file pages\n  charged to the VMs' memory cgroups (a shared page once); "
        "QEMU PSS: shared pages split; guest Cached: one guest's"
    )
    for over, r in mem.items():
        for k in ("host_used_bytes", "cgroup_bytes", "qemu_pss_bytes", "guest_cached_bytes"):
            fig[f"{over}_{k.removesuffix('_bytes')}_bytes"] = r[k]
    fig["pmem_vs_blk_host_mem_ratio"] = ratio("cgroup_bytes")
    fig["pmem_vs_blk_system_used_ratio"] = ratio("host_used_bytes")
    fig["pmem_vs_blk_pss_ratio"] = ratio("qemu_pss_bytes")
    fig["other_qemus_during_memory"] = others
    print(
        f"\n{n_vms} microVMs of {VM_MEMORY} (layers over blk) that read all of the "
        f"{mb(data_mb << 20)} layer, then idle: what their cgroups hold\n"
    )
    print(f"  {'':26} {'after the read':>15} {'idle, later':>12} {'given back':>11}")
    for mode, r in gave.items():
        label = "balloon and reclaim " + mode
        print(
            f"  {label:26} {mb(r['read_bytes']):>15} {mb(r['held_bytes']):>12} "
            f"{mb(r['given_back']):>11}"
        )
    on, off = gave["on"]["held_bytes"], gave["off"]["held_bytes"]
    fig["balloon_damon_vs_off_host_mem_ratio"] = round(on / off, 3) if off else None
    fig["balloon_on_held_bytes"], fig["balloon_off_held_bytes"] = on, off
    fig["balloon_given_back_bytes"] = gave["on"]["given_back"]
    print(
        f"  on / off                   {fig['balloon_damon_vs_off_host_mem_ratio']!s:>28}  "
        "(cold memory found by referenced bits: DAMON's sysfs is held by the host's own)"
    )
    fig.update(density)
    print(
        f"\n{density['idle_microvms_run']} idle microVMs of {VM_MEMORY} (the node's defaults: "
        f"balloon, reclaim every 30 s), each:\n  host memory "
        f"{mb(density['idle_microvm_host_bytes'])} (its cgroup, median; QEMU PSS "
        f"{mb(density['idle_microvm_pss_bytes'])}), CPU "
        f"{density['idle_microvm_cpu_share']} of a core\n  this host holds about "
        f"{density['idle_microvms_fit_by_memory']} by memory (90% of MemTotal), "
        f"{density['idle_microvms_fit_by_cpu']} by CPU (half its cores): "
        f"{density['idle_microvms_fit']}"
    )
    fig["idle_vms"], fig["layer_mb"] = n_vms, data_mb
    fig["microvm_create_p50_s"] = fig.get("microvm_create_p50_s")

    print("\ntargets")
    for key, limit in TARGETS.items():
        value = fig.get(key)
        verdict = "n/a" if value is None else ("pass" if value <= limit else "FAIL")
        print(f"  {key:30} {value!s:>8}  <= {limit:<6} {verdict}")
    print()
    print(json.dumps(fig))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
