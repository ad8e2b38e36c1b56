"""Loads dsec plugins: the ``dsec`` entry-point group for shipped and third-party plugins alike.

``DSEC_PLUGINS`` (comma-separated entry-point names) limits which entry points load;
``DSEC_TRACE_PLUGINS=1`` prints every hook call. Core's own plugins (``CORE_PLUGINS``: the node's
local layer store as the ``local`` source, and best-of-k placement) always load, after the entry
points, and their placement answers last, so a plugin can override it. ``registry()`` collects
what the registration hooks offer and opens layer sources by URL; ``place()`` asks the
placement hooks to pick a node.

A plugin that fails, fails alone: one whose distribution was written for other dsec versions
(the range its ``Requires-Dist: dsec[node]>=0.1,<0.2`` gives does not hold ``__version__``;
checked before it is imported), one that does not import, declares another plugin API than
``PLUGIN_API`` (``DSEC_PLUGIN_API = N`` in its module; none is the first contract's, 1),
implements hooks dsec does not have, or raises or offers something that breaks the contract
while registering, is skipped with a ``PluginFailure`` saying why (``dsec plugins`` shows it,
the log says it once), and everything else goes on. Two plugins that offer one name both lose
it (neither is used). What is missing only matters where it is named: a create that names a
backend no working plugin offers is ``UnknownBackend`` saying which plugins failed, and a node
whose configuration names one (a layer source's scheme, ``DSEC_RUNTIME``) refuses to start
(``Registry.check_node_config``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import itertools
import logging
import operator
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from . import __version__, hookspecs, placement
from .backend import Backend
from .config import NodeConfig
from .errors import (
    DsecError,
    PluginApiMismatch,
    PluginInvalid,
    PluginVersionMismatch,
    UnknownBackend,
    UnknownPolicy,
    UnknownSource,
)
from .records import NodeLoad, SandboxSpec
from .security import SecurityPolicy
from .sources import local as local_source
from .sources.base import LayerSource
from .sources.chain import split_url

__all__ = [
    "API_ATTRIBUTE",
    "CORE_PLUGINS",
    "MIGRATION",
    "PLUGIN_API",
    "DsecPluginManager",
    "PluginFailure",
    "Registry",
    "dsec_range",
    "failures",
    "get_plugin_manager",
    "open_source",
    "place",
    "plugin_descriptions",
    "register_commands",
    "registry",
    "release_range",
    "reset",
]

log = logging.getLogger("dsec.plugins")

ENTRY_POINT_GROUP = "dsec"
#: The plugin API this dsec speaks. 1 was the first contract (before backends declared what
#: they need and give, and before the declaration itself); 2 is the one the docs describe
#: (docs/plugins/index.md).
PLUGIN_API = 2
#: What a plugin module sets to the plugin API it was written for: ``DSEC_PLUGIN_API = 2``.
API_ATTRIBUTE = "DSEC_PLUGIN_API"
#: The API of a plugin that declares none: it predates the declaration.
UNDECLARED_API = 1
#: Where a plugin author reads what changed.
MIGRATION = "the guide 'Migrating a plugin written before this change' (docs/plugins/migrating.md)"
#: Plugins of dsec_core itself, registered on every plugin manager whatever DSEC_PLUGINS says.
CORE_PLUGINS: tuple[tuple[str, ModuleType], ...] = (
    ("core_local_source", local_source),
    ("core_placement", placement),
)


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was skipped, or a name it lost, and why; the other plugins work without it.

    ``stage``: ``version`` (its distribution was written for other dsec versions:
    ``PluginVersionMismatch``; it is not imported), ``import`` (loading its entry point
    raised), ``api`` (it was written for another
    plugin API: ``PluginApiMismatch``), ``hooks`` (it implements hooks dsec does not have, or
    with arguments they do not take), ``register`` (a registration hook raised, or offered
    something that breaks the contract), ``commands`` (``dsec_register_commands`` raised), or
    ``conflict`` (another plugin offers a name it offers too: neither keeps that name, and the
    plugin is not skipped otherwise). ``distribution`` and ``version`` are its package's.
    """

    plugin: str
    stage: str
    error: BaseException
    distribution: str | None = None
    version: str | None = None
    api: Any = None

    @property
    def skipped(self) -> bool:
        """Whether the whole plugin is out (everything but a conflict)."""
        return self.stage != "conflict"

    def describe(self) -> str:
        """The error's message: it names the plugin (and its package) and what to do."""
        return str(self.error)


