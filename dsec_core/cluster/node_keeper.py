"""The keeper of one cluster node's daemon: the object a Ray actor runs on its Ray node.

``NodeKeeper`` starts ``python -m dsec_core.node.daemon`` as its child with the node's own
``DSEC_HOME``, uid range, name, labels, layer sources and a TCP listener on the Ray node's
address behind a token it made, waits until the daemon answers over that listener, and stops
it again. It knows nothing of Ray (``dsec_core.cluster.control`` wraps it in an actor), so it
is plain Python any process can drive.

The daemon is the keeper's child: when the actor's worker process dies, Ray kills it too
(SIGKILL: its sandboxes keep running and the next daemon in that home re-adopts them).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import NodeConfig
from ..errors import DsecError, NodeUnavailable
from ..linux.processes import free_port, stop_process
from ..localnode import daemon_pid, spawn_daemon, stop_daemon
from ..sdk import Client
from .endpoint import check_name, format_labels

__all__ = ["KeeperSettings", "NodeKeeper"]

#: Client variables of the caller that must not leak into a daemon's environment.
CLIENT_VARIABLES = ("DSEC_ADDRESS", "DSEC_TOKEN")


@dataclass(frozen=True)
class KeeperSettings:
    """Everything one node's daemon is started with.

    ``uid_base``/``uid_size``/``uid_ranges`` become ``DSEC_UID_BASE``/``_SIZE``/``_RANGES``
    (the ranges of nodes on one host must not overlap); ``layer_sources`` becomes
    ``DSEC_LAYER_SOURCES`` when not empty; ``env`` adds further variables (``DSEC_RUNTIME``,
    ``DSEC_DAEMON_MEMORY``, ...)."""

    name: str
    home: str
    node_ip: str
    ray_node_id: str
    uid_base: int
    uid_size: int = 65536
    uid_ranges: int = 4096
    labels: Mapping[str, str] = field(default_factory=dict)
    layer_sources: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 60.0

    def __post_init__(self) -> None:
        check_name(self.name)

    @property
    def config(self) -> NodeConfig:
        """The daemon's config as far as paths and uids go (the rest it reads from its env)."""
        return NodeConfig(
            home=Path(self.home),
            uid_base=self.uid_base,
            uid_size=self.uid_size,
            uid_ranges=self.uid_ranges,
        )


