/*
 * op=exec, and what it shares with session commands: run options, the child's environment and
 * descriptors, output capture with a cap, and the result response.
 *
 * exec runs in a handler child (a child subreaper). The command gets its own session and
 * process group; on timeout or cancellation the handler kills that group and then every
 * descendant it can still find, so setsid'd and double-forked daemons die too. When the command
 * exits, whatever it left running is killed the same way before the answer goes out, unless
 * the request says background=1: then the handler answers and stays on as the subreaper of
 * what was left, until the last of it is gone (so nothing of it ever becomes main's orphan).
 * exclusive=1 first kills every other process in the sandbox (other calls' commands, session
 * shells and what they started, background jobs), so nothing that ran before can tamper with
 * what this command reads or runs.
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
#include <sys/resource.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

static const char *const DEFAULT_ENV[] = {
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    "LANG=C.UTF-8",
    NULL,
};

/* ---------------------------------------------------------------- options and environment */

/* Returns -1 (bad request) if a number is malformed or a body comes without stdin=1;
 * max_output is clamped to [0, MAX_OUTPUT]. */
int read_run_opts(struct req *r, struct run_opts *o)
{
    int bad = 0;
    o->timeout_ms = req_num(r, "timeout_ms", 0, &bad);
    o->maxo = req_num(r, "max_output", 1 << 20, &bad);
    o->has_stdin = req_num(r, "stdin", 0, &bad);
    o->body_len = req_num(r, "body_len", 0, &bad);
    if (o->maxo < 0)
        o->maxo = 0;
    if (o->maxo > MAX_OUTPUT)
        o->maxo = MAX_OUTPUT;
    return bad || (!o->has_stdin && o->body_len) ? -1 : 0;
}

/* Defaults, then the request's env fields on top (same key replaces). */
char **build_env(const struct req *r)
{
    int cap = 4 + req_count(r, "env"), n = 0;
    char **e = xcalloc(cap, sizeof(char *));
    for (const char *const *d = DEFAULT_ENV; *d; d++)
        e[n++] = (char *)*d;
    for (int i = 0; i < r->n; i++) {
        if (strcmp(r->key[i], "env") != 0)
            continue;
        char *kv = r->val[i];
        char *eq = strchr(kv, '=');
        size_t kl = eq ? (size_t)(eq - kv) : strlen(kv);
        if (kl == 0)
            continue;
        int j;
        for (j = 0; j < n; j++)
            if (strncmp(e[j], kv, kl) == 0 && e[j][kl] == '=')
                break;
        e[j] = kv;
        if (j == n)
            n++;
    }
    e[n] = NULL;
    return e;
}

/* ---------------------------------------------------------------- the child side */

/* The agent blocks the signals it reads from its signalfd and ignores SIGPIPE; a command
 * inherits both unless they are undone before exec. */
void reset_child_signals(void)
{
    sigset_t none;
    sigemptyset(&none);
    signal(SIGPIPE, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

/* Commands go first when the sandbox hits its memory limit: the agent is the sandbox's init, and
 * if the OOM killer picked it the whole sandbox would die. Raising one's own score needs no
 * privilege. */
void prefer_for_oom_kill(void)
{
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, "1000", 4) < 0) {
        }
        close(fd);
    }
}

/* Put src[i] at fd i for i < n, whatever numbers they had (they may overlap 0..n-1). */
int place_fds(const int *src, int n)
{
    int tmp[8];
    for (int i = 0; i < n; i++)
        if ((tmp[i] = fcntl(src[i], F_DUPFD_CLOEXEC, 64)) < 0)
            return -1;
    for (int i = 0; i < n; i++)
        if (dup2(tmp[i], i) < 0)
            return -1;
    return 0;
}

/* ---------------------------------------------------------------- output capture */

/* One read: 1 data, 0 EOF (fd closed), -1 nothing now. Keeps at most cap bytes. */
int stream_read(struct stream *s)
{
    if (s->fd < 0)
        return 0;
    size_t room = s->cap - s->b.len;
    ssize_t n;
    if (room > 0) {
        size_t want = room < READ_CHUNK ? room : READ_CHUNK;
        buf_reserve(&s->b, want);
        n = read(s->fd, s->b.p + s->b.len, want);
        if (n > 0)
            s->b.len += n;
    } else {
        n = read(s->fd, g_scratch, sizeof g_scratch);
        if (n > 0)
            s->truncated = 1;
    }
    if (n > 0)
        return 1;
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return -1;
    close(s->fd);
    s->fd = -1;
    return 0;
}

