"""A request id follows a request from the apiserver into the node: a client's
``X-Request-Id`` sent to ``dsec apiserver`` comes back in the answer and is on the node
daemon's JSON log lines (its access line and its own) for the work it did for that request."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest

from dsec_core.iam import Iam
from dsec_core.records import PROJECT_LABEL
from dsec_core.testing.apiserver import NamedNode, named_nodes, running_apiserver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[tuple[NamedNode, str, str]]:
    """One named node behind an apiserver, and a member key of project ``obs``."""
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    try:
        iam.create_project("obs")
        key = iam.create_key("obs", "member")[1]
        with named_nodes({"n1": {}}) as nodes, running_apiserver(nodes, iam_url) as api:
            yield nodes[0], api.url, key
    finally:
        iam.close()


def _node_lines(node: NamedNode, rid: str, want: int, timeout: float = 5.0) -> list[dict]:
    """The node's log lines that carry ``rid``, once there are ``want`` access lines among
    them (each is written just after its answer went out)."""
    path = node.node.home / "dsecd.log"
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        mine = [x for x in lines if x.get("request_id") == rid]
        if sum(x["logger"] == "dsec.access" for x in mine) >= want:
            return mine
        assert time.monotonic() < deadline, f"no {want} access lines with {rid}: {mine}"
        time.sleep(0.05)


def test_the_request_id_goes_from_the_apiserver_to_the_node(plane):
    node, url, key = plane
    # made on the node itself, as the apiserver would have made it for project obs (this test
    # follows requests, not creates: the apiserver's tests cover those)
    with node.node.client() as direct:
        sid = direct.create(
            layers=(node.node.layer.ref,), memory="64M", ttl=120, labels={PROJECT_LABEL: "obs"}
        ).id
    rid = f"rollout-{secrets.token_hex(4)}"
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": rid}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        r = c.get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == rid
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo hi"})
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        r = c.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code == 200 and r.headers["x-request-id"] == rid

    mine = _node_lines(node, rid, want=3)
    access = [(x["method"], x["route"], x["status"]) for x in mine if x["logger"] == "dsec.access"]
    for line in [
        ("GET", "/v1/sandboxes/{sid}", 200),
        ("POST", "/v1/sandboxes/{sid}/exec", 200),
        ("DELETE", "/v1/sandboxes/{sid}", 200),
    ]:
        assert line in access, access
    # and the node's own line about the work, not only the access lines
    assert any(x["logger"] == "dsec.node" and f"killing sandbox {sid}" in x["msg"] for x in mine)


def test_without_an_id_the_node_logs_the_one_the_apiserver_made(plane):
    node, url, key = plane
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.get("/v1/sandboxes", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    mine = _node_lines(node, rid, want=1)
    assert [x["route"] for x in mine if x["logger"] == "dsec.access"] == ["/v1/sandboxes"]
