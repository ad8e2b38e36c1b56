"""Renamed ``dsec_core.read_profiles`` (it records read profiles, not CPU profiles): this stub
warns on import and goes in the next release."""

from .read_profiles import ProfiledLayer, profile_catalog
from .renamed import warn_renamed

__all__ = ["ProfiledLayer", "profile_catalog"]

warn_renamed(__name__, "dsec_core.read_profiles")
