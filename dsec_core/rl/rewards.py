"""Rewards a ``SandboxEnv`` scores a submitted episode with: ``reward(client, sandbox_id)``,
returning a float (or, with an ``AsyncClient``, an awaitable of one)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from ..records import ExecResult
from .errors import InfraFailure
from .infra import infra_event

__all__ = ["Reward", "command_reward"]

#: ``reward(client, sandbox_id) -> float``: scores the sandbox's state when the policy submits
#: (with an ``AsyncClient`` it may return an awaitable of the float).
Reward = Callable[[Any, str], "float | Awaitable[float]"]


def _score(result: ExecResult, sandbox_id: str) -> float:
    event = infra_event(result, sandbox_id)
    if event is not None:  # killed for memory while checking: not a wrong answer
        raise InfraFailure(event)
    return 1.0 if result.ok else 0.0


def command_reward(command: str, timeout: float = 300.0) -> Reward:
    """A reward that runs ``command`` in the sandbox: 1.0 if it exits 0, else 0.0; on either
    client twin. An out-of-memory kill of the command raises ``InfraFailure`` (masked)."""

    def reward(client: Any, sandbox_id: str) -> float | Awaitable[float]:
        result = client.exec(sandbox_id, command, timeout=timeout)
        if inspect.isawaitable(result):
            return _scored(result, sandbox_id)
        return _score(result, sandbox_id)

    async def _scored(result: Awaitable[ExecResult], sandbox_id: str) -> float:
        return _score(await result, sandbox_id)

    return reward
