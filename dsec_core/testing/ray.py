"""A real Ray cluster of several nodes on loopback for tests and benchmarks, and dsec node
daemons on it (``dsec cluster up``), each removed again to the last process.

Ray takes 127.0.0.1 for the machine's own address, so its nodes get other loopback addresses:
the head 127.0.0.2, workers 127.0.0.3, 127.0.0.4, ... Every port is chosen free or left to
the OS (workers' ports included: ``--min/max-worker-port=0``), so clusters of several
developers run side by side, and everything is stopped by pid (the ``ray start`` processes and
every process below them), never with ``ray stop``, which kills every Ray process by name.

- ``local_ray_cluster(n=3, overflow=1)``: the Ray cluster (``LocalRayCluster``);
- ``cluster_daemons(ray_cluster)``: ``dsec cluster up`` on it, with a shared layer store that
  holds the kit's busybox layer (``KitCluster``);
- fixtures ``dsec_ray_cluster`` and ``dsec_cluster`` (module scope: a process talks to one Ray
  cluster at a time, so each test module gets its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ..cluster import ClusterPlan, NodeEndpoint, connect, disconnect, down, status, up
from ..errors import NodeUnavailable
from ..layers.store import LayerStore
from ..linux.processes import free_port, proc_stat, start_time, still_running
from ..records import LayerInfo
from ..sdk import Client
from .fixtures import build_busybox_layer, kit_home_parent, leftovers

__all__ = [
    "KitCluster",
    "LocalRayCluster",
    "RayNodeProcess",
    "cluster_daemons",
    "dsec_cluster",
    "dsec_ray_cluster",
    "local_ray_cluster",
    "ray_importable",
    "ray_loopback_lock",
]

#: The head's address; worker k (from 1) gets 127.0.0.(2 + k).
HEAD_IP = "127.0.0.2"
#: The machine-wide lock of the loopback addresses above (``ray_loopback_lock``).
LOOPBACK_LOCK = Path("/run/lock/dsec-test-ray-loopback.lock")
#: Ray's smallest object store (bytes); a test cluster stores no objects worth the name.
OBJECT_STORE_BYTES = 80 * 1000 * 1000
#: Test nodes' uid ranges: clear of a default node's (100000 + 8192 ranges of 65536 ids).
TEST_UID_BASE = 1 << 31
TEST_UID_RANGES = 1024


def ray_importable() -> bool:
    """Whether Ray is installed (``pip install 'dsec[cluster]'``)."""
    return importlib.util.find_spec("ray") is not None


@dataclass(frozen=True)
class RayNodeProcess:
    """One Ray node of a ``LocalRayCluster``: its address, Ray node id, the pid of its
    ``ray start --block`` process (the root of its processes), whether it is in the overflow
    pool (resource ``dsec_overflow``), and its Ray temp dir."""

    ip: str
    node_id: str
    pid: int
    overflow: bool
    temp_dir: Path


@dataclass
class LocalRayCluster:
    """A Ray cluster started by ``local_ray_cluster``: ``address`` is the head's GCS
    (``127.0.0.2:<port>``), ``nodes`` head first."""

    address: str
    nodes: list[RayNodeProcess]
    root: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _seen: dict[int, int] = field(default_factory=dict, repr=False)  # pid -> start time

    def pids(self) -> set[int]:
        """Every live process of the cluster: each ``ray start`` and all below it (raylet,
        GCS, agents, workers, and what workers started, such as dsec daemons)."""
        tree = _process_tree([p.pid for p in self.procs])
        self._seen.update(tree)
        return set(tree)

    def node(self, ip: str) -> RayNodeProcess:
        return next(n for n in self.nodes if n.ip == ip)

    def node_pids(self, ip: str) -> set[int]:
        """The live processes of the Ray node at ``ip``: its ``ray start`` and all below."""
        return set(_process_tree([self.node(ip).pid]))

    def lose_node(self, ip: str) -> list[int]:
        """A machine lost: SIGKILL every process of the (worker) Ray node at ``ip``, its
        ``ray start`` and all below it (raylet, workers, what they started: a dsec daemon
        and its sandboxes' helpers). The pids killed."""
        node = self.node(ip)
        if node.pid == self.procs[0].pid:
            raise ValueError("the head cannot be lost: the cluster goes with it")
        tree = _process_tree([node.pid])
        self._seen.update(tree)
        for pid, start in tree.items():
            _signal(pid, start, signal.SIGKILL)
        proc = next(p for p in self.procs if p.pid == node.pid)
        proc.wait()
        return sorted(tree)

    def restart_node(self, ip: str, *, timeout: float = 60.0) -> RayNodeProcess:
        """Start the Ray node at ``ip`` again (after ``lose_node``): a new ``ray start`` that
        joins the head, with a temp dir of its own; the node it becomes, once Ray sees it."""
        old = self.node(ip)
        k = self.nodes.index(old)
        temp = old.temp_dir.with_name(f"{old.temp_dir.name}r{len(self.procs)}")
        args = [*_ray_start_args(ip, temp, 1, old.overflow), f"--address={self.address}"]
        with open(self.root / f"node{k}-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"),
            )
        self.procs.append(proc)
        ray = connect(self.address)
        deadline = time.monotonic() + timeout
        while True:
            found = [
                n["NodeID"]
                for n in ray.nodes()
                if n.get("Alive") and n["NodeManagerAddress"] == ip and n["NodeID"] != old.node_id
            ]
            if found:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise NodeUnavailable(f"the Ray node at {ip} did not come back:\n" + _logs(self))
            time.sleep(0.2)
        new = RayNodeProcess(ip, found[0], proc.pid, old.overflow, temp)
        self.nodes[k] = new
        return new

    def stop(self, grace: float = 10.0) -> None:
        """Disconnect this process, SIGTERM every ``ray start`` (they stop their nodes),
        SIGKILL whatever of the cluster is left after ``grace`` seconds, and remove the temp
        dirs. Idempotent; safe after a failed start."""
        with contextlib.suppress(Exception):
            if _connected_to(self.address):
                disconnect()
        self.pids()
        # a dsec daemon still running (its `down` failed) stops cleanly, keeping sandboxes
        for pid in self._seen:
            if b"dsec_core.node.daemon" in _cmdline(pid):
                _signal(pid, self._seen[pid], signal.SIGTERM)
        for proc in reversed(self.procs):  # workers first: the head answers their goodbyes
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._alive():
            self.pids()
            time.sleep(0.1)
        self.pids()
        for pid, start in self._seen.items():
            _signal(pid, start, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and self._alive():
            time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)

    def left_behind(self) -> list[str]:
        """What of the cluster is still there (after ``stop``, nothing): processes seen in
        it that still run, its temp dir."""
        left = [f"pid {p}: {_cmdline(p)[:80]!r}" for p in self._alive()]
        return left + ([f"temp dir {self.root}"] if self.root.exists() else [])

    def _alive(self) -> list[int]:
        return [pid for pid, start in self._seen.items() if still_running(pid, start)]


