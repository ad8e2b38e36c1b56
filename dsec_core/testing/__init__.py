"""The conformance kit: test classes a plugin subclasses so it runs exactly our checks, the
pytest fixtures they use, and helpers for tests that start real servers on loopback.

Opt-in, as pytester is: enable it with ``-p dsec_core.testing`` (command line or ``addopts``)
or ``pytest_plugins = ["dsec_core.testing"]`` in the rootdir's conftest.py. Then:

- ``BackendConformance``: every backend plugin's checks (set ``backend_name``).
- ``LayerSourceConformance``: every layer-source plugin's checks (provide ``dsec_source``,
  ``corrupt`` and ``unreachable``).
- ``SecurityPolicyConformance``: every security policy plugin's checks (set ``policy_name``
  and the ``backend_name`` its sandboxes run on).
- ``local_ray_cluster``, ``cluster_daemons`` and fixtures ``dsec_ray_cluster``,
  ``dsec_cluster``: a 3-node Ray cluster on loopback and dsec node daemons on it (needs Ray:
  ``pip install 'dsec[cluster]'``; the fixtures skip without it).
- ``running_fleet``, ``SimulatedFleet``, ``Behaviour``: many simulated node identities served
  by one process over the real node API (no sandboxes behind them), to run an apiserver
  against 160 nodes on one machine (``fleet``).
- ``private_dockerd`` and fixture ``dsec_dockerd``: a dockerd of a test's or benchmark's own
  (socket, data root, no networking), stopped and removed at the end.
- fixtures ``dsec_node``, ``dsec_client``, ``dsec_backend_name``, ``dsec_sandboxes``: a real
  node daemon in a private home (under ``DSEC_KIT_HOME``, else ``DSEC_HOME``, else the temporary
  directory), a client of it, the backend under test, and a recorder that kills every sandbox
  a test made.

Loading it twice (``-p dsec_core.testing`` and a conftest line) is harmless: pytest registers a
plugin module once.
"""

from .backend import BackendConformance
from .dockerd import PrivateDockerd, dsec_dockerd, private_dockerd
from .fixtures import (
    KIT_DEVICE_KIND,
    KitNode,
    SandboxRecorder,
    build_busybox_layer,
    cgroup_hierarchies,
    daemon_config,
    dsec_backend_name,
    dsec_client,
    dsec_node,
    dsec_sandboxes,
    kit_home_parent,
    leaves_no_mounts_or_threads,
    leftovers,
    make_busybox_rootfs,
    make_standin_device,
    node_home,
    running_kit_node,
)
from .fleet import Behaviour, FleetProcess, SimulatedFleet, running_fleet
from .policies import SecurityPolicyConformance
from .procs import free_port, pids_matching, stop_process
from .ray import (
    KitCluster,
    LocalRayCluster,
    RayNodeProcess,
    cluster_daemons,
    dsec_cluster,
    dsec_ray_cluster,
    local_ray_cluster,
    ray_importable,
    ray_loopback_lock,
)
from .sources import LayerSourceConformance
from .waits import async_until, until

__all__ = [
    "KIT_DEVICE_KIND",
    "BackendConformance",
    "Behaviour",
    "FleetProcess",
    "KitCluster",
    "KitNode",
    "LayerSourceConformance",
    "LocalRayCluster",
    "PrivateDockerd",
    "RayNodeProcess",
    "SandboxRecorder",
    "SecurityPolicyConformance",
    "SimulatedFleet",
    "async_until",
    "build_busybox_layer",
    "cgroup_hierarchies",
    "cluster_daemons",
    "daemon_config",
    "dsec_backend_name",
    "dsec_client",
    "dsec_cluster",
    "dsec_dockerd",
    "dsec_node",
    "dsec_ray_cluster",
    "dsec_sandboxes",
    "free_port",
    "kit_home_parent",
    "leaves_no_mounts_or_threads",
    "leftovers",
    "local_ray_cluster",
    "make_busybox_rootfs",
    "make_standin_device",
    "node_home",
    "pids_matching",
    "private_dockerd",
    "ray_importable",
    "ray_loopback_lock",
    "running_fleet",
    "running_kit_node",
    "stop_process",
    "until",
]
