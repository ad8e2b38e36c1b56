"""Moving layers and catalogs between the node's local store and a layer source.

Push and publish upload what is missing (a layer already there is a no-op); pull fetches into
the local store through the source's verified fetch. Publishing a catalog whose environments
name a layer that is neither built locally nor already in the destination is rejected before
anything is uploaded.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Callable

from ..catalog import Catalog, CatalogStore, parse_catalog
from ..errors import CatalogInvalid, UnknownLayer
from ..records import LayerInfo, LayerRef
from .source import LayerSource
from .store import LayerStore

__all__ = ["Transfer", "push_layer", "pull_layer", "publish_catalog", "pull_catalog",
           "catalog_layer_refs"]

Report = Callable[[str], None]


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
        added = local.add(copy, name=info.name, version=info.version, kind=info.kind,
                          source=src.url)
    return Transfer(added.ref, added.digest, added.size, True)


def catalog_layer_refs(catalog: Catalog) -> list[str]:
    """Every layer the catalog's environments use, once each, in a stable order."""
    seen: dict[str, None] = {}
    for env in catalog.environments:
        for ref in env.layer_refs():
            seen.setdefault(ref, None)
    return list(seen)


def publish_catalog(catalog: Catalog, dest: LayerSource, local: LayerStore,
                    report: Report | None = None) -> list[Transfer]:
    """Push the catalog's layers that ``dest`` lacks, then the catalog itself."""
    refs = catalog_layer_refs(catalog)
    missing = []
    plan: list[tuple[str, bool]] = []  # (ref, have locally)
    for ref in refs:
        if local.exists(ref):
            plan.append((ref, True))
        elif dest.resolve(LayerRef.parse(ref)) is not None:
            plan.append((ref, False))
        else:
            missing.append(ref)
    if missing:
        raise CatalogInvalid(
            f"catalog {catalog.name}: layer(s) {', '.join(missing)} are neither built on this "
            f"node nor in {dest.url}; build them first (dsec catalog build)",
            path="$.environments", missing=missing)
    done = []
    for ref, have in plan:
        if have:
            t = push_layer(ref, dest, local)
        else:
            info = dest.resolve(LayerRef.parse(ref))
            t = Transfer(info.ref, info.digest, info.size, False)
        done.append(t)
        if report:
            order = " (data in read-profile order)" if t.moved and t.profiled else ""
            report(f"{'pushed' if t.moved else 'present'} {t.ref} {t.digest[:19]}{order}")
    dest.put_catalog(catalog.name, catalog.to_document())
    if report:
        report(f"published catalog {catalog.name} to {dest.url}")
    return done


def pull_catalog(name: str, src: LayerSource, local: LayerStore, catalogs: CatalogStore,
                 report: Report | None = None) -> tuple[Catalog, list[LayerInfo]]:
    """Fetch catalog ``name`` and every layer it uses into this node; register it."""
    doc = src.get_catalog(name)
    catalog = parse_catalog(doc, where=f"{src.url} catalog {name}", check_sources=False,
                            check_layers=False)
    pulled = []
    for ref in catalog_layer_refs(catalog):
        t = pull_layer(ref, src, local)
        pulled.append(local.resolve(ref))
        if report:
            report(f"{'pulled' if t.moved else 'present'} {t.ref} {t.digest[:19]}")
    catalogs.save(catalog)
    if report:
        report(f"registered catalog {catalog.name}")
    return catalog, pulled
