"""Sandboxes' writable layers on filesystems of their own: the ext4 images and loop devices, the
``disk`` limit, root-only node directories, and the filesystems across daemon restarts.

The attacks (disk fills, planted setuid binaries and device nodes, host users reading sandbox
files) are in ``tests/adversarial/test_disk.py``.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dsec_core.backend import cgroup_path
from dsec_core.config import NodeConfig
from dsec_core.errors import InvalidSpec, MountError, ToolError
from dsec_core.linux import loop
from dsec_core.linux.ext4 import mkfs_ext4
from dsec_core.linux.files import SparseFile, copy_sparse
from dsec_core.linux.loop import attach_loop, loop_backing_files
from dsec_core.localnode import ensure_daemon, stop_daemon
from dsec_core.node import disks as disks_module
from dsec_core.node.disks import WritableDisks
from dsec_core.records import DEFAULT_DISK, SandboxSpec
from dsec_core.testing import cgroup_hierarchies, leftovers, running_kit_node, until

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture
def disks(tmp_path) -> WritableDisks:
    d = tmp_path / "disks"
    d.mkdir()
    return WritableDisks(d)


def _nothing_left(disks: WritableDisks, target: Path) -> None:
    assert not os.path.ismount(target) and not target.exists()
    # the kernel detaches an autoclear loop device in a work item after its last close
    # (the unmount), not in the unmount itself: soon, not at once
    until(lambda: loop_backing_files(disks.dir) == {}, 5, "the loop device detached")
    assert disks.images() == []


# --- the disk limit in the spec ---------------------------------------------------------------


def test_disk_limit_parses_like_memory():
    spec = SandboxSpec(layers=("x@1",))
    assert spec.limits.disk == DEFAULT_DISK == 10 << 30
    assert SandboxSpec(layers=("x@1",), disk="1.5G").limits.disk == 3 << 29
    assert SandboxSpec(layers=("x@1",), disk=64 << 20).limits.disk == 64 << 20


@pytest.mark.parametrize("bad", ["lots", "1M", 0, -5, "2T", "", None])
def test_bad_disk_limits_are_typed(bad):
    with pytest.raises(InvalidSpec) as e:
        SandboxSpec(layers=("x@1",), disk=bad)
    assert e.value.field == "disk" and "disk" in str(e.value)


# --- primitives: sparse copies, ext4 images, loop devices ------------------------------------


@pytest.mark.parametrize("direct", [False, True])
def test_sparse_files_keep_data_and_holes(tmp_path, direct):
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.truncate(64 << 20)
        f.seek(1 << 20)
        f.write(os.urandom(8192))
        f.seek(40 << 20)
        f.write(b"b" * 4096)
    image = SparseFile.read(src)
    assert image.size == 64 << 20 and [o for o, _ in image.extents] == [1 << 20, 40 << 20]
    dst = tmp_path / "dst"
    image.write(dst, direct=direct)
    assert dst.stat().st_size == 64 << 20
    assert dst.stat().st_blocks * 512 <= 64 << 10  # the holes stayed holes
    assert stat.S_IMODE(dst.stat().st_mode) == 0o600
    assert dst.read_bytes() == src.read_bytes()
    with pytest.raises(FileExistsError):
        image.write(dst)


@root_only
def test_a_sparse_copy_crosses_file_systems(tmp_path):
    """copy_file_range between two file systems is EXDEV on this kernel (found by the chaos
    soak: a VM template saved from node homes on a file system of their own): the copy
    reads and writes instead, data and holes as they were."""
    src = Path(tempfile.mkdtemp(dir="/dev/shm")) / "src"
    try:
        with open(src, "wb") as f:
            f.truncate(64 << 20)
            f.seek(1 << 20)
            f.write(os.urandom(3 << 20))  # more than one buffer's worth
            f.seek(40 << 20)
            f.write(b"tail")
        fd_in, fd_out = (
            os.open(src, os.O_RDONLY),
            os.open(tmp_path / "probe", os.O_CREAT | os.O_WRONLY),
        )
        try:  # the case is real here: the kernel refuses the in-kernel copy
            with pytest.raises(OSError) as e:
                os.copy_file_range(fd_in, fd_out, 4096, 1 << 20, 0)
            assert e.value.errno == errno.EXDEV
        finally:
            os.close(fd_in)
            os.close(fd_out)
        copy_sparse(src, tmp_path / "dst")
        assert (tmp_path / "dst").read_bytes() == src.read_bytes()
        assert os.stat(tmp_path / "dst").st_blocks * 512 < 8 << 20  # the holes stayed holes
    finally:
        shutil.rmtree(src.parent)


def test_mkfs_refuses_bad_sizes_and_a_missing_tool_leaves_nothing(tmp_path, monkeypatch):
    with pytest.raises(InvalidSpec):
        mkfs_ext4(tmp_path / "small", 1 << 20)
    with pytest.raises(InvalidSpec):
        mkfs_ext4(tmp_path / "odd", (16 << 20) + 1)
    monkeypatch.setenv("PATH", os.fspath(tmp_path))
    with pytest.raises(ToolError) as e:
        mkfs_ext4(tmp_path / "img", 16 << 20)
    assert "mkfs.ext4" in str(e.value)
    assert list(tmp_path.iterdir()) == []


@root_only
def test_templates_are_sparse_and_made_once_per_size(disks):
    big = disks.template(10 << 30)
    path = disks.template_path(10 << 30)
    assert big.size == path.stat().st_size == 10 << 30
    held = sum(len(d) for _, d in big.extents)
    assert 16 << 10 < held <= path.stat().st_blocks * 512 < 1 << 20  # formatted, under a MiB
    made = path.stat().st_ino
    assert disks.template(10 << 30) is big
    assert WritableDisks(disks.dir).template(10 << 30) == big  # a new daemon reads it back
    assert path.stat().st_ino == made  # and formats nothing
    disks.template(16 << 20)
    assert {p.name for p in disks.templates.iterdir()} == {
        f"ext4-{16 << 20}.img",
        f"ext4-{10 << 30}.img",
    }


@root_only
def test_templates_are_bounded_in_memory_and_on_disk(disks, monkeypatch):
    monkeypatch.setattr(disks_module, "HELD", 2)
    monkeypatch.setattr(disks_module, "KEPT", 3)
    sizes = [(16 + i) << 20 for i in range(5)]
    for size in sizes:
        disks.template(size)
        disks.template(sizes[0])  # the one in use stays
    assert disks.ready(sizes[0]) and disks.ready(sizes[-1]) and not disks.ready(sizes[1])
    on_disk = {int(p.name.split(".")[0].split("-")[1]) for p in disks.templates.iterdir()}
    assert on_disk == {sizes[0], sizes[3], sizes[4]}


@root_only
def test_a_sandbox_filesystem_fills_with_enospc_and_goes_without_a_trace(disks, tmp_path):
    target = tmp_path / "sb"
    disks.mount("abc123", 16 << 20, target)
    try:
        assert os.path.ismount(target)
        flags = os.statvfs(target).f_flag
        assert flags & os.ST_NOSUID and flags & os.ST_NODEV
        assert stat.S_IMODE(target.stat().st_mode) == 0o700
        assert list(loop_backing_files(disks.dir).values()) == [os.fspath(disks.image("abc123"))]
        with pytest.raises(OSError) as e, open(target / "fill", "wb") as f:
            for _ in range(32):
                f.write(bytes(1 << 20))
                f.flush()
                os.fsync(f.fileno())
        assert e.value.errno == errno.ENOSPC
        assert disks.image("abc123").stat().st_blocks * 512 <= 17 << 20
    finally:
        disks.remove("abc123", target)
    _nothing_left(disks, target)


@root_only
def test_failures_while_mounting_leave_nothing(disks, tmp_path, monkeypatch):
    target = tmp_path / "sb"

    def broken_mount(device, target, flags=0):
        raise MountError("no ext4 here", target=os.fspath(target))

    monkeypatch.setattr(disks, "_mount", broken_mount)
    with pytest.raises(MountError):
        disks.mount("abc123", 16 << 20, target)
    _nothing_left(disks, target)
    monkeypatch.undo()
    monkeypatch.setattr(loop, "LOOP_CONTROL", os.fspath(tmp_path / "no-loop-control"))
    with pytest.raises(MountError) as e:
        disks.mount("abc123", 16 << 20, target)
    assert "loop" in str(e.value)
    _nothing_left(disks, target)


@root_only
def test_leftovers_report_loop_devices_and_images(tmp_path):
    home = tmp_path / "home"
    (home / "disks").mkdir(parents=True)
    image = home / "disks" / "abc123.img"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    with attach_loop(image) as dev:
        left = leftovers(home)
        assert left["loop_devices"] == [f"{dev.path}: {image}"]
        assert left["disk_images"] == ["abc123.img"]
    image.unlink()
    left = leftovers(home)
    assert left["loop_devices"] == [] and left["disk_images"] == []  # autoclear on close


@root_only
def test_leftovers_take_a_live_sandboxs_starting_init_for_its_own_and_report_it_after(tmp_path):
    """crun's fork of a sandbox's init keeps crun's command line (the home's paths, then the
    sandbox id) until it runs the agent, which may be just after the create returned: not a
    leftover while the sandbox's directory is there; reported once it is gone."""
    home = tmp_path / "home"
    sdir = home / "run" / "sandboxes" / "0123456789ab"
    sdir.mkdir(parents=True)
    argv = [sys.executable, "-c", "import sys; sys.stdin.read()", "--root", f"{home}/run/runc"]
    init = subprocess.Popen(
        [*argv, "run", "-d", "--bundle", os.fspath(sdir), sdir.name], stdin=subprocess.PIPE
    )
    other = subprocess.Popen([*argv, "sleep"], stdin=subprocess.PIPE)  # no run: always reported
    try:
        for p in (init, other):  # Popen returns while the exec may not yet show the new argv
            while os.fsencode(home) not in Path(f"/proc/{p.pid}/cmdline").read_bytes():
                time.sleep(0.001)
        assert [p.split(":")[0] for p in leftovers(home)["processes"]] == [str(other.pid)]
        sdir.rmdir()
        left = leftovers(home)["processes"]
        assert sorted(p.split(":")[0] for p in left) == sorted([str(init.pid), str(other.pid)])
    finally:
        for p in (init, other):
            p.kill()
            p.wait()


