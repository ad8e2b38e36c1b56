"""Helpers for the real servers tests start on loopback: a free port, and a clean stop."""

from __future__ import annotations

import socket
import subprocess

__all__ = ["free_port", "stop_process"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing was listening on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
