"""Connect-RPC (JSON codec) as envd speaks it to the e2b SDK: unary calls are a JSON body in and
out (errors: an HTTP status with ``{"code", "message"}``); server streams are enveloped
messages (one flags byte, a 4-byte big-endian length, the JSON) ending with an end-of-stream
envelope (flags ``0x02``) that carries the error, if any, and the metadata.

Only what envd's services need is here: JSON, no compression (the SDK turns it off both ways).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..api.routes import MAX_ITEMS, load_json
from ..api.serving import read_body
from ..errors import (
    AdmissionRejected,
    AuthenticationFailed,
    DsecError,
    ExecTimeout,
    InvalidSpec,
    NodeUnavailable,
    NotFound,
    PermissionDenied,
    RequestTimeout,
    RequestTooLarge,
    SandboxNotRunning,
    SandboxPathError,
    SandboxPaused,
    UnknownSandbox,
)

__all__ = [
    "END_STREAM",
    "STREAM_CONTENT_TYPE",
    "RpcError",
    "end_stream",
    "envelope",
    "read_message",
    "rpc_error",
    "timeout_seconds",
    "unary_error",
]

STREAM_CONTENT_TYPE = "application/connect+json"
END_STREAM = 0x02
#: The largest request message read (envd's requests are small: paths, a command line).
MAX_REQUEST = 4 << 20

#: Connect's codes and the HTTP status a unary error carries for each (the Connect spec).
CODE_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

ENOENT, EEXIST = 2, 17


class RpcError(Exception):
    """A Connect error to answer with: ``code`` is one of ``CODE_STATUS``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def not_running(sandbox_id: str, why: str = "") -> RpcError:
    """What E2B's sandbox proxy answers for a sandbox that is gone: ``unavailable`` with
    "... was not found", which the SDK raises as ``SandboxNotRunningException``."""
    tail = f" ({why})" if why else ""
    return RpcError("unavailable", f"The sandbox {sandbox_id} was not found{tail}")


def rpc_error(e: DsecError, sandbox_id: str = "") -> RpcError:
    """The Connect error for a dsec error, so the SDK raises its own matching exception."""
    if isinstance(e, AuthenticationFailed):
        return RpcError("unauthenticated", e.message)
    if isinstance(e, PermissionDenied):
        return RpcError("permission_denied", e.message)
    if isinstance(e, UnknownSandbox):
        return not_running(sandbox_id or str(getattr(e, "name", "")), e.message)
    if isinstance(e, (SandboxPaused, SandboxNotRunning)):
        return not_running(sandbox_id, e.message)
    if isinstance(e, SandboxPathError):
        errno = e.context.get("errno")
        if errno == ENOENT:
            return RpcError("not_found", e.message)
        if errno == EEXIST:
            return RpcError("already_exists", e.message)
        return RpcError("invalid_argument", e.message)
    if isinstance(e, NotFound):
        return RpcError("not_found", e.message)
    if isinstance(e, RequestTooLarge):
        return RpcError("resource_exhausted", e.message)
    if isinstance(e, RequestTimeout):
        return RpcError("deadline_exceeded", e.message)
    if isinstance(e, InvalidSpec):
        return RpcError("invalid_argument", e.message)
    if isinstance(e, AdmissionRejected):
        return RpcError("resource_exhausted", e.message)
    if isinstance(e, ExecTimeout):
        return RpcError("deadline_exceeded", e.message)
    if isinstance(e, NodeUnavailable):
        return RpcError("unavailable", e.message)
    return RpcError("internal", f"{type(e).__name__}: {e.message}")


def envelope(message: Mapping[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_stream(error: RpcError | None = None) -> bytes:
    """The end-of-stream envelope: ``{}`` after success, ``{"error": {...}}`` after a failure."""
    body: dict[str, Any] = {}
    if error is not None:
        body["error"] = {"code": error.code, "message": error.message}
    return envelope(body, END_STREAM)


def unary_error(error: RpcError) -> Response:
    return JSONResponse(
        {"code": error.code, "message": error.message}, status_code=CODE_STATUS[error.code]
    )


def timeout_seconds(request: Request) -> float | None:
    """The call's deadline from ``Connect-Timeout-Ms``, in seconds (None: none)."""
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise RpcError("invalid_argument", f"bad connect-timeout-ms {raw!r}") from None
    return max(ms, 1) / 1000.0


async def read_message(request: Request, *, stream: bool) -> dict[str, Any]:
    """The request's one message: the body as JSON (unary), or the one enveloped JSON message
    of a streaming call (``application/connect+json``). Read within ``MAX_REQUEST`` and in
    time, and nested no deeper than ``MAX_DEPTH``: ``RequestTooLarge``, ``RequestTimeout`` or
    ``InvalidSpec`` otherwise (``rpc_error`` makes them Connect's codes)."""
    data = await read_body(request, MAX_REQUEST + 5)
    if stream:
        if len(data) < 5:
            raise RpcError("invalid_argument", "a streaming request needs one enveloped message")
        flags, length = struct.unpack(">BI", data[:5])
        if flags & 0x01:
            raise RpcError("unimplemented", "compressed messages are not supported")
        data = data[5 : 5 + length]
    message = load_json(data or b"{}", "request", max_items=MAX_ITEMS)
    if not isinstance(message, dict):
        raise RpcError("invalid_argument", "the request must be a JSON object")
    return message
