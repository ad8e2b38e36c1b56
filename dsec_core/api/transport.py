"""A small HTTP/1.1 client for the node API, sync and async, over unix sockets and TCP (TLS for
``https://``), with kept-alive pooled connections.

A general client (httpx) spent as much CPU per request as the daemon serving it, and on a
two-core node a create -> exec -> kill loop made that a fifth of the machine. This speaks just
the HTTP the API needs: requests with a Content-Length body; responses with a Content-Length,
chunked, or close-delimited body. Building a request and parsing a response are sans-IO
(``request_head``, ``ResponseParser``) and shared, so the two twins differ only in how they
wait: ``HTTPTransport.request`` and ``AsyncHTTPTransport.request`` read the same way: take a
pooled connection that is still open, or connect; send; receive.

While the node is away (its daemon restarting: the socket is gone or refuses connections) a
request is sent again, with a short backoff, for up to ``retry`` seconds: any request whose
bytes never reached the node (the connect failed, or the send did), and an ``idempotent`` one
also when the connection broke before its answer was complete. A request that was sent is
never sent twice otherwise: the node may have acted on it (a create, an exec).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import InvalidSpec

__all__ = [
    "Address",
    "AsyncHTTPTransport",
    "AsyncStreamedResponse",
    "HTTPTransport",
    "Response",
    "ResponseParser",
    "StreamedResponse",
    "TransportError",
    "TransportTimeout",
    "ssl_context",
]

_MAX_HEAD = 64 << 10
_READ = 256 << 10
_BACKOFF = (0.05, 0.5)  # first and longest pause between attempts while the node is away


class TransportError(OSError):
    """The node could not be reached, or the connection broke mid-request."""


class TransportTimeout(TransportError):
    """No complete answer within the call's timeout."""


class _Unsent(TransportError):
    """Nothing of the request reached the node: the connect or the send failed."""


class _Stale(TransportError):
    """The connection was closed before any byte of an answer came back."""


class _Broken(TransportError):
    """The connection was closed or reset in the middle of the answer."""


#: What a node that is restarting answers a connect or a send with: its socket is gone, refuses,
#: or was closed under us. Anything else (a TLS certificate, a permission) will not pass.
_AWAY = frozenset(
    {
        errno.ENOENT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.EAGAIN,
    }
)


def _failed(where: Address, e: OSError) -> TransportError:
    """The error of a connect or send that failed: ``_Unsent`` if the node is only away."""
    away = e.errno in _AWAY and not isinstance(e, ssl.SSLError)
    return (_Unsent if away else TransportError)(f"{where}: {e}")


def _may_retry(e: TransportError, idempotent: bool) -> bool:
    return isinstance(e, _Unsent) or (idempotent and isinstance(e, (_Stale, _Broken)))


class _Retry:
    """The backoff of one request while the node is away, within ``window`` seconds of the
    first failure."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.deadline: float | None = None
        self.pause = _BACKOFF[0]
        self.failures = 0

    def next_pause(self, e: TransportError) -> float:
        """Seconds to wait before the next attempt; raises ``e`` when the window has passed."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.window
        self.failures += 1
        left = self.deadline - now
        if left <= 0:
            if self.failures > 1:
                raise TransportError(f"{e} (still, after {self.window:g}s of retrying)") from e
            raise e
        pause, self.pause = min(self.pause, left), min(self.pause * 2, _BACKOFF[1])
        return pause


