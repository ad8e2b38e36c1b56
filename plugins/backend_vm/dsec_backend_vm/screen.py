"""A VM's screen and input over QMP: ``screendump_png`` takes a screenshot as PNG bytes, and
typed input events (``dsec_core.screen_input``: key, move, click) are sent as ``input-send-event``
batches.

QEMU 7.1 and later write PNG themselves (``screendump`` with ``format: png``, when built with
libpng, as Debian's 7.2 is); an older or PNG-less QEMU writes PPM, which ``ppm_to_png`` turns
into PNG here with zlib alone.
"""

from __future__ import annotations

import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any, Protocol

from qemu.qmp import ExecuteError

from dsec_core.errors import InvalidSpec, SandboxError
from dsec_core.screen_input import BUTTONS, Click, InputEvent, Key, Move, parse_input, parse_inputs

__all__ = [
    "ABS_MAX",
    "BUTTONS",
    "Click",
    "InputEvent",
    "Key",
    "Move",
    "abs_move_events",
    "button_event",
    "event_batches",
    "key_event",
    "parse_input",
    "parse_inputs",
    "png_size",
    "ppm_to_png",
    "screen_size",
    "screendump_png",
    "send_input",
]

#: QEMU's absolute axes run 0..ABS_MAX whatever the screen's size.
ABS_MAX = 0x7FFF

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Executes(Protocol):
    """What the helpers here talk to: a ``qemu.qmp.QMPClient`` or ``dsec_core.vm.qmp.Qmp``."""

    async def execute(self, cmd: str, arguments: dict[str, Any] | None = None) -> Any: ...


def _refused(e: Exception) -> bool:
    """Whether ``e`` is QEMU refusing a command (not the connection failing): a
    ``qemu.qmp.ExecuteError`` from a bare client, a ``SandboxError`` with ``qmp_class`` from
    ``dsec_core.vm.qmp``."""
    return isinstance(e, ExecuteError) or (isinstance(e, SandboxError) and "qmp_class" in e.context)


# ---- screenshots -------------------------------------------------------------------------------


async def screendump_png(qmp: Executes, *, head: int | None = None) -> bytes:
    """A screenshot of the VM's display as PNG bytes (of ``head`` of a multi-head card if
    given). QEMU writes it to a file of ours; PPM is the fallback when QEMU refuses PNG."""
    with tempfile.TemporaryDirectory(prefix="dsec-screen-") as tmp:
        args: dict[str, Any] = {} if head is None else {"head": head}
        png = Path(tmp) / "screen.png"
        try:
            await qmp.execute("screendump", {"filename": str(png), "format": "png", **args})
            return png.read_bytes()
        except (ExecuteError, SandboxError) as e:
            if not _refused(e):  # the connection failed, not the format
                raise
            # QEMU refused "format" (before 7.1, or built without libpng): PPM below
        ppm = Path(tmp) / "screen.ppm"
        await qmp.execute("screendump", {"filename": str(ppm), **args})
        return ppm_to_png(ppm.read_bytes())


async def screen_size(qmp: Executes, *, head: int | None = None) -> tuple[int, int]:
    """``(width, height)`` of the VM's display now: QMP reports no mode, so this reads the
    header of an uncompressed PPM screendump (cheaper than a PNG's compression)."""
    with tempfile.TemporaryDirectory(prefix="dsec-screen-") as tmp:
        ppm = Path(tmp) / "screen.ppm"
        args: dict[str, Any] = {} if head is None else {"head": head}
        await qmp.execute("screendump", {"filename": str(ppm), **args})
        with open(ppm, "rb") as f:
            width, height, _, _ = _ppm_header(f.read(256))
        return width, height


def _ppm_header(data: bytes) -> tuple[int, int, int, int]:
    """``(width, height, maxval, offset of the pixels)`` of a binary PPM; comments allowed."""
    fields: list[bytes] = []
    pos = 0
    while len(fields) < 4:
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":
            end = data.find(b"\n", pos)
            pos = len(data) if end < 0 else end + 1
            continue
        start = pos
        while pos < len(data) and not data[pos : pos + 1].isspace() and data[pos] != ord("#"):
            pos += 1
        if start == pos:
            raise InvalidSpec("PPM header is cut short")
        fields.append(data[start:pos])
    if fields[0] != b"P6":
        raise InvalidSpec(f"not a binary PPM (P6): magic {fields[0][:8]!r}")
    try:
        width, height, maxval = (int(f) for f in fields[1:])
    except ValueError as e:
        raise InvalidSpec(f"PPM header has a non-number: {e}") from e
    return width, height, maxval, pos + 1  # one whitespace byte ends the header


