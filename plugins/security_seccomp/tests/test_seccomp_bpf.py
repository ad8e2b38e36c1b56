"""The BPF program the agent installs, run through a small classic-BPF interpreter: it answers
each call as the OCI profile says (and as runc's compilation did), ENOSYS past the profile's
newest call, and kills callers of an ABI it was not built for. Without starting anything."""

from __future__ import annotations

import errno
import struct

import pytest
from dsec_security_seccomp import SeccompPolicy, bpf, libseccomp
from dsec_security_seccomp.policy import absent_architectures
from dsec_security_seccomp.profile import (
    CLONE_NEWUSER,
    DENIED_IOCTLS,
    build_profile,
)

from dsec_core.backend import AgentPolicy

ALLOW = libseccomp.ACT_ALLOW
EPERM = libseccomp.act_errno(errno.EPERM)
ENOSYS = libseccomp.act_errno(errno.ENOSYS)
KILL_THREAD = 0
X86_64 = bpf.AUDIT_ARCH["SCMP_ARCH_X86_64"]
I386 = bpf.AUDIT_ARCH["SCMP_ARCH_X86"]
AARCH64 = bpf.AUDIT_ARCH["SCMP_ARCH_AARCH64"]
CLONE_FS = 0x200
FIONREAD = 0x541B
FICLONE = 0x40049409


def run_bpf(program: bytes, nr: int, arch: int, *args: int) -> int:
    """What a classic BPF seccomp program returns for struct seccomp_data (nr, arch, ip=0,
    args). Covers the instructions libseccomp and the stub emit; anything else fails."""
    argv = [*args, *[0] * (6 - len(args))]
    data = struct.pack("=iIQ6Q", nr, arch, 0, *argv)
    a = x = 0
    mem = [0] * 16
    insns = bpf.decode(program)
    pc = 0
    while True:
        i = insns[pc]
        pc += 1
        cls, op = i.code & 0x07, i.code & 0xF0
        if i.code == 0x20:  # ld [k]
            a = struct.unpack_from("=I", data, i.k)[0]
        elif i.code == 0x06:  # ret k
            return i.k
        elif i.code == 0x16:  # ret a
            return a
        elif i.code == 0x05:  # ja
            pc += i.k
        elif cls == 0x05:  # jumps, k or x
            v = x if i.code & 0x08 else i.k
            hit = {0x10: a == v, 0x20: a > v, 0x30: a >= v, 0x40: bool(a & v)}[op]
            pc += i.jt if hit else i.jf
        elif cls == 0x04:  # alu, k or x
            v = x if i.code & 0x08 else i.k
            a = {0x50: a & v, 0x40: a | v, 0x00: a + v, 0x10: a - v}[op] & 0xFFFFFFFF
        elif i.code == 0x00:  # ld #k
            a = i.k
        elif i.code == 0x60:  # ld M[k]
            a = mem[i.k]
        elif i.code == 0x61:  # ldx M[k]
            x = mem[i.k]
        elif i.code == 0x02:  # st M[k]
            mem[i.k] = a
        elif i.code == 0x03:  # stx M[k]
            mem[i.k] = x
        elif i.code == 0x07:  # tax
            x = a
        elif i.code == 0x87:  # txa
            a = x
        else:
            raise AssertionError(f"the test interpreter does not know opcode {i.code:#x}")


@pytest.fixture(scope="module")
def program() -> bytes:
    return bpf.compile_profile(build_profile("x86_64", without=absent_architectures("x86_64")))


def nr(name: str, arch: str = "SCMP_ARCH_X86_64") -> int:
    number = libseccomp.resolve(arch, name)
    assert number is not None, name
    return number


def test_ordinary_calls_pass_and_dangerous_ones_get_eperm(program):
    for name in ("read", "write", "openat", "fork", "execve", "getppid", "landlock_add_rule"):
        assert run_bpf(program, nr(name), X86_64) == ALLOW, name
    for name in ("keyctl", "bpf", "io_uring_setup", "userfaultfd", "kexec_load", "pidfd_getfd"):
        assert run_bpf(program, nr(name), X86_64) == EPERM, name
        assert run_bpf(program, nr(name, "SCMP_ARCH_X86"), I386) == EPERM, name


