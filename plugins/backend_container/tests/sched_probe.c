/*
 * A probe of a process's way out of its CPU class, run as root in a sandbox: each argument
 * names one attempt, made in order, and prints "<attempt> ok" or "<attempt> <errno name>";
 * "policy" prints "policy <n>" (sched_getscheduler: 0 SCHED_OTHER, 3 SCHED_BATCH, 5 SCHED_IDLE).
 *
 *   other, batch, idle   sched_setscheduler(0, SCHED_OTHER / SCHED_BATCH / SCHED_IDLE)
 *   setattr-other        sched_setattr(0, {SCHED_OTHER, nice 0})
 *   rlimit-nice          setrlimit(RLIMIT_NICE, {40, 40}): allow every nice value
 *   nice-down            setpriority(PRIO_PROCESS, 0, -5)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

struct attr {
    uint32_t size;
    uint32_t sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime, sched_deadline, sched_period;
};

static int set_policy(int policy)
{
    struct sched_param p = {0};
    return sched_setscheduler(0, policy, &p);
}

static int attempt(const char *name)
{
    if (!strcmp(name, "other"))
        return set_policy(SCHED_OTHER);
    if (!strcmp(name, "batch"))
        return set_policy(SCHED_BATCH);
    if (!strcmp(name, "idle"))
        return set_policy(SCHED_IDLE);
    if (!strcmp(name, "setattr-other")) {
        struct attr a = {.size = sizeof a, .sched_policy = SCHED_OTHER};
        return (int)syscall(SYS_sched_setattr, 0, &a, 0);
    }
    if (!strcmp(name, "rlimit-nice")) {
        struct rlimit r = {40, 40};
        return setrlimit(RLIMIT_NICE, &r);
    }
    if (!strcmp(name, "nice-down"))
        return setpriority(PRIO_PROCESS, 0, -5);
    errno = EINVAL;
    return -1;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "policy")) {
            printf("policy %d\n", sched_getscheduler(0));
            continue;
        }
        errno = 0;
        int rc = attempt(argv[i]);
        printf("%s %s\n", argv[i], rc == 0 ? "ok" : strerrorname_np(errno));
    }
    return 0;
}
