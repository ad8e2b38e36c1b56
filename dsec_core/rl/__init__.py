"""dsec.rl: the trainer-facing interface. A gymnasium environment over a sandbox, forking of
trajectories from snapshots, and the typing of infrastructure failures a trainer masks.

    env = SandboxEnv(client, environment="judge-fizzbuzz", reward=command_reward("make test"))
    obs, info = env.reset()
    obs, reward, terminated, truncated, info = env.step("ls")
    obs, reward, terminated, truncated, info = env.step("submit")   # scored by ``reward``
    if info["infra"] is not None:   # preempted, out of memory, start timeout, node lost
        ...                         # not the policy's doing: mask it, do not score it zero

``env.fork(n)`` packs the sandbox's state (``pack_diff``) and returns ``n`` environments that
each go on from it in a sandbox of their own, without replaying the steps so far. Rollout groups
(``Client.group``) create, fork, pause and kill many sandboxes together; leases
(``Client.lease``) pause them when their trainer dies. A loop that runs inside an agent sandbox
drives its workers through the drive socket: ``drive_client_source()`` is the Python client to
copy in.
"""

from __future__ import annotations

import string
import time
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

import gymnasium
from gymnasium import spaces

from ..errors import DsecError, NodeUnavailable, SandboxDied, SandboxPaused, StartTimeout
from ..records import ExecResult, InfraEvent, LayerInfo, SandboxSpec
from ..sdk import GROUP_LABEL, Client

__all__ = [
    "Reward",
    "SandboxEnv",
    "command_reward",
    "drive_client_source",
    "infra_event",
]

#: ``reward(client, sandbox_id) -> float``: scores the sandbox's state when the policy submits.
Reward = Callable[[Client, str], float]

#: What an observation may hold: printable ASCII (anything else shows as "?").
CHARSET = string.printable


#: The errors that are infrastructure failures, and their ``InfraEvent`` kinds.
_INFRA_ERRORS: dict[type[DsecError], str] = {
    NodeUnavailable: "node_lost",
    StartTimeout: "start_timeout",
    SandboxPaused: "preempted",
    SandboxDied: "crashed",
}


def drive_client_source() -> str:
    """The text of the drive socket's Python client (standard library only), to write into an
    agent sandbox as ``drive.py``: ``from drive import Drive``."""
    return resources.files("dsec_core.node").joinpath("drive_client.py").read_text()


def infra_event(error: BaseException | ExecResult, sandbox_id: str = "") -> InfraEvent | None:
    """The infrastructure failure ``error`` is (a dsec error raised by a call, or a command's
    result), or None if it is not one (then it is the task's or the caller's own)."""
    now = time.time()
    if isinstance(error, ExecResult):
        if error.oom_killed:
            return InfraEvent("out_of_memory", error.sandbox_id or sandbox_id, now, error.command)
        return None
    for cls, name in _INFRA_ERRORS.items():
        if isinstance(error, cls):
            sid = getattr(error, "context", {}).get("sandbox_id") or sandbox_id
            return InfraEvent(name, sid, now, str(error))
    return None


def command_reward(command: str, timeout: float = 300.0) -> Reward:
    """A reward that runs ``command`` in the sandbox: 1.0 if it exits 0, else 0.0."""

    def reward(client: Client, sandbox_id: str) -> float:
        return 1.0 if client.exec(sandbox_id, command, timeout=timeout).ok else 0.0

    return reward


class SandboxEnv(gymnasium.Env):
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
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's own shape

    def __init__(
        self,
        client: Client | None = None,
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
            raise ValueError("SandboxEnv needs an environment, a snapshot or a spec")
        self.client = client or Client()
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
        self.action_space = spaces.Text(max_length=1 << 16, charset=CHARSET)
        self.sandbox_id: str | None = None
        self.steps = 0

    # --- gymnasium ------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A fresh sandbox. ``options["snapshot"]`` restores from that snapshot this time."""
        super().reset(seed=seed)
        self._drop()
        self.steps = 0
        snapshot = (options or {}).get("snapshot", self.snapshot)
        if isinstance(snapshot, LayerInfo):
            snapshot = snapshot.ref
        try:
            if snapshot is not None:
                (sb,) = self.client.restore(snapshot, n=1, **self._fields(restore=True))
            else:
                sb = self.client.create(SandboxSpec.from_dict(self._fields()))
        except DsecError as e:
            event = infra_event(e)
            if event is None:
                raise
            return "", self._info(event)
        self.sandbox_id = sb.id
        return "", self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.sandbox_id is None:
            raise RuntimeError("call reset() before step()")
        self.steps += 1
        truncated = self.steps >= self.max_steps
        try:
            if action.strip() == self.submit:
                reward = self.reward_fn(self.client, self.sandbox_id) if self.reward_fn else 0.0
                return f"submitted: reward {reward:g}", float(reward), True, False, self._info()
            result = self.client.exec(
                self.sandbox_id, action, timeout=self.timeout, trajectory=self.trajectory
            )
        except DsecError as e:
            event = infra_event(e, self.sandbox_id)
            if event is None:
                raise
            return "", 0.0, False, True, self._info(event)
        event = infra_event(result, self.sandbox_id)
        info = self._info(event, result)
        if event is not None:
            return self._observe(result), 0.0, False, True, info
        return self._observe(result), 0.0, False, truncated, info

    def close(self) -> None:
        self._drop()

    # --- forking --------------------------------------------------------------------------
    def fork(self, n: int) -> list[SandboxEnv]:
        """``n`` environments that each go on from this one's state now, in sandboxes of their
        own (one ``pack_diff``, then ``restore``); this one goes on as it was."""
        if self.sandbox_id is None:
            raise RuntimeError("call reset() before fork()")
        snap = self.client.pack_diff(self.sandbox_id)
        kids = self.client.restore(snap.ref, n=n, **self._fields(restore=True))
        out = []
        for sb in kids:
            env = SandboxEnv(
                self.client,
                snapshot=snap.ref,
                spec=self.sandbox_spec,
                reward=self.reward_fn,
                submit=self.submit,
                max_steps=self.max_steps,
                timeout=self.timeout,
                max_observation=self.max_observation,
                group=self.group,
                **{k: v for k, v in self.spec_fields.items() if k != "environment"},
            )
            env.sandbox_id, env.steps = sb.id, self.steps
            out.append(env)
        return out

    # ---------------------------------------------------------------------------------------
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

    def _drop(self) -> None:
        if self.sandbox_id is not None:
            sid, self.sandbox_id = self.sandbox_id, None
            try:
                self.client.kill(sid)
            except DsecError:  # gone already (its ttl, a lost node): nothing to drop
                pass
