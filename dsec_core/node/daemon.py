"""Running the node daemon: start it (detached or in the foreground), find it, stop it.

One daemon per ``DSEC_HOME``, guarded by a lock on its pid file. Sandboxes outlive the daemon:
stopping it leaves them running, and the next daemon re-adopts them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..config import NodeConfig
from ..errors import NodeUnavailable
from ..transport import UnixTransport

__all__ = ["serve", "ensure_daemon", "daemon_pid", "stop_daemon", "ping"]

log = logging.getLogger("dsec.daemon")


def ping(config: NodeConfig, timeout: float = 2.0) -> dict | None:
    """The daemon's ``/v1/node`` answer, or None if no daemon answers on the socket."""
    if not config.socket_path.exists():
        return None
    transport = UnixTransport(os.fspath(config.socket_path))
    try:
        r = transport.request("GET", "/v1/node", timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (OSError, ValueError):
        return None
    finally:
        transport.close()


def daemon_pid(config: NodeConfig) -> int | None:
    """Pid of the daemon holding the pid-file lock, if any."""
    pid_file = config.run_dir / "dsecd.pid"
    try:
        fd = os.open(pid_file, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # locked: a daemon lives
            text = os.pread(fd, 32, 0).decode().strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def ensure_daemon(config: NodeConfig | None = None, timeout: float = 60.0) -> dict:
    """Make sure a daemon serves ``config.home``, starting one detached if needed."""
    config = config or NodeConfig.from_env()
    info = ping(config)
    if info:
        return info
    if os.geteuid() != 0:
        raise NodeUnavailable(f"no node daemon at {config.socket_path}, and starting one needs "
                              "root (mounts, cgroups, runc); run `sudo dsec node start`")
    config.ensure_dirs()
    with open(config.home / ".start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter at a time
        info = ping(config)
        if info:
            return info
        logf = open(config.log_path, "ab")
        env = dict(os.environ, DSEC_HOME=os.fspath(config.home))
        proc = subprocess.Popen([sys.executable, "-m", "dsec_core.node.daemon"],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True, env=env, close_fds=True)
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = ping(config, timeout=1.0)
            if info:
                return info
            if proc.poll() is not None:
                info = ping(config, timeout=1.0)  # lost a race to another starter?
                if info:
                    return info
                raise NodeUnavailable(f"the node daemon exited with {proc.returncode} while "
                                      f"starting:\n{_log_tail(config.log_path)}",
                                      log=os.fspath(config.log_path))
            time.sleep(0.05)
        raise NodeUnavailable(f"the node daemon did not answer within {timeout}s; see "
                              f"{config.log_path}:\n{_log_tail(config.log_path)}")


def stop_daemon(config: NodeConfig | None = None, timeout: float = 30.0) -> int | None:
    """Stop the daemon (sandboxes keep running); returns its pid, or None if none ran."""
    config = config or NodeConfig.from_env()
    pid = daemon_pid(config)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon_pid(config) is None:
            return pid
        time.sleep(0.05)
    raise NodeUnavailable(f"daemon {pid} did not stop within {timeout}s")


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def serve(config: NodeConfig | None = None) -> None:
    """Run the daemon in this process until SIGTERM/SIGINT."""
    import uvicorn

    from .api import make_app
    from .node import Node

    from .mounts import ensure_tmpfs

    config = config or NodeConfig.from_env()
    config.ensure_dirs()
    ensure_tmpfs(config.run_dir)
    logging.basicConfig(level=os.environ.get("DSEC_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    pid_fd = os.open(config.run_dir / "dsecd.pid", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
