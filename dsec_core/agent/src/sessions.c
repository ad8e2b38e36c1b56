/*
 * Shell sessions: main owns the shells and queues their commands; a handler runs one command
 * (op_session_exec) through the pipes it inherited and waits for that command's end marker.
 * How a command is fed to the shell, and why its end cannot be forged, is described in the
 * architecture notes at the top of main.c.
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static struct session *g_sessions;
static unsigned g_session_counter;
static char g_priv[200];        /* private dir for session files, "" until made */

/* How far a session command's timeout (or cancellation) has escalated. The order matters:
 * only the phases before SX_SHELL_GONE count as a timeout. */
enum {
    SX_RUNNING = 0,       /* waiting for the end marker */
    SX_KILLING = 1,       /* killed what the command started; waiting for the shell's marker */
    SX_SHELL_KILLED = 2,  /* the shell itself was stuck and is killed; waiting for its status */
    SX_SHELL_GONE = 3,    /* the shell went away on its own; waiting for its status */
};

/* One session command, as its handler sees it. */
struct session_run {
    struct session *s;
    struct stream so, se;
    int mk_fd;                /* the marker pipe, -1 once the shell closed it */
    char mk[512];             /* marker bytes not yet ended by a newline */
    size_t mklen;
    char nonce[33];
    pid_t *before;            /* the shell's descendants before the command (sorted) */
    int nbefore;
    int phase;
    long long t0, deadline;
    long long tick;           /* in SX_KILLING: when to kill the command's new children again */
    int shell_dead, got_marker, timed_out, gone;
    int wstatus, code;
};

/* ---------------------------------------------------------------- small helpers */

/* Where session command and stdin files go. Handlers and shells run in the sandbox's Landlock
 * domain (domain.c), so a base the file policy protects would refuse them: it is skipped. */
static const char *priv_dir(void)
{
    if (g_priv[0])
        return g_priv;
    static const char *const bases[] = {"/run", "/dev/shm", "/tmp"};
    for (unsigned i = 0; i < sizeof bases / sizeof bases[0]; i++) {
        if (landlock_protects(bases[i]))
            continue;
        snprintf(g_priv, sizeof g_priv, "%s/.dsec-agent-%d", bases[i], (int)getpid());
        struct stat st;
        if (mkdir(g_priv, 0700) == 0 ||
            (errno == EEXIST && lstat(g_priv, &st) == 0 && S_ISDIR(st.st_mode) &&
             st.st_uid == geteuid() && chmod(g_priv, 0700) == 0))
            return g_priv;
    }
    g_priv[0] = 0;
    return NULL;
}

/* Make the session directory now: the Landlock walk grants rules to what exists at start, and
 * a directory made later in an ancestor of a protected path would get none. */
int session_dir_prepare(void) { return priv_dir() ? 0 : -1; }

void priv_dir_remove(void)
{
    if (g_priv[0])
        rm_tree(AT_FDCWD, g_priv);
}

static void session_fds_close(struct session *s)
{
    int *fds[] = {&s->ctl_w, &s->out_r, &s->err_r, &s->mk_r, &s->st_r, &s->st_w};
    for (unsigned i = 0; i < sizeof fds / sizeof fds[0]; i++)
        if (*fds[i] >= 0) {
            close(*fds[i]);
            *fds[i] = -1;
        }
}

static void make_nonce(char out[33])
{
    unsigned char raw[16];
    if (getrandom(raw, sizeof raw, 0) != sizeof raw) {
        /* no entropy syscall (ancient seccomp profile): fall back to time and pid noise */
        long long t = now_us() ^ ((long long)getpid() << 32);
        for (unsigned i = 0; i < sizeof raw; i++)
            raw[i] = (unsigned char)((t >> (i % 8 * 8)) ^ (i * 131) ^ (uintptr_t)out);
    }
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", raw[i]);
}

static int write_file_all(const char *path, const char *data, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
        return -1;
    int rc = write_all(fd, data, n);
    if (close(fd) < 0)
        rc = -1;
    return rc;
}

/* ---------------------------------------------------------------- a command (handler side) */

/* The shell sources the command from a file, so the text needs no quoting and never passes
 * through the control stream. -1 once the error is sent. */