def test_arguments_are_compared_as_the_profile_says(program):
    unshare, ioctl = nr("unshare"), nr("ioctl")
    assert run_bpf(program, unshare, X86_64, CLONE_FS) == ALLOW
    assert run_bpf(program, unshare, X86_64, CLONE_NEWUSER) == EPERM
    assert run_bpf(program, ioctl, X86_64, 3, FIONREAD) == ALLOW
    for name, (t, n) in DENIED_IOCTLS.items():
        cmd = t << 8 | n
        assert run_bpf(program, ioctl, X86_64, 3, cmd) == EPERM, name
        assert run_bpf(program, ioctl, X86_64, 3, 0xC0DE << 16 | cmd) == EPERM, name
    # junk in the upper half of the 64-bit register: the kernel reads an unsigned int
    assert run_bpf(program, ioctl, X86_64, 3, 1 << 32 | FICLONE) == EPERM
    assert run_bpf(program, nr("clone3"), X86_64) == ENOSYS


def test_calls_newer_than_the_profile_get_enosys_as_runc_answered(program):
    profile = build_profile("x86_64", without=absent_architectures("x86_64"))
    highest = bpf.highest_numbers(profile)
    for arch, audit in (("SCMP_ARCH_X86_64", X86_64), ("SCMP_ARCH_X86", I386)):
        top = highest[arch]
        assert run_bpf(program, top + 1, audit) == ENOSYS
        assert run_bpf(program, 457, audit) == ENOSYS  # statmount: newer than every name
        assert run_bpf(program, 1000, audit) == ENOSYS
    # below the top, a number the profile does not name is denied like any other
    assert run_bpf(program, nr("syslog"), X86_64) == EPERM


def test_an_abi_the_filter_was_not_built_for_kills_the_caller(program):
    assert run_bpf(program, 39, AARCH64) == KILL_THREAD
    if "SCMP_ARCH_X32" in absent_architectures("x86_64"):
        assert run_bpf(program, 0x40000000 | nr("unshare"), X86_64, CLONE_NEWUSER) == KILL_THREAD
        assert run_bpf(program, 0x40000000 | 1000, X86_64) == KILL_THREAD


def test_the_stub_jumps_land_where_they_should_with_x32_in_the_filter():
    profile = build_profile("x86_64")  # x32 kept, whatever the kernel runs
    program = bpf.compile_profile(profile)
    top = bpf.highest_numbers(profile)
    x32_unshare = nr("unshare", "SCMP_ARCH_X32")
    assert x32_unshare & 0x40000000
    assert run_bpf(program, x32_unshare, X86_64, CLONE_NEWUSER) == EPERM
    assert run_bpf(program, top["SCMP_ARCH_X32"] + 1, X86_64) == ENOSYS
    assert run_bpf(program, nr("read"), X86_64) == ALLOW
    assert run_bpf(program, top["SCMP_ARCH_X86_64"] + 1, X86_64) == ENOSYS


def test_settings_change_the_program_and_each_is_compiled_once():
    policy = SeccompPolicy()
    plain = policy.program({})
    assert policy.program({}) is plain  # cached in the daemon
    lifted = policy.program({"allow": ["io_uring_setup"]})
    assert run_bpf(plain, nr("io_uring_setup"), X86_64) == EPERM
    assert run_bpf(lifted, nr("io_uring_setup"), X86_64) == ALLOW
    assert run_bpf(lifted, nr("io_uring_setup", "SCMP_ARCH_X86"), I386) == ALLOW
    nested = policy.program({"userns": True})
    assert run_bpf(nested, nr("unshare"), X86_64, CLONE_NEWUSER) == ALLOW
    assert run_bpf(nested, nr("mount"), X86_64) == ALLOW


def test_the_program_travels_in_the_agent_document():
    policy = SeccompPolicy()
    doc = AgentPolicy()
    policy.apply("agent", _Runtime(), {}, doc)
    assert doc.seccomp == policy.program({})
    encoded = doc.encode()
    assert encoded.startswith(b"DSECPOL1\x07seccomp") and encoded.endswith(doc.seccomp)
    with pytest.raises(Exception, match="already has a seccomp program"):
        policy.apply("agent", _Runtime(), {}, doc)


def test_the_oci_path_is_taken_only_where_the_backend_has_no_agent_point():
    policy = SeccompPolicy()
    config: dict = {}
    policy.apply("oci", _Runtime(targets=frozenset({"agent", "oci"})), {}, config)
    assert "linux" not in config  # through the agent instead
    policy.apply("oci", _Runtime(targets=frozenset({"oci"})), {}, config)
    assert config["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ERRNO"
    assert policy.stats(_Runtime())["via"] == "oci"


class _Runtime:
    """The two fields of a SandboxRuntime the policy reads."""

    def __init__(self, targets: frozenset[str] = frozenset({"agent", "oci"})) -> None:
        self.id = "t-bpf"
        self.targets = targets
