"""A VM sandbox's QEMU monitor (QMP) from the node's side: ``Qmp`` connects to the unix socket
``QemuBackend`` gives every guest (``<runtime dir>/qmp.sock``), runs commands and closes, with
``qemu.qmp``'s errors turned into ``SandboxError``s at this edge (carrying ``sandbox_id``,
``command`` and, when QEMU itself refused the command, ``qmp_class``).

QEMU's QMP socket serves one client at a time: a second connection waits in the backlog until
the first closes, so hold a ``Qmp`` only for the commands at hand (callers that may overlap,
such as a screenshot and an input, take turns under a lock of their own).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from qemu.qmp import ConnectError, ExecuteError, QMPClient, QMPError

from ..errors import SandboxError

__all__ = ["QMP_SOCKET", "Qmp", "qmp_execute"]

#: QMP's socket in a VM sandbox's runtime directory.
QMP_SOCKET = "qmp.sock"
#: Seconds to wait for QEMU's greeting, and for a command's answer unless told otherwise.
CONNECT_TIMEOUT = 10.0
COMMAND_TIMEOUT = 60.0


class Qmp:
    """One QMP session: ``async with Qmp(rt.dir / "qmp.sock", rt.id) as qmp: await
    qmp.execute("query-status")``. ``client`` is the ``qemu.qmp.QMPClient`` underneath, for
    what this does not wrap (waiting for events, such as a migration's end)."""

    def __init__(
        self,
        socket: Path,
        sandbox_id: str | None = None,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        command_timeout: float | None = COMMAND_TIMEOUT,
    ) -> None:
        self.socket = socket
        self.sandbox_id = sandbox_id
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self.client = QMPClient(f"dsec-{sandbox_id}" if sandbox_id else "dsec")
        self._connected = False

    def _where(self) -> str:
        return f"sandbox {self.sandbox_id}" if self.sandbox_id else f"QEMU at {self.socket}"

    def _error(self, what: str, **context: Any) -> SandboxError:
        return SandboxError(f"{self._where()}: {what}", sandbox_id=self.sandbox_id, **context)

    async def connect(self) -> None:
        """Connect and negotiate; a QEMU that is gone or does not answer is a
        ``SandboxError``."""
        try:
            await asyncio.wait_for(
                self.client.connect(os.fspath(self.socket)), self.connect_timeout
            )
        except (ConnectError, OSError, TimeoutError) as e:
            await self._disconnect()
            cause = "no greeting in time" if isinstance(e, TimeoutError) else str(e)
            raise self._error(
                f"cannot reach QEMU's monitor at {self.socket}: {cause}", socket=str(self.socket)
            ) from e
        self._connected = True

    async def execute(
        self,
        command: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> Any:
        """Run ``command`` and return QEMU's answer (most are dicts). QEMU refusing it is a
        ``SandboxError`` with ``qmp_class`` (``GenericError``, ``CommandNotFound``, ...); a
        lost connection or no answer within ``timeout`` (default ``command_timeout``) one
        without."""
        if not self._connected:
            await self.connect()
        limit = self.command_timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(self.client.execute(command, arguments), limit)
        except ExecuteError as e:
            raise self._error(
                f"QEMU refused {command}: {e}", command=command, qmp_class=e.error_class
            ) from e
        except TimeoutError as e:
            raise self._error(
                f"QEMU did not answer {command} within {limit:g}s", command=command
            ) from e
        except (QMPError, OSError, EOFError) as e:
            raise self._error(
                f"QMP {command} failed: {type(e).__name__}: {e}", command=command
            ) from e

    async def close(self) -> None:
        """Disconnect (idempotent; what goes wrong on the way out is not the caller's)."""
        self._connected = False
        await self._disconnect()

    async def _disconnect(self) -> None:
        try:
            await self.client.disconnect()
        except (QMPError, OSError, EOFError):
            pass

    async def __aenter__(self) -> Qmp:
        await self.connect()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def qmp_execute(
    socket: Path,
    command: str,
    arguments: Mapping[str, Any] | None = None,
    sandbox_id: str | None = None,
    timeout: float | None = None,
) -> Any:
    """One command in a session of its own."""
    async with Qmp(socket, sandbox_id) as qmp:
        return await qmp.execute(command, arguments, timeout=timeout)
