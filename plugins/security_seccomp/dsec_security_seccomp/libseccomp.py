"""The host's libseccomp, the library runc compiles filters with: which syscall names it knows.

runc skips, with only a debug log, every name its libseccomp cannot resolve, so a name it does
not know in a sandbox's ``allow`` list would be silently not allowed. Asking the same shared
library (through ctypes) lets the policy refuse such a name up front.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from dsec_core.errors import PolicyUnavailable

__all__ = ["knows", "version"]

NR_SCMP_ERROR = -1  # what seccomp_syscall_resolve_name answers for a name it does not know


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
    return lib


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