@root_only
def test_leftovers_pass_over_another_nodes_launcher_that_hides_this_home(tmp_path):
    """Another node's runtime launcher lists every mount on the host as ``--hide``/``--mask``
    arguments, this home's too: it is not this node's (it failed a kit check once when a
    neighbour's create ran in the before snapshot). One named by its program path is."""
    home = tmp_path / "home"
    home.mkdir()
    argv = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    hider = subprocess.Popen(
        [*argv, "--hold", "--mask", f"{home}/x", "--hide", f"{home}/run", "--hide", "/elsewhere"],
        stdin=subprocess.PIPE,
    )
    ours = subprocess.Popen([*argv, "--hide", "/elsewhere", f"{home}/bin/x"], stdin=subprocess.PIPE)
    try:
        for p in (hider, ours):
            while os.fsencode(home) not in Path(f"/proc/{p.pid}/cmdline").read_bytes():
                time.sleep(0.001)
        assert [p.split(":")[0] for p in leftovers(home)["processes"]] == [str(ours.pid)]
    finally:
        for p in (hider, ours):
            p.kill()
            p.wait()


@root_only
def test_leftovers_report_the_cgroups_of_a_sandbox_the_log_says_is_gone(tmp_path):
    """A stop that found a sandbox's cgroups busy removed its directory and left them (the
    soak's second full run): they are found through the daemon's log, which names each
    sandbox it kills or cleans up; a sandbox named for another reason is not this node's."""
    home = tmp_path / "home"
    home.mkdir()
    gone, theirs = f"{os.urandom(6).hex()}-n2", f"{os.urandom(6).hex()}-n1"
    NodeConfig(home=home).log_path.write_text(
        f'{{"msg": "sandbox {gone} died while no daemon watched; cleaning up"}}\n'
        f'{{"msg": "packed sandbox {theirs} as x"}}\n'
    )
    made = [h / cgroup_path(sid) for h in cgroup_hierarchies()[:1] for sid in (gone, theirs)]
    try:
        for cg in made:
            cg.mkdir(parents=True)
        assert leftovers(home)["cgroups"] == [os.fspath(made[0])]
    finally:
        for cg in made:
            if cg.exists():
                cg.rmdir()
    assert leftovers(home)["cgroups"] == []


