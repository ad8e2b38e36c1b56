"""Boot time of a q35 guest to a drawn framebuffer, for each display device and firmware: the
measurements behind ``dsec_backend_vm.display``'s choice.

Each run boots Debian's generic kernel (its uncompressed vmlinux through PVH, or with
``--vmlinuz`` the bzImage as shipped) with an initramfs that loads the display and input
modules and starts clickpad, and times QEMU's start to clickpad's ``ready`` line on the serial
console. ``--runs N`` boots each set N times (default 3) and prints the median and the range.

    python plugins/backend_vm/bench/display_boot.py [--runs N] [--tuned] [--vmlinuz]

``--tuned`` adds the q35 and kernel options that shorten any TCG boot (no SMBus, SATA, USB,
vmport; ``-cpu max``; tsc and RCU flags), to see whether the devices still rank the same.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsec_backend_vm.display import DISPLAY_KERNEL_PACKAGE
from dsec_backend_vm.guest import ensure_guest_program

from dsec_core.vm.guest import build_initramfs, ensure_kernel
from dsec_core.vm.vmlinux import ensure_vmlinux

KERNEL_CACHE = Path(os.environ.get("DSEC_TEST_KERNELS", "/var/cache/dsec-test-kernels"))
QBOOT = Path("/usr/share/qemu/qboot.rom")
INPUT = ("virtio_pci", "virtio_input", "evdev")
INIT = b"""#!/bin/sh
/bin/busybox mount -t devtmpfs dev /dev
for m in $(/bin/busybox cat /lib/modules/order); do /bin/busybox insmod /lib/modules/$m.ko; done
n=0
while [ ! -e /dev/fb0 ] && [ $n -lt 100 ]; do /bin/busybox sleep 0.1; n=$((n+1)); done
exec /bin/clickpad
"""
# name: (QEMU display device, extra modules, extra kernel arguments, needs SeaBIOS)
SETS = {
    "virtio-gpu": ("virtio-gpu-pci", ("virtio_gpu",), "", False),
    "bochs-drm": ("VGA", ("bochs",), "", False),
    "vesafb": ("VGA", (), "vga=0x318", True),
}
TUNED_ARGS = "tsc=reliable no_timer_check cryptomgr.notests rcupdate.rcu_expedited=1"


def boot(
    kernel_path: Path, initrd: Path, device: str, kargs: str, bios: Path | None, tuned: bool
) -> float:
    machine = "q35,smbus=off,sata=off,usb=off,vmport=off" if tuned else "q35"
    argv = [
        "qemu-system-x86_64", "-M", machine, "-accel", "tcg", "-m", "512M", "-smp", "1",
        "-nodefaults", "-no-user-config", "-no-reboot", "-serial", "stdio", "-display", "none",
        "-kernel", str(kernel_path), "-initrd", str(initrd),
        "-append", f"console=ttyS0 quiet panic=-1 {kargs} {TUNED_ARGS if tuned else ''}",
        "-device", device, "-device", "virtio-tablet-pci",
    ]  # fmt: skip
    if tuned:
        argv += ["-cpu", "max"]
    if bios is not None:
        argv += ["-bios", str(bios)]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(b"ready "):
                return time.monotonic() - started
            if time.monotonic() - started > 120:
                break
        return float("nan")
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tuned", action="store_true")
    parser.add_argument("--vmlinuz", action="store_true", help="boot the compressed bzImage")
    args = parser.parse_args()
    if not shutil.which("qemu-system-x86_64"):
        sys.exit("needs qemu-system-x86_64")
    kernel = ensure_kernel(KERNEL_CACHE, package=DISPLAY_KERNEL_PACKAGE)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-display-") as tmp:
        image = kernel.vmlinuz if args.vmlinuz else ensure_vmlinux(kernel.vmlinuz, Path(tmp))
        clickpad = ensure_guest_program("clickpad", Path(tmp))
        files = {"/init": INIT, "/bin/clickpad": clickpad}
        for name, (device, modules, kargs, seabios) in SETS.items():
            if seabios and not args.vmlinuz:
                continue  # vga= is read by the bzImage's real-mode set-up, which PVH skips
            initrd = build_initramfs(Path(tmp), kernel, (*modules, *INPUT), files)
            firmwares: list[Path | None] = [None]
            if not seabios and QBOOT.is_file():
                firmwares.append(QBOOT)
            for bios in firmwares:
                times = [
                    boot(image, initrd, device, kargs, bios, args.tuned) for _ in range(args.runs)
                ]
                firmware = "qboot" if bios else "seabios"
                print(
                    f"{name:11} {firmware:8} median {statistics.median(times):5.2f}s "
                    f"(min {min(times):5.2f}s, max {max(times):5.2f}s)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
