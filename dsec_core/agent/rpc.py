"""``AgentClient``: the asyncio client of one sandbox's ``dsec-agent`` over its unix socket.

Wire protocol (the full table is at the top of ``agent/src/wire.c``): one request and one response
per connection. Each is a header frame ``u32le n`` + ``n`` bytes of fields, every field
``u8 klen, key, u32le vlen, value`` (keys repeat for lists, numbers are ASCII decimal), followed
by ``body_len`` raw bytes (stdin, file data, or stdout++stderr). Unix connects cost microseconds,
so there is no connection pooling; a cancelled call closes its connection and the agent kills
the command it was running. Bodies over 8 MiB are split into several offset reads/writes
because the agent refuses frames over 16 MiB.

Replies are untrusted input: the agent runs inside the sandbox. Each call knows how large its
answer can be (a few fields; a directory listing; ``max_output`` bytes per stream; the length it
asked to read), so the reply's header and body lengths are checked against that before
anything is read, and what is read grows with the bytes that really arrive, in pieces of at
most ``RECV_PIECE``. A reply that breaks those limits or the field encoding raises
``AgentProtocolError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import socket
import struct
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from ..errors import (
    AgentProtocolError,
    AgentUnresponsive,
    InvalidSpec,
    SandboxError,
    SandboxNotRunning,
    SandboxPathError,
    SessionClosed,
    UnknownSession,
)
from ..records import ExecResult, FileEntry

__all__ = [
    "CHUNK",
    "MAX_FRAME",
    "MAX_OUTPUT",
    "RECV_PIECE",
    "REPLY_HEADER",
    "AgentClient",
    "AgentProcess",
]

MAX_FRAME = 16 << 20  # the agent refuses headers and bodies above this
CHUNK = 8 << 20  # file transfers are split into pieces of this size
MAX_OUTPUT = 16 << 20  # the agent keeps at most this much of each output stream
#: the largest reply header of an operation that answers with a few fields (everything but
#: directory listings and session lists, which may take up to MAX_FRAME)
REPLY_HEADER = 64 << 10
#: replies are read in pieces of at most this size, so memory follows the bytes that arrive
RECV_PIECE = 1 << 20
#: a call with a timeout gives up this long after it (the agent's own kill and grace
#: steps take a few seconds at most), so a frozen agent cannot hang the caller forever
_TIMEOUT_SLACK = 15.0

_TYPES = {b"f": "file", b"d": "dir", b"l": "symlink", b"o": "other"}
_Fields = dict[str, list[bytes]]


def _encode(fields: Sequence[tuple[str, Any]]) -> bytes:
    parts = []
    for key, value in fields:
        k = key.encode()
        if isinstance(value, bool):
            value = int(value)
        v = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogateescape")
        if b"\0" in v:
            raise InvalidSpec(f"{key} must not contain NUL bytes", field=key)
        parts.append(struct.pack("<B", len(k)) + k + struct.pack("<I", len(v)) + v)
    payload = b"".join(parts)
    if len(payload) > MAX_FRAME:
        raise InvalidSpec(
            f"request header of {len(payload)} bytes is over the agent's "
            f"{MAX_FRAME} byte limit (command or env too large)"
        )
    return struct.pack("<I", len(payload)) + payload


class _Malformed(ValueError):
    """A reply field that does not decode; ``_roundtrip`` turns it into AgentProtocolError."""


def _decode(payload: bytes) -> _Fields:
    out: _Fields = {}
    i, n = 0, len(payload)
    while i < n:
        kl = payload[i]
        if i + 1 + kl + 4 > n:
            raise _Malformed(f"truncated field at byte {i}")
        try:
            key = payload[i + 1 : i + 1 + kl].decode()
        except UnicodeDecodeError:
            raise _Malformed(f"undecodable key at byte {i}") from None
        i += 1 + kl
        (vl,) = struct.unpack_from("<I", payload, i)
        i += 4
        if i + vl > n:
            raise _Malformed(f"field {key!r} claims {vl} bytes past the header's end")
        out.setdefault(key, []).append(payload[i : i + vl])
        i += vl
    return out


def _one(fields: _Fields, key: str, default: bytes = b"") -> bytes:
    values = fields.get(key)
    return values[0] if values else default


def _num(fields: _Fields, key: str, default: int = 0) -> int:
    value = _one(fields, key)
    if not value:
        return default
    if len(value) > 20 or not value.lstrip(b"-").isdigit():
        raise _Malformed(f"field {key!r} is not a number: {value[:40]!r}")
    return int(value)


def _entry(value: bytes) -> FileEntry:
    kind, size, mode, sec, nsec, name = value.split(b" ", 5)
    return FileEntry(
        name=os.fsdecode(name),
        type=_TYPES.get(kind, "other"),
        size=int(size),
        mode=int(mode),
        mtime=int(sec) + int(nsec) / 1e9,
    )


def _env_fields(env: Mapping[str, str] | None) -> list[tuple[str, str]]:
    fields = []
    for key, value in (env or {}).items():
        if not key or "=" in key:
            raise InvalidSpec(f"bad environment variable name {key!r}", field="env")
        fields.append(("env", f"{key}={value}"))
    return fields


class AgentClient:
    """Talks to one sandbox's agent; every method is a coroutine and safe to run concurrently."""

    def __init__(self, socket_path: str | os.PathLike[str], sandbox_id: str = "") -> None:
        self.socket_path = str(socket_path)
        self.sandbox_id = sandbox_id

    def __repr__(self) -> str:
        return f"AgentClient({self.socket_path!r}, sandbox_id={self.sandbox_id!r})"

    # --- transport ---------------------------------------------------------------------------
    def _where(self) -> str:
        return f"sandbox {self.sandbox_id}" if self.sandbox_id else f"agent {self.socket_path}"

    def _gone(self, why: object) -> SandboxNotRunning:
        return SandboxNotRunning(
            f"{self._where()}: the agent is not reachable ({why})",
            sandbox_id=self.sandbox_id,
            socket=self.socket_path,
        )

    async def _call(
        self,
        fields: Sequence[tuple[str, Any]],
        body: bytes = b"",
        timeout: float | None = None,
        *,
        max_header: int = REPLY_HEADER,
        max_body: int = 0,
    ) -> tuple[_Fields, bytes]:
        """One request; the reply's header may take ``max_header`` bytes and its body
        ``max_body`` (what this request can legitimately get back), or AgentProtocolError."""
        limits = (max_header, max_body)
        if timeout is None:
            return await self._roundtrip(fields, body, limits)
        try:
            return await asyncio.wait_for(
                self._roundtrip(fields, body, limits), timeout + _TIMEOUT_SLACK
            )
        except TimeoutError:
            # wait_for closed our connection, which tells the agent to kill the command
            raise AgentUnresponsive(
                f"{self._where()}: the agent did not answer within {timeout + _TIMEOUT_SLACK:.0f}s",
                sandbox_id=self.sandbox_id,
            ) from None

    async def _roundtrip(
        self, fields: Sequence[tuple[str, Any]], body: bytes, limits: tuple[int, int]
    ) -> tuple[_Fields, bytes]:
        loop = asyncio.get_running_loop()
        sock, fields = await self._send(loop, fields, body)
        try:
            try:
                reply, rbody = await self._read_reply(loop, sock, fields, limits)
            except (OSError, EOFError) as e:
                raise self._gone(getattr(e, "strerror", None) or e) from e
        finally:
            sock.close()
        if "error" in reply:
            raise self._error(reply)
        return reply, rbody

    async def _send(
        self, loop: asyncio.AbstractEventLoop, fields: Sequence[tuple[str, Any]], body: bytes
    ) -> tuple[socket.socket, list[tuple[str, Any]]]:
        """Connect and send one request (its header, then ``body``); the connected socket,
        for the caller to read the reply from and close, and the fields as sent."""
        if len(body) > MAX_FRAME:
            raise InvalidSpec(
                f"request body of {len(body)} bytes is over the agent's {MAX_FRAME} byte limit"
            )
        fields = list(fields)
        if body:
            fields.append(("body_len", len(body)))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.socket_path)
            await loop.sock_sendall(sock, _encode(fields))
            if body:
                await loop.sock_sendall(sock, body)
        except OSError as e:
            sock.close()
            raise self._gone(e.strerror or e) from e
        except BaseException:
            sock.close()
            raise
        return sock, fields

    async def _read_reply(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        fields: Sequence[tuple[str, Any]],
        limits: tuple[int, int],
    ) -> tuple[_Fields, bytes]:
        max_header, max_body = limits
        op = next((str(v) for k, v in fields if k == "op"), "?")
        (hlen,) = struct.unpack("<I", await self._recv(loop, sock, 4))
        if hlen > max_header:
            raise self._forged(f"a {hlen} byte reply header to {op} (at most {max_header})")
        try:
            reply = _decode(await self._recv(loop, sock, hlen))
            body_len = _num(reply, "body_len")
        except _Malformed as e:
            raise self._forged(f"a malformed reply to {op}: {e}") from None
        if not 0 <= body_len <= max_body:
            raise self._forged(f"a {body_len} byte reply body to {op} (at most {max_body})")
        return reply, await self._recv(loop, sock, body_len)

    def _forged(self, what: str) -> AgentProtocolError:
        return AgentProtocolError(
            f"{self._where()}: the agent sent {what}; refused without reading it",
            sandbox_id=self.sandbox_id,
        )

    @staticmethod
    async def _recv(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
        """Exactly n bytes, read in pieces of at most RECV_PIECE: memory grows with what
        arrives, never with what the other side claims it will send."""
        if n <= RECV_PIECE:
            buf = bytearray(n)
            view = memoryview(buf)
            got = 0
            while got < n:
                k = await loop.sock_recv_into(sock, view[got:])
                if k == 0:
                    raise EOFError("the agent closed the connection mid-reply")
                got += k
            return bytes(buf)
        out = bytearray()
        while len(out) < n:
            piece = await loop.sock_recv(sock, min(RECV_PIECE, n - len(out)))
            if not piece:
                raise EOFError("the agent closed the connection mid-reply")
            out += piece
        return bytes(out)

    def _error(self, reply: _Fields) -> Exception:
        kind = _one(reply, "error").decode("utf-8", "replace")
        message = _one(reply, "message").decode("utf-8", "replace")
        where, sid = self._where(), self.sandbox_id
        if kind == "path":
            path = os.fsdecode(_one(reply, "path"))
            try:
                code = _num(reply, "errno")
            except _Malformed as e:
                return self._forged(f"a malformed error reply: {e}")
            return SandboxPathError(
                f"{where}: {path}: {message}", path=path, errno=code, sandbox_id=sid
            )
        if kind == "unknown_session":
            known = [s.decode("utf-8", "replace") for s in reply.get("session", [])]
            name = _one(reply, "name").decode("utf-8", "replace")
            return UnknownSession(f"{where}: {message}", name=name, known=known, sandbox_id=sid)
        if kind == "session_closed":
            return SessionClosed(f"{where}: {message}", sandbox_id=sid)
        if kind == "bad_request":
            return InvalidSpec(f"{where}: agent refused the request: {message}", sandbox_id=sid)
        return SandboxError(f"{where}: agent error: {message}", sandbox_id=sid)

    def _result(self, reply: _Fields, body: bytes, command: str, max_output: int) -> ExecResult:
        try:
            n = _num(reply, "stdout_len")
            if not (0 <= n <= len(body) and n <= max_output and len(body) - n <= max_output):
                raise _Malformed(f"{n} of {len(body)} bytes as stdout, at most {max_output} each")
            return ExecResult(
                exit_code=_num(reply, "exit_code"),
                stdout=body[:n],
                stderr=body[n:],
                duration=_num(reply, "duration_us") / 1e6,
                truncated=bool(_num(reply, "truncated")),
                timed_out=bool(_num(reply, "timed_out")),
                command=command,
                sandbox_id=self.sandbox_id,
                cpu_time=_num(reply, "cpu_us") / 1e6 if "cpu_us" in reply else None,
                max_rss=_num(reply, "maxrss_kb") << 10 if "maxrss_kb" in reply else None,
            )
        except _Malformed as e:
            raise self._forged(f"a malformed exec result: {e}") from None

    @staticmethod
    def _output_cap(max_output: int) -> int:
        """The per-stream cap the agent applies: ``max_output`` clamped to [0, MAX_OUTPUT]."""
        return min(max(0, int(max_output)), MAX_OUTPUT)

    @staticmethod
    def _timeout_ms(timeout: float | None) -> int:
        if timeout is None:
            return 0
        if timeout <= 0:
            raise InvalidSpec(
                f"timeout must be positive seconds or None, got {timeout}", field="timeout"
            )
        return max(1, int(timeout * 1000))

    # --- API ---------------------------------------------------------------------------------
    async def ping(self) -> dict[str, Any]:
        """The agent's pid (in its pid namespace), version and number of open sessions."""
        reply, _ = await self._call([("op", "ping")])
        try:
            return {
                "pid": _num(reply, "pid"),
                "version": _one(reply, "version").decode("utf-8", "replace"),
                "sessions": _num(reply, "sessions"),
            }
        except _Malformed as e:
            raise self._forged(f"a malformed ping reply: {e}") from None

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
        background: bool = False,
        exclusive: bool = False,
    ) -> ExecResult:
        """Run a command: a string through ``/bin/sh -c``, a list directly (PATH lookup).

        ``env`` is merged over PATH/HOME/LANG defaults; ``cwd`` defaults to ``/``; ``stdin``
        None means /dev/null. A missing command gives exit code 127, a non-executable one 126,
        death by signal N 128+N. Output past ``max_output`` bytes per stream (at most 16 MiB) is
        dropped (``truncated``); at ``timeout`` the whole process tree is killed (``timed_out``,
        exit code 137). When the command exits, every process it left running is killed before
        the result comes back, unless ``background``: then they keep running (until they end,
        a later ``exclusive`` call, or the sandbox dies). ``exclusive`` first kills every other
        process in the sandbox (other calls' commands, sessions, background jobs), so nothing
        that ran before can tamper with this command while it runs: run verifiers this way.
        """
        fields, command = self._exec_fields(
            cmd, timeout, cwd, env, stdin, max_output, background, exclusive
        )
        cap = self._output_cap(max_output)
        reply, body = await self._call(fields, bytes(stdin or b""), timeout, max_body=2 * cap)
        return self._result(reply, body, command, cap)

    def _exec_fields(
        self,
        cmd: str | Sequence[str],
        timeout: float | None,
        cwd: str | None,
        env: Mapping[str, str] | None,
        stdin: bytes | None,
        max_output: int,
        background: bool,
        exclusive: bool,
    ) -> tuple[list[tuple[str, Any]], str]:
        if isinstance(cmd, str):
            argv, command = ["/bin/sh", "-c", cmd], cmd
        else:
            argv = [os.fspath(a) for a in cmd]
            if not argv:
                raise InvalidSpec("exec needs a non-empty command")
            command = shlex.join(argv)
        fields: list[tuple[str, Any]] = [("op", "exec")]
        fields += [("arg", a) for a in argv]
        fields += _env_fields(env)
        fields += [
            ("cwd", cwd or "/"),
            ("timeout_ms", self._timeout_ms(timeout)),
            ("max_output", max(0, int(max_output))),
        ]
        if stdin is not None:
            fields.append(("stdin", 1))
        if background:
            fields.append(("background", 1))
        if exclusive:
            fields.append(("exclusive", 1))
        return fields, command

    async def exec_stream(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
        background: bool = False,
        exclusive: bool = False,
    ) -> AsyncIterator[tuple[str, bytes] | ExecResult]:
        """``exec``, with the output as it comes: ``("stdout" | "stderr", bytes)`` pieces, then
        the ``ExecResult`` (its stdout and stderr empty). ``max_output`` bounds each stream's
        total as in ``exec``. Closing the iterator early closes the connection, and the agent
        kills the command. An agent older than streaming answers at the end only: its output
        then comes as one piece per stream before the result."""
        fields, command = self._exec_fields(
            cmd, timeout, cwd, env, stdin, max_output, background, exclusive
        )
        fields.append(("stream", 1))
        cap = self._output_cap(max_output)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout + _TIMEOUT_SLACK
        sock, fields = await self._send(loop, fields, bytes(stdin or b""))
        try:
            sent = {b"out": 0, b"err": 0}
            while True:
                read = self._read_reply(loop, sock, fields, (REPLY_HEADER, 2 * cap))
                try:
                    if deadline is None:
                        reply, rbody = await read
                    else:
                        reply, rbody = await asyncio.wait_for(read, deadline - loop.time())
                except TimeoutError:
                    raise AgentUnresponsive(
                        f"{self._where()}: the agent did not answer within "
                        f"{timeout + _TIMEOUT_SLACK:.0f}s",  # type: ignore[operator]
                        sandbox_id=self.sandbox_id,
                    ) from None
                except (OSError, EOFError) as e:
                    raise self._gone(getattr(e, "strerror", None) or e) from e
                if "error" in reply:
                    raise self._error(reply)
                if "chunk" in reply:
                    which = _one(reply, "chunk")
                    if which not in sent or sent[which] + len(rbody) > cap:
                        raise self._forged(f"an output chunk beyond the {cap} byte cap")
                    sent[which] += len(rbody)
                    yield ("stdout" if which == b"out" else "stderr", rbody)
                    continue
                result = self._result(reply, rbody, command, cap)
                if result.stdout:
                    yield ("stdout", result.stdout)
                if result.stderr:
                    yield ("stderr", result.stderr)
                yield dataclasses.replace(result, stdout=b"", stderr=b"")
                return
        finally:
            sock.close()

    async def exec_interactive(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
        max_output: int = 1 << 20,
        background: bool = False,
    ) -> AgentProcess:
        """Start a command that takes input, resizes and signals while it runs (the agent's
        ``interactive=1``): its stdin a pipe that stays open (``stdin``; else /dev/null), or a
        new pseudo-terminal of ``pty`` = (rows, cols) as its controlling tty on fds 0-2. The
        ``AgentProcess`` holds the connection: closing it kills the command. ``max_output``
        bounds each piece of output, not the total."""
        fields, command = self._exec_fields(
            cmd, timeout, cwd, env, b"" if stdin else None, max_output, background, False
        )
        fields.append(("interactive", 1))
        if pty is not None:
            rows, cols = pty
            fields += [("pty", 1), ("rows", int(rows)), ("cols", int(cols))]
        loop = asyncio.get_running_loop()
        sock, fields = await self._send(loop, fields, b"")
        try:
            try:
                reply, _ = await asyncio.wait_for(
                    self._read_reply(loop, sock, fields, (REPLY_HEADER, 0)), _TIMEOUT_SLACK
                )
            except TimeoutError:
                raise SandboxError(
                    f"{self._where()}: the agent did not start the command within "
                    f"{_TIMEOUT_SLACK:.0f}s",
                    sandbox_id=self.sandbox_id,
                ) from None
            except (OSError, EOFError) as e:
                raise self._gone(getattr(e, "strerror", None) or e) from e
            if "error" in reply:
                raise self._error(reply)
            try:
                pid = _num(reply, "pid")
            except _Malformed as e:
                raise self._forged(f"a malformed start of an interactive command: {e}") from None
            if "started" not in reply or pid <= 0:
                raise self._forged("an interactive command's start without its pid")
        except BaseException:
            sock.close()
            raise
        return AgentProcess(self, sock, fields, command, self._output_cap(max_output), pid)

    async def session_open(
        self,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        shell: str | None = None,
    ) -> str:
        """Start a persistent shell (bash if present, else sh); returns the session id."""
        fields: list[tuple[str, Any]] = [("op", "session_open"), ("cwd", cwd or "/")]
        fields += _env_fields(env)
        if shell:
            fields.append(("shell", shell))
        reply, _ = await self._call(fields, max_header=MAX_FRAME)
        return _one(reply, "session").decode("utf-8", "replace")

    async def session_exec(
        self,
        session_id: str,
        cmd: str,
        *,
        timeout: float | None = None,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
    ) -> ExecResult:
        """Run ``cmd`` in the session's shell; cwd, variables and functions persist.

        Calls on one session run one at a time in arrival order. Processes a command starts in
        the background (``server &``) keep running after it, until the session is closed or
        ends, or the sandbox dies. A timeout kills the command's processes (those it started,
        not earlier commands'); if the shell itself does not come back within a second it is
        killed and the session is over (later calls raise ``SessionClosed``), as after ``exit``.
        """
        fields: list[tuple[str, Any]] = [
            ("op", "session_exec"),
            ("session", session_id),
            ("cmd", cmd),
            ("timeout_ms", self._timeout_ms(timeout)),
            ("max_output", max(0, int(max_output))),
        ]
        if stdin is not None:
            fields.append(("stdin", 1))
        cap = self._output_cap(max_output)
        reply, body = await self._call(
            fields, bytes(stdin or b""), timeout, max_header=MAX_FRAME, max_body=2 * cap
        )
        return self._result(reply, body, cmd, cap)

    async def session_close(self, session_id: str) -> None:
        """Kill the session's shell and everything it started."""
        await self._call([("op", "session_close"), ("session", session_id)], max_header=MAX_FRAME)

    async def sessions(self) -> list[str]:
        """Ids of the sessions whose shells are still running."""
        reply, _ = await self._call([("op", "sessions")], max_header=MAX_FRAME)
        return [s.decode("utf-8", "replace") for s in reply.get("session", [])]

    async def read_file(
        self, path: str | os.PathLike[str], offset: int = 0, length: int = -1
    ) -> bytes:
        """Up to ``length`` bytes (-1: to the end) from ``offset``."""
        path = os.fspath(path)
        if offset < 0:
            raise InvalidSpec(f"offset must not be negative: {offset}", field="offset")
        parts, pos, left = [], offset, length
        while True:  # at least one request, so a bad path raises even for length 0
            want = CHUNK if left < 0 else min(CHUNK, left)
            reply, data = await self._call(
                [("op", "read"), ("path", path), ("offset", pos), ("length", want)],
                max_body=want,
            )
            parts.append(data)
            pos += len(data)
            if left > 0:
                left -= len(data)
            try:
                eof = _num(reply, "eof")
            except _Malformed as e:
                raise self._forged(f"a malformed read reply: {e}") from None
            if left == 0 or eof or len(data) < want:
                break
        return b"".join(parts)

    async def write_file(
        self,
        path: str | os.PathLike[str],
        data: bytes,
        *,
        mode: int = 0o644,
        offset: int = 0,
        truncate: bool = True,
        make_parents: bool = True,
    ) -> None:
        """Write ``data`` at ``offset``; ``truncate`` cuts the file at ``offset`` first.

        ``mode`` applies to a file this call creates (exactly, ignoring the umask); missing
        parent directories are made 0755 when ``make_parents``.
        """
        path = os.fspath(path)
        if offset < 0:
            raise InvalidSpec(f"offset must not be negative: {offset}", field="offset")
        view = memoryview(data)
        pos, first = 0, True
        while first or pos < len(view):
            piece = bytes(view[pos : pos + CHUNK])
            await self._call(
                [
                    ("op", "write"),
                    ("path", path),
                    ("mode", mode),
                    ("offset", offset + pos),
                    ("truncate", truncate and first),
                    ("parents", make_parents and first),
                ],
                piece,
            )
            pos += len(piece)
            first = False

    async def list_dir(self, path: str | os.PathLike[str]) -> list[FileEntry]:
        """Entries of a directory (lstat, without . and ..), sorted by name.

        ``mode`` is the permission bits (``st_mode & 0o7777``); the kind is in ``type``.
        """
        reply, _ = await self._call(
            [("op", "list"), ("path", os.fspath(path))], max_header=MAX_FRAME
        )
        return sorted((self._entry(v) for v in reply.get("entry", [])), key=lambda e: e.name)

    async def wake(
        self, seed: bytes, hostname: str | None = None, time_ns: int | None = None
    ) -> None:
        """For a VM guest started from a saved state: mix ``seed`` (1-256 bytes) into the
        kernel's random pool and reseed its CRNG, set ``hostname``, and set the clock to
        ``time_ns`` (nanoseconds since the epoch: the guest wakes with the clock of the
        instant it was saved). A container's root may do none of these."""
        fields: list[tuple[str, Any]] = [("op", "wake"), ("seed", seed.hex())]
        if hostname is not None:
            fields.append(("hostname", hostname))
        if time_ns is not None:
            fields.append(("time", str(int(time_ns))))
        await self._call(fields)

    async def reclaim(self, nbytes: int) -> int:
        """For a VM guest: reclaim ``nbytes`` of its coldest memory now (cgroup v2's
        ``memory.reclaim``), less if the rest is in use; returns how much its free memory grew
        (what free page reporting then gives the host back)."""
        reply, _ = await self._call([("op", "reclaim"), ("bytes", int(nbytes))])
        return _num(reply, "freed")

    async def ifup(
        self, address: str, prefixlen: int = 32, gateway: str | None = None, device: str = "eth0"
    ) -> None:
        """For a VM guest: give its network card ``device`` the IPv4 ``address``/``prefixlen``
        (replacing the one it had), bring it up, and route to ``gateway`` and through it by
        default; IPv6 goes off. A container's root may not."""
        fields: list[tuple[str, Any]] = [("op", "ifup"), ("dev", device)]
        fields += [("address", address), ("prefix", int(prefixlen))]
        if gateway is not None:
            fields.append(("gateway", gateway))
        await self._call(fields)

    async def freeze(self, on: bool, path: str | None = None, seconds: int = 60) -> bool:
        """For a VM guest: freeze (``on``) the filesystem at ``path`` (default the writable
        disk, bound at ``/.dsec/rw``: its data written out, its writes held) for at most
        ``seconds``, or thaw it. Returns whether it was frozen before a thaw (True after a
        freeze). A container's root may not."""
        fields: list[tuple[str, Any]] = [("op", "freeze"), ("on", int(on))]
        fields.append(("seconds", int(seconds)))
        if path is not None:
            fields.append(("path", path))
        reply, _ = await self._call(fields)
        return _one(reply, "frozen") == b"1"

    async def stat(self, path: str | os.PathLike[str]) -> FileEntry:
        """lstat of one path (a symlink is reported as a symlink)."""
        reply, _ = await self._call([("op", "stat"), ("path", os.fspath(path))])
        return self._entry(_one(reply, "entry"))

    def _entry(self, value: bytes) -> FileEntry:
        try:
            return _entry(value)
        except ValueError as e:
            raise self._forged(f"a malformed directory entry {value[:80]!r}: {e}") from None

    async def remove(self, path: str | os.PathLike[str], recursive: bool = False) -> None:
        """Remove a file, symlink or empty directory; ``recursive`` removes a tree."""
        await self._call([("op", "remove"), ("path", os.fspath(path)), ("recursive", recursive)])


