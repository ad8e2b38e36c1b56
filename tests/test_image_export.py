"""Layers to docker images and back (issue 13, deliverable 5): an exported archive is loaded and
run by the real docker (whiteouts of a pack_diff snapshot honoured), and docker images, `docker
save` archives and Dockerfile builds become base layers whose sandboxes run. Bad input gets a
typed error and leaves no scratch files, mounts, containers or images behind.

Docker's daemon is a private one started for this module (``test_layers.docker_host``, the
kit's ``dsec_dockerd``: own socket and data root, no networking, stopped at the end).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import stat
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_layers import docker_host  # noqa: F401 - the module's docker daemon

from dsec_core.catalog.model import Catalog, Environment
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.errors import (
    InvalidSpec,
    LayerBuildError,
    ToolError,
    UnknownEnvironment,
    UnknownImage,
    UnknownLayer,
)
from dsec_core.layers.image import export_image, import_dockerfile, import_image, layer_tar
from dsec_core.layers.store import LayerStore
from dsec_core.linux.mounts import MS_RDONLY, mount, mounted_under, unmount
from dsec_core.node.node import Node
from dsec_core.records import SandboxSpec
from dsec_core.testing import node_home

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

BASE = SandboxSpec(layers=("kit-base@1",), memory="128M", disk="64M", ttl=None)


def _docker(*args: str, check: bool = True) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {out.returncode}: {out.stderr}")
    return out.stdout


def _images() -> set[str]:
    return set(_docker("images", "-aq", "--no-trunc").split())


def _containers() -> set[str]:
    return set(_docker("ps", "-aq", "--no-trunc").split())


@pytest.fixture(scope="module")
def docker(docker_host: str) -> Iterator[str]:  # noqa: F811
    """DOCKER_HOST pointed at the module's daemon, for the docker CLI and python-on-whales."""
    old = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = docker_host
    try:
        yield docker_host
    finally:
        if old is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = old


@pytest.fixture
def loaded(docker: str) -> Iterator[list[str]]:
    """Tags a test loads into docker; all removed at teardown, after which docker holds exactly
    the images and containers it held before the test."""
    images, containers = _images(), _containers()
    tags: list[str] = []
    yield tags
    for tag in tags:
        _docker("rmi", "-f", tag, check=False)
    assert _containers() == containers
    assert _images() == images


def _tag(what: str) -> str:
    return f"dsec-test-{what}-{secrets.token_hex(4)}:1"


def _load(archive: Path, tags: list[str], tag: str) -> None:
    tags.append(tag)
    assert f"Loaded image: {tag}" in _docker("load", "-i", str(archive))


def _run(tag: str, script: str) -> str:
    return _docker("run", "--rm", "--network", "none", tag, "sh", "-c", script)


@contextlib.contextmanager
def _mounted(image: Path, target: Path) -> Iterator[Path]:
    target.mkdir()
    mount(os.fspath(image), target, "erofs", MS_RDONLY)
    try:
        yield target
    finally:
        unmount(target, lazy_fallback=False)


