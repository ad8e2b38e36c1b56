"""The SDK: ``Client`` (sync) and ``AsyncClient`` (asyncio) with the same methods.

Every call is described once as a ``_Call`` (HTTP method, path, body, how to read the answer);
the two clients only differ in how they send it. ``Client()`` with no address talks to the local
node daemon and starts it if none runs (the embedded single-node default).
"""

from __future__ import annotations

import asyncio
import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from .api.transport import (AsyncUnixTransport, Response, TransportError, TransportTimeout,
                            UnixTransport)
from .config import NodeConfig
from .errors import DsecError, ExecTimeout, InvalidSpec, NodeUnavailable, error_from_wire
from .localnode import ensure_daemon
from .records import ExecResult, FileEntry, LayerInfo, SandboxInfo, SandboxSpec, SandboxUsage

__all__ = ["Client", "AsyncClient", "Sandbox", "AsyncSandbox", "Session", "AsyncSession"]

CHUNK = 8 << 20  # file transfers move in pieces of this size
DEFAULT_MAX_OUTPUT = 1 << 20


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    params: Mapping[str, Any] | None = None
    timeout: float | None = 60.0
    parse: Callable[[Response], Any] = lambda r: r.json()
    exec_timeout: float | None = None  # a client-side read timeout here means ExecTimeout


def _spec(spec: SandboxSpec | None, kw: dict[str, Any]) -> SandboxSpec:
    if spec is None:
        return SandboxSpec(**kw)
    if kw:
        return SandboxSpec(**{**spec.to_dict(), **kw})
    return spec


def _exec_body(cmd: str | Sequence[str], timeout: float | None, cwd: str | None,
               env: Mapping[str, str] | None, stdin: bytes | str | None,
               max_output: int) -> dict[str, Any]:
    if isinstance(stdin, str):
        stdin = stdin.encode()
    if not isinstance(cmd, str):
        cmd = list(cmd)
    return {"cmd": cmd, "timeout": timeout, "cwd": cwd, "env": dict(env) if env else None,
            "stdin": base64.b64encode(stdin).decode() if stdin is not None else None,
            "max_output": max_output}


