"""envd's ``process.Process`` Connect service over dsec's interactive processes
(``process_start``): ``Start`` starts one and streams a start event (the pid), its output as
it comes and an end event (the exit code); ``Connect`` streams the same from now on for a
running one; ``SendInput``, ``StreamInput``, ``CloseStdin``, ``Update`` (a PTY's size) and
``SendSignal`` reach it by pid; ``List`` shows what runs.

The node holds each command, not the stream: a command runs on when its client lets go
(``disconnect()``, a dropped handle), as under envd, until it ends, its timeout (the
``Start`` call's) kills it, ``kill`` does, or the sandbox dies; ``commands.connect`` attaches
to it again. A PTY is a pseudo-terminal of the sandbox's own (``tty`` names ``/dev/pts/N``).

The SDK runs every command as ``/bin/bash -l -c <cmd>`` (a PTY as ``/bin/bash -i -l``); a
sandbox without bash runs it with ``/bin/sh``. A short shell prologue marks the command for
``List`` and ``exec``s it, so the pid the node reports is the command's.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import anyio
from starlette.requests import Request

from ..errors import DsecError, NotFound
from ..records import ExecResult
from .callers import Connect, caller_client
from .connect import MAX_REQUEST, RpcError, end_stream, envelope, rpc_error

__all__ = [
    "PROLOGUE",
    "close_stdin",
    "command_argv",
    "connect_events",
    "keepalive_interval",
    "list_processes",
    "send_input",
    "send_signal",
    "start_events",
    "stream_input",
    "update",
]

#: Marks the command with its pid (``DSEC_E2B_PID``, which ``List`` looks for: equal to a
#: process's own pid only in the command itself, not in what it starts), falls back to
#: /bin/sh when the environment has no bash, then becomes the command.
PROLOGUE = (
    'export DSEC_E2B_PID="$$"\n'
    'if [ "$1" = /bin/bash ] && [ ! -x /bin/bash ]; then shift; '
    'if [ "$1" = -l ]; then shift; elif [ "$2" = -l ]; then a=$1; shift 2; set -- "$a" "$@"; fi; '
    'set -- /bin/sh "$@"; fi\n'
    'exec "$@"'
)
_SIGNALS = {"SIGNAL_SIGKILL": "KILL", "SIGNAL_SIGTERM": "TERM", 9: "KILL", 15: "TERM"}
#: The largest PTY side envd's clients send (the kernel keeps 16 bits).
_MAX_SIDE = 65535


def command_argv(message: Mapping[str, Any]) -> tuple[list[str], dict[str, str], str | None]:
    """The argv (behind the prologue), env and cwd of a ``StartRequest``."""
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


def _pty_size(pty: Any) -> tuple[int, int] | None:
    """(rows, cols) of a ``PTY`` message (None: no PTY); envd's default is 24x80."""
    if pty is None:
        return None
    size = pty.get("size") if isinstance(pty, dict) else None
    size = size if isinstance(size, dict) else {}
    rows, cols = size.get("rows") or 24, size.get("cols") or 80
    if not all(isinstance(v, int) and 0 < v <= _MAX_SIDE for v in (rows, cols)):
        raise RpcError("invalid_argument", f"bad PTY size {size!r}")
    return rows, cols


def _pid_of(message: Mapping[str, Any]) -> int:
    """The pid a ``ProcessSelector`` names; a tag, or nothing, is ``not_found``."""
    selector = message.get("process") or {}
    pid = selector.get("pid") if isinstance(selector, dict) else None
    if isinstance(pid, str) and pid.isdigit():
        pid = int(pid)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise RpcError("not_found", f"no process {selector!r}: only pids are known here")
    return pid


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
    return _event({"end": end})


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


#: A client that leaves a command's stream this close to the command's timeout (seconds) left
#: because of it: the command is killed then rather than at the node's own deadline.
DEADLINE_SLACK = 1.0


async def start_events(
    connect: Connect,
    key: str,
    sid: str,
    message: Mapping[str, Any],
    timeout: float | None,
    keepalive: float | None = None,
) -> AsyncIterator[bytes]:
    """The ``Start`` response stream, envelope by envelope, with a keepalive event every
    ``keepalive`` seconds of quiet. The command runs on if the client goes away (the node
    holds it) until it ends or ``timeout`` kills it."""
    began = time.monotonic()
    try:
        argv, env, cwd = command_argv(message)
        size = _pty_size(message.get("pty"))
        stdin = message.get("stdin") is True
        async with caller_client(connect, key) as client:
            # background: what the command leaves running lives on, as under envd (`cmd &`)
            info = await client.process_start(
                sid,
                argv,
                timeout=timeout,
                env=env,
                cwd=cwd,
                stdin=stdin,
                rows=size[0] if size else None,
                cols=size[1] if size else None,
                background=True,
            )
            yield _event({"start": {"pid": info.pid}})
            try:
                async for piece in _output_events(client, sid, info.pid, size, True, keepalive):
                    yield piece
            except (GeneratorExit, asyncio.CancelledError):
                # The client left. At its deadline that is the SDK giving up on the command's
                # own timeout, which the node's timer (started a request later) is about to
                # enforce: kill it now, so the caller never sees it running after its
                # TimeoutException. Any earlier, the command runs on, as under envd.
                if timeout is not None and time.monotonic() - began >= timeout - DEADLINE_SLACK:
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await client.process_signal(sid, info.pid, "KILL")
                raise
        yield end_stream()
    except RpcError as e:
        yield end_stream(e)
    except DsecError as e:
        yield end_stream(rpc_error(e, sid))


