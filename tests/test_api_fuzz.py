"""schemathesis fuzzes a real daemon over TCP from the OpenAPI document alone: no request may
make it fail (5xx), and every answer, errors included, must fit the document.

Sandbox-scoped routes get a real sandbox's id (and a real session's) most of the time, and
create requests the kit's real layer, so the fuzzer reaches the backend and the agent rather than
stopping at "no such sandbox" or "no such layer". Bounded: a few dozen cases per route, at most
two sandboxes per create (removed after each), well under a minute.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from dsec_core.api.openapi import openapi_document

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture(scope="module")
def target(network_node):
    """A sandbox and a session in it for the fuzzer to aim at; removed afterwards."""
    with network_node.node.client() as client:
        sb = client.create(layers=(network_node.node.layer.ref,), memory="64M", ttl=600)
        ses = sb.session()
        try:
            yield network_node, client, sb.id, ses.id
        finally:
            for info in client.list():
                client.kill(info.id)


def _aim_create(body, layer: str) -> bool:
    """Point a create request at a layer that exists and keep it to two sandboxes."""
    if not (isinstance(body, dict) and isinstance(body.get("spec"), dict)):
        return False
    body["spec"]["layers"] = [layer]
    body["spec"].pop("environment", None)
    count = body.get("count")
    if isinstance(count, int) and not isinstance(count, bool) and count > 2:
        body["count"] = 2
    return True


def _bound_exec(body) -> None:
    """A random command must not run long: bound its timeout (invalid ones stay invalid)."""
    if isinstance(body, dict) and "cmd" in body:
        timeout = body.get("timeout")
        if timeout is None or (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 2
        ):
            body["timeout"] = 2


@schema.parametrize()
@settings(
    max_examples=30,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_api_fuzz(case, target):
    node, client, sid, ses = target
    params = case.path_parameters or {}
    # Aim at the real sandbox, except for killing it (that would end the run's target).
    if "sid" in params and not (case.method == "DELETE" and case.path.endswith("{sid}")):
        params["sid"] = sid
        if "ses" in params and len(str(case.body)) % 2:
            params["ses"] = ses
    creates = case.operation.label == "POST /v1/sandboxes" and _aim_create(
        case.body, node.node.layer.ref
    )
    _bound_exec(case.body)
    try:
        case.call_and_validate(
            base_url=node.http,
            headers={"Authorization": f"Bearer {node.token}"},
            checks=[not_a_server_error, response_schema_conformance],
            timeout=30,
        )
    finally:
        if creates:
            for info in client.list():
                if info.id != sid:
                    client.kill(info.id)
