"""Layer store and layer builds: real mkfs.erofs images, mounted back to check what is inside."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from dsec_core.errors import InvalidSpec, LayerBuildError, LayerExists, ToolError, UnknownLayer
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.mounts import MS_RDONLY, mount, mounted_under, unmount
from dsec_core.records import LayerRef

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mkfs.erofs"), reason="needs root and mkfs.erofs"
)


def _mounts_below(prefix: Path) -> list[str]:
    return [str(p) for p in mounted_under(prefix)]


@pytest.fixture
def store(home) -> LayerStore:
    return LayerStore(home / "layers")


@pytest.fixture
def mount_image(tmp_path):
    """mount(2) an EROFS image file read-only (no loop device); all unmounted at teardown."""
    mounted: list[Path] = []

    def mount_it(image: Path) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        mount(str(image), target, "erofs", MS_RDONLY)
        mounted.append(target)
        return target

    yield mount_it
    for target in reversed(mounted):
        unmount(target, lazy_fallback=False)
    assert _mounts_below(tmp_path) == []


def make_tree(root: Path, text: str = "hello\n") -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "sub/file.txt").write_text(text)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "link").symlink_to("sub/file.txt")
    os.chown(root / "sub/file.txt", 1234, 1234)
    for path in (root / "sub/file.txt", root / "run.sh", root / "sub", root):
        os.utime(path, (1_600_000_000, 1_600_000_000), follow_symlinks=False)
    return root


def tar_bytes(members: list[tuple[tarfile.TarInfo, bytes | None]], gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = None, **attrs):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mtime = 1_600_000_000
    info.mode = attrs.pop("mode", 0o644)
    if data is not None:
        info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def store_is_empty(store: LayerStore) -> bool:
    blobs = list(store.blob_dir.glob("*")) if store.blob_dir.exists() else []
    refs = list(store.ref_dir.rglob("*.json")) if store.ref_dir.exists() else []
    scratch = list(store.tmp_dir.iterdir()) if store.tmp_dir.exists() else []
    return not blobs and not refs and not scratch


# --- building ------------------------------------------------------------------------------


def test_build_from_directory_is_mountable_and_owned_by_root(tmp_path, store, mount_image):
    src = make_tree(tmp_path / "src")
    info = build_layer(src, name="ws", version="1", kind="workspace", store=store)
    assert info.ref == "ws@1" and info.kind == "workspace" and info.digest.startswith("sha256:")
    image = store.image_path(info)
    assert image.stat().st_size == info.size and not image.stat().st_mode & 0o222
    root = mount_image(image)
    assert (root / "sub/file.txt").read_text() == "hello\n"
    assert os.readlink(root / "link") == "sub/file.txt"
    assert os.access(root / "run.sh", os.X_OK)
    st = (root / "sub/file.txt").stat()
    assert (st.st_uid, st.st_gid) == (0, 0)  # directories default to --all-root
    assert st.st_mtime == 1_600_000_000  # per-file mtimes survive (pyc files check them)
    assert store.list() == [info]
    assert list(store.tmp_dir.iterdir()) == []


def test_build_from_tar_gz_keeps_owners_modes_and_devices(tmp_path, store, mount_image):
    archive = tmp_path / "rootfs.tar.gz"
    archive.write_bytes(
        tar_bytes(
            [
                member("bin", tarfile.DIRTYPE, mode=0o755),
                member("bin/tool", data=b"#!/bin/sh\n", mode=0o4755, uid=1000, gid=1001),
                member(
                    "bin/tool2",
                    tarfile.LNKTYPE,
                    linkname="bin/tool",
                    mode=0o4755,
                    uid=1000,
                    gid=1001,
                ),
                member("etc", tarfile.DIRTYPE, mode=0o755),
                member("etc/abs", tarfile.SYMTYPE, linkname="/usr/share/zoneinfo/UTC", mode=0o777),
                member("dev", tarfile.DIRTYPE, mode=0o755),
                member("dev/null", tarfile.CHRTYPE, mode=0o666, devmajor=1, devminor=3),
            ]
        )
    )
    info = build_layer(archive, name="rootfs", version="1", kind="base", store=store)
    root = mount_image(store.image_path(info))
    st = (root / "bin/tool").stat()
    assert (st.st_uid, st.st_gid) == (1000, 1001)
    assert stat.S_IMODE(st.st_mode) == 0o4755
    assert (root / "bin/tool2").stat().st_ino == st.st_ino  # hard link kept
    assert os.readlink(root / "etc/abs") == "/usr/share/zoneinfo/UTC"
    dev = (root / "dev/null").lstat()
    assert stat.S_ISCHR(dev.st_mode) and os.major(dev.st_rdev) == 1 and os.minor(dev.st_rdev) == 3
    assert stat.S_IMODE(root.stat().st_mode) == 0o755  # no "." member: root dir is 0755


def test_same_input_gives_same_digest_and_one_blob(tmp_path, store):
    src = make_tree(tmp_path / "src")
    a = build_layer(src, name="ws", version="1", kind="workspace", store=store)
    time.sleep(1.1)  # a build-time stamp in the image would change the digest now
    b = build_layer(src, name="ws-copy", version="1", kind="workspace", store=store)
    assert a.digest == b.digest
    assert len(list(store.blob_dir.iterdir())) == 1
    assert store.by_digest(a.digest).ref == "ws-copy@1"  # newest of the refs sharing it


def test_default_version_is_digest_prefix(tmp_path, store):
    info = build_layer(make_tree(tmp_path / "src"), name="ws", kind="workspace", store=store)
    assert info.version == info.digest.removeprefix("sha256:")[:12]
    assert store.resolve(f"ws@{info.version}") == info


def test_versions_live_side_by_side_and_unversioned_means_newest(tmp_path, store):
    v1 = build_layer(
        make_tree(tmp_path / "a", "one\n"), name="ws", version="1", kind="workspace", store=store
    )
    v2 = build_layer(
        make_tree(tmp_path / "b", "two\n"), name="ws", version="2", kind="workspace", store=store
    )
    assert v1.digest != v2.digest
    assert store.resolve("ws@1") == v1
    assert store.resolve("ws") == v2
    assert store.resolve(LayerRef("ws")) == v2
    assert [i.ref for i in store.list()] == ["ws@1", "ws@2"]


def test_same_ref_same_content_is_a_no_op_and_other_content_raises(tmp_path, store):
    first = build_layer(
        make_tree(tmp_path / "a", "one\n"), name="ws", version="1", kind="workspace", store=store
    )
    again = build_layer(tmp_path / "a", name="ws", version="1", kind="workspace", store=store)
    assert again == first
    with pytest.raises(LayerExists, match="ws@1 already exists"):
        build_layer(
            make_tree(tmp_path / "b", "two\n"),
            name="ws",
            version="1",
            kind="workspace",
            store=store,
        )
    assert store.resolve("ws@1") == first
    assert len(list(store.blob_dir.iterdir())) == 1
    assert list(store.tmp_dir.iterdir()) == []


def test_unknown_layer_names_the_known_refs(tmp_path, store):
    for version in ("1", "2"):
        build_layer(
            make_tree(tmp_path / version, version),
            name="ws",
            version=version,
            kind="workspace",
            store=store,
        )
    build_layer(make_tree(tmp_path / "t"), name="tools", version="7", kind="toolkit", store=store)
    with pytest.raises(UnknownLayer) as e:
        store.resolve("ws@3")
    assert "ws@3" in str(e.value) and "ws@1" in str(e.value) and "ws@2" in str(e.value)
    assert "tools@7" not in str(e.value)
    with pytest.raises(UnknownLayer) as e:
        store.resolve("nothere")
    assert all(ref in str(e.value) for ref in ("ws@1", "ws@2", "tools@7"))
    assert e.value.known == ["tools@7", "ws@1", "ws@2"]
    with pytest.raises(UnknownLayer, match="none known"):
        LayerStore(tmp_path / "empty").resolve("x@1")


def test_remove_drops_the_blob_with_its_last_ref(tmp_path, store):
    src = make_tree(tmp_path / "src")
    a = build_layer(src, name="a", version="1", kind="workspace", store=store)
    b = build_layer(src, name="b", version="1", kind="workspace", store=store)
    image = store.image_path(a)
    assert store.remove("a@1") == a
    assert image.exists() and store.resolve("b@1") == b  # still used by b@1
    with pytest.raises(UnknownLayer):
        store.resolve("a@1")
    store.remove("b")  # unversioned is fine when there is only one version
    assert not image.exists()
    assert store_is_empty(store) and not (store.ref_dir / "b").exists()
    with pytest.raises(UnknownLayer):
        store.remove("b@1")


def test_remove_unversioned_refuses_when_ambiguous(tmp_path, store):
    for version in ("1", "2"):
        build_layer(
            make_tree(tmp_path / version, version),
            name="ws",
            version=version,
            kind="workspace",
            store=store,
        )
    with pytest.raises(InvalidSpec, match="ws@1, ws@2"):
        store.remove("ws")
    assert len(store.list()) == 2


def test_by_digest(tmp_path, store):
    info = build_layer(
        make_tree(tmp_path / "src"), name="ws", version="1", kind="workspace", store=store
    )
    assert store.by_digest(info.digest) == info
    assert store.by_digest(info.digest.removeprefix("sha256:")) == info
    with pytest.raises(UnknownLayer):
        store.by_digest("sha256:" + "0" * 64)
    with pytest.raises(InvalidSpec):
        store.by_digest("md5:abc")


def test_kinds_and_names_are_validated(tmp_path, store):
    src = make_tree(tmp_path / "src")
    with pytest.raises(InvalidSpec, match="base, workspace, toolkit"):
        build_layer(src, name="ws", version="1", kind="bogus", store=store)
    with pytest.raises(InvalidSpec):
        build_layer(src, name="../ws", version="1", kind="workspace", store=store)
    image = tmp_path / "x.erofs"
    image.write_bytes(b"x")
    with pytest.raises(InvalidSpec):
        store.add(image, name="ws", version="1", kind="bogus")
    assert store_is_empty(store)


def test_missing_or_unsupported_sources(tmp_path, store):
    with pytest.raises(LayerBuildError, match="does not exist"):
        build_layer(tmp_path / "nope", name="x", kind="base", store=store)
    (tmp_path / "file.zip").write_bytes(b"PK")
    with pytest.raises(LayerBuildError, match="neither a directory"):
        build_layer(tmp_path / "file.zip", name="x", kind="base", store=store)


def test_store_record_is_plain_json(tmp_path, store):
    info = build_layer(
        make_tree(tmp_path / "src"), name="ws", version="1", kind="workspace", store=store
    )
    data = json.loads((store.ref_dir / "ws" / "1.json").read_text())
    assert data["digest"] == info.digest and data["kind"] == "workspace"
    assert data["source"] == str(tmp_path / "src")


# --- tar safety ----------------------------------------------------------------------------

ESCAPES = {
    "dotdot": [member("../evil", data=b"x")],
    "nested-dotdot": [member("a/../../evil", data=b"x")],
    "absolute": [member("{outside}/evil", data=b"x")],
    "through-symlink": [
        member("link", tarfile.SYMTYPE, linkname="{outside}"),
        member("link/evil", data=b"x"),
    ],
    "hardlink-out": [member("hl", tarfile.LNKTYPE, linkname="../../victim")],
    "device-outside-dev": [member("etc/sda", tarfile.BLKTYPE, devmajor=8, devminor=0)],
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_unsafe_tar_is_rejected_and_nothing_escapes(case, tmp_path, store, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "systmp"))
    (tmp_path / "systmp").mkdir()
    fixed = []  # fill in the {outside} placeholders of names and link targets
    for info, data in ESCAPES[case]:
        clone = tarfile.TarInfo(info.name.format(outside=outside))
        for attr in ("type", "mode", "mtime", "size", "devmajor", "devminor", "uid", "gid"):
            setattr(clone, attr, getattr(info, attr))
        clone.linkname = info.linkname.format(outside=outside)
        fixed.append((clone, data))
    archive = tmp_path / "bad.tar"
    archive.write_bytes(tar_bytes(fixed, gz=False))
    with pytest.raises(LayerBuildError):
        build_layer(archive, name="bad", version="1", kind="base", store=store)
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "evil").exists() and not (store.root / "evil").exists()
    assert not (store.tmp_dir / "evil").exists()
    assert store_is_empty(store)
    assert list((tmp_path / "systmp").iterdir()) == []


def test_corrupt_archive_is_a_build_error(tmp_path, store):
    archive = tmp_path / "broken.tar.gz"
    archive.write_bytes(tar_bytes([member("a", data=b"x" * 10000)])[:60])
    with pytest.raises(LayerBuildError, match="cannot unpack"):
        build_layer(archive, name="bad", version="1", kind="base", store=store)
    assert store_is_empty(store)


def test_failed_mkfs_raises_tool_error_and_leaves_no_files(tmp_path, store, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mkfs.erofs").write_text(
        "#!/bin/sh\n"
        "for last; do :; done\n"
        "eval out=\\${$(($#-1))}\n"
        'echo partial > "$out"\n'
        "echo 'mkfs.erofs: disk on fire' >&2\nexit 3\n"
    )
    (fake / "mkfs.erofs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "systmp"))
    (tmp_path / "systmp").mkdir()
    archive = tmp_path / "ok.tar.gz"
    archive.write_bytes(tar_bytes([member("a", data=b"x")]))
    for source in (make_tree(tmp_path / "src"), archive):
        with pytest.raises(ToolError) as e:
            build_layer(source, name="ws", version="1", kind="workspace", store=store)
        assert e.value.exit_code == 3 and "disk on fire" in e.value.stderr
        assert e.value.command[0] == "mkfs.erofs" and "disk on fire" in str(e.value)
        assert store_is_empty(store)
    assert list((tmp_path / "systmp").iterdir()) == []


# --- readers while a writer works ----------------------------------------------------------


def test_readers_never_see_partial_refs(tmp_path, store):
    sources = [make_tree(tmp_path / f"s{i}", f"content {i}\n") for i in range(6)]
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            for info in store.list():
                try:
                    assert store.resolve(info.ref).digest == info.digest
                    assert store.image_path(info).stat().st_size == info.size
                except UnknownLayer:
                    pass  # removed since we listed it: fine, that is not a torn read
                except BaseException as e:  # reported below
                    errors.append(e)
                    return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i, src in enumerate(sources):
            build_layer(src, name="ws", version=str(i), kind="workspace", store=store)
        for i in range(0, 6, 2):
            store.remove(f"ws@{i}")
    finally:
        done.set()
        reader.join()
    assert errors == []
    assert [i.version for i in store.list()] == ["1", "3", "5"]


# --- the local layer source plugin ---------------------------------------------------------


def test_local_layer_source_plugin(tmp_path, store, home):
    from dsec_core.plugins import registry, reset

    reset()
    try:
        cls = registry().layer_source("local")
    finally:
        reset()
    info = build_layer(
        make_tree(tmp_path / "src"), name="ws", version="1", kind="workspace", store=store
    )
    source = cls(str(store.root))
    assert source.resolve(LayerRef.parse("ws@1")) == info
    assert source.resolve(LayerRef.parse("ws")) == info
    assert source.resolve(LayerRef.parse("ws@2")) is None
    assert source.list() == [info]
    assert source.image_path(info) == store.image_path(info)
    default = cls()  # DSEC_HOME/layers
    assert Path(default.location) == home / "layers" and default.list() == [info]


# --- docker sources ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docker_host(dsec_dockerd) -> str:
    """The module's docker daemon: a private one (the kit's ``dsec_dockerd``: own socket and
    data root, no networking), stopped and removed at the end."""
    return dsec_dockerd.host


@pytest.fixture
def busybox_image(docker_host, tmp_path, monkeypatch):
    busybox = shutil.which("busybox")
    if not busybox:
        pytest.skip("busybox-static is not installed")
    monkeypatch.setenv("DOCKER_HOST", docker_host)
    archive = tmp_path / "busybox.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(busybox, "bin/busybox")
        tar.addfile(member("bin/sh", tarfile.SYMTYPE, linkname="busybox", mode=0o777)[0])
    name = "dsec-test-busybox:1"
    subprocess.run(["docker", "import", str(archive), name], check=True, capture_output=True)
    yield name
    subprocess.run(["docker", "rmi", "-f", name], capture_output=True)


def _containers() -> list[str]:
    return subprocess.run(
        ["docker", "ps", "-aq"], capture_output=True, text=True, check=True
    ).stdout.split()


def test_build_from_docker_image(busybox_image, store, mount_image):
    before = _containers()
    info = build_layer(
        f"docker:{busybox_image}", name="busybox", version="1", kind="base", store=store
    )
    assert _containers() == before  # the export container is gone
    root = mount_image(store.image_path(info))
    assert os.access(root / "bin/busybox", os.X_OK)
    assert os.readlink(root / "bin/sh") == "busybox"
    assert info.source == f"docker:{busybox_image}"
    assert list(store.tmp_dir.iterdir()) == []


def test_docker_failure_is_a_tool_error_and_leaves_no_container(busybox_image, store):
    before = _containers()
    with pytest.raises(ToolError) as e:
        build_layer("docker:Not//A/Valid:Ref", name="x", version="1", kind="base", store=store)
    assert e.value.exit_code not in (None, 0) and e.value.command
    assert _containers() == before
    assert store_is_empty(store)
