"""A PEP 503 "simple" package index over a directory of wheels, served where a build can
reach it: ``EgressIndex`` serves it from a network namespace of its own linked to a node's
egress namespace (the only place a sandbox granted egress can reach: never the host's
loopback), ``LoopbackIndex`` on 127.0.0.1 for the host's own tools (``docker build
--network host``, pip on the host).

``dsec build demo`` installs the sample repository's dependency from one, and
``bench/build.py`` builds its variants from one: offline builds, with pip doing exactly what it
does against PyPI. ``python -m dsec_builder.pkgindex serve --wheels DIR`` is the server
process ``EgressIndex`` starts in its namespace.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import ipaddress
import json
import os
import random
import re
import secrets
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote

from dsec_security_ebpf.network import EgressNetwork

from dsec_core.errors import InvalidSpec, ToolError
from dsec_core.linux.netns import add_netns, delete_netns, ip_batch, links, netns_exists
from dsec_core.linux.processes import stop_process
from dsec_core.linux.tools import run_tool

__all__ = [
    "INDEX_NETWORK",
    "EgressIndex",
    "IndexRequest",
    "LoopbackIndex",
    "SimpleIndex",
    "make_server",
    "normalize",
    "project_of",
]

#: Where ``EgressIndex`` takes its /24 from (one per index; ``.2`` serves, ``.1`` is the
#: egress side), apart from the egress namespace's own sandbox subnet.
INDEX_NETWORK = "10.78.0.0/16"
DIST_SUFFIXES = (".whl", ".tar.gz", ".zip")


def normalize(name: str) -> str:
    """A project name as PEP 503 spells it in URLs: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(filename: str) -> str | None:
    """The normalized project a distribution file belongs to (``peppercorn-0.6-py3-none-any
    .whl`` -> ``peppercorn``), or None for a file that is not a wheel or an sdist."""
    if filename.endswith(".whl"):
        parts = filename[: -len(".whl")].split("-")
        return normalize(parts[0]) if len(parts) >= 5 else None
    for suffix in (".tar.gz", ".zip"):
        if filename.endswith(suffix):
            stem = filename[: -len(suffix)]
            name, sep, _version = stem.rpartition("-")
            return normalize(name) if sep and name else None
    return None


@dataclass(frozen=True)
class IndexRequest:
    """One request the index answered: method, path and HTTP status."""

    method: str
    path: str
    status: int


