"""The local node daemon as a process: find it, start it detached, stop it.

One daemon per ``DSEC_HOME``, guarded by a lock on its pid file (``NodeConfig.pid_file``).
Sandboxes outlive the daemon: stopping it leaves them running, and the next daemon re-adopts
them. This module only runs ``python -m dsec_core.node.daemon`` and talks to it over its
socket, so the SDK can start the embedded single-node default without importing the node.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .api.transport import UnixTransport
from .config import NodeConfig
from .errors import NodeUnavailable

__all__ = ["ensure_daemon", "daemon_pid", "stop_daemon", "ping", "DAEMON_MODULE"]

#: What ``ensure_daemon`` runs (``python -m ...``): the node daemon's entry point.
DAEMON_MODULE = "dsec_core.node.daemon"


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
        proc = subprocess.Popen([sys.executable, "-m", DAEMON_MODULE],
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
