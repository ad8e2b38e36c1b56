"""QEMU for VM sandboxes: which accelerator truly works here, the command line of a microVM or a
full VM, and the host processes around one (QEMU itself and the agent channel's forwarder).

KVM is used only where it really runs guests: ``/dev/kvm`` opens, the CPU has hardware
virtualisation (``vmx``/``svm``) and the module is not PVM's (a PVM nested platform offers
``/dev/kvm`` but runs ordinary guests about a thousand times slower than TCG). Elsewhere QEMU
translates (TCG) with a small translation cache, which is most of an idle guest's host memory.

Machines: ``microvm`` (no PCI, no firmware beyond qboot, virtio-mmio devices) boots fastest but
QEMU 7.2 gives it no device-memory region, so virtio-pmem cannot attach to it (the guest's
nd_pmem fails with "could not reserve region"); layers over virtio-pmem therefore run on a
``q35`` machine trimmed the same way (qboot firmware, ``-nodefaults``, only virtio-pci
devices), which boots about 0.3 s slower under TCG. ``VmConfig.machine`` picks; the devices
follow the machine's bus.

A guest's block devices are ``Disk``s (virtio-blk; QEMU's own word is ``-drive``): "drive" in
dsec is the socket a loop drives its workers through (``dsec_core.node.drive``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BackendUnavailable
from ..renamed import renamed_getattr, warn_renamed
from .migstream import RAM_BLOCKS

__all__ = [
    "GUEST_MAC",
    "PMEM_ALIGN",
    "TAP_FD",
    "Disk",
    "Pmem",
    "VmConfig",
    "accelerator",
    "find_firecracker",
    "find_qemu",
    "host_tsc_khz",
    "kill",
    "kvm_usable",
    "option",
    "qemu_argv",
    "quoted",
    "spawn",
]

if not TYPE_CHECKING:  # ``Drive``, renamed ``Disk``, warns (mypy would take any name for Any)
    __getattr__ = renamed_getattr(__name__)

QEMU = "qemu-system-x86_64"
QBOOT = Path("/usr/share/qemu/qboot.rom")
#: virtio-pmem regions are whole 2 MiB pages (the guest maps them with huge pages).
PMEM_ALIGN = 2 << 20
#: TCG's translation cache (MiB): QEMU's default is 1 GiB of address space, touched as code
#: runs; a guest that runs a shell and a few tools needs far less.
TCG_CACHE_MIB = 64
#: Where the layer devices sit on q35's root bus: layer i at slot PMEM_SLOT + i, so the guest
#: tells them apart by PCI address.
PMEM_SLOT = 0x10
#: QEMU's fd of the TAP device (``VmConfig.tap_fd``), after the agent's chardev (fd 3).
TAP_FD = 4
#: Every guest's network card's address: each card is alone on its link (its sandbox's own
#: network namespace), and a fork's card is its parent's.
GUEST_MAC = "52:54:00:d5:ec:01"


def kvm_usable() -> bool:
    """Whether KVM truly runs guests here (see the module docstring)."""
    if Path("/sys/module/kvm_pvm").exists():
        return False
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("vmx", "svm"))


def host_tsc_khz() -> int:
    """The host's clock rate in kHz, which is the rate of a TCG guest's TSC (QEMU reads the
    host's). Told to the guest kernel (``tsc_early_khz=``): its own calibration against the
    emulated PIT fails when the host is busy (TCG's PIT then runs late), and a kernel that
    finds no TSC rate and no HPET or ACPI PM timer hangs early in boot."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return 2_000_000


def accelerator() -> str:
    """``kvm`` where it truly works, else ``tcg``."""
    return "kvm" if kvm_usable() else "tcg"


def find_qemu() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise BackendUnavailable(
            f"{QEMU} is not installed (apt-get install qemu-system-x86)", missing=QEMU
        )
    return path


def find_firecracker() -> str | None:
    """Firecracker's binary if this host has it (it needs real KVM: None without it)."""
    path = shutil.which("firecracker")
    return path if path is not None and kvm_usable() else None


@dataclass(frozen=True)
class Disk:
    """A virtio-blk disk; the guest finds it by ``serial`` (``/sys/block/vd*/serial``)."""

    path: Path
    serial: str
    readonly: bool = True
    #: QEMU's cache mode: "none" (O_DIRECT: the guest caches what it reads) or "writeback"
    #: (the host's page cache, shared by every guest reading the file: an on-demand blob)
    cache: str = "none"


@dataclass(frozen=True)
class Pmem:
    """A read-only file mapped into the guest as a virtio-pmem device (size: whole 2 MiB)."""

    path: Path
    size: int
    #: the PCI slot past ``PMEM_SLOT`` (the guest's layer index); None: its place in the list
    slot: int | None = None


@dataclass(frozen=True)
class VmConfig:
    """One VM's QEMU: what it boots, what it holds, and where its host ends are."""

    kernel: Path
    initrd: Path
    cmdline: str
    vcpus: int
    memory_mib: int
    qmp: Path  # QMP's unix socket (QEMU listens)
    console: Path  # the guest's serial console, written to a file
    agent_fd: int  # the agent port's chardev: our end of a connected socket, QEMU's fd 3
    machine: str = "microvm"  # or "q35" (needed for pmem and displays)
    accel: str = "tcg"
    disks: tuple[Disk, ...] = ()
    pmems: tuple[Pmem, ...] = ()
    display: bool = False  # a virtio-gpu display and a virtio tablet (q35 only)
    vnc: int | None = None  # a VNC display number, on 127.0.0.1 only
    incoming: Path | None = None  # start from this saved state (QMP migrate to a file)
    #: the guest's RAM as this file, mapped privately (``migstream``): a saved VM's memory,
    #: shared with every other QEMU mapping it until the guest writes a page
    ram: Path | None = None
    #: a virtio-balloon with free page reporting: memory the guest frees goes back to the
    #: host, and the node can ask the guest for more (``balloon``)
    balloon: bool = False
    #: a TAP device's descriptor (QEMU's fd 4): the guest's network card, a virtio-net one
    tap_fd: int | None = None
    name: str = "dsec-vm"  # QEMU's -name: the process's name on the host
    extra: tuple[str, ...] = field(default=())

    @property
    def drives(self) -> tuple[Disk, ...]:
        """Renamed ``disks``; this alias warns and goes in the next release."""
        warn_renamed("VmConfig.drives", "VmConfig.disks")
        return self.disks


def qemu_argv(cfg: VmConfig, qemu: str = QEMU) -> list[str]:
    """QEMU's command line for ``cfg``; the agent's chardev is fd 3 in QEMU."""
    pci = cfg.machine != "microvm"
    dev = "pci" if pci else "device"
    if cfg.pmems and not pci:
        raise BackendUnavailable(
            "virtio-pmem needs a machine with device memory (q35); microvm has none",
            machine=cfg.machine,
        )
    if cfg.machine == "microvm":
        machine = "microvm,acpi=on,pit=off,pic=off,rtc=off"
    else:
        machine = f"{cfg.machine},smbus=off,sata=off,usb=off,vmport=off"
    if cfg.ram is not None:  # the machine's own RAM block, named as the stream names it
        machine += f",memory-backend={RAM_BLOCKS['microvm' if not pci else 'q35']}"
    accel = cfg.accel if cfg.accel != "tcg" else f"tcg,tb-size={TCG_CACHE_MIB}"
    memory = f"{cfg.memory_mib}M"
    if cfg.pmems:
        total = sum(p.size for p in cfg.pmems)
        memory += f",slots={len(cfg.pmems)},maxmem={cfg.memory_mib + (total >> 20)}M"
    argv = [
        qemu,
        "-name",
        f"{cfg.name},process={cfg.name}",
        "-M",
        machine,
        "-accel",
        accel,
        "-cpu",
        "host" if cfg.accel == "kvm" else "max",
        "-smp",
        str(cfg.vcpus),
        "-m",
        memory,
        "-nodefaults",
        "-no-user-config",
        "-no-reboot",
        "-kernel",
        os.fspath(cfg.kernel),
        "-initrd",
        os.fspath(cfg.initrd),
        "-append",
        cfg.cmdline,
        "-serial",
        f"file:{cfg.console}",
        "-qmp",
        f"unix:{cfg.qmp},server=on,wait=off",
        "-chardev",
        "socket,id=agent,fd=3",
        "-device",
        f"virtio-serial-{dev}",
        "-device",
        "virtserialport,chardev=agent,name=dsec.agent",
    ]
    if cfg.ram is not None:
        argv += [
            "-object",
            f"memory-backend-file,id={RAM_BLOCKS['microvm' if not pci else 'q35']},"
            f"mem-path={option(cfg.ram)},size={cfg.memory_mib}M,share=off",
        ]
    if QBOOT.exists():  # virtio-gpu needs no VGA BIOS: qboot serves displays too
        argv += ["-bios", os.fspath(QBOOT)]
    if not cfg.display:
        argv += ["-display", "none", "-vga", "none"]
    else:
        argv += _display_args(cfg)
    for i, d in enumerate(cfg.disks):
        ro = ",readonly=on" if d.readonly else ""
        argv += [
            "-drive",
            # discard=ignore: a guest's discard never punches the image (nopunch.c relies on it).
            # werror/rerror=report: a write the host's full disk refuses is the guest's EIO, as
            # a container's ENOSPC is; QEMU's default (enospc) stopped the whole VM, and with
            # no one to resume it the sandbox never answered again (the chaos soak's disk fill)
            f"file={option(d.path)},if=none,format=raw,id=d{i},cache={d.cache},aio=threads,"
            f"discard=ignore,detect-zeroes=off,werror=report,rerror=report{ro}",
            "-device",
            f"virtio-blk-{dev},drive=d{i},serial={d.serial}",
        ]
    for i, p in enumerate(cfg.pmems):
        argv += [
            "-object",
            f"memory-backend-file,id=pm{i},mem-path={option(p.path)},size={p.size},share=off,readonly=on",
            "-device",
            f"virtio-pmem-pci,memdev=pm{i},id=pmem{i},bus=pcie.0,"
            f"addr={PMEM_SLOT + (i if p.slot is None else p.slot):#x}",
        ]
    if cfg.balloon:
        # deflate-on-oom: a guest about to run out takes pages back from the balloon rather
        # than kill a process (the node's give_back never starves it)
        argv += [
            "-device",
            f"virtio-balloon-{dev},id=balloon0,free-page-reporting=on,deflate-on-oom=on",
        ]
    if cfg.tap_fd is not None:
        argv += [
            "-netdev",
            f"tap,id=net0,fd={TAP_FD}",
            "-device",
            f"virtio-net-{dev},netdev=net0,mac={GUEST_MAC}",
        ]
    if cfg.incoming is not None:
        argv += ["-incoming", f"exec:cat {quoted(cfg.incoming)}"]
    return argv + list(cfg.extra)


def _display_args(cfg: VmConfig) -> list[str]:
    """A virtio-gpu card and a virtio tablet (absolute pointer: a click lands on the pixel
    asked for) on q35; keys go to q35's own PS/2 keyboard, built into the guest kernel.
    ``-nodefaults`` (above) matters: without it q35 adds a standard VGA card too and
    ``screendump`` shows that card's text console. The screen is seen over QMP
    (``screendump``) and, if ``cfg.vnc`` is set, over VNC on loopback only."""
    if cfg.machine == "microvm":
        raise BackendUnavailable("a display needs a PCI machine (q35)", machine=cfg.machine)
    argv = ["-vga", "none", "-device", "virtio-gpu-pci", "-device", "virtio-tablet-pci"]
    if cfg.vnc is None:
        return [*argv, "-display", "none"]
    return [*argv, "-display", "none", "-vnc", f"127.0.0.1:{int(cfg.vnc)}"]


def option(path: Path) -> str:
    """``path`` inside a QEMU option list (a comma doubled, as QEMU reads it)."""
    return os.fspath(path).replace(",", ",,")


def quoted(path: Path) -> str:
    """``path`` for a shell command QEMU runs (``exec:`` migration URIs): refused if it holds
    anything a shell would read specially (our paths never do)."""
    s = os.fspath(path)
    if any(c in s for c in " '\"\\$`"):
        raise BackendUnavailable(f"a VM state file path QEMU cannot take: {s!r}")
    return s


def spawn(argv: Sequence[str], fds: Sequence[int], log: Path | None = None) -> int:
    """Start ``argv`` in a session of its own (it outlives the daemon that started it) with
    ``fds`` as its fds 3, 4, ..., stdin from /dev/null and stdout/stderr to ``log`` (else
    /dev/null); returns its pid."""
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    out = (
        os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        if log is not None
        else devnull
    )

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in fds]
    try:
        actions = [
            (os.POSIX_SPAWN_DUP2, devnull, 0),
            (os.POSIX_SPAWN_DUP2, out, 1),
            (os.POSIX_SPAWN_DUP2, out, 2),
        ]
        actions += [(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(high)]
        return os.posix_spawn(argv[0], list(argv), os.environ, file_actions=actions, setsid=True)
    finally:
        for fd in {devnull, out, *high}:
            os.close(fd)


def kill(pid: int) -> None:
    """SIGKILL ``pid`` if it still runs (the caller reaps it)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
