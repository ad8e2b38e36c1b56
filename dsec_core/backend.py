"""The contract between the node daemon and a backend plugin (container, FnCall, microVM, VM).

A backend starts and stops the isolation around a prepared root filesystem; everything inside
(exec, sessions, files) goes through the in-sandbox agent, reached at ``agent_address``. So a new
backend only has to boot something that runs ``dsec-agent`` on the socket it was handed.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

from .config import NodeConfig
from .records import Limits, SandboxSpec

__all__ = ["Backend", "SandboxRuntime", "IdMap"]


@dataclass(frozen=True)
class IdMap:
    """Container uid/gid 0.. map to host ``host_base``.. (``size`` ids)."""

    host_base: int
    size: int


@dataclass(frozen=True)
class SandboxRuntime:
    """What the daemon prepared for one sandbox before asking a backend to start it."""

    id: str
    spec: SandboxSpec
    limits: Limits
    dir: Path  # the sandbox's runtime directory (tmpfs): the OCI bundle, sockets, state
    data_dir: Path  # the sandbox's directory on local disk: its writable layer
    rootfs: Path  # composed overlay (layers + writable upper), already mounted
    agent_socket: Path  # listening unix socket the agent must serve (bound by the daemon)
    agent_binary: Path  # static dsec-agent to run inside as init
    idmap: IdMap
    layer_mounts: tuple[Path, ...] = ()  # the read-only layer mounts (top first), for VM backends
    extra: Mapping[str, Any] = field(default_factory=dict)


class Backend(abc.ABC):
    """Subclass, set ``name``, and register the class from ``dsec_register_backends``."""

    name: ClassVar[str]
    #: what the backend's isolation gives; the conformance kit reads this to pick its checks
    features: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: NodeConfig, security_policies: list[Any] | None = None) -> None:
        self.config = config
        self.security_policies = list(security_policies or [])

    @classmethod
    def check_available(cls) -> None:
        """Raise ``BackendUnavailable`` (saying what is missing) if this host cannot run it."""

    @abc.abstractmethod
    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        """Start the sandbox; return the JSON-able state needed to adopt or stop it later.

        On failure, leave nothing running and raise a ``DsecError``.
        """

    @abc.abstractmethod
    async def alive(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        """Whether a sandbox started earlier (perhaps by a previous daemon) still runs."""

    @abc.abstractmethod
    async def stop(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        """Kill every process of the sandbox and free what ``start`` took. Idempotent."""

    def usage(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> dict[str, Any]:
        """Current resource use (memory bytes, cpu seconds, pids), best effort."""
        return {}
