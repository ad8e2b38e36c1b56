"""Network namespaces and veth pairs through iproute2: named namespaces (``/run/netns/NAME``,
as ``ip netns`` makes them), batches of ``ip`` commands run in a namespace given by name or by
path (``/proc/PID/ns/net``), and the links in one."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import ToolError
from .tools import run_tool

__all__ = [
    "NETNS_DIR",
    "add_netns",
    "delete_netns",
    "ip_batch",
    "links",
    "netns_exists",
    "run_in_netns",
]

NETNS_DIR = Path("/run/netns")


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def add_netns(name: str) -> Path:
    """Create the named network namespace (its loopback up); its path."""
    run_tool(["ip", "netns", "add", name], f"creating network namespace {name}")
    try:
        run_tool(["ip", "-n", name, "link", "set", "lo", "up"], f"bringing up lo in {name}")
    except ToolError:
        delete_netns(name)
        raise
    return NETNS_DIR / name


def delete_netns(name: str) -> None:
    """Remove the named namespace; the kernel frees it, and every device in it (a veth's peer
    included), once no process is left in it. A namespace that is not there is no error."""
    if netns_exists(name):
        run_tool(["ip", "netns", "delete", name], f"removing network namespace {name}")


def _enter(netns: str | os.PathLike[str] | None) -> list[str]:
    if netns is None:
        return []
    if isinstance(netns, str) and "/" not in netns:
        netns = NETNS_DIR / netns
    return ["nsenter", f"--net={os.fspath(netns)}"]


def run_in_netns(
    netns: str | os.PathLike[str] | None, argv: Sequence[str], what: str, input: str | None = None
) -> str:
    """Run ``argv`` in a network namespace (a name in /run/netns or a path); its stdout."""
    return run_tool([*_enter(netns), *argv], what, input=input).stdout


def ip_batch(netns: str | os.PathLike[str] | None, commands: Sequence[str], what: str) -> None:
    """Run ``ip`` commands (each as after ``ip``) in one process, in a network namespace; the
    first that fails stops the batch and raises ``ToolError``."""
    if commands:
        run_in_netns(netns, ["ip", "-batch", "-"], what, input="\n".join(commands) + "\n")


def links(netns: str | os.PathLike[str] | None) -> list[str]:
    """The names of the network devices in a namespace."""
    out = run_in_netns(netns, ["ip", "-json", "link", "show"], "listing network devices")
    return [link["ifname"] for link in json.loads(out or "[]")]
