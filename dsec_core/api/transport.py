"""A small HTTP/1.1 client over the node daemon's unix socket, sync and async, with keep-alive.

A general client (httpx) spent as much CPU per request as the daemon serving it, and on a
two-core node a create -> exec -> kill loop made that a fifth of the machine. This speaks just
the HTTP the daemon answers: requests with a Content-Length body, responses with a
Content-Length or chunked body.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import quote, urlencode

__all__ = ["Response", "UnixTransport", "AsyncUnixTransport", "TransportError", "TransportTimeout"]

_MAX_HEAD = 64 << 10


class TransportError(OSError):
    """The daemon could not be reached, or the connection broke mid-request."""


class TransportTimeout(TransportError):
    """No complete answer within the call's timeout."""


@dataclass(frozen=True)
class Response:
    status_code: int
    content: bytes
    headers: Mapping[str, str]

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


def _request_bytes(method: str, path: str, params: Mapping[str, Any] | None, body: bytes | None,
                   content_type: str) -> bytes:
    target = quote(path)
    if params:
        target += "?" + urlencode({k: v for k, v in params.items() if v is not None})
    head = f"{method} {target} HTTP/1.1\r\nhost: dsec\r\n"
    if body is not None:
        head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
    elif method in ("POST", "PUT"):
        head += "content-length: 0\r\n"
    return (head + "\r\n").encode() + (body or b"")


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        raise TransportError(f"malformed status line from the daemon: {lines[0]!r}") from None
    headers = {}
    for line in lines[1:]:
        if line:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
    return status, headers


def _encode(json_body: Any, content: bytes | None) -> tuple[bytes | None, str]:
    if json_body is not None:
        return json.dumps(json_body, separators=(",", ":")).encode(), "application/json"
    return content, "application/octet-stream"


class _SyncConn:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self.buf = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buf += data
        return True

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise TransportError("the daemon closed the connection mid-response")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._fill():
                raise TransportError("the daemon closed the connection mid-response")
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def roundtrip(self, data: bytes, timeout: float | None) -> Response | None:
        """Send one request, read one response; None if the (reused) connection was closed
        before any byte of an answer came back."""
        self.sock.settimeout(timeout)
        self.sock.sendall(data)
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                if not self.buf:
                    return None
                raise TransportError("the daemon closed the connection mid-response")
            if len(self.buf) > _MAX_HEAD:
                raise TransportError("response head too large")
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        status, headers = _parse_head(head)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self._line().split(b";")[0], 16)
                if size == 0:
                    self._line()
                    break
                parts.append(self._take(size))
                self._take(2)
            body = b"".join(parts)
        else:
            body = self._take(int(headers.get("content-length", "0")))
        return Response(status, body, headers)

    def close(self) -> None:
        self.sock.close()


class UnixTransport:
    """Blocking requests to a unix-socket HTTP server; thread-safe, pooled connections."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[_SyncConn] = []
        self._lock = threading.Lock()

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
                params: Mapping[str, Any] | None = None,
                timeout: float | None = None) -> Response:
        body, ctype = _encode(json, content)
        data = _request_bytes(method, path, params, body, ctype)
        for attempt in range(2):
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            fresh = conn is None
            try:
                if conn is None:
                    conn = _SyncConn(self.path)
                resp = conn.roundtrip(data, timeout)
            except socket.timeout as e:
                conn.close()
                raise TransportTimeout(f"no answer within {timeout}s") from e
            except OSError as e:
                if conn is not None:
                    conn.close()
                if isinstance(e, TransportError) or fresh:
                    raise TransportError(f"{self.path}: {e}") from e
                continue  # a kept-alive connection went stale; try a fresh one
            if resp is None:
                conn.close()
                if fresh:
                    raise TransportError(f"{self.path}: connection closed without an answer")
                continue
            if resp.headers.get("connection", "").lower() == "close":
                conn.close()
            else:
                with self._lock:
                    self._idle.append(conn)
            return resp
        raise TransportError(f"{self.path}: connection closed without an answer")

    def close(self) -> None:
        with self._lock:
            for conn in self._idle:
                conn.close()
            self._idle.clear()


class _AsyncConn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def roundtrip(self, data: bytes) -> Response | None:
        self.writer.write(data)
        await self.writer.drain()
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise TransportError("the daemon closed the connection mid-response") from e
        except asyncio.LimitOverrunError as e:
            raise TransportError("response head too large") from e
        status, headers = _parse_head(head[:-4])
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                parts = []
                while True:
                    size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        await self.reader.readuntil(b"\r\n")
                        break
                    parts.append(await self.reader.readexactly(size))
                    await self.reader.readexactly(2)
                body = b"".join(parts)
            else:
                body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        except asyncio.IncompleteReadError as e:
            raise TransportError("the daemon closed the connection mid-response") from e
        return Response(status, body, headers)

    def close(self) -> None:
        self.writer.close()


class AsyncUnixTransport:
    """The asyncio twin of ``UnixTransport``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[_AsyncConn] = []

    async def request(self, method: str, path: str, *, json: Any = None,
                      content: bytes | None = None, params: Mapping[str, Any] | None = None,
                      timeout: float | None = None) -> Response:
        body, ctype = _encode(json, content)
        data = _request_bytes(method, path, params, body, ctype)
        for attempt in range(2):
            conn = self._idle.pop() if self._idle else None
            fresh = conn is None
            try:
                if conn is None:
                    conn = _AsyncConn(*await asyncio.open_unix_connection(
                        self.path, limit=_MAX_HEAD))
                resp = await asyncio.wait_for(conn.roundtrip(data), timeout)
            except asyncio.TimeoutError as e:
                conn.close()
                raise TransportTimeout(f"no answer within {timeout}s") from e
            except asyncio.CancelledError:
                if conn is not None:
                    conn.close()
                raise
            except OSError as e:
                if conn is not None:
                    conn.close()
                if isinstance(e, TransportError) or fresh:
                    raise TransportError(f"{self.path}: {e}") from e
                continue
            if resp is None:
                conn.close()
                if fresh:
                    raise TransportError(f"{self.path}: connection closed without an answer")
                continue
            if resp.headers.get("connection", "").lower() == "close":
                conn.close()
            else:
                self._idle.append(conn)
            return resp
        raise TransportError(f"{self.path}: connection closed without an answer")

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
