"""runc starts in a mount namespace of its own (``dsec-runc-launch``) that keeps the sandbox's
root filesystem and none of the other sandboxes' mounts, and nothing it does there reaches the
host; the node's sandbox mount parents are private binds of themselves, gone with the node."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsec_backend_container.launch import RUNC_SEALS, SealedBinary, detachable, ensure_launcher

from dsec_core.linux.mounts import bind_onto_itself, mount, mount_points, mounted_under, unmount
from dsec_core.localnode import daemon_pid
from dsec_core.testing import running_kit_node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")

SHOW_MOUNTS = "import sys; sys.stdout.write(open('/proc/self/mountinfo').read())"


def _mount_points(mountinfo: str, under: Path | None = None) -> list[str]:
    return [p for p in mount_points(mountinfo) if under is None or p.startswith(os.fspath(under))]


def _propagation(path: Path) -> str:
    """The optional fields of ``path``'s mount in our mountinfo ("" for a private mount)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == os.fspath(path):
            return " ".join(fields[6 : fields.index("-")])
    raise AssertionError(f"{path} is not a mount point")


def _launch(launcher: Path, parent: Path) -> list[str | Path]:
    """The launcher's argv up to ``--``: keep ``parent/1/rootfs``, hide ``parent``."""
    return [launcher, "--keep", parent / "1" / "rootfs", "--hide", parent, "--"]


def _touch(marker: Path) -> list[str]:
    return [sys.executable, "-c", f"open({os.fspath(marker)!r}, 'w')"]


