/*
 * dsec-agent: the init process (PID 1) of every dsec sandbox; it serves exec, persistent shell
 * sessions and file operations over a unix socket the node daemon handed it (like DSec's aether).
 *
 * This file is the main process: the accept loop, dispatch, handler processes and signals.
 * The rest: wire.c (the wire protocol, with its full table), exec.c, sessions.c, files.c,
 * proctree.c (process trees), guard.c (keeping sandbox code away from the agent), alloc.c
 * (memory and buffers) and io.c (descriptors and time); agent.h declares what they share.
 *
 * Usage: dsec-agent [--fd N | --listen PATH | --serial PATH] [--policy-fd N [--status-fd N]]
 *        dsec-agent drive [SOCKET]   (drive.c: the bridge a loop drives its workers through)
 *        dsec-agent forward --listen-fd N --serial-fd M   (mux.c: a VM's host-side forwarder)
 * The backend binds and listens on a unix stream socket (the node connects to it) before the
 * sandbox starts and passes it as fd N (default 3; runc --preserve-fds), so the node can connect
 * before the agent is even running. Where a runtime cannot pass descriptors (gVisor's runsc), the
 * agent binds PATH itself (--listen), in a directory the host sees, and the node waits for it.
 * With --policy-fd the agent first reads the policy document
 * there (seccomp filter, Landlock file rules and scopes) and enforces it, reporting the outcome
 * on --status-fd, before it serves anything (policy.c); without it, it serves at once.
 * In a VM guest there is no socket to inherit: --serial names the virtio-serial port the host's
 * forwarder multiplexes the node's connections over (mux.c), and each stream it opens arrives
 * in the accept loop below as if accepted.
 *
 * ARCHITECTURE
 * The main process accepts connections and reads just the request header (non-blocking, so a
 * slow client cannot stall anybody). Cheap bookkeeping ops (ping, sessions, session_open/close)
 * are answered inline. Everything that can block (exec, file I/O on arbitrary paths, session
 * commands) runs in a handler child forked per request: a static agent forks in ~100 us, a hung
 * NFS read or FIFO cannot freeze the agent, and concurrency needs no threads or event loop.
 * Handlers are child subreapers, so a command's orphans (setsid, double fork) come back to the
 * handler, which on timeout SIGKILLs the command's process group and then walks its descendants
 * until none is left. The main process is a subreaper too and reaps everything else (as PID 1 it
 * must). Descendants are found by scanning /proc/<pid>/stat parents rather than
 * /proc/<pid>/task/<tid>/children, which needs CONFIG_PROC_CHILDREN and is missing on some
 * kernels; sandboxes hold few processes, so the scan costs well under a millisecond.
 *
 * A session is a shell (/bin/bash, else /bin/sh) owned by main: stdin is a control pipe, fds 1/2
 * are output pipes, fd 3 is a marker pipe. A session command is run by a handler that inherited
 * those fds: it writes the command into a private file and sends the shell
 *     . '<file>' 3>&- <'<stdin file or /dev/null>'; command printf '%s %d\n' <nonce> "$?" >&3
 * The command never sees the control stream or fd 3, and the end marker carries a random
 * per-command nonce on a pipe the command cannot reach, so output cannot forge an end. Main
 * queues requests for a busy session and starts them in order. The shell is a subreaper so
 * daemons started in a session stay its descendants and die on timeout or close. When a shell
 * exits, main reaps it and writes the wait status into the session's status pipe, which is how
 * the running handler learns e.g. that `exit 3` returned 3. A session command's timeout kills
 * only the processes that command started (the shell's descendants minus a snapshot taken just
 * before it, with their subtrees), so a server started in the background by an earlier command
 * keeps running, workers included.
 *
 * Every descriptor the agent opens is O_CLOEXEC (including the inherited listening socket), so
 * commands cannot reach the control socket, session pipes or another request's connection.
 * Nor can they take them, or the agent's memory, another way: main and the handlers are
 * non-dumpable, stop signals from inside the sandbox are ignored, and processes orphaned by a
 * killed handler are swept (guard.c says how and why). When an exec's command exits, what it
 * left running is killed unless the request asked for background=1; then its handler stays
 * on as their keeper (exec.c).
 *
 * With a Landlock file policy, exec and session handlers, session shells and every command are
 * forked from the agent's domain thread and share one Landlock domain; main and the file
 * handlers stay outside it (domain.c says why and how).
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
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

/* A connection whose request header is still arriving. */
struct conn {
    int fd;
    uint32_t got, hlen;
    unsigned char lenb[4];
    unsigned char *hdr;
    long long t0;
};

