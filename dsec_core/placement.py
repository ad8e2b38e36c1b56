"""Placement: choosing the node for a sandbox among the eligible ones (``NodeLoad`` records).

The default, best-of-k, samples ``k`` eligible nodes at random and takes the least loaded
(``NodeLoad.load``; ties go to the first name). Sampling rather than scanning keeps many
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

__all__ = ["best_of_k", "dsec_place", "placement_k"]

DEFAULT_K = 3


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
    return min(sample, key=lambda n: (n.load, n.node))


@hookimpl(trylast=True)
def dsec_place(request: SandboxSpec, nodes: list[NodeLoad]) -> NodeLoad | None:
    return best_of_k(nodes, placement_k())
