"""The server side of the route table's HTTP, shared by the node daemon and the apiserver:
typed errors as answers, request bodies read within their route's ``max_body`` and refused when
they stall (``HttpLimits``), Starlette's own refusals in the API's error shape, and the uvicorn
options both run with (``server_options``: the bounded HTTP protocol of ``.protocol``)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..errors import DsecError, InvalidSpec, NotFound, RequestTimeout, RequestTooLarge
from ..records import parse_size
from .routes import JSON, MAX_BODY, ROUTES, dump_json

#: httptools is a dependency; a server without it still runs, on h11 (``server_options``).
_HTTPTOOLS = importlib.util.find_spec("httptools") is not None
if _HTTPTOOLS:
    from .protocol import bounded_protocol

__all__ = [
    "AnsweredErrors",
    "HttpLimits",
    "basic_password",
    "body_pieces",
    "check_declared",
    "error_response",
    "http_limits",
    "on_http_error",
    "read_body",
    "read_json_body",
    "request_key",
    "server_options",
    "unless_disconnected",
]

T = TypeVar("T")


@dataclass(frozen=True)
class HttpLimits:
    """How large a request's head may be and how slowly a request may arrive, as
    ``DSEC_MAX_HEADER_BYTES`` (a size: 64K, or bytes), ``DSEC_HEADER_TIMEOUT`` and
    ``DSEC_BODY_TIMEOUT`` (seconds) say."""

    #: The request line and headers together; more is 431 ``HeadersTooLarge``.
    max_header_bytes: int = 64 << 10
    #: From a request's first byte (or the connection's opening) to the end of its headers;
    #: longer is 408 ``RequestTimeout``.
    header_timeout: float = 10.0
    #: The longest wait for the next byte of a body being read; longer is 408
    #: ``RequestTimeout``. A body nobody reads (its answer went out first) gets this long to
    #: finish before the connection closes.
    body_timeout: float = 30.0

    @classmethod
    def from_env(cls) -> HttpLimits:
        env = os.environ
        kw: dict[str, Any] = {}
        if env.get("DSEC_MAX_HEADER_BYTES", "").strip():
            size = parse_size(env["DSEC_MAX_HEADER_BYTES"].strip(), "DSEC_MAX_HEADER_BYTES")
            if not size or size < 1024:
                raise InvalidSpec(
                    f"DSEC_MAX_HEADER_BYTES must be at least 1K, got {size}",
                    field="DSEC_MAX_HEADER_BYTES",
                )
            kw["max_header_bytes"] = size
        for name, key in (
            ("DSEC_HEADER_TIMEOUT", "header_timeout"),
            ("DSEC_BODY_TIMEOUT", "body_timeout"),
        ):
            if env.get(name, "").strip():
                kw[key] = _seconds(name, env[name])
        return cls(**kw)


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise InvalidSpec(f"{name} must be a positive number of seconds, got {text!r}", field=name)
    return value


@functools.cache
def http_limits() -> HttpLimits:
    """This process's ``HttpLimits``, read from the environment once."""
    return HttpLimits.from_env()


def error_response(err: DsecError, headers: Mapping[str, str] | None = None) -> Response:
    """A typed error as the API answers it: ``{"error": ...}`` with the error's status. A body
    that stalled closes the connection. (One too large does not: a sender that sends it all
    anyway, as the apiserver forwarding it does, then reads the answer rather than a reset;
    what is left of it is dropped as it comes, for ``body_timeout`` at most.)"""
    if isinstance(err, RequestTimeout):
        headers = {**(headers or {}), "connection": "close"}
    return Response(
        dump_json({"error": err.to_wire()}), err.http_status, headers=headers, media_type=JSON
    )


