"""The drive socket: how a loop in an agent sandbox drives its worker sandboxes through the node.

An agent sandbox is created with ``SandboxSpec.drives`` (the worker ids it may drive). The node
serves one unix socket, ``<run_dir>/drive/drive.sock``, and passes its directory into such
sandboxes at ``/.dsec/drive`` (``DRIVE_SOCKET`` inside; a directory, so a restarted daemon's new
socket shows through). It tells callers apart by the kernel's peer credentials
(``SO_PEERCRED``): every sandbox has a host uid range of its own, so a connection is the
sandbox whose range holds the peer's uid, and it reaches only the workers that sandbox's spec
names (any other id is ``UnknownSandbox``, whether it exists or not). The host's own processes
and sandboxes that drive nothing are refused.

Protocol: one JSON object per line each way, any number per connection, answered in order.

    {"op": "exec", "sandbox": ID, "cmd": STR|[ARGV], "step": K?, and the other fields of the
     API's exec body (timeout, cwd, env, stdin, ...)}  -> {"result": ExecResult}
    {"op": "workers"}                               -> {"result": [ID, ...]}
    {"op": "trajectory"}                            -> {"result": [TrajectoryEntry, ...]}
    anything wrong                                  -> {"error": {"type", "message"}}

Every exec goes to the driving sandbox's trajectory log (``SandboxSpec.trajectory``, default
its id) at ``step`` (default: the next): a loop that restarts gets what it already ran from the
log. ``ExecResult`` and entries are in the API's JSON shapes (bytes in base64). Shells use the
agent's bridge, ``/.dsec/agent drive`` (stdin to the socket, the socket to stdout); Python
loops can use ``drive_client.py`` beside this file (standard library only, to copy into a
sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Any

from ..api.messages import ExecRequest
from ..api.routes import dump_json
from ..api.shapes import decoder, encoder
from ..backend import DRIVE_DIR
from ..errors import DsecError, InvalidSpec, UnknownSandbox
from ..records import ExecResult, TrajectoryEntry
from .host import DriveHost
from .sandbox import Sandbox

__all__ = ["DRIVE_SOCKET", "SOCKET_NAME", "DriveServer"]

#: The socket's name in its directory, on the host and inside (``DRIVE_DIR``).
SOCKET_NAME = "drive.sock"
#: The drive socket inside a sandbox that drives others.
DRIVE_SOCKET = f"{DRIVE_DIR}/{SOCKET_NAME}"
#: The longest request line read (an exec's stdin travels in it).
MAX_LINE = 32 << 20

log = logging.getLogger("dsec.drive")

_result = encoder(ExecResult)
_entries = encoder(list[TrajectoryEntry])
_exec_request = decoder(ExecRequest)  # the API's own checks of an exec body
assert _result is not None and _entries is not None


class DriveServer:
    """The node's drive socket in ``directory`` (``drive.sock``), serving ``host``'s
    sandboxes."""

    def __init__(self, host: DriveHost, directory: Path) -> None:
        self.host = host
        self.directory = directory
        self.socket_path = directory / SOCKET_NAME
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.directory.mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.directory, 0o755)  # sandbox uids pass it; only root writes in it
        self.socket_path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(
            self._serve, path=os.fspath(self.socket_path), limit=MAX_LINE
        )
        os.chmod(self.socket_path, 0o666)  # connect(2) needs write; the peer's uid decides

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    def _driver(self, sock: socket.socket) -> Sandbox | None:
        """The running sandbox that holds the peer's uid and drives others, or None."""
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", raw)
        for sb in self.host.sandboxes.values():
            m = sb.rt.idmap
            if m.host_base <= uid < m.host_base + m.size:
                return sb if sb.rt.spec.drives and sb.status == "running" else None
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            driver = self._driver(sock)
            if driver is None:
                writer.write(_error(InvalidSpec("this socket serves sandboxes that drive others")))
                await writer.drain()
                return
            while line := await reader.readline():
                if not line.endswith(b"\n") and len(line) >= MAX_LINE:
                    writer.write(_error(InvalidSpec(f"request line over {MAX_LINE} bytes")))
                    break
                writer.write(await self._answer(driver, line))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except ValueError:  # a line over the reader's limit
            with contextlib.suppress(Exception):
                writer.write(_error(InvalidSpec(f"request line over {MAX_LINE} bytes")))
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _answer(self, driver: Sandbox, line: bytes) -> bytes:
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise InvalidSpec("a request is a JSON object")
            return dump_json({"result": await self._do(driver, req)}) + b"\n"
        except DsecError as e:
            return _error(e)
        except (ValueError, TypeError) as e:
            return _error(InvalidSpec(f"bad request: {e}"))

    async def _do(self, driver: Sandbox, req: dict[str, Any]) -> Any:
        op = req.get("op")
        spec = driver.rt.spec
        trajectory = spec.trajectory or driver.rt.id
        if op == "workers":
            return list(spec.drives)
        if op == "trajectory":
            return _entries(self.host.trajectories.entries(trajectory))  # type: ignore[misc]
        if op != "exec":
            raise InvalidSpec(f"unknown op {op!r}: exec, workers or trajectory", field="op")
        target = req.get("sandbox")
        if not isinstance(target, str) or target not in spec.drives:
            raise UnknownSandbox(
                f"no sandbox {target!r} among those sandbox {driver.rt.id} drives",
                sandbox_id=target if isinstance(target, str) else "",
            )
        body = _exec_request({k: v for k, v in req.items() if k not in ("op", "sandbox")}, "exec")
        if body.trajectory is not None:
            raise InvalidSpec("a driver's commands go to its own trajectory", field="trajectory")
        await self._unpaused(target)
        result = await self.host.exec(
            target,
            body.cmd,
            timeout=body.timeout,
            cwd=body.cwd,
            env=body.env,
            stdin=body.stdin,
            max_output=body.max_output,
            background=body.background,
            exclusive=body.exclusive,
            trajectory=trajectory,
            step=body.step,
        )
        return _result(result)  # type: ignore[misc]

    async def _unpaused(self, sid: str) -> None:
        """Wait while worker ``sid`` is paused (its lease lapsed and the loop's command slipped
        in meanwhile): the command runs when the worker is resumed, as the loop's own would."""
        while (sb := self.host.sandboxes.get(sid)) is not None and sb.paused:
            await asyncio.sleep(0.05)


def _error(e: DsecError) -> bytes:
    return dump_json({"error": {"type": type(e).__name__, "message": str(e)}}) + b"\n"
