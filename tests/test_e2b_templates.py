"""E2B's template API on a real ``dsec apiserver`` over a node, driven by the stock ``e2b``
SDK: ``Template`` steps and a Dockerfile build into dsec layers, a sandbox of the template sees
the copied files, the ENV and the WORKDIR, an unchanged rebuild is a cache hit that starts no
build sandbox, a failing RUN and an unknown image are build errors saying why, a member key
may not build, and aliases, listing and deleting work as the SDK expects."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("e2b")

from e2b import (
    AsyncSandbox,
    AsyncTemplate,
    BuildException,
    Sandbox,
    SandboxException,
    Template,
    wait_for_file,
)
from e2b.api.client.api.templates import (
    delete_templates_template_id,
    get_templates,
    get_templates_template_id,
    get_v2_templates,
)
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig

from dsec_core.e2b.template_build import BuildFailed, copy_plan
from dsec_core.e2b.templates import BuildNetwork, ImageTable
from dsec_core.errors import InvalidSpec, ToolError
from dsec_core.iam import ROOT, Iam
from dsec_core.layers.image import export_image
from dsec_core.layers.store import LayerStore
from dsec_core.records import BUILD_LABEL
from dsec_core.testing.apiserver import named_nodes, start_apiserver
from dsec_core.testing.dockerd import private_dockerd

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

#: What ``FROM`` names in these tests; the operator's table maps it to the kit's environment.
IMAGE = "python:3.11-slim-bookworm"


class Plane:
    def __init__(
        self, url: str, iam: Iam, node: object, files: Path, docker_image: str | None
    ) -> None:
        self.url, self.iam, self.node, self.files = url, iam, node, files
        #: An image in the node's docker (a private dockerd), or None where none can run.
        self.docker_image = docker_image
        iam.create_project("tpl")
        self.builder = iam.create_key("tpl", "builder")[1]
        self.member = iam.create_key("tpl", "member")[1]

        self.admin = iam.create_key(ROOT, "admin")[1]

    def placed(self) -> float:
        """How many sandboxes the apiserver placed so far (its metrics: the operator's)."""
        r = httpx.get(self.url + "/metrics", headers={"X-API-Key": self.admin})
        r.raise_for_status()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in r.text.splitlines()
            if line.startswith("dsec_placement_decisions_total")
        )


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[Plane]:
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    files = tmp_path_factory.mktemp("e2b-files")
    iam = Iam.open(iam_url)
    with contextlib.ExitStack() as stack:
        try:  # the node's own docker, for FROM an image it holds
            dockerd = stack.enter_context(private_dockerd(tmp_path_factory.mktemp("dockerd")))
        except ToolError:
            dockerd = None
        env = {"DOCKER_HOST": dockerd.host} if dockerd else {}
        nodes = stack.enter_context(named_nodes({"t1": {}}, env=env))
        node = nodes[0].node
        environment = node.environment("e2b-tpl-kit")
        image = None
        if dockerd is not None:
            image = "dsec-e2b-tpl-test:1"
            archive = export_image(
                LayerStore(node.config.layer_dir),
                [node.layer.ref],
                tmp_path_factory.mktemp("image") / "image.tar",
                tag=image,
                env=["FROM_IMAGE=docker"],
            )
            assert dockerd.run("load", "-i", str(archive)).returncode == 0
        with pytest.MonkeyPatch.context() as mp:  # read as the apiserver starts
            mp.setenv("DSEC_E2B_TEMPLATES", f"base={environment}")
            mp.setenv("DSEC_E2B_IMAGES", f"{IMAGE}={environment}")
            mp.setenv("DSEC_E2B_FILES", str(files))
            api = start_apiserver(nodes, iam_url)
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("E2B_API_URL", api.url)
                mp.setenv("E2B_SANDBOX_URL", api.url)
                mp.delenv("E2B_API_KEY", raising=False)
                plane = Plane(api.url, iam, node, files, image)
                plane.nodes, plane.iam_url, plane.environment = nodes, iam_url, environment
                yield plane
        finally:
            api.stop()
            api.log.unlink(missing_ok=True)
    iam.close()


