"""A simulated fleet: one process serving many node identities over the real node API, so an
apiserver can be run and measured against 160 nodes on one machine.

Each identity is a ``SimulatedNode``: its own loopback TCP listener and bearer token, and the
node routes an apiserver uses (``probe``, ``create``, ``list``, ``get``, ``kill``,
``node_info``) answered with the route table's messages and the node's typed errors, in the
same JSON and with the same statuses (``{"error": {"type", "message", "context"}}``). It
holds no sandboxes: a create makes a record after ``Behaviour.create_latency`` (no process,
no mount), up to ``Behaviour.capacity`` of them. Every other route of the table answers
``FeatureUnavailable``: nothing runs in a simulated sandbox.

A node may fail as real ones do (``SimulatedFleet.fail``):

- ``crash``: its listener closes and its connections are reset, as when its daemon is killed
  (connects are refused);
- ``silent``: it keeps accepting connections and never answers, as a machine that froze or
  fell off the network does (probes and in-flight requests time out);
- ``full``: creates are refused with the node's ``AdmissionRejected`` (reason ``count``)
  although its probe shows room, as a node whose room another apiserver just took;
- ``unavailable``: creates are refused with ``NodeUnavailable``;
- ``up``: back to normal (a crashed node listens again on its address).

One event loop serves every identity (HTTP/1.1 on httptools, keep-alive, no pipelining: what
the apiserver's transport speaks), so 160 of them cost what their requests cost. Run it in a
process of its own (``running_fleet``) and steer it over its stdin: the context manager's
``FleetProcess`` does that (``fail``, ``counts``, ``stats``).

    with running_fleet(160, capacity=200) as fleet:
        with running_apiserver(fleet.nodes, iam_url) as api:
            ...
        fleet.fail(["sim007"], "crash")
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import random
import resource
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, unquote

import httptools
import uvloop

from .. import __version__
from ..api.messages import (
    Killed,
    NodeCapacity,
    NodeProbe,
    NodeStatus,
    ProjectUsage,
)
from ..api.routes import JSON, ROUTES, dump_json
from ..errors import (
    AdmissionRejected,
    AuthenticationFailed,
    DsecError,
    FeatureUnavailable,
    InvalidSpec,
    NodeUnavailable,
    NotFound,
    UnknownSandbox,
)
from ..records import DEFAULT_BACKEND, PROJECT_LABEL, Limits, NodeLoad, SandboxInfo
from .procs import stop_process

__all__ = [
    "FAILURES",
    "Behaviour",
    "FleetProcess",
    "SimulatedFleet",
    "SimulatedNode",
    "SimulatedNodeAddress",
    "running_fleet",
]

#: What ``SimulatedFleet.fail`` can make of a node.
FAILURES = ("up", "crash", "silent", "full", "unavailable")
_GiB = 1 << 30
_SANDBOXES = "/v1/sandboxes"
_SANDBOX = "/v1/sandboxes/"
_PHRASES = {s.value: s.phrase for s in HTTPStatus}


@dataclass(frozen=True)
class Behaviour:
    """How one simulated node behaves: how many sandboxes it takes (``capacity``: its
    ``max_sandboxes``), its CPU cores and memory (limits are committed against these, as a
    node's admission does), how long a create takes (``create_latency`` seconds, spread
    uniformly by ``jitter`` of it either side), and its labels (``dsec.pool``)."""

    capacity: int = 256
    cpu: float = 256.0
    memory: int = 1024 * _GiB
    create_latency: float = 0.0
    jitter: float = 0.5
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 0 or self.cpu <= 0 or self.memory <= 0:
            raise InvalidSpec("a simulated node needs capacity >= 0 and positive cpu and memory")
        if self.create_latency < 0 or not 0 <= self.jitter <= 1:
            raise InvalidSpec("create_latency must be >= 0 and jitter within [0, 1]")


@dataclass(frozen=True)
class SimulatedNodeAddress:
    """Where one simulated node listens and the token it wants (what ``start_apiserver`` and
    ``dsec apiserver --node NAME=URL`` take)."""

    name: str
    url: str
    token: str
    labels: dict[str, str] = field(default_factory=dict)

    def arg(self) -> str:
        return f"{self.name}={self.url}"


class _Connection(asyncio.Protocol):
    """One client connection to a simulated node: HTTP/1.1 requests parsed by httptools and
    answered one at a time."""

    def __init__(self, node: SimulatedNode) -> None:
        self.node = node
        self.transport: Any = None  # an asyncio.Transport (uvloop's is not its subclass)
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.auth: bytes | None = None
        self.body: list[bytes] = []

    # --- asyncio ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.node.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.node.connections.discard(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.node.state == "silent":
            return  # read and dropped: the machine froze
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    # --- httptools' callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url, self.auth, self.body = b"", None, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.auth = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode("latin-1")
        keep = self.parser.should_keep_alive()
        self.node.handle(self, method, self.url, self.auth, b"".join(self.body), keep)

    # --- answering --------------------------------------------------------------------------
    def answer(self, status: int, content: bytes, keep: bool) -> None:
        t = self.transport
        if t is None or t.is_closing() or self.node.state in ("silent", "crash"):
            return
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            status,
            _PHRASES.get(status, "").encode(),
            JSON.encode(),
            len(content),
            b"" if keep else b"connection: close\r\n",
        )
        t.write(head + content)
        if not keep:
            t.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class SimulatedNode:
    """One node identity: its sandboxes' records, what they commit, and how it behaves."""

    def __init__(self, name: str, token: str, behaviour: Behaviour) -> None:
        self.name = name
        self.behaviour = behaviour
        self.state = "up"
        self.url = ""
        self.server: asyncio.base_events.Server | None = None
        self.connections: set[_Connection] = set()
        self._auth = f"Bearer {token}".encode()
        self.sandboxes: dict[str, dict[str, Any]] = {}  # id -> its SandboxInfo as JSON
        self.cpu_committed = 0.0
        self.memory_committed = 0
        self.creating = 0  # admitted, answer not sent yet
        self.projects: dict[str, list[float]] = {}  # project -> [count, cpu, memory]
        self.served: dict[str, int] = {}  # route name -> requests answered
        self.refused = 0  # creates answered with an error

    # --- listening -------------------------------------------------------------------------
    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=1024, reuse_address=True
        )
        sock = self.server.sockets[0].getsockname()
        self.url = f"http://{sock[0]}:{sock[1]}"

    async def fail(self, how: str) -> None:
        """Make this node fail as ``how`` says (``FAILURES``), or bring it back (``up``)."""
        if how not in FAILURES:
            raise InvalidSpec(f"a simulated node fails as one of {FAILURES}, not {how!r}")
        was, self.state = self.state, how
        if how == "crash" and was != "crash":
            if self.server is not None:
                self.server.close()
            for conn in list(self.connections):
                if conn.transport is not None:
                    conn.transport.abort()  # a reset, as a killed process's sockets get
        elif was == "crash" and how != "crash":
            host, _, port = self.url.removeprefix("http://").rpartition(":")
            await self.listen(host, int(port))
        elif was == "silent" and how != "silent":
            for conn in list(self.connections):
                conn.close()  # what it swallowed is gone: its clients reconnect

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.close()

    # --- the routes -------------------------------------------------------------------------
    def handle(
        self,
        conn: _Connection,
        method: str,
        url: bytes,
        auth: bytes | None,
        body: bytes,
        keep: bool,
    ) -> None:
        route = "other"
        try:
            if auth is None or not hmac.compare_digest(auth, self._auth):
                why = "no bearer token" if auth is None else "a wrong bearer token"
                raise AuthenticationFailed(
                    f"the request carried {why}; send Authorization: Bearer <token> (DSEC_TOKEN)"
                )
            path, _, query = url.decode("latin-1").partition("?")
            route, status, content = self._route(method, path, query, body)
            if route == "create" and content is None:
                self._create(conn, body, keep)
                return
        except DsecError as e:
            status, content = e.http_status, dump_json({"error": e.to_wire()})
            if route == "create":
                self.refused += 1
        self.served[route] = self.served.get(route, 0) + 1
        assert content is not None
        conn.answer(status, content, keep)

    def _route(
        self, method: str, path: str, query: str, body: bytes
    ) -> tuple[str, int, bytes | None]:
        """The route a request is for and its answer (None: a create, answered later)."""
        if path == "/v1/node/probe" and method == "GET":
            return "probe", 200, ROUTES["probe"].encode_response(self.probe())
        if path == _SANDBOXES:
            if method == "POST":
                return "create", 201, None
            if method == "GET":
                q = ROUTES["list"].decode_query(dict(parse_qsl(query)))
                return "list", 200, self._list(q.project or None, q.subtree)
        if path.startswith(_SANDBOX) and "/" not in path[len(_SANDBOX) :]:
            sid = unquote(path[len(_SANDBOX) :])
            info = self.sandboxes.get(sid)
            if method in ("GET", "DELETE") and info is None:
                raise UnknownSandbox(f"no sandbox {sid!r} on this node", name=sid)
            if method == "GET":
                return "get", 200, dump_json(info)
            if method == "DELETE":
                self._forget(sid)
                return "kill", 200, ROUTES["kill"].encode_response(Killed(killed=sid))
        if path == "/v1/node" and method == "GET":
            return "node_info", 200, ROUTES["node_info"].encode_response(self.status())
        for r in ROUTES.values():
            if r.method == method and _matches(r.path, path):
                raise FeatureUnavailable(
                    f"node {self.name} is simulated: it holds no sandboxes and serves only "
                    "probe, create, list, get, kill and node_info, not " + r.name,
                    backend="simulated",
                    feature=r.name,
                )
        raise NotFound(f"no route {method} {path}")

    def _create(self, conn: _Connection, raw: bytes, keep: bool) -> None:
        """Admit the request's sandboxes as a node does (all or none), then answer after the
        create latency."""
        request, template, lim = _decoded(raw)
        spec, count = request.spec, request.count
        b = self.behaviour
        if self.state == "unavailable":
            raise NodeUnavailable(f"node {self.name} cannot start sandboxes now", node=self.name)
        if self.state == "full" or len(self.sandboxes) + self.creating + count > b.capacity:
            held = len(self.sandboxes) + self.creating
            raise AdmissionRejected(
                f"node is full: {held} sandboxes of at most {b.capacity}",
                reason="count",
                node=self.name,
            )
        cpu = 0.0 if spec.qos == "be" else lim.cpu
        if self.cpu_committed + count * cpu > b.cpu:
            raise AdmissionRejected(
                f"not enough CPU: asked {lim.cpu} cores, {b.cpu - self.cpu_committed:.1f} of "
                f"{b.cpu:.0f} (with overcommit) left",
                reason="cpu",
                node=self.name,
            )
        if self.memory_committed + count * lim.memory > b.memory:
            raise AdmissionRejected(
                f"not enough memory: asked {lim.memory >> 20} MiB, "
                f"{(b.memory - self.memory_committed) >> 20} MiB of {b.memory >> 20} MiB of "
                "limits (with overcommit) left",
                reason="memory",
                node=self.name,
            )
        self.creating += count
        self.cpu_committed += count * cpu
        self.memory_committed += count * lim.memory

        def made() -> None:
            self.creating -= count
            self.cpu_committed -= count * cpu
            self.memory_committed -= count * lim.memory
            if self.state in ("crash", "silent"):
                return  # a node that died mid-create answers nothing
            now = time.time()
            infos = []
            for _ in range(count):
                sid = f"{secrets.token_hex(6)}-{self.name}"
                info = dict(template)
                info.update(id=sid, created=now, expires=now + spec.ttl if spec.ttl else None)
                self._keep(sid, info, cpu, lim.memory)
                infos.append(info)
            self.served["create"] = self.served.get("create", 0) + 1
            conn.answer(201, dump_json({"sandboxes": infos, "errors": []}), keep)

        if b.create_latency <= 0:
            made()
            return
        spread = b.create_latency * b.jitter
        delay = b.create_latency + random.uniform(-spread, spread)
        asyncio.get_running_loop().call_later(delay, made)

    def _keep(self, sid: str, info: dict[str, Any], cpu: float, memory: int) -> None:
        self.sandboxes[sid] = info
        self.cpu_committed += cpu
        self.memory_committed += memory
        project = info["labels"].get(PROJECT_LABEL)
        if project is not None:
            u = self.projects.setdefault(project, [0, 0.0, 0])
            u[0] += 1
            u[1] += cpu
            u[2] += memory

    def _forget(self, sid: str) -> None:
        info = self.sandboxes.pop(sid)
        cpu = 0.0 if info.get("qos") == "be" else float(info["limits"].get("cpu") or 0)
        memory = int(info["limits"].get("memory") or 0)
        self.cpu_committed -= cpu
        self.memory_committed -= memory
        project = info["labels"].get(PROJECT_LABEL)
        u = self.projects.get(project) if project is not None else None
        if u is not None:
            u[0] -= 1
            u[1] -= cpu
            u[2] -= memory
            if u[0] <= 0:
                del self.projects[project]

    def _list(self, project: str | None, subtree: bool) -> bytes:
        infos = sorted(self.sandboxes.values(), key=lambda i: i["created"])
        if project is not None:
            infos = [
                i for i in infos if _in_project(i["labels"].get(PROJECT_LABEL), project, subtree)
            ]
        return dump_json({"sandboxes": infos})

    # --- what the watcher sees ----------------------------------------------------------------
    def load(self) -> NodeLoad:
        b = self.behaviour
        return NodeLoad(
            node=self.name,
            backends=(DEFAULT_BACKEND,),
            cpu_capacity=b.cpu,
            cpu_committed=self.cpu_committed,
            memory_capacity=b.memory,
            memory_committed=self.memory_committed,
            sandboxes=len(self.sandboxes) + self.creating,
            max_sandboxes=b.capacity,
            labels=dict(b.labels),
        )

    def probe(self) -> NodeProbe:
        return NodeProbe(
            at=time.time(),
            name=self.name,
            version=__version__,
            load=self.load(),
            projects={
                p: ProjectUsage(sandboxes=int(n), cpu=c, memory=int(m))
                for p, (n, c, m) in self.projects.items()
            },
        )

    def status(self) -> NodeStatus:
        b = self.behaviour
        return NodeStatus(
            version=__version__,
            pid=os.getpid(),
            home=f"simulated:{self.name}",
            sandboxes=len(self.sandboxes),
            capacity=NodeCapacity(cpu=b.cpu, memory=b.memory, sandboxes=b.capacity),
            backends=(DEFAULT_BACKEND,),
            layer_sources=(),
        )


