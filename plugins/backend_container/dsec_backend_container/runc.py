"""Container sandboxes under runc: user, pid, mount, net, ipc, uts and cgroup namespaces.

The node composes the root filesystem (``RootfsForm.COMPOSED``). ``runc run -d`` starts the
sandbox with the in-sandbox agent as its init, handed the listening socket this backend binds
at ``rt.agent_socket`` as fd 3 (``AgentChannel.UNIX``). Security policies enforce through the
agent (target ``"agent"``: the policy document as a sealed memfd at fd 4, the agent's answer on
a pipe at fd 5, read before ``start`` returns), the OCI config (``"oci"``) and once the
container runs (``"started"``: its init pid, network namespace and cgroup v2 directory, while
the agent applies its document, before ``start`` returns). A sandbox whose ``runtime`` (or the
node's, ``NodeConfig.runtime``) is ``runsc`` runs the same bundle under gVisor (``gvisor.py``
says what changes). Stopping does not go
through ``runc kill``/``runc delete`` (two more Go process start-ups and a polling loop,
~100 ms): killing the namespace's init with a pidfd makes the kernel kill every process in it,
then we remove the cgroups and runc's state ourselves. Its CPU class (``qos.py``) is applied to
the init once the agent has answered, before ``start`` returns. runc runs under
``dsec-runc-launch`` in a copy of a small mount namespace without the other sandboxes' mounts
(``launch.py``): its reads of the mount table and the namespace copies do not grow with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import resource
import shutil
import signal
import socket
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from dsec_core.backend import (
    AGENT_PATH,
    DRIVE_DIR,
    AgentChannel,
    AgentPolicy,
    Backend,
    Feature,
    MemoryWindowUse,
    RootfsForm,
    SandboxRuntime,
    StartedSandbox,
    cgroup_path,
    parse_status,
)
from dsec_core.config import NodeConfig, default_runtime
from dsec_core.errors import (
    BackendUnavailable,
    InvalidSpec,
    PolicyUnavailable,
    SandboxError,
    ToolError,
)
from dsec_core.linux import processes
from dsec_core.linux.cgroups import (
    cgroup2_root,
    close_memory_window,
    freeze,
    frozen,
    memory_cgroup_dir,
    oom_kills,
    open_memory_window,
    reclaim_memory,
    thaw,
)
from dsec_core.records import SandboxUsage

from . import gvisor
from .cpus import CpuPinning, format_cpus, host_cpus, pinning_enabled
from .launch import LaunchNamespace, SealedBinary, ensure_launcher
from .lxcfs import Lxcfs, find_lxcfs, lxcfs_enabled, lxcfs_mounts
from .qos import apply_qos, cpu_shares

__all__ = ["ContainerBackend", "device_rules", "oci_config", "oci_devices"]

# The OCI runtimes a sandbox may ask for (``SandboxSpec.runtime``), with how to install each.
# runc and crun run the same bundle the same way; crun starts in about a fifth of runc's CPU
# (C, one process, where runc starts Go twice).
RUNTIMES = {
    "runc": "apt-get install runc",
    "crun": "apt-get install crun",
    "runsc": "apt-get install runsc",
}
#: The runtime of sandboxes that name none, on a node that names none (DSEC_RUNTIME): the
#: first of these installed.
DEFAULT_RUNTIMES = ("crun", "runc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# crun (1.8) refuses hybrid cgroups while the v2 hierarchy lists any controller (this host
# binds hugetlb there, and no sandbox uses it); its launches see this file masked (launch.c).
HYBRID_CONTROLLERS = CGROUP_ROOT / "unified" / "cgroup.controllers"

# The OCI defaults, plus the kernel page-info files: DSec saw a recursive grep touching
# /proc/kpagecgroup crash a kernel.
MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
# Enough for root in the sandbox to own, chmod and run services; no raw sockets, no mknod,
# nothing that reaches outside the user namespace.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_SETPCAP",
]
CFS_PERIOD = 100_000
# Where the agent finds its policy document and answers (runc --preserve-fds: 3, 4, 5).
AGENT_FDS = {"listener": 3, "policy": 4, "status": 5}
# How long the agent may take to put its policy in force (a Landlock walk, a filter) and say so.
POLICY_ANSWER_TIMEOUT = 10.0
STATUS_MAX = 4096
# Kept in runc's launch namespace with the mounts they are on, whatever else goes (launch.py).
SYSTEM_DIRS = tuple(map(Path, ("/usr", "/lib", "/lib64", "/etc")))


def standard_runtime() -> str:
    """crun where it is installed, else runc (``DEFAULT_RUNTIMES``); ``find_runtime`` says what
    to install when neither is."""
    return next((r for r in DEFAULT_RUNTIMES if shutil.which(r)), DEFAULT_RUNTIMES[-1])


def find_runtime(name: str | None = None) -> str:
    """The path of OCI runtime ``name`` (``RUNTIMES``): ``InvalidSpec`` for one this backend
    does not know, ``BackendUnavailable`` naming the package if it is not installed. No
    name: the standard one (``standard_runtime``)."""
    name = name or standard_runtime()
    if name not in RUNTIMES:
        raise InvalidSpec(
            f"container backend: unknown runtime {name!r} (known: {', '.join(RUNTIMES)})",
            field="runtime",
        )
    path = shutil.which(name)
    if path is None:
        what = "gVisor's runsc" if name == "runsc" else name
        raise BackendUnavailable(
            f"container backend: runtime {name} asked for, but {what} is not installed "
            f"(install it: {RUNTIMES[name]})",
            missing=name,
        )
    return path


def agent_args(with_policy: bool) -> list[str]:
    """The agent's command line: the listener at fd 3, and the policy document and the answer
    pipe at fds 4 and 5 when there is a policy."""
    args = [AGENT_PATH, "--fd", str(AGENT_FDS["listener"])]
    if with_policy:
        args += ["--policy-fd", str(AGENT_FDS["policy"]), "--status-fd", str(AGENT_FDS["status"])]
    return args


def cgroup_readonly_paths(runtime: str) -> list[str]:
    """The sandbox's cgroup tree read-only: /sys/fs/cgroup, which runc makes read-only whole.
    crun (1.8, cgroup v1) binds it again recursively to make it read-only, and the hierarchies
    under it come out writable (their files are the host's, so writes failed on permissions
    only); each is made read-only after it. A path that is not there is skipped."""
    return ["/sys/fs/cgroup", *(_v1_hierarchies() if runtime == "crun" else ())]


@functools.cache
def _v1_hierarchies() -> tuple[str, ...]:
    """The sandbox-side paths of the host's cgroup v1 hierarchies (none on a v2 host)."""
    return tuple(
        f"/sys/fs/cgroup/{h.name}"
        for h in _HIERARCHIES
        if h.name != "unified" and os.path.ismount(h)
    )


