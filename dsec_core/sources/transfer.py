"""Moving layers between a local layer store and a layer source.

Push uploads what is missing (a layer already there is a no-op), with the layer's read profile
if it has one; pull fetches into the local store through the source's verified fetch.
Catalogs move with ``dsec_core.catalog.distribution``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from ..errors import UnknownLayer
from ..layers.store import LayerStore
from ..records import LayerRef
from .base import LayerSource

__all__ = ["Transfer", "pull_layer", "push_layer"]


@dataclass(frozen=True)
class Transfer:
    """What one push or pull did to one layer."""

    ref: str
    digest: str
    size: int
    moved: bool  # False: the other side had it already
    profiled: bool = False  # pushed with its data blob in read-profile order


def push_layer(ref: str, dest: LayerSource, local: LayerStore) -> Transfer:
    """Publish ``ref`` from ``local`` to ``dest``, with its read profile if it has one."""
    info = local.resolve(LayerRef.parse(ref))
    profile = local.load_profile(info)
    if profile is None:  # keep sources that predate profiles working
        moved = dest.push(info, local.image_path(info))
    else:
        moved = dest.push(info, local.image_path(info), profile=profile)
        if moved:  # a stale profile is skipped (with a warning): say what was published
            form = dest.lazy_form(info)
            profile = profile if form is not None and form.index.layout else None
    return Transfer(info.ref, info.digest, info.size, moved, profile is not None)


def pull_layer(ref: str, src: LayerSource, local: LayerStore) -> Transfer:
    parsed = LayerRef.parse(ref)
    info = src.resolve(parsed)
    if info is None:
        known = sorted(i.ref for i in src.list())
        raise UnknownLayer(f"{src.url}: no layer {ref!r}", name=ref, known=known)
    if local.exists(info.ref) and local.resolve(info.ref).digest == info.digest:
        return Transfer(info.ref, info.digest, info.size, False)
    image = src.image_path(info)  # verified against info.digest
    with local.scratch("pull-") as tmp:
        copy = tmp / "image.erofs"
        shutil.copyfile(image, copy)  # add() moves its input; the source's copy stays
        added = local.add(
            copy,
            name=info.name,
            version=info.version,
            kind=info.kind,
            source=src.url,
            **info.lineage(),  # a snapshot's pulled copy still knows what it goes over
        )
    return Transfer(added.ref, added.digest, added.size, True)
