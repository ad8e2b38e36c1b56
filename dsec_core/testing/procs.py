"""Helpers for the real servers tests start on loopback: a free port, and a clean stop. They are
``dsec_core.linux.processes``'s, here so that the kit's users find them with its fixtures."""

from __future__ import annotations

from ..linux.processes import free_port, pids_matching, stop_process

__all__ = ["free_port", "pids_matching", "stop_process"]