@dataclass(frozen=True)
class Address:
    """Where a node listens: ``unix:///path`` (or a bare path), ``http://host:port`` or
    ``https://host:port``."""

    scheme: str  # "unix" | "http" | "https"
    host: str = ""
    port: int = 0
    path: str = ""  # the unix socket

    @classmethod
    def parse(cls, text: str | os.PathLike[str]) -> Address:
        if not isinstance(text, (str, os.PathLike)):
            raise InvalidSpec(
                f"an address is a string or a path, got {type(text).__name__}", field="address"
            )
        text = os.fspath(text)
        if not isinstance(text, str):
            raise InvalidSpec("an address is text, not bytes", field="address")
        if text.startswith("unix://"):
            text = text[len("unix://") :]
        if "://" not in text:
            if not text:
                raise InvalidSpec(
                    "an empty address; expected unix:///path, http://host:port "
                    "or https://host:port",
                    address=text,
                )
            return cls("unix", path=text)
        url = urlsplit(text)
        try:
            port = url.port
        except ValueError:
            port = -1
        if (
            url.scheme not in ("http", "https")
            or not url.hostname
            or port == -1
            or url.path not in ("", "/")
            or url.query
            or url.username
        ):
            raise InvalidSpec(
                f"bad address {text!r}: expected unix:///path, http://host:port "
                "or https://host:port",
                address=text,
            )
        return cls(url.scheme, url.hostname, port or (443 if url.scheme == "https" else 80))

    @property
    def tcp(self) -> bool:
        return self.scheme != "unix"

    def __str__(self) -> str:
        if not self.tcp:
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def ssl_context(verify: bool | str | os.PathLike[str] = True) -> ssl.SSLContext:
    """A client TLS context: the system's CAs (True), one CA file (a path), or none (False)."""
    if verify is False:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if verify is True:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=os.fspath(verify))
    except (OSError, ssl.SSLError) as e:
        raise InvalidSpec(f"cannot load CA file {verify}: {e}", path=os.fspath(verify)) from e


@dataclass(frozen=True)
class Response:
    status_code: int
    content: bytes
    headers: Mapping[str, str]
    keep_alive: bool = True

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


# --- sans-IO: the bytes of a request, and a parser fed the bytes of a response ---------------


def request_head(address: Address, token: str | None) -> bytes:
    """The header lines every request to ``address`` carries (host, authorization)."""
    host = "dsec" if not address.tcp else str(address).split("://", 1)[1]
    head = f"host: {host}\r\n"
    if token:
        if any(c in token for c in "\r\n\0"):
            raise InvalidSpec("an API token must not contain line breaks")
        head += f"authorization: Bearer {token}\r\n"
    return head.encode()


def header_lines(headers: Mapping[str, str]) -> bytes:
    """``headers`` as request header lines (``InvalidSpec`` for a line break in one)."""
    out = []
    for key, value in headers.items():
        if any(c in key + value for c in "\r\n\0"):
            raise InvalidSpec(f"header {key!r} must not contain line breaks")
        out.append(f"{key}: {value}\r\n".encode("latin-1"))
    return b"".join(out)


def request_bytes(
    method: str, target: str, head: bytes, body: bytes | None, content_type: str | None
) -> bytes:
    if body is None:
        extra = b"content-length: 0\r\n" if method in ("POST", "PUT") else b""
        return b"%s %s HTTP/1.1\r\n%s%s\r\n" % (method.encode(), target.encode(), head, extra)
    return b"%s %s HTTP/1.1\r\n%scontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        method.encode(),
        target.encode(),
        head,
        (content_type or "").encode(),
        len(body),
        body,
    )


def stream_request_head(
    method: str,
    target: str,
    head: bytes,
    content_type: str | None,
    length: int | None,
    extra: Mapping[str, str] | None = None,
) -> bytes:
    """The head of a request whose body follows separately: ``length`` bytes of it (0: none),
    or chunked when ``length`` is None (``chunk`` frames each piece)."""
    lines = [b"%s %s HTTP/1.1\r\n" % (method.encode(), target.encode()), head]
    if extra:
        lines.append(header_lines(extra))
    if content_type:
        lines.append(b"content-type: %s\r\n" % content_type.encode())
    if length is None:
        lines.append(b"transfer-encoding: chunked\r\n")
    elif length or method in ("POST", "PUT", "PATCH"):
        lines.append(b"content-length: %d\r\n" % length)
    lines.append(b"\r\n")
    return b"".join(lines)


def chunk(piece: bytes) -> bytes:
    """One piece of a chunked request body (an empty piece ends the body)."""
    return b"%x\r\n%s\r\n" % (len(piece), piece)