class DsecPluginManager(pluggy.PluginManager):
    """pluggy's manager, plus what loading the entry points found: each entry-point plugin's
    distribution and declared API, and the ``failures`` of those that were skipped."""

    def __init__(self) -> None:
        super().__init__("dsec")
        self.failures: list[PluginFailure] = []
        self.distributions: dict[str, importlib.metadata.Distribution] = {}
        self.apis: dict[str, Any] = {}
        self.traced = False  # every hook call is printed (``DSEC_TRACE_PLUGINS``)

    def fail(self, name: str, stage: str, error: BaseException, plugin: object = None) -> None:
        """Record ``name``'s failure, log it once, and unregister ``plugin`` (if it is
        registered as ``name``) unless it only lost a name (a conflict)."""
        dist = self.distributions.get(name)
        if any(
            (f.plugin, f.stage, str(f.error)) == (name, stage, str(error)) for f in self.failures
        ):
            return  # a registry built again finds the same conflict again
        failure = PluginFailure(
            plugin=name,
            stage=stage,
            error=error,
            distribution=dist.metadata["Name"] if dist else None,
            version=dist.version if dist else None,
            api=self.apis.get(name),
        )
        self.failures.append(failure)
        if failure.skipped:
            if plugin is not None and self.get_plugin(name) is plugin:
                self.unregister(plugin)
            log.warning("%s; it is skipped (`dsec plugins` lists it)", failure.describe())
        else:
            log.warning("%s", failure.describe())


def declared_api(plugin: object) -> Any:
    """The plugin API a plugin object (its entry point's target) declares: ``API_ATTRIBUTE`` on
    it or on its module; ``UNDECLARED_API`` if neither says."""
    for holder in (plugin, inspect.getmodule(plugin)):
        value = getattr(holder, API_ATTRIBUTE, None)
        if value is not None:
            return value
    return UNDECLARED_API


def _api_mismatch(name: str, dist: str, api: Any) -> PluginApiMismatch | None:
    """The error of an entry-point plugin written for another API than ``PLUGIN_API``."""
    if type(api) is int and api == PLUGIN_API:
        return None
    fields = {"plugin": name, "declared": api, "supported": PLUGIN_API, "see": MIGRATION}
    if type(api) is not int:
        return PluginApiMismatch(
            f"plugin {name!r} ({dist}) declares {API_ATTRIBUTE} = {api!r}, which is no API "
            f"version; this dsec speaks plugin API {PLUGIN_API}: declare "
            f"{API_ATTRIBUTE} = {PLUGIN_API} in its module once it is written for it",
            **fields,
        )
    if api > PLUGIN_API:
        return PluginApiMismatch(
            f"plugin {name!r} ({dist}) was written for dsec plugin API {api}, newer than this "
            f"dsec's {PLUGIN_API}: upgrade dsec, or install a version of the plugin written "
            f"for API {PLUGIN_API}",
            **fields,
        )
    why = "it declares no " + API_ATTRIBUTE if api == UNDECLARED_API else f"it declares {api}"
    return PluginApiMismatch(
        f"plugin {name!r} ({dist}) was written for dsec plugin API {api} ({why}); this dsec "
        f"speaks API {PLUGIN_API}. Migrate it as {MIGRATION} says, then declare "
        f"{API_ATTRIBUTE} = {PLUGIN_API} in its module",
        **fields,
    )


