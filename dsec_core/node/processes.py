"""Interactive processes: commands that run on between clients (``process_start``).

A process is one agent connection held by the node (``AgentClient.exec_interactive``): the
agent kills the command when that connection closes, so the node holds it until the command
ends, is signalled to death, or the sandbox dies; no client's stream is its lifeline. A pump
task reads its output as it comes into a backlog and hands each piece to every attached
stream (``output``), so any number of clients watch it, attach late (from the backlog's start
or from now) and go away without harm. Until a first stream attaches from the start, the
backlog keeps the newest ``UNREAD`` bytes, so the client that starts a command and then asks
for its output gets all of it however much the command wrote in between; from then on, the
newest ``BACKLOG`` bytes. Input, terminal resizes
and signals go to the agent on the same connection.

A process that ended stays listed (``running`` false, its backlog and result kept) for
``LINGER`` seconds, or until a stream that attached from the start has read its end, so a
client that starts a short command and then attaches still gets all of it. A sandbox holds
at most ``MAX_PROCESSES`` at once. Killing the sandbox closes its processes' connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal as signals
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

from ..agent.rpc import AgentProcess
from ..errors import AdmissionRejected, DsecError, InvalidSpec, NotFound, SandboxNotRunning
from ..records import ExecResult, ProcessInfo
from .agents import Agents

__all__ = ["BACKLOG", "LINGER", "MAX_PROCESSES", "UNREAD", "Processes", "signal_number"]

#: How much of a process's output is kept for streams that attach later (the newest bytes).
BACKLOG = 1 << 20
#: How much is kept before anyone has read the output from its start (the newest bytes).
UNREAD = 16 << 20
#: How long an ended process stays listed with its backlog and result.
LINGER = 30.0
#: The most processes (running or lingering) one sandbox holds.
MAX_PROCESSES = 256
#: A stream more than this many bytes behind the output is cut off (it raises).
MAX_BEHIND = 16 << 20
#: Each piece of output is at most this many bytes (the agent's read size is smaller).
PIECE = 1 << 20


def signal_number(signal: str | int) -> int:
    """A signal's number from its name (``KILL``, ``SIGKILL``) or number; ``InvalidSpec``
    otherwise."""
    if isinstance(signal, int) and not isinstance(signal, bool):
        number = signal
    elif isinstance(signal, str) and signal.isdigit():
        number = int(signal)
    elif isinstance(signal, str):
        name = signal.upper()
        member = getattr(signals.Signals, name if name.startswith("SIG") else "SIG" + name, None)
        if member is None:
            raise InvalidSpec(f"unknown signal {signal!r}", field="signal")
        number = int(member)
    else:
        raise InvalidSpec(f"a signal is a name or a number, got {signal!r}", field="signal")
    if not 1 <= number <= 64:
        raise InvalidSpec(f"signal {number} is not in 1..64", field="signal")
    return number


class _Stream:
    """One attached client's queue of pieces."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, bytes] | ExecResult | DsecError] = asyncio.Queue()
        self.behind = 0
        self.lost = False  # it fell too far behind: nothing more is queued

    def put(self, item: tuple[str, bytes] | ExecResult | DsecError) -> None:
        if self.lost:
            return
        if isinstance(item, tuple):
            self.behind += len(item[1])
            if self.behind > MAX_BEHIND:
                self.lost = True
                item = DsecError(f"this stream fell over {MAX_BEHIND} bytes behind the output")
        self.queue.put_nowait(item)


class _Process:
    def __init__(
        self, sid: str, proc: AgentProcess, stdin: bool, size: tuple[int, int] | None
    ) -> None:
        self.sid, self.proc, self.stdin, self.size = sid, proc, stdin, size
        self.started = time.time()
        self.backlog: deque[tuple[str, bytes]] = deque()
        self.kept = 0
        self.read = False  # a stream has attached from the start: keep only BACKLOG
        self.end: ExecResult | DsecError | None = None
        self.streams: set[_Stream] = set()
        self.pump: asyncio.Task[None] | None = None
        self.gone: asyncio.TimerHandle | None = None

    def info(self) -> ProcessInfo:
        rows, cols = self.size or (None, None)
        end = self.end
        return ProcessInfo(
            pid=self.proc.pid,
            command=self.proc.command,
            sandbox_id=self.sid,
            running=end is None,
            stdin=self.stdin,
            rows=rows,
            cols=cols,
            started=self.started,
            exit_code=end.exit_code if isinstance(end, ExecResult) else None,
        )

    def trim(self) -> None:
        keep = BACKLOG if self.read else UNREAD
        while self.kept > keep and len(self.backlog) > 1:
            self.kept -= len(self.backlog.popleft()[1])

    def deliver(self, item: tuple[str, bytes] | ExecResult | DsecError) -> None:
        if isinstance(item, tuple):
            self.backlog.append(item)
            self.kept += len(item[1])
            self.trim()
        else:
            self.end = item
        for stream in self.streams:
            stream.put(item)