def _http_timeout(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + 30.0


class _Calls:
    """Builds the ``_Call`` of every API operation; shared by both clients."""

    @staticmethod
    def node() -> _Call:
        return _Call("GET", "/v1/node")

    @staticmethod
    def create(spec: SandboxSpec, count: int = 1) -> _Call:
        def parse(r: Response) -> tuple[list[SandboxInfo], list[DsecError]]:
            data = r.json()
            return ([SandboxInfo.from_dict(d) for d in data["sandboxes"]],
                    [error_from_wire(e) for e in data.get("errors", [])])
        return _Call("POST", "/v1/sandboxes", json={"spec": spec.to_dict(), "count": count},
                     timeout=300.0, parse=parse)

    @staticmethod
    def list() -> _Call:
        return _Call("GET", "/v1/sandboxes", parse=lambda r: [
            SandboxInfo.from_dict(d) for d in r.json()["sandboxes"]])

    @staticmethod
    def get(sid: str) -> _Call:
        return _Call("GET", f"/v1/sandboxes/{sid}", parse=lambda r: SandboxInfo.from_dict(r.json()))

    @staticmethod
    def kill(sid: str) -> _Call:
        return _Call("DELETE", f"/v1/sandboxes/{sid}", parse=lambda r: None)

    @staticmethod
    def usage(sid: str) -> _Call:
        return _Call("GET", f"/v1/sandboxes/{sid}/usage",
                     parse=lambda r: SandboxUsage.from_dict(r.json()))

    @staticmethod
    def exec(sid: str, body: dict[str, Any]) -> _Call:
        return _Call("POST", f"/v1/sandboxes/{sid}/exec", json=body,
                     timeout=_http_timeout(body["timeout"]), exec_timeout=body["timeout"],
                     parse=lambda r: ExecResult.from_dict(r.json()))

    @staticmethod
    def session_open(sid: str, cwd: str | None, env: Mapping[str, str] | None) -> _Call:
        return _Call("POST", f"/v1/sandboxes/{sid}/sessions",
                     json={"cwd": cwd, "env": dict(env) if env else None},
                     parse=lambda r: r.json()["session"])

    @staticmethod
    def sessions(sid: str) -> _Call:
        return _Call("GET", f"/v1/sandboxes/{sid}/sessions", parse=lambda r: r.json()["sessions"])

    @staticmethod
    def session_exec(sid: str, ses: str, body: dict[str, Any]) -> _Call:
        return _Call("POST", f"/v1/sandboxes/{sid}/sessions/{ses}/exec", json=body,
                     timeout=_http_timeout(body["timeout"]), exec_timeout=body["timeout"],
                     parse=lambda r: ExecResult.from_dict(r.json()))

    @staticmethod
    def session_close(sid: str, ses: str) -> _Call:
        return _Call("DELETE", f"/v1/sandboxes/{sid}/sessions/{ses}", parse=lambda r: None)

    @staticmethod
    def read(sid: str, path: str, offset: int = 0, length: int = -1) -> _Call:
        return _Call("GET", f"/v1/sandboxes/{sid}/file",
                     params={"path": path, "offset": offset, "length": length},
                     parse=lambda r: r.content)

    @staticmethod
    def write(sid: str, path: str, data: bytes, mode: int, offset: int, truncate: bool) -> _Call:
        return _Call("PUT", f"/v1/sandboxes/{sid}/file", content=data,
                     params={"path": path, "mode": f"{mode:o}", "offset": offset,
                             "truncate": "1" if truncate else "0"}, parse=lambda r: None)

    @staticmethod
    def remove(sid: str, path: str, recursive: bool) -> _Call:
        return _Call("DELETE", f"/v1/sandboxes/{sid}/file",
                     params={"path": path, "recursive": "1" if recursive else "0"},
                     parse=lambda r: None)

    @staticmethod
    def list_dir(sid: str, path: str) -> _Call:
        return _Call("GET", f"/v1/sandboxes/{sid}/ls", params={"path": path},
                     parse=lambda r: [FileEntry.from_dict(e) for e in r.json()["entries"]])

    @staticmethod
    def stat(sid: str, path: str) -> _Call:
        return _Call("GET", f"/v1/sandboxes/{sid}/stat", params={"path": path},
                     parse=lambda r: FileEntry.from_dict(r.json()))

    @staticmethod
    def prefetch(refs: Sequence[str]) -> _Call:
        return _Call("POST", "/v1/layers/prefetch", json={"refs": list(refs)}, timeout=None,
                     parse=lambda r: r.json()["layers"])

    @staticmethod
    def layers() -> _Call:
        return _Call("GET", "/v1/layers",
                     parse=lambda r: [LayerInfo.from_dict(d) for d in r.json()["layers"]])


def _write_chunks(data: bytes) -> Iterator[tuple[int, bytes]]:
    if not data:
        yield 0, b""
    for off in range(0, len(data), CHUNK):
        yield off, data[off:off + CHUNK]


def _check_response(call: _Call, r: Response) -> Any:
    if r.status_code >= 400:
        try:
            payload = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            raise DsecError(f"node daemon answered {r.status_code} to {call.method} {call.path}: "
                            f"{r.text[:500]}") from None
        raise error_from_wire(payload)
    return call.parse(r)


def _transport_error(call: _Call, e: TransportError, address: str) -> DsecError:
    if isinstance(e, TransportTimeout) and call.exec_timeout is not None:
        return ExecTimeout(f"no answer from the node within {call.exec_timeout}s + grace",
                           timeout=call.exec_timeout)
    return NodeUnavailable(f"node daemon at {address}: {type(e).__name__}: {e}", address=address)


def _resolve_address(address: str | None, autostart: bool) -> str:
    if address is None:
        config = NodeConfig.from_env()
        if autostart:
            ensure_daemon(config)
        return os.fspath(config.socket_path)
    if address.startswith("unix://"):
        return address[len("unix://"):]
    if "://" in address:
        raise InvalidSpec(f"unsupported address {address!r}: only unix sockets for now")
    return address


class Client:
    """Synchronous client of a dsec node. ``Client()`` uses (and starts) the local node."""

    def __init__(self, address: str | None = None, *, autostart: bool = True) -> None:
        self.address = _resolve_address(address, autostart)
        self._http = UnixTransport(self.address)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, call: _Call) -> Any:
        try:
            r = self._http.request(call.method, call.path, json=call.json, content=call.content,
                                   params=call.params, timeout=call.timeout)
        except TransportError as e:
            raise _transport_error(call, e, self.address) from e
        return _check_response(call, r)

    # --- node and sandboxes ---------------------------------------------------------------
    def node_info(self) -> dict[str, Any]:
        return self._call(_Calls.node())

    def create(self, spec: SandboxSpec | None = None, **kw: Any) -> "Sandbox":
        infos, errors = self._call(_Calls.create(_spec(spec, kw)))
        return Sandbox(self, infos[0])

    def create_many(self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any) -> list["Sandbox"]:
        """Create ``n`` sandboxes concurrently; all or nothing (the created are killed on error)."""
        infos, errors = self._call(_Calls.create(_spec(spec, kw), n))
        if errors:
            for info in infos:
                self.kill(info.id)
            raise errors[0]
        return [Sandbox(self, i) for i in infos]

    def get(self, sandbox_id: str) -> "Sandbox":
        return Sandbox(self, self._call(_Calls.get(sandbox_id)))

    def list(self) -> list[SandboxInfo]:
        return self._call(_Calls.list())

    def kill(self, sandbox_id: str) -> None:
        self._call(_Calls.kill(sandbox_id))

    def usage(self, sandbox_id: str) -> SandboxUsage:
        return self._call(_Calls.usage(sandbox_id))

    def layers(self) -> list[LayerInfo]:
        return self._call(_Calls.layers())

    def prefetch(self, refs: Sequence[str]) -> list[dict[str, Any]]:
        """Warm layers on the node (all chunks of on-demand layers); returns what was fetched."""
        return self._call(_Calls.prefetch(refs))

    # --- inside a sandbox -----------------------------------------------------------------
    def exec(self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None = 300.0,
             cwd: str | None = None, env: Mapping[str, str] | None = None,
             stdin: bytes | str | None = None, max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        return self._call(_Calls.exec(sandbox_id, _exec_body(cmd, timeout, cwd, env, stdin,
                                                             max_output)))

    def session_open(self, sandbox_id: str, *, cwd: str | None = None,
                     env: Mapping[str, str] | None = None) -> "Session":
        return Session(self, sandbox_id, self._call(_Calls.session_open(sandbox_id, cwd, env)))

    def sessions(self, sandbox_id: str) -> list[str]:
        return self._call(_Calls.sessions(sandbox_id))

    def session_exec(self, sandbox_id: str, session_id: str, cmd: str, *,
                     timeout: float | None = 300.0, stdin: bytes | str | None = None,
                     max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        body = _exec_body(cmd, timeout, None, None, stdin, max_output)
        return self._call(_Calls.session_exec(sandbox_id, session_id, body))

    def session_close(self, sandbox_id: str, session_id: str) -> None:
        self._call(_Calls.session_close(sandbox_id, session_id))

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        out = bytearray()
        while True:
            piece = self._call(_Calls.read(sandbox_id, path, len(out), CHUNK))
            out += piece
            if len(piece) < CHUNK:
                return bytes(out)

    def write_file(self, sandbox_id: str, path: str, data: bytes | str, *,
                   mode: int = 0o644) -> None:
        data = data.encode() if isinstance(data, str) else data
        for off, piece in _write_chunks(data):
            self._call(_Calls.write(sandbox_id, path, piece, mode, off, truncate=off == 0))

    def upload(self, sandbox_id: str, local: str | os.PathLike, remote: str, *,
               mode: int | None = None) -> None:
        local = Path(local)
        self.write_file(sandbox_id, remote, local.read_bytes(),
                        mode=mode if mode is not None else local.stat().st_mode & 0o7777)

    def download(self, sandbox_id: str, remote: str, local: str | os.PathLike) -> None:
        Path(local).write_bytes(self.read_file(sandbox_id, remote))

    def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return self._call(_Calls.list_dir(sandbox_id, path))

    def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return self._call(_Calls.stat(sandbox_id, path))

    def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        self._call(_Calls.remove(sandbox_id, path, recursive))


class AsyncClient:
    """Asyncio client of a dsec node; the same methods as ``Client``, awaited."""

    def __init__(self, address: str | None = None, *, autostart: bool = True) -> None:
        self.address = _resolve_address(address, autostart)
        self._http = AsyncUnixTransport(self.address)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, call: _Call) -> Any:
        try:
            r = await self._http.request(call.method, call.path, json=call.json,
                                         content=call.content, params=call.params,
                                         timeout=call.timeout)
        except TransportError as e:
            raise _transport_error(call, e, self.address) from e
        return _check_response(call, r)

    async def node_info(self) -> dict[str, Any]:
        return await self._call(_Calls.node())

    async def create(self, spec: SandboxSpec | None = None, **kw: Any) -> "AsyncSandbox":
        infos, _ = await self._call(_Calls.create(_spec(spec, kw)))
        return AsyncSandbox(self, infos[0])

    async def create_many(self, spec: SandboxSpec | None = None, n: int = 1,
                          **kw: Any) -> list["AsyncSandbox"]:
        infos, errors = await self._call(_Calls.create(_spec(spec, kw), n))
        if errors:
            await asyncio.gather(*(self.kill(i.id) for i in infos), return_exceptions=True)
            raise errors[0]
        return [AsyncSandbox(self, i) for i in infos]

    async def get(self, sandbox_id: str) -> "AsyncSandbox":
        return AsyncSandbox(self, await self._call(_Calls.get(sandbox_id)))

    async def list(self) -> list[SandboxInfo]:
        return await self._call(_Calls.list())

    async def kill(self, sandbox_id: str) -> None:
        await self._call(_Calls.kill(sandbox_id))

    async def usage(self, sandbox_id: str) -> SandboxUsage:
        return await self._call(_Calls.usage(sandbox_id))

    async def layers(self) -> list[LayerInfo]:
        return await self._call(_Calls.layers())

    async def prefetch(self, refs: Sequence[str]) -> list[dict[str, Any]]:
        return await self._call(_Calls.prefetch(refs))

    async def exec(self, sandbox_id: str, cmd: str | Sequence[str], *,
                   timeout: float | None = 300.0, cwd: str | None = None,
                   env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                   max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        return await self._call(_Calls.exec(sandbox_id, _exec_body(cmd, timeout, cwd, env, stdin,
                                                                   max_output)))

    async def session_open(self, sandbox_id: str, *, cwd: str | None = None,
                           env: Mapping[str, str] | None = None) -> "AsyncSession":
        return AsyncSession(self, sandbox_id,
                            await self._call(_Calls.session_open(sandbox_id, cwd, env)))

    async def sessions(self, sandbox_id: str) -> list[str]:
        return await self._call(_Calls.sessions(sandbox_id))

    async def session_exec(self, sandbox_id: str, session_id: str, cmd: str, *,
                           timeout: float | None = 300.0, stdin: bytes | str | None = None,
                           max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        body = _exec_body(cmd, timeout, None, None, stdin, max_output)
        return await self._call(_Calls.session_exec(sandbox_id, session_id, body))

    async def session_close(self, sandbox_id: str, session_id: str) -> None:
        await self._call(_Calls.session_close(sandbox_id, session_id))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        out = bytearray()
        while True:
            piece = await self._call(_Calls.read(sandbox_id, path, len(out), CHUNK))
            out += piece
            if len(piece) < CHUNK:
                return bytes(out)

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, *,
                         mode: int = 0o644) -> None:
        data = data.encode() if isinstance(data, str) else data
        for off, piece in _write_chunks(data):
            await self._call(_Calls.write(sandbox_id, path, piece, mode, off, truncate=off == 0))

    async def upload(self, sandbox_id: str, local: str | os.PathLike, remote: str, *,
                     mode: int | None = None) -> None:
        local = Path(local)
        data = await asyncio.to_thread(local.read_bytes)
        await self.write_file(sandbox_id, remote, data,
                              mode=mode if mode is not None else local.stat().st_mode & 0o7777)

    async def download(self, sandbox_id: str, remote: str, local: str | os.PathLike) -> None:
        data = await self.read_file(sandbox_id, remote)
        await asyncio.to_thread(Path(local).write_bytes, data)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return await self._call(_Calls.list_dir(sandbox_id, path))

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return await self._call(_Calls.stat(sandbox_id, path))

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        await self._call(_Calls.remove(sandbox_id, path, recursive))


# --- handles: a sandbox or session bound to its client -------------------------------------

_SANDBOX_METHODS = ("exec", "session_open", "sessions", "read_file", "write_file", "upload",
                    "download", "list_dir", "stat", "remove", "usage", "kill")


class _Bound:
    def __init__(self, client: Any, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        self.id = info.id

    def __getattr__(self, name: str) -> Any:
        if name in _SANDBOX_METHODS:
            method = getattr(self.client, name)
            return lambda *a, **kw: method(self.id, *a, **kw)
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.info.state}>"


class Sandbox(_Bound):
    """A sandbox handle: ``sb.exec(...)``, ``sb.read_file(...)``, ``sb.kill()``; a context
    manager that kills the sandbox on exit."""

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.client.kill(self.id)
        except DsecError:
            pass

    def session(self, **kw: Any) -> "Session":
        return self.client.session_open(self.id, **kw)

    def refresh(self) -> SandboxInfo:
        self.info = self.client._call(_Calls.get(self.id))
        return self.info


class AsyncSandbox(_Bound):
    """The asyncio twin of ``Sandbox`` (``async with`` kills it on exit)."""

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.client.kill(self.id)
        except DsecError:
            pass

    async def session(self, **kw: Any) -> "AsyncSession":
        return await self.client.session_open(self.id, **kw)

    async def refresh(self) -> SandboxInfo:
        self.info = await self.client._call(_Calls.get(self.id))
        return self.info


class Session:
    """A persistent shell in a sandbox: cwd, env and shell variables carry over."""

    def __init__(self, client: Client, sandbox_id: str, session_id: str) -> None:
        self.client, self.sandbox_id, self.id = client, sandbox_id, session_id

    def exec(self, cmd: str, **kw: Any) -> ExecResult:
        return self.client.session_exec(self.sandbox_id, self.id, cmd, **kw)

    def close(self) -> None:
        self.client.session_close(self.sandbox_id, self.id)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        except DsecError:
            pass


class AsyncSession:
    """The asyncio twin of ``Session``."""

    def __init__(self, client: AsyncClient, sandbox_id: str, session_id: str) -> None:
        self.client, self.sandbox_id, self.id = client, sandbox_id, session_id

    async def exec(self, cmd: str, **kw: Any) -> ExecResult:
        return await self.client.session_exec(self.sandbox_id, self.id, cmd, **kw)

    async def close(self) -> None:
        await self.client.session_close(self.sandbox_id, self.id)

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.close()
        except DsecError:
            pass
