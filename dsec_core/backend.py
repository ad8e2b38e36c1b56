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
    ``"agent"`` (below), ``"oci"`` and calls ``rt.enforce("oci", config)`` with the OCI runtime
    config before starting the container, and ``"started"`` with a ``StartedSandbox`` (the
    init's pid, its network namespace and cgroup v2 directory) once the container runs, before
    ``start`` returns and so before any command runs in it; if that raises, the backend stops
    the sandbox and ``start`` raises. A policy a sandbox asks for must work through the
    backend's targets, or the create fails (``SecurityPolicy.enforceable_on``); one that works
    through several picks among those the sandbox's backend offers (``rt.targets``). Empty:
    sandboxes of this backend cannot ask for policies.

``"agent"``: the agent policy document
    Policies only the agent can enforce (it is the sandbox's PID 1 and starts every process in
    it) reach it through a document it reads at start, before it serves. The backend makes an
    ``AgentPolicy``, calls ``rt.enforce("agent", policy)`` (policies add their parts), and, if
    the policy is not ``empty()``, hands ``policy.encode()`` to the agent without putting a file
    in the sandbox, with a way back for the agent's answer: the container backend passes a
    sealed memfd holding the document as fd 4 and the write end of a pipe as fd 5 (runc
    ``--preserve-fds 3``; agent arguments ``--fd 3 --policy-fd 4 --status-fd 5``); a VM backend
    would send the same bytes over its own channel (``--policy-fd`` and ``--status-fd`` may name
    one socket: the agent reads the document to its end, so the sender half-closes). The agent
    answers one line, ``ok`` once everything is in force, or ``error <part>: <message>``
    (``parse_status``), and after an error exits without serving;
    the backend waits for the answer before ``start`` returns, and on an error stops the
    sandbox and raises ``PolicyUnavailable`` with the message. With an empty policy the backend
    passes nothing and the agent serves at once, as without policies. The document (version 1;
    ``dsec_core/agent/src/policy.c`` is the agent's side)::

        document = b"DSECPOL1", then fields up to the end (at most 4 MiB)
        field    = u8 klen, key, u32le vlen, value      (keys may repeat; values any bytes)
        seccomp             a classic BPF program, struct sock_filter[] in the machine's byte
                            order (1-4096 instructions), installed with TSYNC on the agent
                            before it serves, so every process in the sandbox is under it
        landlock.read_only  an absolute path: no writes beneath it, for every process the
                            agent starts (repeatable)
        landlock.hidden     an absolute path: nothing beneath it, reads included (repeatable)
        landlock.scope      "signal" or "abstract_unix": no signals to / abstract unix
                            sockets of processes outside the sandbox's Landlock domain

    Keys the agent does not know are refused, so a policy is never silently dropped by an
    older agent. The agent's own file operations (``read_file``, ``write_file``, ...) are not
    under the Landlock rules: the node reads and writes what commands cannot.

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
- ``close`` (optional) runs when the node closes, after it killed what it meant to kill: free
  what the backend holds node-wide that no sandbox still running needs. Sandboxes may outlive
  the daemon; what they need keeps working, and the next daemon's instance takes it over
  (the container backend's lxcfs: stopped when no container is left, else left running).
- With ``PAUSE``, ``pause`` returns once no process of the sandbox runs, ``resume`` lets them
  go on where they stopped, and ``stop`` kills a paused sandbox as a running one.
- A backend with a kernel of its own (no ``SHARED_KERNEL``: VMs) boots ``rt.kernel`` when
  it is set: a Debian kernel package, ``"package"`` or ``"package=version"``
  (``split_kernel``), which the node takes from the sandbox's catalog environment
  (``Environment.kernel``); None: the backend's default. A backend that shares the host's
  kernel never gets one.
- With ``SCREEN``, ``screenshot`` returns a PNG of the display and ``input`` delivers typed
  events (``dsec_core.screen_input``) to it; the node calls neither on a paused sandbox.
- With ``MEMORY_WINDOW``, ``memory_window(rt, state, extra)`` bounds what runs in the sandbox
  during an ``async with`` to ``extra`` bytes above its use at the start, and reports the peak
  and the OOM kills of that while (the node's judge runs each test case in one).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .config import NodeConfig
from .errors import BackendUnavailable, FeatureUnavailable, PluginInvalid
from .records import IdMap, Limits, SandboxSpec, SandboxUsage
from .screen_input import InputEvent

__all__ = [
    "AGENT_PATH",
    "AGENT_SCOPES",
    "CGROUP_PARENT",
    "DRIVE_DIR",
    "AgentChannel",
    "AgentPolicy",
    "Backend",
    "DeviceNode",
    "Feature",
    "IdMap",
    "LayerImage",
    "MemoryWindowUse",
    "RootfsForm",
    "SandboxRuntime",
    "StartedSandbox",
    "cgroup_path",
    "parse_status",
    "split_kernel",
]

#: Where the agent binary is inside every sandbox.
AGENT_PATH = "/.dsec/agent"
#: Where a sandbox that drives others (``SandboxSpec.drives``) finds the node's drive socket
#: directory (``Feature.DRIVE``): the socket is ``drive.sock`` in it.
DRIVE_DIR = "/.dsec/drive"
#: Parent of every sandbox's cgroup in each hierarchy: ``<hierarchy>/dsec/<sandbox id>``.
CGROUP_PARENT = "dsec"


def split_kernel(kernel: str) -> tuple[str, str | None]:
    """``SandboxRuntime.kernel`` as (Debian package, version or None: apt's candidate):
    ``"linux-image-cloud-amd64=6.1.192-3"`` is ``("linux-image-cloud-amd64", "6.1.192-3")``."""
    package, _, version = kernel.partition("=")
    return package, version or None


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
    #: ``reset`` returns a running sandbox to the state it started in (every process but the
    #: agent killed, every writable place back to pristine), so the node may reuse it for
    #: another caller's work: the node's FnCall pools take members only from such backends.
    RESET = "reset"
    #: ``memory_window`` gives what runs in the sandbox for a while a memory limit of its own
    #: (so much above what the sandbox uses when it starts) and reports the peak and whether
    #: the OOM killer struck: the node's judge gives each test case its memory limit so.
    MEMORY_WINDOW = "memory-window"
    #: Passes host device nodes in (``SandboxRuntime.devices``): each at its path inside,
    #: usable there (the device cgroup allows it), and no device the sandbox was not given.
    #: Without it the node refuses specs that ask for devices.
    DEVICES = "devices"
    #: ``pause`` stops every process of the sandbox where it is (nothing runs, nothing is lost:
    #: memory, open files, sockets and sessions stay) and ``resume`` lets them go on; a paused
    #: sandbox can still be killed. The node counts no CPU for it while it is paused.
    PAUSE = "pause"
    #: Passes ``SandboxRuntime.drive_dir`` (a host directory holding the node's drive socket)
    #: in at ``DRIVE_DIR``, so a loop in the sandbox can drive the workers its spec names; the
    #: node tells its connections apart by peer uid, so processes in the sandbox must run as
    #: uids of its ``idmap`` as seen from the host. Without it the node refuses ``drives``.
    DRIVE = "drive"
    #: ``save`` writes the running sandbox's memory, device state and writable disk, all of
    #: one instant, to a directory (the sandbox runs on), and ``start_from`` starts a new
    #: sandbox of the same spec from such a directory, going on from that instant with its
    #: own copy of the disk: the node's memory snapshots and their restore (VM forks).
    MEMORY_SNAPSHOT = "memory-snapshot"
    #: ``pack_diff`` packs the sandbox's writable layer into a snapshot layer: the overlay
    #: upper on the host (``SandboxRuntime.rootfs``), or, for a sandbox whose writable layer
    #: is a disk (``SandboxRuntime.disk``: the ``upper`` directory of the ext4 on it), that
    #: disk while ``freeze_disk`` holds the guest's filesystem still. The node packs a
    #: ``COMPOSED`` backend's upper (frozen through its cgroup) whether it claims this or not;
    #: the conformance kit checks it for those that claim it.
    PACK_DIFF = "pack-diff"
    #: The sandbox gives memory back: what its guest frees returns to the host (a balloon's
    #: free page reporting), and ``give_back`` asks it for memory it has not touched lately
    #: (the node's reclaim, ``dsec_core.node.reclaim``).
    BALLOON = "balloon"
    #: The sandbox has a display: ``screenshot`` returns it as a PNG image and ``input`` sends
    #: it key presses, pointer moves and clicks (``dsec_core.screen_input``). Without it the node
    #: refuses both.
    SCREEN = "screen"


@dataclass
class MemoryWindowUse:
    """What ``Backend.memory_window`` measured, filled in when the window closes: the peak
    memory above what the sandbox used when it opened (bytes), and how many processes the
    OOM killer took meanwhile."""

    peak: int = 0
    oom_kills: int = 0


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

    pid: int  # the init's host pid (a VM's: its emulator's)
    netns: Path  # its network namespace: /proc/<pid>/ns/net, or the file holding it
    cgroup2: Path | None = None  # its cgroup v2 directory (cgroup BPF attaches here), if any
    #: The sandbox's processes run in a guest kernel (a VM) behind a network card in
    #: ``netns``: socket hooks on ``cgroup2`` see none of their traffic, which a policy must
    #: check as packets. What a policy sets up on ``eth0`` there (its addresses and routes)
    #: the backend moves into the guest afterwards: the guest's card takes ``eth0``'s place.
    guest: bool = False


#: What ``AgentPolicy.scope`` may name (the agent's ``landlock.scope`` values).
AGENT_SCOPES = ("abstract_unix", "signal")
POLICY_MAGIC = b"DSECPOL1"
MAX_POLICY_BYTES = 4 << 20
BPF_INSN_BYTES = 8
MAX_BPF_INSNS = 4096


@dataclass
class AgentPolicy:
    """The subject of enforcement point ``"agent"``: what the sandbox's agent enforces at start
    (the module docstring has the document). Policies add their parts in ``apply``."""

    #: A classic BPF seccomp program (struct sock_filter[], native byte order); b"" for none.
    seccomp: bytes = b""
    #: Landlock: absolute paths beneath which nothing may be written.
    read_only: list[str] = field(default_factory=list)
    #: Landlock: absolute paths beneath which nothing at all is allowed, reads included.
    hidden: list[str] = field(default_factory=list)
    #: Landlock scopes (``AGENT_SCOPES``).
    scope: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.seccomp or self.read_only or self.hidden or self.scope)

    def encode(self) -> bytes:
        """The document's bytes. ``ValueError`` for parts the agent would refuse (a policy
        plugin's bug, not bad user input: ``FileRules`` checks settings first)."""
        n = len(self.seccomp) // BPF_INSN_BYTES
        if len(self.seccomp) % BPF_INSN_BYTES or n > MAX_BPF_INSNS:
            raise ValueError(f"seccomp: not a BPF program of at most {MAX_BPF_INSNS} instructions")
        fields: list[tuple[str, bytes]] = [("seccomp", self.seccomp)] if self.seccomp else []
        for key, paths in (
            ("landlock.read_only", self.read_only),
            ("landlock.hidden", self.hidden),
        ):
            for path in paths:
                if not path.startswith("/") or "\0" in path:
                    raise ValueError(f"{key}: {path!r} is not an absolute path")
                fields.append((key, path.encode()))
        for name in self.scope:
            if name not in AGENT_SCOPES:
                raise ValueError(f"landlock.scope: unknown scope {name!r}")
            fields.append(("landlock.scope", name.encode()))
        out = bytearray(POLICY_MAGIC)
        for key, value in fields:
            out += bytes([len(key)]) + key.encode() + len(value).to_bytes(4, "little") + value
        if len(out) > MAX_POLICY_BYTES:
            raise ValueError(f"the agent policy is over {MAX_POLICY_BYTES} bytes")
        return bytes(out)


def parse_status(answer: bytes) -> tuple[str, str] | None:
    """The agent's answer to its policy document: None for ``ok``, else ``(part, message)``
    (part: ``document``, ``landlock``, ``seccomp`` or ``agent``; ``agent`` also when it said
    nothing, having died before answering)."""
    line = answer.decode("utf-8", "replace").strip()
    if line == "ok":
        return None
    if not line:
        return "agent", "the agent exited before confirming its policy"
    head, _, message = line.removeprefix("error ").partition(": ")
    if not line.startswith("error ") or not message:
        return "agent", f"the agent answered {line[:200]!r}"
    return head, message


@dataclass(frozen=True)
class DeviceNode:
    """A host device node a sandbox holds (``Feature.DEVICES``): at ``host_path`` on the
    host, at ``path`` inside (the same by default), char ("c") or block ("b") device
    ``major``:``minor``, with file mode ``mode`` and owner ``uid``:``gid`` as seen inside
    (root's: the sandbox's root maps to its host uid range)."""

    kind: str
    host_path: str
    path: str
    type: str  # "c" | "b"
    major: int
    minor: int
    mode: int = 0o666
    uid: int = 0
    gid: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceNode:
        return cls(**data)


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
    #: The enforcement points the sandbox's backend offers (its ``policy_targets``): a policy
    #: that works through several enforces through the one it prefers among these.
    targets: frozenset[str] = frozenset()
    #: ``Feature.DEVICES``: the device nodes the node assigned it, to pass in.
    devices: tuple[DeviceNode, ...] = ()
    #: ``Feature.DRIVE``: the directory of the node's drive socket, to pass in at
    #: ``DRIVE_DIR`` (None: the sandbox drives nothing).
    drive_dir: Path | None = None
    #: What a VM backend boots: a Debian kernel package, optionally pinned, as
    #: ``"package=version"`` (``split_kernel``), e.g. ``"linux-image-cloud-amd64=6.1.192-3"``;
    #: the node sets it from the sandbox's environment (``Environment.kernel``). None: the
    #: backend's default. Backends that share the host's kernel never get one.
    kernel: str | None = None


class Backend(abc.ABC):
    """Subclass, set ``name`` and what you need and give, and register the class from
    ``dsec_register_backends``. The node makes one instance per backend and node."""

    name: ClassVar[str]
    features: ClassVar[frozenset[Feature]] = frozenset()
    rootfs: ClassVar[RootfsForm] = RootfsForm.COMPOSED
    agent_channel: ClassVar[AgentChannel] = AgentChannel.UNIX
    policy_targets: ClassVar[frozenset[str]] = frozenset()
    #: The runtimes a sandbox may name in ``SandboxSpec.runtime`` (the container backend's OCI
    #: runtimes: runc, runsc); the node refuses any other (``InvalidSpec``). A backend puts the
    #: one a sandbox runs under in its state as ``"runtime"`` (``SandboxInfo.runtime``).
    runtimes: ClassVar[frozenset[str]] = frozenset()
    #: Bytes of host memory a sandbox of this backend may take beyond its ``memory`` limit
    #: (a VM's emulator): the node counts them as committed, and against the sandbox's
    #: project's quota, with the limit.
    memory_overhead: ClassVar[int] = 0

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

    def death_cause(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> tuple[str, str] | None:
        """Why a sandbox that stopped on its own did, asked once the node noticed and before
        ``stop``: ``(kind, text)``, kind "guest_panic" or "crashed" (a VM's console's last
        words, a runtime's log), or None (the default: nothing to say beyond its death)."""
        return None

    def exit_fd(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> int | None:
        """A descriptor that turns readable once the sandbox has stopped on its own (a pidfd of
        its init, say), for the node to watch instead of asking ``alive`` every second: a node
        of thousands of sandboxes then spends nothing on the ones that keep running. The node
        owns and closes it. None (the default): the node polls ``alive``."""
        return None

    @abc.abstractmethod
    async def stop(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        """Kill every process of the sandbox and free what ``start`` took. Idempotent."""

    def usage(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> SandboxUsage:
        """What the sandbox uses now, best effort (None where unknown)."""
        return SandboxUsage()

    async def close(self) -> None:  # noqa: B027 - optional, most backends hold nothing
        """The node is closing: free what the backend holds node-wide (a helper daemon) that
        no sandbox still running needs. Sandboxes may outlive this (a daemon restart); what
        they need must keep working, for the next daemon's instance to take over."""

    @contextlib.asynccontextmanager
    async def memory_window(
        self, rt: SandboxRuntime, state: Mapping[str, Any], extra: int
    ) -> AsyncIterator[MemoryWindowUse]:
        """With ``Feature.MEMORY_WINDOW``: for the body of the ``async with``, the sandbox may
        use at most ``extra`` bytes more than it does when the window opens (never more than
        its own limit); a process that asks for more is killed as at the sandbox's limit. The
        yielded ``MemoryWindowUse`` is filled in at the close, and the sandbox's limit is back.
        The node opens one window at a time per sandbox, around one command."""
        raise BackendUnavailable(
            f"backend {self.name!r} cannot bound memory per command "
            "(it does not claim Feature.MEMORY_WINDOW)",
            backend=self.name,
        )
        yield MemoryWindowUse()  # pragma: no cover - makes this a generator

    async def pause(
        self, rt: SandboxRuntime, state: Mapping[str, Any], reclaim: bool = False
    ) -> None:
        """With ``Feature.PAUSE``: stop every process of the running sandbox where it is and
        return once none runs (idempotent); raise a ``DsecError`` if it cannot, leaving the
        sandbox running. ``reclaim``: then give back what of its memory the host can take
        without harm to it (best effort)."""
        raise BackendUnavailable(
            f"backend {self.name!r} cannot pause a sandbox (it does not claim Feature.PAUSE)",
            backend=self.name,
        )

    async def resume(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        """With ``Feature.PAUSE``: let a paused sandbox's processes run on (a no-op if it is
        not paused)."""
        raise BackendUnavailable(
            f"backend {self.name!r} cannot resume a sandbox (it does not claim Feature.PAUSE)",
            backend=self.name,
        )

    def paused(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        """With ``Feature.PAUSE``: whether the sandbox is paused now (what a restarted node
        believes over its records)."""
        return False

    async def save(self, rt: SandboxRuntime, state: Mapping[str, Any], to: Path) -> None:
        """With ``Feature.MEMORY_SNAPSHOT``: save the running sandbox, memory, devices and
        writable disk of one instant, into the new directory ``to`` (made by the backend,
        absent on failure); the sandbox goes on running."""
        raise BackendUnavailable(
            f"backend {self.name!r} cannot save a sandbox's memory "
            "(it does not claim Feature.MEMORY_SNAPSHOT)",
            backend=self.name,
        )

    async def give_back(self, rt: SandboxRuntime, state: Mapping[str, Any], floor: int) -> int:
        """With ``Feature.BALLOON``: have the sandbox give the host back the memory it has not
        touched since the last call (never leaving it less than ``floor`` bytes); returns the
        bytes it gave (best effort; 0 when there is nothing cold)."""
        raise FeatureUnavailable(
            f"backend {self.name!r} cannot give memory back (it does not claim Feature.BALLOON)",
            backend=self.name,
            feature=Feature.BALLOON.value,
        )

    async def freeze_disk(
        self, rt: SandboxRuntime, state: Mapping[str, Any], on: bool, seconds: float
    ) -> None:
        """With ``Feature.PACK_DIFF`` and a disk (``rt.disk``): freeze (``on``) the filesystem
        on the sandbox's disk from inside (its data written out, its writes held, for at most
        ``seconds`` should nobody thaw it), or thaw it, so the node reads a consistent
        disk."""
        raise FeatureUnavailable(
            f"backend {self.name!r} cannot freeze a sandbox's disk "
            "(it does not claim Feature.PACK_DIFF with a disk)",
            backend=self.name,
            feature=Feature.PACK_DIFF.value,
        )

    async def start_from(self, rt: SandboxRuntime, saved: Path) -> dict[str, Any]:
        """With ``Feature.MEMORY_SNAPSHOT``: ``start``, but from what ``save`` wrote to
        ``saved`` (the spec's limits are the saved sandbox's); the same contract otherwise."""
        raise BackendUnavailable(
            f"backend {self.name!r} cannot start from a saved sandbox "
            "(it does not claim Feature.MEMORY_SNAPSHOT)",
            backend=self.name,
        )

    async def screenshot(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bytes:
        """With ``Feature.SCREEN``: the sandbox's display now, as PNG bytes."""
        raise FeatureUnavailable(
            f"backend {self.name!r} has no screen (it does not claim Feature.SCREEN)",
            backend=self.name,
            feature=Feature.SCREEN.value,
        )

    async def input(
        self, rt: SandboxRuntime, state: Mapping[str, Any], events: list[InputEvent]
    ) -> None:
        """With ``Feature.SCREEN``: deliver ``events`` (checked records) in order, each whole
        (a click's press and release both) before the next. A point off the screen or a key
        the display does not know is an ``InvalidSpec``; events before it were delivered."""
        raise FeatureUnavailable(
            f"backend {self.name!r} has no screen to send input to "
            "(it does not claim Feature.SCREEN)",
            backend=self.name,
            feature=Feature.SCREEN.value,
        )

    async def reset(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        """With ``Feature.RESET``: make the running sandbox as it was when ``start`` returned,
        with nothing of the work done in it since left to see: kill every process but the
        agent, return every writable place to pristine, drop kernel objects that outlive
        processes (SysV IPC, POSIX message queues). The node calls it between two callers'
        work and never while a command runs; raise a ``DsecError`` if the sandbox cannot be
        made clean (the node then kills it instead of reusing it)."""
        raise BackendUnavailable(
            f"backend {self.name!r} cannot reset a sandbox (it does not claim Feature.RESET)",
            backend=self.name,
        )
