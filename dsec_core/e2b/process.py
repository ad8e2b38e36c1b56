"""envd's ``process.Process`` Connect service over dsec's streaming exec: ``Start`` streams a
start event (the pid), stdout and stderr as they come, and an end event (the exit code);
``SendSignal`` kills by pid.

The SDK runs every command as ``/bin/bash -l -c <cmd>``; a sandbox without bash runs it with
``/bin/sh -c``. The pid the SDK needs (to kill a background command) is the process's own pid
inside the sandbox: a two-line shell prologue prints it on stderr (as a line this service
takes out of the stream) and ``exec``s the command, so that pid is the command's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import anyio

from ..api.messages import MAX_OUTPUT
from ..errors import DsecError
from ..records import ExecResult
from .callers import Connect, caller_client
from .connect import RpcError, end_stream, envelope, rpc_error

__all__ = [
    "PROLOGUE",
    "command_argv",
    "keepalive_interval",
    "list_processes",
    "send_signal",
    "start_events",
]

#: Prints the shell's pid (the command's, after ``exec``) as a marked line on stderr, marks the
#: command with it (``DSEC_E2B_PID``, which ``List`` looks for: equal to a process's own pid
#: only in the command itself, not in what it starts), falls back to /bin/sh when the
#: environment has no bash, then becomes the command.
PROLOGUE = (
    "printf '\\036e2b-pid %s\\n' \"$$\" >&2\n"
    'export DSEC_E2B_PID="$$"\n'
    'if [ "$1" = /bin/bash ] && [ ! -x /bin/bash ]; then shift; '
    '[ "$1" = -l ] && shift; set -- /bin/sh "$@"; fi\n'
    'exec "$@"'
)
_MARK = re.compile(rb"\x1ee2b-pid (\d+)\n")
_SIGNALS = {"SIGNAL_SIGKILL": "KILL", "SIGNAL_SIGTERM": "TERM", 9: "KILL", 15: "TERM"}


def command_argv(message: Mapping[str, Any]) -> tuple[list[str], dict[str, str], str | None]:
    """The argv (behind the prologue), env and cwd of a ``StartRequest``; what dsec cannot do
    (a PTY, stdin to send later) is refused as ``unimplemented``."""
    if message.get("pty"):
        raise RpcError("unimplemented", "PTY is not supported by dsec's E2B API")
    if message.get("stdin") is True:
        raise RpcError(
            "unimplemented", "stdin=True is not supported: dsec's exec takes no input later"
        )
    config = message.get("process") or {}
    cmd, args = config.get("cmd"), config.get("args") or []
    envs, cwd = config.get("envs") or {}, config.get("cwd")
    if not isinstance(cmd, str) or not cmd:
        raise RpcError("invalid_argument", "process.cmd must be a command")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise RpcError("invalid_argument", "process.args must be strings")
    if not isinstance(envs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
    ):
        raise RpcError("invalid_argument", "process.envs must map strings to strings")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
        raise RpcError("invalid_argument", f"process.cwd must be an absolute path, got {cwd!r}")
    return ["/bin/sh", "-c", PROLOGUE, "e2b", cmd, *args], dict(envs), cwd


def _kill_argv(signal: str, pid: int) -> list[str]:
    # the shell's own kill: a minimal image may have no /bin/kill
    return ["/bin/sh", "-c", f'kill -{signal} "$0"', str(pid)]


def _event(event: Mapping[str, Any]) -> bytes:
    return envelope({"event": event})


def _data(stream: str, data: bytes) -> bytes:
    return _event({"data": {stream: base64.b64encode(data).decode()}})


def _end(result: ExecResult) -> bytes:
    code = result.exit_code
    status = f"exit status {code}" if code >= 0 else f"signal: {-code}"
    end: dict[str, Any] = {"exitCode": code, "exited": code >= 0, "status": status}
    if result.truncated:
        end["error"] = f"output past {MAX_OUTPUT} bytes per stream was dropped"
    return _event({"end": end})


async def _exec_stream(client: Any, sid: str, argv: list[str], **kw: Any) -> Any:
    """dsec's streaming exec: ``ExecOutput(stream, data)`` items, then the ``ExecResult``."""
    stream = getattr(client, "exec_stream", None)
    if stream is None:
        raise RpcError("unimplemented", "this dsec node has no streaming exec")
    return await stream(sid, argv, **kw)


