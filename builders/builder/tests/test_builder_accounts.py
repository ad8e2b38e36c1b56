"""The builder through ``dsec apiserver`` with IAM keys: the session under a builder key, QA
under a second key, and a runtime agent key of the same project that can neither open a build
nor see its session, but uses the published environment."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from dsec_builder import BuildContext, BuildSession, BuildTools

from dsec_core.errors import DsecError, PermissionDenied, UnknownSandbox
from dsec_core.iam import Iam
from dsec_core.records import STAGED_PREFIX
from dsec_core.sdk import Client
from dsec_core.testing.apiserver import named_nodes, running_apiserver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

PROJECT = "envs/builders"


@pytest.fixture
def accounts(tmp_path, install_python_env) -> Iterator[tuple[BuildContext, Client]]:
    """A builder's context (session key, QA key, both role builder) and an agent's client."""
    iam_url = f"sqlite://{tmp_path / 'iam.db'}"
    iam = Iam.open(iam_url)
    iam.create_project("envs")
    iam.create_project(PROJECT)
    with contextlib.ExitStack() as stack:
        nodes = stack.enter_context(named_nodes({"b1": {}}))
        install_python_env(nodes[0].node)
        api = stack.enter_context(running_apiserver(nodes, iam_url))

        def client(role: str) -> Client:
            return stack.enter_context(Client(api.url, api_key=iam.create_key(PROJECT, role)[1]))

        ctx = BuildContext(nodes[0].node.home, client("builder"), client("builder"))
        yield ctx, client("agent")
        for record in ctx.store.list():
            with contextlib.suppress(DsecError):
                ctx.client.kill(record.sandbox_id)
    iam.close()


def test_a_build_under_builder_keys_is_invisible_to_agent_keys(accounts):
    ctx, agent = accounts
    agent_ctx = BuildContext(ctx.home, agent, agent)
    with pytest.raises(PermissionDenied):
        BuildSession.start(agent_ctx, from_env="python", name="denied")
    assert "denied" not in {r.name for r in ctx.store.list()}

    session = BuildSession.start(ctx, from_env="python", name="accounts", version="1")
    tools = BuildTools(session)
    tools.call("write", {"path": "/root/made", "content": "by the builder\n"})
    with pytest.raises(UnknownSandbox):
        agent.get(session.sandbox_id)
    assert session.sandbox_id not in {s.id for s in agent.list()}

    done = tools.call("finish", {"checks": [{"name": "made", "command": "test -f /root/made"}]})
    assert done["report"]["passed"] and done["layer"]["name"] == "accounts"
    assert done["report"]["layer"].partition("-")[2].startswith(STAGED_PREFIX)  # scoped
    # the agent key uses what was published, as any environment
    with agent.create(environment="accounts", ttl=60, memory="256M") as sb:
        assert sb.read_file("/root/made") == b"by the builder\n"