#: ``DSEC_PLUGIN_API = N`` at the start of a line of a plugin's source
_API_LINE = re.compile(
    rb"^" + API_ATTRIBUTE.encode() + rb"\s*(?::[^=]*)?=\s*(\d+)\s*(?:#.*)?$", re.M
)


def _declared_in_source(module: str) -> Any:
    """The API a plugin module that does not import declares in its source (read, not run),
    else ``UNDECLARED_API``."""
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        text = Path(origin).read_bytes() if origin else b""
    except Exception:  # finding a submodule imports its parents, which may fail any way
        return UNDECLARED_API
    found = _API_LINE.search(text)
    return int(found.group(1)) if found else UNDECLARED_API


def release_range(version: str = __version__) -> str:
    """The dsec versions a plugin written for dsec ``version`` declares (``dsec[node]`` and
    this, in its pyproject's dependencies): ``version``'s release series, ``>=0.1,<0.2`` for
    0.1.x (before 1.0 a minor release may change what plugins see), ``>=1.2,<2`` from 1.0 on."""
    v = Version(version)
    if v.major == 0:
        return f">=0.{v.minor},<0.{v.minor + 1}"
    return f">={v.major}.{v.minor},<{v.major + 1}"


def dsec_range(dist: importlib.metadata.Distribution) -> SpecifierSet | None:
    """The dsec versions a plugin's distribution was written for: the specifiers of its own
    requirement on dsec (``dsec[node]>=0.1,<0.2``; empty if it gives no range), or None if it
    requires no dsec. Requirements of its extras (``; extra == "test"``) are not its own."""
    for line in dist.requires or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue  # metadata we cannot read refuses nothing
        if canonicalize_name(requirement.name) != "dsec":
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        return requirement.specifier
    return None


def _version_mismatch(
    name: str, dist: importlib.metadata.Distribution
) -> PluginVersionMismatch | None:
    """The error of a plugin whose distribution requires dsec versions ``__version__`` is not
    among; None if it fits (or says nothing of a range)."""
    wanted = dsec_range(dist)
    if wanted is None or wanted.contains(__version__, prereleases=True):
        return None
    dist_name = dist.metadata["Name"]
    return PluginVersionMismatch(
        f"plugin {name!r} ({dist_name} {dist.version}) was written for dsec {wanted} (its "
        f"distribution requires it), and this is dsec {__version__}: install a version of "
        f"{dist_name} written for dsec {__version__}, or the dsec it was written for",
        plugin=name,
        distribution=dist_name,
        requires=str(wanted),
        running=__version__,
    )


def _from_dsec(e: ImportError) -> bool:
    """Whether ``e`` is about a module or name of dsec's (one that moved or went)."""
    return (e.name or "").split(".")[0] in ("dsec_core", "dsec")


def _moved(mismatch: PluginApiMismatch, e: ImportError) -> PluginApiMismatch:
    """``mismatch``, saying which of dsec's names the plugin could not import."""
    error = PluginApiMismatch(
        f"{mismatch.message} (it imports what this dsec does not have: {type(e).__name__}: "
        f"{e}; the section lists where names moved)",
        **mismatch.context,
        missing=e.name,
    )
    error.__cause__ = e
    return error


def _unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """Hooks ``plugin`` implements that no hookspec defines (what ``check_pending`` refuses)."""
    return sorted(
        caller.name
        for caller in pm.get_hookcallers(plugin) or []
        if caller.spec is None
        and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())
    )