# --- the node's directories -------------------------------------------------------------------


@root_only
def test_node_directories_admit_only_root_and_the_sandboxes_group():
    home = Path(tempfile.mkdtemp(prefix="dsec-dirs-"))
    try:
        cfg = NodeConfig(home=home)
        cfg.ensure_dirs()
        for d in (cfg.home, cfg.run_dir, cfg.runtime_dir, cfg.bin_dir):
            st = d.stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o710, 0, cfg.uid_base), d
        for d in (
            cfg.mount_dir,
            cfg.sandbox_dir,
            cfg.disk_dir,
            cfg.layer_dir,
            cfg.catalog_dir,
            cfg.cache_dir,
        ):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    finally:
        shutil.rmtree(home)


@root_only
@pytest.mark.parametrize(
    "mode, owner, ok",
    [
        (0o700, (0, 0), False),
        (0o750, (0, 0), False),
        (0o701, (0, 0), True),
        (0o710, (0, 100000), True),
        (0o700, (100000, 100000), True),
    ],
)
def test_a_home_the_sandboxes_cannot_reach_is_refused(mode, owner, ok):
    parent = Path(tempfile.mkdtemp(prefix="dsec-parent-"))
    try:
        os.chown(parent, *owner)
        os.chmod(parent, mode)
        cfg = NodeConfig(home=parent / "home")
        if ok:
            cfg.ensure_dirs()
        else:
            with pytest.raises(InvalidSpec) as e:
                cfg.ensure_dirs()
            assert os.fspath(parent) in str(e.value) and e.value.path == os.fspath(parent)
    finally:
        shutil.rmtree(parent)


