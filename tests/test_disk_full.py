"""A node whose disk fills: what the chaos soak (bench/soak.py) found. Its home is on a small
ext4 file system of its own (a loop mount), filled to the last block while it serves: a create
is ``DiskFull`` (HTTP 507, an infrastructure failure a trainer masks), never an untyped 500,
the node keeps answering, live sandboxes keep running, nothing of the failed creates is left,
and once room is made creates work again."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from dsec_core.errors import DiskFull
from dsec_core.rl import infra_event
from dsec_core.testing import running_kit_node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a file system: needs root")


@pytest.fixture
def small_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 384 MiB ext4 file system on a loop device where the kit makes its node homes."""
    root = Path(tempfile.mkdtemp(prefix="dsec-full-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    image, mnt = root / "fs.img", root / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "384M", image], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", image], check=True)
    subprocess.run(["mount", "-o", "loop", image, mnt], check=True)
    try:
        os.chmod(mnt, 0o711)
        monkeypatch.setenv("DSEC_KIT_HOME", os.fspath(mnt))
        yield mnt
    finally:
        if subprocess.run(["umount", mnt]).returncode != 0:
            subprocess.run(["umount", "-l", mnt])
        image.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            mnt.rmdir()
            root.rmdir()


@contextlib.contextmanager
def filled(where: Path) -> Iterator[None]:
    """``where``'s file system filled to its last block for the block."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        st = os.statvfs(where)
        size = st.f_bfree * st.f_frsize
        while size > 1 << 20:
            try:
                os.posix_fallocate(fd, 0, size)
                break
            except OSError:
                size = size * 15 // 16
        with contextlib.suppress(OSError):
            os.lseek(fd, 0, os.SEEK_END)
            while True:
                os.write(fd, b"\0" * 65536)
        yield
    finally:
        os.close(fd)
        filler.unlink()


def test_a_full_disk_is_disk_full_and_the_node_goes_on(small_disk: Path):
    with running_kit_node("dsec-full-") as node, node.client() as c:
        spec = dsec.SandboxSpec(layers=(node.layer.ref,), memory="64M")
        live = c.create(spec)
        live.exec("echo kept > /tmp/state").check()

        def made_on_disk() -> set[str]:
            return {p.name for d in ("sandboxes", "disks") for p in (node.home / d).iterdir()}

        before = made_on_disk()
        with filled(small_disk):
            for _ in range(3):  # each one fails typed, none is left half made
                with pytest.raises(DiskFull) as e:
                    c.create(spec)
                assert e.value.http_status == 507
                event = infra_event(e.value)
                assert event is not None and event.kind == "disk_full"
            assert c.node_info()["sandboxes"] == 1  # the node answers
            assert live.exec("cat /tmp/state").check().stdout == b"kept\n"
        assert made_on_disk() == before  # nothing of the failed creates
        made = c.create(spec)  # room again: creates work
        assert made.exec("echo ok").check().stdout == b"ok\n"
        made.kill()
        live.kill()  # and the kit finds nothing left behind when the node stops


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="QEMU is not installed")
def test_a_full_disk_is_a_microvms_eio_not_a_stopped_vm(small_disk: Path):
    """QEMU's default stopped the whole VM on ENOSPC, and with no one to resume it the
    sandbox never answered again (the soak's microVM creates hung for minutes): the guest now
    sees EIO for that write, as a container sees ENOSPC, and answers on."""
    with running_kit_node("dsec-full-") as node, node.client() as c:
        vm = c.create(layers=(node.layer.ref,), memory="256M", backend="microvm")
        with filled(small_disk):
            r = vm.exec("dd if=/dev/urandom of=/x bs=1M count=40 conv=fsync", timeout=60)
            assert r.exit_code != 0 and b"Input/output error" in r.stderr
            assert vm.exec("echo alive", timeout=30).stdout == b"alive\n"
        assert vm.exec("echo alive", timeout=30).stdout == b"alive\n"
        vm.kill()
