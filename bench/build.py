#!/usr/bin/env python3
"""Building environments through the builder vs as Dockerfiles with docker, in one run.

Ten variants of one environment that share a base (the default catalog's ``python``
environment: the Debian base and the toolkit): each copies its own variant of a small public
repository (pypa/sampleproject, from the demo's test data) into /workspace/sample and installs
its dependency (peppercorn) with pip from a local PEP 503 index (``dsec_builder.pkgindex``).

- builder: each variant is a build (``dsec_builder``): a session from ``python`` whose policy
  grants only the index, and a plan replayed by the scripted driver (``run_plan``): the
  variant's files written, the install run, then ``finish`` with one declared check (scrub,
  pack_diff, QA in a fresh sandbox, publish). Bytes stored: the layer store's blobs the ten
  environments use, each blob counted once (the base and the toolkit once). The bench's
  builds, layers and catalogs are removed at the end.
- docker: each variant is a Dockerfile ``FROM`` the same base (dsec's base and toolkit layers
  exported into the daemon first, not timed), ``COPY`` of the variant and a ``RUN`` of the same
  install command, built one after the other by a dockerd this script starts on a private
  socket and data root (``--bridge=none --iptables=false``; builds run with ``--network host``
  to reach the index on loopback) and stops by pid at the end. Bytes stored: the sizes of the
  unique layers of the ten images (each layer counted once, the base once: chain IDs and the
  daemon's layer database), and, as cross-checks, what its data root holds on disk and the
  ten images' sizes summed (each with its base: what ten ``docker save`` archives, or a
  registry that shares no layers between repositories, would hold).

The variants are built one each way in turn, the order alternating, so a shared machine's
drift hits both sides alike; each side's time is the sum of its builds.

    python bench/build.py [--quick] [--variants N]

--quick: 3 variants instead of 10 (under a minute once the catalog is built). The last line
printed is one JSON object; ``builder_vs_docker_time_ratio`` and
``builder_vs_docker_bytes_ratio`` (unique layers on both sides) are builder / docker (below 1:
the builder is faster, stores less); ``builder_vs_docker_images_bytes_ratio`` compares with
the images summed, ``builder_vs_docker_time_ratio_without_qa`` leaves QA's time out (docker
checks nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from dsec_builder.pkgindex import EgressIndex, LoopbackIndex

from dsec_core.catalog.model import default_catalog_file
from dsec_core.config import NodeConfig
from dsec_core.demo import ensure_catalog
from dsec_core.errors import ToolError
from dsec_core.layers.image import export_image
from dsec_core.layers.store import LayerStore
from dsec_core.sdk import Client
from dsec_core.testing import PrivateDockerd, private_dockerd

HERE = Path(__file__).resolve().parent
ENV = "python"
CPUS = float(os.cpu_count() or 1)
TARGET_BYTES_RATIO = 0.2  # the layers should store at most 1/5 of docker's bytes


# --- the variants ---------------------------------------------------------------------------
def variant_tree(root: Path, k: int) -> Path:
    """Variant ``k`` of the sample repository: the repository plus a module of its own."""
    from dsec_builder.demo import SAMPLE_PROJECT

    dest = root / f"variant-{k}" / "sample"
    shutil.copytree(SAMPLE_PROJECT, dest)
    (dest / "src" / "sample" / "variant.py").write_text(
        f'"""Variant {k} of the benchmark\'s environment."""\n\nVARIANT = {k}\n'
    )
    return dest


# --- docker ---------------------------------------------------------------------------------
def docker(dockerd: PrivateDockerd, *args: str, **kw) -> subprocess.CompletedProcess:
    """``docker ARGS`` against the bench's daemon; a failure ends the bench."""
    r = dockerd.run(*args, **kw)
    if r.returncode != 0:
        raise SystemExit(f"docker {' '.join(args[:3])} failed: {r.stderr[-2000:]}")
    return r


@contextlib.contextmanager
def bench_dockerd() -> Iterator[PrivateDockerd]:
    """The kit's private dockerd, under /var/tmp (the images want room); no docker ends the
    bench."""
    with contextlib.ExitStack() as stack:
        try:
            dockerd = stack.enter_context(private_dockerd("/var/tmp"))
        except ToolError as e:
            raise SystemExit(f"bench: {e}") from e
        yield dockerd


