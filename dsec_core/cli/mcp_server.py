"""dsec's sandboxes as an MCP server (``dsec mcp``): tools to create, exec in, read, write,
list, fork, look at, type into and kill sandboxes, for any MCP-capable agent.

A client of a node or an apiserver like the rest of the CLI's client commands: every tool is
one or two calls of the SDK's ``AsyncClient`` and nothing here reaches a node otherwise, so it
runs in a client-only install with the ``mcp`` extra (``pip install 'dsec[mcp]'``). A
``DsecError`` comes back as a tool error (``is_error``) whose text starts with the error's type
(``UnknownSandbox: ...``) and whose structured content is the error's wire form (``type``,
``message``, ``context``); the server carries on. A command's output reaches the caller as MCP
progress notifications while it runs (the SDK's ``exec_stream``), before the tool's result.
"""

from __future__ import annotations

import base64
import functools
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, ParamSpec

import anyio
import click
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.utilities.types import Image
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from ..errors import DsecError, InvalidSpec
from ..records import ExecOutput, ExecResult, SandboxInfo
from ..sdk import AsyncClient

__all__ = ["SCOPE_LABEL", "TOOL_NAMES", "SandboxTools", "build_server", "serve"]

#: The label each sandbox created through the server carries, its value the server's scope
#: (``--scope``): ``list_sandboxes`` shows that scope's sandboxes unless asked for all.
SCOPE_LABEL = "dsec.mcp"
#: The tools, in the order ``list_tools`` gives them.
TOOL_NAMES = (
    "create",
    "exec",
    "read_file",
    "write_file",
    "list_files",
    "list_sandboxes",
    "fork",
    "screenshot",
    "input",
    "kill",
)
#: How many bytes of a command's output one progress notification carries at most (a chunk
#: the node sent larger is split, so a client's log line stays readable).
PROGRESS_PIECE = 16 << 10

P = ParamSpec("P")

SandboxId = Annotated[str, Field(description="The sandbox's id (from create or list_sandboxes).")]


class InputEvent(BaseModel):
    """One input event for a sandbox's screen."""

    type: Literal["key", "move", "click"] = Field(
        description="key: press and release a key; move: move the pointer; click: move there "
        "and click a button."
    )
    key: str | None = Field(
        None, description="For key: QEMU's key name (a, b, 1, ret, spc, shift, ctrl, esc, tab)."
    )
    x: int | None = Field(None, description="For move and click: pixels from the left.")
    y: int | None = Field(None, description="For move and click: pixels from the top.")
    button: str | None = Field(
        None, description="For click: left (default), middle, right, wheel-up, wheel-down."
    )


def _tool_error(e: DsecError) -> CallToolResult:
    wire = e.to_wire()
    return CallToolResult(
        content=[TextContent(type="text", text=f"{wire['type']}: {e}")],
        structured_content=wire,
        is_error=True,
    )


def _typed_errors(fn: Callable[P, Awaitable[Any]]) -> Callable[P, Awaitable[Any]]:
    """``fn``, its ``DsecError``s returned as tool errors naming their type."""

    @functools.wraps(fn)
    async def tool(*args: P.args, **kwargs: P.kwargs) -> Any:
        try:
            return await fn(*args, **kwargs)
        except DsecError as e:
            return _tool_error(e)

    return tool


def _info(info: SandboxInfo) -> dict[str, Any]:
    return info.to_dict()


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise InvalidSpec(
            f"mode must be octal permission bits such as 644, got {text!r}", field="mode"
        )
    return mode


def _pieces(data: bytes) -> list[bytes]:
    return [data[i : i + PROGRESS_PIECE] for i in range(0, len(data), PROGRESS_PIECE)] or [b""]


