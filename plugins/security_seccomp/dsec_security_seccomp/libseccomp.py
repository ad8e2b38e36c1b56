"""The host's libseccomp, the library runc compiles filters with, through ctypes: which syscall
names it knows, and compiling a profile's rules into a BPF program (``bpf.py``).

A name libseccomp does not know is skipped when rules are compiled (runc did the same, with
only a debug log), so a name it does not know in a sandbox's ``allow`` list would be silently
not allowed: the policy refuses such a name up front.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterable, Sequence

from dsec_core.errors import PolicyUnavailable

__all__ = ["ACT_ALLOW", "act_errno", "export_bpf", "knows", "resolve", "version"]

NR_SCMP_ERROR = -1  # what seccomp_syscall_resolve_name answers for a name it does not know
ACT_ALLOW = 0x7FFF0000
ACT_ERRNO = 0x00050000
FLTATR_CTL_OPTIMIZE = 8  # enum scmp_filter_attr (libseccomp >= 2.5)
COMPARE = {  # enum scmp_compare
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}
#: OCI architecture names -> libseccomp's (seccomp_arch_resolve_name)
ARCH_NAMES = {
    "SCMP_ARCH_X86_64": "x86_64",
    "SCMP_ARCH_X86": "x86",
    "SCMP_ARCH_X32": "x32",
    "SCMP_ARCH_AARCH64": "aarch64",
    "SCMP_ARCH_ARM": "arm",
}


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class _Version(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint),
        ("minor", ctypes.c_uint),
        ("micro", ctypes.c_uint),
    ]


@functools.cache
def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise PolicyUnavailable(
            f"security policy 'seccomp' needs libseccomp, which runc compiles filters with "
            f"(apt-get install libseccomp2): {e}",
            policy="seccomp",
            missing="libseccomp",
        ) from e
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_version.argtypes = []
    lib.seccomp_version.restype = ctypes.POINTER(_Version)
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_native.argtypes = []
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_add.restype = ctypes.c_int
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_attr_set.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    return lib


def act_errno(err: int) -> int:
    """SCMP_ACT_ERRNO(err)."""
    return ACT_ERRNO | (err & 0xFFFF)


def _arch_token(arch: str) -> int:
    token = int(_library().seccomp_arch_resolve_name(ARCH_NAMES[arch].encode()))
    if token == 0:
        raise ValueError(f"libseccomp {version()} does not know architecture {arch}")
    return token


def resolve(arch: str, name: str) -> int | None:
    """Syscall ``name``'s number on ``arch`` (an OCI name, ``SCMP_ARCH_X86``), or None where it
    does not exist or libseccomp does not know it (a pseudo-number, below zero)."""
    nr = int(_library().seccomp_syscall_resolve_name_arch(_arch_token(arch), name.encode()))
    return None if nr < 0 else nr


def export_bpf(
    default: int,
    architectures: Sequence[str],
    rules: Iterable[tuple[int, str, Sequence[tuple[int, str, int, int]]]],
    *,
    optimize: bool = True,
) -> bytes:
    """Compile ``rules`` ((action, syscall name, [(arg index, SCMP_CMP_* name, a, b)])) under
    ``default`` for ``architectures`` (OCI names; the native one must be among them) into a
    BPF program, as runc did: names libseccomp does not know are skipped, each rule's
    comparisons must all hold."""
    lib = _library()
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise ValueError(f"seccomp_init refused default action {default:#x}")
    try:
        native = int(lib.seccomp_arch_native())
        for arch in architectures:
            token = _arch_token(arch)
            if token != native:
                _check(lib.seccomp_arch_add(ctx, token), f"seccomp_arch_add {arch}")
        if optimize:  # a binary tree of syscall numbers instead of a list (as runc does)
            _check(lib.seccomp_attr_set(ctx, FLTATR_CTL_OPTIMIZE, 2), "optimize")
        for action, name, conds in rules:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr == NR_SCMP_ERROR:
                continue
            array = (_ArgCmp * max(1, len(conds)))(
                *(_ArgCmp(i, COMPARE[op], a, b) for i, op, a, b in conds)
            )
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(conds), array)
            _check(rc, f"rule for {name}")
        return _export(lib, ctx)
    finally:
        lib.seccomp_release(ctx)


def _export(lib: ctypes.CDLL, ctx: int) -> bytes:
    fd = os.memfd_create("dsec-seccomp-bpf", os.MFD_CLOEXEC)
    try:
        _check(lib.seccomp_export_bpf(ctx, fd), "seccomp_export_bpf")
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise ValueError(f"libseccomp {version()}: {what}: {os.strerror(-rc)}")


def knows(name: str) -> bool:
    """Whether libseccomp can resolve syscall ``name`` (on any architecture it supports)."""
    try:
        encoded = name.encode("ascii")
    except UnicodeEncodeError:
        return False
    return bool(_library().seccomp_syscall_resolve_name(encoded) != NR_SCMP_ERROR)


def version() -> str:
    """libseccomp's version, ``major.minor.micro``."""
    v = _library().seccomp_version().contents
    return f"{v.major}.{v.minor}.{v.micro}"
