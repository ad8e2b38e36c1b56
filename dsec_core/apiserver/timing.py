"""Where an apiserver request's time goes, as its answer's ``Server-Timing`` header says.

Each request's ``Stages`` ride in the ASGI scope (``TIMING``) from the key check on; each
stage is closed by a ``mark`` with its name, and lasts from the mark before it. The stages,
in ms (``docs/operators/observability.md`` says what each holds):

- ``auth``: the API key checked (IAM, cached);
- ``admit``: the route found, the body read and decoded, what it names checked against the
  caller's reach (a create's spec: layers, policies, labels);
- ``place``: a create's quotas, placement and holds (and its time in the placement queue,
  for a create that waits for room);
- ``node``: the node's answer awaited: from the request sent to its answer read. It holds
  ``upstream``, the node's own time (its ``Server-Timing`` ``total``), and ``hop``, the rest:
  the connection, the bytes both ways, the node's HTTP parsing, and the wait for each process
  to be scheduled;
- ``relay``: the node's answer made into ours;
- ``apiserver``: the apiserver's own work, ``auth + admit + place + relay``.

Every dsec server (node or apiserver) also adds ``total``: its time from the request's head
to its answer's head (``dsec_core.observe.ObservedRequests``).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["OWN", "TIMING", "Stages", "stages_of", "upstream_total"]

#: The ASGI scope key of a request's ``Stages``.
TIMING = "dsec.timing"
#: The stages that are the apiserver's own work (not waiting for a node).
OWN = ("auth", "admit", "place", "relay")


class Stages:
    """One request's stages: ``mark(name)`` closes the stage that began at the previous mark
    (or at the request's start), adding its time to ``name``."""

    __slots__ = ("durations", "last", "upstream")

    def __init__(self, start: float | None = None) -> None:
        self.last = time.perf_counter() if start is None else start
        self.durations: dict[str, float] = {}
        self.upstream: float | None = None  # the node's own time, ms (its ``total``)

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        d = self.durations
        d[name] = d.get(name, 0.0) + (now - self.last)
        self.last = now

    def header(self) -> str:
        """The ``Server-Timing`` value: each stage in ms, the node's own time and the hop
        when a node answered, and the apiserver's own work."""
        d = self.durations
        parts = [f"{name};dur={secs * 1e3:.3f}" for name, secs in d.items()]
        if self.upstream is not None and "node" in d:
            hop = max(0.0, d["node"] * 1e3 - self.upstream)
            parts.append(f"upstream;dur={self.upstream:.3f}, hop;dur={hop:.3f}")
        own = sum(d.get(name, 0.0) for name in OWN)
        parts.append(f"apiserver;dur={own * 1e3:.3f}")
        return ", ".join(parts)


def stages_of(scope: Any) -> Stages:
    """The request's ``Stages`` (new ones if the key check did not start them)."""
    stages = scope.get(TIMING)
    if stages is None:
        stages = scope[TIMING] = Stages()
    return stages


def upstream_total(headers: Any) -> float | None:
    """The ``total`` a node's answer gives in its ``Server-Timing`` header (ms), if any."""
    value = headers.get("server-timing")
    if not value:
        return None
    for part in value.split(","):
        name, _, rest = part.strip().partition(";dur=")
        if name == "total":
            try:
                return float(rest)
            except ValueError:
                return None
    return None
