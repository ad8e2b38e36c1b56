"""Loads dsec plugins: the ``dsec`` entry-point group for shipped and third-party plugins alike.

``DSEC_PLUGINS`` (comma-separated entry-point names) limits which load; ``DSEC_TRACE_PLUGINS=1``
prints every hook call. ``registry()`` collects what the registration hooks offer.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .errors import UnknownBackend, UnknownSource

__all__ = ["get_plugin_manager", "Registry", "registry", "plugin_descriptions", "reset"]

ENTRY_POINT_GROUP = "dsec"


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("dsec")
    pm.add_hookspecs(hookspecs)
    allowed = os.environ.get("DSEC_PLUGINS")
    if allowed is None:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    else:
        wanted = {n.strip() for n in allowed.split(",") if n.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in wanted and pm.get_plugin(ep.name) is None:
                pm.register(ep.load(), name=ep.name)
    pm.check_pending()
    if os.environ.get("DSEC_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
        pm.enable_tracing()
    return pm


def reset() -> None:
    """Forget the loaded plugin manager (tests that register plugins by hand use this)."""
    get_plugin_manager.cache_clear()
    registry.cache_clear()


@dataclass(frozen=True)
class Registry:
    """What the loaded plugins offer, by name."""

    backends: dict[str, type]
    layer_sources: dict[str, type]
    security_policies: dict[str, type]

    def backend(self, name: str) -> type:
        try:
            return self.backends[name]
        except KeyError:
            raise UnknownBackend(f"unknown backend {name!r}", name=name,
                                 known=sorted(self.backends)) from None

    def layer_source(self, scheme: str) -> type:
        try:
            return self.layer_sources[scheme]
        except KeyError:
            raise UnknownSource(f"unknown layer source scheme {scheme!r}", name=scheme,
                                known=sorted(self.layer_sources)) from None


def _collect(hook: Any, attr: str) -> dict[str, type]:
    found: dict[str, type] = {}

    def register(cls: type) -> None:
        found[getattr(cls, attr)] = cls

    hook(register=register)
    return found


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    hook = get_plugin_manager().hook
    return Registry(
        backends=_collect(hook.dsec_register_backends, "name"),
        layer_sources=_collect(hook.dsec_register_layer_sources, "scheme"),
        security_policies=_collect(hook.dsec_register_security_policies, "name"),
    )


def plugin_descriptions() -> list[dict[str, Any]]:
    """Name, version, module and implemented hooks of each loaded plugin (for ``dsec plugins``)."""
    pm = get_plugin_manager()
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    out = []
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda p: p[0]):
        if plugin is None:
            continue
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        dist = dists.get(id(plugin))
        out.append({
            "name": name,
            "version": dist.version if dist else None,
            "distribution": dist.metadata["Name"] if dist else None,
            "module": getattr(plugin, "__name__", repr(plugin)),
            "hooks": hooks,
        })
    return out
