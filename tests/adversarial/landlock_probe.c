/* Attacks on a sandbox's file policy, run as root inside a sandbox by tests/adversarial/
 * test_landlock.py. Each subcommand tries one family of ways around the policy with raw system
 * calls (no shell or busybox in the way: a running busybox would answer ETXTBSY for itself) and
 * prints one "step: outcome" line per way, outcome "ok" or the errno's name; it exits with the
 * number of steps that worked.
 *
 *   overwrite PATH      write, truncate, link out and write through the link, create, mkdir,
 *                       symlink, mkfifo and link beside it, rename out, rename over, unlink
 *   chmod PATH          chmod 04777 (metadata: Landlock does not mediate it)
 *   read PATH           open and read, mmap, list its directory, a symlink and a hard link made
 *                       in /tmp, "..", /proc/self/root, /proc/1/root, relative to its
 *                       directory (chdir, openat), rename its directory out
 *   stat PATH           stat it (a name tested for existence) and list its directory
 *   bind PATH           from a new user and mount namespace, bind-mount PATH's directory onto
 *                       /tmp/.ll-view and read PATH through it
 *   signal PID          kill 0 (may I?) and SIGTERM
 *   trace PID           PTRACE_ATTACH (detached again at once) and /proc/PID/environ
 *   connect NAME        connect to the abstract unix socket "@NAME"
 *   listen NAME SECS    accept one connection on "@NAME" within SECS; prints "accepted"
 *
 * Build: gcc -O2 -Wall -static -o landlock_probe landlock_probe.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static int worked;

static void step(const char *what, int rc)
{
    int e = errno;
    if (rc >= 0) {
        printf("%s: ok\n", what);
        worked++;
    } else {
        printf("%s: %s\n", what, strerrorname_np(e) ? strerrorname_np(e) : "E?");
    }
    fflush(stdout);
}

static char *join(const char *a, const char *b)
{
    char *s;
    if (asprintf(&s, "%s%s", a, b) < 0)
        exit(100);
    return s;
}

static char *dir_of(const char *path)
{
    char *copy = strdup(path);
    return strdup(dirname(copy));
}

static char *base_of(const char *path)
{
    char *copy = strdup(path);
    return strdup(basename(copy));
}

/* Open path read-only and read a byte: what "reading it" means here. */
static int read_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    char c;
    int rc = read(fd, &c, 1) < 0 ? -1 : 0;
    close(fd);
    return rc;
}

static int write_file(const char *path, int flags)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC | flags, 0755);
    if (fd < 0)
        return -1;
    int rc = write(fd, "#!/bin/sh\necho forged\n", 22) < 0 ? -1 : 0;
    close(fd);
    return rc;
}

static int list_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0)
        close(fd);
    return fd;
}

static void overwrite(const char *path)
{
    char *dir = dir_of(path);
    step("write", write_file(path, 0));
    step("truncate", truncate(path, 0));
    unlink("/tmp/.ll-link");
    int linked = link(path, "/tmp/.ll-link");
    step("link out", linked);
    step("write through the link", linked < 0 ? -1 : write_file("/tmp/.ll-link", 0));
    step("create beside", write_file(join(dir, "/.ll-new"), O_CREAT));
    step("mkdir beside", mkdir(join(dir, "/.ll-dir"), 0755));
    step("symlink beside", symlink("/tmp/.ll-evil", join(dir, "/.ll-sym")));
    step("mkfifo beside", mkfifo(join(dir, "/.ll-fifo"), 0644));
    write_file("/tmp/.ll-evil", O_CREAT | O_TRUNC);
    step("link in beside", link("/tmp/.ll-evil", join(dir, "/.ll-hard")));
    step("rename out", rename(path, "/tmp/.ll-moved"));
    write_file("/tmp/.ll-evil", O_CREAT | O_TRUNC);
    step("rename over", rename("/tmp/.ll-evil", path));
    step("unlink", unlink(path));
}

static void read_all_ways(const char *path)
{
    char *dir = dir_of(path), *base = base_of(path), *top = base_of(dir);
    step("open and read", read_file(path));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    void *m = fd < 0 ? MAP_FAILED : mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, fd, 0);
    step("mmap", m == MAP_FAILED ? -1 : 0);
    step("list its directory", list_dir(dir));
    unlink("/tmp/.ll-sym");
    step("symlink from /tmp", symlink(path, "/tmp/.ll-sym") < 0 ? -1 : read_file("/tmp/.ll-sym"));
    unlink("/tmp/.ll-hard");
    step("hard link into /tmp", link(path, "/tmp/.ll-hard") < 0 ? -1 : read_file("/tmp/.ll-hard"));
    step("..", read_file(join(join(join(dir, "/../"), top), join("/", base))));
    step("/tmp/..", read_file(join("/tmp/..", path)));
    step("/proc/self/root", read_file(join("/proc/self/root", path)));
    step("/proc/1/root", read_file(join("/proc/1/root", path)));
    int dfd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    int at = dfd < 0 ? -1 : openat(dfd, base, O_RDONLY | O_CLOEXEC);
    step("openat from an O_PATH handle", at);
    step("chdir and read", chdir(dir) < 0 ? -1 : read_file(base));
    if (chdir("/") < 0) {
    }
    step("rename its directory out", rename(dir, "/tmp/.ll-taken"));
}

