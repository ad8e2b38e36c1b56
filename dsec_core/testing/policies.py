"""The security-policy conformance kit: every security policy plugin subclasses
``SecurityPolicyConformance``.

    from dsec_core.testing import SecurityPolicyConformance

    class TestMyPolicy(SecurityPolicyConformance):
        policy_name = "mypolicy"     # what the policy registers as
        backend_name = "container"   # where the kit's sandboxes run: it offers the targets
        bad_settings = [({"paths": ["relative"]}, "policies.mypolicy.paths[0]")]

The checks: the declared contract; ``check_available`` quick, typed and the same answer the
node gives at a create; a policy the host cannot run, or one named for a backend it cannot be
enforced on, failing the create with ``PolicyUnavailable`` and leaving nothing behind; bad
settings an ``InvalidSpec`` naming the field (``policies.<name>.<key>``), in ``validate`` and
at the create; the ``example`` settings "enforced" on a real sandbox, still after a daemon
restart; a released sandbox leaving nothing; a ``live`` policy's ``update`` in force (and a
policy that is not live refusing one); ``loosens`` consistent. Where this host cannot run the
policy, the checks that need it are skipped with the policy's own reason, and the checks of
the unavailable path run instead.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest

from ..backend import Backend
from ..errors import DsecError, InvalidSpec, PluginInvalid, PolicyUnavailable
from ..plugins import registry
from ..security import SecurityPolicy, loosenings
from .fixtures import leftovers

__all__ = ["SecurityPolicyConformance"]

#: Seconds ``check_available`` may take: the node asks it before creates that name the policy.
AVAILABLE_WITHIN = 2.0
#: Seconds what a sandbox's policy made may take to go once the sandbox is killed (a veth
#: goes after the kernel's RCU grace period, in the background).
GONE_WITHIN = 5.0
#: A settings key no policy knows: every policy refuses it, naming it.
UNKNOWN_KEY = "dsec-kit-no-such-setting"


class _NoTargets(Backend):
    """A stand-in backend that offers security policies no enforcement point."""

    name = "dsec-kit-no-targets"

    async def start(self, rt: Any) -> dict[str, Any]:
        raise NotImplementedError

    async def alive(self, rt: Any, state: Mapping[str, Any]) -> bool:
        return False

    async def stop(self, rt: Any, state: Mapping[str, Any]) -> None:
        pass


def _offering(targets: frozenset[str]) -> type[Backend]:
    """A stand-in backend that offers exactly ``targets``."""
    return type("_Offering", (_NoTargets,), {"policy_targets": frozenset(targets)})


class SecurityPolicyConformance:
    """Behaviour every dsec security policy must show. Set ``policy_name`` in the subclass.

    ``backend_name`` is the backend of the kit's sandboxes (or override the
    ``dsec_backend_name`` fixture): one that offers the policy's ``targets``. ``bad_settings``
    lists ``(settings, field)`` pairs the policy refuses, besides the unknown key the kit tries.
    ``loosening`` and ``tightening`` list settings ``loosens`` must give a reason for, and
    settings it must not. A ``live`` policy names the settings the kit changes to in
    ``live_example``. ``unenforceable_backend`` names a loaded backend the policy cannot be
    enforced on (default: the kit picks one, or skips that part saying why). Override
    ``check_effect`` to look into a sandbox for what the settings do, and ``policy_leftovers``
    for what the policy makes outside the node's home (the kit compares it before and after).
    A base class of your own that sets no ``policy_name`` is declared with
    ``class Base(SecurityPolicyConformance, abstract=True)``.
    """

    policy_name: ClassVar[str] = ""
    backend_name: ClassVar[str] = ""
    bad_settings: ClassVar[Sequence[tuple[Mapping[str, Any], str]]] = ()
    loosening: ClassVar[Sequence[Mapping[str, Any]]] = ()
    tightening: ClassVar[Sequence[Mapping[str, Any]]] = ()
    live_example: ClassVar[Mapping[str, Any] | None] = None
    unenforceable_backend: ClassVar[str | None] = None

    def __init_subclass__(cls, abstract: bool = False, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        name = getattr(cls, "policy_name", "")
        if not abstract and (not isinstance(name, str) or not name):
            raise PluginInvalid(
                f"{cls.__module__}.{cls.__qualname__} subclasses SecurityPolicyConformance but "
                'sets no policy_name: add `policy_name = "<the name your SecurityPolicy '
                'registers>"` to the class (or declare a base class of your own with '
                "abstract=True)",
                test_class=cls.__qualname__,
            )

    # --- what a subclass may override -----------------------------------------------------
    def check_effect(self, sb: Any, settings: Mapping[str, Any]) -> None:
        """Assert that ``settings`` are in force in sandbox ``sb`` (a write refused, a
        connection denied, a count in ``stats``). The kit calls it after the create with the
        ``example`` settings, after a daemon restart, and after a live ``update``. Default:
        nothing beyond what the node reports."""

    def policy_leftovers(self, node: Any) -> Mapping[str, Any]:
        """What the policy made outside ``node``'s home that a sandbox's release or a failed
        create must not leave more of (map entries, network devices, loaded profiles), as
        comparable JSON values. Default: nothing."""
        return {}

    # --- helpers --------------------------------------------------------------------------
    def policy_class(self) -> type[SecurityPolicy]:
        """The class registered as ``policy_name`` (``UnknownPolicy`` if none is)."""
        return registry().security_policy(self.policy_name)

    def unavailable(self) -> PolicyUnavailable | None:
        """Why this host cannot run the policy (its ``check_available``), or None."""
        try:
            self.policy_class().check_available()
        except PolicyUnavailable as e:
            return e
        return None

    def need_available(self) -> None:
        """Skip the calling check, with the policy's own reason, where the host lacks it."""
        why = self.unavailable()
        if why is not None:
            pytest.skip(f"security policy {self.policy_name!r} is unavailable here: {why}")

    def example(self) -> tuple[dict[str, Any], str]:
        """The policy's ``example``: (settings, network mode)."""
        settings, network = self.policy_class().example
        return dict(settings), network

    def create_example(self, dsec_sandboxes: Any, settings: Mapping[str, Any] | None = None):
        """A sandbox with the policy at ``settings`` (default: its example) and the example's
        network mode."""
        example, network = self.example()
        chosen = example if settings is None else dict(settings)
        return dsec_sandboxes.create(network=network, policies={self.policy_name: chosen})

    def field(self, key: str) -> str:
        return f"policies.{self.policy_name}.{key}"

    @contextlib.contextmanager
    def leaves_nothing(self, dsec_client: Any, dsec_node: Any) -> Iterator[None]:
        """Fail unless the block leaves the node's sandboxes, what the node left in its home
        (``leftovers``) and ``policy_leftovers`` as they were."""
        before = self._state(dsec_client, dsec_node)
        yield
        deadline = time.monotonic() + GONE_WITHIN
        while True:
            after = self._state(dsec_client, dsec_node)
            if after == before or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert after == before, f"left behind: {self._diff(before, after)}"

    def _state(self, client: Any, node: Any) -> dict[str, Any]:
        return {
            "sandboxes": sorted(s.id for s in client.list()),
            "home": leftovers(node.home),
            "policy": dict(self.policy_leftovers(node)),
        }

    @staticmethod
    def _diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
        return {k: {"before": before[k], "after": after[k]} for k in after if after[k] != before[k]}

    @pytest.fixture
    def dsec_held(self, dsec_sandboxes: Any) -> Any:
        """A plain sandbox held for the whole check: its layers stay mounted, so the
        before-and-after comparisons see only what the check itself made or left."""
        return dsec_sandboxes.create()

    # --- the declared contract ------------------------------------------------------------
    def test_declares_the_contract(self, dsec_backend_name: str) -> None:
        cls = self.policy_class()
        assert issubclass(cls, SecurityPolicy) and cls.name == self.policy_name
        assert isinstance(cls.targets, frozenset) and cls.targets, (
            "targets must be a non-empty frozenset of enforcement point names"
        )
        assert all(isinstance(t, str) and t for t in cls.targets), cls.targets
        assert isinstance(cls.network_modes, frozenset), "network_modes must be a frozenset"
        assert all(isinstance(m, str) and m != "none" for m in cls.network_modes), (
            "network_modes lists modes other than 'none' (loopback only is the backend's)"
        )
        assert isinstance(cls.implied_by, frozenset) and cls.implied_by <= cls.network_modes, (
            "implied_by must be a frozenset of the policy's own network_modes"
        )
        if cls.implied_by:
            self.policy_class()().validate({})  # what an implied policy is given
        assert isinstance(cls.default, bool) and isinstance(cls.live, bool)
        settings, network = cls.example
        assert isinstance(settings, Mapping) and isinstance(network, str), (
            "example must be (settings, network mode)"
        )
        assert network == "none" or network in cls.network_modes, (
            f"the example's network {network!r} is neither 'none' nor one of network_modes"
        )
        json.dumps(dict(settings))  # settings travel as JSON
        if cls.live:
            assert self.live_example is not None, (
                "a live policy's kit names the settings it changes to: set live_example"
            )
        backend = registry().backend(dsec_backend_name)
        assert cls.enforceable_on(backend), (
            f"the kit's sandboxes run on backend {dsec_backend_name!r}, which offers "
            f"{sorted(backend.policy_targets)}: policy {self.policy_name!r} cannot be enforced "
            "there; set backend_name to one that offers its targets"
        )

    def test_check_available_is_quick_typed_and_steady(self) -> None:
        cls = self.policy_class()
        answers: list[str | None] = []
        for _ in range(2):
            started = time.monotonic()
            try:
                cls.check_available()
                answers.append(None)
            except PolicyUnavailable as e:
                assert str(e), "PolicyUnavailable must say what is missing"
                assert e.context.get("policy") == self.policy_name, (
                    f"PolicyUnavailable names the policy (policy={self.policy_name!r}): {e.context}"
                )
                answers.append(str(e))
            took = time.monotonic() - started
            assert took < AVAILABLE_WITHIN, f"check_available took {took:.1f}s"
        assert answers[0] == answers[1], f"check_available changed its mind: {answers}"

    def test_enforceable_only_through_its_targets(self) -> None:
        cls = self.policy_class()
        assert not cls.enforceable_on(_NoTargets), (
            "a backend that offers no enforcement point cannot enforce the policy"
        )
        assert cls.enforceable_on(_offering(cls.targets)), (
            "a backend that offers every one of the policy's targets can enforce it"
        )

    # --- settings -------------------------------------------------------------------------
    def _bad(self) -> list[tuple[dict[str, Any], str]]:
        example, _ = self.example()
        unknown = {**example, UNKNOWN_KEY: True}
        return [(unknown, self.field(UNKNOWN_KEY))] + [(dict(s), f) for s, f in self.bad_settings]

    def test_validate_refuses_bad_settings_naming_the_field(self) -> None:
        policy = self.policy_class()()
        for settings, field in self._bad():
            with pytest.raises(InvalidSpec) as e:
                policy.validate(settings)
            assert e.value.context.get("field") == field, (
                f"validate({settings}) names field {e.value.context.get('field')!r}, "
                f"not {field!r}: {e.value}"
            )

    def test_example_settings_validate(self) -> None:
        """The example validates, or says the host lacks the policy exactly when
        ``check_available`` does."""
        example, _ = self.example()
        why = self.unavailable()
        try:
            self.policy_class()().validate(example)
        except PolicyUnavailable as e:
            assert why is not None, f"validate says unavailable, check_available does not: {e}"

    def test_bad_settings_fail_the_create_and_leave_nothing(
        self, dsec_sandboxes, dsec_client, dsec_node, dsec_held
    ) -> None:
        with self.leaves_nothing(dsec_client, dsec_node):
            for settings, field in self._bad():
                with pytest.raises(InvalidSpec) as e:
                    self.create_example(dsec_sandboxes, settings)
                assert e.value.context.get("field") == field, e.value

    # --- where it cannot be enforced ------------------------------------------------------
    def test_unavailable_fails_the_create_and_leaves_nothing(
        self, dsec_sandboxes, dsec_client, dsec_node, dsec_held
    ) -> None:
        why = self.unavailable()
        if why is None:
            pytest.skip(f"this host can run security policy {self.policy_name!r}")
        with self.leaves_nothing(dsec_client, dsec_node):
            with pytest.raises(PolicyUnavailable) as e:
                self.create_example(dsec_sandboxes)
        assert str(e.value) == str(why), "the node's reason is check_available's"
        assert e.value.context.get("policy") == self.policy_name
        # best_effort: the sandbox starts without it, saying why
        example, _ = self.example()
        sb = self.create_example(dsec_sandboxes, {**example, "best_effort": True})
        assert sb.info.policies[self.policy_name] == f"skipped: {why}"

    def _unenforceable(self) -> str | None:
        if self.unenforceable_backend:
            return self.unenforceable_backend
        cls = self.policy_class()
        for name, backend in sorted(registry().backends.items()):
            if cls.enforceable_on(backend):
                continue
            try:
                backend.check_available()
            except DsecError:
                continue
            return name
        return None

    def test_a_backend_it_cannot_enforce_on_fails_the_create(
        self, dsec_sandboxes, dsec_client, dsec_node, dsec_held
    ) -> None:
        backend = self._unenforceable()
        if backend is None:
            pytest.skip(
                f"every loaded backend available here offers a target of {self.policy_name!r} "
                f"({sorted(self.policy_class().targets)}); test_enforceable_only_through_its_"
                "targets checked a stand-in"
            )
        with self.leaves_nothing(dsec_client, dsec_node):
            with pytest.raises(PolicyUnavailable) as e:
                example, network = self.example()
                dsec_sandboxes.create(
                    backend=backend, network=network, policies={self.policy_name: example}
                )
        assert e.value.context.get("policy") == self.policy_name, e.value

    # --- on a real sandbox ----------------------------------------------------------------
    def _assert_in_force(self, client: Any, sb: Any, settings: Mapping[str, Any]) -> None:
        states = {p.name: p for p in client.policies(sb.id)}
        assert self.policy_name in states, f"policies of {sb.id}: {sorted(states)}"
        state = states[self.policy_name]
        assert state.state == "enforced", state
        assert dict(state.settings) == dict(settings), state
        json.dumps(dict(state.stats))  # shown by `dsec sandbox inspect --json`
        self.check_effect(sb, settings)

    def test_example_is_enforced_on_a_real_sandbox(self, dsec_sandboxes, dsec_client) -> None:
        self.need_available()
        example, _ = self.example()
        sb = self.create_example(dsec_sandboxes)
        assert sb.info.policies[self.policy_name] == "enforced", sb.info.policies
        self._assert_in_force(dsec_client, sb, example)
        assert sb.exec("echo works").stdout == b"works\n"

    def test_release_leaves_nothing(
        self, dsec_sandboxes, dsec_client, dsec_node, dsec_held
    ) -> None:
        self.need_available()
        with self.leaves_nothing(dsec_client, dsec_node):
            sb = self.create_example(dsec_sandboxes)
            assert sb.exec("true").exit_code == 0
            sb.kill()

    def test_a_daemon_restart_keeps_it_in_force(
        self, dsec_sandboxes, dsec_client, dsec_node
    ) -> None:
        self.need_available()
        example, _ = self.example()
        sb = self.create_example(dsec_sandboxes)
        try:
            dsec_node.restart()
        finally:
            dsec_node.ensure_running()
        with dsec_node.client() as client:
            again = client.get(sb.id)
            self._assert_in_force(client, again, example)

    def test_live_update_takes_effect_or_is_refused(self, dsec_sandboxes, dsec_client) -> None:
        self.need_available()
        cls = self.policy_class()
        example, _ = self.example()
        sb = self.create_example(dsec_sandboxes)
        if not cls.live:
            with pytest.raises(PolicyUnavailable):
                dsec_client.set_policy(sb.id, self.policy_name, example)
            self._assert_in_force(dsec_client, sb, example)
            return
        assert self.live_example is not None, "set live_example"
        new = dict(self.live_example)
        state = dsec_client.set_policy(sb.id, self.policy_name, new)
        assert state.state == "enforced" and dict(state.settings) == new, state
        self._assert_in_force(dsec_client, sb, new)
        bad, field = self._bad()[0]
        with pytest.raises(InvalidSpec) as e:
            dsec_client.set_policy(sb.id, self.policy_name, bad)
        assert e.value.context.get("field") == field, e.value
        self._assert_in_force(dsec_client, sb, new)  # the refused change changed nothing

    # --- loosening ------------------------------------------------------------------------
    def test_loosens_is_consistent(self) -> None:
        """``loosens`` needs neither an instance nor the host (the apiserver asks it about
        policies its own machine may lack), answers None or a reason, and core's
        ``loosenings`` agrees with it."""
        cls = self.policy_class()
        example, network = self.example()
        known = {self.policy_name: cls}
        assert cls.loosens({}) is None, "no settings cannot loosen anything"
        cases: list[tuple[str, dict[str, Any], bool | None]] = [("example", example, None)]
        cases += [("loosening", dict(s), True) for s in self.loosening]
        cases += [("tightening", dict(s), False) for s in self.tightening]
        for what, settings, loosens in cases:
            why = cls.loosens(settings)
            assert why is None or (isinstance(why, str) and why), f"loosens({settings}): {why!r}"
            assert cls.loosens(settings) == why, "loosens must answer the same every time"
            if loosens is not None:
                assert (why is not None) is loosens, f"{what} settings {settings}: {why!r}"
            reasons = loosenings({self.policy_name: settings}, "none", known)
            assert reasons == ([why] if why else []), reasons
        if network != "none":  # a mode that opens the network is a loosening of its own
            assert loosenings({self.policy_name: example}, network, known)
        for node_key in ({"enabled": False}, {"best_effort": True}):
            reasons = loosenings({self.policy_name: node_key}, "none", known)
            assert bool(reasons) is cls.default, (
                f"{node_key} on a {'default' if cls.default else 'opt-in'} policy: {reasons}"
            )
