"""Layer mounts: one shared, reference-counted mount per layer; overlays on top of idmapped clones
of it, one uid range per sandbox."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dsec_core.errors import MountError
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.mounts import (
    UserNamespaceHandle,
    clone_idmapped,
    ensure_tmpfs,
    mounted_under,
    unmount,
)
from dsec_core.node.mounts import MountCache, OverlayStack

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture
def layer(tmp_path):
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("hi\n")
    store = LayerStore(tmp_path / "store")
    info = build_layer(src, name="t", version="1", kind="base", store=store)
    return info, store.image_path(info)


@pytest.fixture
def userns():
    handle = UserNamespaceHandle([(0, 100000, 65536)])
    yield handle
    handle.close()


def _mounted(path: Path) -> bool:
    return os.path.ismount(path)


def test_shared_refcounted(tmp_path, layer):
    info, image = layer
    cache = MountCache(tmp_path / "mnt", linger=0)
    a = cache.acquire(info.digest, image)
    b = cache.acquire(info.digest, image)
    assert a == b and _mounted(a)
    assert len(mounted_under(tmp_path / "mnt")) == 1  # one mount serves both users
    assert (a / "etc" / "hello").read_text() == "hi\n"
    assert (a / "etc" / "hello").stat().st_uid == 0  # as in the image: sandboxes get clones
    with pytest.raises(OSError):
        (a / "etc" / "new").write_text("x")  # read-only
    cache.release(info.digest)
    assert _mounted(a)
    cache.release(info.digest)
    assert not _mounted(a) and not a.exists()


def test_linger_keeps_mount_until_sweep(tmp_path, layer):
    info, image = layer
    cache = MountCache(tmp_path / "mnt", linger=0.2)
    path = cache.acquire(info.digest, image)
    cache.release(info.digest)
    assert _mounted(path)
    cache.sweep()
    assert _mounted(path)  # not idle long enough yet
    assert cache.acquire(info.digest, image) == path  # reused while lingering
    cache.release(info.digest)
    time.sleep(0.25)
    cache.sweep()
    assert not _mounted(path)


def test_adopt_after_restart(tmp_path, layer):
    info, image = layer
    first = MountCache(tmp_path / "mnt", linger=0)
    path = first.acquire(info.digest, image)
    # a new daemon: one sandbox still uses the layer
    second = MountCache(tmp_path / "mnt", linger=0)
    second.adopt({info.digest: 1})
    assert second.refcounts() == {info.digest: 1} and _mounted(path)
    second.release(info.digest)
    assert not _mounted(path)
    # and a mount nobody uses is removed on adoption
    path = first.acquire(info.digest, image)
    third = MountCache(tmp_path / "mnt", linger=0)
    third.adopt({})
    assert not _mounted(path)


def test_bad_image_is_typed_and_leaves_nothing(tmp_path):
    junk = tmp_path / "junk.erofs"
    junk.write_bytes(b"\0" * 8192)
    cache = MountCache(tmp_path / "mnt")
    with pytest.raises(MountError):
        cache.acquire("sha256:" + "0" * 64, junk)
    assert list((tmp_path / "mnt").iterdir()) == []


def test_overlay_writes_go_to_upper(tmp_path, layer, userns):
    info, image = layer
    cache = MountCache(tmp_path / "mnt")
    lower = cache.acquire(info.digest, image)
    stack = OverlayStack(tmp_path / "data", tmp_path / "run" / "rootfs")
    root = stack.mount([lower], owner=(100000, 100000), userns=userns)
    try:
        assert (root / "etc" / "hello").stat().st_uid == 100000  # root in the image, idmapped
        (root / "etc" / "hello").write_text("changed\n")
        assert (tmp_path / "data" / "upper" / "etc" / "hello").read_text() == "changed\n"
        assert (lower / "etc" / "hello").read_text() == "hi\n"  # the layer is untouched
    finally:
        stack.unmount()
        cache.release(info.digest)
    assert mounted_under(tmp_path) == []


def test_tmpfs_is_idempotent(tmp_path):
    ensure_tmpfs(tmp_path / "run")
    ensure_tmpfs(tmp_path / "run")
    assert len(mounted_under(tmp_path)) == 1
    unmount(tmp_path / "run")
    assert mounted_under(tmp_path) == []


def test_clones_idmap_per_range_and_share_the_page_cache(tmp_path, layer):
    """Two sandboxes' clones of one layer mount: each shows the image's root as its own range's
    uid, both are the shared mount's superblock (one page cache), and the overlays leave no
    clone mounted on the host."""
    info, image = layer
    cache = MountCache(tmp_path / "mnt")
    lower = cache.acquire(info.digest, image)
    ranges = [(200000, 65536), (265536, 65536)]
    handles = [
        UserNamespaceHandle([(0, b, n)], [(0, 100000, 1), (1, b + 1, n - 1)]) for b, n in ranges
    ]
    stacks = []
    try:
        for i, (ns, (base, _)) in enumerate(zip(handles, ranges, strict=True)):
            fd = clone_idmapped(lower, ns)
            try:
                st = os.stat(f"/proc/self/fd/{fd}/etc/hello")
                assert (st.st_uid, st.st_gid) == (base, 100000)
                assert st.st_dev == os.stat(lower / "etc" / "hello").st_dev  # one superblock
                assert st.st_ino == os.stat(lower / "etc" / "hello").st_ino
            finally:
                os.close(fd)
            stack = OverlayStack(tmp_path / f"data{i}", tmp_path / "run" / f"rootfs{i}")
            root = stack.mount([lower], owner=(base, 100000), userns=ns)
            stacks.append(stack)
            assert (root / "etc" / "hello").stat().st_uid == base
        # the shared mount and two overlays, no clone left mounted anywhere
        assert len(mounted_under(tmp_path)) == 3
    finally:
        for stack in stacks:
            stack.unmount()
        cache.release(info.digest)
        for ns in handles:
            ns.close()
    assert mounted_under(tmp_path) == []


def test_bad_maps_are_typed(tmp_path):
    with pytest.raises(MountError, match="uid_map"):
        UserNamespaceHandle([(0, 100000, 65536), (0, 200000, 10)])  # overlapping inside ids