int g_sig_fd = -1;
static pid_t g_main_pid;
static int g_listen_fd = -1;
static struct conn *g_conns;
static int g_nconns, g_capconns;

static void agent_sigmask(sigset_t *mask)
{
    sigemptyset(mask);
    sigaddset(mask, SIGCHLD);
    sigaddset(mask, SIGTERM);
    sigaddset(mask, SIGINT);
    sigaddset(mask, SIGHUP);
}

/* ---------------------------------------------------------------- handlers */

/* In a freshly forked handler: drop everything that belongs to other requests or sessions. */
static void handler_init(int keep_fd, struct session *keep)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != g_main_pid)
        _exit(1);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    close(g_listen_fd);
    mux_close_fds_in_handler();
    for (int i = 0; i < g_nconns; i++)
        if (g_conns[i].fd != keep_fd)
            close(g_conns[i].fd);
    sessions_close_fds_in_handler(keep_fd, keep);
    set_nonblock(keep_fd, 0);
    /* A signalfd of its own: gVisor ties one to the task that made it, so the inherited one
     * would go on reading main's signals, never this handler's SIGCHLD. */
    sigset_t mask;
    agent_sigmask(&mask);
    int sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd >= 0) {
        close(g_sig_fd);
        g_sig_fd = sfd;
    }
}

/* What a handler is forked to serve. */
struct handler_job {
    int fd;
    struct req *r;
    struct session *s;
};

/* The forked handler's body (domain_spawn exits when it returns). */
static void handler_main(void *p)
{
    struct handler_job *j = p;
    handler_init(j->fd, j->s);
    const char *op = req_get(j->r, "op");
    if (j->s)
        op_session_exec(j->fd, j->r, j->s);
    else if (!strcmp(op, "exec"))
        op_exec(j->fd, j->r);
    else if (!strcmp(op, "read"))
        op_read(j->fd, j->r);
    else if (!strcmp(op, "write"))
        op_write(j->fd, j->r);
    else if (!strcmp(op, "list"))
        op_list(j->fd, j->r);
    else if (!strcmp(op, "stat"))
        op_stat(j->fd, j->r);
    else if (!strcmp(op, "remove"))
        op_remove(j->fd, j->r);
}

/* Run r (for session s, if any) in a forked handler. Main keeps neither fd nor r: the handler
 * has its own copies and answers on fd. Handlers that run sandbox code (exec, session commands)
 * start in the sandbox's Landlock domain, if it has one; file operations serve the node and
 * stay outside it, so the node reads and writes what the file policy hides from commands. */
void spawn_handler(int fd, struct req *r, struct session *s)
{
    if (s)
        s->seq++;
    struct handler_job job = {.fd = fd, .r = r, .s = s};
    int sandboxed = s || !strcmp(req_get(r, "op"), "exec");
    pid_t pid = domain_spawn(sandboxed, handler_main, &job);
    if (pid < 0) {
        send_error(fd, "internal", NULL, errno, "fork: %s", strerror(errno));
    } else {
        guard_track(pid);
        if (s)
            s->handler = pid;
    }
    close(fd);
    req_free(r);
}

/* ---------------------------------------------------------------- requests */

static void op_ping(int fd)
{
    struct buf h = {0};
    int live = sessions_live();
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_num(&h, "pid", getpid());
    resp_str(&h, "version", AGENT_VERSION);
    resp_num(&h, "sessions", live);
    resp_send(fd, &h, NULL, 0, NULL, 0);
}

/* A complete header arrived: answer bookkeeping ops here, hand everything else to a handler.
 * Takes hdr and fd (closed here unless a handler or a session queue took it). */