@contextlib.contextmanager
def local_ray_cluster(
    n: int = 3,
    overflow: int | Iterable[str] = 1,
    *,
    cpus: int = 1,
    timeout: float = 60.0,
) -> Iterator[LocalRayCluster]:
    """A Ray cluster of ``n`` nodes on 127.0.0.2 .. 127.0.0.(n+1), this process connected to
    it as a driver (namespace ``dsec``); stopped by pid and removed at exit, even on failure.

    ``overflow``: how many nodes, the last ones, get the resource ``dsec_overflow`` (so
    ``dsec cluster up`` labels their daemons ``dsec.pool=overflow``), or the names they get
    there (``("n3",)``: names are ``n1``.. in address order)."""
    if n < 1 or n > 250:
        raise ValueError(f"a local Ray cluster has 1 to 250 nodes, not {n}")
    ips = [f"127.0.0.{2 + k}" for k in range(n)]
    if isinstance(overflow, int):
        pool = set(ips[n - overflow :]) if overflow > 0 else set()
    else:
        pool = {ips[int(name[1:]) - 1] for name in overflow}
    root = Path(tempfile.mkdtemp(prefix="dr-", dir="/tmp"))  # unix socket paths are short
    cluster = LocalRayCluster(address="", nodes=[], root=root)
    try:
        port = free_port(HEAD_IP)
        cluster.address = f"{HEAD_IP}:{port}"
        for k, ip in enumerate(ips):
            head = k == 0
            args = _ray_start_args(ip, root / (f"h{k}" if head else f"w{k}"), cpus, ip in pool)
            args += (
                ["--head", f"--port={port}", *_head_args(ip)]
                if head
                else [f"--address={cluster.address}"]
            )
            log = open(root / f"node{k}.log", "wb")
            cluster.procs.append(
                subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"),
                )
            )
            log.close()
            # workers start at once: `ray start --address` waits for the GCS itself
        _wait_for_port(HEAD_IP, port, cluster, timeout)
        ids = _wait_for_nodes(cluster, ips, timeout)
        cluster.nodes = [
            RayNodeProcess(
                ip=ip,
                node_id=ids[ip],
                pid=cluster.procs[k].pid,
                overflow=ip in pool,
                temp_dir=root / (f"h{k}" if k == 0 else f"w{k}"),
            )
            for k, ip in enumerate(ips)
        ]
    except BaseException:
        cluster.stop()
        raise
    try:
        yield cluster
    except BaseException:
        cluster.stop()
        raise
    cluster.stop()
    left = cluster.left_behind()
    assert not left, f"the Ray cluster left things behind: {left}"


