"""Building a catalog: every missing layer recipe into the layer store, then registering it."""

from __future__ import annotations

from collections.abc import Callable

from ..layers.recipes import build_recipe
from ..layers.store import LayerStore, Progress
from ..records import LayerInfo
from .model import Catalog, check_environment_layers
from .store import CatalogStore

__all__ = ["PullCatalog", "build_catalog"]

#: Pulls catalog ``name`` with its layers from the layer source at ``url`` into the node's
#: stores (``distribution.pull_catalog`` with the source opened).
PullCatalog = Callable[[str, str], None]


def build_catalog(
    catalog: Catalog,
    layer_store: LayerStore,
    catalog_store: CatalogStore,
    progress: Progress | None = None,
    pull: PullCatalog | None = None,
) -> list[LayerInfo]:
    """Build every recipe not yet in ``layer_store``, then register the catalog.

    The catalogs it imports come first: a file import is built and registered the same way,
    a source import is pulled with ``pull`` (a registered one is there already). Returns the
    layer of every recipe of ``catalog`` itself, built now or found in the store (a recipe
    changed without a version bump is ``LayerStale``). ``progress`` gets stages named
    ``"<name@version>: <stage>"``.
    """
    for spec, other in zip(catalog.imports, catalog.imported, strict=False):
        if spec.path is not None:
            build_catalog(other, layer_store, catalog_store, progress, pull)
        elif spec.source is not None and pull is not None:
            pull(spec.source, other.name)
    infos = []
    for recipe in catalog.layers:

        def stage(name: str, fraction: float | None, _ref: str = recipe.ref) -> None:
            if progress:
                progress(f"{_ref}: {name}", fraction)

        infos.append(build_recipe(recipe, layer_store, stage))
    check_environment_layers(
        catalog.environments, catalog.visible_layers(), layer_store, catalog.path or catalog.name
    )
    catalog_store.save(catalog)
    return infos