@pytest.fixture
def parent(tmp_path: Path) -> Iterator[Path]:
    """A private bind of a directory onto itself with three tmpfs "root filesystems" below
    it (``<parent>/<n>/rootfs``), all unmounted after."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    assert bind_onto_itself(root)
    try:
        for n in range(3):
            rootfs = root / str(n) / "rootfs"
            rootfs.mkdir(parents=True)
            mount("tmpfs", rootfs, "tmpfs", 0, "size=1m")
            (rootfs / f"hello{n}").write_text("hi")
            (root / str(n) / "config.json").write_text("{}")
        yield root
    finally:
        for mp in mounted_under(root):
            unmount(mp)


def test_launcher_keeps_one_rootfs_and_sheds_the_rest(tmp_path: Path, parent: Path) -> None:
    launcher = ensure_launcher(tmp_path)
    # ours alone: tests running beside this one mount and unmount elsewhere meanwhile
    before = _mount_points(Path("/proc/self/mountinfo").read_text(), under=tmp_path)
    out = subprocess.run(
        [*_launch(launcher, parent), sys.executable, "-c", SHOW_MOUNTS],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    inside = [mp for mp in _mount_points(out) if mp.startswith(os.fspath(parent))]
    assert inside == [os.fspath(parent / "1" / "rootfs")]  # the parent bind went, and 0 and 2
    # nothing done in the launcher's namespace reached ours
    assert _mount_points(Path("/proc/self/mountinfo").read_text(), under=tmp_path) == before
    assert (parent / "0" / "rootfs" / "hello0").exists()


def test_launcher_sees_the_files_under_what_it_hides(tmp_path: Path, parent: Path) -> None:
    launcher = ensure_launcher(tmp_path)
    script = (
        "import os, sys; p = sys.argv[1]; "
        "print(sorted(os.listdir(p + '/1')), os.listdir(p + '/1/rootfs'), "
        "os.listdir(p + '/0/rootfs'))"
    )
    out = subprocess.run(
        [*_launch(launcher, parent), sys.executable, "-c", script, os.fspath(parent)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # the bundle's files are there; the kept root filesystem is whole; the others are bare
    assert out.strip() == "['config.json', 'rootfs'] ['hello1'] []"


def test_launcher_failure_is_logged_and_runs_nothing(tmp_path: Path) -> None:
    launcher = ensure_launcher(tmp_path)
    log = tmp_path / "runc.log"
    marker = tmp_path / "ran"
    proc = subprocess.run(
        [launcher, "--log", log, "--keep", tmp_path / "missing", "--", *_touch(marker)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 125
    assert "cloning" in log.read_text() and os.fspath(tmp_path / "missing") in log.read_text()
    assert not marker.exists()


def test_the_launch_namespace_keeps_what_runc_needs_and_nothing_else() -> None:
    points = ["/", "/proc", "/sys/fs/cgroup/cpu", "/dev/pts", "/usr", "/usr/local", "/home"]
    points += ["/var/lib/dsec/run", "/var/lib/dsec/run/lxcfs", "/var/lib/dsec/run/sandboxes"]
    points += ["/var/lib/dsec/sandboxes", "/var/lib/dsec/sandboxes/a1", "/var/lib/docker/x"]
    needed = [Path("/var/lib/dsec/run"), Path("/var/lib/dsec/run/lxcfs"), Path("/usr")]
    assert detachable(points, needed) == [
        "/usr/local",
        "/home",
        "/var/lib/dsec/run/sandboxes",
        "/var/lib/dsec/sandboxes",
        "/var/lib/dsec/sandboxes/a1",
        "/var/lib/docker/x",
    ]


def test_bind_onto_itself_leaves_mounts_below_a_plain_directory(tmp_path: Path) -> None:
    d = tmp_path / "d"
    (d / "x").mkdir(parents=True)
    mount("tmpfs", d / "x", "tmpfs", 0, "size=1m")
    try:
        assert not bind_onto_itself(d)  # binding over it would hide d/x from its unmount
        assert mounted_under(d) == [d / "x"]
    finally:
        unmount(d / "x")


def test_node_sandbox_mounts_sit_in_private_parents_and_leave_with_the_node() -> None:
    with running_kit_node("dsec-launch-") as node, node.client() as c:
        cfg = node.config
        a = c.create(layers=(node.layer.ref,), backend="container")
        b = c.create(layers=(node.layer.ref,), backend="container")
        for parent in (cfg.sandbox_dir, cfg.runtime_dir):
            assert parent in mounted_under(parent)
            # private: a sandbox's mounts propagate to no other mount namespace
            assert _propagation(parent) == ""
        for sb in (a, b):
            assert cfg.runtime_dir / sb.id / "rootfs" in mounted_under(cfg.runtime_dir)
            assert cfg.sandbox_dir / sb.id in mounted_under(cfg.sandbox_dir)
            assert sb.exec("echo ok").stdout == b"ok\n"
        # b's namespace was copied from runc's: nothing of a's mounts is in it
        pid = (cfg.runtime_dir / b.id / "init.pid").read_text().strip()
        assert a.id not in Path(f"/proc/{pid}/mountinfo").read_text()
        # runc started in a copy of the node's launch namespace: held by the daemon, it has
        # none of the sandboxes' mounts and nothing under other directories runc never needs
        launch_ns = _launch_namespace_mounts(node.config)
        assert launch_ns, "the daemon holds no launch namespace"
        assert not [
            mp for mp in launch_ns if mp.startswith((str(cfg.sandbox_dir), str(cfg.runtime_dir)))
        ]
        assert os.fspath(cfg.run_dir) in launch_ns
        assert not [mp for mp in launch_ns if mp.startswith(os.fspath(cfg.layer_dir))]
        a.kill()
        b.kill()
    # running_kit_node failed the test had the node left a mount (its parents' binds too)


def _launch_namespace_mounts(config) -> list[str]:
    """The mount points of the mount namespace the node's daemon holds open (not its own)."""
    pid = daemon_pid(config)
    own = os.readlink(f"/proc/{pid}/ns/mnt")
    for fd in os.listdir(f"/proc/{pid}/fd"):
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
        if link.startswith("mnt:[") and link != own:
            script = (
                "import ctypes, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                "assert ctypes.CDLL(None, use_errno=True).setns(fd, 0x20000) == 0; "
                "sys.stdout.write(open('/proc/self/mountinfo').read())"
            )
            out = subprocess.run(
                [sys.executable, "-c", script, f"/proc/{pid}/fd/{fd}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            return _mount_points(out)
    return []


def _sealed_program(tmp_path: Path, source: str = "/bin/sh") -> Path:
    prog = tmp_path / "prog"
    shutil.copy(source, prog)
    return prog


def test_a_sealed_copy_has_runcs_seals_refuses_writes_and_follows_its_file(tmp_path: Path):
    prog = _sealed_program(tmp_path)
    sealed = SealedBinary(prog)
    fd = sealed.fd()
    assert fd is not None
    # exactly the seals runc's init trusts, and the file's bytes
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == RUNC_SEALS
    assert os.pread(fd, prog.stat().st_size + 1, 0) == prog.read_bytes()
    # no write gets in: not through the descriptor, nor through a new open of it
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"\0", 0)
    with open(f"/proc/self/fd/{fd}", "r+b", buffering=0) as f, pytest.raises(PermissionError):
        f.write(b"\0")
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    assert sealed.fd() == fd  # one copy serves every start
    # an upgrade (a new file in its place): a new copy of the new bytes, the old one closed
    new = tmp_path / "prog.new"
    shutil.copy("/bin/true", new)
    os.rename(new, prog)
    fd2 = sealed.fd()
    assert fd2 is not None and os.pread(fd2, prog.stat().st_size + 1, 0) == prog.read_bytes()
    sealed.close()
    with pytest.raises(OSError):
        os.fstat(fd2)
    assert SealedBinary(tmp_path / "missing").fd() is None  # logged; runc runs from its path


def test_launcher_runs_the_sealed_copy_and_hands_it_no_descriptor(tmp_path: Path, parent: Path):
    launcher = ensure_launcher(tmp_path)
    sealed = SealedBinary(_sealed_program(tmp_path))
    fd = sealed.fd()
    assert fd is not None
    try:
        inherited = os.dup(fd)  # inheritable, at a number the launcher is told
        show = "readlink /proc/$$/exe; ls /proc/$$/fd"
        out = subprocess.run(
            [
                launcher,
                "--exec-fd",
                str(inherited),
                *_launch(launcher, parent)[1:],
                "/path/not/run",
                "-c",
                show,
            ],
            capture_output=True,
            text=True,
            check=True,
            pass_fds=(inherited,),
        ).stdout.splitlines()
    finally:
        os.close(inherited)
        sealed.close()
    assert out[0].startswith("/memfd:runc_cloned:/proc/self/exe")  # the copy ran, not the path
    assert str(inherited) not in out[1:]  # closed by the exec


def test_launcher_masks_files_in_its_namespace_alone(tmp_path: Path, parent: Path):
    launcher = ensure_launcher(tmp_path)
    secret = tmp_path / "controllers"
    secret.write_text("hugetlb\n")
    out = subprocess.run(
        [launcher, "--mask", secret, *_launch(launcher, parent)[1:], "/bin/cat", secret],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == ""  # /dev/null over it, inside
    assert secret.read_text() == "hugetlb\n"  # outside, unchanged
    assert os.fspath(secret) not in mount_points(Path("/proc/self/mountinfo").read_text())
