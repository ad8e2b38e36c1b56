"""Building a catalog: every missing layer recipe into the layer store, then registering it."""

from __future__ import annotations

from ..layers.recipes import build_recipe
from ..layers.store import LayerStore, Progress
from ..records import LayerInfo
from .model import Catalog, check_environment_layers
from .store import CatalogStore

__all__ = ["build_catalog"]


def build_catalog(
    catalog: Catalog,
    layer_store: LayerStore,
    catalog_store: CatalogStore,
    progress: Progress | None = None,
) -> list[LayerInfo]:
    """Build every recipe not yet in ``layer_store``, then register the catalog.

    Returns the layer of every recipe, built now or found in the store. ``progress`` gets
    stages named ``"<name@version>: <stage>"``.
    """
    infos = []
    for recipe in catalog.layers:

        def stage(name: str, fraction: float | None, _ref: str = recipe.ref) -> None:
            if progress:
                progress(f"{_ref}: {name}", fraction)

        infos.append(build_recipe(recipe, layer_store, stage))
    check_environment_layers(catalog.environments, (), layer_store, catalog.path or catalog.name)
    catalog_store.save(catalog)
    return infos