/* Read whatever is already buffered in the pipe, without waiting. */
void stream_drain(struct stream *s)
{
    while (s->fd >= 0 && stream_read(s) > 0) {
    }
}

/* For the client connection, polled with POLLRDHUP: a half-close is a cancellation. */
int child_gone(short revents) { return revents & (POLLRDHUP | POLLHUP | POLLERR); }

/* ---------------------------------------------------------------- results */

/* The shell convention: the exit status, or 128 + the signal that killed it. */
int wait_status_code(int status)
{
    return WIFEXITED(status) ? WEXITSTATUS(status)
           : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 255;
}

/* The answer to exec and session_exec: result fields, then stdout ++ stderr as the body.
 * session_closed < 0 leaves the field out (plain exec has no session); ru (NULL: left out) is
 * what the command used: CPU time, and the peak resident set of it or of the largest
 * descendant it waited for. */
void send_run_result(int conn, int code, long long duration_us, int timed_out,
                     const struct stream *so, const struct stream *se, int session_closed,
                     const struct rusage *ru)
{
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_num(&h, "exit_code", code);
    resp_num(&h, "duration_us", duration_us);
    resp_num(&h, "truncated", so->truncated || se->truncated);
    resp_num(&h, "timed_out", timed_out);
    if (session_closed >= 0)
        resp_num(&h, "session_closed", session_closed);
    if (ru) {
        resp_num(&h, "cpu_us", (long long)(ru->ru_utime.tv_sec + ru->ru_stime.tv_sec) * 1000000 +
                                   ru->ru_utime.tv_usec + ru->ru_stime.tv_usec);
        resp_num(&h, "maxrss_kb", ru->ru_maxrss);
    }
    resp_num(&h, "stdout_len", (long long)so->b.len);
    resp_send(conn, &h, so->b.p, so->b.len, se->b.p, se->b.len);
}

/* ---------------------------------------------------------------- exec */

/* A running command, as the handler sees it. */
struct exec_run {
    pid_t pid;
    struct stream so, se;
    int in_w;                 /* stdin pipe while body bytes are left to write, else -1 */
    const char *in;           /* the request body, fed to stdin */
    size_t in_off, in_len;
    int status, exited, timed_out;
    struct rusage ru;         /* the command's, once reaped */
    long long deadline;       /* the timeout, -1 for none */
    long long grace_end;      /* after the exit, how long to wait for EOF on the pipes */
    long long t_end;
    int stream;               /* send output as it comes (chunk frames), not in the result */
    int conn;
    int broken;               /* a chunk could not be sent: the client is gone */
    int interactive;          /* input, resizes and signals come later, in frames */
    int pty;                  /* the master of the command's terminal (so.fd), -1 if none */
    int in_eof;               /* interactive: close stdin once what is queued is written */
    struct buf inq;           /* interactive: input not yet written (x->in points into it) */
};

/* Positions in one round's pollfd array; -1 if that fd is not polled this round. */
struct exec_slots {
    int out, err, in, sig, conn;
};

static char **exec_argv(struct req *r, int argc)
{
    char **argv = xcalloc(argc + 1, sizeof(char *));
    for (int i = 0, k = 0; i < r->n; i++)
        if (strcmp(r->key[i], "arg") == 0)
            argv[k++] = r->val[i];
    return argv;
}

/* Pipes for the command's stdout and stderr, and its stdin: a pipe if the request sends one,
 * else /dev/null. -1 once the error is sent. */
