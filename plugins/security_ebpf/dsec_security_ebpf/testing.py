"""Test helpers for the egress policy, for our tests and a third party's: network namespaces a
test makes and attaches to a node's egress namespace, servers in them that record everything
that reaches them (TCP, UDP, a small DNS server), and ``netprobe``, a static program that
makes one egress attempt from inside a sandbox and says how it ended.

Network tests send traffic only to these servers: in namespaces the test made, or on
loopback. ``python -m dsec_security_ebpf.testing serve ...`` is the server process.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec_core.backend import cgroup_path
from dsec_core.errors import ToolError, UnknownSandbox
from dsec_core.linux.cgroups import cgroup2_root
from dsec_core.linux.netns import add_netns, delete_netns, ip_batch, netns_exists
from dsec_core.linux.processes import stop_process
from dsec_core.linux.tools import compile_static
from dsec_core.testing import KitNode, free_port, running_kit_node

from .bpf import NodeMaps
from .network import EgressNetwork

__all__ = [
    "PROBE_SOURCE",
    "EgressKitNode",
    "HostServerNamespace",
    "Received",
    "ServerNamespace",
    "build_probe",
    "egress_kit_node",
    "serve_dns_answer",
]

PROBE_SOURCE = Path(__file__).with_name("probe") / "netprobe.c"


def build_probe(directory: Path) -> Path:
    """Compile ``netprobe`` (static) into ``directory``, once; its path."""
    out = Path(directory) / "netprobe"
    if not out.exists():
        compile_static([PROBE_SOURCE], out, "netprobe", flags=["-O2"])
    return out


@dataclass(frozen=True)
class Received:
    """One thing a test server got: ``kind`` is "tcp", "udp" or "dns" (then ``data`` is the
    name asked for)."""

    kind: str
    port: int
    peer: str
    data: str


class ServerNamespace:
    """A network namespace a test makes, linked by a veth to a node's egress namespace:
    ``10.77.<n>.2`` here, ``10.77.<n>.1`` on the egress side; servers in it record what
    reaches them. ``close()`` removes the namespace, the veth and the servers."""

    def __init__(self, home: Path, tmp: Path, n: int = 0) -> None:
        self.egress = EgressNetwork(home)
        self.name = f"dsec-test-{secrets.token_hex(4)}"
        self.veth = f"tsv{secrets.token_hex(5)}"
        net = ipaddress.ip_network(f"10.77.{n}.0/24")
        self.gateway, self.address = str(net[1]), str(net[2])
        self.record = Path(tmp) / f"{self.name}.jsonl"
        self.zone = Path(tmp) / f"{self.name}.zone.json"
        self._procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> ServerNamespace:
        self.egress.ensure()
        add_netns(self.name)
        try:
            ip_batch(
                None,
                [
                    f"link add {self.veth} netns {self.egress.name} type veth "
                    f"peer name eth0 netns {self.name}"
                ],
                "linking a test namespace to the egress namespace",
            )
            ip_batch(
                self.egress.name,
                [f"addr add {self.gateway}/24 dev {self.veth}", f"link set {self.veth} up"],
                "the egress side of a test namespace",
            )
            ip_batch(
                self.name,
                [
                    f"addr add {self.address}/24 dev eth0",
                    "link set eth0 up",
                    f"route add default via {self.gateway}",
                ],
                "a test namespace's eth0",
            )
        except BaseException:
            self.close()
            raise
        self.record.touch()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serve(
        self, tcp: Sequence[int] = (), udp: Sequence[int] = (), dns: int | None = None
    ) -> None:
        """Start a server process in the namespace on these ports; returns once it listens."""
        argv = [sys.executable, "-m", "dsec_security_ebpf.testing", "serve"]
        argv += ["--record", os.fspath(self.record), "--zone", os.fspath(self.zone)]
        for p in tcp:
            argv += ["--tcp", str(p)]
        for p in udp:
            argv += ["--udp", str(p)]
        if dns is not None:
            argv += ["--dns", str(dns)]
        self._procs.append(start_server(argv, netns=self.name))

    def received(self) -> list[Received]:
        return read_record(self.record)

    def close(self) -> None:
        for proc in self._procs:
            stop_server(proc)
        self._procs.clear()
        # the veth's egress end goes with its peer when this namespace is freed
        delete_netns(self.name)

    @property
    def exists(self) -> bool:
        return netns_exists(self.name)


class HostServerNamespace(ServerNamespace):
    """A network namespace a test makes, linked by a veth to the host's namespace: the host
    holds ``network[1]`` and routes ``network`` to it, the namespace ``network[2]`` (what a
    sandbox of ``network="internet"`` reaches through the node's uplink). ``close()`` removes
    the namespace; the veth and the host's route go with it."""

    def __init__(self, home: Path, tmp: Path, network: str) -> None:
        super().__init__(home, tmp)
        self.veth = f"tsh{secrets.token_hex(5)}"
        net = ipaddress.ip_network(network)
        self.prefixlen = net.prefixlen
        self.gateway, self.address = str(net[1]), str(net[2])

    def __enter__(self) -> HostServerNamespace:
        add_netns(self.name)
        try:
            ip_batch(
                None,
                [
                    f"link add {self.veth} type veth peer name eth0 netns {self.name}",
                    f"addr add {self.gateway}/{self.prefixlen} dev {self.veth}",
                    f"link set {self.veth} up",
                ],
                "linking a test namespace to the host's",
            )
            ip_batch(
                self.name,
                [
                    f"addr add {self.address}/{self.prefixlen} dev eth0",
                    "link set eth0 up",
                    f"route add default via {self.gateway}",
                ],
                "a test namespace's eth0",
            )
        except BaseException:
            self.close()
            raise
        self.record.touch()
        return self


def start_server(argv: list[str], netns: str | None = None) -> subprocess.Popen[str]:
    """Start a ``serve`` process (in ``netns`` if given) and wait until it listens."""
    if netns is not None:
        argv = ["nsenter", f"--net=/run/netns/{netns}", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        stop_server(proc)
        raise ToolError("a test server did not start", command=argv, stdout=line)
    return proc


def stop_server(proc: subprocess.Popen[str]) -> None:
    stop_process(proc)
    if proc.stdout:
        proc.stdout.close()


def read_record(path: Path) -> list[Received]:
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [Received(**json.loads(line)) for line in lines if line.strip()]


@dataclass
class EgressKitNode:
    """A kit node whose egress policy resolves domains through a DNS server the test started
    on loopback (``zone``: a JSON object name -> IPv4 addresses, read at every query; every
    query it answers is in ``record``), re-resolving every ``refresh`` seconds."""

    node: KitNode
    zone: Path
    record: Path
    refresh: float
    dns_port: int  # the DNS server's, on 127.0.0.1

    def set_zone(self, zone: dict[str, list[str]]) -> None:
        tmp = self.zone.with_suffix(".tmp")
        tmp.write_text(json.dumps(zone))
        os.replace(tmp, self.zone)

    def queries(self) -> list[Received]:
        return read_record(self.record)


@contextlib.contextmanager
def egress_kit_node(
    tmp: Path, refresh: float = 1.0, env: dict[str, str] | None = None
) -> Iterator[EgressKitNode]:
    """A ``running_kit_node`` configured as ``EgressKitNode`` says (plus ``env`` for its
    daemon); on exit, besides the kit's own checks, fails if the node left its egress
    namespace or a pinned BPF object behind."""
    tmp = Path(tmp)
    zone, record = tmp / "zone.json", tmp / "dns.jsonl"
    zone.write_text("{}")
    port = free_port()
    argv = [sys.executable, "-m", "dsec_security_ebpf.testing", "serve", "--bind", "127.0.0.1"]
    argv += ["--record", os.fspath(record), "--zone", os.fspath(zone), "--dns", str(port)]
    dns = start_server(argv)
    before = _registered()
    try:
        daemon_env = {
            "DSEC_EGRESS_DNS": f"127.0.0.1:{port}",
            "DSEC_EGRESS_REFRESH": str(refresh),
            **(env or {}),
        }
        saved = {k: os.environ.get(k) for k in daemon_env}
        # what the daemon reads as it starts (and again if a test restarts it)
        os.environ.update(daemon_env)
        try:
            with running_kit_node("dsec-egress-kit-") as node:
                egress = EgressNetwork(node.home)
                yield EgressKitNode(node, zone, record, refresh, port)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        assert not egress.exists(), f"the node left its egress namespace {egress.name}"
        left = stale_registrations(before)
        assert not left, f"sandboxes left in the egress maps: {sorted(left)}"
    finally:
        stop_server(dns)


def _registered() -> dict[str, int]:
    try:
        with NodeMaps.open() as maps:
            return maps.sandboxes()
    except UnknownSandbox:  # nothing pinned yet
        return {}


def _cgroup_alive(sandbox_id: str, cgroup_id: int) -> bool:
    """Whether the cgroup v2 directory a sandbox was registered with still exists."""
    root = cgroup2_root()
    if root is None:
        return False
    for path in (root / cgroup_path(sandbox_id), *root.glob(f"*/*/{sandbox_id}")):
        try:
            if path.stat().st_ino == cgroup_id:
                return True
        except OSError:
            continue
    return False


def stale_registrations(ignore: Iterable[str] = (), wait: float = 5.0) -> set[str]:
    """Sandboxes registered in the host's maps whose cgroup is gone: what a node left behind.
    The maps are the host's, shared by every node on it (parallel test workers' too), so an
    entry of a live sandbox, another node's included, is no leftover; one whose sandbox some
    node is killing just now goes within ``wait`` seconds. ``ignore``: ids registered before."""
    skip = set(ignore)
    deadline = time.monotonic() + wait
    while True:
        entries = _registered().items()
        stale = {sid for sid, cg in entries if sid not in skip and not _cgroup_alive(sid, cg)}
        if not stale or time.monotonic() >= deadline:
            return stale
        time.sleep(0.1)


# --- the server process ---------------------------------------------------------------------
def serve_dns_answer(query: bytes, zone: dict[str, list[str]]) -> tuple[str, bytes]:
    """The name a DNS query asks for and the answer from ``zone`` (name -> IPv4 addresses;
    NXDOMAIN for others, and no AAAA records)."""
    qid, _, qd = struct.unpack("!HHH", query[:6])
    off, labels = 12, []
    while query[off]:
        n = query[off]
        labels.append(query[off + 1 : off + 1 + n].decode(errors="replace"))
        off += 1 + n
    qtype = struct.unpack("!H", query[off + 1 : off + 3])[0]
    question = query[12 : off + 5]
    name = ".".join(labels).lower()
    addrs = zone.get(name, []) if qtype == 1 else []
    rcode = 0 if name in zone else 3
    head = struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, len(addrs), 0, 0)
    answers = b"".join(
        struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(a) for a in addrs
    )
    return name, head + question + answers


def _serve(args: argparse.Namespace) -> None:
    lock = threading.Lock()
    record = open(args.record, "a")

    def note(kind: str, port: int, peer: str, data: str) -> None:
        with lock:
            record.write(json.dumps(dict(kind=kind, port=port, peer=peer, data=data)) + "\n")
            record.flush()

    def tcp_loop(s: socket.socket, port: int) -> None:
        while True:
            conn, peer = s.accept()
            with conn:
                conn.settimeout(3)
                data = b""
                try:
                    while chunk := conn.recv(4096):
                        data += chunk
                except OSError:
                    pass
                note("tcp", port, peer[0], data.decode(errors="replace"))

    def udp_loop(s: socket.socket, port: int, dns: bool) -> None:
        while True:
            data, peer = s.recvfrom(4096)
            if not dns:
                note("udp", port, peer[0], data.decode(errors="replace"))
                continue
            try:
                zone = json.loads(Path(args.zone).read_text())
            except (OSError, ValueError):
                zone = {}
            try:
                name, answer = serve_dns_answer(data, zone)
            except (IndexError, struct.error):
                note("udp", port, peer[0], data.decode(errors="replace"))
                continue
            note("dns", port, peer[0], name)
            s.sendto(answer, peer)

    threads = []
    for port in args.tcp:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((args.bind, port))
        s.listen(64)
        threads.append(threading.Thread(target=tcp_loop, args=(s, port), daemon=True))
    for port, dns in [(p, False) for p in args.udp] + [(p, True) for p in args.dns]:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((args.bind, port))
        threads.append(threading.Thread(target=udp_loop, args=(s, port, dns), daemon=True))
    for t in threads:
        t.start()
    print("ready", flush=True)
    threading.Event().wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsec_security_ebpf.testing")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="record what reaches these ports; answer DNS")
    serve.add_argument("--record", required=True)
    serve.add_argument("--zone", default="/nonexistent")
    serve.add_argument("--bind", default="0.0.0.0")
    serve.add_argument("--tcp", type=int, action="append", default=[])
    serve.add_argument("--udp", type=int, action="append", default=[])
    serve.add_argument("--dns", type=int, action="append", default=[])
    args = parser.parse_args(argv)
    _serve(args)


if __name__ == "__main__":
    main()
