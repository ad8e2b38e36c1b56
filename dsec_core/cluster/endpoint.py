"""What the cluster tells its users about one node: where its daemon listens, with which token
and labels (``NodeEndpoint``), and what ``dsec cluster ls`` shows besides (``NodeState``).

Plain frozen records without Ray, so the apiserver and tests can hold them without importing
it; ``ClusterUnavailable`` is the typed error of everything in this package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidSpec, NodeUnavailable

__all__ = [
    "NAME_PATTERN",
    "ClusterUnavailable",
    "NodeEndpoint",
    "NodeState",
    "check_name",
    "format_labels",
]

#: A node's name in a cluster (``DSEC_NODE_NAME``): the suffix of its sandboxes' ids.
NAME_PATTERN = re.compile(r"[a-z0-9]{1,16}")


class ClusterUnavailable(NodeUnavailable):
    """The Ray cluster cannot be used: Ray is not installed, no address was given, nothing
    answers there, or this process is already connected to another Ray cluster."""


def check_name(name: str) -> str:
    """``name`` if it is a valid node name (``[a-z0-9]{1,16}``), else ``InvalidSpec``."""
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidSpec(
            f"node name {name!r} must be 1 to 16 lowercase letters or digits", field="name"
        )
    return name


def format_labels(labels: Mapping[str, str]) -> str:
    """Labels as ``DSEC_NODE_LABELS`` spells them: ``k=v,k=v``, sorted by key."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


@dataclass(frozen=True)
class NodeEndpoint:
    """How to reach one cluster node's daemon: ``dsec.Client(url, token=token)``.

    ``labels`` are the node's ``DSEC_NODE_LABELS`` (``dsec.pool`` is ``home`` or
    ``overflow``); ``ray_node_id`` is the Ray node its actor is pinned to; ``alive`` is False
    when the actor answers but its daemon process is gone (killed, crashed)."""

    name: str
    url: str
    token: str = field(repr=False)
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)  # hashable all the same
    ray_node_id: str = ""
    alive: bool = True

    @property
    def pool(self) -> str:
        """The node's pool: ``overflow`` or ``home``."""
        return self.labels.get("dsec.pool", "home")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeEndpoint:
        return cls(
            name=data["name"],
            url=data["url"],
            token=data["token"],
            labels=dict(data.get("labels") or {}),
            ray_node_id=data.get("ray_node_id", ""),
            alive=bool(data.get("alive", True)),
        )


@dataclass(frozen=True)
class NodeState:
    """One node as ``dsec cluster ls`` shows it: its endpoint, the daemon's pid (None when it
    is not running), its home, its uid range, and the Ray node's address."""

    endpoint: NodeEndpoint
    pid: int | None
    home: str
    uid_base: int
    uid_count: int
    node_ip: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the token (``ls`` output is often pasted around)."""
        e = self.endpoint
        return {
            "name": e.name,
            "url": e.url,
            "labels": dict(e.labels),
            "alive": e.alive,
            "pid": self.pid,
            "home": self.home,
            "uid_base": self.uid_base,
            "uid_count": self.uid_count,
            "node_ip": self.node_ip,
            "ray_node_id": e.ray_node_id,
        }
