"""Root filesystems: a sandbox's layers found, fetched and mounted, its writable layer made, in
the form its backend asks for, and all of it taken apart again.

``COMPOSED`` backends get the layers mounted (shared through the ``MountCache``) under an
overlay whose upper is the sandbox's writable disk; ``IMAGES`` backends get the layers' image
files and a sparse writable disk, nothing mounted. Fetches of one image are made once for all
concurrent creates that need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from ..backend import Backend, LayerImage, RootfsForm, SandboxRuntime
from ..config import NodeConfig
from ..linux.mounts import bind_onto_itself, mounted_under, unmount
from ..plugins import Registry
from ..records import LayerInfo
from ..sources.base import LayerSource
from ..sources.chain import find_layer
from .disks import WritableDisks
from .idpool import UidPool
from .lazy_layers import LazyLayers
from .mounts import MountCache, OverlayStack
from .sandbox import Sandbox

__all__ = ["RootFilesystems", "sparse_disk"]

log = logging.getLogger("dsec.node")

T = TypeVar("T")


class RootFilesystems:
    """The root filesystems of a node's sandboxes: their writable disks, and from ``open`` on
    (when the node has its layer sources) the shared layer mounts and on-demand layers."""

    def __init__(self, config: NodeConfig, uids: UidPool) -> None:
        self.config = config
        self.disks = WritableDisks(config.disk_dir, config.disk_fs)
        self.uids = uids
        self.mounts: MountCache | None = None
        self.lazy_layers: LazyLayers | None = None
        self.sources: Sequence[LayerSource] = ()
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._mounted_refs: dict[str, str] = {}  # layer digest -> name@version, once mounted

    async def open(self, registry: Registry, sources: Sequence[LayerSource]) -> None:
        """Make the layer mounts and the on-demand layers (taking over those a previous
        daemon served); layers come from ``sources``."""
        cfg = self.config
        self.mounts = MountCache(cfg.mount_dir, cfg.layer_linger)
        self.lazy_layers = LazyLayers(cfg, registry)
        lazy = self.lazy_layers
        if lazy.keeper_socket.exists() or any(lazy.state_dir.glob("*.json")):
            # a previous daemon served on-demand layers: take its connection over (or find
            # it lost, and which layers with it) before anything is adopted
            await asyncio.to_thread(lazy.ensure_open)
        self.sources = sources

    def parents(self) -> tuple[Path, Path]:
        """The directories every sandbox's mounts go under: its writable disk's mount point
        (``sandbox_dir``) and its root filesystem's (``runtime_dir``)."""
        return self.config.sandbox_dir, self.config.runtime_dir

    def bind_parents(self) -> None:
        """Make each of ``parents`` a private bind mount of itself (``bind_onto_itself``):
        the sandboxes' mounts then propagate to no other mount namespace, and a backend can
        start a sandbox in a namespace that sheds all the others' mounts at once (the
        container backend's ``dsec-runc-launch``: runc then reads a mount table of a few
        dozen lines, not two per live sandbox). A directory that is no mount point but has
        mounts below it (a daemon before this change mounted sandboxes there) is left as it
        is."""
        for d in self.parents():
            if not bind_onto_itself(d):
                log.info("%s has sandbox mounts but is no mount point: left as it is", d)

    def release_parents(self) -> None:
        """Undo ``bind_parents`` once no sandbox has a mount below them."""
        for d in self.parents():
            if mounted_under(d) == [d]:
                unmount(d)

    def resolve(self, refs: Sequence[str]) -> list[tuple[LayerSource, LayerInfo]]:
        """(source, layer) for each ``name@version``, from the first source that has it."""
        return [find_layer(self.sources, text) for text in refs]

    def lingering(self) -> list[str]:
        """The layers (``name@version``) mounted now, in use or lingering after their last."""
        held = self.mounts.refcounts() if self.mounts else {}
        return [ref for digest, ref in self._mounted_refs.items() if digest in held]

    def sweep(self) -> None:
        """Unmount the layers that lingered unused long enough (the watch loop's round)."""
        assert self.mounts is not None  # open() made it
        self.mounts.sweep()

    def close(self, keep_lazy_layers: bool) -> None:
        """Let the layer mounts go; the on-demand layers too, unless ``keep_lazy_layers`` (a
        sandbox still reads through them)."""
        if self.mounts:
            self.mounts.close()
        if self.lazy_layers and not keep_lazy_layers:
            self.lazy_layers.close()  # after the layer mounts that read through it
        self.disks.drain()

    def counts(self) -> dict[str, int]:
        """The layer mount cache's hits and misses since the node opened."""
        if self.mounts is None:
            return {}
        return {"hit": self.mounts.hits, "miss": self.mounts.misses}

    async def prepare(
        self,
        rt: SandboxRuntime,
        backend: Backend,
        sources: list[tuple[LayerSource, LayerInfo]],
        taken: list[str],
    ) -> SandboxRuntime:
        """What the backend asks for: mounted layers under an overlay (``COMPOSED``; each
        layer mount taken is appended to ``taken``), or the image files and a writable disk
        (``IMAGES``: nothing is mounted)."""
        files = [await self.layer_files(source, info) for source, info in sources]
        size = self.disks.size_of(rt.limits.disk)
        if backend.rootfs is RootfsForm.IMAGES:  # the disk's size is its quota
            images = tuple(
                LayerImage(info.ref, info.digest, image, device)
                for (_, info), (image, device) in zip(sources, files, strict=True)
            )
            disk = sparse_disk(rt.data_dir, size)
            return replace(rt, images=images, disk=disk, disk_size=size)
        if not self.disks.ready(size):  # mkfs once per size, off the event loop
            await self.once(("disk-template", str(size)), self.disks.template, size)
        assert self.mounts is not None
        mounts = []
        for (_, info), (image, device) in zip(sources, files, strict=True):
            mounts.append(self.mounts.acquire(info.digest, image, device))
            taken.append(info.digest)
            self._mounted_refs[info.digest] = info.ref
        rootfs = rt.dir / "rootfs"
        await to_the_end(self._mount_rootfs, rt, size, mounts, rootfs)
        return replace(rt, rootfs=rootfs)

    def _mount_rootfs(
        self, rt: SandboxRuntime, size: int, mounts: list[Path], rootfs: Path
    ) -> None:
        """Blocking, so called in a thread (the disk's copy, its loop device and the mounts
        take a few ms, and the event loop would serve nothing meanwhile): the writable disk,
        then the overlay of ``mounts`` on it, idmapped to the sandbox's range."""
        self.disks.mount(rt.id, size, rt.data_dir)
        OverlayStack(rt.data_dir, rootfs).mount(
            mounts,
            owner=(rt.idmap.host_base, rt.idmap.root_gid),
            userns=self.uids.namespace(rt.idmap),
        )

    async def layer_files(self, source: LayerSource, info: LayerInfo) -> tuple[Path, Path | None]:
        """What to mount for a layer: (image, None) for a whole image, or (metadata image,
        data blob) to load it on demand."""
        if source.local:
            return source.image_path(info), None
        if self.config.ondemand:
            assert self.lazy_layers is not None
            prepared = await self.once(
                ("lazy", info.digest), self.lazy_layers.prepare, source, info
            )
            if prepared is not None:
                return prepared
        return await self.once(("image", info.digest), source.image_path, info), None

    async def once(self, key: tuple[str, str], fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn(*args)`` in a thread, once for all concurrent callers with the same
        ``key``: a burst of sandboxes of one image fetches it once."""
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            self._inflight[key] = fut
            fut.add_done_callback(lambda _f: self._inflight.pop(key, None))
        return await asyncio.shield(fut)

    async def prefetch(self, refs: Sequence[str]) -> list[dict[str, Any]]:
        """Warm layers on this node: every chunk of on-demand layers, whole remote images."""
        out = []
        for source, info in self.resolve(refs):
            if source.local:
                out.append({"layer": info.ref, "source": source.url, "fetched": 0, "mode": "local"})
                continue
            image, device = await self.layer_files(source, info)
            form = source.lazy_form(info) if device is not None else None
            if form is None:
                out.append(
                    {"layer": info.ref, "source": source.url, "mode": "whole", "fetched": info.size}
                )
                continue
            assert self.lazy_layers is not None
            n = await asyncio.to_thread(self.lazy_layers.prefetch, form.index.blob_digest)
            out.append(
                {
                    "layer": info.ref,
                    "source": source.url,
                    "mode": "on-demand",
                    "fetched": n,
                    "chunks": len(form.index.chunks),
                }
            )
        return out

    async def undo(self, taken: list[str], rt: SandboxRuntime) -> None:
        """Take apart what ``prepare`` made of ``rt`` (``taken``: the layer mounts it took),
        however far it got."""
        try:  # no-op if never mounted
            await to_the_end(OverlayStack(rt.data_dir, rt.dir / "rootfs").unmount)
        finally:
            assert self.mounts is not None
            for digest in taken:
                self.mounts.release(digest)
            await to_the_end(self.remove_dirs, rt)

    async def remove(self, sb: Sandbox) -> tuple[float, float]:
        """Unmount a stopped sandbox's overlay, release its layers, delete its directories;
        the seconds the overlay and then the disk and directories took."""
        return await to_the_end(self._remove, sb)

    def _remove(self, sb: Sandbox) -> tuple[float, float]:
        """Blocking (a thread): ``remove``'s work; the layers are released in the thread too
        (``MountCache`` is thread-safe), once nothing mounts them."""
        t0 = time.perf_counter()
        if sb.rt.rootfs is not None:
            OverlayStack(sb.rt.data_dir, sb.rt.rootfs).unmount()
            assert self.mounts is not None
            for info in sb.layers:
                self.mounts.release(info.digest)
        t_unmount = time.perf_counter()
        self.remove_dirs(sb.rt)
        return t_unmount - t0, time.perf_counter() - t_unmount

    def remove_dirs(self, rt: SandboxRuntime) -> None:
        """Blocking, so called in a thread: unmounting the writable layer's filesystem writes
        back what the sandbox wrote in the last seconds (up to its memory's dirty share)."""
        self.disks.remove(rt.id, rt.data_dir)
        shutil.rmtree(rt.dir, ignore_errors=True)

    def adopt(self, sandboxes: Iterable[Sandbox]) -> None:
        """After a restart: the layer mounts of ``sandboxes`` (those adopted) are theirs; the
        writable layers of any other sandbox (after a reboot, or a crash mid-create) go."""
        kept = {sb.rt.id for sb in sandboxes}
        in_use: dict[str, int] = {}
        for sb in sandboxes:
            for info in sb.layers if sb.rt.rootfs is not None else ():
                in_use[info.digest] = in_use.get(info.digest, 0) + 1
        for ddir in sorted(self.config.sandbox_dir.iterdir()):
            if ddir.name not in kept:
                self.disks.remove(ddir.name, ddir)
        self.disks.sweep(kept)
        assert self.mounts is not None  # open() made it
        self.mounts.adopt(in_use)


async def to_the_end(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread, awaited to its end even when the caller is cancelled
    meanwhile (the cancellation is raised after): an undo that follows a cancelled create
    must find everything the thread mounted, not race it."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({fut})
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller hears
        raise


def sparse_disk(data_dir: Path, size: int) -> Path:
    """A new sparse, unformatted file of ``size`` bytes: an ``IMAGES`` backend's writable disk."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    disk = data_dir / "disk.raw"
    with open(disk, "xb") as f:
        f.truncate(size)
    return disk