class Processes:
    """The interactive processes of ``agents``' sandboxes, by sandbox and pid."""

    def __init__(self, agents: Agents) -> None:
        self.agents = agents
        self._table: dict[str, dict[int, _Process]] = {}

    def _get(self, sid: str, pid: int) -> _Process:
        p = self._table.get(sid, {}).get(pid)
        if p is None:
            self.agents.host.sandbox(sid)  # an unknown sandbox is UnknownSandbox first
            raise NotFound(f"sandbox {sid} has no process {pid} started by process_start")
        return p

    async def start(
        self,
        sid: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bool = False,
        rows: int | None = None,
        cols: int | None = None,
        background: bool = False,
    ) -> ProcessInfo:
        """Start ``cmd`` in the sandbox, held by the node (see the module's docstring)."""
        sb = self.agents.host.sandbox(sid)
        table = self._table.setdefault(sid, {})
        if len(table) >= MAX_PROCESSES:
            raise AdmissionRejected(
                f"sandbox {sid} holds {len(table)} processes already (at most {MAX_PROCESSES})",
                sandbox_id=sid,
            )
        size = (rows, cols) if rows is not None and cols is not None else None
        proc = await self.agents.agent(sid).exec_interactive(
            cmd,
            timeout=timeout,
            cwd=cwd or sb.rt.spec.workdir or "/",
            env={**sb.rt.spec.env, **(env or {})} or None,
            stdin=stdin,
            pty=size,
            max_output=PIECE,
            background=background,
        )
        if sb.status != "running":  # it died or is being killed while we started
            proc.close()
            raise sb.not_running()
        p = _Process(sid, proc, stdin or size is not None, size)
        old = table.pop(proc.pid, None)
        if old is not None:  # an ended one whose pid came round again
            self._forget(old)
        table[proc.pid] = p
        p.pump = asyncio.get_running_loop().create_task(self._pump(p), name=f"process-{sid}")
        return p.info()

    async def _pump(self, p: _Process) -> None:
        events = p.proc.events()
        try:
            async for item in events:
                p.deliver(item)
        except DsecError as e:
            p.deliver(e)
        except Exception as e:
            p.deliver(DsecError(f"process {p.proc.pid}'s output broke: {e}"))
        finally:
            if p.end is None:  # cancelled: the sandbox is going (or died: SandboxDied)
                sb = self.agents.host.sandboxes.get(p.sid)
                p.end = (
                    sb.not_running()
                    if sb is not None and sb.died is not None
                    else SandboxNotRunning(f"sandbox {p.sid} is gone", sandbox_id=p.sid)
                )
                for stream in p.streams:
                    stream.put(p.end)
            p.proc.close()
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
            loop = asyncio.get_running_loop()
            p.gone = loop.call_later(LINGER, self._forget, p)

    def _forget(self, p: _Process) -> None:
        if p.gone is not None:
            p.gone.cancel()
        table = self._table.get(p.sid)
        if table is not None and table.get(p.proc.pid) is p:
            del table[p.proc.pid]
            if not table:
                del self._table[p.sid]

    def list(self, sid: str) -> list[ProcessInfo]:
        """The sandbox's processes (running, and ended within ``LINGER``), by pid."""
        self.agents.host.sandbox(sid)
        return [p.info() for _, p in sorted(self._table.get(sid, {}).items())]

    def get(self, sid: str, pid: int) -> ProcessInfo:
        return self._get(sid, pid).info()

    def output(
        self, sid: str, pid: int, from_start: bool = True
    ) -> AsyncIterator[tuple[str, bytes] | ExecResult]:
        """The process's output as it comes (from the backlog's start, or from now), then
        its ``ExecResult``; a stream too far behind, or a process whose sandbox died, ends
        with the error. Unknown processes are refused now."""
        p = self._get(sid, pid)
        stream = _Stream()
        if from_start:
            for piece in p.backlog:
                stream.put(piece)
            stream.behind = 0
            p.read = True
            p.trim()
        if p.end is not None:
            stream.put(p.end)
        else:
            p.streams.add(stream)

        async def run() -> AsyncIterator[tuple[str, bytes] | ExecResult]:
            try:
                while True:
                    item = await stream.queue.get()
                    if isinstance(item, DsecError):
                        raise item
                    if isinstance(item, tuple):
                        stream.behind -= len(item[1])
                    yield item
                    if isinstance(item, ExecResult):
                        if from_start:  # all of it was read: it need not linger
                            self._forget(p)
                        return
            finally:
                p.streams.discard(stream)

        return run()

    def _running(self, sid: str, pid: int) -> _Process:
        p = self._get(sid, pid)
        if p.end is not None:
            raise NotFound(f"process {pid} of sandbox {sid} has ended")
        return p

    async def send(self, sid: str, pid: int, data: bytes, eof: bool = False) -> ProcessInfo:
        """Input for the process (``AgentProcess.send``), then the end of input if ``eof``."""
        p = self._running(sid, pid)
        if not p.stdin and (data or eof):
            raise InvalidSpec(
                f"process {pid} was started without stdin: it takes no input", field="stdin"
            )
        if data:
            await p.proc.send(data)
        if eof:
            await p.proc.close_stdin()
        return p.info()

    async def resize(self, sid: str, pid: int, rows: int, cols: int) -> ProcessInfo:
        p = self._running(sid, pid)
        if p.size is None:
            raise InvalidSpec(f"process {pid} has no terminal to resize", field="rows")
        await p.proc.resize(rows, cols)
        p.size = (rows, cols)
        return p.info()

    async def signal(self, sid: str, pid: int, signal: str | int = "KILL") -> ProcessInfo:
        """Send ``signal`` to the process (the command itself, not what it started)."""
        number = signal_number(signal)
        p = self._running(sid, pid)
        await p.proc.signal(number)
        return p.info()

    async def drop(self, sid: str) -> None:
        """Close every process of sandbox ``sid`` (it is being killed)."""
        table = self._table.pop(sid, {})
        pumps = [p.pump for p in table.values() if p.pump is not None]
        for pump in pumps:
            pump.cancel()  # its end closes the connection: the agent kills the command
        await asyncio.gather(*pumps, return_exceptions=True)
        for p in table.values():
            p.proc.close()
            if p.gone is not None:
                p.gone.cancel()

    async def close(self) -> None:
        """Close every process (the node is closing)."""
        for sid in list(self._table):
            await self.drop(sid)
