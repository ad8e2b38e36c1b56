"""The gymnasium environment over a sandbox, in two twins: ``SandboxEnv`` on a blocking
``Client`` and ``AsyncSandboxEnv`` on an ``AsyncClient``. What they do is written once, in
``EnvCore``: each of reset, step, fork and close is an operation of client calls (``calls``),
and a twin only runs it, blocking or awaited, as the SDK's clients run its core."""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any, Self

import gymnasium
from gymnasium import spaces
from gymnasium.utils import seeding

from ..errors import DsecError, InvalidSpec
from ..records import ExecResult, InfraEvent, LayerInfo, SandboxSpec
from ..sdk import GROUP_LABEL, AsyncClient, Client
from .calls import Apply, Op, Use, adrive, drive
from .errors import EnvClosed, EnvNotReset, EpisodeEnded, InvalidAction
from .infra import infra_event
from .rewards import Reward

__all__ = ["CHARSET", "AsyncSandboxEnv", "EnvCore", "SandboxEnv"]

#: What an observation may hold: printable ASCII (anything else shows as "?").
CHARSET = string.printable

#: The longest action (a shell command) an environment takes.
MAX_ACTION = 1 << 16

#: What ``step`` returns: observation, reward, terminated, truncated, info.
StepResult = tuple[str, float, bool, bool, dict[str, Any]]


