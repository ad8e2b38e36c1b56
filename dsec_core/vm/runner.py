"""``QemuBackend``: what a VM backend plugin subclasses. One sandbox is one QEMU process booting
a Debian kernel and an initramfs whose init (``init.sh``) mounts the sandbox's layers and hands
the root to ``dsec-agent``; the node reaches the agent through a forwarder process on the host
(``dsec-agent forward``), over one virtio-serial port (``AgentChannel.FORWARDED``).

Per sandbox, on the host: QEMU and the forwarder (each in a session of its own, so both outlive
a daemon restart), both in the cgroups ``dsec/<id>`` (memory: the guest's RAM plus QEMU's own
overhead; pids; cpu: the sandbox's cores), and in the sandbox's runtime directory QEMU's QMP
socket, its log and the guest's console. The writable disk (``rt.disk``) gets an ext4 made by
the host. Stopping kills both processes and removes the cgroups; the node removes the
directories.

Subclasses set ``machine`` (and ``display``, ``vnc_display``); ``layers_over`` says how the
layers reach the guest: ``"pmem"`` (virtio-pmem, mounted with DAX: guests share the host's
page cache of each layer; needs a q35 machine here, see ``qemu``) or ``"blk"`` (read-only
virtio-blk, each guest caching what it reads). A layer the node loads on demand comes either
way as two read-only virtio-blk disks, its metadata image and its data blob (the node's FUSE
file, through the host's page cache), mounted as one multi-device EROFS: a guest fetches only
the chunks it reads, as a container does, rather than having the whole layer unpacked first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from ..agent.rpc import AgentClient
from ..backend import (
    AgentChannel,
    Backend,
    Feature,
    LayerImage,
    RootfsForm,
    SandboxRuntime,
    StartedSandbox,
    cgroup_path,
    split_kernel,
)
from ..config import NodeConfig
from ..errors import (
    BackendUnavailable,
    DsecError,
    GuestPanic,
    InvalidSpec,
    SandboxError,
    StartTimeout,
)
from ..linux.cgroups import (
    cgroup2_root,
    kill_members,
    place_process,
    place_process_cpu,
    place_process_v2,
    remove_cgroups,
)
from ..linux.ext4 import mkfs_ext4
from ..linux.files import copy_sparse
from ..linux.processes import (
    kill_and_wait,
    open_pidfd,
    proc_stat,
    start_time,
    still_running,
    wait_readable,
)
from ..records import SandboxUsage
from . import guestnet, qemu
from .coldmem import ColdProbe, GuestLoad, Settled
from .guest import DEFAULT_KERNEL_PACKAGE, GuestKernel, build_initramfs, ensure_kernel
from .images import pmem_image
from .migstream import RAM_BLOCKS, SplitStats, StreamFormatError, split_stream
from .qmp import QMP_SOCKET, Qmp
from .vmlinux import ensure_vmlinux

__all__ = ["GUEST_MODULES", "INIT_SCRIPT", "QemuBackend", "vm_cache_dir"]

log = logging.getLogger(__name__)

INIT_SCRIPT = Path(__file__).with_name("init.sh")
#: What every guest loads (with their dependencies), in this order.
GUEST_MODULES = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_console",
    "virtio_blk",
    "virtio_pmem",
    "nd_pmem",
    "virtio_balloon",  # free page reporting: what the guest frees goes back to the host
    "virtio_net",  # the network card of a sandbox whose network mode is not "none"
    "erofs",
    "overlay",
    "ext4",  # the writable disk's (built into the cloud kernel, a module in the generic one)
)
#: Kernel command line: a quiet boot without probing what a dsec guest never has.
CMDLINE = (
    "console=ttyS0 quiet panic=-1 i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd "
    "tsc=reliable no_timer_check cryptomgr.notests random.trust_cpu=on "
    "rcupdate.rcu_expedited=1 mitigations=off"
)
#: QEMU's own memory beyond the guest's RAM (TCG's translation cache, device state).
QEMU_OVERHEAD = 256 << 20
#: Seconds a guest may take to boot when the spec sets no start_timeout (TCG is slow).
BOOT_TIMEOUT = 120.0
#: Where a paused VM's device state and its RAM go, in its data directory (on disk).
SAVED_STATE, SAVED_RAM = "vm.state", "vm.ram"
#: Seconds a VM's state may take to save or load (QEMU streams it through ``cat``).
MIGRATE_TIMEOUT = 120.0
#: A start template's files (``<cache>/templates/<key>/``), and a memory snapshot's.
TEMPLATE_STATE, TEMPLATE_RAM, TEMPLATE_DISK, TEMPLATE_READY, TEMPLATE_DEVICES = (
    "vm.state",
    "vm.ram",
    "disk.raw",
    "ready",
    "devices.json",
)
#: How a template is saved (its RAM apart since 2; 3: the balloon deflates on OOM): part of
#: its key, so a node saves its templates again rather than loading an older form.
TEMPLATE_FORMAT = 3
#: The FIFO a save streams through, in the sandbox's runtime directory.
SAVE_FIFO = "save.fifo"
#: Seconds one connection waits for the booting guest's agent before another is tried.
PING_PATIENCE = 10.0
#: Cold guest memory below this is left alone (a give_back is a balloon round trip).
GIVE_BACK_MIN = 32 << 20
#: A guest that worked more than this share of a core since the last pass is not asked (by
#: its own /proc/stat: the host's figures mislead on a loaded host, ``coldmem``).
GIVE_BACK_BUSY = 0.2
#: A guest that could not give half of what it was asked is left alone for this many passes
#: unless it grows meanwhile (``coldmem.Settled``).
GIVE_BACK_RETRY = 3
#: Lines of the guest's console kept in an error.
CONSOLE_TAIL = 60


def vm_cache_dir() -> Path:
    """``DSEC_VM_CACHE``: where VM backends keep what a guest boots (kernels, initramfs,
    unpacked kernels), layers unpacked for virtio-pmem and start templates. All of it is named
    by its content (a template by the content of its kernel, initramfs and layers), so it is
    the machine's, shared by every node home: a fresh node neither fetches a kernel nor boots
    a VM that another node of the machine already booted. Default ``/var/cache/dsec/vm`` for
    root, ``$XDG_CACHE_HOME/dsec/vm`` otherwise."""
    value = os.environ.get("DSEC_VM_CACHE", "")
    if value:
        return Path(value)
    if os.geteuid() == 0:
        return Path("/var/cache/dsec/vm")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsec" / "vm"


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def console_tail(path: Path, lines: int = CONSOLE_TAIL) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class QemuBackend(Backend):
    """A VM backend: subclass, set ``name``, ``machine`` and what you claim."""

    rootfs = RootfsForm.IMAGES
    agent_channel = AgentChannel.FORWARDED
    features: ClassVar[frozenset[Feature]] = frozenset(
        {
            Feature.PID_NAMESPACE,
            Feature.NET_NAMESPACE,
            Feature.PAUSE,
            Feature.MEMORY_SNAPSHOT,
            Feature.PACK_DIFF,
            Feature.BALLOON,
        }
    )
    #: ``"started"``: a VM with a network card, its namespace set up before anything runs
    #: (``StartedSandbox.guest``; ``guestnet``)
    policy_targets: ClassVar[frozenset[str]] = frozenset({"started"})
    machine: ClassVar[str] = "microvm"
    display: ClassVar[bool] = False
    memory_overhead: ClassVar[int] = QEMU_OVERHEAD  # QEMU's cgroup holds RAM plus this
    #: The Debian kernel package guests boot unless DSEC_VM_KERNEL names another.
    kernel_package: ClassVar[str] = DEFAULT_KERNEL_PACKAGE
    #: Modules guests load beyond ``GUEST_MODULES`` (a display's drivers, say).
    extra_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: NodeConfig) -> None:
        super().__init__(config)
        self.qemu = qemu.find_qemu()
        self.accel = qemu.accelerator()
        self.cache = vm_cache_dir()
        self.kernel = os.environ.get("DSEC_VM_KERNEL") or self.kernel_package
        self.kernel_version = os.environ.get("DSEC_VM_KERNEL_VERSION") or None
        self.layers_over = os.environ.get("DSEC_VM_LAYERS", "pmem")
        if self.layers_over not in ("pmem", "blk"):
            raise BackendUnavailable(
                f"DSEC_VM_LAYERS={self.layers_over!r}: say pmem or blk", backend=self.name
            )
        self._boot: dict[tuple[str, str | None, str], tuple[GuestKernel, Path, Path]] = {}
        #: DSEC_VM_SNAPSHOT_START=0: every VM boots (else most start from a template)
        self.snapshot_start = os.environ.get("DSEC_VM_SNAPSHOT_START", "1") != "0"
        self._making: set[str] = set()  # template keys being saved now
        #: DSEC_VM_BALLOON=0: no virtio-balloon (memory a guest frees stays with its QEMU)
        self.balloon = os.environ.get("DSEC_VM_BALLOON", "1") != "0"
        self.cold = ColdProbe()
        self.load = GuestLoad()
        self._settled = Settled(GIVE_BACK_MIN, GIVE_BACK_RETRY)

    @classmethod
    def check_available(cls) -> None:
        qemu.find_qemu()
        if os.geteuid() != 0:
            raise BackendUnavailable(f"backend {cls.name!r} needs root (cgroups, mounts)")

    # --- what a guest boots ----------------------------------------------------------------
    def boot_files(self, agent: Path, kernel: str | None = None) -> tuple[GuestKernel, Path, Path]:
        """The kernel (and its unpacked ``vmlinux``, booted through PVH: the guest need not
        decompress it) and the initramfs (init script, agent, modules), made once per node and
        kernel. ``kernel``: a sandbox's ``rt.kernel`` ("package" or "package=version"), over
        the node's default (``kernel_package``, DSEC_VM_KERNEL, DSEC_VM_KERNEL_VERSION)."""
        package, version = split_kernel(kernel) if kernel else (self.kernel, self.kernel_version)
        key = (package, version, os.fspath(agent))
        if key not in self._boot:
            # the machine's, and its templates hold guests' memory: root's alone
            self.cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            guest = ensure_kernel(self.cache / "kernels", package, version)
            initrd = build_initramfs(
                self.cache / "initramfs",
                guest,
                (*GUEST_MODULES, *self.extra_modules),
                {"/init": INIT_SCRIPT.read_bytes(), "/dsec-agent": agent},
            )
            vmlinux = ensure_vmlinux(guest.vmlinuz, self.cache / "vmlinux")
            self._boot[key] = (guest, vmlinux, initrd)
        return self._boot[key]

    def machine_for(self, pmem: bool) -> str:
        return "q35" if pmem or self.machine != "microvm" else "microvm"

    def vm_config(self, rt: SandboxRuntime, agent_fd: int) -> qemu.VmConfig:
        """The VM of sandbox ``rt``: its layers, disk, size and channels."""
        _, vmlinux, initrd = self.boot_files(rt.agent_binary, rt.kernel)
        disks: list[qemu.Disk] = []
        pmems: list[qemu.Pmem] = []
        blobs: list[str] = []
        for i, layer in enumerate(rt.images):
            if layer.device is not None:
                # on demand: the metadata image and its data blob (the node's FUSE file) as
                # two disks, mounted in the guest as one multi-device EROFS, so a guest reads
                # (and the node fetches) only the chunks it touches, through the host's page
                # cache that every guest and container of the node shares
                disks.append(qemu.Disk(layer.image, f"dsec-l{i}"))
                disks.append(qemu.Disk(layer.device, f"dsec-l{i}b", cache="writeback"))
                blobs.append(str(i))
            elif self.layers_over == "pmem":
                image = pmem_image(self.cache / "pmem", layer)
                pmems.append(qemu.Pmem(image, image.stat().st_size, slot=i))
            else:
                disks.append(qemu.Disk(layer.image, f"dsec-l{i}"))
        assert rt.disk is not None
        disks.append(qemu.Disk(rt.disk, "dsec-rw", readonly=False))
        pmem = bool(pmems)
        cmdline = (
            f"{CMDLINE} dsec.layers={len(rt.images)} dsec.pmem={int(pmem)} "
            + (f"dsec.blobs={','.join(blobs)} " if blobs else "")
            + f"dsec.hostname=dsec-{rt.id[:12]}"
        )
        if self.accel == "tcg":
            cmdline += f" tsc_early_khz={qemu.host_tsc_khz()}"
        return qemu.VmConfig(
            kernel=vmlinux,
            initrd=initrd,
            cmdline=cmdline,
            vcpus=max(1, math.ceil(rt.limits.cpu)),
            memory_mib=max(128, rt.limits.memory >> 20),
            qmp=rt.dir / "qmp.sock",
            console=rt.dir / "console.log",
            agent_fd=agent_fd,
            machine=self.machine_for(pmem),
            accel=self.accel,
            disks=tuple(disks),
            pmems=tuple(pmems),
            display=self.display,
            balloon=self.balloon,
            name=f"dsec-{rt.id}",
            vnc=self.vnc_display(rt),
        )

    def vnc_display(self, rt: SandboxRuntime) -> int | None:
        """The VNC display number sandbox ``rt`` serves its screen on (loopback only), or
        None for none (the default; a display backend picks a free one when asked)."""
        return None

    # --- start ---------------------------------------------------------------------------
    @staticmethod
    def wants_network(rt: SandboxRuntime) -> bool:
        """Whether sandbox ``rt`` gets a network card (its mode is not ``"none"``)."""
        return rt.spec.network != "none"

    async def start(self, rt: SandboxRuntime) -> dict[str, Any]:
        state: dict[str, Any] = {}
        try:
            await self._start(rt, state)
            await self._connect(rt, state)
        except BaseException:
            await self.stop(rt, state)
            raise
        return state

    async def _start(self, rt: SandboxRuntime, state: dict[str, Any]) -> None:
        assert rt.disk is not None
        disk = rt.disk
        key = await asyncio.to_thread(self.template_key, rt) if self.snapshot_start else None
        template = self.cache / "templates" / key if key else None
        if template is not None and (template / TEMPLATE_READY).exists():
            try:
                await self._start_from(rt, state, template)
                return
            except DsecError as e:  # a stale or broken template: boot, and make it again
                log.warning(
                    "sandbox %s: starting from template %s failed (%s); booting",
                    rt.id,
                    template.name,
                    e,
                )
                await self._end_processes(state)
                state.clear()
                shutil.rmtree(template, ignore_errors=True)

        def prepare() -> None:  # mkfs and images: blocking work, off the loop
            disk.unlink(missing_ok=True)
            mkfs_ext4(disk, rt.disk_size)

        await asyncio.to_thread(prepare)
        await self._launch(rt, state)
        await self._wait_ready(rt, state)
        if template is not None and key is not None and key not in self._making:
            self._making.add(key)
            try:
                await self._save_template(rt, state, template)
            except DsecError as e:  # the sandbox runs on; the next one boots again
                log.warning("sandbox %s: saving a start template failed: %s", rt.id, e)
            finally:
                self._making.discard(key)

    async def _connect(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        """A VM with a network card, running and nothing run in it yet: the policies that
        work through ``"started"`` set its namespace up (``StartedSandbox.guest``), then the
        guest takes over what they put on ``eth0`` (``guestnet.hand_over``)."""
        if not state.get("net"):
            return
        netns = guestnet.netns_file(rt.dir)
        root = cgroup2_root()
        cgroup2 = root / cgroup_path(rt.id) if root is not None else None
        started = StartedSandbox(
            pid=state["pid"],
            netns=netns,
            cgroup2=cgroup2 if cgroup2 is not None and cgroup2.is_dir() else None,
            guest=True,
        )
        await asyncio.to_thread(rt.enforce, "started", started)
        address = await asyncio.to_thread(guestnet.hand_over, netns)
        if address is None:
            return
        try:
            await AgentClient(rt.agent_socket, rt.id).ifup(
                address.address, address.prefixlen, address.gateway, guestnet.GUEST_DEVICE
            )
        except DsecError as e:
            raise SandboxError(
                f"sandbox {rt.id}: the guest could not take its address {address.address}: "
                f"{e.message}",
                sandbox_id=rt.id,
            ) from e

    # --- fast start: a fresh boot saved once, loaded by every later VM of its shape ----------
    def template_key(self, rt: SandboxRuntime) -> str:
        """What makes two sandboxes' fresh boots the same: the boot files, the layers and
        how they attach, vCPUs, RAM, the disk's size and the machine. Every part is named by
        its content, never by a node's paths (the boot files' names are digests; a layer is
        its digest, and on demand also its metadata image's), so the key,
        and the template saved under it, holds for every node home of the machine."""
        cfg = self.vm_config(rt, -1)
        pmems = iter(cfg.pmems)

        def layer_key(layer: LayerImage) -> list[Any]:
            if layer.device is not None:
                # its metadata image names the data the guest reads (the blob's logical
                # bytes): the order a source stores them in (a read profile's) is no part
                return [layer.digest, "lazy", layer.image.name]
            if not cfg.pmems:
                return [layer.digest, "blk"]
            # an unpacked copy made on this machine: made again, it is another file
            st = next(pmems).path.stat()
            return [layer.digest, "pmem", st.st_size, st.st_mtime_ns]

        shape = {
            "kernel": cfg.kernel.name,
            "initrd": cfg.initrd.name,
            "cmdline": cfg.cmdline.rsplit(" dsec.hostname=", 1)[0],
            "vcpus": cfg.vcpus,
            "memory": cfg.memory_mib,
            "machine": cfg.machine,
            "accel": cfg.accel,
            "display": cfg.display,
            "balloon": cfg.balloon,
            "net": self.wants_network(rt),
            "layers": [layer_key(layer) for layer in rt.images],
            "disk": rt.disk_size,
            "qemu": self.qemu,
            "saved": TEMPLATE_FORMAT,
        }
        blob = json.dumps(shape, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:24]

    async def _save_template(self, rt: SandboxRuntime, state: Mapping[str, Any], to: Path) -> None:
        """Save the just-booted sandbox (nothing has run in it yet) as the template ``to``: its
        memory and devices (stopped for it: about half a second) and its disk as it was."""
        with contextlib.suppress(FileExistsError):  # another daemon made the same one meanwhile
            await self.save(rt, state, to)

    async def save(self, rt: SandboxRuntime, state: Mapping[str, Any], to: Path) -> None:
        """The guest stopped, its RAM saved to ``to/vm.ram`` and its devices to
        ``to/vm.state`` (``_save_state``) and its disk copied (holes kept) while nothing
        writes to it, then let go on; ``FileExistsError`` if ``to`` exists."""
        assert rt.disk is not None
        if to.exists():
            raise FileExistsError(to)
        work = to.parent / f".{to.name}.{os.getpid()}.{os.urandom(4).hex()}"
        work.mkdir(parents=True)
        try:
            async with Qmp(rt.dir / QMP_SOCKET, rt.id) as q:
                await q.execute("stop")
                try:
                    await self._save_state(q, rt, state, work / TEMPLATE_STATE, work / TEMPLATE_RAM)
                    devices = {
                        "balloon": bool(state.get("balloon")),
                        "net": bool(state.get("net")),
                    }
                    (work / TEMPLATE_DEVICES).write_text(json.dumps(devices))
                    await asyncio.to_thread(copy_sparse, rt.disk, work / TEMPLATE_DISK)
                finally:
                    await q.execute("cont")
            (work / TEMPLATE_READY).touch()
            try:
                os.rename(work, to)
            except OSError as e:
                raise FileExistsError(to) from e
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def start_from(self, rt: SandboxRuntime, saved: Path) -> dict[str, Any]:
        state: dict[str, Any] = {}
        try:
            await self._start_from(rt, state, saved)
            await self._connect(rt, state)
        except BaseException:
            await self.stop(rt, state)
            raise
        return state

    async def _start_from(self, rt: SandboxRuntime, state: dict[str, Any], template: Path) -> None:
        """Start the sandbox from ``template``: a copy of its disk, its memory loaded, then the
        guest's randomness reseeded and its hostname set before anything runs."""
        assert rt.disk is not None
        disk = rt.disk

        def prepare() -> None:
            disk.unlink(missing_ok=True)
            copy_sparse(template / TEMPLATE_DISK, disk)

        await asyncio.to_thread(prepare)
        ram = template / TEMPLATE_RAM
        try:  # the saved VM's devices (a save before they were written down: today's)
            devices = json.loads((template / TEMPLATE_DEVICES).read_text())
        except (OSError, ValueError):
            devices = {}
        if self.wants_network(rt) and not devices.get("net"):
            raise InvalidSpec(
                f"sandbox {rt.id}: network={rt.spec.network!r}, but the VM saved in "
                f"{template.name} has no network card (it ran with network='none')",
                field="network",
                sandbox_id=rt.id,
            )
        await self._launch(
            rt,
            state,
            incoming=template / TEMPLATE_STATE,
            ram=ram if ram.exists() else None,
            balloon=devices.get("balloon"),
            net=bool(devices.get("net")),
        )
        async with await self._monitor(rt, state) as q:
            await self._migrated(q, rt, "load")
            await q.execute("cont")
        await self._wait_ready(rt, state)
        await AgentClient(rt.agent_socket, rt.id).wake(
            os.urandom(64), f"dsec-{rt.id[:12]}", time.time_ns()
        )
        state["template"] = template.name

    async def _launch(
        self,
        rt: SandboxRuntime,
        state: dict[str, Any],
        incoming: Path | None = None,
        ram: Path | None = None,
        balloon: bool | None = None,
        net: bool | None = None,
    ) -> None:
        """QEMU (from ``incoming``, a saved state, if given, its RAM the file ``ram`` mapped
        privately if given; ``balloon``, ``net``: whether the saved VM had one, a network
        card, if known) and its forwarder, confined. A card's TAP is in the sandbox's own
        network namespace (``guestnet``), made now if it is not there."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        (rt.dir / QMP_SOCKET).unlink(missing_ok=True)  # a previous QEMU's (a resume)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tap: int | None = None
        try:
            if self.wants_network(rt) if net is None else net:
                netns = await asyncio.to_thread(guestnet.make_netns, rt.dir)
                tap = await asyncio.to_thread(guestnet.open_card, netns)
            state["net"] = tap is not None
            cfg = await asyncio.to_thread(self.vm_config, rt, theirs.fileno())
            cfg = dataclasses.replace(cfg, tap_fd=tap)
            if incoming is not None:
                # the saved VM's devices, whatever this node's settings are now: a balloon it
                # had must be there to load its state, one it had not must not
                cfg = dataclasses.replace(
                    cfg,
                    incoming=incoming,
                    ram=ram,
                    balloon=cfg.balloon if balloon is None else balloon,
                )
            # what a save needs to know of this QEMU: its RAM block's name (the machine's),
            # how many layers it maps (their pages are not saved), the file its RAM maps
            state.update(
                machine=cfg.machine, accel=cfg.accel, pmems=len(cfg.pmems), balloon=cfg.balloon
            )
            state["memory_from"] = os.fspath(ram) if incoming is not None and ram else None
            if cfg.vnc is not None:
                state["vnc"] = f"127.0.0.1:{5900 + cfg.vnc}"
            rt.agent_socket.unlink(missing_ok=True)
            listener.bind(os.fspath(rt.agent_socket))
            listener.listen(1024)
            # hole punching a no-op (nopunch.c): a guest giving memory back must never punch
            # the RAM file it shares with the other VMs started from the same save
            argv = [os.fspath(rt.agent_binary), "no-punch", "--", *qemu.qemu_argv(cfg, self.qemu)]
            fds = [theirs.fileno(), *([tap] if tap is not None else [])]
            pid = qemu.spawn(argv, fds, log=rt.dir / "qemu.log")
            state.update(pid=pid, start_time=start_time(pid))
            fwd = qemu.spawn(
                [os.fspath(rt.agent_binary), "forward", "--listen-fd", "3", "--serial-fd", "4"],
                [listener.fileno(), ours.fileno()],
                log=rt.dir / "forward.log",
            )
            state.update(forwarder=fwd, forwarder_start=start_time(fwd))
        finally:
            for s in (ours, theirs, listener):
                s.close()
            if tap is not None:
                os.close(tap)  # QEMU holds it now (or never will: the TAP goes)
        self._confine(rt, state)

    def _confine(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        """QEMU and its forwarder into ``dsec/<id>``: RAM plus overhead, the sandbox's cores."""
        memory = rt.limits.memory + QEMU_OVERHEAD
        for key in ("pid", "forwarder"):
            place_process(state[key], cgroup_path(rt.id), memory)
            place_process_cpu(state[key], cgroup_path(rt.id), rt.limits.cpu)
            if state.get("net"):  # a cgroup v2 of its own: what network policies key on
                place_process_v2(state[key], cgroup_path(rt.id))

    async def _wait_ready(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        """Until the agent answers through the forwarder: the guest has booted. A QEMU that
        exits first is a failed start (``GuestPanic`` if the guest's kernel said so)."""
        limit = rt.spec.start_timeout or BOOT_TIMEOUT
        pidfd = os.pidfd_open(state["pid"])
        died = asyncio.ensure_future(wait_readable(pidfd))
        ping = asyncio.ensure_future(self._ping_until_up(rt))
        try:
            done, _ = await asyncio.wait(
                {ping, died}, timeout=limit, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (died, ping):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            os.close(pidfd)
        if ping in done and ping.exception() is None:
            return
        console = rt.dir / "console.log"
        if died in done or (ping in done and not self._running(state)):
            raise self._death(rt, state, during="boot")
        if ping in done:
            exc = ping.exception()
            assert exc is not None
            raise exc
        raise StartTimeout(
            f"sandbox {rt.id}: the guest did not answer within {limit:g}s; its console "
            f"ends:\n{console_tail(console)}",
            sandbox_id=rt.id,
            seconds=limit,
        )

    @staticmethod
    async def _ping_until_up(rt: SandboxRuntime) -> None:
        client = AgentClient(rt.agent_socket, rt.id)
        while True:
            try:
                # one connection waits in the channel while the guest boots; a new one now and
                # then in case a guest that restarted its end dropped it
                await asyncio.wait_for(client.ping(), PING_PATIENCE)
                return
            except (DsecError, TimeoutError):
                await asyncio.sleep(0.05)

    def _death(self, rt: SandboxRuntime, state: Mapping[str, Any], during: str) -> DsecError:
        """The error for a QEMU that is gone: a guest kernel panic, or its own exit."""
        console = console_tail(rt.dir / "console.log")
        log = console_tail(rt.dir / "qemu.log", 5)
        if "Kernel panic" in console:
            return GuestPanic(
                f"sandbox {rt.id}: the guest kernel panicked during {during}:\n{console}",
                sandbox_id=rt.id,
                console=console,
            )
        return SandboxError(
            f"sandbox {rt.id}: QEMU exited during {during}; console:\n{console}\nqemu: {log}",
            sandbox_id=rt.id,
            console=console,
        )

    async def give_back(self, rt: SandboxRuntime, state: Mapping[str, Any], floor: int) -> int:
        """The guest's RAM pages QEMU holds that it has not touched since the last call
        (``coldmem``) are reclaimed in the guest (the agent's proactive reclaim: cgroup v2's
        ``memory.reclaim``, coldest first), at most down to ``floor``; what the guest frees
        goes back to the host by the balloon's free page reporting within seconds. A guest at
        work (over a fifth of a core since the last call, by its own ``/proc/stat``) is left
        alone, and so, for ``GIVE_BACK_RETRY`` passes, is one that could not give half of what
        it was asked last time and has not grown since (``coldmem.Settled``). Returns how
        much the guest freed."""
        pid = state.get("pid")
        if not state.get("balloon") or not isinstance(pid, int) or not self._running(state):
            return 0
        agent = AgentClient(rt.agent_socket, rt.id)
        try:  # the guest's own accounting: how busy it was since the last pass
            busy = self.load.cores(pid, await agent.read_file("/proc/stat", length=1 << 16))
        except (DsecError, ValueError) as e:
            log.debug("sandbox %s: no /proc/stat from the guest: %s", rt.id, e)
            return 0
        ram = max(128, rt.limits.memory >> 20) << 20
        sample = await asyncio.to_thread(self.cold.sample, pid, ram)
        if sample is None or busy is None or sample.cold < GIVE_BACK_MIN or busy > GIVE_BACK_BUSY:
            return 0  # nothing cold enough, or a guest at work now
        if self._settled.holds(pid, sample.resident):
            return 0  # no more than it kept last time, lately
        ask = min(sample.cold, sample.resident - floor)
        if ask < GIVE_BACK_MIN:
            return 0
        freed = await agent.reclaim(ask)
        self._settled.gave(pid, sample.resident, ask, freed)
        return freed

    async def freeze_disk(
        self, rt: SandboxRuntime, state: Mapping[str, Any], on: bool, seconds: float
    ) -> None:
        """The agent freezes (or thaws) the guest's writable disk (``/.dsec/rw``, bound there
        by ``init.sh``), thawing it by itself after ``seconds``."""
        await AgentClient(rt.agent_socket, rt.id).freeze(on, seconds=math.ceil(seconds))

    # --- liveness ------------------------------------------------------------------------
    @staticmethod
    def _running(state: Mapping[str, Any]) -> bool:
        return still_running(state.get("pid"), state.get("start_time"))

    async def alive(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        """QEMU runs, or the VM is paused to its file (then no process is needed)."""
        return self._running(state) or self.paused(rt, state)

    def exit_fd(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> int | None:
        pid = state.get("pid")
        return open_pidfd(pid, state.get("start_time")) if isinstance(pid, int) else None

    def death_cause(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> tuple[str, str]:
        """A guest kernel panic, or QEMU gone (killed from outside, say): the console's last
        words either way."""
        error = self._death(rt, state, during="its life")
        return ("guest_panic" if isinstance(error, GuestPanic) else "crashed", str(error))

    # --- stop ----------------------------------------------------------------------------
    async def stop(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        if isinstance(state.get("pid"), int):
            self.cold.forget(state["pid"])
            self.load.forget(state["pid"])
            self._settled.forget(state["pid"])
        await self._end_processes(state)
        await asyncio.to_thread(guestnet.release_netns, rt.dir)
        self._saved(rt).unlink(missing_ok=True)
        (rt.data_dir / SAVED_RAM).unlink(missing_ok=True)
        for attempt in range(100):
            if not remove_cgroups(cgroup_path(rt.id)):
                break
            if attempt == 10:
                # still busy after 0.1 s: a process its state does not name (a QEMU a
                # daemon started and died before it recorded the pid, found by the soak)
                killed = kill_members(cgroup_path(rt.id))
                log.warning("sandbox %s: killed %s, left in its cgroups", rt.id, killed)
            await asyncio.sleep(0.01)
        else:
            raise SandboxError(f"sandbox {rt.id}: its cgroups stay busy", sandbox_id=rt.id)
        rt.agent_socket.unlink(missing_ok=True)
        (rt.dir / "qmp.sock").unlink(missing_ok=True)

    # --- pause: the VM saved to a file, QEMU gone ------------------------------------------
    def _saved(self, rt: SandboxRuntime) -> Path:
        return rt.data_dir / SAVED_STATE

    async def pause(
        self, rt: SandboxRuntime, state: Mapping[str, Any], reclaim: bool = False
    ) -> None:
        """Stop the guest, save its RAM to ``<data dir>/vm.ram`` and its devices to
        ``vm.state`` (``_save_state``), and end QEMU and its forwarder: a paused VM holds no
        host memory but its page cache's share of the layers. Connections open at the time
        end. The state dict records the file (``saved``); ``reclaim`` changes nothing
        more."""
        saved, ram = self._saved(rt), rt.data_dir / SAVED_RAM
        if state.get("saved"):
            return
        saved.unlink(missing_ok=True)
        ram.unlink(missing_ok=True)
        async with Qmp(rt.dir / QMP_SOCKET, rt.id) as q:
            await q.execute("stop")
            try:
                await self._save_state(q, rt, state, saved, ram)
            except BaseException:
                saved.unlink(missing_ok=True)
                ram.unlink(missing_ok=True)
                await q.execute("cont")
                raise
        writable = dict(state)  # the node's dict: updated in place below
        await self._end_processes(writable)
        assert isinstance(state, dict)
        # its RAM is all in its own file now: it maps a snapshot's no longer
        state.update(
            pid=None, start_time=None, forwarder=None, forwarder_start=None, memory_from=None
        )
        state["saved"] = os.fspath(saved)

    async def resume(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> None:
        """A new QEMU loads the saved state (``-incoming``) with the same disks, its RAM the
        saved file mapped privately (read as the guest touches it), and the guest goes on
        from the instant it was saved; the files are removed (QEMU's mapping keeps the RAM
        file's data until it exits)."""
        if not state.get("saved"):
            return
        assert isinstance(state, dict)
        saved = Path(state["saved"])
        ram = rt.data_dir / SAVED_RAM
        fresh: dict[str, Any] = {}
        try:
            await self._launch(
                rt,
                fresh,
                incoming=saved,
                ram=ram if ram.exists() else None,
                balloon=state.get("balloon"),
                net=bool(state.get("net")),
            )
            async with await self._monitor(rt, fresh) as q:
                await self._migrated(q, rt, "load")
                await q.execute("cont")
        except BaseException:
            await self._end_processes(fresh)
            raise
        state.update(fresh)
        state.pop("saved", None)
        saved.unlink(missing_ok=True)
        ram.unlink(missing_ok=True)
        state["memory_from"] = None

    async def _monitor(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> Qmp:
        """A connected monitor of a QEMU just started (it makes its socket as it starts)."""
        deadline = time.monotonic() + 10.0
        while True:
            if not (rt.dir / QMP_SOCKET).exists() and time.monotonic() < deadline:
                if not self._running(state):
                    raise self._death(rt, state, during="start")
                await asyncio.sleep(0.005)
                continue
            q = Qmp(rt.dir / QMP_SOCKET, rt.id)
            try:
                await q.connect()
                return q
            except SandboxError:
                if not self._running(state):
                    raise self._death(rt, state, during="start") from None
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)

    async def _save_state(
        self, q: Qmp, rt: SandboxRuntime, state: Mapping[str, Any], to: Path, ram: Path
    ) -> None:
        """The stopped guest's RAM into the new file ``ram`` and the rest of its state into
        ``to`` (``migstream``), so that whatever loads it maps the RAM instead of copying it.
        A stream that does not split (a QEMU whose format this does not parse) is saved
        whole into ``to``, with no ``ram``: loading it copies the RAM, as before."""
        block = RAM_BLOCKS.get(str(state.get("machine")))
        if block is not None:
            try:
                stats = await self._save_split(q, rt, state, to, ram, block)
                log.debug("sandbox %s: saved %s", rt.id, stats)
                return
            except StreamFormatError as e:
                log.warning("sandbox %s: its state did not split (%s); saving it whole", rt.id, e)
                to.unlink(missing_ok=True)
                ram.unlink(missing_ok=True)
        await q.execute("migrate", {"uri": f"exec:cat > {qemu.quoted(to)}"})
        await self._migrated(q, rt, "save")

    async def _save_split(
        self,
        q: Qmp,
        rt: SandboxRuntime,
        state: Mapping[str, Any],
        to: Path,
        ram: Path,
        block: str,
    ) -> SplitStats:
        """QEMU migrates into a FIFO in the runtime directory (``exec:cat > FIFO``) that a
        thread reads and splits as it comes. The thread ends when the writer closes (``cat``
        ends with the migration, however it ends); a split that fails closes its end, and the
        migration fails with it."""
        drop = [f"pm{i}" for i in range(int(state.get("pmems") or 0))]  # the layers' files
        fifo = rt.dir / SAVE_FIFO
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo, 0o600)

        def split() -> SplitStats:
            fd = os.open(fifo, os.O_RDONLY | os.O_CLOEXEC)  # until cat opens it
            with open(fd, "rb", buffering=1 << 20) as source, open(to, "xb") as out:
                return split_stream(source, out, ram, block, drop)

        task = asyncio.ensure_future(asyncio.to_thread(split))
        try:
            await q.execute("migrate", {"uri": f"exec:cat > {qemu.quoted(fifo)}"})
            await self._migrated(q, rt, "save")
            return await task
        except BaseException:
            with contextlib.suppress(OSError):  # a reader still waiting for cat: let it go
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), 10.0)
            if task.done() and not task.cancelled():
                error = task.exception()
                if isinstance(error, StreamFormatError):
                    raise error from None
            raise
        finally:
            fifo.unlink(missing_ok=True)

    async def _migrated(self, q: Qmp, rt: SandboxRuntime, what: str) -> None:
        """Until the save (``query-migrate``) or load (``query-status``) is done."""
        deadline = time.monotonic() + MIGRATE_TIMEOUT
        while time.monotonic() < deadline:
            if what == "save":
                status = (await q.execute("query-migrate")).get("status")
                if status == "completed":
                    return
                if status in ("failed", "cancelled"):
                    raise SandboxError(
                        f"sandbox {rt.id}: saving the VM's state {status}", sandbox_id=rt.id
                    )
            else:
                status = (await q.execute("query-status")).get("status")
                if status in ("paused", "postmigrate", "running"):
                    return
                if status not in ("inmigrate", "prelaunch"):
                    raise SandboxError(
                        f"sandbox {rt.id}: loading the VM's state ended {status}",
                        sandbox_id=rt.id,
                    )
            await asyncio.sleep(0.01)
        raise SandboxError(
            f"sandbox {rt.id}: the VM's state did not {what} within {MIGRATE_TIMEOUT:g}s",
            sandbox_id=rt.id,
        )

    def paused(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> bool:
        return bool(state.get("saved")) and self._saved(rt).exists()

    async def _end_processes(self, state: Mapping[str, Any]) -> None:
        for key, started in (("pid", "start_time"), ("forwarder", "forwarder_start")):
            pid = state.get(key)
            if isinstance(pid, int) and still_running(pid, state.get(started)):
                await kill_and_wait(pid)
            if isinstance(pid, int):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)  # ours, if this daemon started it

    def usage(self, rt: SandboxRuntime, state: Mapping[str, Any]) -> SandboxUsage:
        """QEMU's host memory and CPU time (the guest's own view is not the host's)."""
        pid = state.get("pid")
        if not isinstance(pid, int) or not self._running(state):
            return SandboxUsage()
        stat = proc_stat(pid)
        return SandboxUsage(memory=_rss(pid), cpu_seconds=stat.cpu_seconds if stat else None)

    def describe(self, state: Mapping[str, Any]) -> str:
        return json.dumps({k: state.get(k) for k in ("machine", "accel", "vnc")})