#: Create bodies decoded lately: a fleet is sent the same few specs over and over, and
#: decoding each anew cost more than the rest of a simulated create.
_DECODED: dict[bytes, tuple[Any, dict[str, Any], Limits]] = {}


def _decoded(raw: bytes) -> tuple[Any, dict[str, Any], Limits]:
    """A create body decoded as the node decodes it (``InvalidSpec`` for a bad one), the
    ``SandboxInfo`` of a sandbox it makes as JSON (its id and times to be filled in), and its
    limits."""
    hit = _DECODED.get(raw)
    if hit is not None:
        return hit
    request = ROUTES["create"].decode_body(raw)
    spec = request.spec
    lim = spec.limits
    template = SandboxInfo(
        id="",
        backend=spec.backend or DEFAULT_BACKEND,
        state="running",
        created=0.0,
        expires=None,
        layers=tuple(spec.layers),
        environment=spec.environment,
        limits=lim.to_dict(),
        labels=dict(spec.labels),
        qos=spec.qos,
    ).to_dict()
    if len(_DECODED) >= 256:
        _DECODED.clear()
    _DECODED[raw] = (request, template, lim)
    return request, template, lim


def _in_project(label: str | None, project: str, subtree: bool) -> bool:
    # as dsec_core.node.sandbox.in_project (the testing floor does not import the node's)
    if label is None:
        return False
    if label == project or (subtree and project == "/"):
        return True
    return subtree and label.startswith(project + "/")