static int write_command_file(int conn, struct session *s, const char *cmd, char *cpath,
                              size_t size)
{
    snprintf(cpath, size, "%s/c%u", s->dir, s->seq);
    if (mkdir_p(s->dir, 0700) < 0) {
        send_error(conn, "internal", s->dir, errno, "session dir %s: %s", s->dir, strerror(errno));
        return -1;
    }
    size_t cl = strlen(cmd);
    char *text = xrealloc(NULL, cl + 1);
    memcpy(text, cmd, cl);
    text[cl] = '\n';
    if (write_file_all(cpath, text, cl + 1) < 0) {
        send_error(conn, "internal", cpath, errno, "%s: %s", cpath, strerror(errno));
        return -1;
    }
    free(text);
    return 0;
}

/* The request body becomes the command's stdin through a file (the shell's own stdin is the
 * control pipe). -1 once the error is sent; if the client goes away mid-body the handler ends
 * here. */
static int write_stdin_file(int conn, struct session *s, long long body_len, const char *cpath,
                            char *ipath, size_t size)
{
    snprintf(ipath, size, "%s/i%u", s->dir, s->seq);
    int fd = open(ipath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        send_error(conn, "internal", ipath, errno, "%s: %s", ipath, strerror(errno));
        return -1;
    }
    for (long long left = body_len; left > 0;) {
        ssize_t n = read(conn, g_scratch, left < (long long)sizeof g_scratch ? left : (long long)sizeof g_scratch);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0 || write_all(fd, g_scratch, n) < 0) {
            unlink(ipath);
            unlink(cpath);
            _exit(0);
        }
        left -= n;
    }
    close(fd);
    return 0;
}

/* Output of background jobs between commands is not this command's (bounded: a job writing
 * nonstop would otherwise keep us here forever). Neither are markers left in the pipe by an
 * earlier command whose handler stopped waiting for them. */
static void srun_discard_stale(struct session_run *x, long long maxo)
{
    x->so = (struct stream){.fd = x->s->out_r};
    x->se = (struct stream){.fd = x->s->err_r};
    for (int i = 0; i < 64 && stream_read(&x->so) > 0; i++) {
    }
    for (int i = 0; i < 64 && stream_read(&x->se) > 0; i++) {
    }
    x->so.cap = x->se.cap = (size_t)maxo;
    x->so.truncated = x->se.truncated = 0;
    x->mklen = 0;
    x->mk_fd = x->s->mk_r;
    while (x->mk_fd >= 0) {
        ssize_t n = read(x->mk_fd, x->mk, sizeof x->mk);
        if (n > 0)
            continue;
        if (n == 0) {
            close(x->mk_fd);
            x->mk_fd = -1;
        }
        break;
    }
}

/* Hand the shell the command, followed by an end marker with a fresh nonce on fd 3. */
static void srun_start(struct session_run *x, const char *cpath, const char *ipath,
                       long long timeout_ms)
{
    /* what already runs under the shell (servers started by earlier commands) survives this
     * command's timeout; only what this command started is killed */
    x->nbefore = descendants(x->s->shell, &x->before);

    char line[1024];
    make_nonce(x->nonce);
    int ll = snprintf(line, sizeof line,
                      ". '%s' 3>&- <'%s'; command printf '%%s %%d\\n' %s \"$?\" >&3\n",
                      cpath, ipath, x->nonce);
    x->t0 = now_us();
    x->phase = SX_RUNNING;
    if (x->mk_fd < 0 || write_all(x->s->ctl_w, line, ll) < 0)
        x->phase = SX_SHELL_GONE; /* the shell is gone: just wait for its status below */
    x->deadline = timeout_ms > 0 ? now_ms() + timeout_ms : -1;
    if (x->phase == SX_SHELL_GONE)
        x->deadline = now_ms() + SHELL_GRACE_MS;
    x->tick = -1;
}

/* Nothing came before the deadline (timeout), or the client cancelled: take the next step.
 * 1 when there is nothing left to wait for. */
