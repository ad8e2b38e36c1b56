"""The contract for security policy plugins (file rules, network allowlists, seccomp, ...).

A sandbox names the policies it wants in ``SandboxSpec.policies`` (name -> settings); those
apply to it, plus the ``default`` policies its backend can enforce. Before anything is set up,
the node checks each one: the policy exists (``UnknownPolicy``), its settings are valid
(``validate``: ``InvalidSpec``), this host can run it (``check_available``) and it can be
enforced on the sandbox's backend (``enforceable_on``): if not, the create fails with
``PolicyUnavailable``, never silently without the policy. ``SandboxSpec.network`` modes other
than ``"none"`` must be enforced by a requested policy that lists the mode in ``network_modes``;
a policy whose ``implied_by`` names the mode is added with empty settings when the sandbox does
not list it (``network="internet"`` needs no rules, so naming the mode is enough).

Two settings keys belong to the node, not the policy (it never sees them): ``"enabled": false``
turns a policy off for the sandbox (a ``default`` one, typically), and ``"best_effort": true``
lets the sandbox start without a policy the host or backend cannot enforce. Either way the
sandbox's ``SandboxInfo.policies`` says which policies are in force and why others are not.

Enforcement happens at the backend's enforcement points (``Backend.policy_targets``): there the
backend calls ``rt.enforce(target, subject)`` and the node calls ``apply(target, ...)`` of each
policy the sandbox asked for that lists ``target``. The container backend offers ``"agent"``
(an ``AgentPolicy`` the policy adds its part to: a seccomp program, Landlock file rules; the
sandbox's agent enforces it on itself and everything it starts, before it serves), ``"oci"``
(``apply_oci`` gets the container's OCI runtime config before it starts) and ``"started"``
(a ``StartedSandbox`` once it runs, before any command does). A policy that lists several
targets is called at each the backend offers and picks by ``rt.targets``. ``released`` is
called when the sandbox is gone, ``close`` when the node closes.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .backend import Backend, SandboxRuntime
from .errors import InvalidSpec

__all__ = ["CONFINING_RUNTIMES", "NODE_SETTINGS", "FileRules", "SecurityPolicy", "loosenings"]

#: Settings keys that belong to the node, not the policy (it never sees them): ``enabled``
#: (false turns the policy off for the sandbox) and ``best_effort`` (true lets the sandbox
#: start without a policy the host or backend cannot enforce).
NODE_SETTINGS = ("enabled", "best_effort")

#: What ``FileRules.scope`` may name: ``signal`` (no signals to processes outside the sandbox's
#: file-policy domain, the agent included) and ``abstract_unix`` (no connecting to abstract unix
#: sockets made outside it).
SCOPES = ("abstract_unix", "signal")
MAX_PATHS = 256


@dataclass(frozen=True)
class FileRules:
    """A sandbox's file policy, as the file-policy plugins (Landlock, AppArmor) read their
    settings: paths inside the sandbox that are ``read_only`` (no writes, renames, removals or
    new entries beneath; reading and running stay allowed) or ``hidden`` (not even read), and
    what is ``scope``d to the sandbox's processes (``SCOPES``).

    Settings: ``{"read_only": ["/usr/local/bin"], "hidden": ["/judge"], "scope": ["signal"]}``.
    """

    read_only: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    scope: tuple[str, ...] = ()

    @classmethod
    def parse(cls, settings: Mapping[str, Any], policy: str) -> FileRules:
        """Read and check ``settings``; ``InvalidSpec`` naming ``policies.<policy>.<key>[i]``
        for anything else: unknown keys, paths that are not absolute, hold ``..``, NUL or
        are ``/`` itself, unknown scopes."""
        where = f"policies.{policy}"
        unknown = sorted(set(settings) - {"read_only", "hidden", "scope"})
        if unknown:
            raise InvalidSpec(
                f"{where}: unknown setting(s) {unknown}; known: hidden, read_only, scope",
                field=f"{where}.{unknown[0]}",
            )
        paths = {
            key: _paths(settings.get(key, []), f"{where}.{key}") for key in ("read_only", "hidden")
        }
        scope = settings.get("scope", [])
        if not isinstance(scope, list) or any(s not in SCOPES for s in scope):
            raise InvalidSpec(
                f"{where}.scope must be a list of {', '.join(SCOPES)}", field=f"{where}.scope"
            )
        return cls(
            read_only=paths["read_only"], hidden=paths["hidden"], scope=tuple(sorted(set(scope)))
        )


def _paths(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_PATHS:
        raise InvalidSpec(
            f"{field} must be a list of at most {MAX_PATHS} absolute paths", field=field
        )
    out = []
    for i, path in enumerate(value):
        bad = (
            not isinstance(path, str)
            or not path.startswith("/")
            or "\0" in path
            or ".." in path.split("/")
            or posixpath.normpath(path) == "/"
        )
        if bad:
            raise InvalidSpec(
                f"{field}[{i}]: {path!r} is not an absolute path inside the sandbox "
                "(no '..', not '/' itself)",
                field=f"{field}[{i}]",
            )
        out.append(posixpath.normpath(path))
    return tuple(dict.fromkeys(out))


class SecurityPolicy:
    """Subclass, set ``name`` and ``targets``, register from ``dsec_register_security_policies``.

    The node makes one instance per policy and node.
    """

    name: ClassVar[str]
    #: Enforcement points the policy works through; it can enforce on a backend that offers
    #: any of them (``Backend.policy_targets``), e.g. ``{"oci"}``.
    targets: ClassVar[frozenset[str]] = frozenset()
    #: ``SandboxSpec.network`` modes this policy enforces (e.g. ``{"allowlist"}``).
    network_modes: ClassVar[frozenset[str]] = frozenset()
    #: Network modes (of ``network_modes``) for which a sandbox that does not list this policy
    #: gets it with empty settings (``{}`` must then be valid settings), as a ``default``
    #: policy is added; a mode whose settings matter, such as an allowlist, is not one.
    implied_by: ClassVar[frozenset[str]] = frozenset()
    #: Applied to every sandbox whose backend can enforce it, unless the sandbox's spec turns
    #: it off (``{"enabled": false}``); where the backend cannot, the sandbox runs without it
    #: and its ``SandboxInfo.policies`` says so.
    default: ClassVar[bool] = False
    #: Settings can change while the sandbox runs (``update``).
    live: ClassVar[bool] = False
    #: Settings that show the policy at work (for the docs and ``bench/security.py``), with
    #: the ``SandboxSpec.network`` mode they need, if any: ``(settings, network)``.
    example: ClassVar[tuple[Mapping[str, Any], str]] = ({}, "none")

    @classmethod
    def check_available(cls) -> None:
        """Raise ``PolicyUnavailable`` if this host lacks what the policy needs. The node asks
        before creates that name the policy and keeps the answer a few seconds
        (``AVAILABILITY_TTL``)."""

    @classmethod
    def enforceable_on(cls, backend: type[Backend]) -> bool:
        """Whether the policy can be enforced on sandboxes of ``backend``."""
        return bool(cls.targets & backend.policy_targets)

    def validate(self, settings: Mapping[str, Any]) -> None:
        """Raise ``InvalidSpec`` if ``settings`` are not valid for this policy."""

    @classmethod
    def loosens(cls, settings: Mapping[str, Any]) -> str | None:
        """Why ``settings`` (the node's keys left out) would let a sandbox do what it may not
        without them, or None if they only take away. Keys of roles that may not loosen
        policies (IAM's ``can_loosen``: member and agent keys) get ``PermissionDenied`` for
        settings this gives a reason for. The default: settings of a ``default`` policy
        change what every sandbox gets, so any are a loosening; settings of an opt-in policy
        only add restrictions. Override to be exact (seccomp: only ``allow`` and ``userns``
        loosen)."""
        if cls.default and settings:
            return f"settings {sorted(settings)} change the default {cls.name} policy"
        return None

    def apply(
        self, target: str, rt: SandboxRuntime, settings: Mapping[str, Any], subject: Any
    ) -> None:
        """Enforce the policy on ``subject`` at enforcement point ``target`` (one of
        ``targets``); the default hands "oci" to ``apply_oci``."""
        if target == "oci":
            self.apply_oci(rt, settings, subject)

    def apply_oci(
        self, rt: SandboxRuntime, settings: Mapping[str, Any], config: dict[str, Any]
    ) -> None:
        """Tighten a container's OCI runtime config in place before it starts (target "oci")."""

    def update(self, rt: SandboxRuntime, settings: Mapping[str, Any]) -> None:
        """Enforce new (already validated) ``settings`` on a running sandbox (``live`` only)."""
        raise NotImplementedError(f"security policy {self.name!r} cannot change live")

    def adopted(self, rt: SandboxRuntime, settings: Mapping[str, Any]) -> None:
        """A restarted node daemon took over this running sandbox: pick up what the policy
        keeps for it (pinned objects, counters)."""

    def stats(self, rt: SandboxRuntime) -> Mapping[str, Any]:
        """What the policy saw of the sandbox so far (e.g. denied attempts), for
        ``dsec sandbox inspect``; JSON values."""
        return {}

    def released(self, rt: SandboxRuntime) -> None:
        """The sandbox is gone; drop anything kept for it."""

    def close(self) -> None:
        """The node is closing: stop the policy's threads and drop what it made for the node
        as a whole (on first use, say) that no sandbox still running needs; sandboxes may
        outlive the daemon, and a restarted one adopts them."""


#: OCI runtimes any sandbox may ask for: they add a kernel of the sandbox's own (gVisor), so
#: they are never weaker than a node's default; naming another may be (a node whose default
#: is runsc, asked for runc).
CONFINING_RUNTIMES = frozenset({"runsc"})


def loosenings(
    policies: Mapping[str, Mapping[str, Any]],
    network: str,
    known: Mapping[str, type[SecurityPolicy]],
    *,
    runtime: str | None = None,
    live: bool = False,
    open_networks: frozenset[str] = frozenset(),
) -> list[str]:
    """What a sandbox's ``policies``, ``network`` mode and OCI ``runtime`` (or, ``live``, a
    change of one running sandbox's policy settings) would loosen against the node's default,
    one reason each; empty if they only tighten. ``known`` are the policy classes by name
    (the plugin registry's): a policy not among them cannot be shown to only tighten, so it
    counts.

    Loosening: a network mode other than ``"none"`` (loopback only is the default); turning a
    ``default`` policy off or letting it be skipped (``enabled: false``, ``best_effort``);
    settings a policy's ``loosens`` gives a reason for; live, any change of a policy's settings
    (they replace the old ones: an allowlist may widen, a file rule go). ``open_networks``:
    network modes the operator lets any key ask for (``DSEC_OPEN_NETWORKS``), which then do
    not count."""
    out = []
    if runtime is not None and runtime not in CONFINING_RUNTIMES:
        out.append(
            f"runtime {runtime!r} may be weaker than the node's default (a key that may only "
            f"tighten may name {', '.join(sorted(CONFINING_RUNTIMES))})"
        )
    if network != "none" and network not in open_networks:
        out.append(f"network {network!r} opens the sandbox's network (the default is 'none')")
    for name, raw in policies.items():
        cls = known.get(name)
        if cls is None:
            out.append(f"policy {name!r} is not one this apiserver knows, so it may loosen")
            continue
        if raw.get("enabled", True) is False and (cls.default or live):
            out.append(f"enabled: false turns the {name} policy off")
        if raw.get("best_effort", False) is True and cls.default:
            out.append(f"best_effort lets the default {name} policy be skipped")
        if live:  # new settings replace the old: fewer rules may allow more
            out.append(f"changing the {name} policy live may widen what it allows")
        why = cls.loosens({k: v for k, v in raw.items() if k not in NODE_SETTINGS})
        if why:
            out.append(why)
    return out
