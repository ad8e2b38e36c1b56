"""The microVM backend: ``dsec_core.vm.QemuBackend`` on a ``microvm`` machine (a trimmed q35
when layers come over virtio-pmem, which QEMU's microvm cannot hold), one vCPU per started
core of the sandbox's CPU limit, its memory limit as guest RAM.

Firecracker, where its binary is present with real KVM, is reported by ``hypervisor()`` but
not yet driven: QEMU runs every guest (dsec's ``docs/operators/runtimes.md`` says what was
measured with which).
"""

from __future__ import annotations

from dsec_core.vm.qemu import find_firecracker
from dsec_core.vm.runner import QemuBackend

__all__ = ["MicroVmBackend"]


class MicroVmBackend(QemuBackend):
    """Sandboxes as QEMU microVMs: a kernel of their own; root inside is the guest's root."""

    name = "microvm"
    machine = "microvm"
    features = QemuBackend.features  # a pid namespace in the guest, no NIC, pause to a file

    def hypervisor(self) -> str:
        """What runs the guests here: ``qemu-kvm``, ``qemu-tcg`` (Firecracker's binary, if
        any, is named but QEMU still runs them)."""
        fc = find_firecracker()
        return f"qemu-{self.accel}" + (f" (firecracker at {fc} unused)" if fc else "")
