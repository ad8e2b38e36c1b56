"""The contract between the node and a backend plugin (container, FnCall, microVM, full VM).

A backend starts and stops the isolation around a sandbox; everything inside (exec, sessions,
files) goes through the in-sandbox agent, ``dsec-agent``, which the node reaches at
``SandboxRuntime.agent_socket``. A backend declares what it needs and what it gives as class
attributes, and the node hands it exactly that:

``rootfs`` (``RootfsForm``)
    ``COMPOSED``: the node mounts every layer and an overlay with the writable upper on local
    disk, and hands the backend the mounted directory (``rt.rootfs``): containers. The node
    unmounts it after ``stop``.
    ``IMAGES``: the node mounts nothing (``rt.rootfs`` is None); it hands the layer image files
    (``rt.images``, top first; on-demand layers as a metadata image plus a data blob
    ``device``) and a writable disk file (``rt.disk``, sparse, unformatted, ``rt.disk_size``
    bytes) for the backend to attach (virtio-pmem/blk): microVMs and full VMs.

``agent_channel`` (``AgentChannel``)
    ``UNIX``: the backend itself binds a unix stream socket at ``rt.agent_socket`` (unlinking
    any stale file first), calls ``listen``, and hands the listening socket to ``dsec-agent``
    as an inherited descriptor (not close-on-exec in the child): ``<AGENT_PATH> --fd N``. The
    container backend passes it as fd 3 through ``os.posix_spawn`` file actions (runc
    ``--preserve-fds 1``). The backend then closes its own copy, so that if the agent dies,
    connects fail at once instead of hanging. ``start`` may return before the agent runs:
    connections made earlier wait in the socket's backlog. The socket file stays where it is
    for the sandbox's life; a restarted daemon connects to the same path.
    ``FORWARDED``: the agent runs where the host cannot pass it a descriptor (a guest kernel);
    the backend makes ``rt.agent_socket`` a unix socket that forwards each connection, both
    half-closes included, to the agent (over vsock or a serial port) and returns from
    ``start`` once it does.

``features`` (a frozenset of ``Feature`` members)
    What the backend's isolation gives; claim only what it really gives. The node relies on
    ``NET_NAMESPACE`` to enforce ``SandboxSpec.network="none"`` (the default: without it, such
    creates fail with ``PolicyUnavailable``). The conformance kit reads all of them to pick its
    checks and reports every check it skips for an unclaimed feature, naming the feature.
    Unknown names are refused at registration (``PluginInvalid``).

``policy_targets`` (a frozenset of str)
    The enforcement points the backend offers security policies. At each one the backend calls
    ``rt.enforce(target, subject)``, which applies every policy the sandbox asked for (in
    ``SandboxSpec.policies``) that works through ``target``: the container backend offers
    ``"oci"`` and calls ``rt.enforce("oci", config)`` with the OCI runtime config before
    starting the container, and ``"started"`` with a ``StartedSandbox`` (the init's pid, its
    network namespace and cgroup v2 directory) once the container runs, before ``start``
    returns and so before any command runs in it; if that raises, the backend stops the
    sandbox and ``start`` raises. A policy a sandbox asks for must work through the backend's
    targets, or the create fails (``SecurityPolicy.enforceable_on``). Empty: sandboxes of this
    backend cannot ask for policies.

Other requirements, all checked by ``dsec_core.testing.BackendConformance``:

- The agent is the sandbox's init: PID 1 in its pid namespace (or guest), run as
  ``AGENT_PATH`` (``/.dsec/agent``) in the sandbox, so ``/proc/1/exe`` and ``/proc/1/cmdline``
  name it there. ``rt.agent_binary`` is the static binary to put there (a read-only bind mount
  or a copy). The agent needs ``/proc`` mounted (it walks process trees to kill timed-out
  commands) and ``/dev/null``; string commands and sessions run ``/bin/sh`` from the layers.
  It builds each command's environment itself, so what the backend passes it does not matter.
- ``start`` returns a JSON-able state dict, saved with the sandbox and handed back to
  ``alive``, ``stop`` and ``usage``, also in a restarted daemon whose backend instance never
  saw the start. Its ``"pid"``, if any, is the host process whose death ends the sandbox
  (``SandboxInfo.pid``; the kit kills it to check that the node notices). On failure,
  ``start`` leaves nothing running and raises a ``DsecError``.
- ``alive`` answers from the state alone (a pid and its start time, say, so a reused pid is
  not mistaken for the sandbox), cheaply: the node asks it for every sandbox once a second
  and when it re-adopts sandboxes after a restart. A process that has exited but not been
  reaped is not alive.
- ``stop`` kills every process of the sandbox and frees what ``start`` took, and returns only
  when they are gone; it is idempotent and works from the state alone.
- With ``CGROUPS``, the sandbox's cgroups are ``<hierarchy>/dsec/<sandbox id>``
  (``cgroup_path``; the node's leak checks look there and nowhere else) while it lives and
  gone after ``stop``, and ``usage`` returns a ``SandboxUsage`` with ``memory``,
  ``cpu_seconds`` and ``pids`` all set. Without it, ``usage`` reports what it can (None
  where unknown).
- ``check_available`` raises ``BackendUnavailable`` saying what is missing, quickly, without
  side effects: the node calls it before it first uses the backend.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .config import NodeConfig
from .errors import PluginInvalid
from .records import IdMap, Limits, SandboxSpec, SandboxUsage

__all__ = [
    "AGENT_PATH",
    "CGROUP_PARENT",
    "AgentChannel",
    "Backend",
    "Feature",
    "IdMap",
    "LayerImage",
    "RootfsForm",
    "SandboxRuntime",
    "StartedSandbox",
    "cgroup_path",
]

#: Where the agent binary is inside every sandbox.
AGENT_PATH = "/.dsec/agent"
#: Parent of every sandbox's cgroup in each hierarchy: ``<hierarchy>/dsec/<sandbox id>``.
CGROUP_PARENT = "dsec"


def cgroup_path(sandbox_id: str) -> str:
    """The cgroup of a sandbox, relative to a hierarchy's root: ``dsec/<id>``."""
    return f"{CGROUP_PARENT}/{sandbox_id}"


