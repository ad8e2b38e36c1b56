"""The profile compiled into the classic BPF program the sandbox's agent installs on itself.

runc compiled the OCI profile with libseccomp at every container start (about +15-25 ms a
sandbox on the 2-core machine); the program depends only on the settings, so it is compiled
here once per settings and cached in the daemon, and handed to the agent in its policy document
(``dsec_core.backend.AgentPolicy.seccomp``). Compilation follows runc's: the same libseccomp
(through ctypes), the same rules (names libseccomp does not know are skipped; a rule's
comparisons are one AND-ed condition set, each argument compared once), binary-tree
optimisation for long rule lists, and runc's ENOSYS stub in front of libseccomp's program: per
architecture, a syscall number above the highest the profile names gets ENOSYS instead of the
default EPERM, so libc falls back on calls newer than the profile (``fchmodat2``, ``mseal``)
as it would on an older kernel.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import libseccomp

__all__ = ["Insn", "compile_profile", "decode", "enosys_stub"]

X32_SYSCALL_BIT = 0x40000000
AUDIT_ARCH = {  # the values the kernel puts in seccomp_data.arch
    "SCMP_ARCH_X86_64": 0xC000003E,
    "SCMP_ARCH_X32": 0xC000003E,  # x86_64's, with X32_SYSCALL_BIT set in the number
    "SCMP_ARCH_X86": 0x40000003,
    "SCMP_ARCH_AARCH64": 0xC00000B7,
    "SCMP_ARCH_ARM": 0x40000028,
}
# classic BPF opcodes (linux/bpf_common.h)
LD_W_ABS = 0x20
JMP_JA = 0x05
JMP_JEQ_K = 0x15
JMP_JGT_K = 0x25
JMP_JSET_K = 0x45
RET_K = 0x06
SECCOMP_DATA_NR = 0
SECCOMP_DATA_ARCH = 4
INSN = struct.Struct("=HBBI")  # struct sock_filter, native byte order as the kernel reads it


@dataclass(frozen=True)
class Insn:
    """One struct sock_filter."""

    code: int
    jt: int = 0
    jf: int = 0
    k: int = 0

    def pack(self) -> bytes:
        return INSN.pack(self.code, self.jt, self.jf, self.k)


def decode(program: bytes) -> list[Insn]:
    """A packed program as instructions."""
    return [Insn(*INSN.unpack_from(program, i)) for i in range(0, len(program), INSN.size)]


def _action(rule: Mapping[str, Any]) -> int:
    if rule["action"] == "SCMP_ACT_ALLOW":
        return libseccomp.ACT_ALLOW
    if rule["action"] == "SCMP_ACT_ERRNO":
        return libseccomp.act_errno(int(rule.get("errnoRet", errno.EPERM)))
    raise ValueError(f"the agent's compiler takes ALLOW and ERRNO rules, not {rule['action']}")


def _conditions(rule: Mapping[str, Any]) -> list[tuple[int, str, int, int]]:
    args = rule.get("args", [])
    if len({a["index"] for a in args}) != len(args):
        # runc splits such a rule into one rule per comparison; the profile never writes one
        raise ValueError(f"rule for {rule['names']} compares one argument twice")
    return [(a["index"], a["op"], a["value"], a.get("valueTwo", 0)) for a in args]


def highest_numbers(profile: Mapping[str, Any]) -> dict[str, int]:
    """Per architecture of the profile, the highest syscall number its rules name (runc's
    findLastSyscalls): above it, the stub answers ENOSYS."""
    names = {n for rule in profile["syscalls"] for n in rule["names"]}
    out = {}
    for arch in profile["architectures"]:
        numbers = [libseccomp.resolve(arch, n) for n in names]
        known = [nr for nr in numbers if nr is not None and nr > 0]
        if known:
            out[arch] = max(known)
    return out


def enosys_stub(highest: Mapping[str, int]) -> list[Insn]:
    """Instructions to put in front of libseccomp's program: load the architecture; for each
    one we know, load the number and return ERRNO(ENOSYS) above its highest; anything else
    falls through to the filter proper, which reloads what it needs (checked by
    ``compile_profile``)."""
    enosys = libseccomp.act_errno(errno.ENOSYS)
    sections: list[list[Insn]] = []
    arches = sorted({AUDIT_ARCH[a] for a in highest})
    for audit in arches:
        plain = [a for a in highest if AUDIT_ARCH[a] == audit and a != "SCMP_ARCH_X32"]
        x32 = highest.get("SCMP_ARCH_X32") if audit == AUDIT_ARCH["SCMP_ARCH_X32"] else None
        sections.append(_arch_section(audit, highest[plain[0]] if plain else None, x32))
    # layout: ld arch; sections...; ja +1 (to the filter); ret ENOSYS; <filter>.
    # Each section's jumps are relative: "to the filter" and "to ENOSYS" depend on what
    # follows it, so sections are resolved from the last one backwards.
    tail = [Insn(JMP_JA, k=1), Insn(RET_K, k=enosys)]
    body: list[Insn] = []
    for section in reversed(sections):
        after = len(body) + len(tail)  # instructions between this section's end and the filter
        body = _resolve(section, to_enosys=after - 1, to_filter=after) + body
    return [Insn(LD_W_ABS, k=SECCOMP_DATA_ARCH), *body, *tail]


# Placeholder targets in a section, resolved by _resolve: jumps to the ENOSYS return or to the
# filter, counted from the end of the section.
TO_ENOSYS, TO_FILTER, TO_NEXT = -1, -2, -3


def _arch_section(audit: int, highest: int | None, x32_highest: int | None) -> list[Insn]:
    """For one audit arch: skip the section unless A == audit; load nr; ENOSYS above the
    highest number of its ABI (x32 numbers carry X32_SYSCALL_BIT); else to the filter."""
    check: list[Insn] = [Insn(LD_W_ABS, k=SECCOMP_DATA_NR)]
    if audit == AUDIT_ARCH["SCMP_ARCH_X86_64"]:
        if x32_highest is None:  # x32 left out: libseccomp's filter decides (bad arch)
            check.append(Insn(JMP_JSET_K, jt=TO_FILTER, jf=0, k=X32_SYSCALL_BIT))
        else:
            check.append(Insn(JMP_JSET_K, jt=0, jf=1, k=X32_SYSCALL_BIT))
            check.append(Insn(JMP_JGT_K, jt=TO_ENOSYS, jf=TO_FILTER, k=x32_highest))
    if highest is None:
        check.append(Insn(JMP_JA, k=TO_FILTER))
    else:
        check.append(Insn(JMP_JGT_K, jt=TO_ENOSYS, jf=TO_FILTER, k=highest))
    return [Insn(JMP_JEQ_K, jt=0, jf=TO_NEXT, k=audit), *check]


def _resolve(section: list[Insn], to_enosys: int, to_filter: int) -> list[Insn]:
    """Turn the placeholders into relative jumps: ``to_enosys`` and ``to_filter`` count the
    instructions between the section's end and those targets."""
    out = []
    n = len(section)
    for i, insn in enumerate(section):
        left = n - i - 1  # instructions after this one within the section

        def target(v: int, left: int = left) -> int:
            if v == TO_ENOSYS:
                return left + to_enosys
            if v == TO_FILTER:
                return left + to_filter
            if v == TO_NEXT:
                return left
            return v

        if insn.code == JMP_JA:
            out.append(Insn(JMP_JA, k=target(insn.k)))
        else:
            out.append(Insn(insn.code, target(insn.jt), target(insn.jf), insn.k))
    for insn in out:
        if insn.code != JMP_JA and max(insn.jt, insn.jf) > 255:
            raise ValueError("ENOSYS stub jump out of range")
    return out


def compile_profile(profile: Mapping[str, Any], *, optimize: bool = True) -> bytes:
    """The OCI ``linux.seccomp`` profile (``build_profile``'s) as a packed BPF program: the ENOSYS
    stub, then libseccomp's program for it."""
    if profile.get("defaultAction") != "SCMP_ACT_ERRNO":
        raise ValueError("the agent's compiler takes ERRNO default actions only")
    default = libseccomp.act_errno(int(profile.get("defaultErrnoRet", errno.EPERM)))
    rules = [
        (_action(rule), name, _conditions(rule))
        for rule in profile["syscalls"]
        for name in rule["names"]
        if _action(rule) != default  # runc drops these; libseccomp would refuse them
    ]
    program = libseccomp.export_bpf(default, profile["architectures"], rules, optimize=optimize)
    filt = decode(program)
    if not filt or filt[0] != Insn(LD_W_ABS, k=SECCOMP_DATA_ARCH):
        # the stub leaves the accumulator holding the number; the filter must reload the arch
        raise ValueError("libseccomp's program does not start by loading the architecture")
    stub = enosys_stub(highest_numbers(profile))
    return b"".join(i.pack() for i in stub) + program
