"""envd's directory watching (``files.watch_dir``) over dsec's streamed exec: the sandbox's own
agent binary watches with inotify (``dsec-agent watch [-r] DIR``, ``agent/src/watch.c``), so
it works on any image and backend, and stops when its stream is let go or the sandbox dies.

Both ways the SDK watches are served: ``WatchDir`` (``AsyncSandbox``), a stream of a start
event, the events and keepalives, for as long as the client holds it; and ``CreateWatcher``,
``GetWatcherEvents`` and ``RemoveWatcher`` (``Sandbox``), which keep a watch running here
between polls. Such a watcher belongs to the caller's key and sandbox, holds at most
``MAX_EVENTS`` unread events (older ones are dropped), and is removed after ``WATCHER_IDLE``
seconds without a poll, when its sandbox ends, or with ``RemoveWatcher``; an app keeps at most
``MAX_WATCHERS``. Events are envd's (fsnotify's): CREATE (a move in too), WRITE, REMOVE, RENAME
(a move out) and CHMOD, named relative to the watched directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..backend import AGENT_PATH
from ..errors import DsecError
from ..records import ExecResult
from .callers import Connect, caller_client
from .connect import RpcError, end_stream, envelope, rpc_error
from .filesystem import absolute

__all__ = [
    "MAX_EVENTS",
    "MAX_WATCHERS",
    "WATCHER_IDLE",
    "Watchers",
    "watch_argv",
    "watch_dir_events",
]

MAX_EVENTS = 10_000
MAX_WATCHERS = 1_000
WATCHER_IDLE = 600.0  # seconds
#: What the watching command's stdout is allowed: it runs as long as the watch, so the largest
#: output dsec's exec keeps (after it, events stop coming and the watch ends).
WATCH_OUTPUT = 16 << 20
_TYPES = {
    "CREATE": "EVENT_TYPE_CREATE",
    "WRITE": "EVENT_TYPE_WRITE",
    "REMOVE": "EVENT_TYPE_REMOVE",
    "RENAME": "EVENT_TYPE_RENAME",
    "CHMOD": "EVENT_TYPE_CHMOD",
}


def watch_argv(message: Mapping[str, Any]) -> list[str]:
    """The watching command for a ``WatchDirRequest`` or ``CreateWatcherRequest``."""
    path = absolute(message.get("path"))
    return [AGENT_PATH, "watch", *(["-r"] if message.get("recursive") else []), path]


def _name(text: str) -> str:
    out, escaped = [], False
    for c in text:
        if escaped:
            out.append("\n" if c == "n" else c)
            escaped = False
        elif c == "\\":
            escaped = True
        else:
            out.append(c)
    return "".join(out)


class _Events:
    """The watching command's stdout as envd's events: ``start`` once it watches, then one
    ``FilesystemEvent`` per line."""

    def __init__(self) -> None:
        self.buf = b""
        self.ready = False

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out: list[dict[str, Any]] = []
        while (i := self.buf.find(b"\n")) >= 0:
            line, self.buf = self.buf[:i].decode("utf-8", "replace"), self.buf[i + 1 :]
            kind, _, name = line.partition(" ")
            if kind == "ready":
                self.ready = True
                out.append({"start": {}})
            elif kind in _TYPES:
                out.append({"filesystem": {"name": _name(name), "type": _TYPES[kind]}})
        return out


def _failed(path: str, result: ExecResult | None, stderr: bytes) -> RpcError:
    """Why a watch ended before it began: envd's codes for a missing path or a file."""
    if result is None:
        return RpcError("internal", f"watching {path}: the command's stream ended")
    why = stderr.decode("utf-8", "replace").strip() or f"exit code {result.exit_code}"
    if result.exit_code == 3:
        return RpcError("not_found", f"path {path} not found")
    if result.exit_code == 2:
        return RpcError("invalid_argument", f"path {path} is not a directory")
    return RpcError("internal", f"watching {path} failed: {why}")


async def _watch(client: Any, sid: str, argv: list[str]) -> AsyncGenerator[dict[str, Any], None]:
    """Start watching; yields the start event, then the events, until the command ends (the
    sandbox died, the directory went). Leaving early kills the command."""
    stream = getattr(client, "exec_stream", None)
    if stream is None:
        raise RpcError("unimplemented", "this dsec node has no streaming exec")
    items = await stream(sid, argv, timeout=None, max_output=WATCH_OUTPUT)
    events, err, result = _Events(), b"", None
    try:
        async for item in items:
            if isinstance(item, ExecResult):
                result = item
                break
            if item.stream == "stderr":
                err = (err + item.data)[-4096:]
                continue
            for event in events.feed(item.data):
                yield event
    finally:
        with contextlib.suppress(Exception):
            await items.aclose()
    if not events.ready:
        raise _failed(argv[-1], result, err)


