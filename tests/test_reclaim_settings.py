"""The reclaim's settings and the cold-memory probe's reading of smaps (pure logic; the
microVM tests show memory given back by real guests)."""

from __future__ import annotations

import pytest

from dsec_core.errors import InvalidSpec
from dsec_core.node.reclaim import ReclaimSettings
from dsec_core.vm.coldmem import ram_mapping

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
