"""The egress programs as kernel objects: compiled with clang (once per source digest), loaded
through libbpf (``libbpf.so.1``, by ctypes) once per process and attached to each sandbox's
cgroup, and their maps read and written with the bpf() calls libbpf wraps.

Programs attach with ``BPF_F_ALLOW_MULTI`` and without a link: the cgroup holds them, so they
stay enforced when the daemon exits and go when the sandbox's cgroup is removed. The maps are
the node's, shared by its sandboxes (every key starts with a sandbox's cgroup id) and pinned
under ``/sys/fs/bpf/dsec/egress-<source digest>/``, which is what a live update or a restarted
daemon opens; ``sandboxes`` there registers each sandbox's cgroup id under its sandbox id.
Loading and verifying the programs takes about 1.5 ms of CPU, once; registering a sandbox and
attaching to its cgroup takes a small fraction of that.

A VM sandbox's traffic is its guest's, which no cgroup hook sees: ``Programs.attach_port``
attaches ``guest_egress`` to the egress side of its veth (a tcx link, pinned as
``port-<sandbox id>`` beside the maps so it outlives the daemon) and names the sandbox in
``ports`` by that veth's index, which the policy makes from the sandbox's cgroup id
(``port_index``): the maps are the host's and every node has its own egress namespace, where
indexes would otherwise repeat. The veth's removal detaches it; ``NodeMaps.unregister`` drops
the entry and the pin.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import os
import shutil
import struct
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from dsec_core.errors import PolicyUnavailable, ToolError, UnknownSandbox
from dsec_core.linux.tools import build_key, cached_build

from .rules import MAX_RULES

__all__ = [
    "BPF_ROOT",
    "COUNTERS",
    "SOURCE",
    "NodeMaps",
    "Programs",
    "SandboxMaps",
    "bpffs_mounted",
    "ensure_bpffs",
    "ensure_object",
    "libbpf",
    "maps_dir",
    "port_index",
    "port_pin",
    "registered",
]

SOURCE = Path(__file__).with_name("bpf") / "egress.bpf.c"
BPF_ROOT = Path("/sys/fs/bpf")
#: The slots of a sandbox's ``denied`` entry, in the C enum's order.
COUNTERS = ("connect4", "connect6", "sendmsg4", "sendmsg6", "socket", "packet")
MAPS = ("allow4", "allow6", "denied", "sandboxes", "ports")
#: The program for a VM's packets (tcx, on its veth), not for cgroups.
PACKET_PROGRAM = "guest_egress"
BPF_TCX_INGRESS = 46
#: VM veths' indexes start here (a namespace numbers its own devices from 1 up)
PORT_INDEX_BASE = 1 << 24
BPF_F_ALLOW_MULTI = 2
BPF_ANY = 0
BPF_NOEXIST = 1
SANDBOX_KEY = 32  # bytes of the sandboxes map's key: the sandbox id, NUL-padded
_CGROUP = struct.Struct("=Q")  # a cgroup id as the CPU holds it (the programs copy it so)
_PREFIX = struct.Struct("<I")  # an LPM trie key's prefix length

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_log: list[str] = []


def maps_dir(source: Path | None = None) -> Path:
    """Where the maps of the programs built from ``source`` are pinned: a changed source (a
    new key layout) gets maps of its own."""
    return BPF_ROOT / "dsec" / f"egress-{source_digest(source or SOURCE)}"


def bpffs_mounted() -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == os.fspath(BPF_ROOT) and " - bpf " in line for line in f)


def ensure_bpffs() -> None:
    """Mount the BPF filesystem at /sys/fs/bpf if nothing has (systemd does on most hosts)."""
    if bpffs_mounted():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"bpf", os.fsencode(BPF_ROOT), b"bpf", 0, None) != 0:
        e = ctypes.get_errno()
        if e != errno.EBUSY:
            raise PolicyUnavailable(
                f"cannot mount the BPF filesystem at {BPF_ROOT}: {os.strerror(e)}",
                policy="egress",
            )


# --- libbpf through ctypes ----------------------------------------------------------------
_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _format(fmt: bytes, args: int) -> str:
    # va_list is an array type on x86-64 and arm64 ABIs that libbpf's Debian builds use; it
    # reaches the callback as a pointer that vsnprintf takes as it is.
    buf = ctypes.create_string_buffer(2048)
    _libc.vsnprintf(buf, len(buf), fmt, ctypes.c_void_p(args))
    return buf.value.decode(errors="replace")


@_PRINT_FN
def _print(level: int, fmt: bytes, args: int) -> int:
    # libbpf talks on stderr by default; keep its last words for the error we raise instead
    _log.append(_format(fmt, args))
    del _log[:-40]
    return 0


_libc = ctypes.CDLL(None, use_errno=True)
_libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]


def libbpf() -> ctypes.CDLL:
    """libbpf.so.1 with the prototypes used here; ``PolicyUnavailable`` if it is missing."""
    global _lib
    if _lib is not None:
        return _lib
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise PolicyUnavailable(
            f"the egress policy needs libbpf (apt-get install libbpf1): {e}", policy="egress"
        ) from e
    vp, ci, cu, cc = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p
    for fn, res, args in (
        ("bpf_object__open_file", vp, [cc, vp]),
        ("bpf_object__load", ci, [vp]),
        ("bpf_object__close", None, [vp]),
        ("bpf_object__find_map_by_name", vp, [vp, cc]),
        ("bpf_object__next_program", vp, [vp, vp]),
        ("bpf_map__set_pin_path", ci, [vp, cc]),
        ("bpf_map__fd", ci, [vp]),
        ("bpf_program__fd", ci, [vp]),
        ("bpf_program__name", cc, [vp]),
        ("bpf_program__expected_attach_type", ci, [vp]),
        ("bpf_prog_attach", ci, [ci, ci, ci, cu]),
        ("bpf_prog_detach2", ci, [ci, ci, ci]),
        ("bpf_obj_get", ci, [cc]),
        ("bpf_obj_pin", ci, [ci, cc]),
        ("bpf_link_create", ci, [ci, ci, ci, vp]),
        ("bpf_map_update_elem", ci, [ci, vp, vp, ctypes.c_uint64]),
        ("bpf_map_delete_elem", ci, [ci, vp]),
        ("bpf_map_lookup_elem", ci, [ci, vp, vp]),
        ("bpf_map_get_next_key", ci, [ci, vp, vp]),
        ("libbpf_set_print", vp, [_PRINT_FN]),
    ):
        f = getattr(lib, fn)
        f.restype = res
        f.argtypes = args
    lib.libbpf_set_print(_print)
    _lib = lib
    return lib


def _failed(what: str, code: int) -> ToolError:
    code = abs(code) or ctypes.get_errno()
    return ToolError(
        f"egress policy: {what}: {os.strerror(code)}",
        exit_code=code,
        stderr="".join(_log[-20:]),
    )


# --- the object file ----------------------------------------------------------------------
def source_digest(source: Path = SOURCE) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:12]


def ensure_object(cache_dir: Path, source: Path = SOURCE) -> Path:
    """``cache_dir/dsec-egress-<digest>.bpf.o``, compiled with clang first if missing (or
    copied from the machine's build cache, ``cached_build``, where another node home built it),
    under a temporary name and renamed, so concurrent daemons never load half a file."""
    target = Path(cache_dir) / f"dsec-egress-{source_digest(source)}.bpf.o"
    if target.exists():
        return target
    clang = shutil.which("clang")
    if clang is None:
        raise PolicyUnavailable(
            "the egress policy compiles its BPF programs with clang (apt-get install clang "
            "libbpf-dev)",
            policy="egress",
            tool="clang",
        )
    arch = os.uname().machine
    multiarch = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(arch, arch)
    flags = [
        "-O2",
        "-g",  # BTF: libbpf reads the maps' definitions from it
        "-Wall",
        "-Werror",
        "-target",
        "bpf",
        "-I",
        f"/usr/include/{multiarch}",
    ]

    def build(out: Path) -> None:
        command = [clang, *flags, "-c", os.fspath(source), "-o", os.fspath(out)]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolError(
                "compiling the egress BPF programs failed",
                command=command,
                exit_code=proc.returncode,
                stdout=proc.stdout,
                stderr=proc.stderr,
            )

    key = build_key(["clang", *flags], [Path(source)], programs=[Path(clang)])
    cached_build(target, key, build)
    return target


class Programs:
    """The egress programs of one object file, loaded with the node's pinned maps (made and
    pinned if missing): one set for every sandbox.

    ``attach`` registers a sandbox in the maps and attaches the programs to its cgroup.
    ``close`` leaves attached programs to the kernel: the sandboxes stay enforced, and each
    cgroup's removal drops what it held."""

    def __init__(self, obj: int, programs: list[tuple[str, int, int]], pins: Path):
        self._obj = obj
        self._programs = programs  # (name, fd, attach type)
        self.pins = pins

    @classmethod
    def load(cls, obj_path: Path, pins: Path) -> Programs:
        lib = libbpf()
        with _lock:  # libbpf's print callback and log are process-wide
            for attempt in range(2):  # a daemon pinning the same maps at the same moment
                _log.clear()
                try:
                    return cls._load(lib, obj_path, pins)
                except ToolError as e:
                    if attempt or e.exit_code != errno.EEXIST:
                        raise
        raise AssertionError("unreachable")

    @classmethod
    def _load(cls, lib: ctypes.CDLL, obj_path: Path, pins: Path) -> Programs:
        obj = lib.bpf_object__open_file(os.fsencode(obj_path), None)
        if not obj:
            raise _failed(f"opening {obj_path}", ctypes.get_errno())
        try:
            pins.mkdir(parents=True, exist_ok=True)
            for name in MAPS:
                m = lib.bpf_object__find_map_by_name(obj, name.encode())
                if not m:
                    raise _failed(f"map {name} missing from {obj_path}", errno.ENOENT)
                rc = lib.bpf_map__set_pin_path(m, os.fsencode(pins / name))
                if rc:
                    raise _failed(f"pinning {name}", rc)
            rc = lib.bpf_object__load(obj)  # reuses the maps pinned there already
            if rc:
                raise _failed("loading the egress programs", rc)
            programs = []
            prog = lib.bpf_object__next_program(obj, None)
            while prog:
                programs.append(
                    (
                        lib.bpf_program__name(prog).decode(),
                        lib.bpf_program__fd(prog),
                        lib.bpf_program__expected_attach_type(prog),
                    )
                )
                prog = lib.bpf_object__next_program(obj, prog)
        except BaseException:
            lib.bpf_object__close(obj)
            raise
        return cls(obj, programs, pins)

    def close(self) -> None:
        if self._obj:
            libbpf().bpf_object__close(self._obj)
            self._obj = 0

    def attach(self, sandbox_id: str, cgroup: Path) -> None:
        """Register the sandbox whose cgroup is ``cgroup``, with no rules (default deny), and
        attach the programs to the cgroup. On failure nothing stays: no entry in the maps, no
        program on the cgroup."""
        lib = libbpf()
        cgroup_id = os.stat(cgroup).st_ino  # a cgroup v2 directory's inode is the cgroup's id
        attached: list[tuple[int, int]] = []
        cg = -1
        with NodeMaps.open(self.pins) as maps:
            try:
                maps.register(sandbox_id, cgroup_id)
                cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                for name, prog, kind in self._programs:
                    if name == PACKET_PROGRAM:
                        continue
                    rc = lib.bpf_prog_attach(prog, cg, kind, BPF_F_ALLOW_MULTI)
                    if rc:
                        raise _failed(f"attaching {name} to {cgroup}", rc)
                    attached.append((prog, kind))
            except BaseException:
                for prog, kind in attached:
                    lib.bpf_prog_detach2(prog, cg, kind)
                maps.unregister(sandbox_id)
                raise
            finally:
                if cg >= 0:
                    os.close(cg)

    def attach_port(self, sandbox_id: str, ifindex: int) -> None:
        """Check the packets arriving on device ``ifindex`` of this thread's network
        namespace (a VM sandbox's veth, its egress side) against the registered sandbox's
        rules: the entry in ``ports``, then the program on the device's tcx ingress, its
        link pinned (``port_pin``). On failure neither stays."""
        lib = libbpf()
        prog = next(fd for name, fd, _ in self._programs if name == PACKET_PROGRAM)
        pin = port_pin(sandbox_id, self.pins)
        with NodeMaps.open(self.pins) as maps:
            cgroup_id = maps.cgroup_of(sandbox_id)
            if cgroup_id is None:
                raise UnknownSandbox(
                    f"egress: sandbox {sandbox_id} is not registered", sandbox_id=sandbox_id
                )
            key, value = ctypes.c_uint32(ifindex), ctypes.c_uint64(cgroup_id)
            rc = lib.bpf_map_update_elem(
                maps.fds["ports"], ctypes.byref(key), ctypes.byref(value), BPF_NOEXIST
            )
            if rc:
                raise _failed(f"registering device {ifindex} of sandbox {sandbox_id}", rc)
            link = -1
            try:
                with contextlib.suppress(FileNotFoundError):
                    pin.unlink()  # a link of an earlier attempt
                link = lib.bpf_link_create(prog, ifindex, BPF_TCX_INGRESS, None)
                if link < 0:
                    raise _failed(f"attaching {PACKET_PROGRAM} to device {ifindex}", link)
                rc = lib.bpf_obj_pin(link, os.fsencode(pin))
                if rc:
                    raise _failed(f"pinning the link of device {ifindex} at {pin}", rc)
            except BaseException:
                maps._delete("ports", bytes(key))
                raise
            finally:
                if link >= 0:
                    os.close(link)  # the pin holds it (or, unpinned, it goes)