def _load_entry_points(pm: DsecPluginManager, wanted: set[str] | None) -> None:
    """Load and register the ``dsec`` entry points (those in ``wanted``, if given), each on its
    own: one that fails is recorded in ``pm.failures`` and the rest go on."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if wanted is not None and ep.name not in wanted:
            continue
        if pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
            continue
        dist = getattr(ep, "dist", None)
        if dist is not None:
            pm.distributions[ep.name] = dist
        label = f"{dist.metadata['Name']} {dist.version}" if dist else ep.value
        too_old_or_new = _version_mismatch(ep.name, dist) if dist is not None else None
        if too_old_or_new is not None:  # not imported: it may not even import in this dsec
            pm.fail(ep.name, "version", too_old_or_new)
            continue
        try:
            plugin = ep.load()
        except (Exception, SystemExit) as e:  # a plugin's import must not end the host
            api = pm.apis[ep.name] = _declared_in_source(ep.module)
            mismatch = _api_mismatch(ep.name, label, api)
            if isinstance(e, ImportError) and _from_dsec(e) and mismatch is not None:
                # a name it imports from dsec moved or went: the contract it was written for
                pm.fail(ep.name, "api", _moved(mismatch, e))
            else:
                error = _wrapped(f"plugin {ep.name!r} ({label}) does not import", e)
                pm.fail(ep.name, "import", error)
            continue
        api = pm.apis[ep.name] = declared_api(plugin)
        mismatch = _api_mismatch(ep.name, label, api)
        if mismatch is not None:
            pm.fail(ep.name, "api", mismatch)
            continue
        try:
            pm.register(plugin, name=ep.name)
        except (pluggy.PluginValidationError, ValueError) as e:
            error = _wrapped(f"plugin {ep.name!r} ({label}) is refused", e)
            pm.fail(ep.name, "hooks", error, plugin)  # pluggy keeps what it registered so far
            continue
        unknown = _unknown_hooks(pm, plugin)
        if unknown:
            error = PluginInvalid(
                f"plugin {ep.name!r} ({label}) implements hooks dsec does not have: "
                f"{', '.join(unknown)} (dsec's hooks are in dsec_core/hookspecs.py; a plugin "
                f"of plugin API {PLUGIN_API} uses no others)",
                plugin=ep.name,
                hooks=unknown,
            )
            pm.fail(ep.name, "hooks", error, plugin)


def _wrapped(what: str, e: BaseException) -> PluginInvalid:
    """``e`` as the ``PluginInvalid`` of a plugin that failed, with ``e``'s type and message
    (and its context, for a ``DsecError``: ``PluginInvalid`` names what broke the contract)."""
    context = dict(getattr(e, "context", {}))
    shown = str(e) if isinstance(e, DsecError) else f"{type(e).__name__}: {e}"
    error = PluginInvalid(f"{what}: {shown}", **{**context, "cause": type(e).__name__})
    error.__cause__ = e
    return error


def _label(pm: DsecPluginManager, name: str) -> str:
    """``'name' (distribution version)``, or ``'name'`` for a plugin registered by hand."""
    dist = pm.distributions.get(name)
    return f"{name!r} ({dist.metadata['Name']} {dist.version})" if dist else repr(name)


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> DsecPluginManager:
    pm = DsecPluginManager()
    pm.add_hookspecs(hookspecs)
    allowed = os.environ.get("DSEC_PLUGINS")
    wanted = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    _load_entry_points(pm, wanted)
    for name, module in CORE_PLUGINS:
        if pm.get_plugin(name) is None:
            pm.register(module, name=name)
    pm.check_pending()
    if os.environ.get("DSEC_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
        pm.enable_tracing()
        pm.traced = True
    return pm


def reset() -> None:
    """Forget the loaded plugin manager (tests that register plugins by hand use this)."""
    get_plugin_manager.cache_clear()
    registry.cache_clear()


@dataclass(frozen=True)
class Registry:
    """What the loaded plugins offer, by name, and the plugins that failed (``failures``)."""

    backends: dict[str, type[Backend]]
    layer_sources: dict[str, type[LayerSource]]
    security_policies: dict[str, type[SecurityPolicy]]
    failures: tuple[PluginFailure, ...] = ()

    def backend(self, name: str) -> type[Backend]:
        try:
            return self.backends[name]
        except KeyError:
            raise UnknownBackend(
                f"unknown backend {name!r}{self._why_missing('backend', name)}",
                name=name,
                known=sorted(self.backends),
                **self._failed(),
            ) from None

    def layer_source(self, scheme: str) -> type[LayerSource]:
        try:
            return self.layer_sources[scheme]
        except KeyError:
            raise UnknownSource(
                f"unknown layer source scheme {scheme!r}"
                f"{self._why_missing('layer source', scheme)}",
                name=scheme,
                known=sorted(self.layer_sources),
                **self._failed(),
            ) from None

    def security_policy(self, name: str) -> type[SecurityPolicy]:
        try:
            return self.security_policies[name]
        except KeyError:
            raise UnknownPolicy(
                f"unknown security policy {name!r}{self._why_missing('security policy', name)}",
                name=name,
                known=sorted(self.security_policies),
                **self._failed(),
            ) from None

    def _why_missing(self, what: str, name: str) -> str:
        """What the failures say about a name no plugin offers: the conflict over it, else
        the plugins that were skipped (any of them may have been the one)."""
        for f in self.failures:
            context = getattr(f.error, "context", {})
            if f.stage == "conflict" and (context.get("what"), context.get("name")) == (what, name):
                return f": {f.error}"
        return self._skipped_note()

    def _skipped_note(self) -> str:
        skipped = [f for f in self.failures if f.skipped]
        if not skipped:
            return ""
        return "; plugins that failed to load: " + "; ".join(f.describe() for f in skipped)

    def _failed(self) -> dict[str, Any]:
        skipped = sorted({f.plugin for f in self.failures if f.skipped})
        return {"failed": skipped} if skipped else {}

    def open_source(self, url: str, config: NodeConfig | None = None) -> LayerSource:
        """The layer source a URL names (``local``, ``posix:/mnt/x``, ``s3://b/p``, ...), with
        ``config``'s cache directory; ``local`` alone means the node's own store."""
        config = config or NodeConfig.from_env()
        scheme, location = split_url(url)
        cls = self.layer_source(scheme)
        if cls.local and not location:
            location = str(config.layer_dir)
        return cls(location, cache_dir=config.cache_dir)

    def check_node_config(self, config: NodeConfig) -> None:
        """Refuse a node configuration that names what no working plugin offers: a layer
        source's scheme (``UnknownSource``), an OCI runtime no backend runs (``DSEC_RUNTIME``:
        ``UnknownBackend``); each says which plugins failed. What the configuration does not
        name may be missing: the node starts without it."""
        for url in config.layer_sources:
            self.layer_source(split_url(url)[0])
        runtime = config.runtime
        if runtime and not any(runtime in b.runtimes for b in self.backends.values()):
            able = sorted(n for n, b in self.backends.items() if b.runtimes)
            raise UnknownBackend(
                f"DSEC_RUNTIME={runtime!r}: no loaded backend runs OCI runtime {runtime!r} "
                f"(backends with runtimes: {', '.join(able) or 'none'})"
                f"{self._skipped_note()}",
                runtime=runtime,
                known=able,
                **self._failed(),
            )

    def node_sources(self, config: NodeConfig) -> list[LayerSource]:
        """A node's layer sources in the order they are asked (``config.layer_sources``),
        once ``check_node_config`` accepted the configuration (the node asks this as it
        opens, so a node whose configuration names a plugin that failed does not start).

        The node's own store (``local``) is asked last if the list leaves it out: what the
        node packs (``pack_diff`` without a ``source``) goes there, and a restore on the
        node must find it (the chaos soak's nodes, with a shared store and S3 and OCI as
        their sources, answered every restore of their own snapshots ``UnknownSnapshot``)."""
        self.check_node_config(config)
        sources = [self.open_source(url, config) for url in config.layer_sources]
        own = Path(config.layer_dir).resolve()
        if not any(_store_root(s) == own for s in sources):
            sources.append(self.open_source("local", config))
        return sources


#: (hook, what it registers, base class, the attribute that names it, Registry field)
REGISTRATIONS: tuple[tuple[str, str, type, str, str], ...] = (
    ("dsec_register_backends", "backend", Backend, "name", "backends"),
    ("dsec_register_layer_sources", "layer source", LayerSource, "scheme", "layer_sources"),
    ("dsec_register_security_policies", "security policy", SecurityPolicy, "name",
     "security_policies"),
)  # fmt: skip


def _store_root(source: LayerSource) -> Path | None:
    """The directory of a local store source, None for any other kind."""
    if isinstance(source, local_source.LocalLayerSource):
        return source.store.root.resolve()
    return None


def _checked(what: str, base: type, attr: str, cls: Any) -> str:
    """The name ``cls`` registers as; ``PluginInvalid`` if it breaks the contract."""
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
    return name


def _offers(pm: pluggy.PluginManager, plugin: object) -> dict[str, dict[str, type]]:
    """What one plugin's registration hooks offer, by Registry field and name; raises what a
    hook raised, or ``PluginInvalid`` for something that breaks the contract."""
    others = [p for p in pm.get_plugins() if p is not plugin]
    mine = {caller.name for caller in pm.get_hookcallers(plugin) or []}
    out: dict[str, dict[str, type]] = {}
    for hook, what, base, attr, kind in REGISTRATIONS:
        found = out[kind] = {}
        if hook not in mine:
            continue

        def register(cls: Any, what: str = what, base: type = base, attr: str = attr,
                     found: dict[str, type] = found) -> None:  # fmt: skip
            name = _checked(what, base, attr, cls)
            if name in found and found[name] is not cls:
                raise PluginInvalid(
                    f"the plugin registers two {what}s named {name!r}: "
                    f"{_qualname(found[name])} and {_qualname(cls)}",
                    what=what,
                    name=name,
                )
            found[name] = cls

        pm.subset_hook_caller(hook, remove_plugins=others)(register=register)
    return out


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    """Ask each plugin's registration hooks on their own: a plugin whose hook raises or offers
    something that breaks the contract is skipped (``PluginFailure``, stage ``register``), and
    a name two plugins offer goes to neither (stage ``conflict``)."""
    pm = get_plugin_manager()
    claims: dict[str, dict[str, list[tuple[str, type]]]] = {r[4]: {} for r in REGISTRATIONS}
    for name, plugin in list(pm.list_name_plugin()):
        if plugin is None:
            continue
        try:
            offered = _offers(pm, plugin)
        except Exception as e:  # its bug, not the host's: the others go on
            error = _wrapped(f"plugin {_label(pm, name)} failed to register", e)
            pm.fail(name, "register", error, plugin)
            continue
        for kind, named in offered.items():
            for offer, cls in named.items():
                claims[kind].setdefault(offer, []).append((name, cls))
    fields: dict[str, dict[str, Any]] = {}
    for _hook, what, _base, _attr, kind in REGISTRATIONS:
        fields[kind] = {}
        for offer, claimants in claims[kind].items():
            if len({cls for _, cls in claimants}) == 1:
                fields[kind][offer] = claimants[0][1]
                continue
            shown = " and ".join(f"{p} ({_qualname(c)})" for p, c in claimants)
            for plugin_name, _ in claimants:
                error = PluginInvalid(
                    f"two plugins register a {what} named {offer!r}: {shown}; neither is used "
                    "(uninstall one, or limit DSEC_PLUGINS)",
                    what=what,
                    name=offer,
                    plugins=[p for p, _ in claimants],
                )
                pm.fail(plugin_name, "conflict", error)
    return Registry(**fields, failures=tuple(pm.failures))


def failures() -> tuple[PluginFailure, ...]:
    """Every plugin failure so far: loading, registering (``registry()`` is built first), and
    adding commands (``register_commands``)."""
    registry()
    return tuple(get_plugin_manager().failures)


def register_commands(cli: Any) -> None:
    """Let each plugin add its commands to ``cli`` (a click group), on its own: one whose
    ``dsec_register_commands`` raises is skipped and leaves no command behind."""
    pm = get_plugin_manager()
    registry()  # plugins that fail to register are out before they add commands
    for name, plugin in list(pm.list_name_plugin()):
        mine = {caller.name for caller in pm.get_hookcallers(plugin) or []}
        if plugin is None or "dsec_register_commands" not in mine:
            continue
        before = dict(cli.commands)
        others = [p for p in pm.get_plugins() if p is not plugin]
        try:
            pm.subset_hook_caller("dsec_register_commands", remove_plugins=others)(cli=cli)
        except Exception as e:
            cli.commands.clear()
            cli.commands.update(before)
            pm.fail(
                name, "commands", _wrapped(f"plugin {name!r} failed to add commands", e), plugin
            )


def open_source(url: str, config: NodeConfig | None = None) -> LayerSource:
    """``registry().open_source(url, config)``: the layer source a URL names."""
    return registry().open_source(url, config)


def place(request: SandboxSpec, nodes: Sequence[NodeLoad]) -> NodeLoad | None:
    """The node the placement plugins pick for ``request`` among eligible ``nodes`` (None if
    there are none). An answer that is not one of ``nodes`` is a plugin bug: ``DsecError``."""
    if not nodes:
        return None
    pm = get_plugin_manager()
    impls = pm.hook.dsec_place.get_hookimpls()
    if len(impls) == 1 and impls[0].plugin is placement and not pm.traced:
        # core's best-of-k alone answers (no plugin places, none wraps the hook, no trace to
        # print): called as is, which answers one of ``nodes``, without pluggy's call
        return placement.best_of_k(nodes, placement.placement_k(), request=request)
    chosen = pm.hook.dsec_place(request=request, nodes=list(nodes))
    # one of them by identity first (C speed; an equal copy is as good): at 160 nodes,
    # comparing records field by field was a tenth of an apiserver's create
    if (
        chosen is not None
        and not any(map(operator.is_, nodes, itertools.repeat(chosen)))
        and chosen not in nodes
    ):
        raise DsecError(f"a placement plugin chose {chosen!r}, which is not an eligible node")
    return chosen


def plugin_descriptions() -> list[dict[str, Any]]:
    """Name, version, distribution, module, declared plugin API, the dsec versions it was
    written for (``dsec``: its distribution's range, ``""`` if it gives none, None without a
    distribution) and implemented hooks of each plugin, and ``error``: None for a working one,
    else why it was skipped or what name it lost (for ``dsec plugins``). Skipped plugins are
    listed too, with no hooks."""
    pm = get_plugin_manager()
    errors: dict[str, list[str]] = {}
    for f in failures():
        errors.setdefault(f.plugin, []).append(f"{f.stage}: {f.error}")
    core = {name for name, _ in CORE_PLUGINS}
    out = []
    registered = {name: plugin for name, plugin in pm.list_name_plugin() if plugin is not None}
    for name in sorted({*registered, *errors}):
        plugin = registered.get(name)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or []) if plugin else []
        dist = pm.distributions.get(name)
        version, distribution = (dist.version, dist.metadata["Name"]) if dist else (None, None)
        wanted = dsec_range(dist) if dist else None
        written_for = None if dist is None else "" if wanted is None else str(wanted)
        api = pm.apis.get(name)
        if name in core:
            version, distribution, api = __version__, "dsec", PLUGIN_API
            written_for = f"=={__version__}"
        module = getattr(plugin, "__name__", repr(plugin)) if plugin is not None else None
        if module is None and dist is not None:
            eps = [e for e in dist.entry_points if e.group == ENTRY_POINT_GROUP and e.name == name]
            module = eps[0].value if eps else None
        out.append(
            {
                "name": name,
                "version": version,
                "distribution": distribution,
                "module": module,
                "api": api,
                "dsec": written_for,
                "hooks": hooks,
                "error": "; ".join(errors[name]) if name in errors else None,
            }
        )
    return out
