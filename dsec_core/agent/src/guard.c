/*
 * What keeps the sandbox's own code away from the agent, even as root inside and from a nested
 * user namespace:
 *
 * - Memory and descriptors. The agent is non-dumpable (PR_SET_DUMPABLE 0), and so is every
 *   handler it forks (the flag is inherited by fork and reset only by execve, which handlers
 *   never call). ptrace, /proc/<pid>/mem, process_vm_readv, pidfd_getfd and /proc/<pid>/fd of
 *   a non-dumpable process need CAP_SYS_PTRACE in the user namespace its memory belongs to, the
 *   sandbox's: the container's capability set has no CAP_SYS_PTRACE, and a user namespace
 *   made inside gives capabilities only in itself. Commands become dumpable again at execve,
 *   which is right: they are the sandbox's own.
 * - Signals. As the init of its pid namespace the kernel already drops SIGKILL and SIGSTOP and
 *   every default-action signal sent from inside. The signals the agent reads on its signalfd
 *   (SIGTERM, SIGINT, SIGHUP) would still arrive, so a stop signal counts only if it came from
 *   an ancestor pid namespace: si_code SI_USER with si_pid 0 (the kernel zeroes si_pid for
 *   such senders, and nobody inside can queue an SI_USER signal with a forged si_pid:
 *   rt_sigqueueinfo refuses si_code >= 0). SIGCHLD is always acted on (a forged one costs a
 *   waitpid). The host stops a sandbox with SIGKILL through a pidfd, which init cannot refuse.
 * - Orphans. Handlers are child subreapers, so what a command leaves behind stays below its
 *   handler, and a background exec's handler stays alive as the keeper of what it left. Main
 *   therefore knows every child it should have: handlers and session shells. A process that
 *   becomes main's child otherwise was orphaned by a handler or shell that died (root inside
 *   can SIGKILL its own handler to escape the end-of-exec kill) and is killed with its subtree
 *   whenever main reaps a child that died by a signal, a session shell, or a stranger.
 * - Freezing. A handler or shell stopped by a signal is continued at once.
 * - Resource limits. prlimit(2) on another process needs the caller's uid and gid to equal all
 *   of the target's (real, effective, saved), or CAP_SYS_RESOURCE, which the sandbox lacks. The
 *   agent's saved ids are set to ones no process inside holds as all three, so root inside
 *   cannot lower, say, its RLIMIT_NOFILE and make every later exec fail. Commands get saved
 *   ids equal to their effective ones back from execve.
 */
#include "agent.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

static int g_is_init;
static pid_t *g_handlers;  /* live handlers main forked (unsorted) */
static int g_nhandlers, g_caphandlers;

/* The first of these ids the user namespace maps becomes the agent's saved uid and gid. */
static const unsigned GUARD_IDS[] = {65535, 65534, 1};

void guard_init(void)
{
    g_is_init = getpid() == 1;
    unsigned i = 0;
    while (i < sizeof GUARD_IDS / sizeof GUARD_IDS[0] &&
           (setresgid(-1, -1, GUARD_IDS[i]) < 0 || setresuid(-1, -1, GUARD_IDS[i]) < 0))
        i++;
    if (i == sizeof GUARD_IDS / sizeof GUARD_IDS[0])
        logmsg("setresuid: cannot change the agent's saved ids; prlimit can reach it");
    /* after the id change: a credential change may reset the dumpable flag */
    if (prctl(PR_SET_DUMPABLE, 0) < 0)
        logmsg("PR_SET_DUMPABLE: cannot make the agent non-dumpable");
}

/* A stop signal is obeyed only from outside the sandbox. Outside a pid namespace of its own
 * (tests run the agent as a plain host process) whoever may signal it may stop it. */
int signal_from_outside(const struct signalfd_siginfo *si)
{
    if (!g_is_init)
        return 1;
    return si->ssi_code == SI_USER && si->ssi_pid == 0;
}

void guard_track(pid_t pid)
{
    if (g_nhandlers == g_caphandlers) {
        g_caphandlers = g_caphandlers ? g_caphandlers * 2 : 16;
        g_handlers = xrealloc(g_handlers, g_caphandlers * sizeof *g_handlers);
    }
    g_handlers[g_nhandlers++] = pid;
}

/* 1 if pid was a tracked handler (now forgotten). */
static int guard_forget(pid_t pid)
{
    for (int i = 0; i < g_nhandlers; i++)
        if (g_handlers[i] == pid) {
            g_handlers[i] = g_handlers[--g_nhandlers];
            return 1;
        }
    return 0;
}

static int pid_order(const void *a, const void *b)
{
    pid_t x = *(const pid_t *)a, y = *(const pid_t *)b;
    return (x > y) - (x < y);
}

/* Kill every descendant of main that is neither a known child nor below one. */
static void sweep_orphans(void)
{
    int cap = g_nhandlers + session_shells(NULL, 0);
    pid_t *known = xcalloc(cap, sizeof(pid_t));
    int n = 0;
    for (int i = 0; i < g_nhandlers; i++)
        known[n++] = g_handlers[i];
    n += session_shells(known + n, cap - n);
    qsort(known, n, sizeof(pid_t), pid_order);
    int left = kill_tree_except(getpid(), 0, known, n);
    if (left)
        logmsg("%d orphaned processes survived the sweep", left);
    free(known);
}

/* Main's SIGCHLD: reap everything that exited, continue what was stopped, tell sessions, and
 * sweep orphans if anything suggests there are some. */
void reap_children(void)
{
    int st, sweep = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG | WUNTRACED)) > 0) {
        if (WIFSTOPPED(st)) {
            kill(pid, SIGCONT);
            continue;
        }
        /* a session shell is no handler: its death sweeps too (its orphans are the session's) */
        int handler = guard_forget(pid);
        session_child_exited(pid, st);
        if (!handler || WIFSIGNALED(st))
            sweep = 1;
    }
    if (sweep)
        sweep_orphans();
}
