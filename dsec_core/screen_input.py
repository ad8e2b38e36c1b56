"""Input events for a sandbox's screen (``Feature.SCREEN``): typed ``Key``, ``Move`` and
``Click`` records and ``parse_inputs``, which turns the API's ``{"type": ...}`` objects into
them (``InvalidSpec`` naming the bad event and field). The node, the SDK and the VM backend all
read input through here; how a backend delivers an event (QMP for a VM) is its own business.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidSpec

__all__ = [
    "BUTTONS",
    "MAX_EVENTS",
    "Click",
    "InputEvent",
    "Key",
    "Move",
    "input_dicts",
    "parse_input",
    "parse_inputs",
]

#: Pointer buttons (QEMU's ``InputButton`` names).
BUTTONS = ("left", "middle", "right", "wheel-up", "wheel-down", "side", "extra")
#: At most this many events in one request.
MAX_EVENTS = 1024

_QCODE = re.compile(r"[a-z0-9_]{1,32}")


@dataclass(frozen=True)
class Key:
    """Press and release a key, named by its QEMU ``QKeyCode`` (``a``, ``ret``, ``shift``)."""

    key: str

    def to_dict(self) -> dict[str, Any]:
        return {"type": "key", "key": self.key}


@dataclass(frozen=True)
class Move:
    """Move the pointer to pixel (``x``, ``y``)."""

    x: int
    y: int

    def to_dict(self) -> dict[str, Any]:
        return {"type": "move", "x": self.x, "y": self.y}


@dataclass(frozen=True)
class Click:
    """Move the pointer to pixel (``x``, ``y``), then press and release ``button``."""

    x: int
    y: int
    button: str = "left"

    def to_dict(self) -> dict[str, Any]:
        return {"type": "click", "x": self.x, "y": self.y, "button": self.button}


InputEvent = Key | Move | Click

_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # type: (required fields, optional fields)
    "key": (frozenset({"key"}), frozenset()),
    "move": (frozenset({"x", "y"}), frozenset()),
    "click": (frozenset({"x", "y"}), frozenset({"button"})),
}


def _coordinate(spec: Mapping[str, Any], name: str) -> int:
    value = spec[name]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 16:
        raise InvalidSpec(
            f"input {name} must be an integer from 0 to 65535, not {value!r}", field=name
        )
    return value


def parse_input(spec: Mapping[str, Any] | InputEvent) -> InputEvent:
    """One input request as its record (a record is checked and returned as it is).
    ``{"type": "key", "key": "a"}``, ``{"type": "move", "x": 10, "y": 20}``, ``{"type":
    "click", "x": 10, "y": 20, "button": "left"}`` (button optional). A wrong type, a missing or
    unknown field, a bad key name, a negative or non-integer coordinate or an unknown button is
    an ``InvalidSpec`` naming it. Whether a point is on the screen is known only when the event
    is sent."""
    if isinstance(spec, Key | Move | Click):
        spec = spec.to_dict()
    if not isinstance(spec, Mapping):
        raise InvalidSpec(f"an input event is an object, not {type(spec).__name__}")
    kind = spec.get("type")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise InvalidSpec(
            f"input type must be one of {', '.join(_FIELDS)}, not {kind!r}", field="type"
        )
    required, optional = _FIELDS[kind]
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


def parse_inputs(specs: Sequence[Mapping[str, Any] | InputEvent]) -> list[InputEvent]:
    """A list of input requests as records; the first bad one is an ``InvalidSpec`` that says
    which (``index``)."""
    if not isinstance(specs, Sequence) or isinstance(specs, str | bytes):
        raise InvalidSpec("input events come as a list", field="events")
    if not specs or len(specs) > MAX_EVENTS:
        raise InvalidSpec(f"send 1 to {MAX_EVENTS} input events, not {len(specs)}", field="events")
    events = []
    for i, spec in enumerate(specs):
        try:
            events.append(parse_input(spec))
        except InvalidSpec as e:
            raise InvalidSpec(f"input event {i}: {e.message}", index=i, **e.context) from e
    return events


def input_dicts(events: Sequence[Mapping[str, Any] | InputEvent]) -> list[dict[str, Any]]:
    """``events`` checked and in their wire form (what the SDK sends)."""
    return [e.to_dict() for e in parse_inputs(events)]