def port_index(cgroup_id: int) -> int:
    """The index a VM sandbox's veth takes in its egress namespace (its egress side), made
    from the sandbox's cgroup id: unique on the host while the sandbox lives, as the
    ``ports`` map (the host's, shared by every node and its egress namespace) needs, and above
    the indexes a namespace gives on its own (``PORT_INDEX_BASE``)."""
    return PORT_INDEX_BASE + cgroup_id % ((1 << 31) - 1 - PORT_INDEX_BASE)


def port_pin(sandbox_id: str, pins: Path | None = None) -> Path:
    """Where the link of a VM sandbox's packet program is pinned."""
    return (pins or maps_dir()) / f"port-{sandbox_id}"


# --- the maps -----------------------------------------------------------------------------
def _sandbox_key(sandbox_id: str) -> ctypes.Array[ctypes.c_char]:
    raw = sandbox_id.encode()
    if not raw or len(raw) > SANDBOX_KEY:
        raise ToolError(f"egress: sandbox id {sandbox_id!r} does not fit the maps' keys")
    return ctypes.create_string_buffer(raw, SANDBOX_KEY)


class NodeMaps:
    """The node's pinned maps, open: ``allow4``/``allow6`` (every sandbox's rules),
    ``denied`` (refusals by cgroup id) and ``sandboxes`` (sandbox id -> cgroup id)."""

    def __init__(self, fds: dict[str, int], pins: Path) -> None:
        self.fds = fds
        self.pins = pins

    @classmethod
    def open(cls, pins: Path | None = None) -> NodeMaps:
        """``UnknownSandbox`` if they are not pinned (no sandbox was ever given the policy
        since boot, or the last one's node removed them)."""
        pins = pins or maps_dir()
        lib = libbpf()
        fds: dict[str, int] = {}
        try:
            for name in MAPS:
                fd = lib.bpf_obj_get(os.fsencode(pins / name))
                if fd < 0:
                    if abs(fd) == errno.ENOENT:
                        raise UnknownSandbox(f"egress: no maps pinned at {pins}", pins=str(pins))
                    raise _failed(f"opening pinned map {pins / name}", fd)
                fds[name] = fd
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(fds, pins)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self) -> NodeMaps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the register ---------------------------------------------------------------------
    def cgroup_of(self, sandbox_id: str) -> int | None:
        value = ctypes.c_uint64(0)
        rc = libbpf().bpf_map_lookup_elem(
            self.fds["sandboxes"], _sandbox_key(sandbox_id), ctypes.byref(value)
        )
        return value.value if rc == 0 else None

    def sandboxes(self) -> dict[str, int]:
        """Every registered sandbox: id -> cgroup id."""
        out = {}
        for key in self.keys("sandboxes", SANDBOX_KEY):
            sandbox_id = key.rstrip(b"\0").decode()
            cgroup_id = self.cgroup_of(sandbox_id)
            if cgroup_id is not None:
                out[sandbox_id] = cgroup_id
        return out

    def register(self, sandbox_id: str, cgroup_id: int) -> None:
        """Counters at zero for ``cgroup_id``, then the sandbox's entry in the register."""
        lib = libbpf()
        cg = ctypes.c_uint64(cgroup_id)
        zero = ctypes.create_string_buffer(8 * len(COUNTERS))
        rc = lib.bpf_map_update_elem(self.fds["denied"], ctypes.byref(cg), zero, BPF_ANY)
        if rc:
            raise _failed("adding the sandbox's counters", rc)
        rc = lib.bpf_map_update_elem(
            self.fds["sandboxes"], _sandbox_key(sandbox_id), ctypes.byref(cg), BPF_ANY
        )
        if rc:
            self._delete("denied", bytes(cg))
            raise _failed(f"registering sandbox {sandbox_id}", rc)

    def unregister(self, sandbox_id: str) -> None:
        """Drop the sandbox's rules, counters and entry; nothing if it is not registered."""
        cgroup_id = self.cgroup_of(sandbox_id)
        if cgroup_id is None:
            return
        sandbox = SandboxMaps(self, cgroup_id)
        sandbox.sync({"allow4": set(), "allow6": set()})
        for index, cg in self.ports().items():  # a VM's veth (its link goes with its pin)
            if cg == cgroup_id:
                self._delete("ports", struct.pack("=I", index))
        with contextlib.suppress(FileNotFoundError):
            port_pin(sandbox_id, self.pins).unlink()
        self._delete("denied", _CGROUP.pack(cgroup_id))
        self._delete("sandboxes", _sandbox_key(sandbox_id).raw)

    def ports(self) -> dict[int, int]:
        """Every VM sandbox's veth checked by ``guest_egress``: its index -> the sandbox's
        cgroup id."""
        out = {}
        for key in self.keys("ports", 4):
            value = ctypes.c_uint64(0)
            if libbpf().bpf_map_lookup_elem(self.fds["ports"], key, ctypes.byref(value)) == 0:
                out[struct.unpack("=I", key)[0]] = value.value
        return out

    def sandbox(self, sandbox_id: str) -> SandboxMaps:
        """One registered sandbox's view of the maps (``UnknownSandbox`` if it is not)."""
        cgroup_id = self.cgroup_of(sandbox_id)
        if cgroup_id is None:
            raise UnknownSandbox(
                f"egress: sandbox {sandbox_id} is not registered", sandbox_id=sandbox_id
            )
        return SandboxMaps(self, cgroup_id)

    # --- raw access -----------------------------------------------------------------------
    def keys(self, name: str, size: int) -> Iterator[bytes]:
        """Every key of map ``name``, as bytes (a snapshot: changes as it goes are fine)."""
        lib = libbpf()
        found = []
        cur, nxt = ctypes.create_string_buffer(size), ctypes.create_string_buffer(size)
        rc = lib.bpf_map_get_next_key(self.fds[name], None, nxt)
        while rc == 0:
            found.append(nxt.raw)
            ctypes.memmove(cur, nxt, size)
            rc = lib.bpf_map_get_next_key(self.fds[name], cur, nxt)
        return iter(found)

    def _put(self, name: str, key: bytes) -> None:
        value = ctypes.c_uint32(1)
        rc = libbpf().bpf_map_update_elem(self.fds[name], key, ctypes.byref(value), BPF_ANY)
        if rc:
            raise _failed(f"adding a rule to {name}", rc)

    def _delete(self, name: str, key: bytes) -> None:
        rc = libbpf().bpf_map_delete_elem(self.fds[name], key)
        if rc and abs(rc) != errno.ENOENT:
            raise _failed(f"removing an entry from {name}", rc)


