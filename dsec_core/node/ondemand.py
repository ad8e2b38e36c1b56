"""Renamed ``dsec_core.node.lazy_layers`` (``OnDemandLayers`` is ``LazyLayers``): this stub
warns on import and goes in the next release."""

from ..renamed import warn_renamed
from .lazy_layers import LazyLayers as OnDemandLayers

__all__ = ["OnDemandLayers"]

warn_renamed(__name__, "dsec_core.node.lazy_layers")