static void stat_and_list(const char *path)
{
    struct stat st;
    int rc = stat(path, &st);
    step("stat", rc);
    if (rc == 0)
        printf("size: %lld\n", (long long)st.st_size);
    char *dir = dir_of(path);
    step("list its directory", list_dir(dir));
}

static int write_text(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = write(fd, text, strlen(text)) < 0 ? -1 : 0;
    close(fd);
    return rc;
}

/* Root of a user namespace of our own, in a mount namespace of our own: every capability
 * there, mounts included, unless something refuses. Mapping the sandbox's root would need
 * CAP_SETFCAP, so uid 1000 is what gets mapped (as the seccomp probe does). */
static int nested_root(void)
{
    char map[32];
    if (setresgid(1000, 1000, 1000) < 0 || setresuid(1000, 1000, 1000) < 0)
        return -1;
    prctl(PR_SET_DUMPABLE, 1); /* the uid change cleared it; /proc/self must stay ours */
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0 || write_text("/proc/self/setgroups", "deny") < 0)
        return -1;
    snprintf(map, sizeof map, "0 1000 1");
    return write_text("/proc/self/uid_map", map) < 0 ? -1 : write_text("/proc/self/gid_map", map);
}

static void bind_view(const char *path)
{
    char *dir = dir_of(path), *base = base_of(path);
    mkdir("/tmp/.ll-view", 0755);
    pid_t pid = fork();
    if (pid == 0) {
        step("nested namespaces", nested_root());
        step("make mounts private", mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL));
        step("bind mount", mount(dir, "/tmp/.ll-view", NULL, MS_BIND, NULL));
        step("read through the view", read_file(join("/tmp/.ll-view/", base)));
        _exit(worked);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    worked += WIFEXITED(st) ? WEXITSTATUS(st) : 0;
}

static int abstract_addr(const char *name, struct sockaddr_un *a)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n + 1 > sizeof a->sun_path)
        exit(100);
    memcpy(a->sun_path + 1, name, n);
    return (int)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static void connect_to(const char *name)
{
    struct sockaddr_un a;
    int len = abstract_addr(name, &a);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    step("connect", connect(s, (struct sockaddr *)&a, len));
}

static void listen_on(const char *name, int secs)
{
    struct sockaddr_un a;
    int len = abstract_addr(name, &a);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (bind(s, (struct sockaddr *)&a, len) < 0 || listen(s, 4) < 0) {
        step("listen", -1);
        return;
    }
    step("listen", 0);
    struct pollfd p = {.fd = s, .events = POLLIN};
    if (poll(&p, 1, secs * 1000) == 1 && accept(s, NULL, NULL) >= 0)
        printf("accepted\n");
}

static void trace(pid_t pid)
{
    long rc = ptrace(PTRACE_ATTACH, pid, 0, 0);
    step("ptrace attach", (int)rc);
    if (rc == 0) {
        waitpid(pid, NULL, __WALL);
        ptrace(PTRACE_DETACH, pid, 0, 0);
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/environ", (int)pid);
    step("read /proc/PID/environ", read_file(path));
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s overwrite|chmod|read|stat|bind|signal|trace|connect|listen ARG\n",
                argv[0]);
        return 100;
    }
    const char *cmd = argv[1], *arg = argv[2];
    if (!strcmp(cmd, "overwrite"))
        overwrite(arg);
    else if (!strcmp(cmd, "chmod"))
        step("chmod 04777", chmod(arg, 04777));
    else if (!strcmp(cmd, "read"))
        read_all_ways(arg);
    else if (!strcmp(cmd, "stat"))
        stat_and_list(arg);
    else if (!strcmp(cmd, "bind"))
        bind_view(arg);
    else if (!strcmp(cmd, "signal")) {
        step("kill 0", kill(atoi(arg), 0));
        step("SIGTERM", kill(atoi(arg), SIGTERM));
    } else if (!strcmp(cmd, "trace"))
        trace(atoi(arg));
    else if (!strcmp(cmd, "connect"))
        connect_to(arg);
    else if (!strcmp(cmd, "listen") && argc > 3)
        listen_on(arg, atoi(argv[3]));
    else
        return 100;
    return worked;
}
