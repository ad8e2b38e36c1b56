"""Builds through ``dsec apiserver`` (issue 13, deliverable 2), over a real node daemon with
IAM keys: only admin and builder keys may create a build's sandbox (``BUILD_LABEL``), use or
make a staged layer (``STAGED_PREFIX``); to agent and member keys of the same project a
build's sandbox is as another project's (404 on every route, not listed) and staged layers
are neither listed nor usable."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import dsec
from dsec_core.errors import LeakFound, PermissionDenied, UnknownSandbox
from dsec_core.iam import ROLES, Iam
from dsec_core.records import BUILD_LABEL, STAGED_PREFIX
from dsec_core.testing.apiserver import named_nodes, running_apiserver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

PROJECT = "envs/team"
HIDDEN = "def test_the_hidden_edge_case():\n    assert solve([]) == 0\n"


class Cluster:
    def __init__(self, iam: Iam, iam_url: str, url: str, layer: str) -> None:
        self.iam, self.iam_url, self.url, self.layer = iam, iam_url, url, layer

    def client(self, role: str) -> dsec.Client:
        return dsec.Client(self.url, api_key=self.iam.create_key(PROJECT, role)[1])

    def spec(self, **kw) -> dsec.SandboxSpec:
        return dsec.SandboxSpec(**{"layers": (self.layer,), "memory": "64M", "cpu": 0.5, **kw})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    iam.create_project("envs")
    iam.create_project(PROJECT)
    with named_nodes({"n1": {}}) as nodes, running_apiserver(nodes, iam_url) as api:
        yield Cluster(iam, iam_url, api.url, nodes[0].node.layer.ref)
    iam.close()


def test_builder_is_a_role_and_the_cli_makes_its_keys(cluster):
    assert "builder" in ROLES
    cli = [sys.executable, "-m", "dsec_core.cli", "iam", "--iam", cluster.iam_url, "key"]
    out = subprocess.run(
        [*cli, "create", "--project", PROJECT, "--role", "builder", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    assert made["key"]["role"] == "builder" and made["key"]["project"] == PROJECT
    with dsec.Client(cluster.url, api_key=made["secret"]) as c:
        assert isinstance(c.list(), list)  # the key authenticates


def test_a_builder_builds_and_runtime_keys_see_nothing_of_it(cluster):
    builder, agent, member = (cluster.client(r) for r in ("builder", "agent", "member"))
    made: list[dsec.Sandbox] = []
    try:
        build = builder.create(cluster.spec(labels={BUILD_LABEL: "py-env"}))
        made.append(build)
        assert build.info.labels[BUILD_LABEL] == "py-env"
        build.write_file("/workspace/app.py", b"print('hi')\n")
        assert build.exec("cat /workspace/app.py").stdout == b"print('hi')\n"
        assert [e.name for e in build.list_dir("/workspace")] == ["app.py"]
        assert build.id in {i.id for i in builder.list()}
        # the leak scan answers through the apiserver as from the node
        build.write_file("/workspace/tests/test_hidden.py", HIDDEN.encode())
        with pytest.raises(LeakFound) as e:
            build.pack_diff(name=STAGED_PREFIX + "py-env", secrets={"hidden-test": HIDDEN})
        assert e.value.hits == [{"path": "/workspace/tests/test_hidden.py", "label": "hidden-test"}]
        assert HIDDEN.strip() not in str(e.value)
        build.exec("rm -r /workspace/tests")
        staged = build.pack_diff(
            name=STAGED_PREFIX + "py-env", version="1", secrets={"hidden-test": HIDDEN}
        )
        assert staged.name.endswith("-" + STAGED_PREFIX + "py-env")
        assert staged.ref in {i.ref for i in builder.layers()}
        (copy,) = builder.restore(staged.ref, 1, memory="64M")
        made.append(copy)
        assert copy.read_file("/workspace/app.py") == b"print('hi')\n"

        # a runtime sandbox of the same project, for the pack_diff check below
        own = agent.create(cluster.spec())
        made.append(own)
        for c in (agent, member):
            # the build's sandbox: 404 on every route, and not listed
            assert build.id not in {i.id for i in c.list()}
            calls: list[tuple[str, tuple, dict]] = [
                ("get", (), {}),
                ("exec", (["true"],), {}),
                ("read_file", ("/workspace/app.py",), {}),
                ("write_file", ("/workspace/x", b"x"), {}),
                ("list_dir", ("/",), {}),
                ("pack_diff", (), {"name": "mine"}),
                ("kill", (), {}),
            ]
            for method, args, kw in calls:
                with pytest.raises(UnknownSandbox):
                    getattr(c, method)(build.id, *args, **kw)
            # no build sandboxes, no staged layers
            with pytest.raises(PermissionDenied, match="builder"):
                c.create(cluster.spec(labels={BUILD_LABEL: "mine"}))
            for ref in (staged.ref, STAGED_PREFIX + "py-env@1"):
                with pytest.raises(PermissionDenied, match="staged"):
                    c.create(cluster.spec(layers=(ref, cluster.layer)))
            with pytest.raises(PermissionDenied, match="staged"):
                c.restore(staged.ref, 1, memory="64M")
            with pytest.raises(PermissionDenied, match=BUILD_LABEL):
                c.restore(own.pack_diff(name="plain").ref, 1, labels={BUILD_LABEL: "x"})
            with pytest.raises(PermissionDenied, match="staged"):
                c.pack_diff(own.id, name=STAGED_PREFIX + "sneaky")
            assert not [i for i in c.layers() if STAGED_PREFIX in i.name]
            assert cluster.layer in {i.ref for i in c.layers()}
        # what runtime keys were refused left nothing behind
        assert not [i for i in builder.layers() if "sneaky" in i.name]
        assert {i.id for i in builder.list()} == {s.id for s in made}
        # the build sandbox is still the builder's, untouched
        assert build.read_file("/workspace/app.py") == b"print('hi')\n"
        assert not build.exec("test -e /workspace/x").exit_code == 0
    finally:
        for sb in made:
            builder.kill(sb.id)
        for c in (builder, agent, member):
            c.close()


def test_an_admin_may_build_too(cluster):
    with cluster.client("admin") as admin:
        with admin.create(cluster.spec(labels={BUILD_LABEL: "adm"})) as sb:
            snap = sb.pack_diff(name=STAGED_PREFIX + "adm")
            assert sb.id in {i.id for i in admin.list()}
        assert snap.ref in {i.ref for i in admin.layers()}


def test_the_async_sdk_packs_with_secrets(cluster):
    key = cluster.iam.create_key(PROJECT, "builder")[1]

    async def main() -> None:
        async with dsec.AsyncClient(cluster.url, api_key=key) as c:
            sb = await c.create(cluster.spec(labels={BUILD_LABEL: "async"}))
            try:
                await sb.write_file("/answer.txt", HIDDEN.encode())
                with pytest.raises(LeakFound) as e:
                    await sb.pack_diff(name=STAGED_PREFIX + "async", secrets={"hidden": HIDDEN})
                assert e.value.hits == [{"path": "/answer.txt", "label": "hidden"}]
                snap = await sb.pack_diff(
                    name=STAGED_PREFIX + "async",
                    exclude=["/answer.txt"],  # left out: nothing to find
                    secrets={"hidden": HIDDEN},
                )
                assert snap.kind == "snapshot"
            finally:
                await sb.kill()

    asyncio.run(main())


def test_resolving_an_image_is_a_builders_business(cluster):
    """``resolve_image`` through the apiserver: agent and member keys are refused before any
    node is asked; a builder's request reaches the node, whose answer for an image it has
    nowhere is ``UnknownImage`` naming it (a node without docker, or without an OCI source,
    looks there and says so)."""
    for role in ("agent", "member"):
        with cluster.client(role) as c, pytest.raises(PermissionDenied, match="resolve images"):
            c.resolve_image("python:3.11-slim-bookworm")
    with cluster.client("builder") as c:
        with pytest.raises(dsec.UnknownImage, match=r"no-such-image:3\.11-slim"):
            c.resolve_image("no-such-image:3.11-slim")
        with pytest.raises(dsec.InvalidSpec, match="not a docker image reference"):
            c.resolve_image("${BASE}")
