"""The suite's pytest set-up: dsec's test kit is opt-in (as pytester is), and this repository
opts in for its own tests and every plugin's.

The suite runs under pytest-xdist (``run.sh test``: ``-n`` workers, ``--dist loadfile``: each
module on one worker, so its shared fixtures, a node, an apiserver or a cluster, are made once
and its tests keep their order). What the machine has once, each worker gets a share of its own,
set here before any test or daemon starts (daemons inherit the environment):

- host uid ranges: worker k's nodes hand out ``DSEC_UID_RANGES`` ranges from a base of its own,
  so sandboxes of two workers' nodes never share a host uid (the kernel's per-uid key quota and
  process limits stay per sandbox);
- homes, ports and cgroups are already per node (a fresh ``tmp_path`` home per test or kit node,
  ports chosen free, cgroups named by sandbox id and by a digest of the home);
- Ray's loopback addresses (127.0.0.2-4) are the machine's only fixed ones: a module that starts
  a Ray cluster holds ``dsec_core.testing.ray_loopback_lock`` while it runs, so two such modules
  on two workers run one after the other.
"""

import os

pytest_plugins = ["dsec_core.testing"]

# Every test node's VM backends share one cache of guest kernels, initramfs, pmem images and
# start templates (else each session's node would fetch a kernel again).
os.environ.setdefault("DSEC_VM_CACHE", "/var/cache/dsec-test-vm")

#: Host uid ranges per xdist worker (each ``uid_size``, 65536 ids, wide): 2048 ranges are far
#: more than any test's node holds at once, and leave room for 30 workers under 2**32.
WORKER_UID_RANGES = 2048
BASE_UID = 100000


def _worker_index() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... in a worker
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def pytest_configure(config) -> None:
    k = _worker_index()
    if k is None or "DSEC_UID_BASE" in os.environ:
        return
    os.environ["DSEC_UID_BASE"] = str(BASE_UID + k * WORKER_UID_RANGES * 65536)
    os.environ.setdefault("DSEC_UID_RANGES", str(WORKER_UID_RANGES))
