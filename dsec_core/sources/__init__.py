"""Layer sources: where EROFS layers and catalogs come from (the contract in ``base``), the node's
own store as a source (``local``), finding a layer in an ordered list (``chain``), and moving
layers between a store and a source (``transfer``)."""

from .base import BlobStoreSource, LayerSource, fetch_verified, split_for_publishing
from .chain import find_layer, split_url
from .local import LocalLayerSource
from .transfer import Transfer, pull_layer, push_layer

__all__ = [
    "BlobStoreSource",
    "LayerSource",
    "LocalLayerSource",
    "Transfer",
    "fetch_verified",
    "find_layer",
    "pull_layer",
    "push_layer",
    "split_for_publishing",
    "split_url",
]
