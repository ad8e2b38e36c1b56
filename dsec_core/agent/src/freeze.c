/*
 * What a VM guest does for the node's memory and disk work: op freeze (below) and op reclaim
 * (further down).
 *
 * op freeze: a VM guest's writable disk held still while the node reads it (pack_diff of a
 * VM). on=1 freezes the filesystem at path (FIFREEZE: its dirty data written, its journal
 * clean, every write to it waiting) and starts a guard that thaws it after seconds, so a node
 * that dies mid-read cannot leave the guest's writes waiting for good; on=0 ends the guard
 * and thaws (a filesystem not frozen is no error: frozen=0 says so).
 * path defaults to /.dsec/rw, where the guest's init binds the disk read-only.
 * Needs CAP_SYS_ADMIN over the kernel (a VM guest's root has it; a container's does not).
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#define DEFAULT_PATH "/.dsec/rw"
#define MAX_SECONDS 3600

static pid_t g_guard = -1;

static void end_guard(void)
{
    if (g_guard > 0)
        kill(g_guard, SIGKILL); /* main's SIGCHLD handling reaps it */
    g_guard = -1;
}

void op_freeze(int conn, struct req *r)
{
    const char *path = req_get(r, "path");
    const char *on = req_get(r, "on");
    int bad = 0;
    long long seconds = req_num(r, "seconds", 60, &bad);
    if (!path)
        path = DEFAULT_PATH;
    if (!on || (strcmp(on, "0") && strcmp(on, "1")) || bad || seconds < 1 ||
        seconds > MAX_SECONDS) {
        send_error(conn, "bad_request", NULL, 0, "freeze needs on=0|1 and seconds of 1-%d",
                   MAX_SECONDS);
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        send_path_error(conn, path, errno);
        return;
    }
    struct buf h = {0};
    if (*on == '1') {
        end_guard();
        if (ioctl(fd, FIFREEZE, 0) < 0) {
            int e = errno;
            close(fd);
            send_error(conn, e == EBUSY ? "busy" : "internal", path, e, "freeze %s: %s", path,
                       strerror(e));
            return;
        }
        pid_t pid = fork();
        if (pid == 0) {
            sigset_t none;
            sigemptyset(&none);
            sigprocmask(SIG_SETMASK, &none, NULL);
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            sleep((unsigned)seconds);
            ioctl(fd, FITHAW, 0);
            _exit(0);
        }
        if (pid < 0) {
            int e = errno;
            ioctl(fd, FITHAW, 0);
            close(fd);
            send_error(conn, "internal", path, e, "freeze: fork: %s", strerror(e));
            return;
        }
        g_guard = pid;
        close(fd);
        resp_begin(&h);
        resp_str(&h, "ok", "1");
        resp_str(&h, "frozen", "1");
        resp_send(conn, &h, NULL, 0, NULL, 0);
        return;
    }
    end_guard();
    int thawed = ioctl(fd, FITHAW, 0) == 0;
    int e = errno;
    close(fd);
    if (!thawed && e != EINVAL) {
        send_error(conn, "internal", path, e, "thaw %s: %s", path, strerror(e));
        return;
    }
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_str(&h, "frozen", thawed ? "1" : "0");
    resp_send(conn, &h, NULL, 0, NULL, 0);
}

/*
 * op reclaim: a VM guest's proactive reclaim (the node's give_back): bytes of its coldest
 * memory reclaimed now through cgroup v2's memory.reclaim at the root (mounted at
 * /.dsec/cgroup on first use), what the guest frees then going back to the host by free page
 * reporting. Answers the bytes the guest's free memory grew by.
 */
#define CGROUP_AT "/.dsec/cgroup"

void op_reclaim(int conn, struct req *r)
{
    int bad = 0;
    long long bytes = req_num(r, "bytes", 0, &bad);
    if (bad || bytes <= 0) {
        send_error(conn, "bad_request", NULL, 0, "reclaim needs bytes > 0");
        return;
    }
    char path[64];
    snprintf(path, sizeof path, "%s/memory.reclaim", CGROUP_AT);
    if (access(path, W_OK) != 0) {
        mkdir(CGROUP_AT, 0700);
        if (mount("cgroup2", CGROUP_AT, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0 &&
            errno != EBUSY) {
            send_error(conn, "internal", NULL, errno, "reclaim: mount cgroup2: %s",
                       strerror(errno));
            return;
        }
    }
    struct sysinfo before, after;
    sysinfo(&before);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
        send_error(conn, "internal", NULL, errno, "reclaim: %s: %s", path, strerror(errno));
        return;
    }
    char amount[32];
    int n = snprintf(amount, sizeof amount, "%lld", bytes);
    /* EAGAIN: the kernel reclaimed less than asked (what it has is in use): not an error */
    if (write(fd, amount, (size_t)n) < 0 && errno != EAGAIN) {
        int e = errno;
        close(fd);
        send_error(conn, "internal", NULL, e, "reclaim: write %s: %s", path, strerror(e));
        return;
    }
    close(fd);
    sysinfo(&after);
    long long freed = ((long long)after.freeram - (long long)before.freeram) * after.mem_unit;
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_num(&h, "freed", freed > 0 ? freed : 0);
    resp_send(conn, &h, NULL, 0, NULL, 0);
}
