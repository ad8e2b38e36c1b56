"""``dsec mcp``: serve dsec's sandboxes to MCP clients (``mcp_server``), over stdio or
streamable HTTP on loopback. A client command: it needs the ``mcp`` extra, and says so where
that is not installed instead of failing on an import."""

from __future__ import annotations

import click

from ..extras import require_mcp

__all__ = ["mcp"]


@click.command("mcp")
@click.option(
    "--address", help="The node or apiserver (default: DSEC_ADDRESS, else the local node)."
)
@click.option("--api-key", envvar="DSEC_API_KEY", help="An apiserver's API key.")
@click.option("--http", is_flag=True, help="Streamable HTTP on 127.0.0.1 instead of stdio.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=0, help="HTTP port (default: a free one)."
)
@click.option(
    "--scope",
    default="default",
    show_default=True,
    help="The dsec.mcp label of the sandboxes it creates, which list_sandboxes shows by "
    "default; an empty string labels nothing and lists everything.",
)
@click.option(
    "--kill-on-exit",
    is_flag=True,
    help="When the server stops, kill the sandboxes it created and did not kill (else they "
    "live until their ttl).",
)
def mcp(address, api_key, http, port, scope, kill_on_exit) -> None:
    """Serve sandboxes as MCP tools: create, exec (output streamed as progress), read_file,
    write_file, list_files, list_sandboxes, fork, screenshot, input and kill. Over stdio by
    default (an MCP client starts it); with --http, at http://127.0.0.1:PORT/mcp."""
    if port and not http:
        raise click.UsageError("--port goes with --http")
    require_mcp("dsec mcp")
    from .mcp_server import serve  # the mcp package (dsec[mcp]): loaded when served

    serve(address, api_key, http=http, port=port, scope=scope, kill_on_exit=kill_on_exit)
