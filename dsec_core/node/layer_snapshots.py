"""Snapshots that are layers: pack_diff packs a running sandbox's writable layer into a
``snapshot`` layer over the sandbox's layers, and restore makes sandboxes that start from one.

The packing itself (freeze, idmapped view, mkfs.erofs, secret scan) is ``snapshots.pack_upper``
(a VM's: ``snapshots.pack_disk`` of its disk, while the guest holds its filesystem frozen);
this service checks what may be packed, keeps a pack in flight on the sandbox (a kill or a
pause waits for it), pushes a snapshot and the parents a source lacks, and checks a snapshot's
parents before a restore stacks it over them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

from ..backend import Feature, cgroup_path
from ..errors import (
    BackendUnavailable,
    DsecError,
    InvalidSpec,
    MissingParentLayers,
    SandboxNotRunning,
    SandboxPaused,
    UnknownSource,
)
from ..layers.store import LayerStore
from ..records import LayerInfo, LayerRef, SandboxInfo, SandboxSpec, user_labels
from ..sources.base import LayerSource
from ..sources.chain import find_layer
from .host import SnapshotHost, create_all
from .sandbox import Sandbox
from .snapshots import (
    PACK_MARKER,
    PACK_TIMEOUT,
    exclude_paths,
    pack_disk,
    pack_upper,
    scrub_env,
    secret_needles,
)

__all__ = ["LayerSnapshots"]

log = logging.getLogger("dsec.node")


class LayerSnapshots:
    """pack_diff and restore for ``host``'s sandboxes."""

    def __init__(self, host: SnapshotHost) -> None:
        self.host = host

    async def pack_diff(
        self,
        sid: str,
        name: str | None = None,
        version: str | None = None,
        exclude: Sequence[str] = (),
        scrub: bool = True,
        source: str | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> LayerInfo:
        """Pack the running sandbox's writable layer into a ``snapshot`` layer of the node's
        store over the sandbox's layers: ``name`` (default ``snapshot-<id>``), ``version``
        (default: its digest's first 12 hex digits). Paths in ``exclude``, and with ``scrub``
        the usual scratch (``SCRUBBED``: /tmp, caches, shell histories, credentials), are
        left out: a restored sandbox sees the layers below for them, and the environment it
        records leaves out mirrors, proxies and credentials (``SCRUBBED_ENV``). The sandbox
        is frozen while the layer is read. ``secrets`` (label -> text): the packed layer and
        the environment it records are scanned for each (``snapshots.scan_image``); a hit
        keeps no layer and raises ``LeakFound`` naming the paths and labels.
        ``SandboxNotRunning`` if it is not running. ``source``: the URL of one of the node's
        layer sources to push the snapshot to, after those of its parents it lacks, so other
        nodes of that source can restore it."""
        sb = self.host.sandbox(sid)
        if sb.status != "running":
            if sb.died is not None:
                raise sb.not_running()  # SandboxDied, with its cause
            raise SandboxNotRunning(
                f"sandbox {sid} is {sb.status}: only a running sandbox can be packed",
                sandbox_id=sid,
            )
        # the node packs the overlay upper it composed; a disk, only with the guest's help
        on_disk = sb.rt.rootfs is None
        if on_disk and (Feature.PACK_DIFF not in sb.backend.features or sb.rt.disk is None):
            raise BackendUnavailable(
                f"backend {sb.backend.name!r} cannot pack a sandbox's writable layer "
                "(it does not claim Feature.PACK_DIFF)",
                backend=sb.backend.name,
            )
        if on_disk and sb.paused:  # a stopped guest's unwritten data is in its memory
            raise SandboxPaused(
                f"sandbox {sid} is a paused VM: resume it, and its disk is packed with "
                "everything the guest wrote",
                sandbox_id=sid,
            )
        if sb.packing is not None:
            raise InvalidSpec(f"sandbox {sid} is being packed already", sandbox_id=sid)
        needles = secret_needles(secrets or {})
        paths = exclude_paths(exclude, scrub)
        env = scrub_env(sb.rt.spec.env) if scrub else dict(sb.rt.spec.env)
        target = None if source is None else self.source(source)
        parents = list(sb.layers)
        t0 = time.perf_counter()
        what = dict(
            name=name or f"snapshot-{sid}",
            version=version,
            parents=parents,
            exclude=paths,
            source=f"pack_diff of sandbox {sid}",
            env=[f"{k}={v}" for k, v in sorted(env.items())],
            workdir=sb.rt.spec.workdir,
            needles=needles,
        )
        store = LayerStore(self.host.config.layer_dir)
        if on_disk:
            sb.packing = asyncio.ensure_future(self._pack_disk(sb, store, what))
        else:
            sb.packing = asyncio.ensure_future(
                asyncio.to_thread(
                    pack_upper,
                    sb.rt.data_dir / "upper",
                    sb.rt.idmap,
                    cgroup_path(sid),
                    store,
                    marker=sb.rt.dir / PACK_MARKER,
                    paused=sb.paused,
                    **what,  # type: ignore[arg-type]
                )
            )
        sb.packing.add_done_callback(lambda _f: setattr(sb, "packing", None))
        info, frozen = await asyncio.shield(sb.packing)
        log.info(
            "packed sandbox %s as %s: %d bytes, %.1f ms (frozen %.1f ms)",
            sid,
            info.ref,
            info.size,
            1e3 * (time.perf_counter() - t0),
            1e3 * frozen,
        )
        if target is not None:
            await asyncio.to_thread(self.push_layers, target, [*reversed(parents), info])
        return info

    @staticmethod
    async def _pack_disk(
        sb: Sandbox, store: LayerStore, what: Mapping[str, object]
    ) -> tuple[LayerInfo, float]:
        """A VM's pack: the guest freezes the filesystem on its disk (its data written out,
        its writes held; it thaws by itself after ``PACK_TIMEOUT`` should this daemon die
        meanwhile), the node packs the disk's upper, the guest thaws. Returns the layer and
        how long the guest's writes were held."""
        assert sb.rt.disk is not None
        t0 = time.perf_counter()
        await sb.backend.freeze_disk(sb.rt, sb.backend_state, True, PACK_TIMEOUT + 30)
        try:
            info, _ = await asyncio.to_thread(pack_disk, sb.rt.disk, store, **what)
        finally:
            await sb.backend.freeze_disk(sb.rt, sb.backend_state, False, PACK_TIMEOUT + 30)
        return info, time.perf_counter() - t0

    def source(self, url: str) -> LayerSource:
        """The node's layer source at ``url``; ``UnknownSource`` naming them if none is."""
        sources = self.host.layer_sources
        for source in sources:
            if url == source.url:
                return source
        raise UnknownSource(
            f"{url!r} is none of this node's layer sources ({', '.join(s.url for s in sources)})",
            name=url,
            known=[s.url for s in sources],
        )

    def push_layers(self, target: LayerSource, layers: Sequence[LayerInfo]) -> None:
        """Push each of ``layers`` (in order: parents before the snapshot over them) that
        ``target`` does not hold yet with the same digest. Blocking."""
        for info in layers:
            there = target.resolve(LayerRef.parse(info.ref))
            if there is not None and there.digest == info.digest:
                continue
            origin, _ = find_layer(self.host.layer_sources, info.ref)
            target.push(info, origin.image_path(info))

    def checked(self, snapshot: str) -> LayerInfo:
        """The snapshot layer ``snapshot``, once its parents are checked: a restored sandbox
        stacks it over them. ``MissingParentLayers`` naming each parent no source has (or has
        with other content), ``InvalidSpec`` if the layer is not a snapshot."""
        sources = self.host.layer_sources
        _, info = find_layer(sources, snapshot)
        if info.kind != "snapshot":
            raise InvalidSpec(
                f"layer {info.ref} is a {info.kind} layer, not a snapshot", field="snapshot"
            )
        if not info.parents:  # a copy that lost them (made by a tool that predates snapshots)
            raise InvalidSpec(
                f"snapshot {info.ref} records no parent layers: it cannot be restored",
                field="snapshot",
            )
        missing = []
        for ref, digest in zip(info.parents, info.parent_digests, strict=True):
            try:
                _, found = find_layer(sources, ref)
            except DsecError:
                found = None
            if found is None or found.digest != digest:
                missing.append((ref, digest))
        if missing:
            raise MissingParentLayers(
                f"snapshot {info.ref}: parent layer(s) missing: "
                + ", ".join(f"{ref} ({digest})" for ref, digest in missing),
                name=info.ref,
                missing=[f"{ref} {digest}" for ref, digest in missing],
                digests=[digest for _, digest in missing],
            )
        return info

    def restore_spec(self, info: LayerInfo, spec: SandboxSpec | None) -> SandboxSpec:
        """The spec of a sandbox restored from snapshot layer ``info``: ``spec``'s (limits,
        labels), over the snapshot and its parents (no environment), with the snapshot's env
        and workdir under the spec's own."""
        fields = spec.to_dict() if spec is not None else {}
        saved_env = dict(item.partition("=")[::2] for item in info.env)
        workdir = fields.get("workdir", "/")
        if workdir == "/":  # the spec's default: the snapshot's (as for an environment's)
            workdir = info.workdir or "/"
        return SandboxSpec(
            **{
                **fields,
                "environment": None,
                "labels": user_labels(fields.get("labels") or {}),
                "layers": (info.ref, *info.parents),
                "env": {**saved_env, **fields.get("env", {})},
                "workdir": workdir,
            }
        )

    async def restore(
        self, snapshot: str, n: int = 1, spec: SandboxSpec | None = None
    ) -> list[SandboxInfo]:
        """``n`` new sandboxes that each start from snapshot layer ``snapshot``, all or
        nothing (``host.create_all``: a failed create kills those made)."""
        return await create_all(self.host, self.restore_spec(self.checked(snapshot), spec), n)