static void dispatch(int fd, unsigned char *hdr, uint32_t hlen)
{
    const char *why = NULL;
    struct req *r = req_parse(hdr, hlen, &why);
    free(hdr);
    if (!r) {
        send_error(fd, "bad_request", NULL, 0, "malformed header: %s", why);
        close(fd);
        return;
    }
    int bad = 0;
    long long body_len = req_num(r, "body_len", 0, &bad);
    const char *op = req_get(r, "op");
    if (!op || bad || body_len < 0 || body_len > MAX_FRAME) {
        send_error(fd, "bad_request", NULL, 0, "need op and a body_len of at most %u bytes", MAX_FRAME);
    } else if (!strcmp(op, "ping")) {
        op_ping(fd);
    } else if (!strcmp(op, "sessions")) {
        op_sessions(fd);
    } else if (!strcmp(op, "wake")) {
        op_wake(fd, r);
    } else if (!strcmp(op, "freeze")) {
        op_freeze(fd, r);
    } else if (!strcmp(op, "reclaim")) {
        op_reclaim(fd, r);
    } else if (!strcmp(op, "ifup")) {
        op_ifup(fd, r);
    } else if (!strcmp(op, "session_open")) {
        op_session_open(fd, r);
    } else if (!strcmp(op, "session_close")) {
        op_session_close(fd, r);
    } else if (!strcmp(op, "session_exec")) {
        if (session_enqueue(fd, r))
            return;
    } else if (!strcmp(op, "exec") || !strcmp(op, "read") || !strcmp(op, "write") ||
               !strcmp(op, "list") || !strcmp(op, "stat") || !strcmp(op, "remove")) {
        spawn_handler(fd, r, NULL);
        return;
    } else {
        send_error(fd, "bad_request", NULL, 0, "unknown op %.40s", op);
    }
    close(fd);
    req_free(r);
}

/* ---------------------------------------------------------------- connections */

static void conn_drop(int i)
{
    g_conns[i] = g_conns[--g_nconns];
}

/* Read more of connection i's header; 1 if dispatched or dropped (slot freed), else 0. */
static int conn_progress(int i)
{
    struct conn *c = &g_conns[i];
    for (;;) {
        ssize_t n;
        if (c->got < 4)
            n = read(c->fd, c->lenb + c->got, 4 - c->got);
        else
            n = read(c->fd, c->hdr + (c->got - 4), c->hlen - (c->got - 4));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return 0;
        if (n <= 0) {
            close(c->fd);
            free(c->hdr);
            conn_drop(i);
            return 1;
        }
        c->got += n;
        if (c->got == 4) {
            c->hlen = get_u32(c->lenb);
            if (c->hlen > MAX_FRAME) {
                send_error(c->fd, "bad_request", NULL, 0,
                           "header of %u bytes is over the %u byte limit", c->hlen, MAX_FRAME);
                close(c->fd);
                conn_drop(i);
                return 1;
            }
            c->hdr = xrealloc(NULL, c->hlen);
        }
        if (c->got >= 4 && c->got - 4 == c->hlen) {
            int fd = c->fd;
            unsigned char *hdr = c->hdr;
            uint32_t hlen = c->hlen;
            conn_drop(i);
            dispatch(fd, hdr, hlen);
            return 1;
        }
    }
}

/* A new connection (accepted, or a stream the VM channel opened): read its header. */
static void conn_add(int fd)
{
    if (g_nconns == g_capconns) {
        g_capconns = g_capconns ? g_capconns * 2 : 16;
        g_conns = xrealloc(g_conns, g_capconns * sizeof *g_conns);
    }
    g_conns[g_nconns++] = (struct conn){.fd = fd, .t0 = now_ms()};
    conn_progress(g_nconns - 1); /* usually the whole header is already there */
}