class SandboxMaps:
    """One sandbox's part of the node's maps: its rules and its counters.

    Rules are the sandbox's own trie keys (``rules.trie_entries``: prefix length, protocol,
    port, address); here they get the sandbox's cgroup id in front."""

    def __init__(self, maps: NodeMaps, cgroup_id: int) -> None:
        self.maps = maps
        self.cgroup_id = cgroup_id
        self._cgroup = _CGROUP.pack(cgroup_id)

    @classmethod
    @contextlib.contextmanager
    def open(cls, sandbox_id: str, pins: Path | None = None) -> Iterator[SandboxMaps]:
        """The sandbox's maps, open for the ``with`` block (``UnknownSandbox``)."""
        with NodeMaps.open(pins) as maps:
            yield maps.sandbox(sandbox_id)

    def _full(self, key: bytes) -> bytes:
        (prefix,) = _PREFIX.unpack_from(key)
        return _PREFIX.pack(prefix + 8 * _CGROUP.size) + self._cgroup + key[_PREFIX.size :]

    def keys(self, name: str) -> Iterator[bytes]:
        """The sandbox's keys in trie ``name`` (``allow4`` or ``allow6``), its own form."""
        head = _PREFIX.size
        for key in self.maps.keys(name, KEY_SIZES[name]):
            if key[head : head + _CGROUP.size] == self._cgroup:
                (prefix,) = _PREFIX.unpack_from(key)
                yield _PREFIX.pack(prefix - 8 * _CGROUP.size) + key[head + _CGROUP.size :]

    def sync(self, wanted: Mapping[str, set[bytes]]) -> None:
        """Make the sandbox's entries exactly ``wanted`` (name -> its keys): new entries
        first, so nothing that stays allowed is ever refused in between."""
        total = sum(len(keys) for keys in wanted.values())
        if total > MAX_RULES:
            raise ToolError(
                f"egress: {total} allowlist entries (rules times resolved addresses) exceed "
                f"the {MAX_RULES} a sandbox may have",
                entries=total,
            )
        for name, keys in wanted.items():
            have = set(self.keys(name))
            for key in keys - have:
                self.maps._put(name, self._full(key))
            for key in have - keys:
                self.maps._delete(name, self._full(key))

    def denied(self) -> dict[str, int]:
        """The refusals counted so far, by hook."""
        values = (ctypes.c_uint64 * len(COUNTERS))()
        key = ctypes.c_uint64(self.cgroup_id)
        rc = libbpf().bpf_map_lookup_elem(
            self.maps.fds["denied"], ctypes.byref(key), ctypes.byref(values)
        )
        if rc:
            raise _failed("reading the denied counters", rc)
        return dict(zip(COUNTERS, (int(v) for v in values), strict=True))


def registered(sandbox_id: str) -> bool:
    """Whether the sandbox has entries in the node's maps (what a test checks is gone)."""
    try:
        with NodeMaps.open() as maps:
            return maps.cgroup_of(sandbox_id) is not None
    except UnknownSandbox:
        return False


#: Key sizes of the tries: prefixlen u32, cgroup id u64, proto, pad, port u16, then 4 or 16
#: address bytes (as in the C source).
KEY_SIZES = {"allow4": 20, "allow6": 32}
