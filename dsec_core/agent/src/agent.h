/*
 * dsec-agent: the init process (PID 1) of every dsec sandbox; it serves exec, persistent shell
 * sessions and file operations over a unix socket the node daemon handed it.
 *
 * This header is what the source files share: limits, structs, globals and the functions one
 * file calls in another. The wire protocol is described at the top of wire.c, the architecture
 * (processes, sessions, descriptors) at the top of main.c.
 *
 * Build, as ensure_agent does it: gcc -static -O2 -Wall -Werror -I src -o dsec-agent followed
 * by every .c file in src/. Usage: dsec-agent [--fd N | --serial PATH] [--policy-fd N [--status-fd N]]
 *
 * Every .c file includes this header first, so _GNU_SOURCE is set before any system header.
 */
#ifndef DSEC_AGENT_H
#define DSEC_AGENT_H

#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

extern char **environ;

#define AGENT_VERSION "0.1.0"
#define MAX_FRAME (16u << 20)        /* largest header or body the agent accepts */
#define MAX_OUTPUT (16u << 20)       /* largest per-stream output cap */
#define READ_CHUNK (64 * 1024)
#define EXIT_GRACE_MS 50             /* after the command exits, wait this long for EOF */
#define SHELL_GRACE_MS 1000          /* after killing a session's children, wait for the shell */
#define KILL_BUDGET_MS 2000          /* bound on kill-the-tree loops */
#define HEADER_TIMEOUT_MS 30000      /* a connection must send its header within this */

/* ---------------------------------------------------------------- alloc.c */

struct buf {
    char *p;
    size_t len, cap;
};

/* Scratch space for bytes passing through a handler (output over the cap, request bodies on
 * their way into a file); handlers are single-threaded processes, so one buffer serves all. */
extern char g_scratch[READ_CHUNK];

void *xrealloc(void *p, size_t n);
void *xcalloc(size_t n, size_t sz);
void buf_reserve(struct buf *b, size_t extra);
void buf_add(struct buf *b, const void *d, size_t n);
void buf_free(struct buf *b);

/* ---------------------------------------------------------------- io.c */

void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
long long now_us(void);
long long now_ms(void);
int poll_wait(long long deadline_ms);
void set_nonblock(int fd, int on);
struct iovec;
int writev_all(int fd, struct iovec *iov, int cnt);
int write_all(int fd, const void *p, size_t n);
int read_exact(int fd, void *p, size_t n);

/* ---------------------------------------------------------------- wire.c */

/* A parsed request header: n fields, keys and values as C strings in one arena. */
struct req {
    int n;
    char **key, **val;
    char *arena;
};

