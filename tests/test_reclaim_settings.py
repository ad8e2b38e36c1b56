"""The reclaim's settings and the cold-memory probe's reading of smaps (pure logic; the
microVM tests show memory given back by real guests)."""

from __future__ import annotations

import pytest

from dsec_core.errors import InvalidSpec
from dsec_core.node.reclaim import ReclaimSettings
from dsec_core.vm.coldmem import GuestLoad, Settled, guest_cpu, ram_mapping

SMAPS = """\
55deb4167000-55deb4510000 rw-p 00de3000 fe:00 2170917    /usr/bin/qemu-system-x86_64
Size:               3748 kB
Rss:                1216 kB
Referenced:           40 kB
7f0000000000-7f0020000000 rw-p 00000000 00:00 0
Size:             524288 kB
Rss:              150000 kB
Pss:              150000 kB
Referenced:        40000 kB
7f0020000000-7f0020001000 rw-p 00000000 00:00 0
Size:                  4 kB
Rss:                   4 kB
Referenced:            4 kB
"""


def test_the_guest_ram_mapping_is_found_by_its_size():
    assert ram_mapping(SMAPS, 512 << 20) == (150000 << 10, 40000 << 10)
    assert ram_mapping(SMAPS, 256 << 20) is None


def test_settings_from_the_environment_and_the_floor():
    d = ReclaimSettings.from_env({})
    assert d.enabled and d.interval == 30 and d.floor(512 << 20) == 64 << 20
    s = ReclaimSettings.from_env(
        {"DSEC_VM_RECLAIM": "0", "DSEC_VM_RECLAIM_INTERVAL": "5", "DSEC_VM_RECLAIM_FLOOR": "96M"}
    )
    assert not s.enabled and s.interval == 5
    assert s.floor(512 << 20) == 96 << 20 and s.floor(64 << 20) == 64 << 20  # never above
    assert ReclaimSettings.from_env({"DSEC_VM_RECLAIM_FLOOR": "0.5"}).floor(1 << 30) == 512 << 20
    for bad in ({"DSEC_VM_RECLAIM_INTERVAL": "0"}, {"DSEC_VM_RECLAIM_FLOOR": "lots"}):
        with pytest.raises(InvalidSpec):
            ReclaimSettings.from_env(bad)


STAT = b"""cpu  %d 0 %d %d %d 0 7 0 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
cpu1 1 0 1 1 0 0 0 0 0 0
intr 12345
ctxt 678
"""


def test_a_guests_load_is_its_own_busy_ticks_in_cores():
    """Busy is everything but idle and iowait, over all of the guest's CPUs, in cores."""
    assert guest_cpu(STAT % (100, 50, 800, 43)) == (157, 1000, 2)
    load = GuestLoad()
    assert load.cores(7, STAT % (100, 50, 800, 43)) is None  # nothing to compare with yet
    # 200 more ticks over 2 CPUs, 100 of them busy: half the guest, one core
    assert load.cores(7, STAT % (180, 70, 900, 43)) == pytest.approx(1.0)
    assert load.cores(7, STAT % (182, 70, 1096, 45)) == pytest.approx(0.02)
    load.forget(7)
    assert load.cores(7, STAT % (190, 70, 1200, 45)) is None
    with pytest.raises(ValueError):
        guest_cpu(b"MemTotal: 1 kB\n")


def test_a_guest_that_gave_little_is_left_alone_a_few_passes_not_for_good():
    """A guest that freed under half of what looked cold (its data was still being written
    back, say) is left alone until it grows or for ``passes`` passes, then asked again; one
    that gave what it was asked is asked every pass. Before, it was left alone for good: an
    idle guest that wrote 96 MiB just before a pass on a loaded host never gave any back."""
    mib = 1 << 20
    settled = Settled(grown=32 * mib, passes=3)
    assert not settled.holds(1, 200 * mib)
    settled.gave(1, 200 * mib, asked=96 * mib, freed=10 * mib)
    assert [settled.holds(1, 190 * mib) for _ in range(4)] == [True, True, True, False]
    assert not settled.holds(1, 190 * mib)  # asked again, and every pass after
    settled.gave(1, 190 * mib, asked=96 * mib, freed=0)
    assert settled.holds(1, 200 * mib)
    assert not settled.holds(1, 222 * mib)  # it grew: what it holds now may be cold
    settled.gave(1, 222 * mib, asked=96 * mib, freed=90 * mib)
    assert not settled.holds(1, 132 * mib)
    settled.gave(2, 100 * mib, asked=64 * mib, freed=0)
    settled.forget(2)
    assert not settled.holds(2, 100 * mib)
