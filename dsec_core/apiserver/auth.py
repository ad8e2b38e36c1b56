"""Authenticate first: an ASGI middleware that checks every HTTP request's API key before any
route runs, so nothing of a request whose key IAM does not know is read, parsed or spooled.

The key is ``dsec_core.api.serving.request_key``'s (``Authorization: Bearer`` or HTTP Basic
auth's password, else ``X-API-Key``, else ``X-Access-Token``), from the request head only, and
the routes act as that same key. A refused request is answered at once, in the
shape its route family's clients expect (``refusal``; the node API's ``{"error": ...}`` by
default), with ``Connection: close``: the body it may be sending is never read, and the
connection is not kept for another request behind an unread body. The principal a key
authenticates rides in the ASGI scope (``PRINCIPAL``) to the route, which never looks at the
key again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..api.serving import error_response, request_key
from ..errors import DsecError
from .timing import TIMING, Stages

__all__ = ["PRINCIPAL", "Authenticated"]

#: The ASGI scope key the authenticated principal is kept under.
PRINCIPAL = "dsec.principal"

Refusal = Callable[[str, DsecError], Response | None]


class Authenticated:
    """Check each request's key with ``authenticate`` (IAM's, which raises
    ``AuthenticationFailed``, or ``IamUnavailable`` if its store is down) before ``app`` sees
    the request. ``refusal(path, error)`` may answer a refused request in its route family's
    own shape (E2B's); None falls back to the node API's error body."""

    def __init__(
        self,
        app: ASGIApp,
        authenticate: Callable[[str | None], Any],
        refusal: Refusal | None = None,
    ) -> None:
        self.app = app
        self.authenticate = authenticate
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stages = Stages()
        try:
            principal = self.authenticate(request_key(scope["headers"]))
        except DsecError as e:
            response = (self.refusal and self.refusal(scope["path"], e)) or error_response(e)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        scope[PRINCIPAL] = principal
        stages.mark("auth")
        scope[TIMING] = stages
        await self.app(scope, receive, send)
