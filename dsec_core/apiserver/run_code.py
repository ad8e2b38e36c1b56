"""SandboxFusion's ``POST /run_code`` on the apiserver (``dsec_core.fusion``): for keys only (the
``Authenticated`` middleware refuses a request without one, 401, before this runs; clients
that take only a URL send the key as Basic auth's password, ``http://dsec:KEY@host/run_code``),
checked here so nothing malformed or in an unknown language reaches a node, and run in a pool
of the caller's project on a node, placed as an FnCall is (``app._placed_handler``): on the
node of the project's last call of the environment while placement lets it take a member,
else where placement says; with the project's quotas full, only on a member a pool already
has (``start=0``). The node answers in SandboxFusion's shape, passed back as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from starlette.requests import Request
from starlette.routing import Route as StarletteRoute

from ..errors import AdmissionRejected, DsecError, QuotaExceeded
from ..fusion import CodeRun, fusion_endpoint
from ..observe import current_request_id, new_request_id
from ..records import SandboxSpec
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
    rid = current_request_id() or new_request_id()
    full: QuotaExceeded | None = None
    try:
        gw.check_quota(project, 1, spec.cpu, spec.memory)
    except QuotaExceeded as e:
        full = e
    home_key = (project, spec.environment)
    home = gw.pool_homes.get(home_key)
    if full is None:
        place = SandboxSpec(environment=spec.environment)
        try:
            shares, _ = gw.place(place, 1, only=home)
        except AdmissionRejected:
            shares, _ = gw.place(place, 1)
        names = list(shares)
    else:  # no member may start: wherever the project's pool may have one
        names = sorted((e.name for e in gw.nodes.healthy()), key=lambda n: n != home)
    target = f"/run_code?project={quote(project, safe='')}&start={0 if full else 1}"
    timeout = spec.compile_timeout + spec.run_timeout + SLACK
    for name in names:
        hold = None if full else gw.nodes.ledger.hold(project, name, 1, spec.cpu, spec.memory)
        try:
            answer = await gw._request(gw.nodes.nodes[name], "POST", target, raw, timeout, rid)
        except AdmissionRejected as e:
            if hold is not None:
                gw.nodes.ledger.settle(hold, 0)
            if full is not None and e.context.get("reason") == "pool-start":
                continue  # no member of the project's pool there: the next node
            raise
        except BaseException:
            if hold is not None:
                gw.nodes.ledger.settle(hold, 0)
            raise
        if hold is not None:  # it may have started a member: counted until the next probe
            gw.nodes.ledger.settle(hold, 1)
        gw.pool_homes[home_key] = name
        return answer
    assert full is not None
    raise full