static int srun_escalate(struct session_run *x, int timeout)
{
    if (!timeout)
        x->gone = 1;
    else if (x->phase < SX_SHELL_GONE)
        x->timed_out = 1;
    if (x->phase == SX_RUNNING) {
        /* kill what the command started; the shell itself should come back */
        kill_tree_except(x->s->shell, 0, x->before, x->nbefore);
        x->phase = SX_KILLING;
        x->tick = now_ms() + 50;
        x->deadline = now_ms() + SHELL_GRACE_MS;
    } else if (timeout && x->phase == SX_KILLING) {
        /* the shell is stuck in a builtin (while :; do :; done): end the session,
         * and like session_close take everything it started with it */
        kill_descendants(x->s->shell, 0);
        kill(x->s->shell, SIGKILL);
        x->phase = SX_SHELL_KILLED;
        x->deadline = now_ms() + SHELL_GRACE_MS;
    } else if (timeout) {
        return 1; /* main never told us the status; give up */
    }
    return 0;
}

/* Complete lines on the marker pipe; only one that carries this command's nonce ends it. */
static void srun_scan_markers(struct session_run *x)
{
    char *nl;
    while ((nl = memchr(x->mk, '\n', x->mklen))) {
        *nl = 0;
        if (strncmp(x->mk, x->nonce, 32) == 0 && x->mk[32] == ' ') {
            x->got_marker = 1;
            x->code = atoi(x->mk + 33);
        }
        x->mklen -= nl + 1 - x->mk;
        memmove(x->mk, nl + 1, x->mklen);
    }
    if (x->mklen == sizeof x->mk - 1)
        x->mklen = 0; /* garbage without newline: drop it */
}

static void srun_read_marker(struct session_run *x)
{
    ssize_t n = read(x->mk_fd, x->mk + x->mklen, sizeof x->mk - 1 - x->mklen);
    if (n == 0) {
        close(x->mk_fd);
        x->mk_fd = -1; /* shell gone: its status will come on st_r */
        if (x->phase == SX_RUNNING)
            x->deadline = now_ms() + SHELL_GRACE_MS, x->phase = SX_SHELL_GONE;
    } else if (n > 0) {
        x->mklen += n;
        x->mk[x->mklen] = 0;
        srun_scan_markers(x);
    }
}

/* Until the end marker, the shell's death, giving up, or the client cancelling. */
static void srun_wait(struct session_run *x, int conn)
{
    struct session *s = x->s;
    while (!x->got_marker && !x->shell_dead) {
        if (x->phase == SX_KILLING && now_ms() >= x->tick) {
            /* a loop of sleeps in the command keeps starting new children */
            kill_tree_except(s->shell, 0, x->before, x->nbefore);
            x->tick = now_ms() + 50;
        }
        struct pollfd p[5] = {
            {.fd = x->so.fd, .events = POLLIN},
            {.fd = x->se.fd, .events = POLLIN},
            {.fd = x->mk_fd, .events = POLLIN},
            {.fd = s->st_r, .events = POLLIN},
            {.fd = x->gone ? -1 : conn, .events = POLLRDHUP},
        };
        long long until = x->phase == SX_KILLING && x->tick < x->deadline ? x->tick : x->deadline;
        int rc = poll(p, 5, poll_wait(until));
        if (rc < 0 && errno != EINTR)
            break;
        if (rc == 0 && x->phase == SX_KILLING && now_ms() < x->deadline)
            continue;
        if (rc == 0 || child_gone(p[4].revents)) {
            if (srun_escalate(x, rc == 0))
                break;
            continue;
        }
        if (p[0].revents)
            stream_read(&x->so);
        if (p[1].revents)
            stream_read(&x->se);
        if (p[2].revents)
            srun_read_marker(x);
        if (p[3].revents) {
            if (read(s->st_r, &x->wstatus, sizeof x->wstatus) == sizeof x->wstatus)
                x->shell_dead = 1;
        }
    }
}

/* The command finished before the marker/status was written, so its output is in the pipes
 * already; after a shell death give late writers a short grace for EOF. Returns the exit
 * code. */
static int srun_finish(struct session_run *x)
{
    stream_drain(&x->so);
    stream_drain(&x->se);
    if (x->shell_dead) {
        long long grace = now_ms() + EXIT_GRACE_MS;
        while (x->so.fd >= 0 || x->se.fd >= 0) {
            struct pollfd p[2] = {{.fd = x->so.fd, .events = POLLIN}, {.fd = x->se.fd, .events = POLLIN}};
            if (poll(p, 2, poll_wait(grace)) <= 0)
                break;
            if (p[0].revents)
                stream_read(&x->so);
            if (p[1].revents)
                stream_read(&x->se);
        }
        if (!x->got_marker)
            x->code = wait_status_code(x->wstatus);
    } else if (!x->got_marker) {
        x->code = 255;
    }
    if (x->timed_out)
        x->code = 128 + SIGKILL;
    return x->code;
}