@functools.cache
def crun_masks() -> tuple[Path, ...]:
    """What crun's launches see masked: ``HYBRID_CONTROLLERS`` on a hybrid host whose v2
    hierarchy lists controllers, else nothing."""
    try:
        return (HYBRID_CONTROLLERS,) if HYBRID_CONTROLLERS.read_text().strip() else ()
    except OSError:
        return ()


def oci_config(
    rt: SandboxRuntime,
    *,
    agent_policy: bool = False,
    lxcfs: Path | None = None,
    cpus: list[int] | None = None,
    runtime: str = "runc",
) -> dict[str, Any]:
    """The OCI runtime config of a sandbox (``agent_policy``: the agent gets a document;
    ``lxcfs``: the node's lxcfs mount point, whose files go over /proc's; ``cpus``: the cores
    it is pinned to; ``runtime``: the one that will run it, where they differ)."""
    lim = rt.limits
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DSEC_SANDBOX_ID": rt.id,
    }
    env.update(rt.spec.env)
    uids, gids = (
        [{"containerID": a, "hostID": b, "size": c} for a, b, c in lines]
        for lines in (rt.idmap.uid_lines(), rt.idmap.gid_lines())
    )
    caps = list(CAPABILITIES)
    # A user namespace cannot raise the hard limit above the daemon's own.
    nofile = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    rlimits = [
        {"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile},
        # No negative nice values and no way out of SCHED_IDLE for a best-effort sandbox,
        # whatever limit the daemon itself runs with (sched(7): RLIMIT_NICE).
        {"type": "RLIMIT_NICE", "hard": 0, "soft": 0},
    ]
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": agent_args(agent_policy),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": rlimits,
            "noNewPrivileges": True,
            "oomScoreAdj": 500,
        },
        "root": {"path": os.fspath(rt.rootfs or ""), "readonly": False},
        "hostname": "dsec-" + rt.id[:12],
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            {
                # the sandbox's own cgroups (a cgroup namespace's root), read-only
                "destination": "/sys/fs/cgroup",
                "type": "cgroup",
                "source": "cgroup",
                "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
            },
            {
                "destination": AGENT_PATH,
                "type": "bind",
                "source": os.fspath(rt.agent_binary),
                "options": ["bind", "ro", "nosuid", "nodev"],
            },
            *(lxcfs_mounts(lxcfs) if lxcfs is not None else ()),
            *(
                [
                    {
                        # the node's drive socket (a directory: a restarted daemon's shows through)
                        "destination": DRIVE_DIR,
                        "type": "bind",
                        "source": os.fspath(rt.drive_dir),
                        "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
                    }
                ]
                if rt.drive_dir is not None
                else []
            ),
        ],
        "linux": {
            "uidMappings": uids,
            "gidMappings": gids,
            "namespaces": [
                {"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user", "cgroup")
            ],
            "cgroupsPath": "/" + cgroup_path(rt.id),
            "resources": {
                "memory": {"limit": lim.memory},
                "cpu": {
                    "quota": max(1000, int(lim.cpu * CFS_PERIOD)),
                    "period": CFS_PERIOD,
                    "shares": cpu_shares(rt),
                },
                "pids": {"limit": lim.pids},
                # nothing but runc's defaults (null, zero, tty, ...) and the sandbox's own
                "devices": [{"allow": False, "access": "rwm"}, *device_rules(rt)],
            },
            "devices": oci_devices(rt),
            "maskedPaths": list(MASKED_PATHS),
            # runc mounts a tmpfs under the cgroup hierarchies at /sys/fs/cgroup on a v1 host
            # and leaves that writable whatever the mount's options say: read-only again here
            "readonlyPaths": [*READONLY_PATHS, *cgroup_readonly_paths(runtime)],
        },
    }
    if cpus:
        config["linux"]["resources"]["cpu"]["cpus"] = format_cpus(cpus)
    return config


