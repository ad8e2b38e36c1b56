/* A probe of dangerous kernel surfaces, run as root inside a sandbox (or a docker container).
 *
 * `probe NAME...` (or `probe all`) attempts each named operation in a child process of its own,
 * so one probe's namespaces, keyrings or crash never touch the next, and prints one line per
 * probe: `NAME ok` if the kernel let it happen, `NAME EPERM` (the errno's name) if not, or
 * `NAME signal:N` if the child died. `probe bench N` times N getppid() and N ioctl(FIONREAD)
 * calls and prints nanoseconds per call, to show what the filter costs a syscall.
 *
 * The `i386_*` probes enter the kernel through `int $0x80`, the 32-bit compat ABI, from this
 * 64-bit binary: a seccomp filter that knew only x86_64 numbers would let them through. Their
 * pointer arguments live in static storage, below 4 GiB in this non-PIE binary. The `nested_*`
 * probes first make a user namespace (with mount and network namespaces) and then try what its
 * capabilities would allow. The file ioctls take their files from the environment: PROBE_SRC
 * (read-only source), PROBE_DST (destination) and PROBE_DST_MODE (`rw`, or `ro` to open the
 * destination read-only, as a file the caller may not write).
 *
 * Build: gcc -O2 -static -no-pie -o probe probe.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/capability.h>
#include <linux/fs.h>
#include <linux/if_ether.h>
#include <linux/io_uring.h>
#include <linux/keyctl.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>
#include <linux/perf_event.h>
#include <linux/sched.h>
#include <linux/userfaultfd.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif

/* The swap-extent and move-extent ioctls: their structures are not in the uapi headers we
 * build against, and only the command numbers matter here (the filter never reads the
 * argument). sizeof(struct xfs_swapext) is 192 on x86_64; struct move_extent is 40. */
#define XFS_IOC_SWAPEXT_64 _IOC(_IOC_READ | _IOC_WRITE, 'X', 109, 192)
#define EXT4_IOC_MOVE_EXT_64 _IOC(_IOC_READ | _IOC_WRITE, 'f', 15, 40)

/* --- results ------------------------------------------------------------------------------- */

static int err(long rc)
{
    return rc < 0 ? errno : 0;
}

/* A raw syscall's result (-errno on failure) as an errno, or 0. */
static int kerr(long rc)
{
    return rc < 0 && rc > -4096 ? (int)-rc : 0;
}

/* A failing step of a multi-step probe, on stderr; the errno is the probe's result. */
static int note(const char *step, int e)
{
    fprintf(stderr, "%s: %s\n", step, strerrorname_np(e));
    return e;
}

static int write_text(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    ssize_t n = write(fd, text, strlen(text));
    int e = n < 0 ? errno : 0;
    close(fd);
    return e;
}

/* --- the 32-bit ABI ------------------------------------------------------------------------ */

static long int80(long nr, long a, long b, long c, long d, long e)
{
    long ret;
    __asm__ volatile("int $0x80"
                     : "=a"(ret)
                     : "0"(nr), "b"(a), "c"(b), "d"(c), "S"(d), "D"(e)
                     : "memory", "r8", "r9", "r10", "r11");
    return ret;
}

enum {
    I386_EXIT = 1,
    I386_GETPID = 20,
    I386_IOCTL = 54,
    I386_CLONE = 120,
    I386_INIT_MODULE = 128,
    I386_ADD_KEY = 286,
    I386_KEYCTL = 288,
    I386_UNSHARE = 310,
    I386_PERF_EVENT_OPEN = 336,
    I386_BPF = 357,
    I386_SOCKET = 359,
    I386_USERFAULTFD = 374,
    I386_IO_URING_SETUP = 425,
};

static char s_user[] = "user";
static char s_desc[] = "dsec-probe";
static char s_payload[] = "x";
static char s_empty[] = "";
static struct io_uring_params s_uring;
static struct perf_event_attr s_perf;
static union bpf_attr s_bpf;

/* --- namespaces ---------------------------------------------------------------------------- */

static int unshare_flags(int flags)
{
    return err(unshare(flags));
}