/* Handler side of a session command. The shell's wait status arrives on st_r if it dies. */
void op_session_exec(int conn, struct req *r, struct session *s)
{
    struct run_opts o;
    int bad = read_run_opts(r, &o);
    const char *cmd = req_get(r, "cmd");
    if (!cmd || bad) {
        send_error(conn, "bad_request", NULL, 0, "session_exec needs cmd and numeric options");
        return;
    }
    char cpath[300], ipath[300];
    snprintf(ipath, sizeof ipath, "/dev/null");
    if (write_command_file(conn, s, cmd, cpath, sizeof cpath) < 0)
        return;
    if (o.has_stdin && write_stdin_file(conn, s, o.body_len, cpath, ipath, sizeof ipath) < 0)
        return;

    struct session_run x = {.s = s};
    srun_discard_stale(&x, o.maxo);
    srun_start(&x, cpath, ipath, o.timeout_ms);
    srun_wait(&x, conn);
    long long t_end = now_us();
    int code = srun_finish(&x);
    unlink(cpath);
    if (o.has_stdin)
        unlink(ipath);
    if (x.gone)
        return;
    send_run_result(conn, code, t_end - x.t0, x.timed_out, &x.so, &x.se,
                    x.shell_dead || !x.got_marker, NULL);
}

/* ---------------------------------------------------------------- bookkeeping (main side) */

static struct session *session_find(const char *id)
{
    for (struct session *s = g_sessions; s; s = s->next)
        if (!s->removed && id && !strcmp(s->id, id))
            return s;
    return NULL;
}

static void send_unknown_session(int fd, const char *id)
{
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "error", "unknown_session");
    char msg[128];
    snprintf(msg, sizeof msg, "no session %.40s", id ? id : "");
    resp_str(&h, "message", msg);
    resp_str(&h, "name", id ? id : "");
    for (struct session *s = g_sessions; s; s = s->next)
        if (!s->removed && !s->closed)
            resp_str(&h, "session", s->id);
    resp_send(fd, &h, NULL, 0, NULL, 0);
}

static void send_session_closed(int fd, struct session *s)
{
    send_error(fd, "session_closed", NULL, 0, "session %s has ended (its shell exited or was killed)",
               s->id);
}

static void session_free(struct session *s)
{
    struct session **pp = &g_sessions;
    while (*pp && *pp != s)
        pp = &(*pp)->next;
    if (*pp)
        *pp = s->next;
    session_fds_close(s);
    if (s->dir[0])
        rm_tree(AT_FDCWD, s->dir);
    free(s);
}

static void session_maybe_free(struct session *s)
{
    if (s->removed && s->reaped && !s->handler && !s->qh)
        session_free(s);
}

/* Start the next queued command, or fail the queue if the session is over. */
static void session_kick(struct session *s)
{
    while (s->qh && !s->handler) {
        struct pend *q = s->qh;
        s->qh = q->next;
        if (!s->qh)
            s->qt = NULL;
        if (s->closed || s->removed) {
            send_session_closed(q->fd, s);
            close(q->fd);
            req_free(q->r);
        } else {
            spawn_handler(q->fd, q->r, s);
        }
        free(q);
    }
}

/* Queue a session_exec behind the session's running command. 1 if queued (the queue now owns
 * fd and r), 0 if an error was sent instead. */
int session_enqueue(int fd, struct req *r)
{
    struct session *s = session_find(req_get(r, "session"));
    if (!s) {
        send_unknown_session(fd, req_get(r, "session"));
        return 0;
    }
    if (s->closed) {
        send_session_closed(fd, s);
        return 0;
    }
    struct pend *q = xcalloc(1, sizeof *q);
    q->fd = fd;
    q->r = r;
    if (s->qt)
        s->qt->next = q;
    else
        s->qh = q;
    s->qt = q;
    session_kick(s);
    return 1;
}