# --- through the node -------------------------------------------------------------------------


def test_the_disk_limit_is_the_size_inside(dsec_sandboxes, dsec_node):
    sb = dsec_sandboxes.create(disk="48M")
    assert sb.info.limits["disk"] == 48 << 20
    kib = int(sb.exec("df -k / | tail -1").stdout.split()[1])
    assert 44 << 10 < kib <= 48 << 10  # the size, less ext4's own metadata
    image = dsec_node.config.disk_dir / f"{sb.id}.img"
    data_dir = dsec_node.config.sandbox_dir / sb.id
    assert image.stat().st_size == 48 << 20 and os.path.ismount(data_dir)
    sb.kill()
    assert not image.exists() and not data_dir.exists()
    assert os.fspath(image) not in " ".join(loop_backing_files(dsec_node.home).values())


@pytest.fixture
def private_node():
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with running_kit_node("dsec-disks-") as node:
        yield node


def test_the_filesystem_and_its_quota_outlive_a_daemon_restart(private_node):
    cfg = private_node.config
    with private_node.client() as c:
        sb = c.create(layers=(private_node.layer.ref,), memory="64M", disk="32M")
        sb.exec("dd if=/dev/zero of=/root/kept bs=1M count=8").check()
    data_dir = cfg.sandbox_dir / sb.id
    stop_daemon(cfg)
    assert os.path.ismount(data_dir)  # the sandbox still runs on it
    assert any(b.endswith(f"{sb.id}.img") for b in loop_backing_files(cfg.home).values())
    ensure_daemon(cfg)
    with private_node.client() as c:
        again = c.get(sb.id)
        assert again.exec("stat -c %s /root/kept").stdout == b"8388608\n"
        r = again.exec("dd if=/dev/zero of=/root/more bs=1M count=64")
        assert r.exit_code != 0 and b"No space left on device" in r.stderr
        again.kill()
    left = leftovers(cfg.home)
    assert left["loop_devices"] == [] and left["disk_images"] == [] and left["sandbox_dirs"] == []


