"""The VM guest's boot files: the newc archive reads back, module closures come out in load
order from a real Debian cloud kernel, kernels are cached and reused offline, and an initramfs
boots that kernel under QEMU (TCG) and finds a virtio disk."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsec_core.errors import GuestImageError, InvalidSpec
from dsec_core.vm import guest
from dsec_core.vm.cpio import CpioEntry, write_newc
from dsec_core.vm.guest import (
    GuestKernel,
    build_initramfs,
    ensure_kernel,
    module_closure,
)
from dsec_core.vm.qemu import host_tsc_khz

#: Shared by test runs on this machine, so the kernel package is downloaded once.
KERNEL_CACHE = Path(os.environ.get("DSEC_TEST_KERNELS", "/var/cache/dsec-test-kernels"))

needs_apt = pytest.mark.skipif(
    not shutil.which("apt-get") or not shutil.which("dpkg-deb"), reason="needs apt and dpkg"
)


def read_newc(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """A newc reader written independently of the writer: path -> (mode, data, rdev)."""
    out = {}
    pos = 0
    while True:
        assert data[pos : pos + 6] == b"070701", f"bad magic at {pos}"
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rdev, namesize = fields[1], fields[6], (fields[9], fields[10]), fields[11]
        name = data[pos + 110 : pos + 110 + namesize - 1].decode()
        pos = (pos + 110 + namesize + 3) & ~3
        body = data[pos : pos + size]
        pos = (pos + size + 3) & ~3
        if name == "TRAILER!!!":
            assert pos == len(data)
            return out
        out[name] = (mode, body, rdev)


@pytest.fixture(scope="module")
def kernel() -> GuestKernel:
    """Debian's cloud kernel, downloaded on the machine's first run."""
    return ensure_kernel(KERNEL_CACHE)


def test_newc_round_trip(tmp_path):
    entries = [
        CpioEntry.directory("bin"),
        CpioEntry.file("bin/tool", b"#!/bin/sh\necho hi\n", 0o755),
        CpioEntry.symlink("bin/sh", "busybox"),
        CpioEntry.char_device("console", 5, 1),
        CpioEntry.file("empty", b""),
        CpioEntry.file("odd", b"x" * 4097, 0o600),
    ]
    out = tmp_path / "a.cpio"
    with open(out, "wb") as f:
        write_newc(f, entries)
    members = read_newc(out.read_bytes())
    assert list(members) == [e.path for e in entries]
    for e in entries:
        assert members[e.path] == (e.mode, e.data, e.rdev)
    if shutil.which("busybox"):  # a second opinion from a real cpio reader
        listing = subprocess.run(
            ["busybox", "cpio", "-t", "-i"], input=out.read_bytes(), capture_output=True
        )
        assert listing.returncode == 0, listing.stderr
        assert listing.stdout.decode().split() == [e.path for e in entries]


@needs_apt
def test_module_closure_puts_dependencies_first(kernel):
    order = module_closure(kernel, ["virtio_pmem", "erofs", "virtio-rng", "virtio_mmio"])
    assert order.index("libnvdimm") < order.index("virtio_pmem")
    assert order.index("virtio") < order.index("virtio_pmem")
    assert order.index("virtio_ring") < order.index("virtio")
    assert order.index("libcrc32c") < order.index("erofs")
    assert "virtio_rng" in order  # named with a dash, found with an underscore
    assert len(order) == len(set(order))
    assert module_closure(kernel, ["virtio_mmio", "virtio_mmio"]) == [
        "virtio_ring",
        "virtio",
        "virtio_mmio",
    ]


@needs_apt
def test_unknown_module_is_named(kernel):
    with pytest.raises(GuestImageError, match="no kernel module no_such_mod") as info:
        module_closure(kernel, ["virtio", "no-such-mod"])
    assert info.value.module == "no_such_mod"


def test_compressed_modules_are_refused(tmp_path):
    modules = tmp_path / "lib/modules/9.9-test"
    (modules / "kernel").mkdir(parents=True)
    (modules / "kernel/zmod.ko.xz").write_bytes(b"\xfd7zXZ")
    kernel = GuestKernel("test", "1", "9.9-test", tmp_path / "vmlinuz", modules)
    with pytest.raises(GuestImageError, match="compressed") as info:
        module_closure(kernel, ["zmod"])
    assert info.value.module == "zmod"


@needs_apt
def test_cached_kernel_needs_no_apt(kernel, tmp_path, monkeypatch):
    # a PATH with dpkg-deb but neither apt-get nor apt-cache: any download would fail
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dpkg-deb").symlink_to(shutil.which("dpkg-deb"))
    monkeypatch.setenv("PATH", str(bin_dir))
    assert ensure_kernel(KERNEL_CACHE, version=kernel.version) == kernel
    assert ensure_kernel(KERNEL_CACHE) == kernel  # no candidate known: the one cached
    with pytest.raises(GuestImageError, match="apt-get is not installed"):
        ensure_kernel(KERNEL_CACHE, version="0.0-not-cached")


def test_apts_candidate_is_asked_once_while_apt_stays_as_it_was(tmp_path, monkeypatch):
    """A fresh node's first VM does not wait for ``apt-cache policy`` (a second or more on a
    loaded machine): the candidate version is remembered in the kernel cache until apt's
    lists, configuration or installed packages change."""
    cache = tmp_path / "kernels"
    entry = cache / "linux-image-x_1.0"
    entry.mkdir(parents=True)
    manifest = {"package": "linux-image-x", "version": "1.0", "release": "1.0-x"}
    (entry / "kernel.json").write_text(json.dumps(manifest))
    lists = tmp_path / "lists"
    lists.mkdir()
    monkeypatch.setattr(guest, "APT_STATE", (lists,))
    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    (bin_dir / "apt-cache").write_text(
        f'#!/bin/sh\necho "$@" >> {asked}\n'
        "printf 'linux-image-x:\\n  Installed: (none)\\n  Candidate: 1.0\\n'\n"
    )
    (bin_dir / "apt-cache").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for _ in range(3):
        assert ensure_kernel(cache, "linux-image-x").version == "1.0"
    assert asked.read_text().splitlines() == ["policy linux-image-x"]
    (lists / "new_Packages").write_text("")  # apt-get update brought a new list
    assert ensure_kernel(cache, "linux-image-x").version == "1.0"
    assert len(asked.read_text().splitlines()) == 2


@needs_apt
def test_pinned_version_apt_cannot_get(tmp_path):
    with pytest.raises(GuestImageError, match="apt cannot get") as info:
        ensure_kernel(tmp_path, version="0.0.1-no-such")
    assert info.value.command[:2] == ["apt-get", "download"]
    assert info.value.exit_code not in (None, 0)
    assert "0.0.1-no-such" in info.value.stderr
    assert not list(tmp_path.glob("linux-image-*"))


@needs_apt
def test_local_deb_is_unpacked_and_trimmed(tmp_path):
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        "Package: linux-image-test\nVersion: 1.2-3\nArchitecture: amd64\n"
        "Maintainer: t <t@example.org>\nDescription: test kernel\n"
    )
    (root / "boot").mkdir()
    (root / "boot/vmlinuz-9.9-test").write_bytes(b"kernel")
    (root / "boot/config-9.9-test").write_text("CONFIG_X=y\n")
    (root / "lib/modules/9.9-test/kernel").mkdir(parents=True)
    (root / "usr/share/doc/linux-image-test").mkdir(parents=True)
    deb = tmp_path / "linux-image-test_1.2-3_amd64.deb"
    subprocess.run(["dpkg-deb", "-b", str(root), str(deb)], check=True, capture_output=True)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:  # concurrent callers: one unpacks, all get it
        kernels = list(pool.map(lambda _: ensure_kernel(cache, str(deb)), range(4)))
    kernel = kernels[0]
    assert kernels == [kernel] * 4
    assert (kernel.package, kernel.version) == ("linux-image-test", "1.2-3")
    assert kernel.release == "9.9-test"
    assert kernel.vmlinuz.read_bytes() == b"kernel"
    entry = cache / "linux-image-test_1.2-3"
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "linux-image-test_1.2-3"]
    assert sorted(p.name for p in entry.iterdir()) == ["boot", "kernel.json", "lib"]
    assert [p.name for p in (entry / "boot").iterdir()] == ["vmlinuz-9.9-test"]
    assert ensure_kernel(cache, "linux-image-test", "1.2-3") == kernel
    with pytest.raises(InvalidSpec):
        ensure_kernel(cache, str(deb), "2.0")


@needs_apt
def test_initramfs_members_and_cache(kernel, tmp_path):
    host_file = tmp_path / "tool"
    host_file.write_bytes(b"\x7fELF...")
    host_file.chmod(0o750)
    files = {"/init": b"#!/bin/sh\n", "/etc/dsec/conf": b"x=1\n", "/usr/bin/tool": host_file}
    out = build_initramfs(tmp_path / "out", kernel, ["virtio_blk"], files)
    assert out.name.startswith("initramfs-") and out.suffix == ".cpio"
    members = read_newc(out.read_bytes())
    for d in ("bin", "dev", "proc", "sys", "mnt", "run", "newroot", "etc/dsec", "usr/bin"):
        assert stat.S_ISDIR(members[d][0]), d
    assert members["bin/sh"] == (stat.S_IFLNK | 0o777, b"busybox", (0, 0))
    assert members["bin/busybox"][1] == Path("/bin/busybox").read_bytes()
    order = members["lib/modules/order"][1].decode().split()
    assert order == ["virtio_ring", "virtio", "virtio_blk"]
    assert all(f"lib/modules/{m}.ko" in members for m in order)
    assert stat.S_IMODE(members["init"][0]) == 0o755
    assert stat.S_IMODE(members["etc/dsec/conf"][0]) == 0o644
    assert stat.S_IMODE(members["usr/bin/tool"][0]) == 0o750
    names = list(members)
    assert names.index("etc") < names.index("etc/dsec") < names.index("etc/dsec/conf")

    again = build_initramfs(tmp_path / "out", kernel, ["virtio_blk"], files)
    assert again == out and len(list(out.parent.iterdir())) == 1
    changed = build_initramfs(tmp_path / "out", kernel, ["virtio_blk"], {**files, "/init": b"x"})
    assert changed != out
    with pytest.raises(InvalidSpec):
        build_initramfs(tmp_path / "out", None, ["virtio_blk"], {})
    with pytest.raises(InvalidSpec):
        build_initramfs(tmp_path / "out", None, [], {"etc/relative": b""})


BOOT_INIT = b"""#!/bin/sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in $(/bin/busybox cat /lib/modules/order); do
  /bin/busybox insmod /lib/modules/$m.ko || echo "insmod $m failed"