int sessions_live(void)
{
    int live = 0;
    for (struct session *s = g_sessions; s; s = s->next)
        live += !s->removed && !s->closed;
    return live;
}

void op_sessions(int fd)
{
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    for (struct session *s = g_sessions; s; s = s->next)
        if (!s->removed && !s->closed)
            resp_str(&h, "session", s->id);
    resp_send(fd, &h, NULL, 0, NULL, 0);
}

/* Main reaped pid: if it was a session's shell, pass its status to the command's handler and
 * end the session; if it was a handler, start the session's next command. */
void session_child_exited(pid_t pid, int status)
{
    for (struct session *s = g_sessions, *next; s; s = next) {
        next = s->next;
        if (s->shell == pid && !s->reaped) {
            s->reaped = 1;
            s->closed = 1;
            if (write(s->st_w, &status, sizeof status) < 0) {
            }
            if (!s->handler)
                session_kick(s);
            session_maybe_free(s);
        } else if (s->handler == pid) {
            s->handler = 0;
            session_kick(s);
            session_maybe_free(s);
        }
    }
}

/* The shells main has not reaped yet (at most max into out); returns how many there are. */
int session_shells(pid_t *out, int max)
{
    int n = 0;
    for (struct session *s = g_sessions; s; s = s->next)
        if (s->shell > 0 && !s->reaped) {
            if (n < max)
                out[n] = s->shell;
            n++;
        }
    return n;
}

/* In a freshly forked handler: the part of handler_init (main.c) that concerns sessions. Of
 * its own session (keep) a handler holds the pipes except the status write end, which is main's
 * to use. */
void sessions_close_fds_in_handler(int keep_fd, struct session *keep)
{
    for (struct session *s = g_sessions; s; s = s->next) {
        for (struct pend *q = s->qh; q; q = q->next)
            if (q->fd != keep_fd)
                close(q->fd);
        if (s != keep)
            session_fds_close(s);
    }
    if (keep) {
        close(keep->st_w);
        keep->st_w = -1;
    }
}

/* ---------------------------------------------------------------- opening and closing */

/* A session shell's pipes: ctl (its stdin), out, err, mk (the end markers on its fd 3), st (the
 * wait status main forwards when it dies) and ep (the child reports a failed chdir or exec on
 * it; a successful exec closes it). */
struct shell_pipes {
    int ctl[2], out[2], err[2], mk[2], st[2], ep[2];
};

static int shell_pipes_open(struct shell_pipes *sp)
{
    if (pipe2(sp->ctl, O_CLOEXEC) || pipe2(sp->out, O_CLOEXEC) || pipe2(sp->err, O_CLOEXEC) ||
        pipe2(sp->mk, O_CLOEXEC) || pipe2(sp->st, O_CLOEXEC) || pipe2(sp->ep, O_CLOEXEC))
        return -1;
    return 0;
}

__attribute__((noreturn))
static void shell_child(const struct shell_pipes *sp, const char *cwd, const char *shell,
                        char **envp)
{
    setsid();
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* daemons started in the session stay the shell's descendants, so timeouts and
     * session_close can find and kill them */
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    reset_child_signals();
    prefer_for_oom_kill();
    int e[2] = {1, 0};
    if (chdir(cwd) < 0) {
        e[1] = errno;
        if (write(sp->ep[1], e, sizeof e) < 0) {
        }
        _exit(127);
    }
    int fds[4] = {sp->ctl[0], sp->out[1], sp->err[1], sp->mk[1]};
    if (place_fds(fds, 4) < 0)
        _exit(127);
    environ = envp;
    char *argv[] = {(char *)shell, NULL};
    execv(shell, argv);
    e[0] = 2;
    e[1] = errno;
    if (write(sp->ep[1], e, sizeof e) < 0) {
    }
    _exit(127);
}

/* What shell_main hands shell_child in the forked child. */
struct shell_job {
    const struct shell_pipes *sp;
    const char *cwd, *shell;
    char **envp;
};

static void shell_main(void *p)
{
    struct shell_job *j = p;
    shell_child(j->sp, j->cwd, j->shell, j->envp);
}

/* Close the child's pipe ends and learn whether the shell started: a full e means the child
 * reported {1 (chdir) or 2 (exec), errno}; EOF means the exec worked. */
