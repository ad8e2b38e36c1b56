"""The profile as data: what runc will be handed, checked without starting anything."""

from __future__ import annotations

import errno
import gzip

import pytest
from dsec_security_seccomp import SeccompPolicy, build_profile, libseccomp
from dsec_security_seccomp.policy import absent_architectures
from dsec_security_seccomp.profile import (
    ALLOWED,
    CLONE_NEWUSER,
    DENIED_IOCTLS,
    NAMESPACE_CALLS,
    complement_cubes,
)

from dsec_core.errors import InvalidSpec, PolicyUnavailable


def _allows(profile, name, *args):
    """Whether the profile's rules let syscall ``name`` with ``args`` through, evaluated the way
    libseccomp does: any ALLOW rule whose comparisons all hold. Arguments are 64-bit, as the
    registers a 64-bit caller fills."""
    for rule in profile["syscalls"]:
        if name not in rule["names"] or rule["action"] != "SCMP_ACT_ALLOW":
            continue
        ok = True
        for cmp in rule.get("args", []):
            arg = args[cmp["index"]]
            if cmp["op"] == "SCMP_CMP_MASKED_EQ":
                ok &= arg & cmp["value"] == cmp.get("valueTwo", 0)
            elif cmp["op"] == "SCMP_CMP_EQ":
                ok &= arg == cmp["value"]
            else:
                raise AssertionError(f"the test does not evaluate {cmp['op']}")
        if ok:
            return True
    return False


def test_complement_cubes_cover_everything_but_the_denied_values():
    denied = {t << 8 | n for t, n in DENIED_IOCTLS.values()}
    cubes = complement_cubes(denied, 16)
    for x in range(1 << 16):
        assert any(x & m == v for m, v in cubes) == (x not in denied), hex(x)
    assert len(cubes) <= 16 * len(denied)
    assert complement_cubes(set(), 8) == [(0, 0)]  # nothing denied: one rule matching all
    with pytest.raises(ValueError):
        complement_cubes({1 << 8}, 8)


