"""The build session's tools as an MCP server (the ``mcp`` SDK), over stdio or streamable HTTP
on loopback, so any MCP-capable coding agent can drive a build.

It serves exactly ``TOOL_NAMES``, each with the signature and description of its
``BuildTools`` method. Every call goes through ``BuildTools.call`` (checked, logged); a
``DsecError`` comes back as a tool error whose text starts with the error's type
(``BuildToolError: ...``), and the session carries on.
"""

from __future__ import annotations

import inspect
from typing import Any

import anyio.to_thread
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from dsec_core.errors import DsecError

from .tools import TOOL_NAMES, BuildTools

__all__ = ["build_mcp_server", "serve"]


def _tool(tools: BuildTools, name: str) -> Any:
    method = getattr(tools, name)

    async def call(**kwargs: Any) -> Any:
        try:
            return await anyio.to_thread.run_sync(lambda: tools.call(name, kwargs))
        except DsecError as e:
            raise ToolError(f"{type(e).__name__}: {e}") from e

    call.__name__ = name
    call.__doc__ = method.__doc__
    call.__signature__ = inspect.signature(method, eval_str=True)  # type: ignore[attr-defined]
    return call


def build_mcp_server(tools: BuildTools) -> MCPServer:
    """An MCP server offering ``tools`` of one build session."""
    name = tools.session.name
    server: MCPServer = MCPServer(
        name=f"dsec-build-{name}",
        instructions=(
            f"Tools of dsec build session {name!r}: a sandbox to configure with exec, "
            "session_exec, read, write and list; finish packs it, runs QA and publishes it. "
            "Keep notes and secrets under /.dsec-build (scrubbed before packing)."
        ),
    )
    for tool in TOOL_NAMES:
        fn = _tool(tools, tool)
        server.add_tool(fn, name=tool, description=inspect.cleandoc(fn.__doc__ or ""))
    return server


def serve(tools: BuildTools, *, http: bool = False, port: int = 0, host: str = "127.0.0.1") -> None:
    """Serve ``tools`` on stdio, or (``http``) streamable HTTP at ``host:port``/mcp until
    interrupted. Blocking."""
    server = build_mcp_server(tools)
    if http:
        server.run("streamable-http", host=host, port=port)
    else:
        server.run("stdio")