class SimpleIndex:
    """The pages of a simple index over ``wheels`` (read again at every request, so files added
    while it serves are listed): ``/simple/``, ``/simple/<project>/`` with each file's sha256
    as the URL fragment pip checks, and ``/files/<name>``."""

    def __init__(self, wheels: Path) -> None:
        self.wheels = Path(wheels)
        if not self.wheels.is_dir():
            raise InvalidSpec(f"wheels directory {self.wheels} does not exist", path=str(wheels))

    def projects(self) -> dict[str, list[Path]]:
        """Normalized project name -> its distribution files, sorted."""
        found: dict[str, list[Path]] = {}
        for path in sorted(self.wheels.iterdir()):
            project = project_of(path.name) if path.is_file() else None
            if project is not None:
                found.setdefault(project, []).append(path)
        return found

    def page(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path``."""
        path = unquote(path.split("?", 1)[0])
        if path in ("/simple", "/simple/", "/"):
            links = [
                f'<a href="/simple/{quote(p)}/">{html.escape(p)}</a><br/>' for p in self.projects()
            ]
            return 200, "text/html", _html("Simple index", links)
        m = re.fullmatch(r"/simple/([^/]+)/?", path)
        if m:
            name = normalize(m.group(1))
            files = self.projects().get(name)
            if files is None:
                return 404, "text/plain", b"no such project\n"
            links = [
                f'<a href="/files/{quote(f.name)}#sha256={_sha256(f)}">'
                f"{html.escape(f.name)}</a><br/>"
                for f in files
            ]
            return 200, "text/html", _html(f"Links for {name}", links)
        m = re.fullmatch(r"/files/([^/]+)", path)
        if m and project_of(m.group(1)) is not None and (self.wheels / m.group(1)).is_file():
            return 200, "application/octet-stream", (self.wheels / m.group(1)).read_bytes()
        return 404, "text/plain", b"not found\n"


def _html(title: str, links: list[str]) -> bytes:
    body = "\n".join(links)
    return (
        '<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{html.escape(title)}</title></head><body>\n<h1>{html.escape(title)}</h1>\n"
        f"{body}\n</body></html>\n"
    ).encode()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_server(
    wheels: Path, host: str, port: int, record: Path | None = None
) -> ThreadingHTTPServer:
    """An HTTP server (not started) answering ``SimpleIndex(wheels)``'s pages on
    ``host:port``; each request is appended to ``record`` (JSON lines) if given."""
    index = SimpleIndex(wheels)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        server_version = "dsec-pkgindex/1"

        def _answer(self, body: bool) -> None:
            status, ctype, data = index.page(self.path)
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            if record is not None:
                line = json.dumps({"method": self.command, "path": self.path, "status": status})
                with lock, open(record, "a") as f:
                    f.write(line + "\n")

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def log_message(self, format: str, *args: object) -> None:  # quiet: record says it
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def read_requests(record: Path) -> list[IndexRequest]:
    try:
        lines = Path(record).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [IndexRequest(**json.loads(line)) for line in lines if line.strip()]


class LoopbackIndex:
    """``SimpleIndex(wheels)`` served by a thread of this process on 127.0.0.1 (a free port):
    for the host's tools. A context manager; ``url`` is the index's ``/simple/``."""

    def __init__(self, wheels: Path, record: Path | None = None) -> None:
        self._server = make_server(wheels, "127.0.0.1", 0, record)
        self.port: int = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/simple/"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="dsec-pkgindex", daemon=True
        )

    def __enter__(self) -> LoopbackIndex:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


class EgressIndex:
    """``SimpleIndex(wheels)`` served from a network namespace of its own, linked by a veth to
    the egress namespace of the node at ``home`` (made if it is not there yet): the index
    listens on ``address:port`` (``10.78.<n>.2``), which a sandbox on that node reaches once
    its egress policy allows ``allow_rule``. Nothing there is on the host's loopback.

    A context manager: entering makes the namespace and starts the server process (returning
    once it listens), leaving (or ``close()``) stops it and removes the namespace, the veth
    with it; a failure on the way in leaves nothing behind."""

    def __init__(
        self, home: Path, wheels: Path, record: Path, *, port: int = 8080, subnet: int | None = None
    ) -> None:
        self.index = SimpleIndex(wheels)  # a missing directory fails here, before anything runs
        self.egress = EgressNetwork(Path(home))
        self.record = Path(record)
        self.port = port
        self.name = f"dsec-pkgindex-{secrets.token_hex(4)}"
        self.veth = f"dpi{secrets.token_hex(5)}"  # not "dsv*": the egress side forwards to it
        self._subnet = subnet
        self.gateway = self.address = ""
        self._proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        """The index's ``/simple/`` URL, as a sandbox sees it (pip's ``--index-url``)."""
        return f"http://{self.address}:{self.port}/simple/"

    @property
    def allow_rule(self) -> str:
        """The egress policy rule that lets a sandbox reach the index."""
        return f"{self.address}:{self.port}/tcp"

    def requests(self) -> list[IndexRequest]:
        """Every request the index has answered so far."""
        return read_requests(self.record)

    def __enter__(self) -> EgressIndex:
        self.egress.ensure()
        net = self._pick_subnet()
        self.gateway, self.address = str(net[1]), str(net[2])
        add_netns(self.name)
        try:
            ip_batch(
                None,
                [
                    f"link add {self.veth} netns {self.egress.name} type veth "
                    f"peer name eth0 netns {self.name}"
                ],
                "linking the package index's namespace to the egress namespace",
            )
            ip_batch(
                self.egress.name,
                [f"addr add {self.gateway}/24 dev {self.veth}", f"link set {self.veth} up"],
                "the egress side of the package index's namespace",
            )
            ip_batch(
                self.name,
                [
                    f"addr add {self.address}/24 dev eth0",
                    "link set eth0 up",
                    f"route add default via {self.gateway}",
                ],
                "the package index namespace's eth0",
            )
            self.record.touch()
            self._proc = _start(
                [
                    "nsenter",
                    f"--net=/run/netns/{self.name}",
                    sys.executable,
                    "-m",
                    "dsec_builder.pkgindex",
                    "serve",
                    "--wheels",
                    os.fspath(self.index.wheels),
                    "--bind",
                    self.address,
                    "--port",
                    str(self.port),
                    "--record",
                    os.fspath(self.record),
                ]
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None
        # The veth's egress end would go with its peer once the kernel frees this namespace,
        # in the background; deleting it first makes its removal certain and immediate.
        if self.egress.exists() and self.veth in links(self.egress.name):
            ip_batch(self.egress.name, [f"link del {self.veth}"], "removing the index's veth")
        delete_netns(self.name)

    @property
    def exists(self) -> bool:
        """Whether its namespace is there (tests check that nothing is left)."""
        return netns_exists(self.name)

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        """A /24 of ``INDEX_NETWORK`` no address in the egress namespace is in yet (another
        index, a test's server namespace), apart from the sandboxes' subnet."""
        nets = list(ipaddress.IPv4Network(INDEX_NETWORK).subnets(new_prefix=24))[1:]
        if self._subnet is not None:
            return nets[self._subnet % len(nets)]
        out = run_tool(
            ["ip", "-n", self.egress.name, "-j", "-4", "addr"],
            "listing the egress namespace's addresses",
        )
        used = {
            ipaddress.ip_address(a["local"])
            for link in json.loads(out.stdout or "[]")
            for a in link.get("addr_info", [])
        }
        free = [
            n for n in nets if not n.overlaps(self.egress.subnet) and not any(a in n for a in used)
        ]
        if not free:
            raise ToolError(f"no free /24 left in {INDEX_NETWORK} for a package index")
        return random.choice(free)


def _start(argv: list[str]) -> subprocess.Popen[str]:
    """Start a ``serve`` process and wait until it says it listens."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":  # it has exited, or said something else: either way it is done
        stop_process(proc)
        with proc.stdout, proc.stderr:
            stderr = proc.stderr.read()
        raise ToolError("the package index did not start", command=argv, stderr=stderr[-2000:])
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    stop_process(proc)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsec_builder.pkgindex")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a directory of wheels as a PEP 503 index")
    serve.add_argument("--wheels", required=True, type=Path)
    serve.add_argument("--bind", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--record", type=Path, default=None)
    args = parser.parse_args(argv)
    server = make_server(args.wheels, args.bind, args.port, args.record)
    print("ready", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