class _Output:
    """Holds output back until the prologue's pid line came, then passes it through."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.err = b""
        self.held: list[bytes] = []

    def feed(self, stream: str, data: bytes) -> list[bytes]:
        if self.pid is not None:
            return [_data(stream, data)] if data else []
        if stream == "stdout":
            self.held.append(_data(stream, data))
            return []
        self.err += data
        m = _MARK.search(self.err)
        if m is None:  # the line is the shell's first output; no line in 4 KiB: it never comes
            return self._started(0, self.err) if len(self.err) > 4096 else []
        rest = self.err[: m.start()] + self.err[m.end() :]
        return self._started(int(m.group(1)), rest)

    def _started(self, pid: int, rest: bytes) -> list[bytes]:
        self.pid = pid
        out = [_event({"start": {"pid": pid}}), *self.held]
        if rest:
            out.append(_data("stderr", rest))
        self.held, self.err = [], b""
        return out

    def finish(self) -> list[bytes]:
        """The command ended before its pid line came (the shell failed): start it at pid 0."""
        return [] if self.pid is not None else self._started(0, self.err)


_KEEPALIVE = object()


async def _with_keepalives(
    items: AsyncIterator[Any], interval: float | None
) -> AsyncGenerator[Any, None]:
    """``items``, and ``_KEEPALIVE`` whenever none came for ``interval`` seconds (None: never).
    A task reads ``items`` one item ahead at most, so the command's output is not read faster
    than the client takes it."""
    if not interval:
        async for item in items:
            yield item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
    done = object()

    async def pump() -> None:
        try:
            async for item in items:
                await queue.put(item)
            await queue.put(done)
        except Exception as e:
            await queue.put(e)

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), interval)
            except TimeoutError:
                yield _KEEPALIVE
                continue
            if item is done:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def keepalive_interval(value: str | None) -> float | None:
    """The ``Keepalive-Ping-Interval`` header (seconds) the SDK sends with ``Start``: how
    often envd says it is alive on a quiet stream; None if absent or not a number."""
    try:
        return max(1.0, float(value)) if value else None
    except ValueError:
        return None


async def start_events(
    connect: Connect,
    key: str,
    sid: str,
    message: Mapping[str, Any],
    timeout: float | None,
    keepalive: float | None = None,
) -> AsyncIterator[bytes]:
    """The ``Start`` response stream, envelope by envelope, with a keepalive event every
    ``keepalive`` seconds of quiet. A command cut off by the client going away is killed in
    the sandbox (the stream is its only handle)."""
    try:
        argv, env, cwd = command_argv(message)
        async with caller_client(connect, key) as client:
            out, result = _Output(), None
            # background: what the command leaves running lives on, as under envd
            # (`cmd &`); the output cap is the largest dsec's exec allows
            items = await _exec_stream(
                client,
                sid,
                argv,
                timeout=timeout,
                env=env,
                cwd=cwd,
                background=True,
                max_output=MAX_OUTPUT,
            )
            ticking = _with_keepalives(items, keepalive)
            try:
                async for item in ticking:
                    if item is _KEEPALIVE:
                        if out.pid is not None:
                            yield _event({"keepalive": {}})
                        continue
                    if isinstance(item, ExecResult):
                        result = item
                        break
                    for piece in out.feed(item.stream, item.data):
                        yield piece
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await ticking.aclose()
                if result is None:
                    # the client went away: leaving dsec's stream kills the command; a kill by
                    # pid as well, should the node not have seen the stream close yet
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await items.aclose()
                        if out.pid:
                            await client.exec(sid, _kill_argv("KILL", out.pid), timeout=10)
            for piece in out.finish():
                yield piece
            if result is None:
                raise RpcError("internal", "the command's stream ended without its result")
            if result.timed_out:
                raise RpcError(
                    "deadline_exceeded",
                    f"the command ran past its timeout ({timeout}s) and was killed",
                )
            yield _end(result)
        yield end_stream()
    except RpcError as e:
        yield end_stream(e)
    except DsecError as e:
        yield end_stream(rpc_error(e, sid))


async def send_signal(client: Any, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """``SendSignal``: SIGKILL or SIGTERM to a pid in the sandbox; no such process is
    ``not_found`` (the SDK's ``kill`` then answers False)."""
    selector = message.get("process") or {}
    pid = selector.get("pid")
    if isinstance(pid, str) and pid.isdigit():
        pid = int(pid)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise RpcError("not_found", f"no process {selector!r}: only pids are known here")
    signal = _SIGNALS.get(message.get("signal", "SIGNAL_SIGKILL"))
    if signal is None:
        raise RpcError("invalid_argument", f"signal {message.get('signal')!r} is not supported")
    r = await client.exec(sid, _kill_argv(signal, pid), timeout=10)
    if r.exit_code != 0:
        raise RpcError("not_found", f"process {pid} not found")
    return {}


#: Every running command started here: pid, cwd and argv (NUL-separated), each field after
#: a 0x1e byte.
_LIST = (
    "for d in /proc/[0-9]*; do p=${d#/proc/}; "
    "tr '\\0' '\\n' < $d/environ 2>/dev/null | grep -qx \"DSEC_E2B_PID=$p\" || continue; "
    'printf \'\\036%s\\036%s\\036\' "$p" "$(readlink $d/cwd)"; cat $d/cmdline; done'
)


async def list_processes(client: Any, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """``List``: the commands started through ``Start`` that still run, as envd's
    ``ProcessInfo``: the argv each runs now (``sleep 9`` for ``bash -c "sleep 9"``, which
    bash ``exec``s) and its cwd; their ``envs`` are not reported."""
    r = await client.exec(sid, ["/bin/sh", "-c", _LIST], timeout=30)
    fields = r.stdout.split(b"\x1e")[1:]
    out = []
    for pid, cwd, cmdline in zip(fields[0::3], fields[1::3], fields[2::3], strict=False):
        argv = [a.decode("utf-8", "replace") for a in cmdline.split(b"\0")[:-1]]
        if not pid.isdigit() or not argv:
            continue  # it ended while being listed
        config = {"cmd": argv[0], "args": argv[1:], "envs": {}, "cwd": cwd.decode()}
        out.append({"config": config, "pid": int(pid)})
    return {"processes": out}