async def connect_events(
    connect: Connect, key: str, sid: str, message: Mapping[str, Any], keepalive: float | None
) -> AsyncIterator[bytes]:
    """The ``Connect`` response stream: a running command's start event, its output from now
    on, and its end; a pid the node does not hold is ``not_found``."""
    try:
        pid = _pid_of(message)
        async with caller_client(connect, key) as client:
            try:
                info = await client.process(sid, pid)
            except NotFound:
                raise RpcError("not_found", f"process with pid {pid} not found") from None
            if not info.running:
                raise RpcError("not_found", f"process with pid {pid} has ended")
            size = (info.rows, info.cols) if info.rows is not None else None
            yield _event({"start": {"pid": pid}})
            async for piece in _output_events(client, sid, pid, size, False, keepalive):
                yield piece
        yield end_stream()
    except RpcError as e:
        yield end_stream(e)
    except DsecError as e:
        yield end_stream(rpc_error(e, sid))


async def _output_events(
    client: Any,
    sid: str,
    pid: int,
    size: tuple[int, int] | None,
    from_start: bool,
    keepalive: float | None,
) -> AsyncIterator[bytes]:
    """A process's data events (a PTY's under ``pty``), keepalives, and its end event; a
    command killed at its timeout is ``deadline_exceeded``. Leaving early leaves it running."""
    items = await client.process_output(sid, pid, from_start=from_start)
    ticking = _with_keepalives(items, keepalive)
    result = None
    try:
        async for item in ticking:
            if item is _KEEPALIVE:
                yield _event({"keepalive": {}})
            elif isinstance(item, ExecResult):
                result = item
                break
            elif item.data:
                yield _data("pty" if size is not None else item.stream, item.data)
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await ticking.aclose()
            await items.aclose()
    if result is None:
        raise RpcError("internal", "the command's stream ended without its result")
    if result.timed_out:
        raise RpcError("deadline_exceeded", "the command ran past its timeout and was killed")
    yield _end(result)


async def _to_process(call: Any) -> dict[str, Any]:
    """Run a call on a process; one the node does not hold (or that ended) is ``not_found``."""
    try:
        await call
    except NotFound as e:
        raise RpcError("not_found", e.message) from None
    return {}


def _input_bytes(message: Mapping[str, Any]) -> bytes:
    given = message.get("input") or {}
    value = given.get("stdin", given.get("pty", "")) if isinstance(given, dict) else None
    if not isinstance(value, str):
        raise RpcError("invalid_argument", "input must hold stdin or pty bytes")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise RpcError("invalid_argument", "input bytes must be base64") from None


async def send_input(client: Any, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """``SendInput``: bytes for a command's stdin or PTY."""
    pid = _pid_of(message)
    return await _to_process(client.process_input(sid, pid, _input_bytes(message)))


async def close_stdin(client: Any, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """``CloseStdin``: the command's stdin is closed once what was sent is written."""
    return await _to_process(client.process_input(sid, _pid_of(message), eof=True))


async def update(client: Any, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """``Update``: a PTY's new size."""
    pid, size = _pid_of(message), _pty_size(message.get("pty"))
    if size is None:
        return {}
    return await _to_process(client.process_resize(sid, pid, *size))


async def stream_input(connect: Connect, key: str, sid: str, request: Request) -> bytes:
    """``StreamInput`` (a client stream): a start message naming the process, then data
    messages, each sent on as it arrives; the answer is one empty message (enveloped), or
    the error in the end-of-stream envelope."""
    try:
        async with caller_client(connect, key) as client:
            pid, buf, total = None, b"", 0
            async for chunk in request.stream():
                total += len(chunk)
                if total > 64 * MAX_REQUEST:
                    raise RpcError("resource_exhausted", "the input stream is too large")
                buf += chunk
                while len(buf) >= 5:
                    flags, n = struct.unpack(">BI", buf[:5])
                    if n > MAX_REQUEST:
                        raise RpcError("resource_exhausted", "an input message is too large")
                    if len(buf) < 5 + n:
                        break
                    raw, buf = buf[5 : 5 + n], buf[5 + n :]
                    if flags & 0x01:
                        raise RpcError("unimplemented", "compressed messages are not supported")
                    pid = await _stream_message(client, sid, pid, raw)
        return envelope({}) + end_stream()
    except RpcError as e:
        return end_stream(e)
    except DsecError as e:
        return end_stream(rpc_error(e, sid))


async def _stream_message(client: Any, sid: str, pid: int | None, raw: bytes) -> int | None:
    try:
        message = json.loads(raw or b"{}")
    except ValueError:
        raise RpcError("invalid_argument", "an input message is not JSON") from None
    if not isinstance(message, dict):
        raise RpcError("invalid_argument", "an input message must be a JSON object")
    if "start" in message:
        return _pid_of(message["start"] or {})
    if "data" in message:
        if pid is None:
            raise RpcError("failed_precondition", "input came before the start message")
        await _to_process(client.process_input(sid, pid, _input_bytes(message["data"] or {})))
    return pid


async def send_signal(client: Any, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """``SendSignal``: SIGKILL or SIGTERM to a pid in the sandbox (the node's own handle of a
    command it holds, else the shell's ``kill``); no such process is ``not_found`` (the
    SDK's ``kill`` then answers False)."""
    pid = _pid_of(message)
    signal = _SIGNALS.get(message.get("signal", "SIGNAL_SIGKILL"))
    if signal is None:
        raise RpcError("invalid_argument", f"signal {message.get('signal')!r} is not supported")
    try:
        await client.process_signal(sid, pid, signal)
        return {}
    except NotFound:
        pass  # not one the node holds (or ended): any process of the sandbox by its pid
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