def docker_base(
    dockerd: PrivateDockerd, store: LayerStore, refs_top_first: list[str], tag: str
) -> None:
    """Make ``tag`` in the daemon from dsec's layers: ``export_image`` (a docker archive, one
    layer per dsec layer), then ``docker load``."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        archive = Path(tmp) / "base.tar"
        export_image(store, refs_top_first, archive, tag=tag)
        docker(dockerd, "load", "-i", os.fspath(archive))


def docker_variant(dockerd: PrivateDockerd, base: str, tree: Path, k: int, install: str) -> str:
    """Build variant ``k``'s image (``FROM base``, ``COPY`` the tree, ``RUN install``); its tag."""
    ctx = tree.parent
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\nCOPY sample /workspace/sample\nRUN {json.dumps(['sh', '-c', install])}\n"
    )
    tag = f"dsec-bench-variant:{k}"
    docker(
        dockerd,
        "build", "-q", "--network", "host", "-t", tag, os.fspath(ctx),
        env={**os.environ, "DOCKER_BUILDKIT": "0"},  # no buildx here: the classic builder
    )  # fmt: skip
    return tag


def docker_bytes(dockerd: PrivateDockerd, tags: list[str]) -> int:
    """The sizes of the unique layers of ``tags`` as the daemon stores them, each counted once
    (the base's, shared by every variant, once): the layers' chain IDs from each image's
    ``RootFS.Layers`` and each layer's size from the daemon's layer database (``docker
    history`` cannot tell a loaded image's layers apart: their IDs are all "<missing>")."""
    sizes: dict[str, int] = {}
    layerdb = dockerd.data_root / "image" / "overlay2" / "layerdb" / "sha256"
    for tag in tags:
        diff_ids = json.loads(
            docker(dockerd, "image", "inspect", "--format", "{{json .RootFS.Layers}}", tag).stdout
        )
        chain = ""
        for diff_id in diff_ids:
            # the image spec's ChainID: the first layer's DiffID, then
            # sha256(parent ChainID + " " + DiffID)
            chain = diff_id if not chain else "sha256:" + _sha256(f"{chain} {diff_id}")
            sizes[chain] = int((layerdb / chain.split(":", 1)[1] / "size").read_text())
    return sum(sizes.values())


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def image_size(dockerd: PrivateDockerd, tag: str) -> int:
    """An image's whole size, its base's layers included."""
    return int(docker(dockerd, "image", "inspect", "--format", "{{.Size}}", tag).stdout)


def du_bytes(path: Path) -> int:
    r = subprocess.run(["du", "-sb", os.fspath(path)], capture_output=True, text=True)
    return int(r.stdout.split()[0]) if r.returncode == 0 else 0


# --- dsec -----------------------------------------------------------------------------------
def dsec_bytes(store: LayerStore, refs: set[str]) -> int:
    """The bytes of the store's blobs behind ``refs``, each blob counted once."""
    blobs = {info.digest: info.size for info in (store.resolve(r) for r in refs)}
    return sum(blobs.values())