static int p_unshare_user(void) { return unshare_flags(CLONE_NEWUSER); }
static int p_unshare_mnt(void) { return unshare_flags(CLONE_NEWNS); }
static int p_unshare_net(void) { return unshare_flags(CLONE_NEWNET); }
static int p_unshare_pid(void) { return unshare_flags(CLONE_NEWPID); }
static int p_unshare_ipc(void) { return unshare_flags(CLONE_NEWIPC); }
static int p_unshare_uts(void) { return unshare_flags(CLONE_NEWUTS); }
static int p_unshare_cgroup(void) { return unshare_flags(CLONE_NEWCGROUP); }
static int p_unshare_time(void) { return unshare_flags(CLONE_NEWTIME); }
static int p_unshare_fs(void) { return unshare_flags(CLONE_FS | CLONE_FILES); }

static int reap(long pid)
{
    if (pid < 0)
        return errno;
    if (pid == 0)
        _exit(0);
    int status;
    waitpid((pid_t)pid, &status, 0);
    return 0;
}

static int p_clone_user(void)
{
    return reap(syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0));
}

static int clone3_flags(unsigned long long flags)
{
    struct clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = flags;
    args.exit_signal = SIGCHLD;
    return reap(syscall(SYS_clone3, &args, sizeof args));
}

static int p_clone3_user(void) { return clone3_flags(CLONE_NEWUSER); }
static int p_clone3_plain(void) { return clone3_flags(0); }
static int p_fork(void) { return reap(fork()); }

static int p_setns_net(void)
{
    int fd = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    return err(setns(fd, CLONE_NEWNET));
}

static int has_cap(int cap)
{
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &hdr, data) < 0)
        return errno;
    return data[cap / 32].effective & (1u << (cap % 32)) ? 0 : EPERM;
}

static int p_cap_sys_admin(void) { return has_cap(CAP_SYS_ADMIN); }

/* A user namespace of our own, with mount and network namespaces it owns: the way an attacker
 * regains every capability. Mapping the sandbox's root into it would need CAP_SETFCAP (since
 * Linux 5.12), which the sandbox lacks, so we first become uid 1000 and map that; the
 * capabilities inside come with the namespace, whatever the map says. */
static int enter_nested(void)
{
    char map[64];
    if (geteuid() == 0) {
        if (setresgid(1000, 1000, 1000) < 0)
            return note("setresgid", errno);
        if (setresuid(1000, 1000, 1000) < 0)
            return note("setresuid", errno);
        prctl(PR_SET_DUMPABLE, 1); /* a uid change clears it; /proc/self must stay ours */
    }
    uid_t uid = geteuid();
    gid_t gid = getegid();
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET) < 0)
        return note("unshare", errno);
    int e = write_text("/proc/self/setgroups", "deny");
    if (e)
        return note("setgroups", e);
    snprintf(map, sizeof map, "%u %u 1", uid, uid);
    if ((e = write_text("/proc/self/uid_map", map)))
        return note("uid_map", e);
    snprintf(map, sizeof map, "%u %u 1", gid, gid);
    if ((e = write_text("/proc/self/gid_map", map)))
        return note("gid_map", e);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        return note("make-private", errno);
    return 0;
}

static int p_nested_caps(void)
{
    int e = enter_nested();
    return e ? e : has_cap(CAP_SYS_ADMIN);
}

static int p_nested_tmpfs(void)
{
    int e = enter_nested();
    return e ? e : err(mount("none", "/tmp", "tmpfs", 0, "size=1m"));
}

static int p_nested_bind(void)
{
    int e = enter_nested();
    if (e)
        return e;
    mkdir("/tmp/dsec-probe-bind", 0755);
    e = err(mount("/etc", "/tmp/dsec-probe-bind", NULL, MS_BIND, NULL));
    return e;
}

static int p_nested_overlay(void)
{
    int e = enter_nested();
    if (e)
        return e;
    if (mount("none", "/tmp", "tmpfs", 0, "size=1m") < 0)
        return errno;
    mkdir("/tmp/l", 0755);
    mkdir("/tmp/u", 0755);
    mkdir("/tmp/w", 0755);
    mkdir("/tmp/m", 0755);
    return err(mount("overlay", "/tmp/m", "overlay", 0, "lowerdir=/tmp/l,upperdir=/tmp/u,workdir=/tmp/w"));
}