class Feature(enum.StrEnum):
    """What a backend's isolation gives; ``Backend.features`` claims a set of these."""

    #: Sandbox processes run on the host kernel and show in the host's /proc.
    SHARED_KERNEL = "shared-kernel"
    #: Root inside is an unprivileged host uid (``SandboxRuntime.idmap``); files it writes in
    #: the writable layer belong to that uid on the host.
    USERNS = "userns"
    #: Memory, CPU and pids limits enforced by cgroups at ``cgroup_path(id)``; ``usage`` reports
    #: memory, cpu_seconds and pids.
    CGROUPS = "cgroups"
    #: A private pid namespace (or guest): the agent is PID 1 and sees only sandbox processes.
    PID_NAMESPACE = "pid-namespace"
    #: No network but loopback (a private network namespace, or a guest without a NIC).
    NET_NAMESPACE = "net-namespace"


class RootfsForm(enum.StrEnum):
    """How a backend wants the sandbox's root filesystem (see the module docstring)."""

    COMPOSED = "composed"
    IMAGES = "images"


class AgentChannel(enum.StrEnum):
    """How the node reaches the agent through ``rt.agent_socket`` (see the module docstring)."""

    UNIX = "unix"
    FORWARDED = "forwarded"


@dataclass(frozen=True)
class LayerImage:
    """One read-only layer as files, for ``RootfsForm.IMAGES`` backends.

    ``image`` is the EROFS image; for a layer loaded on demand it is the metadata image and
    ``device`` the data blob (EROFS multi-device: mount with ``-o device=<blob>``), served
    chunk by chunk by the node. Both are read-only and stay in place while the sandbox lives.
    """

    ref: str
    digest: str
    image: Path
    device: Path | None = None


@dataclass(frozen=True)
class StartedSandbox:
    """The subject of enforcement point ``"started"``: a sandbox whose init runs and in which
    no command has run yet."""

    pid: int  # the init's host pid
    netns: Path  # its network namespace: /proc/<pid>/ns/net
    cgroup2: Path | None = None  # its cgroup v2 directory (cgroup BPF attaches here), if any


def _no_policies(target: str, subject: Any) -> None:
    pass


@dataclass(frozen=True)
class SandboxRuntime:
    """What the node prepared for one sandbox before asking a backend to start it."""

    id: str
    spec: SandboxSpec
    limits: Limits
    dir: Path  # the sandbox's runtime directory (tmpfs): bundle, sockets, state; 0711, root's
    data_dir: Path  # the sandbox's directory on local disk: its writable layer or disk
    agent_socket: Path  # where the node connects to the agent; UNIX: the backend binds it
    agent_binary: Path  # the static dsec-agent, to run as the sandbox's init at AGENT_PATH
    idmap: IdMap
    rootfs: Path | None = None  # COMPOSED: the mounted overlay (layers + writable upper)
    images: tuple[LayerImage, ...] = ()  # IMAGES: the layers, top first
    disk: Path | None = None  # IMAGES: the writable disk, a sparse unformatted file
    disk_size: int = 0  # IMAGES: its size in bytes
    #: ``enforce(target, subject)``: apply the sandbox's security policies that work through
    #: enforcement point ``target`` to ``subject`` (for "oci": the OCI config, in place).
    enforce: Callable[[str, Any], None] = field(default=_no_policies, compare=False, repr=False)


class Backend(abc.ABC):
    """Subclass, set ``name`` and what you need and give, and register the class from
    ``dsec_register_backends``. The node makes one instance per backend and node."""

    name: ClassVar[str]
    features: ClassVar[frozenset[Feature]] = frozenset()
    rootfs: ClassVar[RootfsForm] = RootfsForm.COMPOSED
    agent_channel: ClassVar[AgentChannel] = AgentChannel.UNIX
    policy_targets: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: NodeConfig) -> None:
        self.config = config

    @classmethod
    def shares_host_kernel(cls) -> bool:
        return Feature.SHARED_KERNEL in cls.features

    @classmethod
    def check_contract(cls) -> None:
        """Raise ``PluginInvalid`` if the class declares something the contract does not know
        (the registry calls this when the backend is registered)."""
        where = f"backend {getattr(cls, 'name', cls.__qualname__)!r} ({cls.__module__})"
        known = {f.value for f in Feature}
        unknown = sorted(str(f) for f in cls.features if str(getattr(f, "value", f)) not in known)
        if unknown:
            raise PluginInvalid(
                f"{where} claims unknown feature(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}",
                features=unknown,
            )
        if not isinstance(cls.rootfs, RootfsForm):
            raise PluginInvalid(f"{where}: rootfs must be a RootfsForm, not {cls.rootfs!r}")
        if not isinstance(cls.agent_channel, AgentChannel):
            raise PluginInvalid(
                f"{where}: agent_channel must be an AgentChannel, not {cls.agent_channel!r}"
            )

    @classmethod  # noqa: B027 - optional, most backends need nothing
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

    def usage(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> SandboxUsage:
        """What the sandbox uses now, best effort (None where unknown)."""
        return SandboxUsage()
