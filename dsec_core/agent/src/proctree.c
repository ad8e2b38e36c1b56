/*
 * Process trees: who descends from whom, and killing a whole tree.
 *
 * A command can escape its process group (setsid) and its parent (double fork), so killing
 * "the command" means killing every descendant. The processes that kill trees are child
 * subreapers (PR_SET_CHILD_SUBREAPER: main, every handler, every session shell), so orphans
 * are reparented to them instead of to init and stay findable as descendants. Parents come
 * from /proc/<pid>/stat rather than /proc/<pid>/task/<tid>/children, which needs
 * CONFIG_PROC_CHILDREN and is missing on some kernels; sandboxes hold few processes, so a
 * scan costs well under a millisecond.
 */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

struct pinfo {
    pid_t pid, ppid;
    char state;
};

static int pinfo_cmp(const void *a, const void *b)
{
    pid_t x = ((const struct pinfo *)a)->pid, y = ((const struct pinfo *)b)->pid;
    return (x > y) - (x < y);
}

static int proc_list(struct pinfo **out)
{
    int n = 0, cap = 256;
    struct pinfo *p = xcalloc(cap, sizeof *p);
    DIR *d = opendir("/proc");
    if (!d) {
        *out = p;
        return 0;
    }
    struct dirent *e;
    char path[300], st[512];
    while ((e = readdir(d))) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t len = read(fd, st, sizeof st - 1);
        close(fd);
        if (len <= 0)
            continue;
        st[len] = 0;
        char *rp = strrchr(st, ')');
        char state;
        int ppid;
        if (!rp || sscanf(rp + 1, " %c %d", &state, &ppid) != 2)
            continue;
        if (n == cap)
            p = xrealloc(p, (cap *= 2) * sizeof *p);
        p[n].pid = atoi(e->d_name);
        p[n].ppid = ppid;
        p[n].state = state;
        n++;
    }
    closedir(d);
    qsort(p, n, sizeof *p, pinfo_cmp);
    *out = p;
    return n;
}

static int pid_cmp(const void *a, const void *b)
{
    pid_t x = *(const pid_t *)a, y = *(const pid_t *)b;
    return (x > y) - (x < y);
}

/* Live (non-zombie) descendants of root, from one /proc scan, leaving out the nspare pids in
 * spare (sorted) and everything below them. */
static int descendants_except(pid_t root, const pid_t *spare, int nspare, pid_t **out)
{
    struct pinfo *p;
    int n = proc_list(&p), cnt = 0;
    signed char *memo = xcalloc(n, 1); /* 0 unknown, 1 descendant, -1 not */
    int *chain = xcalloc(n + 1, sizeof(int));
    pid_t *res = xcalloc(n, sizeof(pid_t));
    for (int i = 0; i < n; i++) {
        int len = 0, cur = i;
        signed char verdict = -1;
        while (len <= n) {
            if (memo[cur]) {
                verdict = memo[cur];
                break;
            }
            chain[len++] = cur;
            if (nspare && bsearch(&p[cur].pid, spare, nspare, sizeof(pid_t), pid_cmp)) {
                verdict = -1;
                break;
            }
            if (p[cur].ppid == root) {
                verdict = 1;
                break;
            }
            struct pinfo key = {.pid = p[cur].ppid};
            struct pinfo *par = p[cur].ppid > 0 ? bsearch(&key, p, n, sizeof *p, pinfo_cmp) : NULL;
            if (!par || p[cur].pid == root) {
                verdict = -1;
                break;
            }
            cur = (int)(par - p);
        }
        for (int k = 0; k < len; k++)
            memo[chain[k]] = verdict;
    }
    for (int i = 0; i < n; i++)
        if (memo[i] == 1 && p[i].state != 'Z' && p[i].state != 'X')
            res[cnt++] = p[i].pid;
    free(memo);
    free(chain);
    free(p);
    *out = res;
    return cnt;
}

int descendants(pid_t root, pid_t **out) { return descendants_except(root, NULL, 0, out); }

/* SIGKILL every live descendant of root until none is left (bounded), sparing the nspare
 * pids in spare (sorted) and their subtrees. With reap, also collect our own dead children
 * so they stop showing up. Returns how many were still alive when it gave up (0: none). */
int kill_tree_except(pid_t root, int reap, const pid_t *spare, int nspare)
{
    long long end = now_ms() + KILL_BUDGET_MS;
    for (;;) {
        if (reap)
            reap_exited();
        pid_t *pids;
        int n = descendants_except(root, spare, nspare, &pids), found = n;
        for (int i = 0; i < found; i++)
            /* refused only under a Landlock signal scope, by a process outside the sandbox's
             * domain (a file handler serving the node): not sandbox code, not a survivor */
            if (kill(pids[i], SIGKILL) < 0 && errno == EPERM)
                n--;
        free(pids);
        if (n == 0 || now_ms() > end)
            return n;
        usleep(1000);
    }
}

void kill_descendants(pid_t root, int reap) { kill_tree_except(root, reap, NULL, 0); }

/* Collect every child that has already exited, without waiting for the rest. A subreaper
 * inherits its descendants' orphans, and unreaped they would linger as zombies. */
void reap_exited(void)
{
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}
