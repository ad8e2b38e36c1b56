/*
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
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
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