uint32_t get_u32(const unsigned char *p);
void resp_begin(struct buf *h);
void resp_field(struct buf *h, const char *k, const void *v, size_t n);
void resp_str(struct buf *h, const char *k, const char *v);
void resp_num(struct buf *h, const char *k, long long v);
int resp_send(int fd, struct buf *h, const void *b1, size_t n1, const void *b2, size_t n2);
void send_ok(int fd);
void send_error(int fd, const char *kind, const char *path, int err, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
void send_path_error(int fd, const char *path, int err);
struct req *req_parse(const unsigned char *raw, uint32_t len, const char **why);
void req_free(struct req *r);
const char *req_get(const struct req *r, const char *k);
int req_count(const struct req *r, const char *k);
long long req_num(const struct req *r, const char *k, long long dflt, int *bad);

/* ---------------------------------------------------------------- mux.c */

struct pollfd;
void mux_init(int serial_fd, int host, void (*deliver)(int fd));
int mux_active(void);
void mux_open(int fd);
int mux_npollfds(void);
int mux_pollfds(struct pollfd *p, int *wait_ms);
int mux_handle(const struct pollfd *p, int n);
void mux_close_fds_in_handler(void);
int forward_main(int argc, char **argv);
int nopunch_main(int argc, char **argv);

/* ---------------------------------------------------------------- random.c */

void op_wake(int conn, struct req *r);

/* ---------------------------------------------------------------- freeze.c */

void op_freeze(int conn, struct req *r);
void op_reclaim(int conn, struct req *r);
void op_ifup(int conn, struct req *r);

/* ---------------------------------------------------------------- proctree.c */

int descendants(pid_t root, pid_t **out);
int kill_tree_except(pid_t root, int reap, const pid_t *spare, int nspare);
void kill_descendants(pid_t root, int reap);
void reap_exited(void);

/* ---------------------------------------------------------------- exec.c */

/* One output pipe of a command, captured up to cap bytes. */
struct stream {
    int fd;
    size_t cap;
    int truncated;
    struct buf b;
};

/* The options exec and session_exec share. */
struct run_opts {
    long long timeout_ms, maxo, has_stdin, body_len;
};

int read_run_opts(struct req *r, struct run_opts *o);
char **build_env(const struct req *r);
void reset_child_signals(void);
void prefer_for_oom_kill(void);
int place_fds(const int *src, int n);
int stream_read(struct stream *s);
void stream_drain(struct stream *s);
int child_gone(short revents);
int wait_status_code(int status);
struct rusage;
void send_run_result(int conn, int code, long long duration_us, int timed_out,
                     const struct stream *so, const struct stream *se, int session_closed,
                     const struct rusage *ru);
void op_exec(int conn, struct req *r);

/* ---------------------------------------------------------------- files.c */

int mkdir_p(const char *path, mode_t mode);
int rm_tree(int dfd, const char *name);
void op_read(int conn, struct req *r);
void op_write(int conn, struct req *r);
void op_list(int conn, struct req *r);
void op_stat(int conn, struct req *r);
void op_remove(int conn, struct req *r);

/* ---------------------------------------------------------------- sessions.c */

/* A request waiting for its session's shell to finish the command before it. */
struct pend {
    int fd;
    struct req *r;
    struct pend *next;
};

struct session {
    char id[32];
    pid_t shell;
    int ctl_w, out_r, err_r, mk_r, st_r, st_w;   /* main's ends of the shell's pipes */
    int closed;       /* the shell is gone (or going): no more commands */
    int removed;      /* session_close was called: invisible, freed once quiet */
    int reaped;       /* main has collected the shell's wait status */
    pid_t handler;    /* handler running a command, 0 if idle */
    unsigned seq;     /* counts the commands; names their files */
    char dir[256];    /* private dir for command and stdin files */
    struct pend *qh, *qt;
    struct session *next;
};

int sessions_live(void);
void op_sessions(int fd);
void op_session_open(int fd, struct req *r);
void op_session_close(int fd, struct req *r);
int session_enqueue(int fd, struct req *r);
void op_session_exec(int conn, struct req *r, struct session *s);
void session_child_exited(pid_t pid, int status);
int session_shells(pid_t *out, int max);
void sessions_close_fds_in_handler(int keep_fd, struct session *keep);
void priv_dir_remove(void);
int session_dir_prepare(void);

/* ---------------------------------------------------------------- guard.c */

struct signalfd_siginfo;
void guard_init(void);
int signal_from_outside(const struct signalfd_siginfo *si);
void guard_track(pid_t pid);
void reap_children(void);

/* ---------------------------------------------------------------- policy.c */

int policy_apply(int policy_fd, int status_fd);
void policy_report_failure(int status_fd, const char *why);

/* ---------------------------------------------------------------- landlock.c */

#define SCOPE_SIGNAL 1u
#define SCOPE_ABSTRACT_UNIX 2u

/* The file policy of the document: paths as given (landlock.c resolves them), scope bits. */
struct file_rules {
    char **read_only, **hidden;
    int n_read_only, n_hidden;
    unsigned scope;
};

int files_rules_present(const struct file_rules *f);
int landlock_prepare(const struct file_rules *f, char *err, size_t errlen);
int landlock_protects(const char *path);

/* ---------------------------------------------------------------- domain.c */

int domain_start(int ruleset, char *err, size_t errlen);
int domain_active(void);
pid_t domain_spawn(int sandboxed, void (*fn)(void *), void *arg);

/* ---------------------------------------------------------------- drive.c */

int drive_bridge(const char *path);
int watch_main(int argc, char **argv);

/* ---------------------------------------------------------------- main.c */

/* Main's signalfd (SIGCHLD and the stop signals). Handlers inherit it and learn from it that
 * their command exited, without a SIGCHLD handler racing waitpid. */
extern int g_sig_fd;

void spawn_handler(int fd, struct req *r, struct session *s);

#endif
