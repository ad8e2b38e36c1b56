"""How an operation of the core becomes a method: of a client, run on its transport, or of a
handle, with the handle's id filled in. An operation's parameters, defaults and docstring are
then written once, in ``core``, and every method that runs it is made from it here.

The makers are typed with ``ParamSpec``, so mypy and an IDE see each method's real parameters
and result (``Client().fncall`` is ``(environment: str, cmd: ... = None, *, script: ...) ->
FnCallResult``); at run time each method also carries its operation's docstring and signature,
for ``help()`` and ``inspect``. There are two of each: a blocking method is a ``def``, an
awaited one an ``async def``, so ``inspect.iscoroutinefunction`` tells them apart as it does
for any asyncio API.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

from ..records import ExecOutput, ExecResult
from .core import Op, Stream

if TYPE_CHECKING:
    from .async_client import AsyncClient
    from .client import Client

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)

_ONLY, _EITHER = inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD


def _method(fn: F, model: Callable[..., Any], drop: int, returns: Any) -> F:
    """``fn``, named and documented as ``model``, with ``model``'s parameters but the first
    ``drop`` (what the method fills in: its operation's ids), after ``self``."""
    functools.update_wrapper(fn, model)
    params = list(inspect.signature(model).parameters.values())[drop:]
    # self is positional-only where what follows is (a group's name, before its **kw)
    kind = _ONLY if params and params[0].kind is _ONLY else _EITHER
    signature = inspect.Signature([inspect.Parameter("self", kind), *params])
    vars(fn)["__signature__"] = signature.replace(return_annotation=returns)
    fn.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not p.empty}
    fn.__annotations__["return"] = returns
    return fn


def named(cls: C) -> C:
    """``cls``, the methods made here in it named as its own: ``Group.create`` rather than
    ``group_create`` (its operation's name), for ``help()``, reprs and documentation."""
    for name, member in vars(cls).items():
        if inspect.isfunction(member) and hasattr(member, "__wrapped__"):
            member.__name__, member.__qualname__ = name, f"{cls.__qualname__}.{name}"
            member.__module__ = cls.__module__
    return cls


def _result(op: Callable[..., Any], into: Callable[..., Any] | None) -> Any:
    """The result annotation of a method of ``op``: ``into``'s, else the ``T`` of ``Op[T]``."""
    if into is not None:
        return (
            into.__name__ if isinstance(into, type) else inspect.signature(into).return_annotation
        )
    returns = str(inspect.signature(op).return_annotation)
    assert returns.startswith("Op[") and returns.endswith("]"), (op, returns)
    return returns[3:-1]


# --- a client's methods -------------------------------------------------------------------------


@overload
def blocking(op: Callable[P, Op[T]], /) -> Callable[Concatenate[Client, P], T]: ...
@overload
def blocking(
    op: Callable[P, Op[T]], /, into: Callable[[Client, T], R]
) -> Callable[Concatenate[Client, P], R]: ...
def blocking(
    op: Callable[P, Op[T]], /, into: Callable[[Client, T], Any] | None = None
) -> Callable[Concatenate[Client, P], Any]:
    """A ``Client`` method that runs ``op``; ``into`` makes its result a handle."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        result = self._run(op(*args, **kwargs))
        return result if into is None else into(self, result)

    return _method(method, op, 0, _result(op, into))


@overload
def awaiting(
    op: Callable[P, Op[T]], /
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]: ...
@overload
def awaiting(
    op: Callable[P, Op[T]], /, into: Callable[[AsyncClient, T], R]
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]]: ...
def awaiting(
    op: Callable[P, Op[T]], /, into: Callable[[AsyncClient, T], Any] | None = None
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, Any]]:
    """An ``AsyncClient`` method that runs ``op``; ``into`` makes its result a handle."""

    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        result = await self._run(op(*args, **kwargs))
        return result if into is None else into(self, result)

    return _method(method, op, 0, _result(op, into))


def streaming(
    op: Callable[P, Stream],
) -> Callable[Concatenate[Client, P], Iterator[ExecOutput | ExecResult]]:
    """A ``Client`` method that opens ``op``'s stream and yields its items. A generator: nothing
    is checked or sent before the first item is asked for."""

    def method(
        self: Client, /, *args: P.args, **kwargs: P.kwargs
    ) -> Iterator[ExecOutput | ExecResult]:
        yield from self._stream(op(*args, **kwargs))

    return _method(method, op, 0, "Iterator[ExecOutput | ExecResult]")


def streaming_async(
    op: Callable[P, Stream],
) -> Callable[
    Concatenate[AsyncClient, P], Coroutine[Any, Any, AsyncIterator[ExecOutput | ExecResult]]
]:
    """An ``AsyncClient`` method that opens ``op``'s stream (awaited) and returns its items."""

    async def method(
        self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs
    ) -> AsyncIterator[ExecOutput | ExecResult]:
        return await self._stream(op(*args, **kwargs))

    return _method(method, op, 0, "AsyncIterator[ExecOutput | ExecResult]")


# --- a handle's methods -------------------------------------------------------------------------


class Keyed(Protocol):
    """A handle that names one thing of its client's: a sandbox (its id), a group (its name)."""

    @property
    def client(self) -> Any: ...
    @property
    def _key(self) -> str: ...


class InSession(Protocol):
    """A session handle: its sandbox's id and its own."""

    @property
    def client(self) -> Any: ...
    @property
    def sandbox_id(self) -> str: ...
    @property
    def id(self) -> str: ...


H = TypeVar("H", bound=Keyed)
S = TypeVar("S", bound=InSession)


def handle_method(f: Callable[Concatenate[Any, str, P], R]) -> Callable[Concatenate[H, P], R]:
    """A method of a ``Keyed`` handle: client method ``f`` with the handle's key filled in."""

    def method(self: H, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return f(self.client, self._key, *args, **kwargs)

    return _method(method, f, 2, inspect.signature(f).return_annotation)


def async_handle_method(
    f: Callable[Concatenate[Any, str, P], Awaitable[R]],
) -> Callable[Concatenate[H, P], Coroutine[Any, Any, R]]:
    """``handle_method`` of an awaited client method: a coroutine function too."""

    async def method(self: H, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await f(self.client, self._key, *args, **kwargs)

    return _method(method, f, 2, inspect.signature(f).return_annotation)


def session_method(f: Callable[Concatenate[Any, str, str, P], R]) -> Callable[Concatenate[S, P], R]:
    """A method of a session handle: client method ``f`` with the sandbox's and the session's
    ids filled in."""

    def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return f(self.client, self.sandbox_id, self.id, *args, **kwargs)

    return _method(method, f, 3, inspect.signature(f).return_annotation)


def async_session_method(
    f: Callable[Concatenate[Any, str, str, P], Awaitable[R]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """``session_method`` of an awaited client method: a coroutine function too."""

    async def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await f(self.client, self.sandbox_id, self.id, *args, **kwargs)

    return _method(method, f, 3, inspect.signature(f).return_annotation)
