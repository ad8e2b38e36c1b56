"""Stock Harbor runs a task on dsec: its ``oracle`` agent (the task's solution, no LLM) scores
1.0 and its ``nop`` agent 0.0, through dsec's native provider (``-e dsec_harbor:DsecEnvironment``)
and through Harbor's built-in ``-e e2b`` with only ``E2B_*`` variables pointing at a real
``dsec apiserver``. The task is ``harbor init``'s, its Dockerfile using RUN, COPY, WORKDIR
and ENV; Harbor runs from its own venv (Python >= 3.12) as a subprocess."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from dsec_harbor.build import (
    RECIPE_VERSION,
    Base,
    build_layer,
    find_layer,
    lookup_base,
    parse_images,
    resolve_base,
)
from dsec_harbor.dockerfile import Copy, Run, parse
from harbor_kit import DOCKERFILE, IMAGES, harbor_env, run_job

from dsec_core.errors import LayerBuildError, UnknownImage
from dsec_core.sdk import AsyncClient

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a dsec node needs root")
PROVIDER = "dsec_harbor:DsecEnvironment"


def test_the_dockerfile_is_read_into_the_steps_dsec_replays(tmp_path: Path):
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    recipe = parse(tmp_path / "Dockerfile")
    assert recipe.base == "python:3.11-slim-bookworm"
    assert recipe.workdir == "/app"
    assert recipe.env["GREETING"] == "hello from dsec" and recipe.env["APP_HOME"] == "/app"
    assert recipe.env["PATH"].startswith("/opt/tool:/usr/local/sbin:")
    kinds = [type(step).__name__ for step, *_ in recipe.steps]
    assert kinds == ["Copy", "Copy", "Run", "Run"]
    first, env, workdir, _ = recipe.steps[0]
    assert isinstance(first, Copy) and first.sources == ("words.txt",)
    assert first.dest == "/app/"  # `./` under WORKDIR /app
    assert workdir == "/app" and "PATH" not in env  # ENV PATH comes later
    last = recipe.steps[-1][0]
    assert isinstance(last, Run) and "wc -w" in str(last.command)
    images = parse_images(IMAGES + ",ubuntu=python@12,debian:12@sha256:ab=dev")
    assert lookup_base(recipe.base, images) == Base(environment="python")
    assert lookup_base("ubuntu:24.04", images) == Base(layers=("python@12",))  # tag dropped
    assert lookup_base("debian:12@sha256:ab", images) == Base(environment="dev")
    assert lookup_base("alpine", images) is None  # then the node's resolve_image


@needs_root
def test_oracle_scores_1_and_nop_0_through_the_native_provider(
    python_node, harbor_task: Path, tmp_path: Path
):
    env = harbor_env(
        DSEC_ADDRESS=f"unix://{python_node.config.socket_path}", DSEC_HARBOR_IMAGES=IMAGES
    )
    # two oracle attempts and a nop trial, concurrently: one build, three restores of it
    config = tmp_path / "job.yaml"
    config.write_text("agents:\n  - name: oracle\n  - name: nop\n")
    job = run_job(
        tmp_path, harbor_task, env, "-c", str(config), "-k", "2",
        "-e", PROVIDER,
    )  # fmt: skip
    assert job.of("oracle") == [1.0, 1.0], job.output[-4000:]
    assert job.of("nop") == [0.0, 0.0], job.output[-4000:]
    assert job.log.count(" packed harbor-") == 1, job.log[-4000:]  # one build, 3 waited for it
    assert job.log.count("(cache hit)") == 3, job.log[-4000:]
    assert "COPY data/ /app/data/: 22 files as one tar" in job.log, job.log[-4000:]
    assert "COPY words.txt /app/: 1 files" in job.log, job.log[-4000:]
    with python_node.client() as c:
        built = [i for i in c.layers() if i.name.startswith("harbor-")]
        assert [i.kind for i in built] == ["snapshot"], built  # built once, by content hash
        assert built[0].version == RECIPE_VERSION
        assert c.list() == []  # every trial's sandbox is gone
    # a second job, on the task as `harbor init` left its network (public): the unchanged
    # environment is a cache hit, and the sandbox reaches out through the node (NAT)
    public = tmp_path / "public" / harbor_task.name
    shutil.copytree(harbor_task, public)
    toml = public / "task.toml"
    toml.write_text(toml.read_text().replace('"no-network"', '"public"'))
    job2 = run_job(tmp_path / "public", public, env, "-a", "oracle", "-e", PROVIDER)
    assert job2.of("oracle") == [1.0], job2.output[-4000:]
    assert " packed harbor-" not in job2.log and "(cache hit)" in job2.log, job2.log[-4000:]
    assert "(network internet)" in job2.log, job2.log[-4000:]
    with python_node.client() as c:
        again = [i for i in c.layers() if i.name.startswith("harbor-")]
        assert [(i.ref, i.digest) for i in again] == [(i.ref, i.digest) for i in built]


@needs_root
@pytest.mark.asyncio
async def test_an_image_neither_mapped_nor_on_the_node_is_an_error_naming_it(python_node):
    async with AsyncClient(f"unix://{python_node.config.socket_path}", autostart=False) as c:
        with pytest.raises(UnknownImage) as e:
            await resolve_base(c, "nosuch/image:1.0", parse_images(IMAGES))
        assert "FROM nosuch/image:1.0" in str(e.value) and "DSEC_HARBOR_IMAGES" in str(e.value)
        assert e.value.context["name"] == "nosuch/image:1.0"
        mapped = await resolve_base(c, "python:3.11-slim-bookworm", parse_images(IMAGES))
        assert mapped == Base(environment="python")


@needs_root
@pytest.mark.asyncio
async def test_a_failing_run_step_fails_the_build_with_its_output_and_leaves_nothing(
    python_node, tmp_path: Path
):
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11-slim-bookworm\nRUN echo about to fail >&2 && exit 3\n"
    )
    recipe = parse(tmp_path / "Dockerfile")
    async with AsyncClient(f"unix://{python_node.config.socket_path}", autostart=False) as c:
        with pytest.raises(LayerBuildError) as e:
            await build_layer(
                c, recipe, tmp_path, name="harbor-fails", base=Base(environment="python"),
                timeout=60,
            )  # fmt: skip
        assert "exit 3" in str(e.value) and "about to fail" in str(e.value)
        assert await c.list() == []  # the build sandbox is gone
        assert await find_layer(c, "harbor-fails", RECIPE_VERSION) is None


@needs_root
@pytest.mark.asyncio
async def test_copy_follows_dockers_rules_and_the_layer_restores(python_node, tmp_path: Path):
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "b.txt").write_text("b\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11-slim-bookworm\n"
        "WORKDIR /srv\n"
        "COPY a.txt /srv\n"  # an existing directory: into it
        "COPY a.txt renamed.txt\n"  # a file path, relative to WORKDIR
        "COPY tree /opt/tree\n"  # a directory: its contents
        "RUN test -f /srv/a.txt && test -f /srv/renamed.txt && test -f /opt/tree/sub/b.txt\n"
    )
    recipe = parse(tmp_path / "Dockerfile")
    async with AsyncClient(f"unix://{python_node.config.socket_path}", autostart=False) as c:
        ref = await build_layer(
            c, recipe, tmp_path, name="harbor-copies", base=Base(environment="python"),
            timeout=60,
        )  # fmt: skip
        assert await find_layer(c, "harbor-copies", RECIPE_VERSION) == ref
        (sb,) = await c.restore(ref, 1, workdir=recipe.workdir)
        try:
            r = await sb.exec("cat a.txt renamed.txt /opt/tree/sub/b.txt")
            assert r.stdout == b"a\na\nb\n", r
        finally:
            await sb.kill()
        assert await c.list() == []


@needs_root
def test_the_native_provider_works_through_an_apiserver_with_a_member_key(
    plane, harbor_task: Path, tmp_path: Path
):
    env = harbor_env(
        DSEC_ADDRESS=plane.url, DSEC_API_KEY=plane.member_key, DSEC_HARBOR_IMAGES=IMAGES
    )
    job = run_job(tmp_path, harbor_task, env, "-a", "oracle", "-k", "2", "-e", PROVIDER)
    assert job.of("oracle") == [1.0, 1.0], job.output[-4000:]
    # built once, under the project's scope tag, and found again under it
    assert job.log.count(" packed ") == 1, job.log[-4000:]
    assert re.search(r"dsec: [a-z0-9]+-harbor-[0-9a-f]{32}@1 is built already", job.log), job.log


@needs_root
def test_oracle_scores_1_and_nop_0_through_harbors_e2b_environment(
    plane, harbor_task: Path, tmp_path: Path
):
    # Harbor builds its templates and creates its sandboxes with one key: a builder's
    env = harbor_env(
        E2B_API_URL=plane.url, E2B_SANDBOX_URL=plane.url, E2B_API_KEY=plane.builder_key
    )
    config = tmp_path / "job.yaml"
    config.write_text("agents:\n  - name: oracle\n  - name: nop\n")
    job = run_job(tmp_path, harbor_task, env, "-c", str(config), "-e", "e2b")
    assert job.of("oracle") == [1.0], job.output[-4000:]
    assert job.of("nop") == [0.0], job.output[-4000:]