static int exec_pipes(int conn, int has_stdin, int outp[2], int errp[2], int inp[2])
{
    inp[0] = inp[1] = -1;
    if (pipe2(outp, O_CLOEXEC) < 0 || pipe2(errp, O_CLOEXEC) < 0) {
        send_error(conn, "internal", NULL, errno, "pipe: %s", strerror(errno));
        return -1;
    }
    if (has_stdin) {
        if (pipe2(inp, O_CLOEXEC) < 0) {
            send_error(conn, "internal", NULL, errno, "pipe: %s", strerror(errno));
            return -1;
        }
    } else if ((inp[0] = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0) {
        send_error(conn, "internal", "/dev/null", errno, "/dev/null: %s", strerror(errno));
        return -1;
    }
    return 0;
}

/* In the forked child: its own session (so the handler can kill its process group), dies
 * with the handler, then becomes the command. */
__attribute__((noreturn))
static void exec_child(char **argv, char **envp, int in_fd, int out_fd, int err_fd)
{
    setsid();
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    reset_child_signals();
    prefer_for_oom_kill();
    int fds[3] = {in_fd, out_fd, err_fd};
    if (place_fds(fds, 3) < 0)
        _exit(126);
    environ = envp;
    execvp(argv[0], argv);
    int e = errno;
    dprintf(2, "dsec-agent: %s: %s\n", argv[0], strerror(e));
    _exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
}

/* interactive with pty=1: the command's terminal, a pseudo-terminal of the sandbox's own
 * devpts with the asked size; its master in *master, its other end returned (-1 once the
 * error is sent). */
static int exec_open_pty(int conn, long long rows, long long cols, int *master)
{
    char name[64];
    *master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (*master < 0 || grantpt(*master) < 0 || unlockpt(*master) < 0 ||
        ptsname_r(*master, name, sizeof name) != 0) {
        send_error(conn, "internal", "/dev/ptmx", errno, "no pseudo-terminal: %s",
                   strerror(errno));
        return -1;
    }
    int tty = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (tty < 0) {
        send_error(conn, "internal", name, errno, "%s: %s", name, strerror(errno));
        return -1;
    }
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
    ioctl(*master, TIOCSWINSZ, &ws);
    return tty;
}

/* The pty child: its own session with the terminal as its controlling tty on fds 0-2. */
__attribute__((noreturn))
static void exec_child_pty(char **argv, char **envp, int tty)
{
    setsid();
    ioctl(tty, TIOCSCTTY, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    reset_child_signals();
    prefer_for_oom_kill();
    int fds[3] = {tty, tty, tty};
    if (place_fds(fds, 3) < 0)
        _exit(126);
    environ = envp;
    execvp(argv[0], argv);
    int e = errno;
    dprintf(2, "dsec-agent: %s: %s\n", argv[0], strerror(e));
    _exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
}

/* In the handler after the fork: drop the child's pipe ends, make ours non-blocking. */
static void exec_run_init(struct exec_run *x, pid_t pid, const int outp[2], const int errp[2],
                          const int inp[2], const char *in, const struct run_opts *o,
                          int keep_in)
{
    close(outp[1]);
    close(errp[1]);
    close(inp[0]);
    *x = (struct exec_run){.pid = pid, .in_w = inp[1], .in = in, .in_len = (size_t)o->body_len};
    if (x->in_w >= 0 && o->body_len == 0 && !keep_in) {
        close(x->in_w);
        x->in_w = -1;
    }
    if (x->in_w >= 0)
        set_nonblock(x->in_w, 1);
    x->so = (struct stream){.fd = outp[0], .cap = (size_t)o->maxo};
    x->se = (struct stream){.fd = errp[0], .cap = (size_t)o->maxo};
    set_nonblock(x->so.fd, 1);
    set_nonblock(x->se.fd, 1);
    x->deadline = o->timeout_ms > 0 ? now_ms() + o->timeout_ms : -1;
    x->grace_end = -1;
    x->pty = -1;
}

/* The command's group, then whatever escaped it (setsid, double fork) under this handler. */
static void exec_kill_all(pid_t pid)
{
    kill(-pid, SIGKILL);
    kill_descendants(getpid(), 1);
}

/* The command exited: kill what it left behind. Everything it left is below this subreaper,
 * so when the handler has no child left there is nothing to look for in /proc. Only the
 * leftovers are killed, not the command's process group: the command is reaped, and its id
 * could in principle name someone else's group by now. */
static void exec_end_leftovers(void)
{
    siginfo_t si;
    reap_exited();
    if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) < 0 && errno == ECHILD)
        return;
    kill_descendants(getpid(), 1);
}

