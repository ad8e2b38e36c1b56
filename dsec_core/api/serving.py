"""The server side of the route table's HTTP, shared by the node daemon and the apiserver:
typed errors as answers, JSON bodies read within ``MAX_BODY``, Starlette's own refusals in
the API's error shape, and the uvicorn options both run with."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ..errors import DsecError, NotFound, RequestTooLarge
from .routes import JSON, MAX_BODY, dump_json

__all__ = ["error_response", "on_http_error", "read_json_body", "server_options"]


def error_response(err: DsecError, headers: Mapping[str, str] | None = None) -> Response:
    """A typed error as the API answers it: ``{"error": ...}`` with the error's status."""
    return Response(
        dump_json({"error": err.to_wire()}), err.http_status, headers=headers, media_type=JSON
    )


async def read_json_body(request: Request, limit: int = MAX_BODY) -> bytes:
    """The body of a JSON request, refused (``RequestTooLarge``) as soon as it is known to be
    over ``limit``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    async for data in request.stream():
        body += data
        if len(body) > limit:
            raise _too_large(len(body), limit)
    return bytes(body)


def _too_large(size: int, limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"the request body has {size} bytes or more; the limit is {limit}",
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


def server_options() -> dict[str, Any]:
    """The uvicorn options every dsec server runs with: uvloop and httptools where installed
    (``DSEC_LOOP`` picks the loop), our log handlers (not uvicorn's), no access log of
    uvicorn's own (``ObservedRequests`` writes one), connections kept 300 s."""
    return dict(
        loop=os.environ.get("DSEC_LOOP") or ("uvloop" if _has("uvloop") else "asyncio"),
        http="httptools" if _has("httptools") else "h11",
        log_level="warning",
        log_config=None,
        access_log=False,
        timeout_keep_alive=300,
    )


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False