def _chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(kind + body) & 0xFFFFFFFF
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def ppm_to_png(ppm: bytes) -> bytes:
    """A binary PPM (P6, maxval 255, as QEMU writes) as an 8-bit RGB PNG, rows unfiltered.

    A malformed PPM is an ``InvalidSpec``."""
    width, height, maxval, offset = _ppm_header(ppm)
    if maxval != 255:
        raise InvalidSpec(f"PPM maxval {maxval} is not handled (only 255)")
    if width <= 0 or height <= 0:
        raise InvalidSpec(f"PPM of {width}x{height} pixels")
    stride = width * 3
    pixels = ppm[offset : offset + stride * height]
    if len(pixels) != stride * height:
        raise InvalidSpec(f"PPM of {width}x{height} has {len(pixels)} pixel bytes")
    # each row starts with its filter type, 0 (none)
    raw = b"".join(b"\0" + pixels[y * stride : (y + 1) * stride] for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        _PNG_SIGNATURE
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw, 6))
        + _chunk(b"IEND", b"")
    )


def png_size(png: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's header; not a PNG is an ``InvalidSpec``."""
    if len(png) < 24 or not png.startswith(_PNG_SIGNATURE) or png[12:16] != b"IHDR":
        raise InvalidSpec("not a PNG image")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


# ---- input -------------------------------------------------------------------------------------


def key_event(qcode: str, down: bool) -> dict[str, Any]:
    """An ``input-send-event`` key event for QEMU key name ``qcode``."""
    return {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": qcode}}}


def button_event(button: str, down: bool) -> dict[str, Any]:
    """An ``input-send-event`` button event (``button`` one of ``BUTTONS``)."""
    return {"type": "btn", "data": {"down": down, "button": button}}


def _abs_value(pixel: int, size: int) -> int:
    # the middle of the pixel's share of 0..ABS_MAX+1, so the guest's floor(value * size /
    # (ABS_MAX + 1)) gives the pixel back
    return min(ABS_MAX, ((2 * pixel + 1) * (ABS_MAX + 1)) // (2 * size))


def abs_move_events(x: int, y: int, width: int, height: int) -> list[dict[str, Any]]:
    """``input-send-event`` events that put an absolute pointer on pixel (``x``, ``y``) of a
    ``width`` x ``height`` screen. A point off the screen is an ``InvalidSpec``."""
    if not (0 <= x < width and 0 <= y < height):
        raise InvalidSpec(f"point ({x}, {y}) is off the {width}x{height} screen", x=x, y=y)
    return [
        {"type": "abs", "data": {"axis": "x", "value": _abs_value(x, width)}},
        {"type": "abs", "data": {"axis": "y", "value": _abs_value(y, height)}},
    ]


def event_batches(event: InputEvent, width: int, height: int) -> list[list[dict[str, Any]]]:
    """``event`` as the ``input-send-event`` calls to make, in order. Press and release go in
    separate calls: QEMU ends each call with one sync, and a guest that reads state at the sync
    (as evdev clients do) would see a press and release in one report as no press at all."""
    match event:
        case Key(key):
            return [[key_event(key, True)], [key_event(key, False)]]
        case Move(x, y):
            return [abs_move_events(x, y, width, height)]
        case Click(x, y, button):
            move = abs_move_events(x, y, width, height)
            return [[*move, button_event(button, True)], [button_event(button, False)]]
    raise TypeError(f"not an input event: {event!r}")


async def send_input(qmp: Executes, event: InputEvent, screen: tuple[int, int]) -> None:
    """Send ``event`` to the VM, pointer positions scaled to ``screen`` (width, height: take it
    from a screenshot, ``png_size``). A key QEMU does not know is an ``InvalidSpec``."""
    for batch in event_batches(event, *screen):
        try:
            await qmp.execute("input-send-event", {"events": batch})
        except (ExecuteError, SandboxError) as e:
            if isinstance(event, Key) and _refused(e):
                raise InvalidSpec(f"QEMU refused key {event.key!r}: {e}", field="key") from e
            raise
