"""Moving catalogs between this node and a layer source: publish a catalog with the layers it
uses, or pull one with its layers into the node's stores.

Publishing a catalog whose environments name a layer that is neither built locally nor already
in the destination is rejected before anything is uploaded.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CatalogInvalid
from ..layers.store import LayerStore
from ..records import LayerInfo, LayerRef
from ..sources.base import LayerSource
from ..sources.transfer import Transfer, pull_layer, push_layer
from .model import Catalog, parse_catalog
from .store import CatalogStore

__all__ = ["catalog_layer_refs", "publish_catalog", "pull_catalog"]

Report = Callable[[str], None]


def catalog_layer_refs(catalog: Catalog) -> list[str]:
    """Every layer the catalog's environments use, once each, in a stable order."""
    seen: dict[str, None] = {}
    for env in catalog.environments:
        for ref in env.layer_refs():
            seen.setdefault(ref, None)
    return list(seen)


def publish_catalog(
    catalog: Catalog, dest: LayerSource, local: LayerStore, report: Report | None = None
) -> list[Transfer]:
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
            path="$.environments",
            missing=missing,
        )
    done = []
    for ref, have in plan:
        if have:
            t = push_layer(ref, dest, local)
        else:
            info = dest.resolve(LayerRef.parse(ref))
            assert info is not None  # checked above: the destination has it
            t = Transfer(info.ref, info.digest, info.size, False)
        done.append(t)
        if report:
            order = " (data in read-profile order)" if t.moved and t.profiled else ""
            report(f"{'pushed' if t.moved else 'present'} {t.ref} {t.digest[:19]}{order}")
    dest.put_catalog(catalog.name, catalog.to_document())
    if report:
        report(f"published catalog {catalog.name} to {dest.url}")
    return done


def pull_catalog(
    name: str,
    src: LayerSource,
    local: LayerStore,
    catalogs: CatalogStore,
    report: Report | None = None,
) -> tuple[Catalog, list[LayerInfo]]:
    """Fetch catalog ``name`` and every layer it uses into this node; register it."""
    doc = src.get_catalog(name)
    catalog = parse_catalog(
        doc, where=f"{src.url} catalog {name}", check_sources=False, check_layers=False
    )
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
