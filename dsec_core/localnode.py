"""The local node daemon as a process: find it, start it detached, stop it.

One daemon per ``DSEC_HOME``, guarded by a lock on its pid file (``NodeConfig.pid_file``).
Sandboxes outlive the daemon: stopping it leaves them running, and the next daemon re-adopts
them. This module only runs ``python -m dsec_core.node.daemon`` and talks to it over its
socket, so the SDK can start the embedded single-node default without importing the node.
``listen_addresses`` checks the daemon's network listeners before one is started.
"""

from __future__ import annotations

import fcntl
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping

from .api.routes import ROUTES
from .api.transport import Address, HTTPTransport
from .config import NodeConfig
from .errors import InvalidSpec, NodeUnavailable
from .extras import require_node

__all__ = [
    "DAEMON_MODULE",
    "daemon_pid",
    "ensure_daemon",
    "listen_addresses",
    "ping",
    "spawn_daemon",
    "stop_daemon",
]

#: What ``ensure_daemon`` runs (``python -m ...``): the node daemon's entry point.
DAEMON_MODULE = "dsec_core.node.daemon"


def listen_addresses(config: NodeConfig) -> tuple[Address, ...]:
    """The TCP addresses the daemon is to listen on, checked: each needs the API token, and
    https ones a certificate and key. ``InvalidSpec`` says what is missing."""
    addresses = tuple(Address.parse(text) for text in config.listen)
    for a in addresses:
        if not a.tcp:
            raise InvalidSpec(
                f"DSEC_LISTEN: {a} is not a network address (the unix socket is always served)",
                address=str(a),
            )
        if not config.api_token:
            raise InvalidSpec(
                f"refusing to listen on {a} without an API token: set "
                "DSEC_API_TOKEN (clients send it as DSEC_TOKEN)",
                address=str(a),
            )
        if a.scheme == "https" and not (config.tls_cert and config.tls_key):
            raise InvalidSpec(
                f"listening on {a} needs DSEC_TLS_CERT and DSEC_TLS_KEY", address=str(a)
            )
    if any(a.scheme == "https" for a in addresses):
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                os.fspath(config.tls_cert or ""), os.fspath(config.tls_key or "")
            )
        except (OSError, ssl.SSLError) as e:
            raise InvalidSpec(
                f"cannot load DSEC_TLS_CERT {config.tls_cert} with DSEC_TLS_KEY "
                f"{config.tls_key}: {e}"
            ) from e
    return addresses


def ping(config: NodeConfig, timeout: float = 2.0) -> dict | None:
    """The daemon's ``node_info`` answer, or None if no daemon answers on the socket.

    Read as plain JSON, not as a typed ``NodeStatus``, so any daemon version answers."""
    if not config.socket_path.exists():
        return None
    transport = HTTPTransport(Address("unix", path=os.fspath(config.socket_path)))
    try:
        route = ROUTES["node_info"]
        r = transport.request(route.method, route.path, timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (OSError, ValueError):
        return None
    finally:
        transport.close()


def daemon_pid(config: NodeConfig) -> int | None:
    """Pid of the daemon holding the pid-file lock, if any."""
    pid_file = config.pid_file
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


def spawn_daemon(config: NodeConfig, env: Mapping[str, str]) -> subprocess.Popen:
    """Start a node daemon for ``config`` with ``env`` in a session of its own, not waiting for
    it to answer. The daemon logs to its rotated log file itself; what it prints before its
    logging is set up (or as it crashes) lands in ``config.stderr_path``, begun afresh."""
    with open(config.stderr_path, "wb") as logf:
        return subprocess.Popen(
            [sys.executable, "-m", DAEMON_MODULE],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            env=dict(env),
            close_fds=True,
        )


def ensure_daemon(config: NodeConfig | None = None, timeout: float = 60.0) -> dict:
    """Make sure a daemon serves ``config.home``, starting one detached if needed."""
    config = config or NodeConfig.from_env()
    info = ping(config)
    if info:
        return info
    # a client-only install (`pip install dsec`) has no daemon to start: say so, not its import
    require_node(
        f"starting a node daemon at {config.socket_path} (none answers there; a client given "
        "a node's address, or DSEC_ADDRESS, uses that node instead)"
    )
    listen_addresses(config)  # a misconfigured listener fails here, not in the daemon's log
    if os.geteuid() != 0:
        raise NodeUnavailable(
            f"no node daemon at {config.socket_path}, and starting one needs "
            "root (mounts, cgroups, runc); run `sudo dsec node start`"
        )
    config.ensure_dirs()
    with open(config.home / ".start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter at a time
        info = ping(config)
        if info:
            return info
        proc = spawn_daemon(config, dict(os.environ, DSEC_HOME=os.fspath(config.home)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = ping(config, timeout=1.0)
            if info:
                return info
            if proc.poll() is not None:
                info = ping(config, timeout=1.0)  # lost a race to another starter?
                if info:
                    return info
                raise NodeUnavailable(
                    f"the node daemon exited with {proc.returncode} while "
                    f"starting:\n{_log_tail(config)}",
                    log=os.fspath(config.log_path),
                )
            time.sleep(0.05)
        raise NodeUnavailable(
            f"the node daemon did not answer within {timeout}s; see "
            f"{config.log_path}:\n{_log_tail(config)}"
        )


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


def _log_tail(config: NodeConfig, lines: int = 20) -> str:
    """The last lines of the daemon's log, then of what it printed outside it (a traceback)."""
    out = []
    for path in (config.log_path, config.stderr_path):
        try:
            out += path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            pass
    return "\n".join(out)
