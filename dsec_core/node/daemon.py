"""The node daemon process: ``python -m dsec_core.node.daemon`` serves a ``Node`` over its socket.

Started and stopped by ``dsec_core.localnode`` (or ``dsec node start --foreground``). It holds
the pid-file lock while it lives; sandboxes outlive it and the next daemon re-adopts them. It
runs in memory and pids cgroups of its own (``NodeConfig.daemon_cgroup``, limit
``DSEC_DAEMON_MEMORY``), made when it starts and removed when it stops.

The root-only unix socket is always served, without a token. ``DSEC_LISTEN`` adds TCP
listeners (plain or TLS) for an apiserver or remote trainers; each is its own uvicorn server,
behind the bearer token, started once the node is open and stopped before it closes, in the
unix server's lifespan (which owns the signals).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import logging.handlers
import os
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from ..api.serving import server_options
from ..api.transport import Address
from ..config import NodeConfig
from ..errors import DsecError, NodeUnavailable
from ..linux.cgroups import ConfinedCgroups, confine_self, release_self
from ..linux.mounts import ensure_tmpfs
from ..localnode import listen_addresses
from ..observe import ACCESS_LOGGER, JsonLogFormatter, RequestIdFilter
from .node import Node
from .server import make_app, require_token

__all__ = ["serve"]

log = logging.getLogger("dsec.daemon")


class _Listener(uvicorn.Server):
    """A TCP listener run inside the unix server's lifespan; that server owns the signals.

    uvicorn (0.29 on) installs its SIGINT/SIGTERM handlers in ``capture_signals``; a second
    server doing so would take them from the first, so listeners install none and stop when
    the lifespan ends."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind_tcp(address: Address) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        return socket.create_server((address.host, address.port), family=family, backlog=4096)
    except OSError as e:
        raise NodeUnavailable(f"cannot listen on {address}: {e}", address=str(address)) from e


def _listener(app: Any, address: Address, config: NodeConfig, options: dict[str, Any]) -> _Listener:
    """The server of one TCP address: the app behind the token, with TLS for https."""
    tls: dict[str, Any] = {}
    if address.scheme == "https":  # listen_addresses checked that both load
        tls = {
            "ssl_certfile": os.fspath(config.tls_cert or ""),
            "ssl_keyfile": os.fspath(config.tls_key or ""),
        }
    return _Listener(
        uvicorn.Config(
            require_token(app, config.api_token or ""),
            lifespan="off",
            proxy_headers=False,
            **tls,
            **options,
        )
    )


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
LOG_BACKUPS = 3  # dsecd.log.1 .. .3 beside the live file


def log_to_file(config: NodeConfig) -> logging.Handler:
    """Send every log record of this process to ``config.log_path``, one JSON object per line
    (``JsonLogFormatter``: with the id of the request it was made for, so a request is followed
    from the apiserver into the node), rotated at ``config.log_max_bytes`` with
    ``LOG_BACKUPS`` old files kept, so a long-lived daemon's log never grows without bound.
    Returns the handler (to remove it again)."""
    handler = logging.handlers.RotatingFileHandler(
        config.log_path, maxBytes=config.log_max_bytes, backupCount=LOG_BACKUPS
    )
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonLogFormatter())
    logging.getLogger().addHandler(handler)
    return handler