class SandboxTools:
    """The tools over one ``AsyncClient``; ``scope`` (may be empty: no label) labels what
    ``create`` and ``fork`` make and is what ``list_sandboxes`` shows by default."""

    def __init__(self, client: AsyncClient, scope: str = "") -> None:
        self.client = client
        self.scope = scope
        #: ids of the sandboxes made here and not killed here (``--kill-on-exit`` kills them)
        self.made: set[str] = set()

    async def kill_made(self) -> None:
        """Kill every sandbox this server made and did not kill, all at once; one already
        gone (its ttl, another client) is not an error."""

        async def kill(sid: str) -> None:
            try:
                await self.client.kill(sid)
            except DsecError:
                pass
            self.made.discard(sid)

        async with anyio.create_task_group() as tg:
            for sid in sorted(self.made):
                tg.start_soon(kill, sid)

    def _labels(self, labels: dict[str, str] | None) -> dict[str, str]:
        out = dict(labels or {})
        if self.scope:
            out[SCOPE_LABEL] = self.scope
        return out

    async def create(
        self,
        environment: Annotated[
            str | None,
            Field(description="A catalog environment of the node (base, workspaces, toolkits)."),
        ] = None,
        layers: Annotated[
            list[str] | None,
            Field(description="Layers as name@version, top first (with or instead of one)."),
        ] = None,
        backend: Annotated[
            str | None,
            Field(description="container, microvm, vm, ...; default: the environment's."),
        ] = None,
        cpu: Annotated[float, Field(description="CPU cores.", gt=0)] = 1.0,
        memory: Annotated[str, Field(description="Memory limit, e.g. 512M or 2G.")] = "512M",
        disk: Annotated[str, Field(description="Writable layer size, e.g. 10G.")] = "10G",
        ttl: Annotated[
            float | None,
            Field(description="Seconds until the node kills it; null: until killed."),
        ] = 3600.0,
        labels: Annotated[
            dict[str, str] | None, Field(description="Labels to find it by later.")
        ] = None,
        network: Annotated[
            str,
            Field(
                description="Network mode: none (loopback only) or one a security policy of "
                "the node offers."
            ),
        ] = "none",
        env: Annotated[
            dict[str, str] | None, Field(description="Environment variables of its commands.")
        ] = None,
        workdir: Annotated[str, Field(description="Commands' working directory.")] = "/",
    ) -> dict[str, Any]:
        """Create a sandbox from a catalog environment or layers; returns its info (id,
        state, layers, limits, labels, expiry). Sandboxes made here carry the server's
        scope label (dsec.mcp) so list_sandboxes shows them."""
        sb = await self.client.create(
            environment=environment,
            layers=tuple(layers or ()),
            backend=backend,
            cpu=cpu,
            memory=memory,
            disk=disk,
            ttl=ttl,
            labels=self._labels(labels),
            network=network,
            env=dict(env or {}),
            workdir=workdir,
        )
        self.made.add(sb.id)
        return _info(sb.info)

    async def exec(
        self,
        sandbox_id: SandboxId,
        command: Annotated[
            str | list[str],
            Field(description="A shell command line (run by /bin/sh -c), or an argv list."),
        ],
        ctx: Context,
        timeout: Annotated[
            float, Field(description="Seconds before the command's processes are killed.", gt=0)
        ] = 300.0,
        cwd: Annotated[str | None, Field(description="Working directory.")] = None,
        env: Annotated[dict[str, str] | None, Field(description="More environment.")] = None,
        stdin: Annotated[str | None, Field(description="Text fed to its standard input.")] = None,
    ) -> dict[str, Any]:
        """Run a command in a sandbox. Its output arrives as progress notifications while it
        runs (message "stdout: ..." or "stderr: ..."; progress counts bytes so far); the
        result has exit_code, stdout, stderr (UTF-8, invalid bytes replaced), duration,
        timed_out and truncated (output past the node's cap was dropped)."""
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        seen = 0
        result: ExecResult | None = None
        stream = await self.client.exec_stream(
            sandbox_id, command, timeout=timeout, cwd=cwd, env=env, stdin=stdin
        )
        try:
            async for item in stream:
                if isinstance(item, ExecOutput):
                    out[item.stream].extend(item.data)
                    for piece in _pieces(item.data):
                        seen += len(piece)
                        text = piece.decode("utf-8", "replace")
                        await ctx.report_progress(seen, message=f"{item.stream}: {text}")
                else:
                    result = item
        finally:
            # A call the client cancelled (or abandoned) ends here: closing the stream now,
            # not when the generator is collected, has the node kill the command at once.
            close = getattr(stream, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
        if result is None:  # the SDK raises when a stream ends without one
            raise DsecError("the exec stream ended without a result", sandbox_id=sandbox_id)
        return {
            "exit_code": result.exit_code,
            "stdout": out["stdout"].decode("utf-8", "replace"),
            "stderr": out["stderr"].decode("utf-8", "replace"),
            "duration": result.duration,
            "timed_out": result.timed_out,
            "truncated": result.truncated,
            "oom_killed": result.oom_killed,
        }

    async def read_file(
        self,
        sandbox_id: SandboxId,
        path: Annotated[str, Field(description="Absolute path in the sandbox.")],
    ) -> dict[str, Any]:
        """Read a whole file from a sandbox: its content as UTF-8 text (encoding "utf-8"),
        or base64 (encoding "base64") when it is not valid UTF-8."""
        data = await self.client.read_file(sandbox_id, path)
        try:
            content, encoding = data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            content, encoding = base64.b64encode(data).decode(), "base64"
        return {"path": path, "size": len(data), "encoding": encoding, "content": content}

    async def write_file(
        self,
        sandbox_id: SandboxId,
        path: Annotated[str, Field(description="Absolute path in the sandbox.")],
        content: Annotated[str, Field(description="What to write (see encoding).")],
        encoding: Annotated[
            Literal["utf-8", "base64"],
            Field(description="utf-8: content is the text; base64: content is the bytes."),
        ] = "utf-8",
        mode: Annotated[
            str, Field(description="Permission bits in octal for a new file, e.g. 755.")
        ] = "644",
    ) -> dict[str, Any]:
        """Write a file in a sandbox, replacing it if it exists (its directory must
        exist)."""
        try:
            data = (
                base64.b64decode(content, validate=True)
                if encoding == "base64"
                else content.encode("utf-8")
            )
        except ValueError as e:
            raise InvalidSpec(f"content is not base64: {e}", field="content") from None
        await self.client.write_file(sandbox_id, path, data, mode=_mode(mode))
        return {"path": path, "size": len(data)}

    async def list_files(
        self,
        sandbox_id: SandboxId,
        path: Annotated[str, Field(description="A directory in the sandbox.")] = "/",
    ) -> dict[str, Any]:
        """List a directory of a sandbox: each entry's name, type (file, dir, symlink,
        other), size, mode (octal) and mtime, sorted by name."""
        entries = await self.client.list_dir(sandbox_id, path)
        return {
            "path": path,
            "entries": [
                {
                    "name": e.name,
                    "type": e.type,
                    "size": e.size,
                    "mode": f"{e.mode & 0o7777:o}",
                    "mtime": e.mtime,
                }
                for e in entries
            ],
        }

    async def list_sandboxes(
        self,
        all: Annotated[
            bool,
            Field(
                description="Every sandbox this server's address and key can see, not only "
                "those created through this server's scope."
            ),
        ] = False,
    ) -> dict[str, Any]:
        """List sandboxes (id, state, backend, environment, layers, labels, expiry): those
        created in this server's scope, or all that its node or API key can see."""
        infos = await self.client.list()
        if self.scope and not all:
            infos = [i for i in infos if i.labels.get(SCOPE_LABEL) == self.scope]
        return {"sandboxes": [_info(i) for i in infos]}

    async def fork(
        self,
        sandbox_id: SandboxId,
        n: Annotated[int, Field(description="How many copies.", ge=1, le=64)] = 1,
        exclude: Annotated[
            list[str] | None,
            Field(description="Paths left out of the snapshot (a * component matches any)."),
        ] = None,
        scrub: Annotated[
            bool,
            Field(
                description="Also leave out /tmp, /var/tmp, caches, shell histories and "
                "credentials (keep what the copies need elsewhere, e.g. /work or /root)."
            ),
        ] = True,
        ttl: Annotated[
            float | None, Field(description="The copies' lifetime in seconds; null: none.")
        ] = 3600.0,
    ) -> dict[str, Any]:
        """Snapshot a running sandbox's files (pack_diff: it is frozen for a moment) and
        start n new sandboxes from that state, each with its own writable layer and the
        source's limits. Memory and processes are not copied: the copies start fresh over
        the saved files. Returns the snapshot layer's ref and the copies' info."""
        source = (await self.client.get(sandbox_id)).info
        limits = source.limits
        # labels of the source the caller chose; the node's and apiserver's own (dsec.*) it sets
        labels = {k: v for k, v in source.labels.items() if not k.startswith("dsec.")}
        snapshot = await self.client.pack_diff(
            sandbox_id, exclude=tuple(exclude or ()), scrub=scrub
        )
        copies = await self.client.restore(
            snapshot,
            n,
            backend=source.backend,
            cpu=limits.get("cpu", 1.0),
            memory=limits.get("memory", "512M"),
            disk=limits.get("disk", "10G"),
            ttl=ttl,
            labels=self._labels(labels),
        )
        self.made.update(c.id for c in copies)
        return {"snapshot": snapshot.ref, "sandboxes": [_info(c.info) for c in copies]}

    async def screenshot(self, sandbox_id: SandboxId) -> Image:
        """A PNG image of a sandbox's screen (sandboxes with a display: the vm backend)."""
        return Image(data=await self.client.screenshot(sandbox_id), format="png")

    async def input(
        self,
        sandbox_id: SandboxId,
        events: Annotated[
            list[InputEvent], Field(description="Key presses, pointer moves and clicks, in order.")
        ],
    ) -> dict[str, Any]:
        """Send keyboard and mouse input to a sandbox's screen (the vm backend), in order;
        take a screenshot to see what it did."""
        dicts = [e.model_dump(exclude_none=True) for e in events]
        return {"sent": await self.client.input(sandbox_id, dicts)}

    async def kill(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Kill a sandbox: its processes and writable layer are gone."""
        await self.client.kill(sandbox_id)
        self.made.discard(sandbox_id)
        return {"killed": sandbox_id}


#: What each tool does to the world, for clients that ask before calling (MCP's hints).
ANNOTATIONS = {
    "create": ToolAnnotations(read_only_hint=False, destructive_hint=False),
    "exec": ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False),
    "read_file": ToolAnnotations(read_only_hint=True),
    "write_file": ToolAnnotations(read_only_hint=False, destructive_hint=True),
    "list_files": ToolAnnotations(read_only_hint=True),
    "list_sandboxes": ToolAnnotations(read_only_hint=True),
    "fork": ToolAnnotations(read_only_hint=False, destructive_hint=False),
    "screenshot": ToolAnnotations(read_only_hint=True),
    "input": ToolAnnotations(read_only_hint=False, destructive_hint=True),
    "kill": ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True),
}


def build_server(tools: SandboxTools) -> MCPServer:
    """An MCP server offering ``tools`` (``TOOL_NAMES``)."""
    server: MCPServer = MCPServer(
        name="dsec",
        instructions=(
            "Tools for dsec sandboxes (isolated Linux environments): create one, run commands "
            "in it with exec, move files with read_file/write_file/list_files, fork its state "
            "into copies, and kill it when done. Errors name their dsec type, e.g. "
            "UnknownSandbox."
        ),
        log_level="WARNING",
    )
    for name in TOOL_NAMES:
        fn = _typed_errors(getattr(tools, name))
        server.add_tool(fn, name=name, annotations=ANNOTATIONS[name])
    return server


def _loopback_socket(port: int) -> socket.socket:
    """A socket bound to 127.0.0.1:``port`` before uvicorn starts, so that port 0's free port
    is known (and printed) without a race."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise InvalidSpec(f"cannot listen on 127.0.0.1:{port}: {e}", field="port") from None
    return sock


async def _serve_http(server: MCPServer, port: int) -> bool:
    """Serve streamable HTTP on 127.0.0.1:``port`` until SIGINT or SIGTERM; whether SIGTERM
    stopped it (uvicorn stops gracefully on it, then raises it again to the handler it found,
    which here only notes it: the caller cleans up first, then ends as SIGTERM does)."""
    sock = _loopback_socket(port)
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: terminated.append(sig))
    try:
        app = server.streamable_http_app(host="127.0.0.1")
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
        click.echo(f"dsec MCP server: {url}", err=True)
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    return bool(terminated)


async def _serve_stdio(server: MCPServer, cleanup: Callable[[], Awaitable[None]]) -> None:
    """Serve on stdio until stdin closes. SIGTERM (how MCP clients stop a server slow to leave
    once its stdin is closed, and how service managers stop one) runs ``cleanup``, then ends
    the process as SIGTERM does: the thread reading stdin cannot be cancelled."""

    async def stop_on_sigterm() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                with anyio.CancelScope(shield=True):
                    await cleanup()
                _end_as_sigterm()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_on_sigterm)
        await server.run_stdio_async()
        tg.cancel_scope.cancel()


def _end_as_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def serve(
    address: str | None,
    api_key: str | None,
    *,
    http: bool = False,
    port: int = 0,
    scope: str = "",
    kill_on_exit: bool = False,
) -> None:
    """Serve the tools on stdio, or (``http``) streamable HTTP on 127.0.0.1:``port`` (0: a
    free one, printed on stderr) at ``/mcp``, until stdin closes or the process is
    interrupted; then, with ``kill_on_exit``, kill the sandboxes it made. Blocking."""

    async def main() -> bool:
        # made in the server's loop: the async transport belongs to it
        client = AsyncClient(address, api_key=api_key)
        tools = SandboxTools(client, scope)

        async def cleanup() -> None:
            if kill_on_exit:
                await tools.kill_made()
            await client.close()

        try:
            server = build_server(tools)
            if http:
                return await _serve_http(server, port)
            await _serve_stdio(server, cleanup)
            return False
        finally:
            with anyio.CancelScope(shield=True):
                await cleanup()

    try:
        terminated = anyio.run(main)
    except KeyboardInterrupt:  # Ctrl-C in a terminal: the way to stop it, not a crash
        return
    if terminated:
        _end_as_sigterm()