class Builder:
    """Variants built through the builder (``dsec_builder``): each a session from ``ENV``
    whose policy grants only the index, and a plan replayed by the scripted driver (the
    variant's files written, the install run, ``finish`` with one declared check: scrub,
    pack_diff, QA, publish). Keeps the seconds of each phase summed over the variants
    (session start, file writes, the install, finish, and of finish QA), the published
    layers' refs and the builds' names."""

    def __init__(self, index: EgressIndex) -> None:
        from dsec_builder import BuildContext, BuildPolicy, PackageIndex

        self.index = index
        self.policy = BuildPolicy((PackageIndex("pip", index.url),))
        self.ctx = BuildContext.from_env()
        self.phases = dict.fromkeys(("start", "writes", "install", "finish", "qa"), 0.0)
        self.refs: list[str] = []
        self.names: list[str] = []

    def build(self, k: int, tree: Path) -> None:
        from dsec_builder import BuildSession, BuildTools
        from dsec_builder.demo import files_of, install_command
        from dsec_builder.plan import run_plan

        name = f"bench-build-variant-{k}"
        forget(self.ctx, name)
        files = files_of(tree)
        dirs = sorted({posixpath.dirname(f"/workspace/sample/{p}") for p in files})
        writes: list[dict] = [{"tool": "exec", "args": {"command": "mkdir -p " + " ".join(dirs)}}]
        writes += [
            {"tool": "write", "args": {"path": f"/workspace/sample/{p}", "content": text}}
            for p, text in files.items()
        ]
        install = [
            {"tool": "exec", "args": {"command": install_command(self.index.url)}, "expect_exit": 0}
        ]
        check = (
            "cd /workspace/sample && PYTHONPATH=src python3 -c 'import sample.variant, peppercorn'"
        )
        finish = [{"tool": "finish", "args": {"checks": [{"name": "imports", "command": check}]}}]
        t = time.perf_counter()
        # as many CPUs as docker's build containers get (no limit): the session's default is
        # one, which throttles pip
        session = BuildSession.start(
            self.ctx, from_env=ENV, name=name, version="1", policy=self.policy, cpu=CPUS
        )
        self.names.append(name)
        self.phases["start"] += time.perf_counter() - t
        try:
            tools = BuildTools(session)
            for phase, plan in (("writes", writes), ("install", install), ("finish", finish)):
                t = time.perf_counter()
                done = run_plan(plan, tools)[-1]
                self.phases[phase] += time.perf_counter() - t
        finally:
            session.kill()
        self.refs.append(f"{done['layer']['name']}@{done['layer']['version']}")
        self.phases["qa"] += done["report"]["seconds"]

    def close(self) -> None:
        """Remove the bench's builds and what they published; the default catalog stays."""
        try:
            for name in self.names:
                forget(self.ctx, name)
        finally:
            self.ctx.close()


