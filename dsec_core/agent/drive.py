"""Renamed ``dsec_core.node.drive_client`` (the agent package is the in-sandbox agent alone):
this stub warns on import and goes in the next release."""

from ..node.drive_client import DRIVE_SOCKET, Drive, DriveError
from ..renamed import warn_renamed

__all__ = ["DRIVE_SOCKET", "Drive", "DriveError"]

warn_renamed(__name__, "dsec_core.node.drive_client")