def _oci_layout(path: Path, entry: str | None) -> Path:
    """An OCI layout directory holding one image of one layer with a file named ``entry``
    (``None``: an index that names no image)."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')

    def blob(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    manifests = []
    if entry is not None:
        layer = io.BytesIO()
        with tarfile.open(fileobj=layer, mode="w") as tar:
            for name in ("./", "d"):  # some tools write the root as "./": it is skipped
                member = tarfile.TarInfo(name)
                member.type = tarfile.DIRTYPE
                tar.addfile(member)
            member = tarfile.TarInfo(entry)
            tar.addfile(member, io.BytesIO(b""))
        manifest = {
            "schemaVersion": 2,
            "config": blob(b"{}"),
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(layer.getvalue())}
            ],
        }
        manifests.append(blob(json.dumps(manifest).encode()))
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    return path


def _no_scratch(store: LayerStore) -> None:
    left = list(store.tmp_dir.iterdir()) if store.tmp_dir.is_dir() else []
    assert not [p for p in left if p.name.startswith(("export-", "import-"))], left
    assert mounted_under(store.root) == []


async def _sh(node: Node, sid: str, script: str) -> str:
    r = await node.exec(sid, ["sh", "-c", script], timeout=30)
    assert r.exit_code == 0, (script, r.stderr)
    return r.stdout.decode()


# --- layer tars (no docker) ------------------------------------------------------------------


def test_layer_tar_turns_overlay_markers_into_oci_whiteouts(tmp_path):
    root = tmp_path / "upper"
    (root / "d" / "opaque").mkdir(parents=True)
    (root / "d" / "opaque" / "new").write_text("new\n")
    os.setxattr(root / "d" / "opaque", "trusted.overlay.opaque", b"y")
    os.mknod(root / "d" / "gone", stat.S_IFCHR | 0o600, 0)  # overlay's whiteout
    (root / "f").write_text("hello\n")
    os.chown(root / "f", 1234, 2345)
    os.chmod(root / "f", 0o640)
    os.setxattr(root / "f", "user.color", b"blue")
    os.link(root / "f", root / "hl")
    os.symlink("f", root / "link")

    out = io.BytesIO()
    digest, size = layer_tar(root, out)
    data = out.getvalue()
    assert digest == "sha256:" + hashlib.sha256(data).hexdigest() and size == len(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert list(members) == [
            "d",
            "d/.wh.gone",
            "d/opaque",
            "d/opaque/.wh..wh..opq",
            "d/opaque/new",
            "f",
            "hl",
            "link",
        ]
        f = members["f"]
        assert (f.uid, f.gid, f.mode, f.uname) == (1234, 2345, 0o640, "")
        assert f.pax_headers["SCHILY.xattr.user.color"] == "blue"
        assert members["hl"].islnk() and members["hl"].linkname == "f"
        assert members["link"].issym() and members["link"].linkname == "f"
        assert members["d/.wh.gone"].isreg() and members["d/.wh.gone"].size == 0
        # overlay's own xattrs stay out: the .wh..wh..opq entry says it
        assert not any("overlay" in k for k in members["d/opaque"].pax_headers)
        assert tar.extractfile("f").read() == b"hello\n"  # type: ignore[union-attr]


# --- export ----------------------------------------------------------------------------------


def test_the_python_environment_runs_in_docker(built_catalog_config: NodeConfig, loaded, tmp_path):
    store = LayerStore(built_catalog_config.layer_dir)
    try:
        env = CatalogStore(built_catalog_config.catalog_dir).environment("python")
        refs = env.layer_refs()
        for ref in refs:
            store.image_path(store.resolve(ref))
    except (UnknownLayer, UnknownEnvironment) as e:
        pytest.skip(f"the default catalog is not built in {built_catalog_config.home}: {e}")
    tag = _tag("python")
    stages: list[str] = []
    archive = export_image(
        store,
        refs,
        tmp_path / "python.tar",
        tag=tag,
        env={**env.env, "DSEC_EXPORTED": "yes"},
        workdir="/srv/work",
        progress=lambda stage, fraction: stages.append(stage),
    )
    assert [s for s in dict.fromkeys(stages) if ": layer " in s] == [
        f"{ref}: layer {n}/{len(refs)}" for n, ref in enumerate(reversed(refs), 1)
    ]
    with tarfile.open(archive) as tar:  # docker's and OCI's layouts over the same blobs
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        config = json.loads(tar.extractfile(manifest[0]["Config"]).read())  # type: ignore[union-attr]
    assert {"index.json", "oci-layout", "manifest.json"} <= set(names)
    assert manifest[0]["RepoTags"] == [tag]
    assert len(config["rootfs"]["diff_ids"]) == len(refs) == len(manifest[0]["Layers"])
    assert config["config"]["Labels"]["org.dsec.layers"] == ",".join(refs)
    _no_scratch(store)

    _load(archive, loaded, tag)
    out = _docker(
        "run",
        "--rm",
        "--network",
        "none",
        tag,
        "python3",
        "-c",
        "import os, pytest; print(pytest.__file__); print(os.getcwd()); "
        "print(os.environ['DSEC_EXPORTED']); print(os.environ['PATH'])",
    )
    lines = out.splitlines()
    assert lines[0].endswith("pytest/__init__.py")
    assert lines[1:3] == ["/srv/work", "yes"]
    assert "/usr/bin" in lines[3].split(":")


async def test_a_snapshot_exports_with_its_deletions(loaded, tmp_path):
    with node_home("dsec-oci-") as config:
        node = Node(config)
        await node.open()
        try:
            sid = (await node.create(BASE)).id
            await _sh(
                node,
                sid,
                "set -e; rm /etc/group; rm -rf /var; mkdir /var; echo only > /var/only;"
                "mkdir /data; echo kept > /data/kept; ln /data/kept /data/hl",
            )
            snap = await node.pack_diff(sid, name="step", version="1")
        finally:
            await node.close(kill_all=True)
        store = LayerStore(config.layer_dir)
        tag = _tag("snapshot")
        archive = export_image(store, [snap.ref, *snap.parents], tmp_path / "s.tar", tag=tag)
        _no_scratch(store)

        # the same image as an OCI layout alone (no docker manifest.json), as a tar and as a
        # directory: import flattens it itself, whiteouts and hard links included
        layout = tmp_path / "layout"
        with tarfile.open(archive) as tar:
            tar.extractall(layout, filter="tar")
        (layout / "manifest.json").unlink()
        oci_tar = tmp_path / "oci.tar"
        with tarfile.open(oci_tar, "w") as tar:
            for name in sorted(os.listdir(layout)):
                tar.add(layout / name, arcname=name)
        for n, source in enumerate((oci_tar, layout)):
            info = import_image(store, source, name="from-oci", version=str(n))
            assert info.source == f"oci-layout:{source}"
            with _mounted(store.image_path(info), tmp_path / f"mnt{n}") as root:
                assert not (root / "etc/group").exists() and (root / "etc/passwd").is_file()
                assert os.listdir(root / "var") == ["only"]
                assert (root / "data/kept").read_text() == "kept\n"
                assert (root / "data/hl").stat().st_nlink == 2
                assert (root / "bin/busybox").stat().st_mode & 0o111
        _no_scratch(store)
    _load(archive, loaded, tag)
    out = _run(
        tag,
        "test ! -e /etc/group && echo no-group; test -e /etc/passwd && echo passwd;"
        "ls -A /var; cat /data/kept; stat -c %h /data/hl",
    )
    # /etc/group deleted (whiteout), /var replaced (opaque: the base's /var/tmp is hidden)
    assert out.split() == ["no-group", "passwd", "only", "kept", "2"]


def test_export_bad_input_is_typed_and_leaves_nothing(tmp_path):
    with node_home("dsec-oci-") as config:
        store = LayerStore(config.layer_dir)
        out = tmp_path / "x.tar"
        with pytest.raises(UnknownLayer):
            export_image(store, ["kit-base@1", "nope@1"], out, tag="x:1")
        with pytest.raises(InvalidSpec):
            export_image(store, ["kit-base@1"], out, tag="Not A Tag")
        with pytest.raises(InvalidSpec):
            export_image(store, [], out, tag="x:1")
        with pytest.raises(InvalidSpec):  # a directory that does not exist
            export_image(store, ["kit-base@1"], tmp_path / "no" / "x.tar", tag="x:1")
        with pytest.raises(InvalidSpec, match="it is a directory"):
            export_image(store, ["kit-base@1"], tmp_path, tag="x:1")

        def interrupted(stage: str, fraction: float | None) -> None:
            if stage.endswith("layer 2/2") and fraction:
                raise KeyboardInterrupt  # half-way through the second layer

        base = store.resolve("kit-base@1")
        with pytest.raises(KeyboardInterrupt):
            export_image(store, [base.ref, base.ref], out, tag="x:1", progress=interrupted)
        assert list(tmp_path.iterdir()) == []
        _no_scratch(store)


# --- import ----------------------------------------------------------------------------------


async def _sandbox_output(config: NodeConfig, ref: str, script: str) -> str:
    node = Node(config)
    await node.open()
    try:
        sid = (await node.create(SandboxSpec(layers=(ref,), memory="128M", ttl=None))).id
        return await _sh(node, sid, script)
    finally:
        await node.close(kill_all=True)


async def test_export_import_round_trip_and_dockerfile(loaded, tmp_path):
    with node_home("dsec-oci-") as config:
        store = LayerStore(config.layer_dir)
        tag = _tag("busybox")
        archive = export_image(store, ["kit-base@1"], tmp_path / "busybox.tar", tag=tag)
        again = export_image(store, ["kit-base@1"], tmp_path / "again.tar", tag=tag)
        assert again.read_bytes() == archive.read_bytes()  # same layers, same bytes, same id

        # a `docker save` archive: loaded, flattened, and removed from docker again
        before = _images()
        back = import_image(store, archive, name="roundtrip", version="1")
        assert _images() == before
        assert back.kind == "base" and back.source.startswith("docker-archive:")
        out = await _sandbox_output(config, back.ref, "echo ran; cat /etc/passwd | head -n1")
        assert out.splitlines() == ["ran", "root:x:0:0:root:/root:/bin/sh"]

        # an image in the local docker, by name
        _load(archive, loaded, tag)
        by_name = import_image(store, tag, name="byname", version="1")
        assert by_name.source == f"docker:{tag}"

        # a Dockerfile FROM it
        context = tmp_path / "ctx"
        context.mkdir()
        (context / "hello.txt").write_text("hello from the context\n")
        (context / "Dockerfile").write_text(
            f"FROM {tag}\nRUN echo built > /built.txt\nCOPY hello.txt /opt/hello.txt\n"
        )
        built = import_dockerfile(store, context, name="fromdockerfile", version="1")
        assert built.kind == "base" and built.source.startswith("dockerfile:")
        out = await _sandbox_output(config, built.ref, "cat /opt/hello.txt /built.txt")
        assert out.splitlines() == ["hello from the context", "built"]
        _no_scratch(store)


def test_import_bad_input_is_typed_and_leaves_nothing(loaded, tmp_path):
    with node_home("dsec-oci-") as config:
        store = LayerStore(config.layer_dir)
        before = {i.ref for i in store.list()}
        with pytest.raises(UnknownImage) as e:
            import_image(store, "dsec-test-no-such-image:1", name="x", version="1")
        assert "dsec-test-no-such-image:1" in str(e.value)

        junk = tmp_path / "junk.tar"
        junk.write_bytes(b"not a tar at all" * 100)
        with pytest.raises(LayerBuildError):
            import_image(store, junk, name="x", version="1")
        with pytest.raises(LayerBuildError, match="does not exist"):
            import_image(store, str(tmp_path / "missing.tar"), name="x", version="1")
        # OCI layouts: an index naming nothing, and layers whose entries would leave the root
        with pytest.raises(LayerBuildError, match="not a readable OCI image layout"):
            import_image(store, _oci_layout(tmp_path / "empty-index", None), name="x", version="1")
        for bad in ("../escaped", "d/../../escaped", "/abs", ".wh...", "d/.wh..."):
            layout = _oci_layout(tmp_path / f"bad{secrets.token_hex(4)}", bad)
            with pytest.raises(LayerBuildError, match="leaves the image root"):
                import_image(store, layout, name="x", version="1")
        assert not (tmp_path / "escaped").exists() and (tmp_path / "junk.tar").exists()

        with pytest.raises(LayerBuildError):
            import_dockerfile(store, tmp_path / "nowhere", name="x", version="1")
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(LayerBuildError):
            import_dockerfile(store, empty, name="x", version="1")

        # a build that fails half-way: the first step's image and the failed step's container
        # must not stay behind (the fixture compares docker's images and containers)
        tag = _tag("base")
        archive = export_image(store, ["kit-base@1"], tmp_path / "b.tar", tag=tag)
        _load(archive, loaded, tag)
        failing = tmp_path / "failing"
        failing.mkdir()
        (failing / "Dockerfile").write_text(
            f"FROM {tag}\nRUN echo one > /one\nRUN echo two > /two && exit 3\n"
        )
        with pytest.raises(ToolError) as err:
            import_dockerfile(store, failing, name="x", version="1")
        assert err.value.exit_code not in (None, 0) and "returned a non-zero code" in str(err.value)
        assert "Step 3/3 : RUN echo two" in str(err.value)  # what failed, from the build output

        with pytest.raises(InvalidSpec):
            import_image(store, tag, name="x", version="1", kind="nonsense")
        assert {i.ref for i in store.list()} == before
        _no_scratch(store)


# --- CLI -------------------------------------------------------------------------------------


def _dsec(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DSEC_HOME=os.fspath(home))
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and out.returncode != 0:
        raise AssertionError(f"dsec {' '.join(args)} exited {out.returncode}:\n{out.stderr}")
    return out


def test_cli_export_and_import(loaded, tmp_path):
    with node_home("dsec-oci-") as config:
        archive = tmp_path / "kit.tar"
        tag = _tag("cli")
        out = _dsec(config.home, "layer", "export", "kit-base@1", "-o", str(archive), "--tag", tag)
        assert str(archive) in out.stdout and tag in out.stdout
        _load(archive, loaded, tag)
        assert _run(tag, "echo hi").strip() == "hi"

        # an environment: its layers, env and workdir
        CatalogStore(config.catalog_dir).save(
            Catalog(
                name="kit",
                environments=(
                    Environment(name="kitenv", base="kit-base@1", env={"X": "1"}, workdir="/root"),
                ),
            )
        )
        env_tag = _tag("cli-env")
        _dsec(config.home, "layer", "export", "kitenv", "-o", str(archive), "--tag", env_tag)
        _load(archive, loaded, env_tag)
        assert _run(env_tag, "echo $X; pwd").split() == ["1", "/root"]
        missing = _dsec(
            config.home, "layer", "export", "nothing", "-o", str(archive), "--tag", "x", check=False
        )
        assert missing.returncode == 1 and "unknown environment 'nothing'" in missing.stderr

        out = _dsec(config.home, "layer", "import", "--archive", str(archive), "--name", "cli")
        assert out.stdout.startswith("cli@") and " base " in out.stdout

        bad = _dsec(config.home, "layer", "import", "dsec-test-nope:1", "--name", "n", check=False)
        assert bad.returncode == 1 and bad.stderr.startswith("Error: docker has no image")
        assert "Traceback" not in bad.stderr
        both = _dsec(
            config.home, "layer", "import", tag, "--archive", str(archive), "--name", "n",
            check=False,
        )  # fmt: skip
        assert both.returncode == 2 and "exactly one of" in both.stderr
        with contextlib.suppress(FileNotFoundError):
            archive.unlink()


# --- FROM an image: the node resolves it into a base layer ------------------------------------


async def test_a_from_image_resolves_from_the_nodes_docker_once(loaded, tmp_path):
    """``Node.resolve_image``: an image in the node's docker becomes a content-addressed base
    layer with the image's env and workdir; asking again is a cache hit; a sandbox of it runs;
    an image nowhere is ``UnknownImage`` naming it; nothing is left in docker or the store."""
    with node_home("dsec-oci-") as config:
        store = LayerStore(config.layer_dir)
        tag = _tag("fromimage")
        archive = export_image(
            store,
            ["kit-base@1"],
            tmp_path / "img.tar",
            tag=tag,
            env=["GREETING=hi"],
            workdir="/tmp",
        )
        _load(archive, loaded, tag)
        node = Node(config)
        await node.open()
        try:
            first = await node.resolve_image(tag)
            assert not first.cached and first.source == "docker"
            assert first.layer.startswith("image-dsec-test-fromimage-")
            assert "GREETING=hi" in first.env and first.workdir == "/tmp"
            again = await node.resolve_image(tag)
            assert again.cached and again.layer == first.layer
            assert store.resolve(first.layer).kind == "base"
            sid = (await node.create(SandboxSpec(layers=(first.layer,), memory="128M"))).id
            assert await _sh(node, sid, "echo ran") == "ran\n"

            missing = f"no-such-image-{secrets.token_hex(3)}:3.11-slim"
            with pytest.raises(UnknownImage, match=missing) as e:
                await node.resolve_image(missing)
            assert "the node's docker" in str(e.value)
            with pytest.raises(InvalidSpec, match="not a docker image reference"):
                await node.resolve_image("$BASE_IMAGE")
        finally:
            await node.close(kill_all=True)
        _no_scratch(store)
