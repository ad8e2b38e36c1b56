"""``dsec apiserver``: the one entry of a dsec cluster (see ``app`` for what each route does,
``nodes`` for the watcher, ``server`` for running it)."""

from .app import BUILD_ROLES, OVERFLOW_LABEL, Gateway, is_staged, make_app, may_build
from .nodes import NodeAddress, NodeEntry, NodeSet, WatchSettings
from .server import ApiserverConfig, build, serve

__all__ = [
    "BUILD_ROLES",
    "OVERFLOW_LABEL",
    "ApiserverConfig",
    "Gateway",
    "NodeAddress",
    "NodeEntry",
    "NodeSet",
    "WatchSettings",
    "build",
    "is_staged",
    "make_app",
    "may_build",
    "serve",
]