/* background=1, after the answer: keep what the command left below us until it is all gone. */
__attribute__((noreturn))
static void exec_keep_background(int conn, struct exec_run *x)
{
    close(conn);
    buf_free(&x->so.b);
    buf_free(&x->se.b);
    for (;;) {
        if (waitpid(-1, NULL, 0) < 0 && errno != EINTR)
            _exit(0);
    }
}

/* exclusive=1: kill every process in the sandbox but main and this handler. -1 (error sent)
 * if some process would not die. */
static int exec_clear_sandbox(int conn)
{
    pid_t self = getpid();
    int left = kill_tree_except(getppid(), 0, &self, 1);
    if (left) {
        send_error(conn, "internal", NULL, 0,
                   "exclusive: %d processes of the sandbox would not die", left);
        return -1;
    }
    return 0;
}

static int exec_pollfds(const struct exec_run *x, int conn, struct pollfd *p,
                        struct exec_slots *ix)
{
    int np = 0;
    ix->out = ix->err = ix->in = -1;
    if (x->so.fd >= 0) { ix->out = np; p[np++] = (struct pollfd){.fd = x->so.fd, .events = POLLIN}; }
    if (x->se.fd >= 0) { ix->err = np; p[np++] = (struct pollfd){.fd = x->se.fd, .events = POLLIN}; }
    if (x->in_w >= 0 && x->in_off < x->in_len) {
        ix->in = np;
        p[np++] = (struct pollfd){.fd = x->in_w, .events = POLLOUT};
    }
    ix->sig = np;
    p[np++] = (struct pollfd){.fd = x->exited ? -1 : g_sig_fd, .events = POLLIN};
    ix->conn = np;
    p[np++] = (struct pollfd){.fd = conn, .events = x->interactive ? POLLIN | POLLRDHUP
                                                                    : POLLRDHUP};
    return np;
}

/* Streaming: send what each stream holds as a chunk frame (fields chunk=out|err, the bytes as
 * the body) and take it off the stream's allowance, so max_output still bounds the total. */
static void exec_flush_one(struct exec_run *x, struct stream *s, const char *which)
{
    if (!x->stream || s->b.len == 0)
        return;
    if (!x->broken) {
        struct buf h = {0};
        resp_begin(&h);
        resp_str(&h, "chunk", which);
        if (resp_send(x->conn, &h, s->b.p, s->b.len, NULL, 0) < 0)
            x->broken = 1;
    }
    if (!x->interactive) /* a long-lived command's output has no total bound */
        s->cap -= s->b.len;
    s->b.len = 0;
}

static void exec_flush(struct exec_run *x)
{
    exec_flush_one(x, &x->so, "out");
    exec_flush_one(x, &x->se, "err");
}

static void exec_time_out(struct exec_run *x)
{
    x->timed_out = 1;
    exec_kill_all(x->pid);
    x->exited = 1;
    x->t_end = now_us();
    stream_drain(&x->so);
    stream_drain(&x->se);
}

/* Write what the pipe takes now; a command that closes its stdin just stops getting it. */
static void exec_feed_stdin(struct exec_run *x)
{
    ssize_t n = write(x->in_w, x->in + x->in_off, x->in_len - x->in_off);
    if (n > 0)
        x->in_off += n;
    int failed = n < 0 && errno != EAGAIN && errno != EINTR;
    if (x->interactive && !failed && x->in_off == x->in_len) {
        x->inq.len = x->in_off = x->in_len = 0; /* all written: more may come */
        if (!x->in_eof)
            return;
    }
    if (failed || x->in_off == x->in_len) {
        close(x->in_w);
        x->in_w = -1;
    }
}

/* Interactive: one frame from the client (wire.c: in with a body, eof, rows and cols,
 * signal). -1 if the connection broke or the frame is malformed: the command is cancelled. */