/* --- sockets ------------------------------------------------------------------------------- */

static int sock(int family, int type, int proto)
{
    int fd = socket(family, type | SOCK_CLOEXEC, proto);
    if (fd < 0)
        return errno;
    close(fd);
    return 0;
}

static int p_socket_packet(void) { return sock(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)); }
static int p_socket_raw(void) { return sock(AF_INET, SOCK_RAW, IPPROTO_ICMP); }
static int p_socket_vsock(void) { return sock(AF_VSOCK, SOCK_STREAM, 0); }
static int p_socket_tcp(void) { return sock(AF_INET, SOCK_STREAM, 0); }

/* AF_VSOCK with junk in the upper half of the register: the kernel reads an int. */
static int p_socket_vsock_hibits(void)
{
    long fd = syscall(SYS_socket, 0x100000000L | AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return errno;
    close((int)fd);
    return 0;
}

static void nl_put(char *buf, size_t *off, uint16_t type, uint16_t flags, uint32_t seq,
                   uint8_t family, const char *table)
{
    struct nlmsghdr *nlh = (struct nlmsghdr *)(buf + *off);
    nlh->nlmsg_type = type;
    nlh->nlmsg_flags = flags;
    nlh->nlmsg_seq = seq;
    nlh->nlmsg_pid = 0;
    struct nfgenmsg *nfg = NLMSG_DATA(nlh);
    nfg->nfgen_family = family;
    nfg->version = NFNETLINK_V0;
    nfg->res_id = htons(table ? 0 : NFNL_SUBSYS_NFTABLES);
    size_t len = NLMSG_LENGTH(sizeof *nfg);
    if (table) {
        struct nlattr *nla = (struct nlattr *)((char *)nlh + NLMSG_ALIGN(len));
        nla->nla_type = NFTA_TABLE_NAME;
        nla->nla_len = NLA_HDRLEN + strlen(table) + 1;
        memcpy((char *)nla + NLA_HDRLEN, table, strlen(table) + 1);
        len = NLMSG_ALIGN(len) + NLA_ALIGN(nla->nla_len);
    }
    nlh->nlmsg_len = len;
    *off += NLMSG_ALIGN(len);
}

/* Send one nf_tables message (NEWTABLE or DELTABLE of table "dsecprobe") in a batch. */
static int nft_table_msg(int msg)
{
    char buf[512] __attribute__((aligned(4)));
    size_t off = 0;
    memset(buf, 0, sizeof buf);
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
    if (fd < 0)
        return errno;
    nl_put(buf, &off, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 1, AF_UNSPEC, NULL);
    nl_put(buf, &off, (NFNL_SUBSYS_NFTABLES << 8) | msg,
           NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK, 2, 1 /* NFPROTO_INET */, "dsecprobe");
    nl_put(buf, &off, NFNL_MSG_BATCH_END, NLM_F_REQUEST, 3, AF_UNSPEC, NULL);
    struct sockaddr_nl sa = {.nl_family = AF_NETLINK};
    if (sendto(fd, buf, off, 0, (struct sockaddr *)&sa, sizeof sa) < 0)
        return errno;
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char reply[4096] __attribute__((aligned(4)));
    ssize_t n = recv(fd, reply, sizeof reply, 0);
    if (n < 0)
        return errno;
    for (struct nlmsghdr *h = (struct nlmsghdr *)reply; NLMSG_OK(h, (size_t)n);
         h = NLMSG_NEXT(h, n)) {
        if (h->nlmsg_type == NLMSG_ERROR) {
            struct nlmsgerr *e = NLMSG_DATA(h);
            if (e->error)
                return -e->error;
        }
    }
    close(fd);
    return 0;
}

/* Create an nf_tables table in the current network namespace, and delete it again. */
static int nft_new_table(void)
{
    int e = nft_table_msg(NFT_MSG_NEWTABLE);
    if (!e)
        nft_table_msg(NFT_MSG_DELTABLE);
    return e;
}

static int p_nft_table(void) { return nft_new_table(); }

static int p_nested_raw(void)
{
    int e = enter_nested();
    return e ? e : p_socket_raw();
}

static int p_nested_packet(void)
{
    int e = enter_nested();
    return e ? e : p_socket_packet();
}

static int p_nested_nft(void)
{
    int e = enter_nested();
    return e ? e : nft_new_table();
}

/* --- mounts -------------------------------------------------------------------------------- */

/* On a directory of its own, unmounted again if it worked: the probe leaves nothing behind. */
static int p_mount_tmpfs(void)
{
    mkdir("/tmp/dsec-probe-mnt", 0755);
    if (mount("none", "/tmp/dsec-probe-mnt", "tmpfs", 0, "size=1m") < 0)
        return errno;
    umount2("/tmp/dsec-probe-mnt", MNT_DETACH);
    return 0;
}
static int p_fsopen(void) { return err(syscall(SYS_fsopen, "tmpfs", 0)); }
static int p_open_tree(void)
{
    return err(syscall(SYS_open_tree, AT_FDCWD, "/tmp", 1 /* OPEN_TREE_CLONE */));
}

/* --- kernel facilities --------------------------------------------------------------------- */

static int p_keyctl(void)
{
    return err(syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, "dsec-probe"));
}