class AgentProcess:
    """A command ``AgentClient.exec_interactive`` started, and its connection to the agent:
    ``events()`` reads its output as it comes (``("stdout" | "stderr", bytes)``) and then
    its ``ExecResult`` (stdout and stderr empty); ``send``, ``close_stdin``, ``resize`` and
    ``signal`` go to the agent while it runs. ``close()`` ends the connection, which kills
    the command if it still runs."""

    def __init__(
        self,
        client: AgentClient,
        sock: socket.socket,
        fields: Sequence[tuple[str, Any]],
        command: str,
        cap: int,
        pid: int,
    ) -> None:
        self.client, self.command, self.pid = client, command, pid
        self._sock, self._fields, self._cap = sock, fields, cap
        self._lock = asyncio.Lock()  # frames go out whole, one at a time
        self.closed = False

    async def events(self) -> AsyncIterator[tuple[str, bytes] | ExecResult]:
        c, loop = self.client, asyncio.get_running_loop()
        while True:
            try:
                reply, body = await c._read_reply(
                    loop, self._sock, self._fields, (REPLY_HEADER, 2 * self._cap)
                )
            except (OSError, EOFError) as e:
                raise c._gone(getattr(e, "strerror", None) or e) from e
            if "error" in reply:
                raise c._error(reply)
            if "chunk" in reply:
                which = _one(reply, "chunk")
                if which not in (b"out", b"err") or len(body) > self._cap:
                    raise c._forged(f"an output chunk beyond the {self._cap} byte cap")
                yield ("stdout" if which == b"out" else "stderr", body)
                continue
            result = c._result(reply, body, self.command, self._cap)
            if result.stdout:
                yield ("stdout", result.stdout)
            if result.stderr:
                yield ("stderr", result.stderr)
            yield dataclasses.replace(result, stdout=b"", stderr=b"")
            return

    async def _frame(self, fields: Sequence[tuple[str, Any]], body: bytes = b"") -> None:
        if self.closed:
            raise SandboxError(
                f"{self.client._where()}: command {self.pid} is over",
                sandbox_id=self.client.sandbox_id,
            )
        fields = [*fields, ("body_len", len(body))] if body else list(fields)
        loop = asyncio.get_running_loop()
        async with self._lock:
            try:
                await loop.sock_sendall(self._sock, _encode(fields) + body)
            except OSError as e:
                raise self.client._gone(e.strerror or e) from e

    async def send(self, data: bytes) -> None:
        """Input for the command's stdin (or terminal), in pieces of at most ``CHUNK``."""
        view = memoryview(data)
        for at in range(0, len(view), CHUNK):
            await self._frame([("in", 1)], bytes(view[at : at + CHUNK]))

    async def close_stdin(self) -> None:
        """End of input: stdin is closed once what was sent is written (a terminal gets its
        EOF character instead)."""
        await self._frame([("eof", 1)])

    async def resize(self, rows: int, cols: int) -> None:
        """A new size for the command's terminal (its process group gets SIGWINCH)."""
        await self._frame([("rows", int(rows)), ("cols", int(cols))])

    async def signal(self, signal: int) -> None:
        """Send ``signal`` (a number) to the command."""
        await self._frame([("signal", int(signal))])

    def close(self) -> None:
        """Close the connection: the agent kills the command if it still runs."""
        self.closed = True
        self._sock.close()
