"""The microVM backend runs the conformance kit every backend runs: checks that only hold for a
shared kernel (host /proc, host-side writable layer, cgroup limits inside) skip with reasons."""

import shutil

import pytest

from dsec_core.testing import BackendConformance

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-system-x86_64") is None, reason="QEMU is not installed"
)


class TestMicroVmBackend(BackendConformance):
    backend_name = "microvm"