def serve(config: NodeConfig | None = None, *, foreground: bool = False) -> None:
    """Run the daemon in this process until SIGTERM/SIGINT. Logs go to the rotated log file,
    or with ``foreground`` to stderr."""
    config = config or NodeConfig.from_env()
    addresses = listen_addresses(config)
    config.ensure_dirs()
    ensure_tmpfs(config.run_dir, mode=0o710, gid=config.sandbox_gid)
    logging.getLogger().setLevel(os.environ.get("DSEC_LOG_LEVEL", "INFO"))
    if os.environ.get("DSEC_ACCESS_LOG", "on").lower() in ("off", "0", "no", "false"):
        # one line per request costs ~30 us of the daemon's time (after the answer is sent)
        logging.getLogger(ACCESS_LOGGER).setLevel(logging.WARNING)
    if foreground:
        logging.basicConfig(format=LOG_FORMAT)
    else:
        log_to_file(config)
    pid_fd = os.open(config.pid_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(pid_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise NodeUnavailable(f"a node daemon already runs for {config.home}") from None
    os.ftruncate(pid_fd, 0)
    os.pwrite(pid_fd, str(os.getpid()).encode(), 0)
    try:
        confined = _confine(config)
    except DsecError:
        os.close(pid_fd)
        raise

    def release() -> None:
        # Out of the cgroups and them removed while the pid-file lock is still held, so whoever
        # waits for the daemon to stop finds them gone too. Called at the end of the server's
        # lifespan, because uvicorn re-raises the stop signal once it is done, and again here
        # for the ways out that do not get that far.
        if confined is not None:
            kept = release_self(confined)
            if kept:
                log.info("daemon cgroups kept (a child still runs in them): %s", kept)

    try:
        _serve_locked(config, addresses, release)
    finally:
        release()
        os.close(pid_fd)


def _confine(config: NodeConfig) -> ConfinedCgroups | None:
    """Move the daemon into its own memory and pids cgroups (``config.daemon_cgroup``) with
    ``config.daemon_memory`` as the limit, before it starts any thread or child. Replies from
    sandboxes are bounded (``AgentClient``), so this is the backstop, not the first line."""
    if not config.daemon_memory:
        return None
    confined = confine_self(config.daemon_cgroup, config.daemon_memory)
    log.info(
        "daemon confined to %s with a memory limit of %d bytes",
        ", ".join(map(os.fspath, confined.dirs)),
        config.daemon_memory,
    )
    return confined


def _serve_locked(
    config: NodeConfig, addresses: tuple[Address, ...], last_word: Callable[[], None]
) -> None:
    """The daemon's life once it holds the pid-file lock; ``last_word`` runs when it is over."""
    tcp_socks = [_bind_tcp(a) for a in addresses]  # a port in use fails before anything else

    # Bind the socket ourselves so it is root-only from the first moment (uvicorn's own uds
    # handling makes it world-writable).
    path = config.socket_path
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(os.fspath(path))
    finally:
        os.umask(old)
    sock.listen(4096)

    node = Node(config)
    listeners: list[tuple[_Listener, socket.socket]] = []

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await node.open()
        tasks = [asyncio.create_task(srv.serve(sockets=[s])) for srv, s in listeners]
        log.info(
            "dsec node daemon %d serving %s with %d adopted sandboxes",
            os.getpid(),
            ", ".join([os.fspath(path), *map(str, addresses)]),
            len(node.sandboxes),
        )
        try:
            yield
        finally:
            for srv, _ in listeners:
                srv.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            await node.close(kill_all=False, release_runtime=False)
            log.info("node daemon stopped; %d sandboxes left running", len(node.sandboxes))
            # uvicorn re-raises the stop signal after shutdown, so this is our last word.
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            # Our cgroups go first: detaching the runtime tmpfs below takes the pid file with
            # it, and whoever waits for the daemon to stop stops waiting then.
            last_word()
            # Detach the runtime tmpfs while still holding the pid-file lock, so whoever waits
            # for the daemon to stop finds it gone too; it is freed when our fds close.
            node.release_runtime(lazy=True)

    app = make_app(node, lifespan=lifespan)
    options = server_options()  # uvicorn's records go to our (rotated) handlers
    try:
        listeners.extend(
            (_listener(app, a, config, options), s)
            for a, s in zip(addresses, tcp_socks, strict=True)
        )
        server = uvicorn.Server(uvicorn.Config(app, fd=sock.fileno(), lifespan="on", **options))
        server.run()
    finally:
        sock.close()
        for s in tcp_socks:
            s.close()
    if not server.started:
        sys.exit(1)


if __name__ == "__main__":
    try:
        serve()
    except DsecError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
