"""The screen of a sandbox (``Feature.SCREEN``: a VM's display): a screenshot, and key presses,
pointer moves and clicks sent to it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..backend import Feature
from ..errors import FeatureUnavailable, SandboxPaused
from ..screen_input import InputEvent, parse_inputs
from .host import SandboxHost
from .sandbox import Sandbox

__all__ = ["Screens"]


class Screens:
    """The screens of ``host``'s sandboxes."""

    def __init__(self, host: SandboxHost) -> None:
        self.host = host

    def sandbox(self, sid: str) -> Sandbox:
        """A running, unpaused sandbox whose backend has a screen."""
        sb = self.host.sandbox(sid)
        if sb.status != "running":
            raise sb.not_running()
        if sb.paused:
            raise SandboxPaused(f"sandbox {sid} is paused; resume it first", sandbox_id=sid)
        if Feature.SCREEN not in sb.backend.features:
            raise FeatureUnavailable(
                f"sandbox {sid} has no screen: backend {sb.backend.name!r} does not claim "
                f"Feature.SCREEN (the 'vm' backend does)",
                sandbox_id=sid,
                backend=sb.backend.name,
                feature=Feature.SCREEN.value,
            )
        return sb

    async def screenshot(self, sid: str) -> bytes:
        """The sandbox's display now, as PNG bytes."""
        sb = self.sandbox(sid)
        return await sb.backend.screenshot(sb.rt, sb.backend_state)

    async def input(self, sid: str, events: Sequence[Mapping[str, Any] | InputEvent]) -> int:
        """Send key presses, pointer moves and clicks to the sandbox's display, in order
        (``dsec_core.screen_input``: a bad event is ``InvalidSpec`` before any is sent); returns how
        many were sent."""
        checked = parse_inputs(events)
        sb = self.sandbox(sid)
        await sb.backend.input(sb.rt, sb.backend_state, checked)
        return len(checked)
