"""SandboxFusion's ``POST /run_code`` on the apiserver (``dsec_core.fusion``): for keys only (the
``Authenticated`` middleware refuses a request without one, 401, before this runs; clients
that take only a URL send the key as Basic auth's password, ``http://dsec:KEY@host/run_code``),
checked here so nothing malformed or in an unknown language reaches a node, and run in a pool
of the caller's project on a node, placed as an FnCall is (``Gateway.on_pool_node``): on the
node of the project's last call of the environment while placement lets it take a member,
else where placement says; with the project's quotas full, only on a member a pool already
has (``start=0``). The node answers in SandboxFusion's shape, passed back as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from starlette.requests import Request
from starlette.routing import Route as StarletteRoute

from ..errors import DsecError
from ..fusion import CodeRun, fusion_endpoint
from ..observe import current_request_id, new_request_id
from .auth import PRINCIPAL

if TYPE_CHECKING:
    from .app import Gateway

__all__ = ["run_code_route"]

#: How long, past its own timeouts, a run may take on the node (a member's start, a wait for
#: a free one).
SLACK = 120.0


def run_code_route(gw: Gateway) -> StarletteRoute:
    """The apiserver's ``POST /run_code`` over ``gw``'s nodes."""

    async def run(request: Request, raw: bytes, spec: CodeRun) -> bytes:
        principal = request.scope[PRINCIPAL]
        try:
            return await _placed(gw, principal.project, raw, spec)
        except DsecError as e:
            raise gw.scrub(principal, e) from None

    return StarletteRoute("/run_code", fusion_endpoint(run), methods=["POST"])


async def _placed(gw: Gateway, project: str, raw: bytes, spec: CodeRun) -> bytes:
    def to_node(start: bool) -> tuple[str, bytes]:
        return f"/run_code?project={quote(project, safe='')}&start={int(start)}", raw

    return await gw.on_pool_node(
        project,
        spec.environment,
        spec.cpu,
        spec.memory,
        to_node,
        spec.compile_timeout + spec.run_timeout + SLACK,
        current_request_id() or new_request_id(),
    )
