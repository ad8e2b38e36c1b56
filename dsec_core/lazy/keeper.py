"""Renamed ``dsec_core.lazy.fuse_keeper``: this stub warns on import and goes in the next
release. A keeper that a daemon of the last release started (``python -m dsec_core.lazy.keeper``)
runs the code it loaded, and a new daemon adopts it over the same socket."""

from ..renamed import warn_renamed
from .fuse_keeper import ask_keeper, dismiss_keeper, main, take_from_keeper

__all__ = ["ask_keeper", "dismiss_keeper", "main", "take_from_keeper"]

warn_renamed(__name__, "dsec_core.lazy.fuse_keeper")
