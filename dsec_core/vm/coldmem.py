"""How much of a VM's RAM its guest has not touched lately, seen from the host: the referenced
bits of the pages QEMU maps as the guest's RAM.

``ColdProbe.sample(pid, size)`` reads ``/proc/<pid>/smaps`` for the mapping of ``size`` bytes
(the guest's RAM: anonymous, or the saved RAM file a restored VM maps) and returns its resident
bytes and those not referenced since the previous sample, then clears the process's referenced
bits (``/proc/<pid>/clear_refs``) for the next one. Under TCG the guest's accesses are QEMU's own
and set the bits; under KVM a guest's accesses go through the second-level page tables, which
this does not read (DAMON's physical-address mode does; ``damon_status`` says whether this
node could run it).

How busy a guest is comes from the guest itself (``GuestLoad``: its ``/proc/stat``, read through
its agent): a guest kernel counts the time it had work as busy whether or not the host gave
its vCPU a core meanwhile, so a busy guest on a loaded host reads as busy and an idle one as
idle. The host's own figures cannot tell them apart there: a busy guest gets a small share
of a core, and an idle one that wakes ten times a second waits runnable for each wake-up.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ColdProbe",
    "GuestLoad",
    "RamSample",
    "Settled",
    "damon_status",
    "guest_cpu",
    "ram_mapping",
]

DAMON_ADMIN = Path("/sys/kernel/mm/damon/admin/kdamonds")


@dataclass(frozen=True)
class RamSample:
    """One sample of a guest's RAM: resident bytes, and those not referenced since the last
    sample."""

    resident: int
    cold: int


class ColdProbe:
    """Samples of each VM's RAM mapping; the first sample of a process has nothing to compare
    with and reports nothing cold."""

    def __init__(self) -> None:
        self._seen: set[int] = set()  # pids sampled before

    def sample(self, pid: int, size: int) -> RamSample | None:
        """``pid``'s guest RAM (the mapping of exactly ``size`` bytes) now, or None if the
        process or the mapping is gone."""
        try:
            text = Path(f"/proc/{pid}/smaps").read_text()
        except OSError:
            self._seen.discard(pid)
            return None
        found = ram_mapping(text, size)
        if found is None:
            return None
        rss, referenced = found
        seen = pid in self._seen
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("1\n")
            self._seen.add(pid)
        if not seen:
            return RamSample(resident=rss, cold=0)
        return RamSample(resident=rss, cold=max(0, rss - referenced))

    def forget(self, pid: int) -> None:
        self._seen.discard(pid)


def guest_cpu(stat: bytes) -> tuple[int, int, int]:
    """From a guest's ``/proc/stat``: (busy, all) clock ticks of its CPUs together since it
    booted (busy: all but idle and iowait), and how many CPUs it has. ``ValueError`` if it
    is not that file."""
    busy = total = cpus = 0
    found = False
    for line in stat.decode(errors="replace").splitlines():
        name, _, rest = line.partition(" ")
        if name == "cpu":
            ticks = [int(v) for v in rest.split()]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            total, busy, found = sum(ticks[:8]), sum(ticks[:8]) - idle, True
        elif name.startswith("cpu") and name[3:].isdigit():
            cpus += 1
    if not found or cpus == 0:
        raise ValueError("no cpu lines: not a /proc/stat")
    return busy, total, cpus


class GuestLoad:
    """How busy each guest was between two of its ``/proc/stat`` (``guest_cpu``): cores'
    worth of work since the last one; None for the first."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}  # pid -> (busy, all) ticks

    def cores(self, pid: int, stat: bytes) -> float | None:
        busy, total, cpus = guest_cpu(stat)
        last = self._last.get(pid)
        self._last[pid] = (busy, total)
        if last is None or total <= last[1]:
            return None
        return cpus * (busy - last[0]) / (total - last[1])

    def forget(self, pid: int) -> None:
        self._last.pop(pid, None)


class Settled:
    """The guests that could not give half of what looked cold (what they hold is in use, or
    not theirs to give): left alone until they grow by ``grown`` bytes, or for ``passes``
    passes. Not for good: what was in use may be free later, and data a guest wrote is
    reclaimable only once written back (a guest that wrote much just before a pass, on a
    loaded host, gave nothing then and everything a minute later)."""

    def __init__(self, grown: int, passes: int) -> None:
        self.grown, self.passes = grown, passes
        self._held: dict[int, tuple[int, int]] = {}  # pid -> (resident after, passes left)

    def holds(self, pid: int, resident: int) -> bool:
        """Whether to leave ``pid`` alone this pass (counted as one of its passes)."""
        held = self._held.get(pid)
        if held is None:
            return False
        settled, left = held
        if resident >= settled + self.grown or left <= 0:
            del self._held[pid]
            return False
        self._held[pid] = (settled, left - 1)
        return True

    def gave(self, pid: int, resident: int, asked: int, freed: int) -> None:
        """What ``pid`` freed of the ``asked`` bytes, with ``resident`` before."""
        if freed < asked // 2:
            self._held[pid] = (max(0, resident - freed), self.passes)
        else:
            self._held.pop(pid, None)

    def forget(self, pid: int) -> None:
        self._held.pop(pid, None)


def ram_mapping(smaps: str, size: int) -> tuple[int, int] | None:
    """(Rss, Referenced) in bytes of the first mapping of ``size`` bytes in ``smaps``."""
    inside = False
    rss = None
    for line in smaps.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, _, end = head.partition("-")
            try:
                inside = int(end, 16) - int(start, 16) == size
            except ValueError:
                inside = False
            continue
        if not inside:
            continue
        key, _, value = line.partition(":")
        if key == "Rss":
            rss = int(value.split()[0]) << 10
        elif key == "Referenced" and rss is not None:
            return rss, int(value.split()[0]) << 10
    return None


def damon_status() -> tuple[bool, str]:
    """Whether this node could run DAMON of its own through the sysfs interface, and why not:
    the interface changes its number of kdamonds only while none runs, so a host whose own
    DAMON (a platform's proactive reclaim, say) runs leaves no room for another user."""
    nr = DAMON_ADMIN / "nr_kdamonds"
    if not nr.is_file():
        return False, "no DAMON sysfs interface (CONFIG_DAMON_SYSFS)"
    running = []
    for d in sorted(DAMON_ADMIN.iterdir()):
        with contextlib.suppress(OSError):
            if d.is_dir() and (d / "state").read_text().strip() == "on":
                running.append(d.name)
    if running:
        return False, (
            f"DAMON's sysfs interface is held: kdamond {', '.join(running)} runs for another "
            "user of this host, and nr_kdamonds cannot change while one does"
        )
    return True, "DAMON's sysfs interface is free"
