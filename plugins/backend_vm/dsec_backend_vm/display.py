"""What gives a VM guest a screen and input: the Debian kernel package, the QEMU devices and the
kernel modules that turn them into ``/dev/fb0`` and ``/dev/input/event*``.

Debian's cloud kernel (``linux-image-cloud-amd64``) has no DRM and no VESA framebuffer, so it
shows nothing on q35; the generic ``linux-image-amd64`` has both (``DRM_VIRTIO_GPU``,
``DRM_BOCHS`` with ``DRM_FBDEV_EMULATION``, ``FB_VESA``, all ``VIRTIO_INPUT``/``INPUT_EVDEV`` as
modules). Measured under TCG on a 2-core host, q35 with 512 MiB, boot to a drawn framebuffer
(kernel command line to ``ready``) took about 6 s for each of: virtio-gpu, bochs-drm (``-device
VGA``) and vesafb (``-device VGA`` with ``vga=0x318``, no display modules); most of it is before
the kernel runs. virtio-gpu under qboot was the quickest (5.9 s against 6.1 s for bochs-drm
under qboot and 6.4 s for vesafb under SeaBIOS); vesafb needs SeaBIOS's VGA BIOS and shows
nothing under qboot. The pointer is a virtio tablet (absolute, so a click lands on the pixel
asked for); keys go to q35's own PS/2 keyboard (i8042 and atkbd are built into the kernel), so
no keyboard device or module is added.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "DISPLAY_KERNEL_PACKAGE",
    "DISPLAY_MODULES",
    "QBOOT",
    "display_qemu_args",
]

#: The Debian kernel package with DRM and virtio input (see the module's docstring).
DISPLAY_KERNEL_PACKAGE = "linux-image-amd64"

#: The modules to load for the display and input devices of ``display_qemu_args``; pass them
#: to ``dsec_core.vm.guest.module_closure``/``build_initramfs`` for the load order (drm,
#: drm_kms_helper, virtio_ring, virtio, drm_shmem_helper, virtio_dma_buf, virtio_gpu,
#: virtio_pci_modern_dev, virtio_pci_legacy_dev, virtio_pci, virtio_input, evdev with
#: linux-image-amd64 6.1).
DISPLAY_MODULES = ("virtio_pci", "virtio_gpu", "virtio_input", "evdev")

#: qboot: a minimal firmware that boots ``-kernel`` on q35 quicker than SeaBIOS; it runs no
#: VGA BIOS, which virtio-gpu does not need.
QBOOT = Path("/usr/share/qemu/qboot.rom")


def display_qemu_args(vnc_display: int | None = None) -> list[str]:
    """QEMU arguments for the display and input devices, the firmware and, if ``vnc_display``
    is given, a VNC server on loopback at TCP port 5900 + ``vnc_display``.

    QEMU is to be started with ``-nodefaults`` (or ``-vga none``): q35 otherwise adds a
    standard VGA as well, and ``screendump`` shows that card's text console instead.
    """
    args = ["-device", "virtio-gpu-pci", "-device", "virtio-tablet-pci"]
    args += ["-display", "none"]
    if QBOOT.is_file():
        args += ["-bios", str(QBOOT)]
    if vnc_display is not None:
        args += ["-vnc", f"127.0.0.1:{int(vnc_display)}"]
    return args