def _context(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.txt").write_text("from the context\n")
    (tmp_path / "hello.txt").write_text("hello file\n")
    return tmp_path


def test_steps_build_a_template_whose_sandboxes_see_files_env_and_workdir(plane, tmp_path):
    ctx = _context(tmp_path)
    template = (
        Template(file_context_path=ctx)
        .from_image(IMAGE)
        .copy("hello.txt", "/data/")
        .copy("app", "/srv/app")
        .set_envs({"GREETING": "hi there"})
        .set_workdir("/srv/app")
        .run_cmd("cat main.txt > made.txt && echo $GREETING >> made.txt")
    )
    logs: list[str] = []
    placed, t0 = plane.placed(), time.monotonic()
    info = Template.build(
        template, "tpl-steps", api_key=plane.builder, on_build_logs=lambda e: logs.append(e.message)
    )
    first = time.monotonic() - t0
    assert plane.placed() == placed + 1  # one build sandbox
    assert any("RUN cat main.txt" in m for m in logs)
    assert Template.alias_exists("tpl-steps", api_key=plane.member)
    assert not Template.alias_exists("tpl-none", api_key=plane.member)

    sb = Sandbox.create("tpl-steps", api_key=plane.member)  # a member key may use it
    try:
        assert sb.files.read("/data/hello.txt") == "hello file\n"
        assert sb.files.read("/srv/app/made.txt") == "from the context\nhi there\n"
        r = sb.commands.run("echo $GREETING; pwd; id -un")
        out = r.stdout.splitlines()
        assert out[:2] == ["hi there", "/srv/app"]
    finally:
        sb.kill()

    # an unchanged rebuild is a cache hit: fast, and no build sandbox runs
    before = plane.placed()
    t0 = time.monotonic()
    again = Template.build(template, "tpl-steps", api_key=plane.builder)
    took = time.monotonic() - t0
    assert again.template_id == info.template_id and again.build_id != info.build_id
    assert plane.placed() == before
    assert took < 3.0, f"a cache hit took {took:.1f} s"
    print(f"first build {first:.2f} s, cache hit {took:.2f} s")


def test_a_dockerfile_builds_and_appends_the_e2b_user(plane, tmp_path):
    ctx = _context(tmp_path)
    dockerfile = f"""FROM {IMAGE}
ENV MODE=docker
WORKDIR /work
COPY hello.txt ./
RUN echo built-$MODE | tee /work/built.txt
"""
    logs: list[str] = []
    Template.build(
        Template(file_context_path=ctx).from_dockerfile(dockerfile),
        "tpl-docker",
        api_key=plane.builder,
        on_build_logs=lambda e: logs.append(e.message),
    )
    assert "built-docker" in logs  # a RUN's output, streamed to on_build_logs
    sb = Sandbox.create("tpl-docker", api_key=plane.member)
    try:
        assert sb.files.read("/work/built.txt") == "built-docker\n"
        assert sb.files.read("/work/hello.txt") == "hello file\n"
        r = sb.commands.run("echo $MODE; grep ^user: /etc/passwd | cut -d: -f6; pwd")
        # the SDK ends a Dockerfile with USER user: the account was made as E2B's base has it
        assert r.stdout.splitlines() == ["docker", "/home/user", "/work"]
    finally:
        sb.kill()


def test_from_an_image_in_the_nodes_docker(plane):
    """FROM an image no table names: the node makes its docker image into a base layer, and
    the image's ENV holds in the template's sandboxes."""
    if plane.docker_image is None:
        pytest.skip("no private dockerd could run here")
    template = Template().from_image(plane.docker_image).run_cmd("echo $FROM_IMAGE > /from.txt")
    Template.build(template, "tpl-docker-image", api_key=plane.builder)
    sb = Sandbox.create("tpl-docker-image", api_key=plane.member)
    try:
        assert sb.files.read("/from.txt") == "docker\n"
        assert sb.commands.run("echo $FROM_IMAGE").stdout == "docker\n"
    finally:
        sb.kill()


def test_a_failing_run_fails_the_build_with_its_output(plane):
    template = Template().from_image(IMAGE).run_cmd("echo about-to-fail; exit 3")
    with pytest.raises(BuildException) as e:
        Template.build(template, "tpl-fails", api_key=plane.builder)
    assert "about-to-fail" in str(e.value) and "exit code 3" in str(e.value)


def test_a_long_log_keeps_its_tail_within_the_records_bounds(plane):
    """A step printing more lines than a build record keeps: the oldest are dropped (the
    record stays small enough for etcd), offsets stay the whole log's, the tail arrives."""
    template = Template().from_image(IMAGE).run_cmd("seq 1 3000")
    seen: list[str] = []
    Template.build(
        template,
        "tpl-long-log",
        api_key=plane.builder,
        on_build_logs=lambda e: seen.append(e.message),
    )
    assert "3000" in seen and "build ready" in seen


def test_an_unknown_image_is_a_build_error_naming_it(plane):
    template = Template().from_image("no-such-registry.example/nothing:0").run_cmd("true")
    with pytest.raises(BuildException) as e:
        Template.build(template, "tpl-noimage", api_key=plane.builder)
    assert "no-such-registry.example/nothing:0" in str(e.value)


def test_a_member_key_may_not_build(plane):
    template = Template().from_image(IMAGE).run_cmd("true")
    with pytest.raises(Exception) as e:
        Template.build(template, "tpl-member", api_key=plane.member)
    assert "403" in str(e.value) or "member key cannot" in str(e.value)
    assert not Template.alias_exists("tpl-member", api_key=plane.builder)


def test_another_apiserver_on_the_same_iam_store_sees_the_templates(plane):
    template = Template().from_image(IMAGE).run_cmd("echo shared > /shared.txt")
    Template.build(template, "tpl-shared", api_key=plane.builder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSEC_E2B_FILES", str(plane.files))
        other = start_apiserver(plane.nodes, plane.iam_url)
    try:
        assert Template.alias_exists("tpl-shared", api_key=plane.member, api_url=other.url)
        sb = Sandbox.create(
            "tpl-shared", api_key=plane.member, api_url=other.url, sandbox_url=other.url
        )
        try:
            assert sb.files.read("/shared.txt") == "shared\n"
        finally:
            sb.kill()
    finally:
        other.stop()
        other.log.unlink(missing_ok=True)


def test_the_build_network_is_the_operators_setting(plane):
    """By default a build has no network (no interface but loopback); with
    ``DSEC_E2B_BUILD_NETWORK=internet`` its sandbox has the node's NAT network."""
    closed = Template().from_image(IMAGE).run_cmd("test ! -e /sys/class/net/eth0")
    Template.build(closed, "tpl-net-none", api_key=plane.builder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSEC_E2B_FILES", str(plane.files))
        mp.setenv("DSEC_E2B_BUILD_NETWORK", "internet")
        mp.setenv("DSEC_E2B_IMAGES", f"{IMAGE}={plane.environment}")
        other = start_apiserver(plane.nodes, plane.iam_url)
    try:
        open_ = Template().from_image(IMAGE).run_cmd("cat /sys/class/net/eth0/operstate")
        seen: list[str] = []
        Template.build(
            open_,
            "tpl-net-internet",
            api_key=plane.builder,
            api_url=other.url,
            on_build_logs=lambda e: seen.append(e.message),
        )
        assert "up" in seen
    finally:
        other.stop()
        other.log.unlink(missing_ok=True)


def test_list_and_delete(plane):
    template = Template().from_image(IMAGE).run_cmd("echo listed > /listed.txt")
    info = Template.build(template, "tpl-listed", api_key=plane.builder)
    api = get_api_client(ConnectionConfig(api_key=plane.builder))
    listed = get_templates.sync(client=api)
    assert isinstance(listed, list)
    assert [t.template_id for t in get_v2_templates.sync(client=api)] == [
        t.template_id for t in listed
    ]
    mine = [t for t in listed if t.template_id == info.template_id]
    assert mine and mine[0].aliases == ["tpl-listed"] and mine[0].build_status.value == "ready"
    # another project's key sees none of them, and cannot use or find one
    plane.iam.create_project("tpl-other")
    other = plane.iam.create_key("tpl-other", "builder")[1]
    assert get_templates.sync(client=get_api_client(ConnectionConfig(api_key=other))) == []
    assert not Template.alias_exists("tpl-listed", api_key=other)
    one = get_templates_template_id.sync(info.template_id, client=api)
    assert [str(b.build_id) for b in one.builds] == [info.build_id]
    sb = Sandbox.create(info.template_id, api_key=plane.member)  # by id, too
    try:
        assert sb.files.read("/listed.txt") == "listed\n"
    finally:
        sb.kill()
    r = delete_templates_template_id.sync_detailed(info.template_id, client=api)
    assert r.status_code == 204
    assert not Template.alias_exists("tpl-listed", api_key=plane.builder)
    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for an unknown template
        Sandbox.create("tpl-listed", api_key=plane.member)


def test_the_async_sdk_builds_from_a_template_with_start_and_ready_commands(plane):
    async def main() -> None:
        base = AsyncTemplate().from_image(IMAGE).run_cmd("echo base > /base.txt")
        await AsyncTemplate.build(base, "tpl-async-base", api_key=plane.builder)
        child = (
            AsyncTemplate()
            .from_template("tpl-async-base")
            .set_envs({"CHILD": "yes"})
            .run_cmd("cat /base.txt > /child.txt")
            .set_start_cmd("echo started > /tmp/started; sleep 600", wait_for_file("/tmp/started"))
        )
        seen: list[str] = []
        await AsyncTemplate.build(
            child,
            "tpl-async-child",
            api_key=plane.builder,
            on_build_logs=lambda e: seen.append(e.message),
        )
        assert any("FROM template tpl-async-base" in m for m in seen)
        sb = await AsyncSandbox.create("tpl-async-child", api_key=plane.member)
        try:
            assert await sb.files.read("/child.txt") == "base\n"
            assert await sb.files.read("/tmp/started") == "started\n"  # ready once it is there
            r = await sb.commands.run("echo $CHILD")
            assert r.stdout == "yes\n"
        finally:
            await sb.kill()

        # skip_cache forces a rebuild: a build sandbox runs again
        before = plane.placed()
        await AsyncTemplate.build(child, "tpl-async-child", api_key=plane.builder, skip_cache=True)
        assert plane.placed() == before + 1

    asyncio.run(main())


def test_tags_name_builds_as_harbor_uses_them(plane):
    """Harbor's e2b environment builds ``name:tag``, reads the tag's build id with
    ``get_tags`` and creates sandboxes of ``name:<build id>``."""
    template = Template().from_image(IMAGE).run_cmd("echo tagged > /tagged.txt")
    info = Template.build(
        template, "tpl-tagged:v1", cpu_count=1, memory_mb=300, api_key=plane.builder
    )
    tags = Template.get_tags("tpl-tagged", api_key=plane.member)
    assert [(t.tag, t.build_id) for t in tags] == [("v1", info.build_id)]
    for ref in ("tpl-tagged:v1", f"tpl-tagged:{info.build_id}", "tpl-tagged"):
        sb = Sandbox.create(ref, api_key=plane.member)
        try:
            assert sb.files.read("/tagged.txt") == "tagged\n"
            assert sb.get_info().memory_mb == 300  # the build's memory_mb
        finally:
            sb.kill()
    Template.assign_tags("tpl-tagged:v1", "stable", api_key=plane.builder)
    assert {t.tag for t in Template.get_tags("tpl-tagged", api_key=plane.builder)} == {
        "v1",
        "stable",
    }
    Template.remove_tags("tpl-tagged", "v1", api_key=plane.builder)
    with pytest.raises(SandboxException) as e:
        Sandbox.create("tpl-tagged:v1", api_key=plane.member)
    assert "does not exist" in str(e.value)
    with pytest.raises(SandboxException):  # a name never built: 404, as Harbor expects
        Template.get_tags("tpl-never", api_key=plane.builder)


# --- COPY's placement rules, without a sandbox -----------------------------------------------


def _members(*names: str) -> list[tarfile.TarInfo]:
    out = []
    for name in names:
        info = tarfile.TarInfo(name.rstrip("/"))
        info.type = tarfile.DIRTYPE if name.endswith("/") else tarfile.REGTYPE
        out.append(info)
    return out


def _placed(members, src, dest, workdir="/w", dest_is_dir=False):
    plan, targets = copy_plan(members, src, dest, workdir, dest_is_dir)
    return sorted(t for _, t in plan), targets


def test_copy_places_files_as_docker_does():
    tree = _members("app/", "app/a.txt", "app/sub/", "app/sub/b.txt", "top.txt", "x.py", "y.py")
    # a directory's contents go into dest
    assert _placed(tree, "app", "/srv") == (
        ["/srv/a.txt", "/srv/sub", "/srv/sub/b.txt"],
        ["/srv/a.txt", "/srv/sub"],
    )
    # a file goes to dest, or into it when dest ends with / or is a directory
    assert _placed(tree, "top.txt", "/etc/conf") == (["/etc/conf"], ["/etc/conf"])
    assert _placed(tree, "top.txt", "/etc/") == (["/etc/top.txt"], ["/etc/top.txt"])
    assert _placed(tree, "top.txt", "/etc", dest_is_dir=True)[0] == ["/etc/top.txt"]
    # a relative dest is under the workdir; several matches go into dest
    assert _placed(tree, "*.py", "lib")[0] == ["/w/lib/x.py", "/w/lib/y.py"]
    # "." is everything; nothing matched is the step's error; no member leaves the context
    assert "/o/app/sub/b.txt" in _placed(tree, ".", "/o")[0]
    with pytest.raises(BuildFailed, match="no uploaded file"):
        copy_plan(tree, "missing", "/x", "/", False)
    assert _placed(_members("../evil", "ok"), ".", "/d")[0] == ["/d/ok"]


def test_operator_settings_are_read_strictly():
    table = ImageTable.parse("python:3.11-slim=python, ubuntu:22.04=ubuntu@22.04")
    assert table.get("python:3.11-slim") == "python"
    assert table.get("ubuntu:22.04") == "ubuntu@22.04" and table.get("alpine") is None
    assert ImageTable.parse("busybox:latest=kit").get("busybox") == "kit"
    with pytest.raises(InvalidSpec, match="DSEC_E2B_IMAGES"):
        ImageTable.parse("python:3.11")
    assert BuildNetwork.parse(None).mode == "none" and BuildNetwork.parse("internet").mode == (
        "internet"
    )
    allow = BuildNetwork.parse("10.0.0.5:3128/tcp,pypi.internal:443/tcp")
    assert allow.mode == "allowlist"
    assert allow.policies == {"egress": {"allow": ["10.0.0.5:3128/tcp", "pypi.internal:443/tcp"]}}
    with pytest.raises(InvalidSpec, match="DSEC_E2B_BUILD_NETWORK"):
        BuildNetwork.parse("everything")


def test_nothing_is_left_behind(plane):
    client = plane.node.client()
    try:
        live = [i.id for i in client.list() if BUILD_LABEL in i.labels and i.state != "dead"]
    finally:
        client.close()
    assert live == []
    leftovers = [*plane.files.rglob(".upload-*"), *Path(tempfile.gettempdir()).glob("dsec-e2b-*")]
    assert leftovers == []
