"""Renamed ``dsec_core.screen_input``: this stub warns on import and goes in the next release."""

from .renamed import warn_renamed
from .screen_input import (
    BUTTONS,
    MAX_EVENTS,
    Click,
    InputEvent,
    Key,
    Move,
    input_dicts,
    parse_input,
    parse_inputs,
)

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

warn_renamed(__name__, "dsec_core.screen_input")
