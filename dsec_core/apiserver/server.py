"""Running an apiserver: ``dsec apiserver --listen http://127.0.0.1:8500 --node n1=http://...``
or ``--ray ADDRESS`` (nodes found through Ray: ``dsec cluster up``).

It serves plain HTTP or TLS (``--tls-cert``/``--tls-key``), keeps nothing on disk but what IAM
keeps (``--iam``: SQLite by default, etcd when several apiservers share it), and stops on
SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from ..api.serving import server_options
from ..api.transport import Address
from ..cluster import discover as ray_discover  # Ray itself is imported when first called
from ..e2b import e2b_refusal, e2b_routes
from ..errors import InvalidSpec
from ..iam import Iam
from ..observe import ApiserverMetrics, JsonLogFormatter, RequestIdFilter
from ..sdk import AsyncClient
from .app import Gateway, Metrics, make_app
from .nodes import NodeAddress, NodeSet, WatchSettings

__all__ = ["ApiserverConfig", "build", "parse_node", "serve"]

log = logging.getLogger("dsec.apiserver")


@dataclass
class ApiserverConfig:
    """What an apiserver serves and where its nodes are."""

    listen: str = "http://127.0.0.1:8500"
    nodes: Sequence[NodeAddress] = ()
    ray_address: str | None = None  # discover nodes through Ray (``dsec cluster up``)
    iam: str | None = None  # IAM store URL (``Iam.open``); None: its default
    watch: WatchSettings = field(default_factory=WatchSettings)
    overflow_at: float = 0.8  # the home pool's use above which overflow is allowed
    tls_cert: Path | None = None
    tls_key: Path | None = None
    e2b: bool = True  # serve the E2B-compatible API on the same listener

    def address(self) -> Address:
        a = Address.parse(self.listen)
        if not a.tcp:
            raise InvalidSpec(f"the apiserver listens on TCP, not {self.listen}", field="listen")
        if a.scheme == "https":
            if not (self.tls_cert and self.tls_key):
                raise InvalidSpec("https needs --tls-cert and --tls-key", field="listen")
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    os.fspath(self.tls_cert), os.fspath(self.tls_key)
                )
            except (OSError, ssl.SSLError) as e:
                raise InvalidSpec(f"cannot load {self.tls_cert} with {self.tls_key}: {e}") from e
        return a


def parse_node(text: str, token: str | None = None) -> NodeAddress:
    """``name=url`` (``n1=http://127.0.0.2:8400``) as a node's address."""
    name, eq, url = text.partition("=")
    if not eq or not name or not url:
        raise InvalidSpec(f"a node is NAME=URL, got {text!r}", field="node")
    Address.parse(url)
    return NodeAddress(name=name.strip(), url=url.strip(), token=token)


def _ray_discovery(address: str) -> Any:
    async def discover() -> list[NodeAddress]:
        found = await asyncio.to_thread(ray_discover, address)
        return [
            NodeAddress(name=e.name, url=e.url, token=e.token, labels=dict(e.labels)) for e in found
        ]

    return discover


def build(
    config: ApiserverConfig, iam: Any = None, metrics: Metrics | None = None
) -> tuple[Gateway, Any]:
    """The gateway and its ASGI app (whose lifespan starts and stops the watcher). ``iam``:
    an ``Authority``; by default the store ``config.iam`` names. ``metrics``: by default an
    ``ApiserverMetrics`` of its own, served at ``GET /metrics``."""
    if iam is None:
        iam = Iam.open(config.iam)
    if metrics is None:
        metrics = ApiserverMetrics()
    discover = _ray_discovery(config.ray_address) if config.ray_address else None
    if not config.nodes and discover is None:
        raise InvalidSpec("an apiserver needs nodes: --node NAME=URL or --ray ADDRESS")
    nodes = NodeSet(config.nodes, discover, config.watch, getattr(metrics, "probed", None))
    gw = Gateway(nodes=nodes, iam=iam, overflow_at=config.overflow_at, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await nodes.start()
        log.info(
            "apiserver %d serving %s over %d nodes (%d healthy)",
            os.getpid(),
            config.listen,
            len(nodes.nodes),
            len(nodes.healthy()),
        )
        try:
            yield
        finally:
            await nodes.stop()

    if not config.e2b:
        return gw, make_app(gw, lifespan=lifespan)
    return gw, make_app(
        gw, lifespan=lifespan, extra_routes=_e2b_routes(config, iam), refusal=e2b_refusal
    )


#: The collector's threshold for its youngest generation once the apiserver is up (Python's
#: default is 700): see ``settle_gc``.
GC_YOUNG = 20_000


def settle_gc() -> None:
    """Before serving: what startup made (modules, the app and its route table) is
    moved out of the collector's sight (``gc.freeze``), and the youngest generation is
    collected every ``GC_YOUNG`` allocations rather than 700. A create allocates a few hundred
    short-lived objects, nearly all freed by their counts: at 700 the collector ran every
    other create and walked the whole heap every few thousand (a tenth of the apiserver's
    CPU under a fleet's creates, ``bench/fleet.py``); at 20,000 it runs a hundredth as often
    and what it finds still young is a few MB at most."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, middle, old)


def _e2b_routes(config: ApiserverConfig, iam: Any = None) -> list[Any]:
    """The E2B-compatible API on the same listener. Its calls come back to this apiserver
    with the caller's key (over loopback: the self-connection is not verified, it never
    leaves the machine), so they are authorised and placed as any other. Built templates
    are kept in IAM's store, where every apiserver sharing it sees them."""
    a = config.address()
    host = "127.0.0.1" if a.host in ("0.0.0.0", "::", "") else a.host
    url = f"{a.scheme}://{host}:{a.port}"

    def connect(key: str) -> AsyncClient:
        return AsyncClient(url, api_key=key, verify=False, autostart=False)

    return list(e2b_routes(connect, store=getattr(iam, "store", None)))


def log_json() -> None:
    """This process's log as JSON lines on stderr, each with the id of the request it was
    made for (the node logs the same id: ``X-Request-Id`` travels with the request)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(os.environ.get("DSEC_LOG_LEVEL", "INFO"))
    if os.environ.get("DSEC_ACCESS_LOG", "").lower() in ("0", "off", "false", "no"):
        logging.getLogger("dsec.apiserver.access").setLevel(logging.WARNING)


def serve(config: ApiserverConfig, iam: Any = None) -> None:
    """Run the apiserver in this process until SIGTERM/SIGINT, logging JSON lines to
    stderr."""
    address = config.address()
    log_json()
    # its JSON lines never show a record's thread or process: not looked up for each record
    # (the access log makes one a request)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    _, app = build(config, iam)
    tls: dict[str, Any] = {}
    if address.scheme == "https":
        tls = {
            "ssl_certfile": os.fspath(config.tls_cert or ""),
            "ssl_keyfile": os.fspath(config.tls_key or ""),
        }
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=address.host,
            port=address.port,
            lifespan="on",
            proxy_headers=False,  # no proxy in front is trusted to say who the client is
            backlog=4096,
            **server_options(),  # uvicorn's records go to our JSON handler
            **tls,
        )
    )
    settle_gc()
    server.run()