done
n=0
while [ ! -e /dev/vda ] && [ $n -lt 50 ]; do /bin/busybox sleep 0.1; n=$((n+1)); done
echo "DSEC-GUEST-UP devices: $(/bin/busybox ls /dev | /bin/busybox grep '^vd')"
/bin/busybox poweroff -f
"""


@needs_apt
@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("qemu-system-x86_64"), reason="needs qemu-system-x86_64")
def test_initramfs_boots_and_sees_virtio_disk(kernel, tmp_path):
    initrd = build_initramfs(tmp_path, kernel, ["virtio_mmio", "virtio_blk"], {"/init": BOOT_INIT})
    disk = tmp_path / "disk.img"
    disk.write_bytes(b"\0" * (1 << 20))
    argv = [
        "qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-m", "256M",
        "-nodefaults", "-no-user-config", "-nographic", "-serial", "stdio",
        "-kernel", str(kernel.vmlinuz), "-initrd", str(initrd),
        "-append", f"console=ttyS0 quiet panic=-1 tsc_early_khz={host_tsc_khz()}", "-no-reboot",
        "-drive", f"file={disk},if=none,format=raw,readonly=on,id=d0",
        "-device", "virtio-blk-device,drive=d0",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    console = proc.stdout.decode(errors="replace")
    assert "DSEC-GUEST-UP" in console, console + proc.stderr.decode(errors="replace")
    assert "insmod" not in console  # every module loaded
    line = next(x for x in console.splitlines() if "DSEC-GUEST-UP" in x)
    assert "vda" in line.split("devices:")[1].split()
