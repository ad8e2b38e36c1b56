"""The egress programs as kernel objects: compiled with clang (once per source digest), loaded
and attached to a cgroup through libbpf (``libbpf.so.1``, by ctypes), and their pinned maps
read and written with the bpf() calls libbpf wraps.

Programs attach with ``BPF_F_ALLOW_MULTI`` and without a link: the cgroup holds them, so they
stay enforced when the daemon exits and go when the sandbox's cgroup is removed. The maps are
pinned under ``/sys/fs/bpf/dsec/<sandbox id>/``, which is what a live update or a restarted
daemon opens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from dsec_core.errors import PolicyUnavailable, ToolError

__all__ = [
    "BPF_ROOT",
    "COUNTERS",
    "SOURCE",
    "PinnedMaps",
    "attach_programs",
    "bpffs_mounted",
    "ensure_bpffs",
    "ensure_object",
    "libbpf",
    "pin_dir",
    "remove_pins",
]

SOURCE = Path(__file__).with_name("bpf") / "egress.bpf.c"
BPF_ROOT = Path("/sys/fs/bpf")
#: The slots of the ``denied`` map, in the C enum's order.
COUNTERS = ("connect4", "connect6", "sendmsg4", "sendmsg6", "socket", "packet")
MAPS = ("allow4", "allow6", "denied")
BPF_F_ALLOW_MULTI = 2
BPF_ANY = 0

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_log: list[str] = []


def pin_dir(sandbox_id: str) -> Path:
    """Where a sandbox's maps are pinned."""
    return BPF_ROOT / "dsec" / sandbox_id


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
        ("bpf_obj_get", ci, [cc]),
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
    """``cache_dir/dsec-egress-<digest>.bpf.o``, compiled with clang first if missing; built
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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    arch = os.uname().machine
    multiarch = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(arch, arch)
    command = [
        clang,
        "-O2",
        "-g",  # BTF: libbpf reads the maps' definitions from it
        "-Wall",
        "-Werror",
        "-target",
        "bpf",
        "-I",
        f"/usr/include/{multiarch}",
        "-c",
        os.fspath(source),
        "-o",
        os.fspath(tmp),
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolError(
                "compiling the egress BPF programs failed",
                command=command,
                exit_code=proc.returncode,
                stdout=proc.stdout,
                stderr=proc.stderr,
            )
        os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def attach_programs(obj_path: Path, cgroup: Path, pins: Path) -> PinnedMaps:
    """Load the object, pin its maps under ``pins`` and attach every program to ``cgroup``;
    ``seed`` the returned maps before anything in the cgroup runs code you do not trust.

    On failure nothing stays pinned (programs already attached go with the cgroup)."""
    lib = libbpf()
    with _lock:  # libbpf's print callback and log are process-wide
        _log.clear()
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
            rc = lib.bpf_object__load(obj)
            if rc:
                raise _failed("loading the egress programs", rc)
            maps = PinnedMaps.open(pins)
            cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                prog = lib.bpf_object__next_program(obj, None)
                while prog:
                    kind = lib.bpf_program__expected_attach_type(prog)
                    rc = lib.bpf_prog_attach(lib.bpf_program__fd(prog), cg, kind, BPF_F_ALLOW_MULTI)
                    if rc:
                        name = lib.bpf_program__name(prog).decode()
                        maps.close()
                        raise _failed(f"attaching {name} to {cgroup}", rc)
                    prog = lib.bpf_object__next_program(obj, prog)
            finally:
                os.close(cg)
            return maps
        except BaseException:
            remove_pins(pins)
            raise
        finally:
            lib.bpf_object__close(obj)  # the cgroup and the pins hold what must stay


def remove_pins(pins: Path) -> None:
    """Unpin a sandbox's maps (freed once nothing else holds them) and remove the directory."""
    for name in MAPS:
        try:
            (pins / name).unlink()
        except FileNotFoundError:
            pass
    try:
        pins.rmdir()
    except FileNotFoundError:
        pass


# --- the maps -----------------------------------------------------------------------------
class PinnedMaps:
    """A sandbox's pinned maps, open: rules in ``allow4``/``allow6``, counters in ``denied``."""

    def __init__(self, fds: dict[str, int]) -> None:
        self.fds = fds

    @classmethod
    def open(cls, pins: Path) -> PinnedMaps:
        lib = libbpf()
        fds: dict[str, int] = {}
        try:
            for name in MAPS:
                fd = lib.bpf_obj_get(os.fsencode(pins / name))
                if fd < 0:
                    raise _failed(f"opening pinned map {pins / name}", fd)
                fds[name] = fd
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(fds)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self) -> PinnedMaps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys(self, name: str) -> Iterator[bytes]:
        """Every key of map ``name`` (``allow4`` or ``allow6``), as bytes."""
        lib = libbpf()
        size = KEY_SIZES[name]
        cur, nxt = ctypes.create_string_buffer(size), ctypes.create_string_buffer(size)
        rc = lib.bpf_map_get_next_key(self.fds[name], None, nxt)
        while rc == 0:
            yield nxt.raw
            ctypes.memmove(cur, nxt, size)
            rc = lib.bpf_map_get_next_key(self.fds[name], cur, nxt)

    def put(self, name: str, key: bytes) -> None:
        value = ctypes.c_uint32(1)
        rc = libbpf().bpf_map_update_elem(self.fds[name], key, ctypes.byref(value), BPF_ANY)
        if rc:
            raise _failed(f"adding a rule to {name}", rc)

    def delete(self, name: str, key: bytes) -> None:
        rc = libbpf().bpf_map_delete_elem(self.fds[name], key)
        if rc and abs(rc) != errno.ENOENT:
            raise _failed(f"removing a rule from {name}", rc)

    def sync(self, wanted: Mapping[str, set[bytes]]) -> None:
        """Make the tries hold exactly ``wanted`` (name -> keys): new entries first, so nothing
        that stays allowed is ever refused in between."""
        for name, keys in wanted.items():
            have = set(self.keys(name))
            for key in keys - have:
                self.put(name, key)
            for key in have - keys:
                self.delete(name, key)

    def denied(self) -> dict[str, int]:
        """The refusals counted so far, by hook."""
        lib = libbpf()
        out = {}
        for slot, name in enumerate(COUNTERS):
            key, value = ctypes.c_uint32(slot), ctypes.c_uint64(0)
            rc = lib.bpf_map_lookup_elem(self.fds["denied"], ctypes.byref(key), ctypes.byref(value))
            if rc:
                raise _failed("reading the denied counters", rc)
            out[name] = value.value
        return out


#: Key sizes of the tries: prefixlen (u32), proto, pad, port (u16), then 4 or 16 address bytes.
KEY_SIZES = {"allow4": 12, "allow6": 24}