class EnvCore:
    """What both twins are: their settings, the episode's state, and each of their methods as
    an operation (``calls.Op``) that either twin runs. The state is ``phase``: "new" (no
    ``reset`` yet, or one that raised), "running", "ended" (terminated or truncated), or
    "closed"; a call out of turn raises the ``EnvError`` saying which.

    ``fork(n)`` packs the sandbox's state (``pack_diff``) and gives ``n`` environments of the
    same class that go on from it, each in a sandbox of its own; their ``reset()`` starts again
    from that point (a fresh sandbox restored from the snapshot, the steps counted from it).
    """

    observation_space: spaces.Space[Any]
    action_space: spaces.Space[Any]

    def __init__(
        self,
        client: Any,
        *,
        environment: str | None = None,
        snapshot: str | LayerInfo | None = None,
        spec: SandboxSpec | None = None,
        reward: Reward | None = None,
        submit: str = "submit",
        max_steps: int = 50,
        timeout: float = 60.0,
        max_observation: int = 4096,
        group: str | None = None,
        trajectory: str | None = None,
        **spec_fields: Any,
    ) -> None:
        if spec is None and environment is None and snapshot is None and not spec_fields:
            raise InvalidSpec(
                f"{type(self).__name__} needs an environment, a snapshot or a spec",
                field="environment",
            )
        self.client = client
        self.sandbox_spec = spec
        self.max_observation = max_observation
        self.spec_fields = dict(spec_fields)
        if environment is not None:
            self.spec_fields["environment"] = environment
        self.snapshot = snapshot.ref if isinstance(snapshot, LayerInfo) else snapshot
        self.reward_fn = reward
        self.submit = submit
        self.max_steps = max_steps
        self.timeout = timeout
        self.group = group
        self.trajectory = trajectory
        self.observation_space = spaces.Text(max_length=max_observation, charset=CHARSET)
        self.action_space = spaces.Text(max_length=MAX_ACTION, charset=CHARSET)
        self.sandbox_id: str | None = None
        self.steps = 0
        #: the steps taken before this environment's snapshot (a fork's), where reset starts
        self.origin_steps = 0
        self.phase = "new"

    # --- the operations ----------------------------------------------------------------------
    def _reset_op(self, options: Mapping[str, Any] | None) -> Op[tuple[str, dict[str, Any]]]:
        """A fresh sandbox. ``options["snapshot"]`` restores from that snapshot this time."""
        self._check_open()
        yield from self._drop_op()
        snapshot = (options or {}).get("snapshot", self.snapshot)
        if isinstance(snapshot, LayerInfo):
            snapshot = snapshot.ref
        self.phase = "new"
        self.steps = self.origin_steps if snapshot is not None and snapshot == self.snapshot else 0
        try:
            if snapshot is not None:
                kw = {"n": 1, **self._fields(restore=True)}
                (sb,) = yield Use("restore", (snapshot,), kw)
            else:
                sb = yield Use("create", (SandboxSpec.from_dict(self._fields()),))
        except DsecError as e:
            event = infra_event(e)
            if event is None:
                raise
            self.phase = "ended"  # nothing to step: reset again
            return "", self._info(event)
        self.sandbox_id, self.phase = sb.id, "running"
        return "", self._info()

    def _step_op(self, action: str) -> Op[StepResult]:
        self._check_steppable("step")
        self._check_action(action)
        sid = self.sandbox_id
        assert sid is not None  # running
        self.steps += 1
        truncated = self.steps >= self.max_steps
        try:
            if action.strip() == self.submit:
                reward = 0.0
                if self.reward_fn is not None:
                    reward = float((yield Apply(self.reward_fn, (sid,))))
                self.phase = "ended"
                return f"submitted: reward {reward:g}", reward, True, False, self._info()
            result = yield Use(
                "exec", (sid, action), {"timeout": self.timeout, "trajectory": self.trajectory}
            )
        except DsecError as e:
            event = infra_event(e, sid)
            if event is None:
                raise
            self.phase = "ended"
            return "", 0.0, False, True, self._info(event)
        event = infra_event(result, sid)
        if event is not None or truncated:
            self.phase = "ended"
        return (
            self._observe(result),
            0.0,
            False,
            truncated or event is not None,
            self._info(event, result),
        )

    def _fork_op(self, n: int, start: bool) -> Op[list[Self]]:
        self._check_steppable("fork")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidSpec(f"fork makes 1 or more environments, got n={n!r}", field="n")
        assert self.sandbox_id is not None  # running
        snap = yield Use("pack_diff", (self.sandbox_id,))
        kids = [self._spawn(snap.ref) for _ in range(n)]
        if start:
            made = yield Use("restore", (snap.ref,), {"n": n, **self._fields(restore=True)})
            for kid, sb in zip(kids, made, strict=True):
                kid.sandbox_id, kid.steps, kid.phase = sb.id, self.steps, "running"
        return kids

    def _close_op(self) -> Op[None]:
        yield from self._drop_op()
        self.phase = "closed"

    # ---------------------------------------------------------------------------------------
    def _spawn(self, snapshot: str) -> Self:
        """An environment of this one's class and settings that starts from ``snapshot``."""
        kid = type(self)(
            self.client,
            snapshot=snapshot,
            spec=self.sandbox_spec,
            reward=self.reward_fn,
            submit=self.submit,
            max_steps=self.max_steps,
            timeout=self.timeout,
            max_observation=self.max_observation,
            group=self.group,
            **{k: v for k, v in self.spec_fields.items() if k != "environment"},
        )
        kid.origin_steps = self.steps
        return kid

    def _check_open(self) -> None:
        if self.phase == "closed":
            raise EnvClosed(
                f"this {type(self).__name__} is closed", sandbox_id=None, step=self.steps
            )

    def _check_steppable(self, what: str) -> None:
        self._check_open()
        if self.phase == "new":
            raise EnvNotReset(
                f"call reset() before {what}()", sandbox_id=self.sandbox_id, step=self.steps
            )
        if self.phase == "ended":
            raise EpisodeEnded(
                f"the episode ended (terminated or truncated) at step {self.steps}: call "
                f"reset() before {what}()",
                sandbox_id=self.sandbox_id,
                step=self.steps,
            )

    def _check_action(self, action: Any) -> None:
        if not isinstance(action, str):
            why = f"an action is a shell command (a str), got {type(action).__name__}"
        elif not action.strip():
            why = "an action is a shell command, got an empty one"
        elif not self.action_space.contains(action):
            bad = sorted({c for c in action if c not in CHARSET})[:5]
            why = (
                f"an action has at most {MAX_ACTION} characters, printable "
                f"ASCII; got {len(action)} characters" + (f", with {bad!r}" if bad else "")
            )
        else:
            return
        raise InvalidAction(why, sandbox_id=self.sandbox_id, step=self.steps)

    def _fields(self, restore: bool = False) -> dict[str, Any]:
        """The spec's fields for the next sandbox; for a restore without environment and
        layers (the snapshot brings its own)."""
        base = self.sandbox_spec.to_dict() if self.sandbox_spec else {}
        fields = {**base, **self.spec_fields}
        if restore:
            fields.pop("environment", None)
            fields.pop("layers", None)
        if self.group is not None:
            fields["labels"] = {**fields.get("labels", {}), GROUP_LABEL: self.group}
        return fields

    def _observe(self, result: ExecResult) -> str:
        text = (result.stdout + result.stderr).decode("utf-8", "replace")
        text = "".join(c if c in CHARSET else "?" for c in text)
        return text[: self.max_observation]

    def _info(
        self, event: InfraEvent | None = None, result: ExecResult | None = None
    ) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "step": self.steps,
            "exit_code": None if result is None else result.exit_code,
            "replayed": False if result is None else result.replayed,
            "infra": event,
            "masked": event is not None,
        }

    def _drop_op(self) -> Op[None]:
        if self.sandbox_id is not None:
            sid, self.sandbox_id = self.sandbox_id, None
            try:
                yield Use("kill", (sid,))
            except DsecError:  # gone already (its ttl, a lost node): nothing to drop
                pass