static int exec_read_frame(struct exec_run *x, int conn)
{
    unsigned char lb[4];
    if (read_exact(conn, lb, 4) < 0)
        return -1;
    uint32_t n = get_u32(lb);
    if (n > 65536)
        return -1;
    unsigned char *raw = xrealloc(NULL, n ? n : 1);
    const char *why = NULL;
    struct req *f = read_exact(conn, raw, n) < 0 ? NULL : req_parse(raw, n, &why);
    free(raw);
    if (!f)
        return -1;
    int bad = 0;
    long long blen = req_num(f, "body_len", 0, &bad);
    long long sig = req_num(f, "signal", 0, &bad);
    long long rows = req_num(f, "rows", 0, &bad), cols = req_num(f, "cols", 0, &bad);
    long long eof = req_num(f, "eof", 0, &bad);
    req_free(f);
    if (bad || blen < 0 || blen > MAX_FRAME)
        return -1;
    /* input the command cannot take now (no stdin, closed, or over MAX_FRAME queued) is
     * dropped, as a write to a closed pipe would be */
    int keep = x->in_w >= 0 && !x->in_eof && x->inq.len + (size_t)blen <= MAX_FRAME;
    if (keep && blen) {
        buf_reserve(&x->inq, (size_t)blen);
        if (read_exact(conn, x->inq.p + x->inq.len, (size_t)blen) < 0)
            return -1;
        x->inq.len += (size_t)blen;
    }
    for (long long left = keep ? 0 : blen; left > 0;) {
        size_t k = left < (long long)sizeof g_scratch ? (size_t)left : sizeof g_scratch;
        if (read_exact(conn, g_scratch, k) < 0)
            return -1;
        left -= (long long)k;
    }
    if (eof && x->in_w >= 0 && !x->in_eof) {
        if (x->pty >= 0) /* a terminal's end of input is its EOF character, not a close */
            buf_add(&x->inq, "\x04", 1);
        else
            x->in_eof = 1;
    }
    x->in = x->inq.p;
    x->in_len = x->inq.len;
    if (x->in_eof && x->in_w >= 0 && x->in_off == x->in_len) {
        close(x->in_w);
        x->in_w = -1;
    }
    if (rows > 0 && cols > 0 && rows < 65536 && cols < 65536 && x->pty >= 0) {
        struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
        ioctl(x->pty, TIOCSWINSZ, &ws); /* the kernel sends the terminal's group SIGWINCH */
    }
    if (sig > 0 && sig < 65 && !x->exited)
        kill(x->pid, (int)sig);
    return 0;
}

/* SIGCHLD: reap everything that exited (orphans come to us too), note when it was ours. */
static void exec_reap(struct exec_run *x)
{
    struct signalfd_siginfo si;
    while (read(g_sig_fd, &si, sizeof si) > 0) {
    }
    int st;
    pid_t w;
    struct rusage ru;
    while ((w = wait4(-1, &st, WNOHANG, &ru)) > 0)
        if (w == x->pid) {
            x->status = st;
            x->ru = ru;
            x->exited = 1;
            x->t_end = now_us();
            x->grace_end = now_ms() + EXIT_GRACE_MS;
        }
}

/* Until the command has exited and its pipes are at EOF, the timeout hits, or the exit grace
 * runs out. Does not return if the client cancels. */
static void exec_wait(int conn, struct exec_run *x)
{
    for (;;) {
        if (x->exited && x->so.fd < 0 && x->se.fd < 0)
            break;
        struct pollfd p[5];
        struct exec_slots ix;
        int np = exec_pollfds(x, conn, p, &ix);
        long long until = x->exited ? x->grace_end : x->deadline;
        int rc = poll(p, np, poll_wait(until));
        if (rc < 0 && errno != EINTR)
            break;
        if (rc == 0) {
            if (!x->exited)
                exec_time_out(x);
            break; /* after an exit, grace over: leftovers hold the pipes open, let them */
        }
        if (x->interactive && (p[ix.conn].revents & POLLIN)) {
            if (exec_read_frame(x, conn) < 0) {
                exec_kill_all(x->pid);
                _exit(0);
            }
        } else if (child_gone(p[ix.conn].revents)) {
            /* the client went away (cancelled): nobody wants the result, stop the work */
            exec_kill_all(x->pid);
            _exit(0);
        }
        if (ix.out >= 0 && p[ix.out].revents)
            stream_read(&x->so);
        if (ix.err >= 0 && p[ix.err].revents)
            stream_read(&x->se);
        exec_flush(x);
        if (x->broken) {
            exec_kill_all(x->pid);
            _exit(0);
        }
        if (ix.in >= 0 && p[ix.in].revents)
            exec_feed_stdin(x);
        if (p[ix.sig].revents)
            exec_reap(x);
    }
}

