"""Who is calling and with which dsec client: the API key of a request (``X-API-KEY`` on the
control plane, ``X-Access-Token`` on envd's paths), the injected ``connect`` that turns it into
a dsec client, and the E2B error bodies (``{"code", "message"}``) dsec errors become."""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..api.serving import request_key
from ..errors import (
    AdmissionRejected,
    AuthenticationFailed,
    BackendUnavailable,
    DsecError,
    FeatureUnavailable,
    InvalidSpec,
    NodeUnavailable,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    RequestTimeout,
    RequestTooLarge,
    SandboxNotRunning,
    SandboxPaused,
)
from ..sdk import AsyncClient

__all__ = [
    "ENVD_PORT",
    "Connect",
    "api_error",
    "api_status",
    "caller_client",
    "envd_key",
    "error_body",
    "sandbox_of",
]

#: What ``make_app`` is given: an API key in, a dsec client for that caller out (or awaited).
#: The app closes the client when the request that asked for it is done.
Connect = Callable[[str], "AsyncClient | Awaitable[AsyncClient]"]

#: envd's port in E2B; the SDK names it in ``E2b-Sandbox-Port`` and in sandbox host names.
ENVD_PORT = 49983
_HOST = re.compile(rf"^{ENVD_PORT}-([^.]+)\.")


def api_status(e: DsecError) -> int:
    """The HTTP status E2B's API answers with for what ``e`` says."""
    if isinstance(e, AuthenticationFailed):
        return 401
    if isinstance(e, PermissionDenied):
        return 403
    if isinstance(e, NotFound):
        return 404
    if isinstance(e, (AdmissionRejected, QuotaExceeded)):
        return 429
    if isinstance(e, (RequestTooLarge, RequestTimeout)):
        return e.http_status  # 413, 408
    if isinstance(e, InvalidSpec):
        return 400
    if isinstance(e, (SandboxPaused, SandboxNotRunning, FeatureUnavailable)):
        return 409
    if isinstance(e, (NodeUnavailable, BackendUnavailable)):
        return 503
    return 500


def error_body(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def api_error(e: DsecError) -> JSONResponse:
    """E2B's error answer for a dsec error. Over quota is final (``Should-Retry: false``, so the
    SDK does not retry it); a full node may free up, so its 429 is left to the SDK's retries.
    A body that stalled closes the connection."""
    status = api_status(e)
    r = error_body(status, f"{type(e).__name__}: {e.message}")
    if isinstance(e, QuotaExceeded):
        r.headers["Should-Retry"] = "false"
    if isinstance(e, RequestTimeout):
        r.headers["Connection"] = "close"
    return r


def envd_key(request: Request) -> str:
    """The caller's key on envd's paths: the ``envdAccessToken`` a create or connect answered
    with (the SDK sends it as ``X-Access-Token``), else an ``X-API-KEY``; a Bearer key first,
    as the apiserver checked it (``request_key``: one rule for which key a request is)."""
    key = request_key(request.scope["headers"])
    if not key:
        raise AuthenticationFailed("no X-Access-Token: connect to the sandbox through the SDK")
    return key


def sandbox_of(request: Request) -> str:
    """The sandbox an envd request is for: ``E2b-Sandbox-Id`` (sent whenever
    ``E2B_SANDBOX_URL`` is set), else the ``49983-<id>.<domain>`` host name."""
    sid = request.headers.get("e2b-sandbox-id")
    if sid:
        return sid
    m = _HOST.match(request.headers.get("host", ""))
    if m:
        return m.group(1)
    raise InvalidSpec("no E2b-Sandbox-Id header: which sandbox is this for?", field="headers")


@contextlib.asynccontextmanager
async def caller_client(connect: Connect, key: str) -> AsyncIterator[Any]:
    """The dsec client ``connect`` gives for ``key``, closed on the way out."""
    made = connect(key)
    client = await made if inspect.isawaitable(made) else made
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.close()
