"""Renamed ``dsec_core.cluster.node_keeper`` (it keeps one node's daemon): this stub warns on
import and goes in the next release."""

from ..renamed import warn_renamed
from .node_keeper import KeeperSettings, NodeKeeper

__all__ = ["KeeperSettings", "NodeKeeper"]

warn_renamed(__name__, "dsec_core.cluster.node_keeper")
