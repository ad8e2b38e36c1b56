/*
 * The sandbox's Landlock domain, and the one way into it: domain_spawn.
 *
 * A Landlock domain is made by landlock_restrict_self and inherited by fork; it cannot be
 * joined afterwards, and two calls of landlock_restrict_self, even with the same ruleset, make
 * two domains whose processes cannot signal each other under a signal scope. So that every
 * command and session shell of the sandbox shares one domain (and can signal and trace each
 * other as before) while the agent itself stays outside it (so scoped commands cannot signal
 * or trace it, and the node's file operations are not under the file rules), one thread of the
 * agent, the domain thread, restricts itself once at start, and every process that runs
 * sandbox code is forked from that thread:
 *
 *   main thread (no domain): accept loop, file-operation handlers (read, write, list, ...)
 *   domain thread (the domain): forks exec and session_exec handlers and session shells, which
 *                               fork the commands; all of them are in the domain
 *
 * Landlock up to ABI 7 restricts only the calling thread, which is what makes this work. A child
 * forked from the domain thread is still the agent's child (its parent is the agent's thread
 * group), so waitpid, SIGCHLD on the signalfd and subreaping are as for any other handler; its
 * parent-death signal follows the domain thread, which lives as long as the agent. Main hands the
 * thread a function and argument through two pipes and waits for the pid while the thread
 * forks, so the child copies a consistent image of main's memory (its requests, sessions and
 * descriptors), and no lock is held by another thread at the fork.
 *
 * Without a Landlock policy there is no domain thread, and domain_spawn is a plain fork.
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif

static int g_req[2] = {-1, -1}, g_ans[2] = {-1, -1};
static void (*g_fn)(void *);
static void *g_arg;
static int g_ruleset_fd = -1;
static int g_on;

static void write_int(int fd, int v)
{
    if (write_all(fd, &v, sizeof v) < 0)
        logmsg("domain thread: cannot answer: %s", strerror(errno));
}

static int read_int(int fd, int *v)
{
    return read_exact(fd, v, sizeof *v);
}

/* In a child of the domain thread: the pipes are main's business, then run the job. */
__attribute__((noreturn))
static void domain_child(void)
{
    close(g_req[0]);
    close(g_req[1]);
    close(g_ans[0]);
    close(g_ans[1]);
    g_fn(g_arg);
    _exit(0);
}

static void *domain_thread(void *unused)
{
    (void)unused;
    int err = 0;
    if (syscall(SYS_landlock_restrict_self, g_ruleset_fd, 0) < 0)
        err = errno;
    write_int(g_ans[1], -err);
    if (err)
        return NULL;
    for (;;) {
        char c;
        ssize_t n = read(g_req[0], &c, 1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            logmsg("domain thread: request pipe: %s", n ? strerror(errno) : "closed");
            return NULL;
        }
        pid_t pid = fork();
        if (pid == 0)
            domain_child();
        write_int(g_ans[1], pid < 0 ? -errno : pid);
    }
}

/* Start the domain thread and wait until it is in the domain made from ruleset (the caller
 * closes ruleset afterwards). 0, or -1 with the reason in err. */
int domain_start(int ruleset, char *err, size_t errlen)
{
    if (pipe2(g_req, O_CLOEXEC) < 0 || pipe2(g_ans, O_CLOEXEC) < 0) {
        snprintf(err, errlen, "pipe: %s", strerror(errno));
        return -1;
    }
    g_ruleset_fd = ruleset;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* signals stay blocked in the thread (main's mask is inherited): they go to main's signalfd */
    int rc = pthread_create(&t, &attr, domain_thread, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        snprintf(err, errlen, "pthread_create: %s", strerror(rc));
        return -1;
    }
    int v;
    if (read_int(g_ans[0], &v) < 0 || v < 0) {
        snprintf(err, errlen, "landlock_restrict_self: %s", strerror(v < 0 ? -v : EIO));
        return -1;
    }
    g_on = 1;
    return 0;
}

int domain_active(void) { return g_on; }

/* Fork a child that runs fn(arg) and exits; in the sandbox's domain if sandboxed and there is
 * one. Returns the child's pid, or -1 with errno set, like fork. */
pid_t domain_spawn(int sandboxed, void (*fn)(void *), void *arg)
{
    if (!sandboxed || !g_on) {
        pid_t pid = fork();
        if (pid == 0) {
            fn(arg);
            _exit(0);
        }
        return pid;
    }
    g_fn = fn, g_arg = arg;
    int v;
    char c = 0;
    if (write_all(g_req[1], &c, 1) < 0 || read_int(g_ans[0], &v) < 0) {
        errno = EIO;
        return -1;
    }
    if (v < 0) {
        errno = -v;
        return -1;
    }
    return v;
}