def _matches(template: str, path: str) -> bool:
    a, b = template.split("/"), path.split("/")
    return len(a) == len(b) and all(
        t == p or (t[:1] == "{" and p) for t, p in zip(a, b, strict=True)
    )


class SimulatedFleet:
    """Many ``SimulatedNode`` identities on this process's event loop, all behind one token."""

    def __init__(
        self,
        names: Sequence[str],
        behaviour: Behaviour | None = None,
        token: str | None = None,
    ) -> None:
        self.token = token or secrets.token_urlsafe(16)
        behaviour = behaviour or Behaviour()
        for name in names:
            if not name or "-" in name:
                raise InvalidSpec(
                    f"a node name is not empty and has no '-' (a sandbox id ends with "
                    f"-NAME, and an apiserver routes it by what follows the last '-'): {name!r}"
                )
        self.nodes = {name: SimulatedNode(name, self.token, behaviour) for name in names}

    async def start(self, host: str = "127.0.0.1") -> None:
        for node in self.nodes.values():
            await node.listen(host)

    async def stop(self) -> None:
        for node in self.nodes.values():
            await node.close()

    def addresses(self) -> list[SimulatedNodeAddress]:
        return [
            SimulatedNodeAddress(n.name, n.url, self.token, dict(n.behaviour.labels))
            for n in self.nodes.values()
        ]

    async def fail(self, names: Sequence[str], how: str) -> None:
        for name in names:
            await self._node(name).fail(how)

    def configure(self, names: Sequence[str], **changes: Any) -> None:
        """Change ``Behaviour`` fields of these nodes (capacity, create_latency, ...)."""
        for name in names:
            node = self._node(name)
            node.behaviour = replace(node.behaviour, **changes)

    def counts(self) -> dict[str, int]:
        """Each node's live sandboxes."""
        return {name: len(n.sandboxes) for name, n in self.nodes.items()}

    def clear(self) -> int:
        """Forget every node's sandboxes at once (between a benchmark's phases); how many."""
        gone = 0
        for n in self.nodes.values():
            gone += len(n.sandboxes)
            for sid in list(n.sandboxes):
                n._forget(sid)
        return gone

    def stats(self) -> dict[str, Any]:
        """Requests answered by route over all nodes, creates refused, creates under way by
        node, and this process's CPU seconds so far."""
        served: dict[str, int] = {}
        for n in self.nodes.values():
            for route, k in n.served.items():
                served[route] = served.get(route, 0) + k
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "served": served,
            "refused": sum(n.refused for n in self.nodes.values()),
            "creating": {name: n.creating for name, n in self.nodes.items() if n.creating},
            "cpu_s": ru.ru_utime + ru.ru_stime,
        }

    def _node(self, name: str) -> SimulatedNode:
        node = self.nodes.get(name)
        if node is None:
            raise InvalidSpec(f"no simulated node {name!r}")
        return node

    async def command(self, op: Mapping[str, Any]) -> Any:
        """One steering command (``FleetProcess`` sends them as JSON lines)."""
        kind = op.get("op")
        if kind == "fail":
            await self.fail(op["names"], op["how"])
            return None
        if kind == "configure":
            self.configure(op["names"], **op.get("changes", {}))
            return None
        if kind == "counts":
            return self.counts()
        if kind == "clear":
            return self.clear()
        if kind == "stats":
            return self.stats()
        raise InvalidSpec(f"unknown fleet command {kind!r}")


