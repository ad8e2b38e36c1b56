"""``dsec apiserver``: the one entry of a dsec cluster (see ``app`` for what each route does,
``nodes`` for the watcher, ``server`` for running it)."""

from .app import OVERFLOW_LABEL, Gateway, make_app
from .nodes import NodeAddress, NodeEntry, NodeSet, WatchSettings
from .server import ApiserverConfig, build, serve

__all__ = [
    "OVERFLOW_LABEL",
    "ApiserverConfig",
    "Gateway",
    "NodeAddress",
    "NodeEntry",
    "NodeSet",
    "WatchSettings",
    "build",
    "make_app",
    "serve",
]
