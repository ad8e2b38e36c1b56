"""The host's memory as the kernel reports it: ``/proc/meminfo`` and pressure stall information.

Admission reads these on every create (about 30 us together), so they parse only what is asked
for and never raise: a kernel without PSI reports no pressure.
"""

from __future__ import annotations

__all__ = ["meminfo", "pressure"]


def meminfo(*fields: str) -> dict[str, int]:
    """The named ``/proc/meminfo`` fields (``"MemAvailable"``, ...) in bytes; all when none are
    named."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if fields and name not in fields:
                continue
            parts = rest.split()
            value = int(parts[0])
            out[name] = value * 1024 if parts[1:] == ["kB"] else value
            if fields and len(out) == len(fields):
                break
    return out


def pressure(resource: str = "memory") -> dict[str, float]:
    """PSI of ``resource`` (``memory``, ``cpu``, ``io``): ``{"some_avg10": %, "full_avg10": %,
    ...}``, the share of the last 10/60/300 s that some (or all) tasks stalled on it. Empty
    where the kernel has no PSI (``psi=0``, or built without it)."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/pressure/{resource}") as f:
            text = f.read()
    except OSError:
        return out
    for line in text.splitlines():
        kind, *pairs = line.split()
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key.startswith("avg"):
                out[f"{kind}_{key}"] = float(value)
    return out
