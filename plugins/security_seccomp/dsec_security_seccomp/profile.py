"""The default seccomp profile: an allowlist in the style of Docker's default, as OCI JSON.

Why an allowlist (default action: fail with EPERM) rather than a list of dangerous calls: the
kernel gains syscalls every release (6.18 has about twenty that the libseccomp runc links
against has never heard of), and a denylist leaves each one open until someone notices. Here a
call nobody named fails, and runc answers ENOSYS for numbers past the last one the profile
names, so libc falls back as it would on an older kernel.

Where this differs from Docker's default (measured by the plugin's tests, which run one probe
under both):

- io_uring, keyctl/add_key/request_key, userfaultfd, bpf, perf_event_open, the module and kexec
  calls are denied, as in Docker (whose io_uring stance changed between releases: here it is
  always denied);
- ``unshare`` is allowed, but, like ``clone``, only without namespace flags (Docker denies it
  whole); ``clone3`` fails with ENOSYS, because its flags sit in memory a filter cannot read and
  glibc falls back to ``clone`` on ENOSYS; ``setns`` and the mount calls are denied. Namespaces
  would give a process every capability inside them, and with them tmpfs, bind and overlay
  mounts, raw and packet sockets and nf_tables: kernel surface a sandbox has no business in.
  ``userns: true`` in the sandbox's settings lifts all of this for environments that nest
  containers;
- ``ioctl`` is allowed except for the commands that move file extents around file access
  control: FICLONE, FICLONERANGE, FIDEDUPERANGE, XFS_IOC_SWAPEXT, the XFS exchange-range
  commands, EXT4_IOC_MOVE_EXT and EXT4_IOC_SWAP_BOOT. They are matched on their type and number
  only (the low 16 bits), so every size and direction variant, the 32-bit compat structures
  included, is caught, and junk in the upper 32 bits of the argument (the kernel takes an
  ``unsigned int``) does not slip past; ``socket`` refuses AF_VSOCK (the host's hypervisor
  sockets, when the node is a VM), also with junk in the upper bits, which Docker's rule misses;
- ``pidfd_getfd``, ``kcmp`` and ``process_madvise`` are denied (Docker allows them only with
  CAP_SYS_PTRACE, which sandboxes lack); ``ptrace`` and ``process_vm_*`` stay allowed, as in
  Docker on kernels from 4.8 on (seccomp is checked again after a tracer changes a syscall), so
  gdb, strace and LeakSanitizer work;
- ``chroot`` is allowed: the sandbox has CAP_SYS_CHROOT.

The filter covers every ABI of the machine: on x86_64 the rules are compiled for x86_64, i386
(``int $0x80``) and x32, so a 32-bit call does not bypass them. An ABI the kernel does not run
(x32, on most kernels: the policy asks) is left out, as each one costs runc about a third of
the compile time at every start; a call through it then meets libseccomp's bad-architecture
action and the caller is killed with SIGSYS, where the kernel would have said ENOSYS.

Known gap, shared with Docker: on i386, ``socketcall`` multiplexes socket calls through a
pointer the filter cannot read, so the rule refusing AF_VSOCK sockets does not hold there (raw
and packet sockets need CAP_NET_RAW, which the sandbox lacks either way).

How rules are written matters because of how runc hands them to libseccomp: a rule whose action
equals the default is dropped, and one comparison per argument is allowed per rule. So a call
with exceptions is written as several ALLOW rules whose union is "everything but the
exceptions" (``complement_cubes``), never as an ALLOW plus a deny.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "CLONE_NS_FLAGS",
    "DENIED_IOCTLS",
    "NAMESPACE_CALLS",
    "UNSHARE_NS_FLAGS",
    "build_profile",
    "complement_cubes",
]

# Namespace flags: a sandbox without CAP_SYS_ADMIN may create none of them, except through a
# user namespace, which is exactly what is refused. CLONE_NEWTIME shares its bit with clone's
# exit signal, so it is filtered for unshare only.
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
CLONE_NS_FLAGS = (
    CLONE_NEWNS
    | CLONE_NEWCGROUP
    | CLONE_NEWUTS
    | CLONE_NEWIPC
    | CLONE_NEWUSER
    | CLONE_NEWPID
    | CLONE_NEWNET
)
UNSHARE_NS_FLAGS = CLONE_NS_FLAGS | CLONE_NEWTIME

#: ioctl commands denied, by (type, number): the low 16 bits of the command.
DENIED_IOCTLS: dict[str, tuple[int, int]] = {
    "FICLONE": (0x94, 9),
    "FICLONERANGE": (0x94, 13),
    "FIDEDUPERANGE": (0x94, 54),
    "XFS_IOC_SWAPEXT": (ord("X"), 109),
    "XFS_IOC_EXCHANGE_RANGE": (ord("X"), 129),
    "XFS_IOC_START_COMMIT": (ord("X"), 130),
    "XFS_IOC_COMMIT_RANGE": (ord("X"), 131),
    "EXT4_IOC_MOVE_EXT": (ord("f"), 15),
    "EXT4_IOC_SWAP_BOOT": (ord("f"), 17),
}

#: The seccomp architectures a filter covers, by the machine's ``uname -m``: its native ABI and
#: every compat ABI its kernel may offer.
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "x86_64": ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"),
    "aarch64": ("SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"),
}

#: Allowed without conditions. Names of every ABI the filter covers sit in one list
#: (``chown32`` exists only on i386, ``arch_prctl`` only on x86_64): libseccomp resolves each
#: name per architecture and skips it where it does not exist.
ALLOWED: frozenset[str] = frozenset(
    """
    accept accept4 access adjtimex alarm bind brk capget capset chdir chmod chown chown32 chroot
    clock_adjtime clock_adjtime64 clock_getres clock_getres_time64 clock_gettime clock_gettime64
    clock_nanosleep clock_nanosleep_time64 close close_range connect copy_file_range creat dup
    dup2 dup3 epoll_create epoll_create1 epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2
    epoll_wait epoll_wait_old eventfd eventfd2 execve execveat exit exit_group faccessat
    faccessat2 fadvise64 fadvise64_64 fallocate fanotify_mark fchdir fchmod fchmodat fchmodat2
    fchown fchown32 fchownat fcntl fcntl64 fdatasync fgetxattr flistxattr flock fork fremovexattr
    fsetxattr fstat fstat64 fstatat64 fstatfs fstatfs64 fsync ftruncate ftruncate64 futex
    futex_requeue futex_time64 futex_wait futex_waitv futex_wake futimesat getcpu getcwd getdents
    getdents64 getegid getegid32 geteuid geteuid32 getgid getgid32 getgroups getgroups32
    getitimer getpeername getpgid getpgrp getpid getppid getpriority getrandom getresgid
    getresgid32 getresuid getresuid32 getrlimit get_robust_list getrusage getsid getsockname
    getsockopt get_thread_area gettid gettimeofday getuid getuid32 getxattr inotify_add_watch
    inotify_init inotify_init1 inotify_rm_watch io_cancel io_destroy io_getevents io_pgetevents
    io_pgetevents_time64 ioprio_get ioprio_set io_setup io_submit ipc kill landlock_add_rule
    landlock_create_ruleset landlock_restrict_self lchown lchown32 lgetxattr link linkat listen
    listxattr llistxattr _llseek lremovexattr lseek lsetxattr lstat lstat64 madvise
    map_shadow_stack membarrier memfd_create memfd_secret mincore mkdir mkdirat mknod mknodat
    mlock mlock2 mlockall mmap mmap2 modify_ldt mprotect mq_getsetattr mq_notify mq_open
    mq_timedreceive mq_timedreceive_time64 mq_timedsend mq_timedsend_time64 mq_unlink mremap
    msgctl msgget msgrcv msgsnd msync munlock munlockall munmap name_to_handle_at nanosleep
    newfstatat _newselect open openat openat2 pause pidfd_open pidfd_send_signal pipe pipe2
    pkey_alloc pkey_free pkey_mprotect poll ppoll ppoll_time64 prctl pread64 preadv preadv2
    prlimit64 process_mrelease process_vm_readv process_vm_writev pselect6 pselect6_time64
    ptrace pwrite64 pwritev pwritev2 read readahead readlink readlinkat readv recv recvfrom
    recvmmsg recvmmsg_time64 recvmsg remap_file_pages removexattr rename renameat renameat2
    restart_syscall rmdir rseq rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo
    rt_sigreturn rt_sigsuspend rt_sigtimedwait rt_sigtimedwait_time64 rt_tgsigqueueinfo
    sched_getaffinity sched_getattr sched_getparam sched_get_priority_max sched_get_priority_min
    sched_getscheduler sched_rr_get_interval sched_rr_get_interval_time64 sched_setaffinity
    sched_setattr sched_setparam sched_setscheduler sched_yield seccomp select semctl semget
    semop semtimedop semtimedop_time64 send sendfile sendfile64 sendmmsg sendmsg sendto setfsgid
    setfsgid32 setfsuid setfsuid32 setgid setgid32 setgroups setgroups32 setitimer setpgid
    setpriority setregid setregid32 setresgid setresgid32 setresuid setresuid32 setreuid
    setreuid32 setrlimit set_robust_list setsid setsockopt set_thread_area set_tid_address
    setuid setuid32 setxattr shmat shmctl shmdt shmget shutdown sigaltstack signalfd signalfd4
    sigprocmask sigreturn socketcall socketpair splice stat stat64 statfs statfs64 statx symlink
    symlinkat sync sync_file_range syncfs sysinfo tee tgkill time timer_create timer_delete
    timer_getoverrun timer_gettime timer_gettime64 timer_settime timer_settime64 timerfd_create
    timerfd_gettime timerfd_gettime64 timerfd_settime timerfd_settime64 times tkill truncate
    truncate64 ugetrlimit umask uname unlink unlinkat utime utimensat utimensat_time64 utimes
    vfork vmsplice wait4 waitid waitpid write writev
    arch_prctl arm_fadvise64_64 arm_sync_file_range sync_file_range2 breakpoint cacheflush set_tls
    """.split()
)

#: Calls that make, enter or rearrange namespaces and mounts: denied unless ``userns`` (then
#: the kernel's own capability checks decide, as they would without a filter).
NAMESPACE_CALLS: frozenset[str] = frozenset(
    """
    setns mount umount umount2 pivot_root fsopen fsconfig fsmount fspick move_mount open_tree
    mount_setattr sethostname setdomainname
    """.split()
)

# personality(2) values programs set: Linux, the 32-bit and uname-2.6 flavours, and the query.
# ADDR_NO_RANDOMIZE is not among them, as in Docker.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

AF_VSOCK = 40
IOCTL_CMD_BITS = 16


def complement_cubes(denied: Iterable[int], bits: int) -> list[tuple[int, int]]:
    """(mask, value) pairs whose union, ``x & mask == value`` for some pair, is every
    ``bits``-bit number except ``denied``: one SCMP_CMP_MASKED_EQ rule each. A walk down the
    binary trie of the denied values emits the sibling of each step, at most ``bits`` pairs
    per denied value."""
    denied = set(denied)
    full = (1 << bits) - 1
    if any(d < 0 or d > full for d in denied):
        raise ValueError(f"denied values must fit in {bits} bits")
    out: list[tuple[int, int]] = []

    def walk(prefix: int, depth: int) -> None:
        shift = bits - depth
        if not any(d >> shift == prefix for d in denied):
            out.append((full ^ ((1 << shift) - 1), prefix << shift))
        elif depth < bits:
            walk(prefix << 1, depth + 1)
            walk(prefix << 1 | 1, depth + 1)

    walk(0, 0)
    return out


def _rule(names: Iterable[str], *args: dict[str, Any], **extra: Any) -> dict[str, Any]:
    rule: dict[str, Any] = {"names": sorted(names), "action": "SCMP_ACT_ALLOW", **extra}
    if args:
        rule["args"] = list(args)
    return rule


def _masked_eq(index: int, mask: int, value: int) -> dict[str, Any]:
    # OCI: for SCMP_CMP_MASKED_EQ, "value" is the mask and "valueTwo" what the masked bits equal
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def build_profile(
    machine: str,
    *,
    userns: bool = False,
    allow: Iterable[str] = (),
    without: Iterable[str] = (),
) -> dict[str, Any]:
    """The OCI ``linux.seccomp`` section for a machine (``uname -m``): the default allowlist,
    namespaces and mounts if ``userns``, and every call in ``allow`` without conditions.
    ``without`` names architectures to leave out because the kernel does not run them (each
    one costs runc time at every start, and the kernel refuses their calls itself)."""
    if machine not in ARCHITECTURES:
        raise ValueError(f"no seccomp architectures known for machine {machine!r}")
    native = ARCHITECTURES[machine][0]
    if native in set(without):
        raise ValueError(f"the native architecture {native} cannot be left out")
    exceptions = set(allow)
    unconditional = set(ALLOWED) | exceptions
    if userns:
        unconditional |= NAMESPACE_CALLS | {"clone", "clone3", "unshare"}
    rules = [_rule(unconditional)]
    if "clone" not in unconditional:
        rules.append(_rule(["clone"], _masked_eq(0, CLONE_NS_FLAGS, 0)))
    if "unshare" not in unconditional:
        rules.append(_rule(["unshare"], _masked_eq(0, UNSHARE_NS_FLAGS, 0)))
    if "clone3" not in unconditional:
        # Its flags are behind a pointer; ENOSYS makes glibc fall back to clone, filtered above.
        rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    if "ioctl" not in unconditional:
        denied = {t << 8 | n for t, n in DENIED_IOCTLS.values()}
        for mask, value in complement_cubes(denied, IOCTL_CMD_BITS):
            rules.append(_rule(["ioctl"], _masked_eq(1, mask, value)))
    if "socket" not in unconditional:
        # Not SCMP_CMP_NE: that compares all 64 bits, and the kernel reads an int, so
        # 0x1_00000028 would pass as "not 40" and open an AF_VSOCK socket.
        for mask, value in complement_cubes({AF_VSOCK}, 32):
            rules.append(_rule(["socket"], _masked_eq(0, mask, value)))
    if "personality" not in unconditional:
        for value in PERSONALITIES:
            rules.append(_rule(["personality"], {"index": 0, "value": value, "op": "SCMP_CMP_EQ"}))
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": errno.EPERM,
        "architectures": [a for a in ARCHITECTURES[machine] if a not in set(without)],
        "syscalls": rules,
    }