def oci_devices(rt: SandboxRuntime) -> list[dict[str, Any]]:
    """The sandbox's devices (``rt.devices``) for the OCI ``linux.devices`` list.

    In a user namespace runc cannot mknod, so it bind-mounts the host node at ``path`` onto the
    same path in the container, and the ``uid``/``gid``/``fileMode`` here go unused: inside,
    the node keeps the host's mode, and its host owner (root, unmapped) shows as the overflow
    id (nobody). So a device reaches the sandbox at its host path, and root inside can open it
    when the host node's mode lets others (0666, as /dev/null and NVIDIA's nodes are)."""
    out = []
    for d in rt.devices:
        if d.path != d.host_path:
            raise BackendUnavailable(
                f"sandbox {rt.id}: device {d.host_path} cannot be put at {d.path}: runc "
                "bind-mounts a device at its host path in a user namespace",
                backend="container",
            )
        out.append(
            {
                "path": d.path,
                "type": d.type,
                "major": d.major,
                "minor": d.minor,
                "fileMode": 0o020000 | d.mode if d.type == "c" else 0o060000 | d.mode,
                "uid": d.uid,
                "gid": d.gid,
            }
        )
    return out


def device_rules(rt: SandboxRuntime) -> list[dict[str, Any]]:
    """Device cgroup rules letting the sandbox read and write its devices (runc's own rules
    for its default devices follow these)."""
    return [
        {"allow": True, "type": d.type, "major": d.major, "minor": d.minor, "access": "rw"}
        for d in rt.devices
    ]


