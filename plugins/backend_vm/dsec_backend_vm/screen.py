"""A VM's screen and input over QMP: ``screendump_png`` takes a screenshot as PNG bytes, and
input requests (``{"type": "key"|"move"|"click", ...}``) are parsed into typed ``InputEvent``
records and sent as ``input-send-event`` batches.

QEMU 7.1 and later write PNG themselves (``screendump`` with ``format: png``, when built with
libpng, as Debian's 7.2 is); an older or PNG-less QEMU writes PPM, which ``ppm_to_png`` turns
into PNG here with zlib alone.
"""

from __future__ import annotations

import re
import struct
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qemu.qmp import ExecuteError, QMPClient

from dsec_core.errors import InvalidSpec

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
    "screendump_png",
    "send_input",
]

#: QEMU's absolute axes run 0..ABS_MAX whatever the screen's size.
ABS_MAX = 0x7FFF
#: QEMU's ``InputButton`` names.
BUTTONS = ("left", "middle", "right", "wheel-up", "wheel-down", "side", "extra")

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_QCODE = re.compile(r"[a-z0-9_]{1,32}")


# ---- screenshots -------------------------------------------------------------------------------


async def screendump_png(qmp: QMPClient, *, head: int | None = None) -> bytes:
    """A screenshot of the VM's display as PNG bytes (of ``head`` of a multi-head card if
    given). QEMU writes it to a file of ours; PPM is the fallback when QEMU refuses PNG."""
    with tempfile.TemporaryDirectory(prefix="dsec-screen-") as tmp:
        args: dict[str, Any] = {} if head is None else {"head": head}
        png = Path(tmp) / "screen.png"
        try:
            await qmp.execute("screendump", {"filename": str(png), "format": "png", **args})
            return png.read_bytes()
        except ExecuteError:
            pass  # no "format" before QEMU 7.1, or built without libpng
        ppm = Path(tmp) / "screen.ppm"
        await qmp.execute("screendump", {"filename": str(ppm), **args})
        return ppm_to_png(ppm.read_bytes())


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


@dataclass(frozen=True)
class Key:
    """Press and release a key, named by its QEMU ``QKeyCode`` (``a``, ``ret``, ``shift``)."""

    key: str


@dataclass(frozen=True)
class Move:
    """Move the pointer to pixel (``x``, ``y``)."""

    x: int
    y: int


@dataclass(frozen=True)
class Click:
    """Move the pointer to pixel (``x``, ``y``), then press and release ``button``."""

    x: int
    y: int
    button: str = "left"


InputEvent = Key | Move | Click

_FIELDS: dict[str, tuple[type, frozenset[str], frozenset[str]]] = {
    # type: (record, required fields, optional fields)
    "key": (Key, frozenset({"key"}), frozenset()),
    "move": (Move, frozenset({"x", "y"}), frozenset()),
    "click": (Click, frozenset({"x", "y"}), frozenset({"button"})),
}


def _coordinate(spec: Mapping[str, Any], name: str) -> int:
    value = spec[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidSpec(f"input {name} must be a non-negative integer, not {value!r}", field=name)
    return value


def parse_input(spec: Mapping[str, Any]) -> InputEvent:
    """One input request as its record. ``{"type": "key", "key": "a"}``, ``{"type": "move",
    "x": 10, "y": 20}``, ``{"type": "click", "x": 10, "y": 20, "button": "left"}`` (button
    optional). A wrong type, a missing or unknown field, a bad key name, a negative or
    non-integer coordinate or an unknown button is an ``InvalidSpec`` naming it. Whether a
    point is on the screen is known only when it is sent (``send_input``)."""
    if not isinstance(spec, Mapping):
        raise InvalidSpec(f"an input event is an object, not {type(spec).__name__}")
    kind = spec.get("type")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise InvalidSpec(
            f"input type must be one of {', '.join(_FIELDS)}, not {kind!r}", field="type"
        )
    _record, required, optional = _FIELDS[kind]
    given = set(spec) - {"type"}
    if missing := sorted(required - given):
        raise InvalidSpec(f"{kind} input needs {', '.join(missing)}", field=missing[0])
    if unknown := sorted(given - required - optional):
        raise InvalidSpec(f"{kind} input has unknown field {unknown[0]!r}", field=unknown[0])
    if kind == "key":
        key = spec["key"]
        if not isinstance(key, str) or not _QCODE.fullmatch(key):
            raise InvalidSpec(
                f"key must be a QEMU key name such as 'a', 'ret' or 'shift', not {key!r}",
                field="key",
            )
        return Key(key)
    x, y = _coordinate(spec, "x"), _coordinate(spec, "y")
    if kind == "move":
        return Move(x, y)
    button = spec.get("button", "left")
    if button not in BUTTONS:
        raise InvalidSpec(
            f"button must be one of {', '.join(BUTTONS)}, not {button!r}", field="button"
        )
    return Click(x, y, button)


def parse_inputs(specs: Sequence[Mapping[str, Any]]) -> list[InputEvent]:
    """A list of input requests as records; the first bad one is an ``InvalidSpec`` that says
    which (``index``)."""
    if not isinstance(specs, Sequence) or isinstance(specs, str | bytes):
        raise InvalidSpec("input events come as a list")
    events = []
    for i, spec in enumerate(specs):
        try:
            events.append(parse_input(spec))
        except InvalidSpec as e:
            raise InvalidSpec(f"input event {i}: {e.message}", index=i, **e.context) from e
    return events


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


async def send_input(qmp: QMPClient, event: InputEvent, screen: tuple[int, int]) -> None:
    """Send ``event`` to the VM, pointer positions scaled to ``screen`` (width, height: take it
    from a screenshot, ``png_size``). A key QEMU does not know is an ``InvalidSpec``."""
    for batch in event_batches(event, *screen):
        try:
            await qmp.execute("input-send-event", {"events": batch})
        except ExecuteError as e:
            if isinstance(event, Key):
                raise InvalidSpec(f"QEMU refused key {event.key!r}: {e}", field="key") from e
            raise
