"""dsec on a Ray cluster: one node daemon per Ray node, each kept by a detached, named actor
pinned to its node; ``up`` starts them, ``discover`` finds them, ``down`` stops them.

Actors live in the Ray namespace ``dsec`` as ``dsec-node-<name>``. Names are ``n1``, ``n2``,
... in the order of the Ray nodes' addresses, and stay with their Ray node for as long as its
actor lives. Nodes on one host get uid ranges that do not overlap (a slot per node of that
host). A Ray node with the resource ``dsec_overflow`` (or the Ray label ``dsec.pool``) is in
the overflow pool: its daemon gets ``DSEC_NODE_LABELS=dsec.pool=overflow``, the others
``dsec.pool=home``; other Ray labels starting ``dsec.`` are passed on as they are.

Ray is imported when first used, so ``import dsec_core.cluster`` works without it. This
process connects to the cluster as a driver with an explicit address (``ray.init(address=)``
never starts a cluster then); a process already connected (a trainer's driver) is reused.
Calls block: run them in a thread from async code (the first call connects, about half a
second; later ones are a few milliseconds). A process on a machine that is no Ray node
connects with Ray Client (``ray://head:10001``, ``pip install 'ray[client]'``).

Each daemon's bearer token is made by its keeper and handed out through Ray: whoever can call
Ray actors on the cluster can read it, as they can run any code there anyway.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import DsecError, InvalidSpec
from .endpoint import ClusterUnavailable, NodeEndpoint, NodeState
from .node_keeper import KeeperSettings, NodeKeeper

__all__ = [
    "ACTOR_PREFIX",
    "DEFAULT_HOME_ROOT",
    "NAMESPACE",
    "ClusterPlan",
    "connect",
    "disconnect",
    "discover",
    "down",
    "node_labels",
    "status",
    "up",
]

NAMESPACE = "dsec"
ACTOR_PREFIX = "dsec-node-"
#: Where node homes go by default: ``<root>/<name>`` on each Ray node's machine.
DEFAULT_HOME_ROOT = "/var/lib/dsec/cluster"
#: The Ray resource that puts a node in the overflow pool (``ray start --resources``).
OVERFLOW_RESOURCE = "dsec_overflow"
POOL_LABEL = "dsec.pool"
MAX_HOST_ID = (1 << 32) - 2
CALL_TIMEOUT = 30.0  # an actor that does not answer a question within this is left out
INSTALL_HINT = "pip install 'dsec[cluster]'"

_actor_class: Any = None


# --- connection ----------------------------------------------------------------------------


def _ray() -> ModuleType:
    try:
        import ray
        import ray.experimental.internal_kv
    except ImportError as e:
        raise ClusterUnavailable(
            f"dsec cluster needs Ray, which is not installed here: {INSTALL_HINT}"
        ) from e
    return ray


def connect(address: str | None = None, *, node_ip: str | None = None) -> ModuleType:
    """Connect this process to the Ray cluster at ``address`` (``host:port`` of its GCS, or
    ``ray://`` for Ray Client; default ``RAY_ADDRESS``) and return the ``ray`` module.

    Reuses an existing connection to the same cluster, or to any when no address is given.
    ``node_ip`` is this machine's Ray node address (``DSEC_RAY_NODE_IP``); by default the
    GCS host when it is a loopback address other than 127.0.0.1 (local test clusters, where
    Ray would take the machine's own address), else Ray's own guess."""
    ray = _ray()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address is None or address == current:
            return ray
        raise ClusterUnavailable(
            f"this process is connected to the Ray cluster at {current}, not {address}",
            address=address,
        )
    if not address or address == "auto":
        raise ClusterUnavailable(
            "no Ray cluster address: pass --address host:port (the head's GCS) or set "
            "RAY_ADDRESS; dsec never starts a Ray cluster of its own"
        )
    kw: dict[str, Any] = {}
    if not address.startswith("ray://"):
        host, port = _split_address(address)
        _check_reachable(host, port)
        node_ip = node_ip or os.environ.get("DSEC_RAY_NODE_IP") or _loopback_host(host)
        if node_ip:
            kw["_node_ip_address"] = node_ip
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            log_to_driver=False,
            logging_level="WARNING",
            **kw,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterUnavailable(
            f"cannot connect to the Ray cluster at {address}: {e}", address=address
        ) from e
    return ray


def disconnect() -> None:
    """Drop this process's connection to Ray (if any); actors and daemons keep running."""
    ray = sys.modules.get("ray")  # never imported: never connected
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidSpec(f"Ray address {address!r} is not host:port", field="address")
    return host.strip("[]"), int(port)


def _check_reachable(host: str, port: int) -> None:
    """Fail fast where Ray would retry for a minute: nothing listens at the address."""
    try:
        with socket.create_connection((host, port), timeout=3.0):
            pass
    except OSError as e:
        raise ClusterUnavailable(
            f"no Ray cluster answers at {host}:{port}: {e}", address=f"{host}:{port}"
        ) from e


def _loopback_host(host: str) -> str | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return host if ip.is_loopback and host != "127.0.0.1" else None


def _actor(ray: ModuleType) -> Any:
    global _actor_class
    if _actor_class is None:
        # num_cpus=0: the keeper idles beside the trainer's work; threads so that alive()
        # answers while stop() waits for the daemon
        _actor_class = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(NodeKeeper)
    return _actor_class


def _get(ray: ModuleType, refs: Any, timeout: float | None = None) -> Any:
    """``ray.get``, with a ``DsecError`` the actor raised raised here as itself."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DsecError):
            raise e.cause from None
        raise


# --- the plan ------------------------------------------------------------------------------


def node_labels(ray_node: Mapping[str, Any]) -> dict[str, str]:
    """The ``DSEC_NODE_LABELS`` of a Ray node (an entry of ``ray.nodes()``): its Ray labels
    that start with ``dsec.``, and ``dsec.pool``: ``overflow`` when it has the
    ``dsec_overflow`` resource (unless a label says otherwise), else ``home``."""
    labels = {
        str(k): str(v) for k, v in (ray_node.get("Labels") or {}).items() if k.startswith("dsec.")
    }
    if POOL_LABEL not in labels:
        overflow = (ray_node.get("Resources") or {}).get(OVERFLOW_RESOURCE, 0) > 0
        labels[POOL_LABEL] = "overflow" if overflow else "home"
    return labels


@dataclass(frozen=True)
class ClusterPlan:
    """How ``up`` lays nodes out: homes under ``home_root`` (on each node's machine), uid
    ranges from ``uid_base`` with ``uid_ranges`` ranges of ``uid_size`` ids per node, and
    what every daemon gets besides (``layer_sources``, ``env``)."""

    home_root: str = DEFAULT_HOME_ROOT
    uid_base: int = 100000
    uid_size: int = 65536
    uid_ranges: int = 4096
    layer_sources: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 60.0

    @property
    def uid_span(self) -> int:
        """How many host uids one node holds."""
        return self.uid_size * self.uid_ranges

    def uid_slot_base(self, slot: int) -> int:
        """The first host uid of the ``slot``-th node on one host; ``InvalidSpec`` past the
        largest host id."""
        span = self.uid_span
        base = self.uid_base + slot * span
        if base + span - 1 > MAX_HOST_ID:
            raise InvalidSpec(
                f"{slot + 1} dsec nodes on one host with {self.uid_ranges} uid ranges of "
                f"{self.uid_size} ids each end past the largest host id; use fewer ranges "
                "per node (--uid-ranges)",
                field="uid_ranges",
            )
        return base

    def free_slot(self, spans: Sequence[tuple[int, int]]) -> int:
        """The first slot whose uids overlap none of ``spans`` (``[start, end)`` held by the
        host's other nodes, which an earlier plan may have laid out differently)."""
        k = 0
        while True:
            base = self.uid_slot_base(k)  # InvalidSpec once past the largest host id
            if all(base + self.uid_span <= lo or hi <= base for lo, hi in spans):
                return k
            k += 1

    def settings(self, name: str, ray_node: Mapping[str, Any], slot: int) -> KeeperSettings:
        return KeeperSettings(
            name=name,
            home=os.fspath(Path(self.home_root) / name),
            node_ip=ray_node["NodeManagerAddress"],
            ray_node_id=ray_node["NodeID"],
            uid_base=self.uid_slot_base(slot),
            uid_size=self.uid_size,
            uid_ranges=self.uid_ranges,
            labels=node_labels(ray_node),
            layer_sources=self.layer_sources,
            env=dict(self.env),
            start_timeout=self.start_timeout,
        )


def _ip_key(ray_node: Mapping[str, Any]) -> tuple[Any, ...]:
    address = ray_node.get("NodeManagerAddress", "")
    try:
        return (0, ipaddress.ip_address(address).packed, ray_node["NodeID"])
    except ValueError:
        return (1, address.encode(), ray_node["NodeID"])


def _keepers(ray: ModuleType) -> dict[str, Any]:
    """name -> handle of every live keeper actor in the ``dsec`` namespace."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE or not entry["name"].startswith(ACTOR_PREFIX):
            continue
        try:
            out[entry["name"][len(ACTOR_PREFIX) :]] = ray.get_actor(
                entry["name"], namespace=NAMESPACE
            )
        except ValueError:  # gone meanwhile
            continue
    return out


def _ask(ray: ModuleType, handles: Mapping[str, Any], method: str) -> dict[str, Any]:
    """name -> answer of ``method`` for every keeper that answers within ``CALL_TIMEOUT``;
    the dead and the silent are left out."""
    refs = {name: getattr(h, method).remote() for name, h in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=CALL_TIMEOUT)
    done = set(ready)
    out = {}
    for name, ref in refs.items():
        if ref not in done:
            continue
        try:
            out[name] = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            continue
    return out


# --- up, down, discover --------------------------------------------------------------------


def up(address: str | None = None, plan: ClusterPlan | None = None) -> list[NodeEndpoint]:
    """Make sure every alive Ray node runs a dsec node daemon, and return their endpoints
    (sorted by name).

    A Ray node without a keeper gets one (a detached actor pinned to it), under the name a
    node at its address had before if that one is gone (a machine lost and back: its home,
    and what its dead daemon left there, are its own again); a keeper whose daemon died
    starts it again (same URL and token; it re-adopts its sandboxes). Keepers of Ray nodes
    that are gone are left alone (``down`` removes them). All daemons start at once; the
    first failure is raised (typed: a keeper that died is ``ClusterUnavailable``) after the
    rest were waited for."""
    plan = plan or ClusterPlan()
    ray = connect(address)
    affinity = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=_ip_key)
    handles = _keepers(ray)
    known = _ask(ray, handles, "state")  # name -> state of live keepers
    taken_names = set(handles)
    by_node = {s["endpoint"]["ray_node_id"]: name for name, s in known.items()}
    host_of = {n["NodeID"]: n.get("NodeManagerHostname", n["NodeManagerAddress"]) for n in nodes}
    used: dict[str, list[tuple[int, int]]] = {}  # host -> uid spans its nodes hold
    for s in known.values():
        host = host_of.get(s["endpoint"]["ray_node_id"])
        if host is not None:
            used.setdefault(host, []).append((s["uid_base"], s["uid_base"] + s["uid_count"]))
    placed = _placed(ray)  # name -> where it last ran (ip) and its uid slot
    actor = _actor(ray)
    for node in nodes:
        if node["NodeID"] in by_node:
            continue
        ip = node["NodeManagerAddress"]
        # a machine back after it was lost takes its old name, so its home (and whatever its
        # dead daemon left there) is its own again
        back = [n for n, p in placed.items() if p["ip"] == ip and n not in known]
        spans = used.setdefault(host_of[node["NodeID"]], [])
        if back:
            name, slot = back[0], int(placed[back[0]]["slot"])
            if name in handles:  # listed, but its node is gone: it never answers again
                ray.kill(handles[name], no_restart=True)
                _wait_name_free(ray, name)
        else:
            name = _next_name(taken_names | set(placed))
            slot = plan.free_slot(spans)
        taken_names.add(name)
        spans.append((plan.uid_slot_base(slot), plan.uid_slot_base(slot) + plan.uid_span))
        handles[name] = actor.options(
            name=ACTOR_PREFIX + name,
            namespace=NAMESPACE,
            lifetime="detached",
            scheduling_strategy=affinity(node["NodeID"], soft=False),
        ).remote(plan.settings(name, node, slot))
        _place(ray, name, ip, slot)
        by_node[node["NodeID"]] = name
    wanted = {by_node[n["NodeID"]]: handles[by_node[n["NodeID"]]] for n in nodes}
    refs = {name: h.start.remote() for name, h in wanted.items()}
    results, failed = {}, {}
    for name, ref in refs.items():
        try:
            results[name] = _get(ray, ref)
        except DsecError as e:
            failed[name] = e
        except Exception as e:  # the actor died (its node went while it started): typed
            failed[name] = ClusterUnavailable(
                f"node {name}: its keeper died while starting the daemon ({type(e).__name__});"
                " its Ray node is probably gone: run up again once Ray has noticed",
                node=name,
            )
    if failed:  # every start was waited for; the first failure is raised
        raise next(iter(failed.values()))
    return [NodeEndpoint.from_dict(results[n]) for n in sorted(results, key=_name_key)]


#: Ray's key-value store (in its GCS) keeps where each node name last ran: ``up`` gives a
#: machine that comes back its old name.
_PLACED = "dsec-node-placed/"


def _placed(ray: ModuleType) -> dict[str, dict[str, Any]]:
    """name -> {"ip", "slot"} of every node ``up`` ever placed on this Ray cluster."""
    kv = ray.experimental.internal_kv
    out = {}
    for key in kv._internal_kv_list(_PLACED, namespace=NAMESPACE):
        raw = kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw:
            out[key.decode()[len(_PLACED) :]] = json.loads(raw)
    return out


def _place(ray: ModuleType, name: str, ip: str, slot: int) -> None:
    kv = ray.experimental.internal_kv
    record = json.dumps({"ip": ip, "slot": slot})
    kv._internal_kv_put(_PLACED + name, record, overwrite=True, namespace=NAMESPACE)


def _wait_name_free(ray: ModuleType, name: str, timeout: float = 10.0) -> None:
    """Until a killed keeper's actor name may be taken again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(ACTOR_PREFIX + name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


def _next_name(taken: Iterable[str]) -> str:
    used = set(taken)
    k = 1
    while f"n{k}" in used:
        k += 1
    return f"n{k}"


def _name_key(name: str) -> tuple[int, str]:
    digits = name[1:]
    return (int(digits), name) if name.startswith("n") and digits.isdigit() else (1 << 30, name)


def discover(ray_address: str | None = None, *, alive_only: bool = False) -> list[NodeEndpoint]:
    """The endpoints of the cluster's node daemons, sorted by name: what an apiserver calls
    to learn its nodes (on start and periodically).

    Keepers whose actor is dead, or does not answer within ``CALL_TIMEOUT``, are left out;
    a keeper whose daemon died is listed with ``alive=False`` (left out with
    ``alive_only``)."""
    ray = connect(ray_address)
    answers = _ask(ray, _keepers(ray), "endpoint")
    endpoints = [NodeEndpoint.from_dict(answers[n]) for n in sorted(answers, key=_name_key)]
    return [e for e in endpoints if e.alive or not alive_only]


def status(ray_address: str | None = None) -> list[NodeState]:
    """Every keeper that answers, with its daemon's pid, home and uid range, by name."""
    ray = connect(ray_address)
    answers = _ask(ray, _keepers(ray), "state")
    return [
        NodeState(endpoint=NodeEndpoint.from_dict(s.pop("endpoint")), **s)
        for s in (answers[n] for n in sorted(answers, key=_name_key))
    ]


def down(
    ray_address: str | None = None, *, purge: bool = False, names: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Stop the cluster's node daemons (all, or those in ``names``) and remove their actors.

    Each keeper kills its node's sandboxes through the API, stops its daemon (SIGTERM) and,
    with ``purge``, removes the node's home (else layers and caches stay for the next
    ``up``); then its actor is killed. Returns per node its name, the daemon's pid and how
    many sandboxes were killed. A keeper whose stop fails keeps its actor (the first failure
    is raised once all were tried), so ``down`` can be run again."""
    ray = connect(ray_address)
    handles = _keepers(ray)
    if names:
        unknown = sorted(set(names) - set(handles))
        if unknown:
            raise InvalidSpec(
                f"no cluster node named {', '.join(unknown)}; there are "
                f"{', '.join(sorted(handles, key=_name_key)) or 'none'}",
                field="names",
            )
        handles = {n: handles[n] for n in names}
    refs = {name: h.stop.remote(purge=purge) for name, h in handles.items()}
    results, first_error = [], None
    for name, ref in refs.items():
        try:
            results.append(_get(ray, ref, timeout=120.0))
        except ray.exceptions.RayActorError:
            results.append({"name": name, "pid": None, "killed": 0})
        except Exception as e:  # keep the actor: its daemon may still hold sandboxes
            first_error = first_error or e
            continue
        ray.kill(handles[name], no_restart=True)
    if first_error is not None:
        raise first_error
    return sorted(results, key=lambda r: _name_key(r["name"]))