def check_declared(request: Request, limit: int) -> None:
    """``RequestTooLarge`` if the request's ``Content-Length`` says it is over ``limit``: a
    refusal before a byte of the body is read (or spooled)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(request, int(declared), limit, "")


async def body_pieces(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request's body as it arrives, refused with ``RequestTooLarge`` once it is known to
    be over ``limit`` (from ``Content-Length`` before reading, else as soon as the count passes
    it) and with ``RequestTimeout`` when no byte comes for ``body_timeout`` seconds."""
    check_declared(request, limit)
    idle = http_limits().body_timeout
    stream = request.stream()
    size = 0
    try:
        while True:
            try:
                async with asyncio.timeout(idle):
                    data = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _stalled(request, idle, size) from None
            size += len(data)
            if size > limit:
                raise _too_large(request, size, limit, " or more")
            yield data
    finally:
        await stream.aclose()


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, read within ``limit`` bytes and in time, as ``body_pieces`` reads it.
    A body not read before is read here from the server's messages directly, as Starlette's
    ``Request.stream`` would, without the two generators between (a create's body is one
    message: the generators were most of its read)."""
    if hasattr(request, "_body") or getattr(request, "_stream_consumed", True):
        body = bytearray()
        async for data in body_pieces(request, limit):
            body += data
        return bytes(body)
    check_declared(request, limit)
    idle = http_limits().body_timeout
    receive = request.receive
    pieces: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(idle):
                message = await receive()
        except TimeoutError:
            raise _stalled(request, idle, size) from None
        if message["type"] == "http.disconnect":
            request._is_disconnected = True
            raise ClientDisconnect()
        data = message.get("body", b"")
        if data:
            size += len(data)
            if size > limit:
                raise _too_large(request, size, limit, " or more")
            pieces.append(data)
        if not message.get("more_body", False):
            request._stream_consumed = True
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def read_json_body(request: Request, limit: int | None = None) -> bytes:
    """The body of a JSON request, within ``limit`` bytes; by default, the ``max_body`` of the
    route of the table the request matched (``MAX_BODY`` for one not in it)."""
    return await read_body(request, _route_limit(request) if limit is None else limit)


@functools.cache
def _table_limits() -> dict[tuple[str, str], int]:
    return {(r.method, r.path): r.max_body for r in ROUTES.values() if r.body is not None}


def _route_limit(request: Request) -> int:
    # Starlette's router puts the route it matched in the scope; its path is the template.
    path = getattr(request.scope.get("route"), "path", None)
    return _table_limits().get((request.method, path or ""), MAX_BODY)


def _stalled(request: Request, idle: float, size: int) -> RequestTimeout:
    return RequestTimeout(
        f"{request.method} {request.url.path}: no byte of the request body came "
        f"for {idle:g} s (after {size} bytes; DSEC_BODY_TIMEOUT)",
        timeout=idle,
        received=size,
    )


def _too_large(request: Request, size: int, limit: int, more: str) -> RequestTooLarge:
    return RequestTooLarge(
        f"{request.method} {request.url.path}: the request body has {size} bytes{more}; the "
        f"limit is {limit}",
        field="body",
        limit=limit,
    )


async def on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (no such path, wrong method) in the API's error shape."""
    assert isinstance(exc, HTTPException)
    err = (
        NotFound(f"no route {request.method} {request.url.path}")
        if exc.status_code == 404
        else DsecError(f"{request.method} {request.url.path}: {exc.detail}")
    )
    return Response(
        dump_json({"error": err.to_wire()}),
        exc.status_code,
        media_type=JSON,
        headers=exc.headers,
    )


class AnsweredErrors:
    """Keeps a connection open after an internal error was answered.

    Starlette's ``ServerErrorMiddleware`` answers an exception no handler expected (with the
    app's ``Exception`` handler: a 500 in the API's shape, logged there) and then raises it
    again for the server to log; uvicorn then closes the connection. A client that kept it
    alive sent its next request on it, and that request, which had nothing wrong with it,
    broke with ``Connection reset by peer`` (a create the chaos soak sent after another's
    ENOSPC). An exception raised after the answer was sent is swallowed here; one raised
    before any answer goes on up."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        answered = False

        async def watch(message: Any) -> None:
            nonlocal answered
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                answered = True

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if not answered:
                raise


def server_options() -> dict[str, Any]:
    """The uvicorn options every dsec server runs with: uvloop where installed (``DSEC_LOOP``
    picks the loop), httptools' parser under ``BoundedHttpProtocol`` (request heads bounded
    in size and time by ``http_limits()``; h11, bounded in size only, where httptools is
    missing), our log handlers (not uvicorn's), no access log of uvicorn's own
    (``ObservedRequests`` writes one), connections kept 300 s."""
    limits = http_limits()
    http: Any = "h11"
    extra: dict[str, Any] = {"h11_max_incomplete_event_size": limits.max_header_bytes}
    if _HTTPTOOLS:
        bounds = (limits.max_header_bytes, limits.header_timeout, limits.body_timeout)
        http, extra = bounded_protocol(*bounds), {}
    return dict(
        loop=os.environ.get("DSEC_LOOP") or ("uvloop" if _has("uvloop") else "asyncio"),
        http=http,
        log_level="warning",
        log_config=None,
        access_log=False,
        timeout_keep_alive=300,
        **extra,
    )


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def basic_password(value: bytes) -> str | None:
    """The password of an ``Authorization: Basic`` header's value (any user name), None if
    the value is not Basic auth: clients that take only a URL (SandboxFusion's, verl's) send
    a key as ``http://dsec:KEY@host/``."""
    scheme, _, rest = value.decode("latin-1").partition(" ")
    if scheme.lower() != "basic" or not rest.strip():
        return None
    try:
        pair = base64.b64decode(rest.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    _user, colon, password = pair.partition(":")
    return password if colon and password else None


def request_key(headers: Any) -> str | None:
    """The API key a request head carries (ASGI ``(name, value)`` byte pairs): the
    ``Authorization: Bearer`` value, else ``X-API-Key``, else ``X-Access-Token`` (E2B's envd
    paths), else HTTP Basic auth's password (``basic_password``); None if none does. The one
    rule: the key the apiserver checks is the key every route then acts as."""
    bearer = api_key = access = basic = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, rest = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and rest.strip():
                bearer = rest.strip()
            elif scheme.lower() == "basic":
                basic = basic_password(value)
        elif name == b"x-api-key":
            api_key = value.decode("latin-1")
        elif name == b"x-access-token":
            access = value.decode("latin-1")
    return bearer or api_key or access or basic or None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ``work`` cancelled as soon as the client closes its connection
    (a queued create whose caller gave up leaves the queue). The request's body must have
    been read: what the connection says next is then only its end."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, DsecError):
            await task
        raise DsecError(f"{request.method} {request.url.path}: the client closed its request")
    return task.result()