class NodeKeeper:
    """Starts, watches and stops one node daemon. Thread-safe: a Ray actor serving several
    calls at once (``alive`` while ``stop`` runs) takes turns on ``start`` and ``stop``."""

    def __init__(self, settings: KeeperSettings) -> None:
        self.settings = settings
        self.token = secrets.token_urlsafe(24)
        self.port: int | None = None  # kept across restarts, so the endpoint stays the same
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    # --- what the cluster asks ------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.settings.node_ip}:{self.port}" if self.port else ""

    def alive(self) -> bool:
        """Whether the daemon this keeper started is still running."""
        return self._proc is not None and self._proc.poll() is None

    def pid(self) -> int | None:
        """The daemon's pid while it runs."""
        return self._proc.pid if self._proc is not None and self.alive() else None

    def endpoint(self) -> dict[str, Any]:
        """``NodeEndpoint``'s fields, as a dict (it crosses Ray by value)."""
        s = self.settings
        return {
            "name": s.name,
            "url": self.url,
            "token": self.token,
            "labels": dict(s.labels),
            "ray_node_id": s.ray_node_id,
            "alive": self.alive(),
        }

    def state(self) -> dict[str, Any]:
        """``NodeState``'s fields: the endpoint, pid, home, uid range and node address."""
        s = self.settings
        return {
            "endpoint": self.endpoint(),
            "pid": self.pid(),
            "home": s.home,
            "uid_base": s.uid_base,
            "uid_count": s.uid_size * s.uid_ranges,
            "node_ip": s.node_ip,
        }

    # --- start ----------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Start the daemon unless it runs; returns the endpoint once it answers on its URL.

        A daemon of this home that another process started (an actor that died before its
        child, ``dsec node start``) is stopped first: its sandboxes keep running and ours
        re-adopts them. A port taken between choosing it and binding it is chosen again."""
        with self._lock:
            if self.alive():
                return self.endpoint()
            config = self.settings.config
            if daemon_pid(config) is not None:
                stop_daemon(config)
            self._prepare_home(config)
            for _attempt in range(3):
                port = self.port or free_port(self.settings.node_ip)
                try:
                    self._spawn(config, port)
                except _PortTaken:
                    self.port = None
                    continue
                return self.endpoint()
            raise NodeUnavailable(
                f"node {self.settings.name}: no free port on {self.settings.node_ip} held "
                "long enough to start its daemon",
                node=self.settings.name,
            )

    def _prepare_home(self, config: NodeConfig) -> None:
        home = config.home
        if not home.exists():
            home.mkdir(parents=True)
            # the node's own ensure_dirs narrows it to 0710; a sandbox's uid must pass through
            # every parent, which the node checks and names
            os.chmod(home, 0o711)

    def _environment(self, port: int) -> dict[str, str]:
        s = self.settings
        env = {k: v for k, v in os.environ.items() if k not in CLIENT_VARIABLES}
        env.update(s.env)
        env.update(
            DSEC_HOME=s.home,
            DSEC_LISTEN=f"http://{s.node_ip}:{port}",
            DSEC_API_TOKEN=self.token,
            DSEC_UID_BASE=str(s.uid_base),
            DSEC_UID_SIZE=str(s.uid_size),
            DSEC_UID_RANGES=str(s.uid_ranges),
            DSEC_NODE_NAME=s.name,
            DSEC_NODE_LABELS=format_labels(s.labels),
        )
        if s.layer_sources:
            env["DSEC_LAYER_SOURCES"] = ",".join(s.layer_sources)
        return env

    def _spawn(self, config: NodeConfig, port: int) -> None:
        """Start the daemon on ``port`` and wait until it answers there; ``_PortTaken`` if
        the port went to someone else first, ``NodeUnavailable`` for any other failure."""
        config.home.mkdir(parents=True, exist_ok=True)
        proc = spawn_daemon(config, self._environment(port))
        self._proc, self.port = proc, port
        deadline = time.monotonic() + self.settings.start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = _log_tail(config)
                self._proc = None
                if "cannot listen on" in tail and "in use" in tail:
                    raise _PortTaken()
                raise NodeUnavailable(
                    f"node {self.settings.name}: its daemon exited with {proc.returncode} "
                    f"while starting:\n{tail}",
                    node=self.settings.name,
                    log=os.fspath(config.log_path),
                )
            if self._answers():
                return
            time.sleep(0.1)
        stop_process(proc, 30.0)
        self._proc = None
        raise NodeUnavailable(
            f"node {self.settings.name}: its daemon did not answer on {self.url} within "
            f"{self.settings.start_timeout}s:\n{_log_tail(config)}",
            node=self.settings.name,
        )

    def _answers(self) -> bool:
        try:
            with Client(self.url, token=self.token, autostart=False, retry=0) as client:
                client.node_info()
            return True
        except DsecError:
            return False

    # --- stop -----------------------------------------------------------------------------
    def stop(self, *, purge: bool = False, timeout: float = 30.0) -> dict[str, Any]:
        """Kill the node's sandboxes, stop its daemon (SIGTERM, SIGKILL after ``timeout``),
        and with ``purge`` remove its home (refused while anything is mounted under it).

        A daemon that died (killed, crashed) left its sandboxes running and its runtime
        tmpfs mounted; it is started again first, so it re-adopts them and they are killed
        through the API like any others. Returns the name, the daemon's pid and how many
        sandboxes were killed."""
        config = self.settings.config
        if not self.alive() and os.path.ismount(config.run_dir):
            self.start()
        with self._lock:
            killed = self._kill_sandboxes() if self.alive() else 0
            pid = self.pid()
            if self._proc is not None:
                stop_process(self._proc, timeout)
                self._proc = None
            if purge and config.home.exists():
                mounted = _mounts_under(config.home)
                if mounted:
                    raise NodeUnavailable(
                        f"node {self.settings.name}: not removing {config.home}, still "
                        f"mounted there: {', '.join(mounted)}",
                        node=self.settings.name,
                    )
                shutil.rmtree(config.home)
            return {"name": self.settings.name, "pid": pid, "killed": killed}

    def _kill_sandboxes(self) -> int:
        killed = 0
        with Client(self.url, token=self.token, autostart=False) as client:
            for info in client.list():
                with contextlib.suppress(DsecError):  # gone meanwhile
                    client.kill(info.id)
                    killed += 1
        return killed


class _PortTaken(Exception):
    """The daemon could not bind the port chosen for it."""


def _mounts_under(path: Path) -> list[str]:
    prefix = os.fspath(path.resolve())
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


def _log_tail(config: NodeConfig, lines: int = 20) -> str:
    """The last lines of the daemon's log, then of what it printed outside it."""
    out: list[str] = []
    for path in (config.log_path, config.stderr_path):
        with contextlib.suppress(OSError):
            out += path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(out)