def test_the_default_profile_denies_by_default_and_covers_every_abi():
    p = build_profile("x86_64")
    assert p["defaultAction"] == "SCMP_ACT_ERRNO" and p["defaultErrnoRet"] == errno.EPERM
    assert p["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    for rule in p["syscalls"]:
        # runc drops a rule whose action is the default one, and libseccomp takes one
        # comparison per argument per rule: the profile must not rely on either.
        assert (rule["action"], rule.get("errnoRet")) != ("SCMP_ACT_ERRNO", errno.EPERM)
        indexes = [a["index"] for a in rule.get("args", [])]
        assert len(indexes) == len(set(indexes)), rule
    clone3 = [r for r in p["syscalls"] if r["names"] == ["clone3"]]
    assert clone3 == [{"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS}]
    with pytest.raises(ValueError, match="sparc"):
        build_profile("sparc")


def test_what_the_profile_lets_through():
    p = build_profile("x86_64")
    for name in ("keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
                 "userfaultfd", "bpf", "perf_event_open", "init_module", "finit_module",
                 "kexec_load", "kexec_file_load", "pidfd_getfd", "mount", "setns",
                 "pivot_root", "fsopen", "open_by_handle_at", "syslog"):  # fmt: skip
        assert not _allows(p, name, 0, 0), name
    for name in ("read", "execve", "arch_prctl", "chroot", "ptrace", "landlock_create_ruleset"):
        assert _allows(p, name, 0, 0), name
    # namespace flags, in clone and unshare
    assert _allows(p, "clone", 0x11 | 0x01000000 | 0x00200000, 0)  # what fork() passes
    assert not _allows(p, "clone", CLONE_NEWUSER | 0x11, 0)
    assert _allows(p, "unshare", 0x200 | 0x400, 0)  # CLONE_FS | CLONE_FILES
    for flag in (CLONE_NEWUSER, 0x00020000, 0x40000000, 0x00000080):
        assert not _allows(p, "unshare", flag, 0), hex(flag)
    # ioctl: the extent movers, in every size and direction, with junk in the upper bits
    for name, (kind, nr) in DENIED_IOCTLS.items():
        for high in (0, 0xC0C00000, 0x40080000, 0xDEAD_0000_0000_0000):
            assert not _allows(p, "ioctl", 3, high | kind << 8 | nr), name
    assert _allows(p, "ioctl", 1, 0x5401)  # TCGETS
    assert _allows(p, "ioctl", 3, 0x541B)  # FIONREAD
    assert _allows(p, "ioctl", 3, 0x80086601)  # FS_IOC_GETFLAGS ('f' 1): lsattr still works
    # socket: all but AF_VSOCK, also when the upper bits hide it
    assert _allows(p, "socket", 2, 1) and _allows(p, "socket", 1, 1)
    assert not _allows(p, "socket", 40, 1) and not _allows(p, "socket", 1 << 32 | 40, 1)
    assert _allows(p, "personality", 0xFFFFFFFF) and not _allows(p, "personality", 0x0040000)


def test_userns_and_allow_lift_what_they_say():
    p = build_profile("x86_64", userns=True)
    for name in NAMESPACE_CALLS | {"clone3"}:
        assert _allows(p, name, 0, 0), name
    assert _allows(p, "clone", CLONE_NEWUSER, 0) and _allows(p, "unshare", CLONE_NEWUSER, 0)
    assert not _allows(p, "keyctl", 0) and not _allows(p, "io_uring_setup", 0)
    clone3 = [r for r in p["syscalls"] if "clone3" in r["names"]]
    assert [r["action"] for r in clone3] == ["SCMP_ACT_ALLOW"]

    p = build_profile("x86_64", allow=["io_uring_setup", "ioctl"])
    assert _allows(p, "io_uring_setup", 0) and not _allows(p, "io_uring_enter", 0)
    assert _allows(p, "ioctl", 3, 0x40049409)  # FICLONE: ioctl is an exception now
    assert [r for r in p["syscalls"] if r["names"] == ["ioctl"]] == []  # no conditions left


def test_every_name_is_one_libseccomp_knows():
    # a misspelt name would be skipped by runc without a word
    unknown = sorted(n for n in ALLOWED | NAMESPACE_CALLS if not libseccomp.knows(n))
    assert unknown == [], f"libseccomp {libseccomp.version()} does not know {unknown}"
    assert not libseccomp.knows("no_such_call") and not libseccomp.knows("ünïcode")


@pytest.mark.parametrize(
    "settings, field, words",
    [
        ({"allo": ["ptrace"]}, "policies.seccomp.allo", "no setting 'allo'"),
        ({"userns": "yes"}, "policies.seccomp.userns", "true or false"),
        ({"allow": "ptrace"}, "policies.seccomp.allow", "list of syscall names"),
        ({"allow": ["ptrace", 5]}, "policies.seccomp.allow[1]", "not a syscall name"),
        ({"allow": ["Open; rm"]}, "policies.seccomp.allow[0]", "not a syscall name"),
        ({"allow": ["no_such_call"]}, "policies.seccomp.allow[0]", "does not know"),
        ({"allow": ["clone3"]}, "policies.seccomp.allow[0]", "userns: true"),
        ({"allow": ["unshare"], "userns": False}, "policies.seccomp.allow[0]", "namespaces"),
    ],
)
def test_bad_settings_are_typed_errors_naming_the_field(settings, field, words):
    with pytest.raises(InvalidSpec) as e:
        SeccompPolicy().validate(settings)
    assert e.value.field == field and words in str(e.value)


def test_good_settings_pass():
    policy = SeccompPolicy()
    for settings in ({}, {"userns": True}, {"allow": []}, {"allow": ["io_uring_setup", "bpf"]},
                     {"allow": ("clone3",), "userns": True}):  # fmt: skip
        policy.validate(settings)


def test_abis_the_kernel_does_not_run_are_left_out():
    # x32 costs runc a third of the filter's compile time, and few kernels run it
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            x32 = "CONFIG_X86_X32_ABI=y" in f.read()
    except OSError:
        pytest.skip("no /proc/config.gz to check against")
    assert absent_architectures("x86_64") == (frozenset() if x32 else {"SCMP_ARCH_X32"})
    assert absent_architectures("aarch64") == frozenset()
    p = build_profile("x86_64", without={"SCMP_ARCH_X32"})
    assert p["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"]
    with pytest.raises(ValueError, match="native"):
        build_profile("x86_64", without={"SCMP_ARCH_X86_64"})


def test_apply_writes_linux_seccomp_and_refuses_to_replace_another():
    class Rt:
        id = "abc"

    policy = SeccompPolicy()
    config: dict = {"linux": {}}
    policy.apply_oci(Rt(), {"userns": True}, config)  # type: ignore[arg-type]
    assert config["linux"]["seccomp"] == policy.profile({"userns": True})
    assert (
        config["linux"]["seccomp"]["syscalls"] == build_profile("x86_64", userns=True)["syscalls"]
    )
    assert policy.stats(Rt())["userns"] is True  # type: ignore[arg-type]
    with pytest.raises(PolicyUnavailable, match="already has a seccomp profile"):
        policy.apply_oci(Rt(), {}, config)  # type: ignore[arg-type]
    policy.released(Rt())  # type: ignore[arg-type]
    assert policy.stats(Rt()) == {}  # type: ignore[arg-type]