class SandboxEnv(EnvCore, gymnasium.Env):
    """A gymnasium environment whose state is a sandbox: an action is a shell command, the
    observation what it printed (stdout then stderr, at most ``max_observation`` characters).

    ``reset()`` kills the previous sandbox and makes a fresh one from ``environment`` (or
    ``spec``, or the spec fields given as keywords) or, with ``snapshot``, restores one from
    that snapshot (``Client.restore``). ``step(submit)`` (default the action "submit") ends the
    episode with ``reward(client, sandbox_id)``; every other step's reward is 0. An episode is
    truncated after ``max_steps`` steps. An infrastructure failure (``infra_event``) ends the
    episode truncated, with ``info["infra"]`` the event and ``info["masked"]`` true, and no
    reward: a trainer masks it. Other dsec errors propagate. ``group`` puts the sandboxes in
    that rollout group; ``trajectory`` logs every command there (``exec(trajectory=)``).

    Used out of turn it raises an ``EnvError``: ``EnvNotReset`` (step or fork before reset),
    ``EpisodeEnded`` (after the episode ended), ``EnvClosed`` (after close), and
    ``InvalidAction`` for an action outside ``action_space``. ``AsyncSandboxEnv`` is its
    twin on an ``AsyncClient``.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's own shape

    def __init__(self, client: Client | None = None, **settings: Any) -> None:
        super().__init__(client or Client(), **settings)

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A fresh sandbox. ``options["snapshot"]`` restores from that snapshot this time."""
        gymnasium.Env.reset(self, seed=seed)
        return drive(self.client, self._reset_op(options))

    def step(self, action: str) -> StepResult:
        return drive(self.client, self._step_op(action))

    def fork(self, n: int, *, start: bool = True) -> list[SandboxEnv]:
        """``n`` environments that each go on from this one's state now, in sandboxes of their
        own (one ``pack_diff``, then ``restore``); this one goes on as it was. ``start=False``
        makes their sandboxes at their first ``reset()`` instead (a runner that bounds its
        sandboxes starts each when it has room)."""
        return drive(self.client, self._fork_op(n, start))

    def close(self) -> None:
        """Kill the sandbox; the environment is done with (``EnvClosed`` after)."""
        drive(self.client, self._close_op())


class AsyncSandboxEnv(EnvCore):
    """``SandboxEnv``'s twin on an ``AsyncClient``: the same settings, spaces, errors and
    episode, with ``reset``, ``step``, ``fork`` and ``close`` awaited (so not a
    ``gymnasium.Env``, whose methods block). ``reward`` may be an async function of the client.
    ``async with`` closes it."""

    def __init__(self, client: AsyncClient, **settings: Any) -> None:
        super().__init__(client, **settings)
        self._rng: Any = None

    @property
    def np_random(self) -> Any:
        """The episode's random generator (numpy), seeded by ``reset(seed=)``, as gymnasium's."""
        if self._rng is None:
            self._rng, _ = seeding.np_random()
        return self._rng

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A fresh sandbox. ``options["snapshot"]`` restores from that snapshot this time."""
        if seed is not None:
            self._rng, _ = seeding.np_random(seed)
        return await adrive(self.client, self._reset_op(options))

    async def step(self, action: str) -> StepResult:
        return await adrive(self.client, self._step_op(action))

    async def fork(self, n: int, *, start: bool = True) -> list[AsyncSandboxEnv]:
        """As ``SandboxEnv.fork``."""
        return await adrive(self.client, self._fork_op(n, start))

    async def close(self) -> None:
        """Kill the sandbox; the environment is done with (``EnvClosed`` after)."""
        await adrive(self.client, self._close_op())
