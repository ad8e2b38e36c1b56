"""Whether this install of dsec has its node side: the ``node`` extra of dsec's one distribution
(``pip install 'dsec[node]'``).

A trainer's ``pip install dsec`` is the client alone (the SDK, the CLI's client commands); what
needs the node side (starting a node, the apiserver, catalogs, plugins) calls ``require_node``
first, so a client-only install says what to install instead of failing on an import.
"""

from __future__ import annotations

import importlib.util

from .errors import ExtraMissing, NodeSideMissing

__all__ = ["INSTALL_MCP", "INSTALL_NODE", "NODE_MODULES", "missing", "require_mcp", "require_node"]

#: What a client-only install runs to get the node side.
INSTALL_NODE = "pip install 'dsec[node]'"
#: What an install runs to get ``dsec mcp``'s MCP server (the ``mcp`` extra: the official SDK).
INSTALL_MCP = "pip install 'dsec[mcp]'"

#: Each distribution of pyproject.toml's ``node`` extra and the module it is imported as
#: (tests/test_slim_client.py keeps the two in step). Looked up with ``find_spec``, well under a
#: millisecond; reading installed metadata would cost a tenth of a second.
NODE_MODULES = {
    "pluggy": "pluggy",
    "packaging": "packaging",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "uvloop": "uvloop",
    "httptools": "httptools",
    "python-on-whales": "python_on_whales",
    "zstandard": "zstandard",
    "qemu.qmp": "qemu.qmp",
    "python-multipart": "python_multipart",
    "prometheus-client": "prometheus_client",
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a dotted name whose parent package is not there
        return False


def missing() -> tuple[str, ...]:
    """The node extra's distributions that are not installed (empty when all are)."""
    return tuple(dist for dist, module in NODE_MODULES.items() if not _importable(module))


def require_node(command: str) -> None:
    """Raise ``NodeSideMissing`` naming ``command`` (what needs the node side: ``dsec node
    start``, say) if this install lacks any of the node extra's distributions."""
    absent = missing()
    if absent:
        which = (
            "it is the client alone"
            if len(absent) == len(NODE_MODULES)
            else f"it lacks {', '.join(absent)}"
        )
        raise NodeSideMissing(
            f"{command} needs dsec's node side, which this install does not have ({which}): "
            f"{INSTALL_NODE} adds it",
            command=command,
            missing=list(absent),
            install=INSTALL_NODE,
        )


def require_mcp(command: str) -> None:
    """Raise ``ExtraMissing`` naming ``command`` (``dsec mcp``) if the ``mcp`` package, which
    the ``mcp`` extra installs, is not importable here."""
    if not _importable("mcp"):
        raise ExtraMissing(
            f"{command} needs the mcp package, which this install does not have: "
            f"{INSTALL_MCP} adds it",
            command=command,
            extra="mcp",
            missing=["mcp"],
            install=INSTALL_MCP,
        )