static ssize_t shell_exec_report(struct shell_pipes *sp, pid_t pid, int e[2])
{
    close(sp->ctl[0]);
    close(sp->out[1]);
    close(sp->err[1]);
    close(sp->mk[1]);
    close(sp->ep[1]);
    ssize_t n = pid < 0 ? -1 : read(sp->ep[0], e, 2 * sizeof(int));
    close(sp->ep[0]);
    return n;
}

static void shell_start_failed(int fd, struct session *s, struct shell_pipes *sp, pid_t pid,
                               const int e[2], const char *cwd, const char *shell)
{
    if (pid > 0)
        waitpid(pid, NULL, 0);
    close(sp->ctl[1]);
    close(sp->out[0]);
    close(sp->err[0]);
    close(sp->mk[0]);
    close(sp->st[0]);
    close(sp->st[1]);
    rmdir(s->dir);
    free(s);
    if (pid < 0)
        send_error(fd, "internal", NULL, errno, "fork: %s", strerror(errno));
    else
        send_path_error(fd, e[0] == 1 ? cwd : shell, e[1]);
}

/* The shell runs: keep main's ends and list the session. */
static void session_adopt(struct session *s, pid_t pid, const struct shell_pipes *sp)
{
    s->shell = pid;
    s->ctl_w = sp->ctl[1];
    s->out_r = sp->out[0];
    s->err_r = sp->err[0];
    s->mk_r = sp->mk[0];
    s->st_r = sp->st[0];
    s->st_w = sp->st[1];
    set_nonblock(s->out_r, 1);
    set_nonblock(s->err_r, 1);
    set_nonblock(s->mk_r, 1);
    set_nonblock(s->st_r, 1);
    s->next = g_sessions;
    g_sessions = s;
}

void op_session_open(int fd, struct req *r)
{
    const char *cwd = req_get(r, "cwd"), *shell = req_get(r, "shell");
    if (!cwd || !*cwd)
        cwd = "/";
    if (!shell || !*shell)
        shell = access("/bin/bash", X_OK) == 0 ? "/bin/bash" : "/bin/sh";
    const char *base = priv_dir();
    if (!base) {
        send_error(fd, "internal", NULL, errno, "no writable place for session files (/run, /dev/shm, /tmp)");
        return;
    }
    struct session *s = xcalloc(1, sizeof *s);
    snprintf(s->id, sizeof s->id, "s%u", ++g_session_counter);
    snprintf(s->dir, sizeof s->dir, "%s/%s", base, s->id);
    s->ctl_w = s->out_r = s->err_r = s->mk_r = s->st_r = s->st_w = -1;
    struct shell_pipes sp;
    if (shell_pipes_open(&sp) < 0) {
        send_error(fd, "internal", NULL, errno, "pipe: %s", strerror(errno));
        free(s);
        return; /* fds of a half-made session leak here; only on fd exhaustion */
    }
    if (mkdir(s->dir, 0700) < 0 && errno != EEXIST) {
        send_error(fd, "internal", s->dir, errno, "%s: %s", s->dir, strerror(errno));
        free(s);
        return;
    }
    char **envp = build_env(r);
    struct shell_job job = {.sp = &sp, .cwd = cwd, .shell = shell, .envp = envp};
    pid_t pid = domain_spawn(1, shell_main, &job);
    free(envp);
    int e[2];
    ssize_t n = shell_exec_report(&sp, pid, e);
    if (pid < 0 || n == sizeof e) {
        shell_start_failed(fd, s, &sp, pid, e, cwd, shell);
        return;
    }
    session_adopt(s, pid, &sp);
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_str(&h, "session", s->id);
    resp_num(&h, "pid", pid);
    resp_send(fd, &h, NULL, 0, NULL, 0);
}

void op_session_close(int fd, struct req *r)
{
    struct session *s = session_find(req_get(r, "session"));
    if (!s) {
        send_unknown_session(fd, req_get(r, "session"));
        return;
    }
    s->removed = 1;
    s->closed = 1;
    if (!s->reaped) {
        kill_descendants(s->shell, 0);
        kill(s->shell, SIGKILL);
    }
    session_kick(s); /* fails whatever was queued */
    send_ok(fd);
    session_maybe_free(s);
}