def test_a_start_removes_writable_layers_of_gone_sandboxes(private_node):
    cfg = private_node.config
    stop_daemon(cfg)
    disks = WritableDisks(cfg.disk_dir)
    # a crash mid-create: a mounted filesystem, no runtime state
    disks.mount("deadbeef0001", 16 << 20, cfg.sandbox_dir / "deadbeef0001")
    # a reboot: an image and a bare directory, nothing mounted
    with open(disks.image("deadbeef0002"), "wb") as f:
        f.truncate(16 << 20)
    (cfg.sandbox_dir / "deadbeef0003").mkdir()
    # a crash while images of killed sandboxes were still being deleted in the background
    disks.freeing.mkdir(exist_ok=True)
    (disks.freeing / "deadbeef0004.img").write_bytes(b"x" * 4096)
    ensure_daemon(cfg)
    with private_node.client() as c:
        assert c.list() == []
    assert list(cfg.sandbox_dir.iterdir()) == [] and disks.images() == []
    assert list(disks.freeing.iterdir()) == []
    assert loop_backing_files(cfg.home) == {}


@root_only
def test_a_removed_image_is_out_of_sight_at_once_and_deleted_in_the_background(disks, tmp_path):
    """A kill does not wait for the host to free (and discard) what a sandbox wrote: its image
    leaves the disk directory at once, and is gone from the host once the disks drain."""
    targets = [tmp_path / f"sb{i}" for i in range(3)]
    for i, target in enumerate(targets):
        disks.mount(f"abc12300000{i}", 16 << 20, target)
        (target / "written").write_bytes(os.urandom(1 << 20))
    for i, target in enumerate(targets):
        disks.remove(f"abc12300000{i}", target)
        assert not disks.image(f"abc12300000{i}").exists() and not target.exists()
    assert disks.images() == []
    disks.drain()
    assert list(disks.freeing.iterdir()) == []
    assert loop_backing_files(disks.dir) == {}
    # the freer starts again after a drain
    disks.mount("abc123000009", 16 << 20, targets[0])
    disks.remove("abc123000009", targets[0])
    disks.drain()
    assert list(disks.freeing.iterdir()) == [] and disks.images() == []


# --- XFS writable layers ------------------------------------------------------------------------


@root_only
def test_an_xfs_writable_layer_with_reflink_fills_up_with_enospc(tmp_path):
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs is not installed (apt-get install xfsprogs)")
    disks = WritableDisks(tmp_path / "disks", "xfs")
    disks.dir.mkdir()
    target = tmp_path / "upper"
    disks.mount("xfs1", 320 << 20, target)
    try:
        with open("/proc/self/mounts") as f:
            line = next(m for m in f if m.split()[1] == os.fspath(target))
        assert line.split()[2] == "xfs" and "nosuid" in line and "nodev" in line
        info = subprocess.run(["xfs_info", os.fspath(target)], capture_output=True, text=True)
        assert "reflink=1" in info.stdout
        with pytest.raises(OSError) as e, open(target / "fill", "wb") as f:
            for _ in range(400):
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        assert e.value.errno == errno.ENOSPC
        # a second sandbox from the same template mounts beside it (every copy shares a UUID)
        disks.mount("xfs2", 320 << 20, tmp_path / "other")
        disks.remove("xfs2", tmp_path / "other")
    finally:
        disks.remove("xfs1", target)
    _nothing_left(disks, target)


def test_unknown_or_too_small_filesystems_are_typed(tmp_path):
    with pytest.raises(InvalidSpec) as e:
        WritableDisks(tmp_path, "btrfs")
    assert e.value.field == "DSEC_DISK_FS" and "ext4, xfs" in str(e.value)
    if shutil.which("mkfs.xfs"):
        with pytest.raises(InvalidSpec) as e2:
            WritableDisks(tmp_path, "xfs").template(64 << 20)
        assert e2.value.field == "disk" and "300 MiB" in str(e2.value)
