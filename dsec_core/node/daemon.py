"""The node daemon process: ``python -m dsec_core.node.daemon`` serves a ``Node`` over its socket.

Started and stopped by ``dsec_core.localnode`` (or ``dsec node start --foreground``). It holds
the pid-file lock while it lives; sandboxes outlive it and the next daemon re-adopts them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sys

import uvicorn

from ..config import NodeConfig
from ..errors import NodeUnavailable
from ..linux.mounts import ensure_tmpfs
from .node import Node
from .server import make_app

__all__ = ["serve"]

log = logging.getLogger("dsec.daemon")


def serve(config: NodeConfig | None = None) -> None:
    """Run the daemon in this process until SIGTERM/SIGINT."""
    config = config or NodeConfig.from_env()
    config.ensure_dirs()
    ensure_tmpfs(config.run_dir)
    logging.basicConfig(level=os.environ.get("DSEC_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    pid_fd = os.open(config.pid_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(pid_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise NodeUnavailable(f"a node daemon already runs for {config.home}") from None
    os.ftruncate(pid_fd, 0)
    os.pwrite(pid_fd, str(os.getpid()).encode(), 0)

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

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await node.open()
        log.info("dsec node daemon %d serving %s with %d adopted sandboxes", os.getpid(), path,
                 len(node.sandboxes))
        try:
            yield
        finally:
            await node.close(kill_all=False, release_runtime=False)
            log.info("node daemon stopped; %d sandboxes left running", len(node.sandboxes))
            # uvicorn re-raises the stop signal after shutdown, so this is our last word.
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            # Detach the runtime tmpfs while still holding the pid-file lock, so whoever waits
            # for the daemon to stop finds it gone too; it is freed when our fds close.
            node.release_runtime(lazy=True)

    app = make_app(node, lifespan=lifespan)
    loop = os.environ.get("DSEC_LOOP") or ("uvloop" if _has("uvloop") else "asyncio")
    http = "httptools" if _has("httptools") else "h11"
    server = uvicorn.Server(uvicorn.Config(app, fd=sock.fileno(), loop=loop, http=http,
                                           log_level="warning", access_log=False,
                                           timeout_keep_alive=300, lifespan="on"))
    try:
        server.run()
    finally:
        sock.close()
        os.close(pid_fd)
    if not server.started:
        sys.exit(1)


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    try:
        serve()
    except NodeUnavailable as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