def forget(ctx, name: str) -> None:
    """Remove build ``name`` and what it published (a previous run's): its session, record,
    catalog and layers."""
    from dsec_core.catalog.store import CatalogStore
    from dsec_core.errors import DsecError

    store = LayerStore(ctx.config.layer_dir)
    with contextlib.suppress(DsecError):
        record = ctx.store.get(name)
        with contextlib.suppress(DsecError):
            ctx.client.kill(record.sandbox_id)
        ctx.store.remove(name)
    with contextlib.suppress(DsecError):
        CatalogStore(ctx.config.catalog_dir).remove(name)
    for info in store.list():
        if info.name in (name, f"staged-{name}"):
            store.remove(info.ref, force=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 variants (under a minute)")
    ap.add_argument("--variants", type=int, default=None, help="how many variants (default 10)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root")
    n = args.variants or (3 if args.quick else 10)

    from dsec_builder.demo import index_wheels, install_command

    config = NodeConfig.from_env()
    config.ensure_dirs()
    catalog = ensure_catalog(default_catalog_file(), config)
    env = catalog.environment(ENV)
    store = LayerStore(config.layer_dir)
    env_refs = [*env.toolkits, *env.workspaces, env.base]  # top first
    fig: dict = {"quick": args.quick, "variants": n, "environment": ENV}

    with tempfile.TemporaryDirectory(prefix="dsec-bench-build-", dir="/var/tmp") as tmp_:
        tmp = Path(tmp_)
        wheels = index_wheels(tmp / "wheels")
        trees = [variant_tree(tmp / "variants", k) for k in range(n)]

        Client().close()  # start the embedded node if none runs
        with contextlib.ExitStack() as stack:
            eindex = stack.enter_context(EgressIndex(config.home, wheels, tmp / "egress.jsonl"))
            dockerd = stack.enter_context(bench_dockerd())
            lindex = stack.enter_context(LoopbackIndex(wheels))
            builder = Builder(eindex)
            stack.callback(builder.close)
            started = time.perf_counter()
            docker_base(dockerd, store, env_refs, "dsec-bench-base:1")
            fig["docker_base_seconds"] = round(time.perf_counter() - started, 2)
            install = install_command(lindex.url)
            tags: list[str] = []
            spent = {"builder": 0.0, "docker": 0.0}
            for k, tree in enumerate(trees):
                # one variant each way in turn, the order alternating: a shared machine's
                # drift hits both sides alike
                for way in ("builder", "docker") if k % 2 == 0 else ("docker", "builder"):
                    t = time.perf_counter()
                    if way == "builder":
                        builder.build(k, tree)
                    else:
                        tags.append(docker_variant(dockerd, "dsec-bench-base:1", tree, k, install))
                    spent[way] += time.perf_counter() - t
            fig["builder_seconds"] = round(spent["builder"], 2)
            fig["builder_qa_seconds"] = round(builder.phases["qa"], 2)
            fig["builder_phase_seconds"] = {k: round(v, 2) for k, v in builder.phases.items()}
            fig["builder_bytes"] = dsec_bytes(store, {*env_refs, *builder.refs})
            fig["builder_variant_bytes_mean"] = round(dsec_bytes(store, set(builder.refs)) / n)
            fig["docker_seconds"] = round(spent["docker"], 2)
            fig["docker_bytes"] = docker_bytes(dockerd, ["dsec-bench-base:1", *tags])
            base_bytes = docker_bytes(dockerd, ["dsec-bench-base:1"])
            fig["docker_variant_bytes_mean"] = round((fig["docker_bytes"] - base_bytes) / n)
            # what the ten images weigh one by one (``docker save`` of each, a registry
            # without cross-repository layer sharing): the base in each of them
            fig["docker_images_total_bytes"] = sum(image_size(dockerd, t) for t in tags)
            fig["docker_data_root_bytes"] = du_bytes(dockerd.data_root)

    fig["builder_vs_docker_time_ratio"] = round(fig["builder_seconds"] / fig["docker_seconds"], 3)
    fig["builder_vs_docker_time_ratio_without_qa"] = round(
        (fig["builder_seconds"] - fig["builder_qa_seconds"]) / fig["docker_seconds"], 3
    )
    # docker's images one by one (each with its base) against the layers, for that accounting
    fig["builder_vs_docker_images_bytes_ratio"] = round(
        fig["builder_bytes"] / fig["docker_images_total_bytes"], 3
    )
    fig["builder_vs_docker_bytes_ratio"] = round(fig["builder_bytes"] / fig["docker_bytes"], 3)

    def mb(b: int) -> str:
        return f"{b / 1e6:.1f} MB"

    rows = [
        ("builder: wall time", f"{fig['builder_seconds']} s"),
        (
            "  start / writes / install / finish (QA)",
            " / ".join(f"{fig['builder_phase_seconds'][k]}" for k in ("start", "writes", "install"))
            + f" / {fig['builder_phase_seconds']['finish']} ({fig['builder_qa_seconds']}) s",
        ),
        ("docker: wall time (base import not counted)", f"{fig['docker_seconds']} s"),
        ("builder: layer blobs stored", mb(fig["builder_bytes"])),
        ("docker: unique image layers", mb(fig["docker_bytes"])),
        ("docker: its data root on disk", mb(fig["docker_data_root_bytes"])),
        (
            "per variant, builder / docker",
            f"{fig['builder_variant_bytes_mean'] / 1e3:.1f} kB / "
            f"{fig['docker_variant_bytes_mean'] / 1e3:.1f} kB",
        ),
        ("docker: the images' sizes summed", mb(fig["docker_images_total_bytes"])),
        (
            "builder / docker, time (without QA)",
            f"{fig['builder_vs_docker_time_ratio']} "
            f"({fig['builder_vs_docker_time_ratio_without_qa']})",
        ),
        ("builder / docker, bytes (unique layers)", fig["builder_vs_docker_bytes_ratio"]),
        (
            "builder / docker, bytes (the images summed)",
            fig["builder_vs_docker_images_bytes_ratio"],
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{n} variants of {ENV!r} sharing its base ({'quick' if args.quick else 'full'})")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    ok = fig["builder_vs_docker_bytes_ratio"] <= TARGET_BYTES_RATIO
    print(
        f"  {'met' if ok else 'MISSED'}: builder_vs_docker_bytes_ratio = "
        f"{fig['builder_vs_docker_bytes_ratio']} (<= {TARGET_BYTES_RATIO}, a 5x win)"
    )
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