/* interactive=1, after the fork: input queues (from the request's body on; stdin stays open
 * for more) and the client learns the pid. */
static void exec_interactive_start(struct exec_run *x, const char *in, long long body_len)
{
    x->interactive = 1;
    if (body_len > 0)
        buf_add(&x->inq, in, (size_t)body_len);
    x->in = x->inq.p;
    x->in_len = x->inq.len;
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "started", "1");
    resp_num(&h, "pid", x->pid);
    if (resp_send(x->conn, &h, NULL, 0, NULL, 0) < 0) {
        exec_kill_all(x->pid);
        _exit(0);
    }
}

void op_exec(int conn, struct req *r)
{
    struct run_opts o;
    int bad = read_run_opts(r, &o);
    long long background = req_num(r, "background", 0, &bad);
    long long exclusive = req_num(r, "exclusive", 0, &bad);
    long long stream = req_num(r, "stream", 0, &bad);
    long long interactive = req_num(r, "interactive", 0, &bad);
    long long pty = req_num(r, "pty", 0, &bad);
    long long rows = req_num(r, "rows", 24, &bad), cols = req_num(r, "cols", 80, &bad);
    if (pty && (!interactive || rows < 1 || cols < 1 || rows > 65535 || cols > 65535))
        bad = 1;
    int argc = req_count(r, "arg");
    const char *cwd = req_get(r, "cwd");
    if (!cwd || !*cwd)
        cwd = "/";
    if (bad || argc == 0) {
        send_error(conn, "bad_request", NULL, 0, "exec needs arg fields and numeric options");
        return;
    }
    char **argv = exec_argv(r, argc);
    char **envp = build_env(r);
    char *in = NULL;
    if (o.body_len > 0) {
        in = xrealloc(NULL, o.body_len);
        if (read_exact(conn, in, o.body_len) < 0)
            return;
    }
    if (chdir(cwd) < 0) {
        send_path_error(conn, cwd, errno);
        return;
    }
    if (exclusive && exec_clear_sandbox(conn) < 0)
        return;
    int outp[2], errp[2], inp[2], master = -1, tty = -1;
    if (pty ? (tty = exec_open_pty(conn, rows, cols, &master)) < 0
            : exec_pipes(conn, o.has_stdin || interactive, outp, errp, inp) < 0)
        return;

    long long t0 = now_us();
    pid_t pid = fork();
    if (pid < 0) {
        send_error(conn, "internal", NULL, errno, "fork: %s", strerror(errno));
        return;
    }
    if (pid == 0) {
        if (pty)
            exec_child_pty(argv, envp, tty);
        exec_child(argv, envp, inp[0], outp[1], errp[1]);
    }
    struct exec_run x;
    int keep_in = interactive && (pty || o.has_stdin);
    if (pty) {
        close(tty);
        /* output from the master; input to a second descriptor of it (closed apart) */
        int out[2] = {master, -1}, none[2] = {-1, -1};
        int to[2] = {-1, fcntl(master, F_DUPFD_CLOEXEC, 0)};
        exec_run_init(&x, pid, out, none, to, in, &o, keep_in);
        x.pty = master;
    } else {
        exec_run_init(&x, pid, outp, errp, inp, in, &o, keep_in);
    }
    x.stream = stream != 0 || interactive;
    x.conn = conn;
    if (interactive)
        exec_interactive_start(&x, in, o.body_len);
    exec_wait(conn, &x);
    exec_flush(&x); /* what a timeout drained */
    if (!x.t_end)
        x.t_end = now_us();
    if (x.in_w >= 0)
        close(x.in_w);
    if (background)
        reap_exited();
    else
        exec_end_leftovers(); /* before the answer: once it is out, nothing of the call runs */
    int code = x.timed_out ? 128 + SIGKILL : wait_status_code(x.status);
    send_run_result(conn, code, x.t_end - t0, x.timed_out, &x.so, &x.se, -1,
                    x.timed_out ? NULL : &x.ru);
    if (background)
        exec_keep_background(conn, &x);
}