@contextlib.contextmanager
def _closed_on_failure(
    close: Callable[[], object], where: Address, parser: ResponseParser, timeout: float | None
) -> Iterator[None]:
    """Around a streamed request's send and the wait for its head: on any failure the
    connection is closed (it is mid-exchange), and what went wrong becomes the transport's
    error (a timeout, or a connection the node dropped before or during its answer)."""
    try:
        yield
    except TimeoutError as e:
        close()
        raise TransportTimeout(f"{where}: no answer within {timeout}s") from e
    except TransportError:
        close()
        raise
    except OSError as e:
        close()
        if not parser.received:
            raise _Stale(f"{where}: {e}") from e
        raise _Broken(f"{where}: {e}") from e
    except BaseException:
        close()
        raise


class ResponseParser:
    """Reads one HTTP/1.1 response from the bytes fed to it; knows nothing of sockets."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._status = 0
        self._headers: dict[str, str] = {}
        self._mode = "head"  # head | length | chunk-size | chunk-data | trailer | close
        self._need = 0
        self._parts: list[bytes] = []
        self._http10 = False
        self.received = False  # any byte of an answer
        self.head_done = False  # the status and headers are known (``status``, ``headers``)

    def feed(self, data: bytes) -> Response | None:
        """Add what the socket gave; the response once it is complete, else None."""
        if data:
            self.received = True
            if self._mode == "head" and not self._buf:
                # The common case, a whole small answer in one read: no buffer copies.
                end = data.find(b"\r\n\r\n")
                if end >= 0:
                    self._head(data[:end])
                    start = end + 4
                    if self._mode == "length" and len(data) - start >= self._need:
                        self._parts.append(data[start : start + self._need])
                        return self._done()
                    data = data[start:]
            self._buf += data
        return self._advance()

    def _advance(self) -> Response | None:
        while True:
            mode = self._mode
            if mode == "head":
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buf) > _MAX_HEAD:
                        raise TransportError("response head too large")
                    return None
                self._head(bytes(self._buf[:end]))
                del self._buf[: end + 4]
            elif mode == "length":
                if len(self._buf) < self._need:
                    return None
                self._parts.append(bytes(self._buf[: self._need]))
                del self._buf[: self._need]
                return self._done()
            elif mode == "chunk-size":
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return None
                try:
                    size = int(bytes(self._buf[:end]).split(b";")[0], 16)
                except ValueError:
                    raise TransportError("malformed chunk size in the response") from None
                del self._buf[: end + 2]
                self._mode, self._need = ("trailer", 0) if size == 0 else ("chunk-data", size)
            elif mode == "chunk-data":
                if len(self._buf) < self._need + 2:
                    return None
                self._parts.append(bytes(self._buf[: self._need]))
                del self._buf[: self._need + 2]
                self._mode = "chunk-size"
            elif mode == "trailer":
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return None
                del self._buf[: end + 2]
                if end == 0:
                    return self._done()
            else:  # "close": the body runs until the server closes the connection
                self._parts.append(bytes(self._buf))
                self._buf.clear()
                return None

    def eof(self) -> Response:
        """The server closed the connection: the response if it ends there."""
        if self._mode == "close":
            return self._done(keep_alive=False)
        if not self.received:
            raise _Stale("the connection was closed without an answer")
        raise _Broken("the node closed the connection mid-response")

    def _head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        try:
            version, code = lines[0].split(" ", 2)[:2]
            self._status = int(code)
        except ValueError:
            raise TransportError(f"malformed status line: {lines[0][:100]!r}") from None
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        if 100 <= self._status < 200:  # an interim answer: the real one follows
            return
        self.head_done = True
        self._headers = headers
        self._http10 = version == "HTTP/1.0"
        if self._status in (204, 304):
            self._mode, self._need = "length", 0
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            self._mode = "chunk-size"
        elif "content-length" in headers:
            try:
                self._mode, self._need = "length", int(headers["content-length"])
            except ValueError:
                raise TransportError("malformed content-length in the response") from None
        else:
            self._mode = "close"

    @property
    def status(self) -> int:
        return self._status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    def drain(self) -> bytes:
        """The body bytes parsed so far and not yet taken (streaming: the caller takes the
        body piece by piece; the finished ``Response`` then holds only the rest)."""
        if not self._parts:
            return b""
        out = b"".join(self._parts)
        self._parts.clear()
        return out

    def _done(self, keep_alive: bool = True) -> Response:
        conn = self._headers.get("connection", "").lower()
        keep_alive = keep_alive and conn != "close" and (not self._http10 or conn == "keep-alive")
        content = b"".join(self._parts)
        self._parts.clear()  # a streaming caller takes the rest from the Response
        return Response(self._status, content, self._headers, keep_alive)


# --- the blocking twin -------------------------------------------------------------------------


def _closed_by_peer(sock: Any) -> bool:
    """Whether an idle kept-alive connection has something to read: the node closed it (a
    restart, an idle timeout) or sent what no request asked for. Either way it is no use."""
    poller = select.poll()  # not select(): a client may hold more than 1024 descriptors
    try:
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class HTTPTransport:
    """Blocking requests to one node; thread-safe, with a pool of kept-alive connections.

    ``retry`` is how many seconds a request keeps trying while the node is away (see the
    module's docstring); 0 gives up at the first failure."""

    def __init__(
        self,
        address: Address | str,
        *,
        token: str | None = None,
        verify: bool | str | os.PathLike[str] = True,
        retry: float = 0.0,
    ) -> None:
        self.address = address if isinstance(address, Address) else Address.parse(address)
        self._head = request_head(self.address, token)
        self._ssl = ssl_context(verify) if self.address.scheme == "https" else None
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self.retry = retry

    def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
        timeout: float | None = None,
        idempotent: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        head = self._head + header_lines(headers) if headers else self._head
        data = request_bytes(method, target, head, body, content_type)
        backoff = _Retry(self.retry)
        while True:
            try:
                return self._exchange(self._take() or self._connect(timeout), data, timeout)
            except TransportTimeout:
                raise
            except TransportError as e:
                if not _may_retry(e, idempotent):
                    raise
                self.close()  # whatever else is pooled went the same way
                time.sleep(backoff.next_pause(e))

    def _take(self) -> socket.socket | None:
        """A pooled connection the node has not closed, if there is one."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn = self._idle.pop()
            if not _closed_by_peer(conn):
                return conn
            conn.close()

    def _connect(self, timeout: float | None) -> socket.socket:
        a = self.address
        try:
            if not a.tcp:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                try:
                    sock.settimeout(timeout)
                    sock.connect(a.path)
                except BaseException:
                    sock.close()
                    raise
                return sock
            sock = socket.create_connection((a.host, a.port), timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=a.host)
            return sock
        except TimeoutError as e:
            raise TransportTimeout(f"{a}: no connection within {timeout}s") from e
        except OSError as e:
            raise _failed(a, e) from e

    def _exchange(self, sock: socket.socket, data: bytes, timeout: float | None) -> Response:
        parser = ResponseParser()
        try:
            sock.settimeout(timeout)
            try:
                sock.sendall(data)
            except TimeoutError:
                raise
            except OSError as e:  # the node cannot have read a whole request
                raise _failed(self.address, e) from e
            response = None
            while response is None:
                chunk = sock.recv(_READ)
                response = parser.feed(chunk) if chunk else parser.eof()
        except TimeoutError as e:
            sock.close()
            raise TransportTimeout(f"{self.address}: no answer within {timeout}s") from e
        except TransportError:
            sock.close()
            raise
        except OSError as e:
            sock.close()
            if not parser.received:  # reset before any answer: stale
                raise _Stale(f"{self.address}: {e}") from e
            raise _Broken(f"{self.address}: {e}") from e
        except BaseException:
            sock.close()
            raise
        if response.keep_alive:
            with self._lock:
                self._idle.append(sock)
        else:
            sock.close()
        return response

    def stream(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> StreamedResponse:
        """The blocking twin of ``AsyncHTTPTransport.stream`` (the body sent whole)."""
        length = len(body) if body is not None else 0
        data = stream_request_head(method, target, self._head, content_type, length, headers)
        sock = self._take() or self._connect(timeout)
        parser = ResponseParser()
        done = None
        with _closed_on_failure(sock.close, self.address, parser, timeout):
            sock.settimeout(timeout)
            sock.sendall(data + (body or b""))
            while not parser.head_done and done is None:
                data = sock.recv(_READ)
                done = parser.feed(data) if data else parser.eof()
            sock.settimeout(None)
        return StreamedResponse(self, sock, parser, done)

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


class StreamedResponse:
    """An answer whose body is read as it is iterated (``HTTPTransport.stream``)."""

    def __init__(
        self,
        transport: HTTPTransport,
        sock: socket.socket,
        parser: ResponseParser,
        done: Response | None,
    ) -> None:
        self._transport, self._sock, self._parser, self._done = transport, sock, parser, done
        self.status_code = parser.status
        self.headers = parser.headers
        self._closed = False

    def __enter__(self) -> StreamedResponse:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[bytes]:
        while True:
            piece = self._parser.drain()
            if piece:
                yield piece
            if self._done is not None:
                if self._done.content:
                    yield self._done.content
                return
            try:
                data = self._sock.recv(_READ)
                self._done = self._parser.feed(data) if data else self._parser.eof()
            except OSError as e:
                raise _Broken(f"{self._transport.address}: {e}") from e

    def read(self) -> bytes:
        return b"".join(self)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done is not None and self._done.keep_alive:
            self._transport._give_back(self._sock)
        else:
            self._sock.close()


# --- the asyncio twin --------------------------------------------------------------------------


class AsyncHTTPTransport:
    """The asyncio twin of ``HTTPTransport`` (one event loop at a time)."""

    def __init__(
        self,
        address: Address | str,
        *,
        token: str | None = None,
        verify: bool | str | os.PathLike[str] = True,
        retry: float = 0.0,
    ) -> None:
        self.address = address if isinstance(address, Address) else Address.parse(address)
        self._head = request_head(self.address, token)
        self._ssl = ssl_context(verify) if self.address.scheme == "https" else None
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        #: every connection made, idle or in use (``abort`` closes them all)
        self._open: weakref.WeakSet[asyncio.StreamWriter] = weakref.WeakSet()
        self._aborts = 0  # a connection opened across an ``abort`` is closed at once
        self.retry = retry

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
        timeout: float | None = None,
        idempotent: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        head = self._head + header_lines(headers) if headers else self._head
        data = request_bytes(method, target, head, body, content_type)
        backoff = _Retry(self.retry)
        while True:
            try:
                async with asyncio.timeout(timeout):
                    return await self._exchange(self._take() or await self._connect(), data)
            except TimeoutError as e:
                raise TransportTimeout(f"{self.address}: no answer within {timeout}s") from e
            except TransportError as e:
                if not _may_retry(e, idempotent):
                    raise
                await self.aclose()
                await asyncio.sleep(backoff.next_pause(e))

    def _take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A pooled connection the node has not closed, if there is one."""
        while self._idle:
            reader, writer = conn = self._idle.pop()
            sock = writer.get_extra_info("socket")
            # Asked of the socket itself: the loop may not have run since the node closed it.
            if not (
                reader.at_eof()
                or writer.is_closing()
                or reader.exception() is not None
                or sock is None
                or _closed_by_peer(sock)
            ):
                return conn
            writer.close()
        return None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        a = self.address
        aborts = self._aborts
        try:
            if not a.tcp:
                conn = await asyncio.open_unix_connection(a.path, limit=_READ)
            else:
                conn = await asyncio.open_connection(
                    a.host,
                    a.port,
                    ssl=self._ssl,
                    limit=_READ,
                    server_hostname=a.host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise
        except OSError as e:
            raise _failed(a, e) from e
        if aborts != self._aborts:
            conn[1].close()
            raise TransportError(f"{a}: connection given up while it was being opened")
        self._open.add(conn[1])
        return conn

    async def _exchange(
        self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], data: bytes
    ) -> Response:
        reader, writer = conn
        parser = ResponseParser()
        sent = False
        try:
            writer.write(data)
            await writer.drain()
            sent = True
            response = None
            while response is None:
                chunk = await reader.read(_READ)
                response = parser.feed(chunk) if chunk else parser.eof()
        except TransportError:
            writer.close()
            raise
        except TimeoutError:
            writer.close()
            raise
        except OSError as e:
            writer.close()
            # A failed drain says only that the connection is lost, which the node may have
            # done after reading the whole request. A broken pipe left on the reader is the
            # send itself failing: then the node cannot have read a whole request.
            if not sent and isinstance(reader.exception(), BrokenPipeError):
                raise _Unsent(f"{self.address}: {reader.exception()}") from e
            if not parser.received:
                raise _Stale(f"{self.address}: {e}") from e
            raise _Broken(f"{self.address}: {e}") from e
        except BaseException:  # cancelled: the connection is mid-exchange, not reusable
            writer.close()
            raise
        if response.keep_alive:
            self._idle.append(conn)
        else:
            writer.close()
        return response

    async def stream(
        self,
        method: str,
        target: str,
        *,
        body: bytes | AsyncIterable[bytes] | None = None,
        length: int | None = None,
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncStreamedResponse:
        """Send a request whose body may come in pieces (``length`` bytes in all, or chunked
        when None) and return once the answer's head is in: its body is read as the caller
        iterates. ``timeout`` bounds the connect, the send and the wait for the head; reading
        the body has none (a command may print nothing for minutes). Never retried: the node
        may have acted on it. The caller must ``aclose`` the answer (``async with``)."""
        if isinstance(body, (bytes, bytearray, memoryview)):
            length = len(body) if length is None else length
        elif body is None:
            length = 0
        head = stream_request_head(method, target, self._head, content_type, length, headers)
        conn = self._take()
        if conn is None:
            try:
                async with asyncio.timeout(timeout):
                    conn = await self._connect()
            except TimeoutError as e:
                raise TransportTimeout(f"{self.address}: no connection within {timeout}s") from e
        reader, writer = conn
        parser = ResponseParser()
        done = None
        with _closed_on_failure(writer.close, self.address, parser, timeout):
            async with asyncio.timeout(timeout):
                if isinstance(body, (bytes, bytearray, memoryview)):
                    # with its head in one write: the node wakes once for the request, not
                    # for its head and again for its body
                    writer.write(head + bytes(body))
                else:
                    writer.write(head)
                if body is not None and not isinstance(body, (bytes, bytearray, memoryview)):
                    async for piece in body:
                        if piece:
                            writer.write(chunk(piece) if length is None else piece)
                            await writer.drain()
                    if length is None:
                        writer.write(chunk(b""))
                await writer.drain()
                while not parser.head_done and done is None:
                    data = await reader.read(_READ)
                    done = parser.feed(data) if data else parser.eof()
        return AsyncStreamedResponse(self, conn, parser, done)

    def _give_back(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self._idle.append(conn)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    def abort(self) -> None:
        """Close every connection, those in use too: each request waiting on one fails at
        once with a ``TransportError`` (the node is known to be gone, and an answer that
        would never come is not waited for)."""
        self._idle = []
        self._aborts += 1
        for writer in list(self._open):
            writer.close()


class AsyncStreamedResponse:
    """An answer whose body is read as it is iterated (``AsyncHTTPTransport.stream``).
    Its connection goes back to the pool only if the whole body was read."""

    def __init__(
        self,
        transport: AsyncHTTPTransport,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        parser: ResponseParser,
        done: Response | None,
    ) -> None:
        self._transport, self._conn, self._parser, self._done = transport, conn, parser, done
        self.status_code = parser.status
        self.headers = parser.headers
        self._closed = False

    @property
    def complete(self) -> bool:
        """The whole answer came with its head (nothing more to wait for)."""
        return self._done is not None

    async def __aenter__(self) -> AsyncStreamedResponse:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self._conn[0]
        while True:
            piece = self._parser.drain()
            if piece:
                yield piece
            if self._done is not None:
                if self._done.content:
                    yield self._done.content
                return
            try:
                data = await reader.read(_READ)
                self._done = self._parser.feed(data) if data else self._parser.eof()
            except OSError as e:
                raise _Broken(f"{self._transport.address}: {e}") from e

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        if self._done is not None:  # all of it came with the head: nothing to wait for
            piece = self._parser.drain()
            return piece + self._done.content if piece else self._done.content
        return b"".join([piece async for piece in self])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        writer = self._conn[1]
        if self._done is not None and self._done.keep_alive:
            self._transport._give_back(self._conn)
        else:
            writer.close()
