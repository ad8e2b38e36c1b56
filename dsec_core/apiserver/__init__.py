"""``dsec apiserver``: the one entry of a dsec cluster (see ``app`` for what each route does,
``auth`` for the key check before it, ``reach`` for what a key may reach, ``nodes`` for the
watcher and the ledger of what is placed, ``server`` for running it)."""

from .app import OVERFLOW_LABEL, Gateway, make_app
from .nodes import NodeAddress, NodeEntry, NodeSet, WatchSettings
from .reach import BUILD_ROLES, Reach, is_staged, may_build, scope_tag
from .server import ApiserverConfig, build, serve

__all__ = [
    "BUILD_ROLES",
    "OVERFLOW_LABEL",
    "ApiserverConfig",
    "Gateway",
    "NodeAddress",
    "NodeEntry",
    "NodeSet",
    "Reach",
    "WatchSettings",
    "build",
    "is_staged",
    "make_app",
    "may_build",
    "scope_tag",
    "serve",
]
