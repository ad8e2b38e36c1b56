"""Placement: choosing the node for a sandbox among the eligible ones (``NodeLoad`` records).

The default, best-of-k, samples ``k`` eligible nodes at random and takes the least loaded
(``NodeLoad.load``). Loads within ``LOAD_GRAIN`` of the least count as equal (a probe's memory
reading moves by more than one sandbox does); among those the node with the fewest sandboxes
wins, where a node that already holds the request's layers mounted (``holds``: a create there
mounts nothing and finds the page cache warm) counts ``WARM_SANDBOXES`` fewer while its load is
under ``WARM_LOAD``. So a batch goes mostly where its layers are, and spreads once that node
holds a few more than the others. Sampling rather than scanning keeps many concurrent
placers from all piling onto the one emptiest node, and k = 2-3 already comes close to the
least-loaded choice (the "power of two choices"). ``DSEC_PLACEMENT_K`` sets k (default 3). It
is registered by core and answers last: a plugin's ``dsec_place`` goes first.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

from .errors import InvalidSpec
from .hookspecs import hookimpl
from .records import NodeLoad, SandboxSpec

__all__ = [
    "LOAD_GRAIN",
    "WARM_LOAD",
    "WARM_SANDBOXES",
    "best_of_k",
    "dsec_place",
    "holds",
    "placement_k",
]

DEFAULT_K = 3
#: Loads closer than this to the least count as equal (then the fewest sandboxes wins).
LOAD_GRAIN = 0.02
#: What holding the request's layers is worth, in sandboxes, while the node's load is under
#: ``WARM_LOAD``.
WARM_SANDBOXES = 4
WARM_LOAD = 0.8


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
    nodes: Sequence[NodeLoad],
    k: int,
    rng: random.Random | None = None,
    request: SandboxSpec | None = None,
) -> NodeLoad | None:
    """The least loaded of ``k`` nodes sampled from ``nodes`` (all of them if there are no
    more than ``k``), nodes holding ``request``'s layers first as the module says; None if
    ``nodes`` is empty."""
    if not nodes:
        return None
    sample = list(nodes) if len(nodes) <= k else (rng or random).sample(nodes, k)
    loads = [(n.load, n) for n in sample]  # each node's load once: a create places by it
    least = min(load for load, _ in loads)
    close = [(load, n) for load, n in loads if load <= least + LOAD_GRAIN]

    def order(pair: tuple[float, NodeLoad]) -> tuple[float, float, str]:
        load, n = pair
        count = float(n.sandboxes)
        if request is not None and load < WARM_LOAD and holds(n, request):
            count -= WARM_SANDBOXES
        return (count / max(n.max_sandboxes, 1), load, n.node)

    return min(close, key=order)[1]


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
    return best_of_k(nodes, placement_k(), request=request)
