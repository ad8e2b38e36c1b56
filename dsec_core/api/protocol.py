"""The HTTP/1.1 protocol dsec's servers run under uvicorn: httptools' parser as uvicorn drives
it, with each request's line and headers bounded in size (431 ``HeadersTooLarge``) and in time
(408 ``RequestTimeout``), so a client cannot make a server hold a huge or never-ending request
head; a body that stalls abandoned whoever reads it (408), and one left unread after its answer
given a bounded time to finish.

uvicorn's own httptools protocol has neither bound: the parser gathers a header of any length
in memory, and a connection that trickles its head a byte at a time is held for ever. Here the
bytes of a head are counted before the parser sees them, and it is never fed more than the
limit: what a head holds in memory stays under ``max_header_bytes`` (plus one read of the
socket when a head follows a body in the same read). A refusal is the API's typed error body
(``{"error": {"type", "message", "context"}}``), written in order after any answers still due
on the connection (HTTP/1.1 answers in order), then the connection is shut for writing and
what the client still sends is read and dropped for up to ``LINGER`` seconds before it closes:
a client still sending its oversized head then reads the answer rather than a reset.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ..errors import DsecError, HeadersTooLarge, RequestTimeout
from .routes import JSON, dump_json

__all__ = ["LINGER", "BoundedHttpProtocol", "bounded_protocol"]

log = logging.getLogger("dsec.api")

#: How long a refused connection is read (and dropped) after its answer, before it closes.
LINGER = 2.0


class _HeadHeld:
    """The connection's transport as one answer is written through it: the head is held
    until the body's first piece, which goes with it in one write, so a whole small answer
    is one send and wakes its reader once (uvicorn writes the head at once, and the reader
    woke for it alone, then again for the body). A head whose body does not follow in the
    same turn of the loop (a streamed answer still waiting for its first piece) goes out
    alone at the end of that turn. Every answer but one to HEAD ends with a write of its body
    (empty or not), so nothing the server writes after an answer can pass its head."""

    __slots__ = ("_held", "_loop", "_transport", "_used")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._used = False

    def write(self, data: bytes) -> None:
        if not self._used:  # the first write of the answer: its head (or a 100 Continue)
            self._used = True
            self._held = data
            self._loop.call_soon(self._flush)
            return
        if self._held is not None:
            data, self._held = self._held + data, None
        self._transport.write(data)

    def _flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with request heads and bodies bounded as its class
    attributes say (``bounded_protocol`` makes a subclass with the server's own)."""

    #: The most bytes of a request's line and headers (``DSEC_MAX_HEADER_BYTES``).
    max_header_bytes = 64 << 10
    #: Seconds from a head's first byte (or the connection's opening) to its end.
    header_timeout = 10.0
    #: Seconds a body may stall (``DSEC_BODY_TIMEOUT``); see ``_check_body``.
    body_timeout = 30.0

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._in_head = True  # the next bytes are (part of) a request's line and headers
        self._head_begun = False  # the parser has seen a request begin and not its headers end
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._refused = False  # a refusal is out or due: what comes now is dropped
        # a body's last byte, and the timer that abandons a body stalled while it is read
        self._body_seen = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_check = self.body_timeout / 4
        self._refusal: bytes | None = None  # due once the answers before it are out
        self._linger: asyncio.TimerHandle | None = None

    # --- the connection -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # a connection opened and left silent is as slow a head as one trickled
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._idle_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._idle_timer = self._linger = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: read and dropped
        self._feed(data)
        if self.transport.is_closing():
            return
        # Timers only for what is left incomplete: a request that came whole costs none.
        if self._in_head:
            if self._head_begun or self._head_bytes:
                self._arm_head_timer()
        elif self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self._idle_check, self._check_body)

    def _feed(self, data: bytes) -> None:
        while data:
            if not self._in_head:
                self._body_seen = self.loop.time()
                super().data_received(data)
                return
            room = self.max_header_bytes - self._head_bytes
            if room <= 0:
                self._refuse(self._too_large())
                return
            piece, data = (data, b"") if len(data) <= room else (data[:room], data[room:])
            self._head_bytes += len(piece)
            super().data_received(piece)  # may end this head, a body, and begin the next head
            if self.transport.is_closing():  # the parser refused it (uvicorn's 400)
                return

    # --- the parser's callbacks -----------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = self._head_begun = True

    def on_headers_complete(self) -> None:
        self._in_head = self._head_begun = False
        self._body_seen = self.loop.time()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        cycle = self.cycle
        # (an answer to HEAD has no body to wait for: its head goes as it is)
        if (
            cycle is not None
            and cycle.transport is self.transport
            and self.scope["method"] != "HEAD"
        ):
            cycle.transport = _HeadHeld(self.transport, self.loop)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0
        for timer in (self._body_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._body_timer = self._idle_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._refusal is not None and not self._answer_due():
            answer, self._refusal = self._refusal, None
            self._send_refusal(answer)
        elif not self._in_head and self._body_timer is None:
            # answered before its body was all read: the body gets body_timeout to finish
            # (uvicorn drops it as it comes), else the connection closes
            self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out)

    # --- refusing -------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self._refused or self.transport.is_closing():
            return
        if self._answer_due():
            # a pipelined head waits behind an answer still going out: its time runs from then
            self._arm_head_timer()
            return
        limit = self.header_timeout
        self._refuse(
            RequestTimeout(
                f"the request's line and headers did not arrive within {limit:g} s "
                f"({self._head_bytes} bytes came; DSEC_HEADER_TIMEOUT)",
                timeout=limit,
                received=self._head_bytes,
            )
        )

    def _check_body(self) -> None:
        """A body being read that stalls for twice ``body_timeout`` is abandoned, whoever reads
        it: the app's ``receive`` says the client left, and the client gets 408. (A reader
        that bounds its own wait, ``body_pieces``, answers 408 itself well before.) Time the
        server does not read (its buffer full, a pipelined request waiting) does not count."""
        self._idle_timer = None
        if self._in_head or self._refused or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:
            self._body_seen = now
        if now - self._body_seen < 2 * self.body_timeout:
            self._idle_timer = self.loop.call_later(self._idle_check, self._check_body)
            return
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        limit = 2 * self.body_timeout
        log.warning("abandoned a request body that stalled for %g s", limit)
        cycle.disconnected = True  # what the app sends from now on goes nowhere
        cycle.message_event.set()
        self._refused = True
        self._send_refusal(
            self._answer(
                RequestTimeout(
                    f"no byte of the request body came for {limit:g} s (DSEC_BODY_TIMEOUT)",
                    timeout=limit,
                )
            )
        )

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._in_head and not self._answer_due():
            self.transport.close()

    def _too_large(self) -> HeadersTooLarge:
        limit = self.max_header_bytes
        return HeadersTooLarge(
            f"the request's line and headers are over {limit} bytes (DSEC_MAX_HEADER_BYTES)",
            field="headers",
            limit=limit,
        )

    def _answer_due(self) -> bool:
        """Whether an answer to an earlier request on this connection is still to go out
        (``cycle`` is the newest request parsed; answers go out in order)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, err: DsecError) -> None:
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("%s: %s", client, err.message)
        self._refused = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        answer = self._answer(err)
        if self._answer_due():
            self._refusal = answer  # on_response_complete sends it in its turn
        else:
            self._send_refusal(answer)

    def _answer(self, err: DsecError) -> bytes:
        body = dump_json({"error": err.to_wire()})
        head = [STATUS_LINE[err.http_status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: " + JSON.encode() + b"\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        return b"".join(head) + body

    def _send_refusal(self, answer: bytes) -> None:
        self._unset_keepalive_if_required()
        transport = self.transport
        transport.write(answer)
        if not transport.can_write_eof():  # TLS: no half-close, so no linger
            transport.close()
            return
        transport.write_eof()
        self.flow.resume_reading()
        self._linger = self.loop.call_later(LINGER, transport.close)


def bounded_protocol(
    max_header_bytes: int, header_timeout: float, body_timeout: float
) -> type[BoundedHttpProtocol]:
    """The protocol class for uvicorn's ``http=`` option, with these bounds."""
    bounds = {
        "max_header_bytes": max_header_bytes,
        "header_timeout": header_timeout,
        "body_timeout": body_timeout,
    }
    return type("BoundedHttpProtocol", (BoundedHttpProtocol,), bounds)
