"""Placement: choosing the node for a sandbox among the eligible ones (``NodeLoad`` records).

The default, best-of-k, samples ``k`` eligible nodes at random and takes the least loaded
(``NodeLoad.load``, in steps of ``LOAD_GRAIN``; ties go to the node with fewer sandboxes for its
size, then to the first name). Nodes that already hold the request's layers
mounted (``holds``: a create there mounts nothing and finds the page cache warm) are sampled
first, while they are under ``WARM_LOAD``. Sampling rather than scanning keeps many
concurrent placers from all piling onto the one emptiest node, and k = 2-3 already comes close
to the least-loaded choice (the "power of two choices"). ``DSEC_PLACEMENT_K`` sets k (default
3). It is registered by core and answers last: a plugin's ``dsec_place`` goes first.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

from .errors import InvalidSpec
from .hookspecs import hookimpl
from .records import NodeLoad, SandboxSpec

__all__ = ["LOAD_GRAIN", "WARM_LOAD", "best_of_k", "dsec_place", "holds", "placement_k"]

DEFAULT_K = 3
#: A node holding the request's layers is preferred only while its load is under this.
WARM_LOAD = 0.8
#: Loads closer than this count as equal (then the node with fewer sandboxes wins).
LOAD_GRAIN = 0.02


def placement_k() -> int:
    """k for best-of-k: ``DSEC_PLACEMENT_K`` (a positive integer), 3 by default."""
    text = os.environ.get("DSEC_PLACEMENT_K", "").strip()
    if not text:
        return DEFAULT_K
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise InvalidSpec(
            f"DSEC_PLACEMENT_K must be a positive integer, got {text!r}", field="DSEC_PLACEMENT_K"
        )
    return k


def best_of_k(
    nodes: Sequence[NodeLoad], k: int, rng: random.Random | None = None
) -> NodeLoad | None:
    """The least loaded of ``k`` nodes sampled from ``nodes`` (all of them if there are no
    more than ``k``); None if ``nodes`` is empty."""
    if not nodes:
        return None
    sample = list(nodes) if len(nodes) <= k else (rng or random).sample(list(nodes), k)
    return min(sample, key=_order)


def _order(node: NodeLoad) -> tuple[int, float, float, str]:
    """Least loaded first, loads within ``LOAD_GRAIN`` of each other counting as equal (a
    probe's memory reading moves by more than a sandbox does); among equals, the fewest
    sandboxes for the node's size, then the exact load, then the name."""
    return (
        int(node.load / LOAD_GRAIN),
        node.sandboxes / max(node.max_sandboxes, 1),
        node.load,
        node.node,
    )


def holds(node: NodeLoad, request: SandboxSpec) -> bool:
    """Whether ``node`` holds everything ``request`` would mount: its environment's layers
    (``NodeLoad.environments``) and its extra layers (``NodeLoad.layers``)."""
    if not request.environment and not request.layers:
        return False
    if request.environment and request.environment not in node.environments:
        return False
    return all(ref in node.layers for ref in request.layers)


@hookimpl(trylast=True)
def dsec_place(request: SandboxSpec, nodes: list[NodeLoad]) -> NodeLoad | None:
    warm = [n for n in nodes if n.load < WARM_LOAD and holds(n, request)]
    return best_of_k(warm or nodes, placement_k())
