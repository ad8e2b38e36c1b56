"""dsec layer source plugin: the node's local content-addressed layer store.

Scheme ``local``; the location is the store's root directory (default: the node's
``NodeConfig().layer_dir``, i.e. ``$DSEC_HOME/layers``).
"""

from __future__ import annotations

from pathlib import Path

from dsec_core.config import NodeConfig
from dsec_core.errors import UnknownLayer
from dsec_core.hookspecs import hookimpl
from dsec_core.layers.source import LayerSource
from dsec_core.layers.store import LayerStore
from dsec_core.records import LayerInfo, LayerRef

__all__ = ["LocalLayerSource"]


class LocalLayerSource(LayerSource):
    """Layers from a ``LayerStore`` on this machine; images need no fetching."""

    scheme = "local"

    def __init__(self, location: str = "") -> None:
        root = Path(location) if location else NodeConfig.from_env().layer_dir
        super().__init__(str(root))
        self.store = LayerStore(root)

    def resolve(self, ref: LayerRef) -> LayerInfo | None:
        try:
            return self.store.resolve(ref)
        except UnknownLayer:
            return None

    def list(self) -> list[LayerInfo]:
        return self.store.list()

    def image_path(self, info: LayerInfo) -> Path:
        return self.store.image_path(info)


@hookimpl
def dsec_register_layer_sources(register):
    register(LocalLayerSource)
