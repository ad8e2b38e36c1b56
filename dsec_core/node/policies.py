"""Security policy planning: which policies a sandbox gets on a backend (``PolicyPlanner.plan``),
the live change of one's settings, and the plan a restarted daemon reads back.

The planner holds the node's one instance of each policy and a short cache of whether this
host can run it; it sees the plugin registry and the sandboxes it is handed, nothing of the
node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..backend import Backend, Feature
from ..errors import DsecError, PolicyUnavailable
from ..plugins import Registry
from ..records import PolicyState, SandboxSpec
from ..security import NODE_SETTINGS, SecurityPolicy
from .sandbox import PolicyPlan, Sandbox

__all__ = ["AVAILABILITY_TTL", "PolicyPlanner", "enforcer"]

log = logging.getLogger("dsec.node")

#: Seconds a policy's ``check_available`` answer is kept: it runs before every create that
#: names the policy, and what it checks (tools, kernel features) rarely changes.
AVAILABILITY_TTL = 5.0


class PolicyPlanner:
    """The security policies of a node: one instance of each, made on first use."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.policies: dict[str, SecurityPolicy] = {}
        # policy name -> (monotonic time checked, why it is unavailable or None)
        self._available: dict[str, tuple[float, PolicyUnavailable | None]] = {}

    def policy(self, name: str) -> SecurityPolicy:
        """The node's instance of policy ``name`` (``UnknownPolicy``); whether this host can
        run it is ``enforceable``'s question."""
        policy = self.policies.get(name)
        if policy is None:
            policy = self.policies[name] = self.registry.security_policy(name)()
        return policy

    def plan(self, spec: SandboxSpec, backend: Backend) -> PolicyPlan:
        """The policies for a sandbox of ``spec`` on ``backend``: those it asks for and the
        ``default`` ones and one ``implied_by`` the network mode, each checked to be
        enforceable there; ``spec.network`` must be enforced by the backend ("none") or by one
        of them. Raises before anything is set up:
        ``UnknownPolicy``, ``InvalidSpec`` (settings) or ``PolicyUnavailable`` (unless the
        policy is a default or ``best_effort``: then it is skipped, with the reason)."""
        plan = PolicyPlan()
        requested = {n: dict(s) for n, s in spec.policies.items()}
        defaults = {n for n, c in self.registry.security_policies.items() if c.default}
        for name in sorted(defaults - set(requested)):
            requested[name] = {}
        implied = sorted(
            n for n, c in self.registry.security_policies.items() if spec.network in c.implied_by
        )
        needed = set(spec.policies)
        if implied and not set(implied) & set(requested):
            requested[implied[0]] = {}
            needed.add(implied[0])  # the mode needs it: its absence is the create's error
        for name, raw in requested.items():
            settings = {k: v for k, v in raw.items() if k not in NODE_SETTINGS}
            if raw.get("enabled", True) is False:
                plan.skipped[name] = "off: the sandbox's spec turned it off"
                continue
            policy = self.policy(name)
            try:
                # Settings first: bad ones are the caller's mistake on any host, best effort
                # or not (InvalidSpec); a validate that finds the host lacking what these
                # settings need raises PolicyUnavailable like the checks after it.
                policy.validate(settings)
                self.enforceable(policy, backend)
            except PolicyUnavailable as e:
                if name in needed and not raw.get("best_effort", False):
                    raise
                plan.skipped[name] = f"skipped: {e}"
                continue
            plan.chosen.append((policy, settings))
        self._check_network(spec, backend, plan)
        return plan

    def enforceable(self, policy: SecurityPolicy, backend: Backend) -> None:
        """``PolicyUnavailable`` unless this host can run ``policy`` on ``backend``."""
        name = policy.name
        checked, why = self._available.get(name, (-AVAILABILITY_TTL, None))
        now = time.monotonic()
        if now - checked >= AVAILABILITY_TTL:
            try:
                policy.check_available()
                why = None
            except PolicyUnavailable as e:
                why = e
            self._available[name] = (now, why)
        if why is not None:
            raise why.with_traceback(None)
        if not policy.enforceable_on(type(backend)):
            raise PolicyUnavailable(
                f"security policy {name!r} cannot be enforced on backend {backend.name!r}: "
                f"it works through {sorted(policy.targets) or 'nothing'}, the backend "
                f"offers {sorted(backend.policy_targets) or 'nothing'}",
                policy=name,
                backend=backend.name,
            )

    def _check_network(self, spec: SandboxSpec, backend: Backend, plan: PolicyPlan) -> None:
        if spec.network == "none":
            if Feature.NET_NAMESPACE not in backend.features:
                raise PolicyUnavailable(
                    f"backend {backend.name!r} does not isolate the network, so network='none' "
                    "(loopback only) cannot be enforced",
                    policy="network",
                    backend=backend.name,
                )
        elif not any(spec.network in p.network_modes for p, _ in plan.chosen):
            able = sorted(
                n
                for n, c in self.registry.security_policies.items()
                if spec.network in c.network_modes
            )
            raise PolicyUnavailable(
                f"network mode {spec.network!r} needs a security policy that enforces it in the "
                f"sandbox's policies ({', '.join(able) or 'no loaded policy does'})",
                policy="network",
                backend=backend.name,
                network=spec.network,
                able=able,
            )

    def recorded(
        self, sid: str, saved: Mapping[str, Any] | None, spec: SandboxSpec, backend: Backend
    ) -> PolicyPlan:
        """The policies a sandbox started with, as its state recorded them (``saved``: the
        state's ``policy_plan``; None: state written before plans were recorded, planned
        again)."""
        try:
            if saved is None:
                return self.plan(spec, backend)
            plan = PolicyPlan(skipped=dict(saved.get("skipped") or {}))
            for name, settings in (saved.get("chosen") or {}).items():
                plan.chosen.append((self.policy(name), dict(settings)))
            return plan
        except DsecError as e:  # it ran with them and keeps running, but cannot release them
            log.warning("sandbox %s: its security policies are not all here any more: %s", sid, e)
            return PolicyPlan()

    @staticmethod
    def states(sb: Sandbox) -> list[PolicyState]:
        """Every policy considered for the sandbox: in force (with its settings and what it
        saw so far) or not (with the reason)."""
        out = [
            PolicyState(name=p.name, state="enforced", settings=dict(s), stats=dict(p.stats(sb.rt)))
            for p, s in sb.policies.chosen
        ]
        out += [PolicyState(name=n, state=r) for n, r in sb.policies.skipped.items()]
        return sorted(out, key=lambda p: p.name)

    @staticmethod
    def change(sb: Sandbox, name: str, settings: Mapping[str, Any]) -> PolicyState:
        """Change the settings of a ``live`` policy in force on a running sandbox (its plan
        is updated; saving it is the caller's)."""
        sid = sb.rt.id
        if sb.status != "running":
            raise sb.not_running()
        found = sb.policies.find(name)
        if found is None:
            raise PolicyUnavailable(
                f"security policy {name!r} is not in force on sandbox {sid} (in force: "
                f"{', '.join(p.name for p, _ in sb.policies.chosen) or 'none'})",
                policy=name,
                sandbox_id=sid,
            )
        policy, _ = found
        if not policy.live:
            raise PolicyUnavailable(
                f"security policy {name!r} cannot change on a running sandbox",
                policy=name,
                sandbox_id=sid,
            )
        new = {k: v for k, v in settings.items() if k not in NODE_SETTINGS}
        policy.validate(new)
        policy.update(sb.rt, new)
        sb.policies.chosen = [(p, new if p is policy else s) for p, s in sb.policies.chosen]
        return PolicyState(
            name=name, state="enforced", settings=new, stats=dict(policy.stats(sb.rt))
        )

    def close(self) -> None:
        for policy in self.policies.values():
            try:
                policy.close()
            except Exception:  # one policy's failure must not keep the node from closing
                log.exception("closing security policy %s", policy.name)


def enforcer(sandbox: Callable[[], Sandbox]) -> Callable[[str, Any], None]:
    """``SandboxRuntime.enforce`` of a sandbox (``sandbox()`` finds its record when a backend
    calls it): apply its policies that work through ``target``."""

    def enforce(target: str, subject: Any) -> None:
        sb = sandbox()
        for policy, settings in sb.policies.chosen:
            if target in policy.targets:
                policy.apply(target, sb.rt, settings, subject)

    return enforce