static int p_add_key(void)
{
    return err(syscall(SYS_add_key, "user", "dsec-probe", "x", 1, KEY_SPEC_PROCESS_KEYRING));
}

static int p_request_key(void)
{
    long rc = syscall(SYS_request_key, "user", "dsec-probe-none", NULL, 0);
    /* no such key is "the kernel looked": reachable */
    return rc < 0 && errno != ENOKEY ? errno : 0;
}

static int p_io_uring_setup(void)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    return err(syscall(SYS_io_uring_setup, 4, &p));
}

static int p_userfaultfd(void)
{
    return err(syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY));
}

static int p_bpf(void)
{
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.map_type = BPF_MAP_TYPE_ARRAY;
    a.key_size = 4;
    a.value_size = 4;
    a.max_entries = 1;
    return err(syscall(SYS_bpf, BPF_MAP_CREATE, &a, sizeof a));
}

static void perf_attr(struct perf_event_attr *a)
{
    memset(a, 0, sizeof *a);
    a->type = PERF_TYPE_SOFTWARE;
    a->size = sizeof *a;
    a->config = PERF_COUNT_SW_CPU_CLOCK;
    a->disabled = 1;
    a->exclude_kernel = 1;
    a->exclude_hv = 1;
}

static int p_perf_event_open(void)
{
    struct perf_event_attr a;
    perf_attr(&a);
    return err(syscall(SYS_perf_event_open, &a, 0, -1, -1, 0));
}

static int p_init_module(void) { return err(syscall(SYS_init_module, NULL, 0, "")); }
static int p_finit_module(void) { return err(syscall(SYS_finit_module, 0, "", 0)); }
static int p_delete_module(void) { return err(syscall(SYS_delete_module, "dsec_probe", 0)); }
static int p_kexec_load(void) { return err(syscall(SYS_kexec_load, 0, 0, NULL, 0)); }
static int p_kexec_file_load(void)
{
    return err(syscall(SYS_kexec_file_load, -1, -1, 0, "", 0x4 /* UNLOAD */));
}

static int p_pidfd_getfd(void)
{
    int pfd = syscall(SYS_pidfd_open, getpid(), 0);
    if (pfd < 0)
        return errno;
    return err(syscall(SYS_pidfd_getfd, pfd, 0, 0));
}

static int p_ptrace_child(void)
{
    pid_t child = fork();
    if (child == 0) {
        pause();
        _exit(0);
    }
    int e = err(ptrace(PTRACE_SEIZE, child, 0, 0));
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    return e;
}

static int p_personality_noaslr(void)
{
    int old = personality(0xffffffff);
    return err(personality(old | ADDR_NO_RANDOMIZE));
}

static int p_syslog(void) { return err(syscall(SYS_syslog, 10 /* SIZE_BUFFER */, NULL, 0)); }

