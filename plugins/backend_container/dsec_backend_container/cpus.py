"""Which cores a sandbox runs on: a sandbox whose CPU limit is below the host's core count is
pinned (cpuset) to ceil(limit) cores, the least committed ones, so ``nproc`` and
``os.sched_getaffinity`` inside count its limit, as ``make -j$(nproc)`` and ``pytest -n auto``
expect.

The count of CPUs a program sees through sched_getaffinity can only come from a real affinity
mask; lxcfs cannot change it. Pinning costs some fairness: the kernel no longer moves a pinned
sandbox to an idle core, so two busy 1-CPU sandboxes that share a core get half a core each
while another may idle. Each sandbox's limit is therefore spread over its cores as committed
load, and a new sandbox goes to the cores with the least committed load; nothing is moved
afterwards. ``DSEC_CPU_PINNING=off`` turns it off (the CFS quota still limits, and lxcfs still
shows the quota in /proc/cpuinfo, /proc/stat and cpu/online, so ``os.cpu_count()`` and
``getconf _NPROCESSORS_ONLN`` count it; only ``nproc`` shows the host's cores then).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["CpuPinning", "format_cpus", "host_cpus", "pinning_enabled"]

CPUSET_ROOTS = (
    Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus"),  # cgroup v1 (and hybrid)
    Path("/sys/fs/cgroup/cpuset.cpus.effective"),  # cgroup v2
)


def pinning_enabled() -> bool:
    return os.environ.get("DSEC_CPU_PINNING", "on").strip().lower() not in ("0", "off", "no")


def parse_cpus(text: str) -> list[int]:
    """A kernel cpu list (``0-3,6``) as numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpus(cpus: list[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def host_cpus() -> list[int]:
    """The cores sandboxes may run on: the root cpuset's (runc's ``dsec`` parent inherits
    it), else this process's affinity."""
    for path in CPUSET_ROOTS:
        try:
            cpus = parse_cpus(path.read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return sorted(os.sched_getaffinity(0))


class CpuPinning:
    """The committed CPU load per core of one node's pinned sandboxes."""

    def __init__(self, cpus: list[int]) -> None:
        self.load = {c: 0.0 for c in cpus}
        self.pinned: dict[str, tuple[list[int], float]] = {}

    def pick(self, sandbox_id: str, cpu: float) -> list[int] | None:
        """The cores for a sandbox with a limit of ``cpu``, counted as committed; None (not
        pinned) when the limit needs every core."""
        n = max(1, math.ceil(cpu - 1e-9))
        if n >= len(self.load):
            return None
        cores = sorted(sorted(self.load, key=lambda c: (self.load[c], c))[:n])
        self.add(sandbox_id, cores, cpu)
        return cores

    def add(self, sandbox_id: str, cores: list[int], cpu: float) -> None:
        """Count a sandbox pinned to ``cores`` (once; a re-adopted one, say)."""
        if sandbox_id in self.pinned or not cores:
            return
        self.pinned[sandbox_id] = (cores, cpu)
        for c in cores:
            if c in self.load:
                self.load[c] += cpu / len(cores)

    def release(self, sandbox_id: str) -> None:
        cores, cpu = self.pinned.pop(sandbox_id, ([], 0.0))
        for c in cores:
            if c in self.load:
                self.load[c] = max(0.0, self.load[c] - cpu / len(cores))
