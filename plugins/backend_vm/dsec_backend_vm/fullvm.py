"""The full-VM backend (``vm``): ``dsec_core.vm.runner.QemuBackend`` on a q35 machine with a
screen. The guest boots Debian's generic kernel (DRM, virtio input: ``display``) with a
virtio-gpu card and a virtio tablet; what draws on the screen comes from the sandbox's layers
(a program the caller starts with ``exec``), so a catalog image with a display program is all
a GUI task needs. The node reads the screen (``screenshot``: QMP ``screendump`` as PNG) and
drives it (``input``: QMP ``input-send-event``), both through ``dsec_core.vm.qmp``.

``DSEC_VM_VNC=1`` also serves each sandbox's screen over VNC on the node's loopback, on a free
display number (port 5901 and up), reported as ``SandboxInfo.vnc``; off by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from dsec_core.backend import Feature, SandboxRuntime
from dsec_core.config import NodeConfig
from dsec_core.errors import BackendUnavailable
from dsec_core.screen_input import InputEvent, Key
from dsec_core.vm.qmp import QMP_SOCKET, Qmp
from dsec_core.vm.runner import QemuBackend

from .display import DISPLAY_KERNEL_PACKAGE, DISPLAY_MODULES
from .screen import screen_size, screendump_png, send_input

__all__ = ["VNC_DISPLAYS", "FullVmBackend"]

#: The VNC display numbers sandboxes may take (TCP port 5900 + n, loopback only).
VNC_DISPLAYS = range(1, 100)


class FullVmBackend(QemuBackend):
    """Sandboxes as full VMs with a screen: a kernel of their own, a framebuffer and input."""

    name = "vm"
    machine = "q35"
    display = True
    kernel_package = DISPLAY_KERNEL_PACKAGE
    extra_modules = DISPLAY_MODULES
    features = QemuBackend.features | {Feature.SCREEN}

    def __init__(self, config: NodeConfig) -> None:
        super().__init__(config)
        vnc = os.environ.get("DSEC_VM_VNC", "0")
        if vnc not in ("0", "1"):
            raise BackendUnavailable(f"DSEC_VM_VNC={vnc!r}: say 0 or 1", backend=self.name)
        self.vnc = vnc == "1"
        # QMP serves one client at a time: a sandbox's screen calls take turns
        self._qmp_locks: dict[str, asyncio.Lock] = {}
        self._vnc_taken: set[int] = set()
        self._vnc_lock = threading.Lock()  # vm_config runs in worker threads

    # --- VNC -------------------------------------------------------------------------------
    def vnc_display(self, rt: SandboxRuntime) -> int | None:
        """With ``DSEC_VM_VNC=1``, a display number whose port is free on loopback now (QEMU
        binds it a moment later; one this backend handed out is not handed out again until
        its sandbox stops)."""
        if not self.vnc:
            return None
        with self._vnc_lock:
            for n in VNC_DISPLAYS:
                if n in self._vnc_taken:
                    continue
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", 5900 + n))
                    except OSError:
                        continue
                self._vnc_taken.add(n)
                return n
        raise BackendUnavailable(
            f"no free VNC display on loopback (ports {5900 + VNC_DISPLAYS[0]}-"
            f"{5900 + VNC_DISPLAYS[-1]})",
            backend=self.name,
        )

    async def stop(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        await super().stop(rt, state)
        self._qmp_locks.pop(rt.id, None)
        vnc = state.get("vnc")
        if isinstance(vnc, str):
            with self._vnc_lock:
                self._vnc_taken.discard(int(vnc.rsplit(":", 1)[1]) - 5900)

    # --- the screen ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _qmp(self, rt: SandboxRuntime) -> AsyncIterator[Qmp]:
        lock = self._qmp_locks.setdefault(rt.id, asyncio.Lock())
        async with lock, Qmp(rt.dir / QMP_SOCKET, rt.id) as qmp:
            yield qmp

    async def screenshot(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bytes:
        async with self._qmp(rt) as qmp:
            return await screendump_png(qmp)

    async def input(
        self, rt: SandboxRuntime, state: Mapping[str, Any], events: list[InputEvent]
    ) -> None:
        """Pointer positions are scaled to the screen's size as it is now (asked once per
        call, only if a pointer event is in it)."""
        async with self._qmp(rt) as qmp:
            size: tuple[int, int] | None = None
            for event in events:
                if size is None and not isinstance(event, Key):
                    size = await screen_size(qmp)
                await send_input(qmp, event, size or (1, 1))