static int p_fanotify_init(void)
{
    /* FAN_CLASS_NOTIF | FAN_REPORT_FID: what an unprivileged caller may ask for */
    return err(syscall(SYS_fanotify_init, 0x00000200, O_RDONLY));
}

/* A made-up handle: the kernel asks for CAP_DAC_READ_SEARCH before it looks at it. */
static int p_open_by_handle_at(void)
{
    char buf[sizeof(struct file_handle) + 8];
    memset(buf, 0, sizeof buf);
    struct file_handle *fh = (struct file_handle *)buf;
    fh->handle_bytes = 8;
    fh->handle_type = 1;
    return err(open_by_handle_at(AT_FDCWD, fh, O_RDONLY));
}

/* --- file ioctls --------------------------------------------------------------------------- */

static const char *env_or(const char *name, const char *fallback)
{
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

/* Opens PROBE_SRC read-only and PROBE_DST as PROBE_DST_MODE says; 0 or an errno. */
static int open_pair(int *src, int *dst)
{
    const char *dst_path = env_or("PROBE_DST", "/tmp/dsec-probe-dst");
    int ro = strcmp(env_or("PROBE_DST_MODE", "rw"), "ro") == 0;
    *src = open(env_or("PROBE_SRC", "/bin/busybox"), O_RDONLY | O_CLOEXEC);
    if (*src < 0)
        return errno;
    *dst = open(dst_path, (ro ? O_RDONLY : O_RDWR | O_CREAT) | O_CLOEXEC, 0644);
    return *dst < 0 ? errno : 0;
}

static int p_ficlone(void)
{
    int src, dst, e = open_pair(&src, &dst);
    return e ? e : err(ioctl(dst, FICLONE, src));
}

static int p_ficlonerange(void)
{
    int src, dst, e = open_pair(&src, &dst);
    if (e)
        return e;
    struct file_clone_range r = {.src_fd = src, .src_offset = 0, .src_length = 4096};
    return err(ioctl(dst, FICLONERANGE, &r));
}

static int p_fideduperange(void)
{
    int src, dst, e = open_pair(&src, &dst);
    if (e)
        return e;
    char buf[sizeof(struct file_dedupe_range) + sizeof(struct file_dedupe_range_info)];
    memset(buf, 0, sizeof buf);
    struct file_dedupe_range *r = (struct file_dedupe_range *)buf;
    r->src_offset = 0;
    r->src_length = 4096;
    r->dest_count = 1;
    r->info[0].dest_fd = dst;
    r->info[0].dest_offset = 0;
    if (ioctl(src, FIDEDUPERANGE, r) < 0)
        return errno;
    /* the call "works" only if the kernel deduped: a per-destination status says so */
    return r->info[0].status < 0 ? -r->info[0].status : 0;
}

static int p_xfs_swapext(void)
{
    int src, dst, e = open_pair(&src, &dst);
    if (e)
        return e;
    int64_t sx[24]; /* 192 bytes: version, fdtarget, fdtmp, offset, length, pad, bstat */
    memset(sx, 0, sizeof sx);
    sx[1] = dst;
    sx[2] = src;
    return err(ioctl(dst, XFS_IOC_SWAPEXT_64, sx));
}

static int p_ext4_move_ext(void)
{
    int src, dst, e = open_pair(&src, &dst);
    if (e)
        return e;
    uint64_t me[5] = {0, 0, 0, 1, 0}; /* reserved|donor_fd, orig_start, donor_start, len, moved */
    me[0] = (uint64_t)(uint32_t)src << 32;
    return err(ioctl(dst, EXT4_IOC_MOVE_EXT_64, me));
}

/* The same command with junk in the upper 32 bits: the kernel takes an unsigned int. */
static int p_ficlone_hibits(void)
{
    int src, dst, e = open_pair(&src, &dst);
    return e ? e : err(syscall(SYS_ioctl, dst, 0xdead000000000000UL | FICLONE, src));
}

/* --- the same through the 32-bit ABI ------------------------------------------------------- */

static int p_i386_getpid(void) { return kerr(int80(I386_GETPID, 0, 0, 0, 0, 0)); }

static int p_i386_unshare_user(void)
{
    return kerr(int80(I386_UNSHARE, CLONE_NEWUSER, 0, 0, 0, 0));
}

static int p_i386_clone_user(void)
{
    long pid = int80(I386_CLONE, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0)
        int80(I386_EXIT, 0, 0, 0, 0, 0);
    if (pid < 0)
        return (int)-pid;
    waitpid((pid_t)pid, NULL, 0);
    return 0;
}

static int p_i386_keyctl(void)
{
    return kerr(int80(I386_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, (long)s_desc, 0, 0, 0));
}

static int p_i386_add_key(void)
{
    return kerr(int80(I386_ADD_KEY, (long)s_user, (long)s_desc, (long)s_payload, 1,
                      KEY_SPEC_PROCESS_KEYRING));
}

static int p_i386_io_uring_setup(void)
{
    return kerr(int80(I386_IO_URING_SETUP, 4, (long)&s_uring, 0, 0, 0));
}

static int p_i386_userfaultfd(void)
{
    return kerr(int80(I386_USERFAULTFD, O_CLOEXEC | UFFD_USER_MODE_ONLY, 0, 0, 0, 0));
}

static int p_i386_bpf(void)
{
    s_bpf.map_type = BPF_MAP_TYPE_ARRAY;
    s_bpf.key_size = 4;
    s_bpf.value_size = 4;
    s_bpf.max_entries = 1;
    return kerr(int80(I386_BPF, BPF_MAP_CREATE, (long)&s_bpf, sizeof s_bpf, 0, 0));
}

static int p_i386_perf_event_open(void)
{
    perf_attr(&s_perf);
    return kerr(int80(I386_PERF_EVENT_OPEN, (long)&s_perf, 0, -1, -1, 0));
}

static int p_i386_init_module(void)
{
    return kerr(int80(I386_INIT_MODULE, 0, 0, (long)s_empty, 0, 0));
}

static int p_i386_socket_packet(void)
{
    return kerr(int80(I386_SOCKET, AF_PACKET, SOCK_RAW, htons(ETH_P_ALL), 0, 0));
}

static int p_i386_ficlone(void)
{
    int src, dst, e = open_pair(&src, &dst);
    return e ? e : kerr(int80(I386_IOCTL, dst, FICLONE, src, 0, 0));
}

/* x32 numbers (bit 30 set) on the 64-bit ABI; kernels without x32 answer ENOSYS. */
static int p_x32_unshare_user(void)
{
    return err(syscall(0x40000000 | SYS_unshare, CLONE_NEWUSER));
}

/* A call newer than every name the profile holds (statmount, 457 on every architecture since
 * Linux 6.8): a filter answering ENOSYS there lets libc fall back as on an older kernel. */
static int p_statmount(void)
{
    return err(syscall(457, 0, 0, 0, 0));
}

/* --- table --------------------------------------------------------------------------------- */

struct probe {
    const char *name;
    int (*fn)(void);
};

static const struct probe PROBES[] = {
    {"fork", p_fork},
    {"socket_tcp", p_socket_tcp},
    {"unshare_fs", p_unshare_fs},
    {"unshare_user", p_unshare_user},
    {"unshare_mnt", p_unshare_mnt},
    {"unshare_net", p_unshare_net},
    {"unshare_pid", p_unshare_pid},
    {"unshare_ipc", p_unshare_ipc},
    {"unshare_uts", p_unshare_uts},
    {"unshare_cgroup", p_unshare_cgroup},
    {"unshare_time", p_unshare_time},
    {"clone_user", p_clone_user},
    {"clone3_user", p_clone3_user},
    {"clone3_plain", p_clone3_plain},
    {"setns_net", p_setns_net},
    {"cap_sys_admin", p_cap_sys_admin},
    {"nested_caps", p_nested_caps},
    {"nested_tmpfs", p_nested_tmpfs},
    {"nested_bind", p_nested_bind},
    {"nested_overlay", p_nested_overlay},
    {"nested_raw", p_nested_raw},
    {"nested_packet", p_nested_packet},
    {"nested_nft", p_nested_nft},
    {"mount_tmpfs", p_mount_tmpfs},
    {"fsopen", p_fsopen},
    {"open_tree", p_open_tree},
    {"socket_packet", p_socket_packet},
    {"socket_raw", p_socket_raw},
    {"socket_vsock", p_socket_vsock},
    {"socket_vsock_hibits", p_socket_vsock_hibits},
    {"nft_table", p_nft_table},
    {"keyctl", p_keyctl},
    {"add_key", p_add_key},
    {"request_key", p_request_key},
    {"io_uring_setup", p_io_uring_setup},
    {"userfaultfd", p_userfaultfd},
    {"bpf", p_bpf},
    {"perf_event_open", p_perf_event_open},
    {"init_module", p_init_module},
    {"finit_module", p_finit_module},
    {"delete_module", p_delete_module},
    {"kexec_load", p_kexec_load},
    {"kexec_file_load", p_kexec_file_load},
    {"pidfd_getfd", p_pidfd_getfd},
    {"ptrace_child", p_ptrace_child},
    {"personality_noaslr", p_personality_noaslr},
    {"syslog", p_syslog},
    {"fanotify_init", p_fanotify_init},
    {"open_by_handle_at", p_open_by_handle_at},
    {"ficlone", p_ficlone},
    {"ficlonerange", p_ficlonerange},
    {"fideduperange", p_fideduperange},
    {"xfs_swapext", p_xfs_swapext},
    {"ext4_move_ext", p_ext4_move_ext},
    {"ficlone_hibits", p_ficlone_hibits},
    {"i386_getpid", p_i386_getpid},
    {"i386_unshare_user", p_i386_unshare_user},
    {"i386_clone_user", p_i386_clone_user},
    {"i386_keyctl", p_i386_keyctl},
    {"i386_add_key", p_i386_add_key},
    {"i386_io_uring_setup", p_i386_io_uring_setup},
    {"i386_userfaultfd", p_i386_userfaultfd},
    {"i386_bpf", p_i386_bpf},
    {"i386_perf_event_open", p_i386_perf_event_open},
    {"i386_init_module", p_i386_init_module},
    {"i386_socket_packet", p_i386_socket_packet},
    {"i386_ficlone", p_i386_ficlone},
    {"x32_unshare_user", p_x32_unshare_user},
    {"statmount", p_statmount},
};

#define NPROBES (sizeof PROBES / sizeof PROBES[0])

static void run(const struct probe *p)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        printf("%s fork-failed:%s\n", p->name, strerrorname_np(errno));
        return;
    }
    if (pid == 0) {
        int e = p->fn();
        _exit(e & 0xff);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (WIFSIGNALED(status))
        printf("%s signal:%d\n", p->name, WTERMSIG(status));
    else if (WEXITSTATUS(status) == 0)
        printf("%s ok\n", p->name);
    else {
        const char *name = strerrorname_np(WEXITSTATUS(status));
        printf("%s %s\n", p->name, name ? name : "E?");
    }
}

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int bench(long n)
{
    int fds[2], avail;
    if (pipe(fds) < 0)
        return 1;
    double t = now_ns();
    for (long i = 0; i < n; i++)
        syscall(SYS_getppid);
    double getppid_ns = (now_ns() - t) / n;
    t = now_ns();
    for (long i = 0; i < n; i++)
        ioctl(fds[0], FIONREAD, &avail);
    double ioctl_ns = (now_ns() - t) / n;
    printf("getppid_ns %.1f\nioctl_ns %.1f\n", getppid_ns, ioctl_ns);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "bench") == 0)
        return bench(atol(argv[2]));
    if (argc < 2) {
        fprintf(stderr, "usage: %s all | NAME... | bench N\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i < argc; i++) {
        int found = 0;
        for (size_t j = 0; j < NPROBES; j++) {
            if (strcmp(argv[i], "all") == 0 || strcmp(argv[i], PROBES[j].name) == 0) {
                run(&PROBES[j]);
                found = 1;
            }
        }
        if (!found) {
            printf("%s unknown-probe\n", argv[i]);
            return 2;
        }
    }
    return 0;
}