static void accept_all(void)
{
    for (;;) {
        int fd = accept4(g_listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        conn_add(fd);
    }
}

/* ---------------------------------------------------------------- signals */

static void shutdown_agent(int sig)
{
    kill_descendants(getpid(), 1);
    priv_dir_remove();
    logmsg("signal %d: stopped", sig);
    _exit(0);
}

static void handle_signals(void)
{
    struct signalfd_siginfo si;
    int child = 0;
    while (read(g_sig_fd, &si, sizeof si) == sizeof si) {
        if (si.ssi_signo == SIGCHLD)
            child = 1;
        else if (signal_from_outside(&si))
            shutdown_agent((int)si.ssi_signo);
    }
    if (child)
        reap_children();
}

/* ---------------------------------------------------------------- start-up and the loop */

static void usage(void)
{
    static const char m[] =
        "usage: dsec-agent [--fd N | --listen PATH | --serial PATH] [--policy-fd N [--status-fd N]]\n"
        "       dsec-agent drive [SOCKET]   (drive.c: a loop's bridge to its workers)\n"
        "       dsec-agent forward --listen-fd N --serial-fd M   (mux.c: a VM's host side)\n"
        "       dsec-agent no-punch -- QEMU ARGS...   (nopunch.c: a VM's QEMU, no hole punching)\n"
        "Serve exec, shell sessions and file operations on the listening unix socket at fd N\n"
        "(default 3), on one it binds at PATH (--listen), or on the streams of a VM's\n"
        "virtio-serial port at PATH (--serial). Runs as the sandbox's init; see the protocol\n"
        "notes in src/wire.c.\n"
        "--policy-fd: read the policy document there and enforce it before serving, reporting\n"
        "\"ok\" or the error on --status-fd (src/policy.c describes both).\n";
    if (write(2, m, sizeof m - 1) < 0) {
    }
}

/* The descriptors the command line names (-1: not given). */
struct agent_args {
    int fd, policy_fd, status_fd, serial_fd;
    const char *listen; /* NULL: the listener is inherited at fd */
    const char *serial; /* a VM's port (mux.c): no listener at all */
};

/* -1 to go on and serve, else the status to exit with. */
static int parse_args(int argc, char **argv, struct agent_args *a)
{
    *a = (struct agent_args){
        .fd = 3, .policy_fd = -1, .status_fd = -1, .serial_fd = -1, .listen = NULL};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--fd") && i + 1 < argc) {
            a->fd = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--listen") && i + 1 < argc) {
            a->listen = argv[++i];
        } else if (!strcmp(argv[i], "--serial") && i + 1 < argc) {
            a->serial = argv[++i];
        } else if (!strcmp(argv[i], "--serial-fd") && i + 1 < argc) {
            a->serial_fd = atoi(argv[++i]); /* an inherited port (tests: a socketpair's end) */
        } else if (!strcmp(argv[i], "--policy-fd") && i + 1 < argc) {
            a->policy_fd = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--status-fd") && i + 1 < argc) {
            a->status_fd = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--version")) {
            printf("dsec-agent %s\n", AGENT_VERSION);
            return 0;
        } else {
            usage();
            return 2;
        }
    }
    return -1;
}

/* Adopt the listening socket; CLOEXEC so no command inherits it. One inherited is checked
 * (gVisor does not answer SO_ACCEPTCONN for a socket bound in a host directory: ours is not). */
static int take_listener(int fd, int inherited)
{
    int acc = 0;
    socklen_t al = sizeof acc;
    if (fd < 0 ||
        (inherited && (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &al) < 0 || !acc))) {
        logmsg("fd %d is not a listening socket", fd);
        return -1;
    }
    g_listen_fd = fd;
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    set_nonblock(fd, 1);
    return 0;
}

