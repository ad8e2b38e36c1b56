"""Loads dsec plugins: the ``dsec`` entry-point group for shipped and third-party plugins alike.

``DSEC_PLUGINS`` (comma-separated entry-point names) limits which entry points load;
``DSEC_TRACE_PLUGINS=1`` prints every hook call. Core's own plugins (``CORE_PLUGINS``: the node's
local layer store as the ``local`` source, and best-of-k placement) always load, after the entry
points, and their placement answers last, so a plugin can override it. ``registry()`` collects
what the registration hooks offer and opens layer sources by URL; ``place()`` asks the
placement hooks to pick a node.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from . import __version__, hookspecs, placement
from .backend import Backend
from .config import NodeConfig
from .errors import DsecError, PluginInvalid, UnknownBackend, UnknownPolicy, UnknownSource
from .records import NodeLoad, SandboxSpec
from .security import SecurityPolicy
from .sources import local as local_source
from .sources.base import LayerSource
from .sources.chain import split_url

__all__ = [
    "CORE_PLUGINS",
    "Registry",
    "get_plugin_manager",
    "open_source",
    "place",
    "plugin_descriptions",
    "registry",
    "reset",
]

ENTRY_POINT_GROUP = "dsec"
#: Plugins of dsec_core itself, registered on every plugin manager whatever DSEC_PLUGINS says.
CORE_PLUGINS: tuple[tuple[str, ModuleType], ...] = (
    ("core_local_source", local_source),
    ("core_placement", placement),
)


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
    for name, module in CORE_PLUGINS:
        if pm.get_plugin(name) is None:
            pm.register(module, name=name)
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

    backends: dict[str, type[Backend]]
    layer_sources: dict[str, type[LayerSource]]
    security_policies: dict[str, type[SecurityPolicy]]

    def backend(self, name: str) -> type[Backend]:
        try:
            return self.backends[name]
        except KeyError:
            raise UnknownBackend(
                f"unknown backend {name!r}", name=name, known=sorted(self.backends)
            ) from None

    def layer_source(self, scheme: str) -> type[LayerSource]:
        try:
            return self.layer_sources[scheme]
        except KeyError:
            raise UnknownSource(
                f"unknown layer source scheme {scheme!r}",
                name=scheme,
                known=sorted(self.layer_sources),
            ) from None

    def security_policy(self, name: str) -> type[SecurityPolicy]:
        try:
            return self.security_policies[name]
        except KeyError:
            raise UnknownPolicy(
                f"unknown security policy {name!r}", name=name, known=sorted(self.security_policies)
            ) from None

    def open_source(self, url: str, config: NodeConfig | None = None) -> LayerSource:
        """The layer source a URL names (``local``, ``posix:/mnt/x``, ``s3://b/p``, ...), with
        ``config``'s cache directory; ``local`` alone means the node's own store."""
        config = config or NodeConfig.from_env()
        scheme, location = split_url(url)
        cls = self.layer_source(scheme)
        if cls.local and not location:
            location = str(config.layer_dir)
        return cls(location, cache_dir=config.cache_dir)

    def node_sources(self, config: NodeConfig) -> list[LayerSource]:
        """A node's layer sources in the order they are asked (``config.layer_sources``)."""
        return [self.open_source(url, config) for url in config.layer_sources]


def _collect(hook: Any, what: str, base: type, attr: str) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def register(cls: type) -> None:
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PluginInvalid(
                f"a plugin registered {cls!r} as a {what}, but it is not a "
                f"subclass of {base.__module__}.{base.__qualname__}",
                what=what,
                offered=repr(cls),
            )
        name = getattr(cls, attr, None)
        if not isinstance(name, str) or not name:
            raise PluginInvalid(
                f"{what} {cls.__qualname__} has no {attr!r} (a non-empty string)",
                what=what,
                offered=repr(cls),
            )
        if issubclass(cls, Backend):
            cls.check_contract()
        if name in found and found[name] is not cls:
            raise PluginInvalid(
                f"two plugins register a {what} named {name!r}: {found[name].__module__}."
                f"{found[name].__qualname__} and {cls.__module__}.{cls.__qualname__}",
                what=what,
                offered=repr(cls),
            )
        found[name] = cls

    hook(register=register)
    return found


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    hook = get_plugin_manager().hook
    return Registry(
        backends=_collect(hook.dsec_register_backends, "backend", Backend, "name"),
        layer_sources=_collect(
            hook.dsec_register_layer_sources, "layer source", LayerSource, "scheme"
        ),
        security_policies=_collect(
            hook.dsec_register_security_policies, "security policy", SecurityPolicy, "name"
        ),
    )


def open_source(url: str, config: NodeConfig | None = None) -> LayerSource:
    """``registry().open_source(url, config)``: the layer source a URL names."""
    return registry().open_source(url, config)


def place(request: SandboxSpec, nodes: Sequence[NodeLoad]) -> NodeLoad | None:
    """The node the placement plugins pick for ``request`` among eligible ``nodes`` (None if
    there are none). An answer that is not one of ``nodes`` is a plugin bug: ``DsecError``."""
    if not nodes:
        return None
    chosen = get_plugin_manager().hook.dsec_place(request=request, nodes=list(nodes))
    if chosen is not None and not any(chosen is n or chosen == n for n in nodes):
        raise DsecError(f"a placement plugin chose {chosen!r}, which is not an eligible node")
    return chosen


def plugin_descriptions() -> list[dict[str, Any]]:
    """Name, version, module and implemented hooks of each loaded plugin (for ``dsec plugins``)."""
    pm = get_plugin_manager()
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    core = {name for name, _ in CORE_PLUGINS}
    out = []
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda p: p[0]):
        if plugin is None:
            continue
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        dist = dists.get(id(plugin))
        version, distribution = (dist.version, dist.metadata["Name"]) if dist else (None, None)
        if name in core:
            version, distribution = __version__, "dsec"
        out.append(
            {
                "name": name,
                "version": version,
                "distribution": distribution,
                "module": getattr(plugin, "__name__", repr(plugin)),
                "hooks": hooks,
            }
        )
    return out
