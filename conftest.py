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


#: Modules whose few tests are long, in seconds (the sum of their tests' times in ``--durations``
#: of a CI run, or of the module run alone, rounded). xdist hands modules out in order; by default it orders them by
#: their number of tests, so a module of three one-minute tests went out last and ran alone
#: at the end. ``run.sh test`` passes ``--no-loadscope-reorder`` and the hook below orders
#: them longest first (longest processing time first: the run's tail is a short module).
LONG_MODULES = {
    "tests/test_lazy_layers.py": 90,
    "tests/adversarial/test_tenants.py": 85,
    "tests/test_first_contract.py": 80,
    "tests/test_plugin_new.py": 55,
    "tests/test_cluster.py": 55,
    "tests/test_layout.py": 40,
    "tests/test_image_export.py": 40,
    "tests/test_uid_ranges.py": 36,
    "builders/builder/tests/test_build_demo.py": 36,
    "plugins/layer_oci/tests/test_oci_distribution_e2e.py": 33,
    "tests/test_apiserver.py": 28,
    "plugins/backend_container/tests/test_limits.py": 27,
    "builders/builder/tests/test_builder.py": 26,
    "tests/test_cluster_apiserver.py": 26,
    "plugins/backend_microvm/tests/test_microvm.py": 25,
    "tests/test_plugin_failures.py": 24,
    "tests/test_snapshots.py": 23,
    "plugins/backend_microvm/tests/test_backend_microvm.py": 21,
    "tests/test_demo.py": 50,  # 22 s alone, 55 s under the suite's load
    "tests/adversarial/test_api.py": 40,
    "tests/test_backend_contract.py": 33,
    "tests/test_vm_channel.py": 29,
    "builders/builder/tests/test_pkgindex.py": 22,
    "tests/test_e2b_apiserver.py": 20,
    "tests/test_node_scale.py": 18,
    "tests/test_node_cluster_api.py": 18,
    "tests/test_apiserver_builds.py": 18,
    "tests/test_program_table.py": 14,
    "builders/builder/tests/test_builder_accounts.py": 14,
    "tests/test_observe_apiserver.py": 13,
    "tests/test_daemon_log.py": 12,
    "tests/adversarial/test_disk.py": 12,
}
#: What a test takes on average (a suite run's wall time x workers / tests), for the rest.
SECONDS_PER_TEST = 1.8


def pytest_collection_modifyitems(config, items) -> None:
    """Modules longest first (estimated: ``LONG_MODULES``, else their tests' count times
    ``SECONDS_PER_TEST``); each module's tests keep their order."""
    counts: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        counts[module] = counts.get(module, 0) + 1

    def estimate(module: str) -> float:
        return LONG_MODULES.get(module, 0) + counts[module] * SECONDS_PER_TEST

    first_seen = {m: i for i, m in enumerate(counts)}
    items.sort(
        key=lambda item: (
            -estimate(module := item.nodeid.split("::", 1)[0]),
            first_seen[module],
        )
    )
