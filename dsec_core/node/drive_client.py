"""The drive client: a loop's client for the drive socket, for Python inside an agent sandbox
(standard library only: copy this file into the sandbox, ``dsec.rl.drive_client_source()`` gives
its text, and import it there as ``drive``).

    from drive import Drive
    d = Drive()
    worker = d.workers()[0]
    r = d.exec(worker, "make test")  # {"exit_code": 0, "stdout": "...", "replayed": False}

Steps are numbered from 0 by the client, one per exec. A loop that restarts makes a new
``Drive`` and runs its commands again from the first: those the trajectory log holds come back
from it (``replayed`` true) without running, and the loop goes on from where it stopped. The node
side and the protocol: ``dsec_core/node/drive.py`` (``DriveServer``).
"""

from __future__ import annotations

import base64
import json
import socket
from typing import Any

__all__ = ["DRIVE_SOCKET", "Drive", "DriveError"]

DRIVE_SOCKET = "/.dsec/drive/drive.sock"


class DriveError(Exception):
    """The node refused a request: ``type`` is the dsec error's name (``UnknownSandbox``,
    ``TrajectoryDiverged``, ``SandboxPaused``, ...)."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(f"{type_}: {message}")
        self.type = type_


class Drive:
    """One connection to the drive socket; ``step`` is the next exec's step."""

    def __init__(self, path: str = DRIVE_SOCKET, step: int = 0) -> None:
        self.step = step
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._file = self._sock.makefile("rb")

    def _call(self, request: dict[str, Any]) -> Any:
        self._sock.sendall(json.dumps(request).encode() + b"\n")
        line = self._file.readline()
        if not line:
            raise DriveError("NodeUnavailable", "the node closed the drive socket")
        answer = json.loads(line)
        if "error" in answer:
            raise DriveError(answer["error"]["type"], answer["error"]["message"])
        return answer["result"]

    def workers(self) -> list[str]:
        """The sandbox ids this sandbox may drive."""
        return self._call({"op": "workers"})

    def exec(self, sandbox: str, cmd: str | list[str], timeout: float | None = None) -> dict:
        """Run ``cmd`` in worker ``sandbox`` as the next step; its result, with stdout and
        stderr decoded as UTF-8."""
        result = self._call(
            {"op": "exec", "sandbox": sandbox, "cmd": cmd, "timeout": timeout, "step": self.step}
        )
        self.step += 1
        for stream in ("stdout", "stderr"):
            result[stream] = base64.b64decode(result[stream]).decode("utf-8", "replace")
        return result

    def trajectory(self) -> list[dict]:
        """What this sandbox's trajectory log holds, step by step."""
        return self._call({"op": "trajectory"})

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> Drive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