# --- a fleet in a process of its own -----------------------------------------------------------


@dataclass
class FleetProcess:
    """A simulated fleet running in a child process, steered over its stdin and stdout."""

    proc: subprocess.Popen[bytes]
    nodes: list[SimulatedNodeAddress]

    def _ask(self, op: Mapping[str, Any]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(op).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise NodeUnavailable("the simulated fleet exited")
        answer = json.loads(line)
        if "error" in answer:
            raise InvalidSpec(answer["error"])
        return answer["ok"]

    def fail(self, names: Sequence[str], how: str) -> None:
        """Make these nodes fail (``FAILURES``), or bring them back (``up``)."""
        self._ask({"op": "fail", "names": list(names), "how": how})

    def configure(self, names: Sequence[str], **changes: Any) -> None:
        self._ask({"op": "configure", "names": list(names), "changes": changes})

    def counts(self) -> dict[str, int]:
        return dict(self._ask({"op": "counts"}))

    def stats(self) -> dict[str, Any]:
        return dict(self._ask({"op": "stats"}))

    def clear(self) -> int:
        """Forget every node's sandboxes (``SimulatedFleet.clear``)."""
        return int(self._ask({"op": "clear"}))

    def stop(self) -> None:
        stop_process(self.proc, 10)


@contextlib.contextmanager
def running_fleet(
    count: int, prefix: str = "sim", behaviour: Behaviour | None = None
) -> Iterator[FleetProcess]:
    """``count`` simulated nodes named ``prefix000``... served by one child process, each on
    its own loopback port; stopped by its pid on exit."""
    b = behaviour or Behaviour()
    # not ``-m dsec_core.testing.fleet``: the package imports this module before runpy would
    # run it again as __main__
    run = "import sys; from dsec_core.testing.fleet import main; main(sys.argv[1:])"
    argv = [sys.executable, "-c", run, "--count", str(count)]
    argv += ["--prefix", prefix, "--behaviour", json.dumps(asdict(b))]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise NodeUnavailable("the simulated fleet did not start")
        nodes = [SimulatedNodeAddress(**a) for a in json.loads(line)["nodes"]]
        fleet = FleetProcess(proc, nodes)
    except BaseException:
        stop_process(proc, 5, sig=signal.SIGKILL)
        raise
    try:
        yield fleet
    finally:
        fleet.stop()


async def _serve(count: int, prefix: str, behaviour: Behaviour) -> None:
    width = max(3, len(str(count - 1)))
    fleet = SimulatedFleet([f"{prefix}{i:0{width}d}" for i in range(count)], behaviour)
    await fleet.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer

    def say(value: Any) -> None:
        out.write(json.dumps(value).encode() + b"\n")
        out.flush()

    say({"nodes": [asdict(a) for a in fleet.addresses()]})
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    async def steer() -> None:
        while line := await reader.readline():
            try:
                say({"ok": await fleet.command(json.loads(line))})
            except (DsecError, KeyError, TypeError, ValueError) as e:
                say({"error": str(e)})
        stop.set()  # stdin closed: the parent is gone

    task = asyncio.create_task(steer())
    await stop.wait()
    task.cancel()
    await fleet.stop()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=160)
    ap.add_argument("--prefix", default="sim")
    ap.add_argument("--behaviour", default="{}", help="Behaviour's fields as JSON")
    args = ap.parse_args(argv)
    behaviour = Behaviour(**json.loads(args.behaviour))
    uvloop.run(_serve(args.count, args.prefix, behaviour))  # the node daemon's loop too


if __name__ == "__main__":
    main()