/* Bind and listen on a unix socket at path (replacing what is there); the fd, or -1. */
static int bind_listener(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        logmsg("--listen %s: path too long", path);
        return -1;
    }
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        logmsg("socket: %s", strerror(errno));
        return -1;
    }
    unlink(path);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 1024) < 0) {
        logmsg("--listen %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* Signals arrive on a signalfd, read in the poll loop, so there are no async handlers; child
 * processes undo the mask (reset_child_signals). */
static int open_signalfd(void)
{
    sigset_t mask;
    agent_sigmask(&mask);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    g_sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    if (g_sig_fd < 0) {
        logmsg("signalfd: %s", strerror(errno));
        return -1;
    }
    return 0;
}

/* Fill p[] (signals, listener, one slot per connection, then the VM channel's); the earliest
 * header deadline. */
static long long fill_pollfds(struct pollfd *p)
{
    p[0] = (struct pollfd){.fd = g_sig_fd, .events = POLLIN};
    p[1] = (struct pollfd){.fd = g_listen_fd, .events = POLLIN};
    long long next = -1;
    for (int i = 0; i < g_nconns; i++) {
        p[2 + i] = (struct pollfd){.fd = g_conns[i].fd, .events = POLLIN};
        long long d = g_conns[i].t0 + HEADER_TIMEOUT_MS;
        if (next < 0 || d < next)
            next = d;
    }
    return next;
}

/* Connections in p[] are looked up by fd: dispatch reorders g_conns. */
static void progress_ready_conns(const struct pollfd *p, int n)
{
    for (int i = 0; i < n; i++) {
        if (!p[i].revents)
            continue;
        for (int j = 0; j < g_nconns; j++)
            if (g_conns[j].fd == p[i].fd) {
                conn_progress(j);
                break;
            }
    }
}

/* A client that never finishes its header must not hold a slot (and an fd) forever. */
static void drop_slow_conns(void)
{
    long long t = now_ms();
    for (int j = g_nconns - 1; j >= 0; j--)
        if (g_conns[j].t0 + HEADER_TIMEOUT_MS <= t) {
            close(g_conns[j].fd);
            free(g_conns[j].hdr);
            conn_drop(j);
        }
}

/* Returns only if poll fails. */
static int serve(void)
{
    struct pollfd *p = NULL;
    int pcap = 0;
    for (;;) {
        if (pcap < g_nconns + 2 + mux_npollfds()) {
            pcap = g_nconns + mux_npollfds() + 18;
            p = xrealloc(p, pcap * sizeof *p);
        }
        int n = g_nconns;
        long long next = fill_pollfds(p);
        int wait = poll_wait(next);
        int m = mux_pollfds(p + 2 + n, &wait);
        int rc = poll(p, 2 + n + m, wait);
        if (rc < 0 && errno != EINTR) {
            logmsg("poll: %s", strerror(errno));
            return 1;
        }
        if (p[0].revents)
            handle_signals();
        progress_ready_conns(p + 2, n);
        drop_slow_conns();
        if (p[1].revents)
            accept_all();
        mux_handle(p + 2 + n, m); /* may add connections: after the loops over p[2..n+2) */
    }
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "drive")) /* a client, not the agent: drive.c */
        return drive_bridge(argc > 2 ? argv[2] : NULL);
    if (argc >= 2 && !strcmp(argv[1], "forward")) /* a VM's host side, not the agent: mux.c */
        return forward_main(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "no-punch")) /* a VM's QEMU, host side: nopunch.c */
        return nopunch_main(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "watch")) /* a command in the sandbox: watch.c */
        return watch_main(argc, argv);
    struct agent_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc >= 0)
        return rc;
    /* keep 0..2 taken so pipes never land there */
    for (int i = 0; i < 3; i++)
        if (fcntl(i, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
            return 1;
    guard_init();
    if (a.serial || a.serial_fd >= 0) {
        int sfd = a.serial ? open(a.serial, O_RDWR | O_CLOEXEC) : a.serial_fd;
        if (sfd < 0) {
            logmsg("%s: %s", a.serial, strerror(errno));
            policy_report_failure(a.status_fd, "its --serial port cannot be opened");
            return 2;
        }
        mux_init(sfd, 0, conn_add);
    } else if (a.listen && (a.fd = bind_listener(a.listen)) < 0) {
        policy_report_failure(a.status_fd, "cannot listen at its --listen path");
        return 2;
    } else if (take_listener(a.fd, !a.listen) < 0) {
        policy_report_failure(a.status_fd, "its --fd is not a listening socket");
        return 2;
    }
    g_main_pid = getpid();
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    signal(SIGPIPE, SIG_IGN);
    if (chdir("/") < 0) {
    }
    if (open_signalfd() < 0)
        return 1;
    /* after the signal mask: the domain thread inherits it, so signals reach the signalfd */
    if (a.policy_fd >= 0 && policy_apply(a.policy_fd, a.status_fd) < 0)
        return 3;
    return serve();
}