def _ray_start_args(ip: str, temp_dir: Path, cpus: int, overflow: bool) -> list[str]:
    args = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        f"--node-ip-address={ip}",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={cpus}",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--node-manager-port=0",
        "--object-manager-port=0",
        "--min-worker-port=0",
        "--max-worker-port=0",
        "--dashboard-agent-listen-port=0",
        "--dashboard-agent-grpc-port=0",
        "--metrics-export-port=0",
        "--runtime-env-agent-port=0",
        "--disable-usage-stats",
        "--include-log-monitor=false",  # workers' prints stay in their log files
    ]
    if overflow:
        args.append("--resources=" + json.dumps({"dsec_overflow": 1}))
    return args


def _head_args(ip: str) -> list[str]:
    args = [
        "--include-dashboard=false",
        f"--dashboard-host={ip}",
        f"--dashboard-port={free_port(ip)}",  # its minimal form runs even without the UI
    ]
    if importlib.util.find_spec("grpc") is not None:
        # with grpc installed Ray starts its client server, on 10001 unless told otherwise
        args.append(f"--ray-client-server-port={free_port(ip)}")
    return args


def _wait_for_port(host: str, port: int, cluster: LocalRayCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_started(cluster)
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.1)
    raise NodeUnavailable(f"the Ray head did not listen on {host}:{port} within {timeout}s")


def _wait_for_nodes(cluster: LocalRayCluster, ips: list[str], timeout: float) -> dict[str, str]:
    """ip -> Ray node id, once every node has joined."""
    ray = connect(cluster.address)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_started(cluster)
        ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if all(ip in ids for ip in ips):
            return ids
        time.sleep(0.2)
    raise NodeUnavailable(
        f"the Ray nodes {', '.join(ips)} did not all join within {timeout}s:\n" + _logs(cluster)
    )


def _check_started(cluster: LocalRayCluster) -> None:
    for proc in cluster.procs:
        if proc.poll() is not None:
            raise NodeUnavailable(
                f"`ray start` {proc.pid} exited with {proc.returncode}:\n" + _logs(cluster)
            )


def _logs(cluster: LocalRayCluster, lines: int = 15) -> str:
    out = []
    for path in sorted(cluster.root.glob("node*.log")):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name}\n" + "\n".join(text))
    return "\n".join(out)


def _connected_to(address: str) -> bool:
    ray = sys.modules.get("ray")  # never imported: never connected
    return bool(
        ray is not None
        and ray.is_initialized()
        and ray.get_runtime_context().gcs_address == address
    )


