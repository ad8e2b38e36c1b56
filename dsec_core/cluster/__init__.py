"""dsec on Ray: ``dsec cluster up`` starts one node daemon per Ray node, each with its own
``DSEC_HOME``, uid range, name and labels, kept by a detached actor pinned to that node;
``discover`` gives an apiserver their endpoints; ``dsec cluster down`` stops them.

Ray is optional (``pip install 'dsec[cluster]'``): it is imported when a function here is
first called, and its absence is a ``ClusterUnavailable`` then, not an import error.
"""

from .control import (
    ACTOR_PREFIX,
    DEFAULT_HOME_ROOT,
    NAMESPACE,
    ClusterPlan,
    connect,
    disconnect,
    discover,
    down,
    node_labels,
    status,
    up,
)
from .endpoint import ClusterUnavailable, NodeEndpoint, NodeState, format_labels
from .node_keeper import KeeperSettings, NodeKeeper

__all__ = [
    "ACTOR_PREFIX",
    "DEFAULT_HOME_ROOT",
    "NAMESPACE",
    "ClusterPlan",
    "ClusterUnavailable",
    "KeeperSettings",
    "NodeEndpoint",
    "NodeKeeper",
    "NodeState",
    "connect",
    "disconnect",
    "discover",
    "down",
    "format_labels",
    "node_labels",
    "status",
    "up",
]
