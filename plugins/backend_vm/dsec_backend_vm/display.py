"""What gives a VM guest a screen and input: the Debian kernel package, the QEMU devices and the
kernel modules that turn them into ``/dev/fb0`` and ``/dev/input/event*``.

Debian's cloud kernel (``linux-image-cloud-amd64``) has no DRM and no VESA framebuffer, so it
shows nothing on q35; the generic ``linux-image-amd64`` has both (``DRM_VIRTIO_GPU``,
``DRM_BOCHS`` with ``DRM_FBDEV_EMULATION``, ``FB_VESA``; ``VIRTIO_INPUT`` and ``INPUT_EVDEV``
as modules).

Measured under TCG on a 2-core host (q35, 512 MiB, ``bench/display_boot.py``), QEMU's start to
clickpad's first frame: virtio-gpu 2.6 s, bochs-drm (``-device VGA``) 2.8 s, booting the
uncompressed ``vmlinux`` through PVH (``dsec_core.vm.vmlinux``); with the bzImage as shipped
every set takes 6-7 s, as the guest spends 3.5 s decompressing it. The firmware (SeaBIOS or
qboot) makes no measurable difference once PVH skips the bzImage's loader. vesafb (``vga=`` with
SeaBIOS's VGA BIOS, no display modules, 6.2 s) needs the bzImage's real-mode set-up, so it
cannot take the PVH path. virtio-gpu is the choice: quickest, and it needs no VGA BIOS.

The pointer is a virtio tablet (absolute, so a click lands on the pixel asked for); keys go to
q35's own PS/2 keyboard (i8042 and atkbd are built into the kernel), so no keyboard device or
module is added.
"""

from __future__ import annotations

__all__ = ["DISPLAY_KERNEL_PACKAGE", "DISPLAY_MODULES", "display_qemu_args"]

#: The Debian kernel package with DRM and virtio input (see the module's docstring).
DISPLAY_KERNEL_PACKAGE = "linux-image-amd64"

#: The modules to load for the display and input devices of ``display_qemu_args``; pass them
#: to ``dsec_core.vm.guest.module_closure``/``build_initramfs`` for the load order (drm,
#: drm_kms_helper, virtio_ring, virtio, drm_shmem_helper, virtio_dma_buf, virtio_gpu,
#: virtio_pci_modern_dev, virtio_pci_legacy_dev, virtio_pci, virtio_input, evdev with
#: linux-image-amd64 6.1).
DISPLAY_MODULES = ("virtio_pci", "virtio_gpu", "virtio_input", "evdev")


def display_qemu_args(vnc_display: int | None = None) -> list[str]:
    """QEMU arguments for the display and input devices and, if ``vnc_display`` is given, a
    VNC server on loopback at TCP port 5900 + ``vnc_display``. The firmware is the launcher's
    choice: virtio-gpu works under SeaBIOS and under qboot.

    QEMU is to be started with ``-nodefaults`` (or ``-vga none``): q35 otherwise adds a
    standard VGA as well, and ``screendump`` shows that card's text console instead.
    """
    args = ["-device", "virtio-gpu-pci", "-device", "virtio-tablet-pci", "-display", "none"]
    if vnc_display is not None:
        args += ["-vnc", f"127.0.0.1:{int(vnc_display)}"]
    return args
