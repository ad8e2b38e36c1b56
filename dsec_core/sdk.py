"""The SDK: ``Client`` (sync) and ``AsyncClient`` (asyncio) with the same methods.

Every method is a line or two over the route table (``dsec_core.api.routes``): it names its
route and hands over the route's messages; the two clients only differ in how they send them.
``Client()`` with no address talks to ``DSEC_ADDRESS`` (with ``DSEC_TOKEN``) if set, else to
the local node daemon on its unix socket, starting it if none runs (the embedded single-node
default).
"""

from __future__ import annotations

import asyncio
import builtins
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .api.messages import (
    DEFAULT_MAX_OUTPUT,
    CreateRequest,
    ExecRequest,
    FileQuery,
    PolicySettings,
    PrefetchRequest,
    ReadQuery,
    RemoveQuery,
    SessionExecRequest,
    SessionOpenRequest,
    WriteQuery,
)
from .api.routes import ROUTES, Route
from .api.transport import (
    Address,
    AsyncHTTPTransport,
    HTTPTransport,
    Response,
    TransportError,
    TransportTimeout,
)
from .config import NodeConfig
from .errors import DsecError, ExecTimeout, InvalidSpec, NodeUnavailable, error_from_wire
from .localnode import ensure_daemon
from .records import (
    ExecResult,
    FileEntry,
    LayerInfo,
    PolicyState,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncSession", "Client", "Sandbox", "Session"]

CHUNK = 8 << 20  # file transfers move in pieces of this size
EXEC_GRACE = 30.0  # past an exec's own timeout, how long a client waits for the node's answer


def _spec(spec: SandboxSpec | None, kw: dict[str, Any]) -> SandboxSpec:
    if spec is None:
        return SandboxSpec(**kw)
    if kw:
        return SandboxSpec(**{**spec.to_dict(), **kw})
    return spec


def _write_chunks(data: bytes) -> Iterator[tuple[int, bytes]]:
    if not data:
        yield 0, b""
    for off in range(0, len(data), CHUNK):
        yield off, data[off : off + CHUNK]


def _resolve(
    address: str | os.PathLike[str] | None, token: str | None, autostart: bool
) -> tuple[Address, str | None]:
    """Where to connect and with which token: the address given, else ``DSEC_ADDRESS`` (and
    ``DSEC_TOKEN``), else the local node's unix socket (started if ``autostart``)."""
    if address is None and os.environ.get("DSEC_ADDRESS"):
        address = os.environ["DSEC_ADDRESS"]
        if token is None:  # the token goes with the address it was set for, never elsewhere
            token = os.environ.get("DSEC_TOKEN") or None
    if address is not None:
        return Address.parse(address), token
    config = NodeConfig.from_env()
    if autostart:
        ensure_daemon(config)
    return Address("unix", path=os.fspath(config.socket_path)), token


def _timeout(route: Route, body: Any) -> float | None:
    """How long to wait for the answer: the route's default, or an exec's own timeout plus a
    grace period for the node to kill the command and answer."""
    if route.exec_timeout:
        return None if body.timeout is None else body.timeout + EXEC_GRACE
    return route.timeout


def _answer(route: Route, r: Response) -> Any:
    """The typed answer of a response, or the typed error the node sent."""
    if r.status_code >= 300:
        try:
            payload = r.json()["error"]
            payload["type"]
        except (ValueError, KeyError, TypeError):
            raise DsecError(
                f"the node answered {r.status_code} to {route.method} {route.path}: {r.text[:500]}"
            ) from None
        raise error_from_wire(payload)
    try:
        return route.decode_response(r.content)
    except InvalidSpec as e:
        raise DsecError(
            f"the node's answer to {route.method} {route.path} does not fit the API: {e}"
        ) from e


def _transport_error(route: Route, body: Any, e: TransportError, address: str) -> DsecError:
    if isinstance(e, TransportTimeout) and route.exec_timeout:
        return ExecTimeout(
            f"no answer from the node within {body.timeout}s + {EXEC_GRACE}s", timeout=body.timeout
        )
    return NodeUnavailable(f"node at {address}: {type(e).__name__}: {e}", address=address)


class Client:
    """Synchronous client of a dsec node.

    ``address`` is ``unix:///path`` (or a path), ``http://host:port`` or ``https://host:port``;
    ``token`` is the node's API token (TCP only); ``verify`` checks the node's TLS certificate
    against the system's CAs (True), a CA file (a path), or not at all (False). ``Client()``
    uses ``DSEC_ADDRESS``/``DSEC_TOKEN``, or the local node (started if needed).
    """

    def __init__(
        self,
        address: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        verify: bool | str | os.PathLike[str] = True,
        autostart: bool = True,
    ) -> None:
        where, token = _resolve(address, token, autostart)
        self.address = str(where)
        self._http = HTTPTransport(where, token=token, verify=verify)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, name: str, body: Any = None, query: Any = None, **params: str) -> Any:
        route = ROUTES[name]
        try:
            r = self._http.request(
                route.method,
                route.target(params, query),
                body=route.encode_body(body),
                content_type=route.body_type,
                timeout=_timeout(route, body),
            )
        except TransportError as e:
            raise _transport_error(route, body, e, self.address) from e
        return _answer(route, r)

    # --- node and sandboxes ---------------------------------------------------------------
    def node_info(self) -> dict[str, Any]:
        return self._call("node_info").to_dict()

    def create(self, spec: SandboxSpec | None = None, **kw: Any) -> Sandbox:
        return Sandbox(self, self._call("create", CreateRequest(_spec(spec, kw))).sandboxes[0])

    def create_many(self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any) -> list[Sandbox]:
        """Create ``n`` sandboxes concurrently; all or nothing (the created are killed on error)."""
        made = self._call("create", CreateRequest(_spec(spec, kw), n))
        if made.errors:
            for info in made.sandboxes:
                self.kill(info.id)
            raise error_from_wire(made.errors[0].to_dict())
        return [Sandbox(self, i) for i in made.sandboxes]

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self, self._call("get", sid=sandbox_id))

    def list(self) -> builtins.list[SandboxInfo]:
        return list(self._call("list").sandboxes)

    def kill(self, sandbox_id: str) -> None:
        self._call("kill", sid=sandbox_id)

    def usage(self, sandbox_id: str) -> SandboxUsage:
        return self._call("usage", sid=sandbox_id)

    def policies(self, sandbox_id: str) -> builtins.list[PolicyState]:
        """The sandbox's security policies: in force (with what they saw), or why not."""
        return list(self._call("policies", sid=sandbox_id).policies)

    def set_policy(self, sandbox_id: str, policy: str, settings: Mapping[str, Any]) -> PolicyState:
        """Change a live policy (e.g. a network allowlist) of a running sandbox."""
        return self._call(
            "set_policy", PolicySettings(dict(settings)), sid=sandbox_id, policy=policy
        )

    def layers(self) -> builtins.list[LayerInfo]:
        return list(self._call("layers").layers)

    def prefetch(self, refs: Sequence[str]) -> builtins.list[dict[str, Any]]:
        """Warm layers on the node (all chunks of on-demand layers); returns what was fetched."""
        return [
            row.to_dict() for row in self._call("prefetch", PrefetchRequest(tuple(refs))).layers
        ]

    # --- inside a sandbox -----------------------------------------------------------------
    def exec(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        background: bool = False,
        exclusive: bool = False,
    ) -> ExecResult:
        """Run ``cmd`` in the sandbox. Processes it leaves running are killed when it exits,
        unless ``background``; ``exclusive`` first kills every other process in the sandbox
        (sessions, background jobs, other calls), which is how a verifier should run."""
        body = ExecRequest(
            cmd,  # type: ignore[arg-type]
            timeout,
            cwd,
            env,
            stdin,  # type: ignore[arg-type]
            max_output,
            background,
            exclusive,
        )
        return self._call("exec", body, sid=sandbox_id)

    def session_open(
        self, sandbox_id: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> Session:
        opened = self._call("session_open", SessionOpenRequest(cwd, env), sid=sandbox_id)
        return Session(self, sandbox_id, opened.session)

    def sessions(self, sandbox_id: str) -> builtins.list[str]:
        return list(self._call("sessions", sid=sandbox_id).sessions)

    def session_exec(
        self,
        sandbox_id: str,
        session_id: str,
        cmd: str,
        *,
        timeout: float | None = 300.0,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        body = SessionExecRequest(cmd, timeout, stdin, max_output)  # type: ignore[arg-type]
        return self._call("session_exec", body, sid=sandbox_id, ses=session_id)

    def session_close(self, sandbox_id: str, session_id: str) -> None:
        self._call("session_close", sid=sandbox_id, ses=session_id)

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        out = bytearray()
        while True:
            piece = self._call("read_file", query=ReadQuery(path, len(out), CHUNK), sid=sandbox_id)
            out += piece
            if len(piece) < CHUNK:
                return bytes(out)

    def write_file(
        self, sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None:
        data = data.encode() if isinstance(data, str) else data
        for off, piece in _write_chunks(data):
            self._call(
                "write_file", piece, WriteQuery(path, f"{mode:o}", off, off == 0), sid=sandbox_id
            )

    def upload(
        self, sandbox_id: str, local: str | os.PathLike, remote: str, *, mode: int | None = None
    ) -> None:
        local = Path(local)
        self.write_file(
            sandbox_id,
            remote,
            local.read_bytes(),
            mode=mode if mode is not None else local.stat().st_mode & 0o7777,
        )

    def download(self, sandbox_id: str, remote: str, local: str | os.PathLike) -> None:
        Path(local).write_bytes(self.read_file(sandbox_id, remote))

    def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return list(self._call("list_dir", query=FileQuery(path), sid=sandbox_id).entries)

    def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return self._call("stat", query=FileQuery(path), sid=sandbox_id)

    def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        self._call("remove", query=RemoveQuery(path, recursive), sid=sandbox_id)


class AsyncClient:
    """Asyncio client of a dsec node; the same methods as ``Client``, awaited."""

    def __init__(
        self,
        address: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        verify: bool | str | os.PathLike[str] = True,
        autostart: bool = True,
    ) -> None:
        where, token = _resolve(address, token, autostart)
        self.address = str(where)
        self._http = AsyncHTTPTransport(where, token=token, verify=verify)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, name: str, body: Any = None, query: Any = None, **params: str) -> Any:
        route = ROUTES[name]
        try:
            r = await self._http.request(
                route.method,
                route.target(params, query),
                body=route.encode_body(body),
                content_type=route.body_type,
                timeout=_timeout(route, body),
            )
        except TransportError as e:
            raise _transport_error(route, body, e, self.address) from e
        return _answer(route, r)

    async def node_info(self) -> dict[str, Any]:
        return (await self._call("node_info")).to_dict()

    async def create(self, spec: SandboxSpec | None = None, **kw: Any) -> AsyncSandbox:
        made = await self._call("create", CreateRequest(_spec(spec, kw)))
        return AsyncSandbox(self, made.sandboxes[0])

    async def create_many(
        self, spec: SandboxSpec | None = None, n: int = 1, **kw: Any
    ) -> list[AsyncSandbox]:
        made = await self._call("create", CreateRequest(_spec(spec, kw), n))
        if made.errors:
            await asyncio.gather(*(self.kill(i.id) for i in made.sandboxes), return_exceptions=True)
            raise error_from_wire(made.errors[0].to_dict())
        return [AsyncSandbox(self, i) for i in made.sandboxes]

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self, await self._call("get", sid=sandbox_id))

    async def list(self) -> builtins.list[SandboxInfo]:
        return list((await self._call("list")).sandboxes)

    async def kill(self, sandbox_id: str) -> None:
        await self._call("kill", sid=sandbox_id)

    async def usage(self, sandbox_id: str) -> SandboxUsage:
        return await self._call("usage", sid=sandbox_id)

    async def policies(self, sandbox_id: str) -> builtins.list[PolicyState]:
        return list((await self._call("policies", sid=sandbox_id)).policies)

    async def set_policy(
        self, sandbox_id: str, policy: str, settings: Mapping[str, Any]
    ) -> PolicyState:
        return await self._call(
            "set_policy", PolicySettings(dict(settings)), sid=sandbox_id, policy=policy
        )

    async def layers(self) -> builtins.list[LayerInfo]:
        return list((await self._call("layers")).layers)

    async def prefetch(self, refs: Sequence[str]) -> builtins.list[dict[str, Any]]:
        made = await self._call("prefetch", PrefetchRequest(tuple(refs)))
        return [row.to_dict() for row in made.layers]

    async def exec(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        background: bool = False,
        exclusive: bool = False,
    ) -> ExecResult:
        """Run ``cmd`` in the sandbox. Processes it leaves running are killed when it exits,
        unless ``background``; ``exclusive`` first kills every other process in the sandbox
        (sessions, background jobs, other calls), which is how a verifier should run."""
        body = ExecRequest(
            cmd,  # type: ignore[arg-type]
            timeout,
            cwd,
            env,
            stdin,  # type: ignore[arg-type]
            max_output,
            background,
            exclusive,
        )
        return await self._call("exec", body, sid=sandbox_id)

    async def session_open(
        self, sandbox_id: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> AsyncSession:
        opened = await self._call("session_open", SessionOpenRequest(cwd, env), sid=sandbox_id)
        return AsyncSession(self, sandbox_id, opened.session)

    async def sessions(self, sandbox_id: str) -> builtins.list[str]:
        return list((await self._call("sessions", sid=sandbox_id)).sessions)

    async def session_exec(
        self,
        sandbox_id: str,
        session_id: str,
        cmd: str,
        *,
        timeout: float | None = 300.0,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        body = SessionExecRequest(cmd, timeout, stdin, max_output)  # type: ignore[arg-type]
        return await self._call("session_exec", body, sid=sandbox_id, ses=session_id)

    async def session_close(self, sandbox_id: str, session_id: str) -> None:
        await self._call("session_close", sid=sandbox_id, ses=session_id)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        out = bytearray()
        while True:
            piece = await self._call(
                "read_file", query=ReadQuery(path, len(out), CHUNK), sid=sandbox_id
            )
            out += piece
            if len(piece) < CHUNK:
                return bytes(out)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None:
        data = data.encode() if isinstance(data, str) else data
        for off, piece in _write_chunks(data):
            await self._call(
                "write_file", piece, WriteQuery(path, f"{mode:o}", off, off == 0), sid=sandbox_id
            )

    async def upload(
        self, sandbox_id: str, local: str | os.PathLike, remote: str, *, mode: int | None = None
    ) -> None:
        local = Path(local)
        data = await asyncio.to_thread(local.read_bytes)
        await self.write_file(
            sandbox_id,
            remote,
            data,
            mode=mode if mode is not None else local.stat().st_mode & 0o7777,
        )

    async def download(self, sandbox_id: str, remote: str, local: str | os.PathLike) -> None:
        data = await self.read_file(sandbox_id, remote)
        await asyncio.to_thread(Path(local).write_bytes, data)

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return list((await self._call("list_dir", query=FileQuery(path), sid=sandbox_id)).entries)

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return await self._call("stat", query=FileQuery(path), sid=sandbox_id)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        await self._call("remove", query=RemoveQuery(path, recursive), sid=sandbox_id)


# --- handles: a sandbox or session bound to its client -------------------------------------

_SANDBOX_METHODS = (
    "exec",
    "session_open",
    "sessions",
    "read_file",
    "write_file",
    "upload",
    "download",
    "list_dir",
    "stat",
    "remove",
    "usage",
    "policies",
    "set_policy",
    "kill",
)


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

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.client.kill(self.id)
        except DsecError:
            pass

    def session(self, **kw: Any) -> Session:
        return self.client.session_open(self.id, **kw)

    def refresh(self) -> SandboxInfo:
        self.info = self.client._call("get", sid=self.id)
        return self.info


class AsyncSandbox(_Bound):
    """The asyncio twin of ``Sandbox`` (``async with`` kills it on exit)."""

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.client.kill(self.id)
        except DsecError:
            pass

    async def session(self, **kw: Any) -> AsyncSession:
        return await self.client.session_open(self.id, **kw)

    async def refresh(self) -> SandboxInfo:
        self.info = await self.client._call("get", sid=self.id)
        return self.info


class Session:
    """A persistent shell in a sandbox: cwd, env and shell variables carry over."""

    def __init__(self, client: Client, sandbox_id: str, session_id: str) -> None:
        self.client, self.sandbox_id, self.id = client, sandbox_id, session_id

    def exec(self, cmd: str, **kw: Any) -> ExecResult:
        return self.client.session_exec(self.sandbox_id, self.id, cmd, **kw)

    def close(self) -> None:
        self.client.session_close(self.sandbox_id, self.id)

    def __enter__(self) -> Session:
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

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.close()
        except DsecError:
            pass