async def watch_dir_events(
    connect: Connect,
    key: str,
    sid: str,
    message: Mapping[str, Any],
    keepalive: float | None = None,
) -> AsyncIterator[bytes]:
    """``WatchDir``'s response stream, envelope by envelope, with a keepalive every
    ``keepalive`` seconds of quiet; it ends when the client goes away (the watch is killed),
    or with an error if the watch cannot start or stops."""
    try:
        argv = watch_argv(message)
        async with caller_client(connect, key) as client:
            events = _watch(client, sid, argv)
            try:
                async for event in _with_keepalives(events, keepalive):
                    yield envelope(event)
            finally:
                with contextlib.suppress(Exception):
                    await events.aclose()
        yield end_stream()
    except RpcError as e:
        yield end_stream(e)
    except DsecError as e:
        yield end_stream(rpc_error(e, sid))


async def _with_keepalives(
    items: AsyncIterator[dict[str, Any]], interval: float | None
) -> AsyncIterator[dict[str, Any]]:
    """``items`` and, after the first, a keepalive event whenever none came for ``interval``
    seconds. A task reads one item ahead at most."""
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
    done = object()

    async def pump() -> None:
        try:
            async for item in items:
                await queue.put(item)
            await queue.put(done)
        except Exception as e:  # handed to the reader, raised there
            await queue.put(e)

    task = asyncio.create_task(pump())
    started = False
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), interval if started else None)
            except TimeoutError:
                yield {"keepalive": {}}
                continue
            if item is done:
                return
            if isinstance(item, Exception):
                raise item
            started = True
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


@dataclass
class _Watcher:
    """One ``CreateWatcher``'s watch, kept between polls."""

    key: str
    sid: str
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    polled: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None
    error: RpcError | None = None
    ended: bool = False


class Watchers:
    """The watchers of one E2B app (``CreateWatcher`` and its calls)."""

    def __init__(self, connect: Connect) -> None:
        self.connect = connect
        self._watchers: dict[str, _Watcher] = {}

    async def create(self, key: str, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
        self._sweep()
        if len(self._watchers) >= MAX_WATCHERS:
            raise RpcError("resource_exhausted", f"{MAX_WATCHERS} watchers are running")
        argv = watch_argv(message)
        watcher = _Watcher(key, sid)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watcher.task = asyncio.create_task(self._run(watcher, argv, started))
        try:
            await started
        except BaseException:
            watcher.task.cancel()
            raise
        wid = secrets.token_hex(8)
        self._watchers[wid] = watcher
        return {"watcherId": wid}

    async def _run(self, w: _Watcher, argv: list[str], started: asyncio.Future[None]) -> None:
        try:
            async with caller_client(self.connect, w.key) as client:
                async for event in _watch(client, w.sid, argv):
                    if "start" in event:
                        started.set_result(None)
                    else:
                        w.events.append(event["filesystem"])
        except RpcError as e:
            w.error = e
        except DsecError as e:
            w.error = rpc_error(e, w.sid)
        except Exception as e:  # a watcher's failure is its poller's answer, not the loop's
            w.error = RpcError("internal", f"the watch failed: {e}")
        finally:
            w.ended = True
            if not started.done():
                started.set_exception(w.error or RpcError("internal", "the watch did not start"))

    def _find(self, key: str, sid: str, message: Mapping[str, Any]) -> tuple[str, _Watcher]:
        wid = message.get("watcherId")
        w = self._watchers.get(wid) if isinstance(wid, str) else None
        if w is None or w.key != key or w.sid != sid:
            raise RpcError("not_found", f"watcher with id {wid} not found")
        return wid, w  # type: ignore[return-value]

    async def events(self, key: str, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
        self._sweep()
        wid, w = self._find(key, sid, message)
        w.polled = time.monotonic()
        out = list(w.events)
        w.events.clear()
        if not out and w.ended:  # what it saw was given out: now its end is the answer
            self._drop(wid)
            raise w.error or RpcError("not_found", f"watcher with id {wid} has stopped")
        return {"events": out}

    async def remove(self, key: str, sid: str, message: Mapping[str, Any]) -> dict[str, Any]:
        wid, _ = self._find(key, sid, message)
        self._drop(wid)
        return {}

    def _drop(self, wid: str) -> None:
        w = self._watchers.pop(wid, None)
        if w is not None and w.task is not None:
            w.task.cancel()  # leaving the exec stream kills the watching command

    def _sweep(self) -> None:
        now = time.monotonic()
        for wid in [i for i, w in self._watchers.items() if now - w.polled > WATCHER_IDLE]:
            self._drop(wid)

    def close(self) -> None:
        for wid in list(self._watchers):
            self._drop(wid)
