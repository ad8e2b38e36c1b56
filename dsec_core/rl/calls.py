"""Code that runs on either client twin: an operation is a generator that yields the client calls
it needs (``Use``: a method of the client; ``Apply``: a caller's function of the client, such as a
reward) and is sent their results, as the SDK's own core (``dsec_core.sdk.core``) does one level
down. ``drive`` runs one on a ``Client``, ``adrive`` on an ``AsyncClient``; ``SandboxEnv`` and
``AsyncSandboxEnv`` are then one piece of logic, and so is a rollout's episode of a catalog task.

A failure is thrown into the operation, a cancellation included, so its ``finally`` can still
kill the sandbox it made.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

from ..errors import InvalidSpec

__all__ = ["Apply", "Op", "Use", "adrive", "drive"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Use:
    """Call the client's method ``name`` with these arguments."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Apply:
    """Call ``fn(client, *args)``, a caller's function of the client (a reward); what it
    returns is awaited if it must be (with an ``AsyncClient`` only)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


Effect: TypeAlias = Use | Apply
#: An operation: yields effects, is sent their outcomes, returns its result.
Op: TypeAlias = Generator[Effect, Any, T]


def _call(client: Any, effect: Effect) -> Any:
    if isinstance(effect, Use):
        return getattr(client, effect.name)(*effect.args, **effect.kwargs)
    return effect.fn(client, *effect.args)


def drive(client: Any, op: Op[T]) -> T:
    """Run ``op`` on a blocking ``Client``: each effect in turn."""
    try:
        effect = next(op)
        while True:
            try:
                outcome = _call(client, effect)
                if inspect.isawaitable(outcome):
                    if inspect.iscoroutine(outcome):
                        outcome.close()
                    raise InvalidSpec(
                        f"{getattr(effect, 'fn', effect)!r} returned an awaitable: an async "
                        "function of the client needs an AsyncClient (AsyncSandboxEnv)",
                        field="reward",
                    )
            except BaseException as e:  # the operation may handle it, or clean up
                effect = op.throw(e)
            else:
                effect = op.send(outcome)
    except StopIteration as stop:
        return stop.value
    finally:
        op.close()


async def adrive(client: Any, op: Op[T]) -> T:
    """Run ``op`` on an ``AsyncClient``: each effect awaited (a plain function's result, such
    as a blocking reward's, is taken as it is)."""
    try:
        effect = next(op)
        while True:
            try:
                outcome = _call(client, effect)
                if inspect.isawaitable(outcome):
                    outcome = await outcome
            except BaseException as e:  # the operation may handle it, or clean up
                effect = op.throw(e)
            else:
                effect = op.send(outcome)
    except StopIteration as stop:
        return stop.value
    finally:
        op.close()