class ContainerBackend(Backend):
    """Sandboxes as runc containers; root inside maps to an unprivileged host uid range."""

    name = "container"
    features = frozenset(
        {
            Feature.USERNS,
            Feature.CGROUPS,
            Feature.PID_NAMESPACE,
            Feature.NET_NAMESPACE,
            Feature.SHARED_KERNEL,
            Feature.MEMORY_WINDOW,
            Feature.DEVICES,
            Feature.PAUSE,
            Feature.DRIVE,
            Feature.PACK_DIFF,
        }
    )
    rootfs = RootfsForm.COMPOSED
    agent_channel = AgentChannel.UNIX
    policy_targets = frozenset({"agent", "oci", "started"})
    runtimes = frozenset(RUNTIMES)

    def __init__(self, config: NodeConfig) -> None:
        super().__init__(config)
        # a subclass without runtimes (FnCall) runs the standard one whatever the node's default
        self.default_runtime = (config.runtime if self.runtimes else None) or standard_runtime()
        self._paths: dict[str, str] = {}
        self._runtime_path(self.default_runtime)
        self.state_root = config.run_dir / "runc"
        # runsc's state, one --root per sandbox (removing it removes all of runsc's files)
        self.gvisor_root = config.run_dir / "runsc"
        for d in (self.state_root, self.gvisor_root):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)  # runc's init reaches its fifo through /proc, not here
        # Always there, to re-adopt and finally stop one a daemon with other settings started;
        # new sandboxes get its files only with DSEC_LXCFS on.
        self.lxcfs = Lxcfs.shared(config.home, config.run_dir)
        self.use_lxcfs = lxcfs_enabled()
        self.pinning = CpuPinning(host_cpus()) if pinning_enabled() else None
        # runc starts in a copy of a small namespace (launch.py), not of the node's, without
        # the mounts of every sandbox: those are all below these (the node's mount parents)
        self.launcher = ensure_launcher(config.bin_dir)
        self.launch_ns = LaunchNamespace(self.launcher)
        # runc and crun run from sealed copies of themselves (launch.py: SealedBinary)
        self.sealed: dict[str, SealedBinary] = {}
        self.sandbox_parents = (config.runtime_dir, config.sandbox_dir)
        # what the launch namespace keeps, but lxcfs's mount (which may change)
        self.launch_needs = [
            config.run_dir,  # the runtimes' state, bundles, the drive socket
            config.bin_dir,  # the agent
            *(Path(p) for p in map(shutil.which, ("runc", "crun")) if p),
            *SYSTEM_DIRS,  # their libraries
        ]
        # Sandboxes this instance knows: started here, or re-adopted through ``alive``.
        self._known: set[str] = set()

    def runtime_of(self, rt: SandboxRuntime) -> str:
        """The OCI runtime the sandbox runs under: its spec's, else the node's default."""
        return rt.spec.runtime or self.default_runtime

    def _runtime_path(self, name: str) -> str:
        if name not in self._paths:
            self._paths[name] = find_runtime(name)
        return self._paths[name]

    @classmethod
    def check_available(cls) -> None:
        find_runtime(default_runtime() if cls.runtimes else None)
        if lxcfs_enabled():
            find_lxcfs()
        if os.geteuid() != 0:
            raise BackendUnavailable("container backend needs root (mounts, cgroups, runc)")
        if not Path("/proc/self/ns/user").exists():
            raise BackendUnavailable("container backend needs user namespaces")

    # --- start ----------------------------------------------------------------------------
    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        policy = AgentPolicy()
        rt.enforce("agent", policy)
        document = None if policy.empty() else policy.encode()
        runtime = self.runtime_of(rt)
        path = self._runtime_path(runtime)
        if runtime == "runsc":
            gvisor.check_spec(rt)
        lxcfs = await self.lxcfs.ensure() if self.use_lxcfs else None
        cores = self.pinning.pick(rt.id, rt.limits.cpu) if self.pinning is not None else None
        try:
            if runtime == "runsc":
                return await self._start_gvisor(rt, path, document, lxcfs, cores)
            return await self._start(rt, runtime, policy, document, lxcfs, cores)
        except BaseException:
            self._forget(rt.id)
            raise

    async def _start(
        self,
        rt: SandboxRuntime,
        runtime: str,
        policy: AgentPolicy,
        document: bytes | None,
        lxcfs: Path | None,
        cores: list[int] | None,
    ) -> dict[str, Any]:
        config = oci_config(
            rt, agent_policy=document is not None, lxcfs=lxcfs, cpus=cores, runtime=runtime
        )
        rt.enforce("oci", config)
        bundle = rt.dir
        # 0600: the bundle directory admits the sandboxes' group on runc's way to rootfs/;
        # the config (the sandbox's environment) is root's alone
        fd = os.open(bundle / "config.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as f:
            json.dump(config, f)
        log = bundle / "runc.log"
        pid_file = bundle / "init.pid"
        with _AgentFds(rt.agent_socket, document) as fds:
            ns = self._launch_ns(config, lxcfs)
            if runtime not in self.sealed:
                self.sealed[runtime] = SealedBinary(Path(self._runtime_path(runtime)))
            sealed = self.sealed[runtime].fd()
            extra = [fd for fd in (ns, sealed) if fd is not None]
            argv = self._run_argv(
                rt, runtime, log, pid_file, len(fds.inherited), ns is not None, sealed is not None
            )
            exit_code = await _spawn_and_wait(argv, [*fds.inherited, *extra])
            fds.close_inherited()  # the agent holds them now; if it dies, connects fail at once
            if exit_code != 0:
                await self._cleanup(rt, None)
                raise ToolError(
                    f"sandbox {rt.id}: {runtime} could not start the container",
                    command=argv,
                    exit_code=exit_code,
                    stderr=_runc_errors(log),
                    sandbox_id=rt.id,
                )
            pid = int(pid_file.read_text().strip())
            start_time = processes.start_time(pid, zombie=True)
            state = {
                "runtime": runtime,
                "pid": pid,
                "start_time": start_time,
                "cpus": cores,
                "lxcfs": lxcfs is not None,
            }
            self._known.add(rt.id)
            if lxcfs is not None:
                self.lxcfs.add(rt.id, pid, start_time)
            started = StartedSandbox(
                pid=pid, netns=Path(f"/proc/{pid}/ns/net"), cgroup2=_cgroup2_dir(rt.id)
            )
            # The agent applies its document while policies enforce on the running container
            # (in a thread: they may run tools and must not stall the loop); no command runs
            # before both are done. Both finish before anything is undone.
            results = await asyncio.gather(
                fds.agent_answer(rt.id),
                asyncio.to_thread(rt.enforce, "started", started),
                return_exceptions=True,
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                await self.stop(rt, state)
                raise failed[0]
            try:  # the agent's threads are all there now; nothing has run in the sandbox yet
                state["qos"] = apply_qos(rt, pid)
            except BaseException:
                await self.stop(rt, state)
                raise
        return state

    async def _start_gvisor(
        self,
        rt: SandboxRuntime,
        runsc: str,
        document: bytes | None,
        lxcfs: Path | None,
        cores: list[int] | None,
    ) -> dict[str, Any]:
        """``_start`` under runsc: the agent binds its socket itself and reads its document on
        its stdin (``gvisor.GvisorChannel``); start returns once that socket is there."""
        config = oci_config(rt, agent_policy=document is not None, lxcfs=lxcfs, cpus=cores)
        gvisor.runsc_config(config, rt, document is not None)
        rt.enforce("oci", config)
        gvisor.check_oci(rt, config)
        fd = os.open(rt.dir / "config.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as f:
            json.dump(config, f)
        root = self.gvisor_root / rt.id
        root.mkdir(mode=0o700, exist_ok=True)
        state: dict[str, Any] = {"runtime": "runsc", "cpus": cores, "lxcfs": lxcfs is not None}
        try:  # whatever fails, nothing is left: no process, cgroup, runsc state or socket
            await self._run_gvisor(rt, runsc, root, config, document, state)
        except BaseException:
            await self.stop(rt, state)
            raise
        return state

    async def _run_gvisor(
        self,
        rt: SandboxRuntime,
        runsc: str,
        root: Path,
        config: dict[str, Any],
        document: bytes | None,
        state: dict[str, Any],
    ) -> None:
        log, pid_file = rt.dir / "runsc.log", rt.dir / "init.pid"
        with gvisor.GvisorChannel(rt, document) as channel:
            argv = gvisor.argv(
                runsc,
                root,
                log,
                pid_file,
                rt,
                gvisor.platform(),
                oci_seccomp=bool(config["linux"].get("seccomp")),
            )
            exit_code = await _spawn_and_wait(argv, [], stdin=channel.stdin)
            channel.close_inherited()
            if exit_code != 0:
                raise ToolError(
                    f"sandbox {rt.id}: runsc could not start the container under gVisor",
                    command=argv,
                    exit_code=exit_code,
                    stderr=_runc_errors(log),
                    sandbox_id=rt.id,
                )
            pid = int(pid_file.read_text().strip())
            state.update(
                pid=pid,
                start_time=processes.start_time(pid, zombie=True),
                gofer=gvisor.gofer_pid(root),
            )
            if state["gofer"] is not None:
                state["gofer_start_time"] = processes.start_time(state["gofer"], zombie=True)
            self._known.add(rt.id)
            if state["lxcfs"]:
                self.lxcfs.add(rt.id, pid, state["start_time"])
            started = StartedSandbox(
                pid=pid, netns=Path(f"/proc/{pid}/ns/net"), cgroup2=_cgroup2_dir(rt.id)
            )
            if document is not None:
                await _agent_answer(channel.answer_fd(), rt.id, gvisor=True)
            await _wait_for_socket(channel.socket_path, pid, rt.id)
            await asyncio.to_thread(rt.enforce, "started", started)
            state["qos"] = apply_qos(rt, pid)

    def _launch_ns(self, config: Mapping[str, Any], lxcfs: Path | None) -> int | None:
        """The launch namespace's descriptor if it shows everything ``config`` binds in as
        the node's namespace does, else None (this start copies the node's namespace)."""
        needed = [*self.launch_needs, *([lxcfs] if lxcfs else [])]
        key = (lxcfs, self.lxcfs.device) if lxcfs else None
        fd = self.launch_ns.fd(key, needed, self.sandbox_parents, crun_masks())
        sources = [
            m["source"]
            for m in config["mounts"]
            if m.get("type") == "bind" or {"bind", "rbind"} & set(m.get("options", ()))
        ]
        return fd if fd is not None and self.launch_ns.covers(sources) else None

    def _run_argv(
        self,
        rt: SandboxRuntime,
        runtime: str,
        log: Path,
        pid_file: Path,
        nfds: int,
        ns: bool = False,
        sealed: bool = False,
    ) -> list[str]:
        """``runc run -d`` under the launcher, in a mount namespace that keeps the sandbox's
        root filesystem and drops every other sandbox's mounts (the node binds both their
        parents onto themselves: ``RootFilesystems.bind_parents``); with ``ns``, a copy of
        the launch namespace, whose descriptor follows the ``nfds`` the agent gets; with
        ``sealed``, runc run from its sealed copy, whose descriptor comes next. crun runs the
        same way (``runtime``)."""
        hidden = [arg for d in self.sandbox_parents for arg in ("--hide", os.fspath(d))]
        masks = crun_masks() if runtime == "crun" else ()
        masked = [arg for f in masks for arg in ("--mask", os.fspath(f))]
        return [
            os.fspath(self.launcher),
            *(["--ns-fd", str(3 + nfds)] if ns else []),
            *(["--exec-fd", str(3 + nfds + ns)] if sealed else []),
            "--log",
            os.fspath(log),
            "--keep",
            os.fspath(rt.rootfs or ""),
            *hidden,
            *masked,
            "--",
            self._runtime_path(runtime),
            "--root",
            os.fspath(self.state_root),
            "--log",
            os.fspath(log),
            "--log-format",
            "json",
            "run",
            "-d",
            "--preserve-fds",
            str(nfds),
            "--pid-file",
            os.fspath(pid_file),
            "--bundle",
            os.fspath(rt.dir),
            rt.id,
        ]

    # --- liveness -------------------------------------------------------------------------
    async def alive(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        pid = state.get("pid")
        live = processes.still_running(pid, state.get("start_time"), zombie=True)
        if live and rt.id not in self._known:  # one a previous daemon started: adopt it
            self._known.add(rt.id)
            if self.pinning is not None and state.get("cpus"):
                self.pinning.add(rt.id, list(state["cpus"]), rt.limits.cpu)
            if state.get("lxcfs"):
                self.lxcfs.adopt_sandbox(rt.id, state["pid"], state.get("start_time"))
        return live

    def _forget(self, sandbox_id: str) -> None:
        self._known.discard(sandbox_id)
        if self.pinning is not None:
            self.pinning.release(sandbox_id)
        self.lxcfs.discard(sandbox_id)

    def exit_fd(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> int | None:
        pid = state.get("pid")
        if not isinstance(pid, int):
            return None
        # None when gone already (alive() says so) or its pid reused before the open
        return processes.open_pidfd(pid, state.get("start_time"), zombie=True)

    # --- stop -----------------------------------------------------------------------------
    async def pause(
        self, rt: SandboxRuntime, state: Mapping[str, Any], reclaim: bool = False
    ) -> None:
        """The sandbox's cgroup frozen (cgroup v2 ``cgroup.freeze`` where the host has that
        hierarchy, else the v1 freezer); ``reclaim``, then its memory cgroup's reclaimable
        memory taken back (``reclaim_memory``)."""
        try:
            await asyncio.to_thread(freeze, cgroup_path(rt.id))
        except (OSError, TimeoutError) as e:
            raise SandboxError(f"sandbox {rt.id}: cannot pause: {e}", sandbox_id=rt.id) from e
        if reclaim:
            d = memory_cgroup_dir(cgroup_path(rt.id))
            if d is not None:
                await asyncio.to_thread(reclaim_memory, d)

    async def resume(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        try:
            await asyncio.to_thread(thaw, cgroup_path(rt.id))
        except (OSError, TimeoutError) as e:
            raise SandboxError(f"sandbox {rt.id}: cannot resume: {e}", sandbox_id=rt.id) from e

    def paused(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        return frozen(cgroup_path(rt.id))

    async def stop(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        if frozen(cgroup_path(rt.id)):  # the v1 freezer holds even SIGKILL until thawed
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.to_thread(thaw, cgroup_path(rt.id))
        pid = state.get("pid")
        if pid and processes.still_running(pid, state.get("start_time"), zombie=True):
            await _kill_and_wait(pid)
        gofer = state.get("gofer")  # runsc's file server, outside the sandbox's cgroups
        if gofer and processes.still_running(gofer, state.get("gofer_start_time"), zombie=True):
            await _kill_and_wait(gofer)
        await self._cleanup(rt, state)
        self._forget(rt.id)

    async def close(self) -> None:
        """lxcfs stops with the node when no container of it is left (their runc state is
        gone); otherwise it keeps serving them and the next daemon re-adopts it."""
        left = any(any(d.iterdir()) for d in (self.state_root, self.gvisor_root) if d.is_dir())
        self.launch_ns.close()  # first: it holds a copy of lxcfs's mount
        for sealed in self.sealed.values():
            sealed.close()
        await self.lxcfs.close(stop=not left)

    async def _cleanup(self, rt: SandboxRuntime, state: Mapping[str, Any] | None) -> None:
        await _remove_cgroups(rt.id)
        shutil.rmtree(self.state_root / rt.id, ignore_errors=True)
        gvisor_root = self.gvisor_root / rt.id
        if gvisor_root.is_dir():  # a gofer a failed runsc run left (stop kills a known one)
            gofer = gvisor.gofer_pid(gvisor_root)
            if gofer is not None and (state is None or gofer != state.get("gofer")):
                await _kill_and_wait(gofer)
            shutil.rmtree(gvisor_root, ignore_errors=True)

    @contextlib.asynccontextmanager
    async def memory_window(
        self, rt: SandboxRuntime, state: Mapping[str, Any], extra: int
    ) -> AsyncIterator[MemoryWindowUse]:
        """The sandbox's memory cgroup's own limit, lowered for the window (see
        ``dsec_core.linux.cgroups.open_memory_window``)."""
        d = memory_cgroup_dir(cgroup_path(rt.id))
        if d is None:
            raise SandboxError(f"sandbox {rt.id}: no memory cgroup", sandbox_id=rt.id)
        try:
            w = open_memory_window(d, extra)
        except OSError as e:
            raise SandboxError(
                f"sandbox {rt.id}: cannot bound its memory: {e}", sandbox_id=rt.id
            ) from e
        use = MemoryWindowUse()
        try:
            yield use
        finally:
            try:
                close_memory_window(w)
            except OSError as e:  # the sandbox went away meanwhile
                raise SandboxError(
                    f"sandbox {rt.id}: cannot read or restore its memory limit: {e}",
                    sandbox_id=rt.id,
                ) from e
            use.peak, use.oom_kills = w.peak, w.oom_kills

    def usage(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> SandboxUsage:
        cg = cgroup_path(rt.id)
        cpu_ns = _read_int(CGROUP_ROOT / "cpuacct" / cg / "cpuacct.usage")
        return SandboxUsage(
            memory=_read_int(CGROUP_ROOT / "memory" / cg / "memory.usage_in_bytes"),
            cpu_seconds=None if cpu_ns is None else cpu_ns * 1e-9,
            pids=_read_int(CGROUP_ROOT / "pids" / cg / "pids.current"),
            oom_kills=oom_kills(cg),
        )


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _runc_errors(log: Path) -> str:
    lines = []
    try:
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                lines.append(line)
                continue
            if rec.get("level") in ("error", "fatal", "warning"):
                lines.append(rec.get("msg", line))
    except OSError:
        pass
    return "\n".join(lines[-10:])


class _AgentFds:
    """The descriptors the agent inherits, made before ``runc run`` and dropped after, on every
    path: the listening socket at ``rt.agent_socket`` (fd 3) and, with a policy document, a
    sealed memfd holding it (fd 4) and the write end of the pipe its answer comes back on
    (fd 5). ``inherited`` maps our descriptors to the numbers the agent gets."""

    def __init__(self, agent_socket: Path, document: bytes | None) -> None:
        self.agent_socket = agent_socket
        self.document = document
        self.inherited: list[int] = []
        self.answer_r = -1
        self._mine: list[int] = []

    def __enter__(self) -> _AgentFds:
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                if self.agent_socket.exists():
                    self.agent_socket.unlink()
                listener.bind(os.fspath(self.agent_socket))
                listener.listen(1024)
            except BaseException:
                listener.close()
                raise
            self._mine.append(listener.detach())
            if self.document is not None:
                self._mine.append(_sealed_memfd(self.document))
                self.answer_r, answer_w = os.pipe2(os.O_CLOEXEC)
                self._mine.append(answer_w)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.inherited = list(self._mine)
        return self

    def close_inherited(self) -> None:
        for fd in self._mine:
            os.close(fd)
        self._mine = []

    async def agent_answer(self, sandbox_id: str) -> None:
        """Wait for the agent's answer to its document; ``PolicyUnavailable`` with the agent's
        reason if it refused (it then exits without serving)."""
        if self.answer_r >= 0:
            await _agent_answer(self.answer_r, sandbox_id)

    def __exit__(self, *exc: object) -> None:
        self.close_inherited()
        if self.answer_r >= 0:
            os.close(self.answer_r)
            self.answer_r = -1


async def _agent_answer(fd: int, sandbox_id: str, gvisor: bool = False) -> None:
    """Read the agent's answer to its document on ``fd`` (its first line: under gVisor the
    sandbox process keeps the other end open); ``PolicyUnavailable`` with the agent's reason if
    it refused (it then exits without serving)."""
    try:
        answer = await asyncio.wait_for(_read_line(fd), POLICY_ANSWER_TIMEOUT)
    except TimeoutError:
        answer = b"error agent: no answer to its policy within %ds" % POLICY_ANSWER_TIMEOUT
    refused = parse_status(answer)
    if refused is not None:
        part, message = refused
        if gvisor and part == "landlock":
            message += " (gVisor implements no Landlock: use runtime runc for file rules)"
        raise PolicyUnavailable(
            f"sandbox {sandbox_id}: its agent could not enforce its policy ({part}): {message}",
            policy=part,
            sandbox_id=sandbox_id,
        )


async def _wait_for_socket(path: Path, pid: int, sandbox_id: str, timeout: float = 10.0) -> None:
    """Until the agent has bound its socket at ``path`` (gVisor: it binds it itself)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.001
    while not path.is_socket():
        if not Path(f"/proc/{pid}").exists():
            raise SandboxError(
                f"sandbox {sandbox_id}: gVisor's sandbox process exited before its agent listened",
                sandbox_id=sandbox_id,
            )
        if loop.time() > deadline:
            raise SandboxError(
                f"sandbox {sandbox_id}: its agent did not listen within {timeout:g}s",
                sandbox_id=sandbox_id,
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)


def _sealed_memfd(data: bytes) -> int:
    """A memfd holding ``data``, sealed against any change, its offset at the start."""
    fd = os.memfd_create("dsec-agent-policy", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def _read_line(fd: int) -> bytes:
    """What a pipe or socket carries up to its first newline or EOF, at most ``STATUS_MAX``
    bytes."""
    os.set_blocking(fd, False)
    out = bytearray()
    while b"\n" not in out and len(out) < STATUS_MAX:
        await processes.wait_readable(fd)
        try:
            chunk = os.read(fd, STATUS_MAX)
        except BlockingIOError:
            continue
        if not chunk:
            break
        out += chunk[: max(0, STATUS_MAX - len(out))]
    return bytes(out)


async def _spawn_and_wait(argv: list[str], fds: list[int], stdin: int | None = None) -> int:
    """posix_spawn ``argv`` with ``fds`` as its fds 3, 4, ... (and ``stdin`` as its fd 0, else
    /dev/null) and wait for it without a thread.

    posix_spawn (vfork underneath) is much cheaper than fork from a large daemon, and its
    file actions place the descriptors atomically, which subprocess cannot do.
    """
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    # copies out of the way of 3, 4, ... first: one of ours may sit where another must go
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in fds]
    if stdin is not None:
        high.append(fcntl.fcntl(stdin, fcntl.F_DUPFD_CLOEXEC, 64))
    try:
        actions = [(os.POSIX_SPAWN_DUP2, devnull, i) for i in range(3)]
        if stdin is not None:
            actions[0] = (os.POSIX_SPAWN_DUP2, high[-1], 0)
        actions += [(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(high[: len(fds)])]
        pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)
    finally:
        os.close(devnull)
        for fd in high:
            os.close(fd)
    return await processes.wait_child(pid)


async def _kill_and_wait(pid: int, timeout: float = 10.0) -> None:
    # The kernel kills every process of the pid namespace when its init dies, and the init's
    # exit is only reported once they are all gone.
    if not await processes.kill_and_wait(pid, timeout):
        raise SandboxError(f"init process {pid} did not die within {timeout}s", pid=pid)


def _cgroup2_dir(sandbox_id: str) -> Path | None:
    """The sandbox's cgroup v2 directory, if the host has that hierarchy (runc places the
    container there too on a hybrid host)."""
    root = cgroup2_root()
    d = root / cgroup_path(sandbox_id) if root is not None else None
    return d if d is not None and d.is_dir() else None


def _hierarchies() -> list[Path]:
    return [h for h in CGROUP_ROOT.iterdir() if not h.is_symlink()]


_HIERARCHIES = _hierarchies()


def _procs(d: Path) -> set[int]:
    try:
        return {int(p) for p in (d / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def _rmdir_cgroups(sandbox_id: str) -> list[Path]:
    """Remove the sandbox's cgroup in each hierarchy; those still busy."""
    busy = []
    for hier in _HIERARCHIES:
        d = hier / cgroup_path(sandbox_id)
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            busy.append(d)
    return busy


async def _remove_cgroups(sandbox_id: str) -> None:
    """Remove the sandbox's cgroups, killing anything still inside (a failed start can leave
    runc init there). The common case is one rmdir per hierarchy, made in a thread (each
    waits for the kernel to take the cgroup apart: a few ms in all, which the event loop
    spends serving others)."""
    busy = await asyncio.to_thread(_rmdir_cgroups, sandbox_id)
    for attempt in range(100):
        if not busy:
            return
        for d in busy:
            for pid in _procs(d):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        await asyncio.sleep(0.002 * min(attempt + 1, 10))  # EBUSY while the last task exits
        still = []
        for d in busy:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                still.append(d)
        busy = still
    raise SandboxError(
        f"sandbox {sandbox_id}: cannot remove cgroups {busy}",
        sandbox_id=sandbox_id,
        cgroups=[os.fspath(d) for d in busy],
    )