# --- processes by pid ----------------------------------------------------------------------


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _process_tree(roots: Iterable[int]) -> dict[int, int]:
    """pid -> start time of every live process in the trees under ``roots``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = proc_stat(int(entry))
        if stat is not None:
            children.setdefault(stat.ppid, []).append(int(entry))
    out: dict[int, int] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        start = start_time(pid)
        if start is None or pid in out:
            continue
        out[pid] = start
        todo += children.get(pid, [])
    return out


def _signal(pid: int, start: int, sig: int) -> None:
    if still_running(pid, start):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


# --- dsec on it ----------------------------------------------------------------------------


@dataclass
class KitCluster:
    """dsec node daemons on a ``LocalRayCluster``: ``endpoints`` by name order, their homes
    under ``home_root``, and the kit's busybox layer ``layer`` in a store every node reads
    (``layer_sources``)."""

    ray: LocalRayCluster
    endpoints: list[NodeEndpoint]
    home_root: Path
    layer: LayerInfo
    plan: ClusterPlan
    daemon_pids: dict[str, int] = field(default_factory=dict)

    def endpoint(self, name: str) -> NodeEndpoint:
        return next(e for e in self.endpoints if e.name == name)

    def client(self, name: str) -> Client:
        """A client of node ``name`` over its TCP listener, with its token."""
        e = self.endpoint(name)
        return Client(e.url, token=e.token, autostart=False)

    def up(self) -> list[NodeEndpoint]:
        """``dsec cluster up`` again: restarts daemons that died; refreshes ``endpoints``."""
        self.endpoints = up(self.ray.address, self.plan)
        self.daemon_pids = {s.endpoint.name: s.pid for s in status(self.ray.address) if s.pid}
        return self.endpoints


@contextlib.contextmanager
def cluster_daemons(
    ray_cluster: LocalRayCluster,
    *,
    layer_sources: tuple[str, ...] = (),
    more_sources: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[KitCluster]:
    """``dsec cluster up`` on ``ray_cluster`` with node homes in a fresh directory under
    ``kit_home_parent()``, uid ranges from 2**31, and (unless ``layer_sources`` is given) a
    shared store holding ``kit-base@1`` as every node's layer source, ``more_sources`` after
    it. At exit ``down`` kills
    every sandbox and stops every daemon, and anything a node left behind (mounts, cgroups,
    processes, a daemon pid still alive) fails the caller once all is removed."""
    parent = kit_home_parent()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dsec-cl-", dir=parent))
    os.chmod(root, 0o711)  # a sandbox's uid walks through it to its node's home
    problems: list[str] = []
    try:
        store = LayerStore(root / "shared-layers")
        layer = build_busybox_layer(store)
        plan = ClusterPlan(
            home_root=os.fspath(root / "nodes"),
            uid_base=TEST_UID_BASE,
            uid_ranges=TEST_UID_RANGES,
            layer_sources=layer_sources or (f"local:{store.root}", *more_sources),
            env=env or {},
        )
        (root / "nodes").mkdir(mode=0o711)
        os.chmod(root / "nodes", 0o711)
        kit = KitCluster(ray=ray_cluster, endpoints=[], home_root=root, layer=layer, plan=plan)
        try:
            kit.up()
            yield kit
        finally:
            pids = dict(kit.daemon_pids)
            with contextlib.suppress(Exception):
                pids.update({s.endpoint.name: s.pid for s in status(ray_cluster.address) if s.pid})
            try:
                down(ray_cluster.address)
            except Exception as e:
                problems.append(f"cluster down failed: {e!r}")
            problems += _daemons_left(pids)
            for home in sorted((root / "nodes").iterdir()):
                left = {k: v for k, v in leftovers(home).items() if v}
                if left:
                    problems.append(f"node home {home} left {left}")
    finally:
        _remove_homes(root, problems)
    assert not problems, "\n".join(problems)


def _daemons_left(pids: dict[str, int]) -> list[str]:
    deadline = time.monotonic() + 10.0
    alive = dict(pids)
    while alive and time.monotonic() < deadline:
        alive = {n: p for n, p in alive.items() if start_time(p) is not None}
        time.sleep(0.05)
    for pid in alive.values():  # never leave one running, whatever failed before
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return [f"daemon of {n} (pid {p}) still ran after cluster down" for n, p in alive.items()]


@contextlib.contextmanager
def ray_loopback_lock() -> Iterator[None]:
    """Hold the machine's Ray test addresses (``HEAD_IP`` and the next ones) for the block:
    test clusters of parallel workers take turns rather than meet on the same loopback
    addresses. An exclusive ``flock``, released if its holder dies."""
    LOOPBACK_LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOOPBACK_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def _remove_homes(root: Path, problems: list[str]) -> None:
    prefix = os.fspath(root) + "/"
    with open("/proc/self/mountinfo") as f:
        mounted = [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
    if mounted:  # never rmtree through a mount (it could be a sandbox's root)
        problems.append(f"still mounted under {root}: {mounted}")
        return
    shutil.rmtree(root, ignore_errors=True)


def _skip_without_ray_or_root() -> None:
    if not ray_importable():
        pytest.skip("Ray is not installed: pip install 'dsec[cluster]'")
    if os.geteuid() != 0:
        pytest.skip("dsec node daemons need root")


@pytest.fixture(scope="module")
def dsec_ray_cluster() -> Iterator[LocalRayCluster]:
    """A 3-node Ray cluster on 127.0.0.2-4 (the third in the overflow pool) for one module."""
    _skip_without_ray_or_root()
    with local_ray_cluster(3, overflow=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def dsec_cluster(dsec_ray_cluster: LocalRayCluster) -> Iterator[KitCluster]:
    """dsec node daemons ``n1``..``n3`` on ``dsec_ray_cluster`` (``n3``: ``dsec.pool=overflow``)
    sharing the kit's busybox layer; all stopped, and checked, at the end of the module."""
    with cluster_daemons(dsec_ray_cluster) as kit:
        yield kit
