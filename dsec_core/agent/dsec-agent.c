/*
 * dsec-agent: the init process (PID 1) of every dsec sandbox; it serves exec, persistent shell
 * sessions and file operations over a unix socket the node daemon handed it (like DSec's aether).
 *
 * Build: gcc -static -O2 -Wall -Werror -o dsec-agent dsec-agent.c      Usage: dsec-agent [--fd N]
 * The daemon binds and listens on a unix stream socket before the container starts and passes it
 * as fd N (default 3, runc --preserve-fds), so it can connect before the agent is even running.
 *
 * WIRE PROTOCOL (one request and one response per connection, then both sides close)
 *   frame    = u32le n, then n bytes of fields
 *   field    = u8 klen, key[klen], u32le vlen, value[vlen]    keys may repeat (lists)
 *   request  = frame, then "body_len" raw bytes (field body_len, default 0)
 *   response = frame, then "body_len" raw bytes
 * Header values are text without NUL bytes; numbers are ASCII decimal; flags are "0"/"1".
 * Binary data only travels in the body. The agent refuses a frame or body over 16 MiB with a
 * "bad_request" error without allocating it; clients split bigger file transfers.
 *
 *   op=ping                                   -> pid, version, sessions
 *   op=exec  arg..., env K=V..., cwd, timeout_ms, max_output, stdin, body=stdin
 *                                             -> exit_code, duration_us, truncated, timed_out,
 *                                                stdout_len; body = stdout ++ stderr
 *   op=session_open  cwd, env..., shell       -> session, pid (of the shell)
 *   op=session_exec  session, cmd, timeout_ms, max_output, stdin, body=stdin
 *                                             -> as exec, plus session_closed=1 if the shell died
 *   op=session_close session                  -> (ok)
 *   op=sessions                               -> session...
 *   op=read   path, offset, length(-1: to EOF) -> eof; body = data (at most 16 MiB per call)
 *   op=write  path, mode, offset, truncate, parents, body=data -> written
 *   op=list   path                            -> entry...      op=stat path -> entry
 *   op=remove path, recursive                 -> (ok)
 * entry = "<t> <size> <mode> <mtime_s> <mtime_ns> <name>", t in f d l o (file dir symlink other),
 *         mode = permission bits (st_mode & 07777) in decimal; name runs to the end of the value.
 * Errors: error=<kind> message=<text> [path=] [errno=] [name= session=...]; kinds: path,
 *         unknown_session, session_closed, bad_request, internal.
 * Closing (or half-closing) the connection before the response cancels the request: the
 * command's process tree is killed. In sessions fd 3 is reserved (the end-marker pipe).
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
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define AGENT_VERSION "0.1.0"
#define MAX_FRAME (16u << 20)        /* largest header or body the agent accepts */
#define MAX_OUTPUT (16u << 20)       /* largest per-stream output cap */
#define READ_CHUNK (64 * 1024)
#define EXIT_GRACE_MS 50             /* after the command exits, wait this long for EOF */
#define SHELL_GRACE_MS 1000          /* after killing a session's children, wait for the shell */
#define KILL_BUDGET_MS 2000          /* bound on kill-the-tree loops */
#define HEADER_TIMEOUT_MS 30000      /* a connection must send its header within this */

static const char *const DEFAULT_ENV[] = {
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    "LANG=C.UTF-8",
    NULL,
};

static pid_t g_main_pid;
static int g_listen_fd = -1;
static int g_sig_fd = -1;
static char g_priv[200];        /* private dir for session files, "" until made */
static char g_scratch[READ_CHUNK];   /* output beyond the cap is read here and dropped */

/* ---------------------------------------------------------------- small utilities */

static void logmsg(const char *fmt, ...)
{
    char line[512];
    int n = snprintf(line, sizeof line, "dsec-agent[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2)
        n = sizeof line - 2;
    line[n++] = '\n';
    if (write(2, line, n) < 0) { /* nowhere left to complain */ }
}

/* Commands go first when the sandbox hits its memory limit: the agent is the sandbox's init, and
 * if the OOM killer picked it the whole sandbox would die. Raising one's own score needs no
 * privilege. */
static void prefer_for_oom_kill(void)
{
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, "1000", 4) < 0) {
        }
        close(fd);
    }
}

static void die_oom(void)
{
    logmsg("out of memory");
    _exit(70);
}

static void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n ? n : 1);
    if (!p)
        die_oom();
    return p;
}

static void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p)
        die_oom();
    return p;
}

static long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static long long now_ms(void) { return now_us() / 1000; }

static int poll_wait(long long deadline_ms)
{
    if (deadline_ms < 0)
        return -1;
    long long left = deadline_ms - now_ms();
    if (left < 0)
        return 0;
    return left > INT_MAX ? INT_MAX : (int)left;
}

static void set_nonblock(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK);
}

struct buf {
    char *p;
    size_t len, cap;
};

static void buf_reserve(struct buf *b, size_t extra)
{
    if (b->cap - b->len >= extra)
        return;
    size_t c = b->cap ? b->cap : 256;
    while (c - b->len < extra)
        c *= 2;
    b->p = xrealloc(b->p, c);
    b->cap = c;
}

static void buf_add(struct buf *b, const void *d, size_t n)
{
    buf_reserve(b, n);
    if (n)
        memcpy(b->p + b->len, d, n);
    b->len += n;
}

static void buf_free(struct buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

static void put_u32(unsigned char *p, uint32_t v)
{
    p[0] = v;
    p[1] = v >> 8;
    p[2] = v >> 16;
    p[3] = v >> 24;
}

static uint32_t get_u32(const unsigned char *p)
{
    return p[0] | p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Write everything; works on blocking and non-blocking fds (waits up to 10 s per stall). */
static int writev_all(int fd, struct iovec *iov, int cnt)
{
    while (cnt > 0) {
        if (iov->iov_len == 0) {
            iov++;
            cnt--;
            continue;
        }
        ssize_t n = writev(fd, iov, cnt);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN) {
                struct pollfd p = {.fd = fd, .events = POLLOUT};
                if (poll(&p, 1, 10000) <= 0)
                    return -1;
                continue;
            }
            return -1;
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= n;
        }
    }
    return 0;
}

static int write_all(int fd, const void *p, size_t n)
{
    struct iovec iov = {(void *)p, n};
    return writev_all(fd, &iov, 1);
}

static int read_exact(int fd, void *p, size_t n)
{
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= r;
    }
    return 0;
}

/* ---------------------------------------------------------------- responses */

static void resp_begin(struct buf *h)
{
    h->len = 0;
    buf_reserve(h, 4);
    h->len = 4;
}

static void resp_field(struct buf *h, const char *k, const void *v, size_t n)
{
    unsigned char kl = (unsigned char)strlen(k), lb[4];
    put_u32(lb, (uint32_t)n);
    buf_add(h, &kl, 1);
    buf_add(h, k, kl);
    buf_add(h, lb, 4);
    buf_add(h, v, n);
}

static void resp_str(struct buf *h, const char *k, const char *v) { resp_field(h, k, v, strlen(v)); }

static void resp_num(struct buf *h, const char *k, long long v)
{
    char s[32];
    int n = snprintf(s, sizeof s, "%lld", v);
    resp_field(h, k, s, n);
}

static int resp_send(int fd, struct buf *h, const void *b1, size_t n1, const void *b2, size_t n2)
{
    if (n1 + n2)
        resp_num(h, "body_len", (long long)(n1 + n2));
    put_u32((unsigned char *)h->p, (uint32_t)(h->len - 4));
    struct iovec iov[3] = {{h->p, h->len}, {(void *)b1, n1}, {(void *)b2, n2}};
    int rc = writev_all(fd, iov, 3);
    buf_free(h);
    return rc;
}

static void send_ok(int fd)
{
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_send(fd, &h, NULL, 0, NULL, 0);
}

static void send_error(int fd, const char *kind, const char *path, int err, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "error", kind);
    resp_str(&h, "message", msg);
    if (path)
        resp_str(&h, "path", path);
    if (err)
        resp_num(&h, "errno", err);
    resp_send(fd, &h, NULL, 0, NULL, 0);
}

static void send_path_error(int fd, const char *path, int err)
{
    send_error(fd, "path", path, err, "%s", strerror(err));
}

/* ---------------------------------------------------------------- requests */

struct req {
    int n;
    char **key, **val;
    char *arena;
};

static void req_free(struct req *r)
{
    if (!r)
        return;
    free(r->key);
    free(r->val);
    free(r->arena);
    free(r);
}

/* Parse a header frame's fields; NULL (and *why) if malformed. Values become C strings. */
static struct req *req_parse(const unsigned char *raw, uint32_t len, const char **why)
{
    uint32_t i = 0;
    int n = 0;
    size_t arena = 0;
    while (i < len) {
        uint8_t kl = raw[i++];
        if (len - i < (uint32_t)kl + 4) {
            *why = "truncated field";
            return NULL;
        }
        if (kl == 0 || memchr(raw + i, 0, kl)) {
            *why = "bad field key";
            return NULL;
        }
        i += kl;
        uint32_t vl = get_u32(raw + i);
        i += 4;
        if (len - i < vl) {
            *why = "truncated field value";
            return NULL;
        }
        if (memchr(raw + i, 0, vl)) {
            *why = "NUL byte in a header value";
            return NULL;
        }
        i += vl;
        n++;
        arena += (size_t)kl + vl + 2;
    }
    struct req *r = xcalloc(1, sizeof *r);
    r->n = n;
    r->key = xcalloc(n, sizeof(char *));
    r->val = xcalloc(n, sizeof(char *));
    r->arena = xcalloc(arena, 1);
    char *a = r->arena;
    i = 0;
    for (int f = 0; f < n; f++) {
        uint8_t kl = raw[i++];
        r->key[f] = a;
        memcpy(a, raw + i, kl);
        a += kl;
        *a++ = 0;
        i += kl;
        uint32_t vl = get_u32(raw + i);
        i += 4;
        r->val[f] = a;
        memcpy(a, raw + i, vl);
        a += vl;
        *a++ = 0;
        i += vl;
    }
    return r;
}

static const char *req_get(const struct req *r, const char *k)
{
    for (int i = 0; i < r->n; i++)
        if (strcmp(r->key[i], k) == 0)
            return r->val[i];
    return NULL;
}

static int req_count(const struct req *r, const char *k)
{
    int c = 0;
    for (int i = 0; i < r->n; i++)
        c += strcmp(r->key[i], k) == 0;
    return c;
}

/* A number field; *bad is set (and dflt returned) if present but not a number. */
static long long req_num(const struct req *r, const char *k, long long dflt, int *bad)
{
    const char *v = req_get(r, k);
    if (!v || !*v)
        return dflt;
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || *end) {
        *bad = 1;
        return dflt;
    }
    return x;
}

/* Defaults, then the request's env fields on top (same key replaces). */
static char **build_env(const struct req *r)
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

/* ---------------------------------------------------------------- process trees */

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

static int descendants(pid_t root, pid_t **out) { return descendants_except(root, NULL, 0, out); }

/* SIGKILL every live descendant of root until none is left (bounded), sparing the nspare
 * pids in spare (sorted) and their subtrees. With reap, also collect our own dead children
 * so they stop showing up. */
static void kill_tree_except(pid_t root, int reap, const pid_t *spare, int nspare)
{
    long long end = now_ms() + KILL_BUDGET_MS;
    for (;;) {
        if (reap)
            while (waitpid(-1, NULL, WNOHANG) > 0) {
            }
        pid_t *pids;
        int n = descendants_except(root, spare, nspare, &pids);
        for (int i = 0; i < n; i++)
            kill(pids[i], SIGKILL);
        free(pids);
        if (n == 0 || now_ms() > end)
            return;
        usleep(1000);
    }
}

static void kill_descendants(pid_t root, int reap) { kill_tree_except(root, reap, NULL, 0); }

/* ---------------------------------------------------------------- paths */

static int mkdir_p(const char *path, mode_t mode)
{
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *s = tmp + 1;; s++) {
        if (*s == '/' || *s == 0) {
            char c = *s;
            *s = 0;
            if (mkdir(tmp, mode) < 0 && errno != EEXIST)
                return -1;
            *s = c;
            if (!c)
                break;
        }
    }
    struct stat st;
    if (stat(tmp, &st) < 0)
        return -1;
    if (!S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    return 0;
}

/* Remove name (relative to dfd) and everything below it; never follows symlinks. */
static int rm_tree(int dfd, const char *name)
{
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOTDIR || errno == ELOOP)
            return unlinkat(dfd, name, 0);
        return -1;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -1;
    }
    int err = 0;
    for (int pass = 0; pass < 3; pass++) {
        struct dirent *e;
        rewinddir(d);
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            int rc = (e->d_type == DT_DIR || e->d_type == DT_UNKNOWN)
                         ? rm_tree(fd, e->d_name)
                         : unlinkat(fd, e->d_name, 0);
            if (rc < 0 && errno != ENOENT && !err)
                err = errno;
        }
        if (err)
            break;
        if (unlinkat(dfd, name, AT_REMOVEDIR) == 0) {
            closedir(d);
            return 0;
        }
        if (errno != ENOTEMPTY) {
            err = errno;
            break;
        }
    }
    closedir(d);
    errno = err ? err : ENOTEMPTY;
    return -1;
}

/* ---------------------------------------------------------------- output capture */

struct stream {
    int fd;
    size_t cap;
    int truncated;
    struct buf b;
};

/* One read: 1 data, 0 EOF (fd closed), -1 nothing now. Keeps at most cap bytes. */
static int stream_read(struct stream *s)
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
static void stream_drain(struct stream *s)
{
    while (s->fd >= 0 && stream_read(s) > 0) {
    }
}

static int child_gone(short revents) { return revents & (POLLRDHUP | POLLHUP | POLLERR); }

/* ---------------------------------------------------------------- exec */

static void reset_child_signals(void)
{
    sigset_t none;
    sigemptyset(&none);
    signal(SIGPIPE, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

/* Put src[i] at fd i for i < n, whatever numbers they had (they may overlap 0..n-1). */
static int place_fds(const int *src, int n)
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

/* The answer to exec and session_exec: result fields, then stdout ++ stderr as the body.
 * session_closed < 0 leaves the field out (plain exec has no session). */
static void send_run_result(int conn, int code, long long duration_us, int timed_out,
                            const struct stream *so, const struct stream *se, int session_closed)
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
    resp_num(&h, "stdout_len", (long long)so->b.len);
    resp_send(conn, &h, so->b.p, so->b.len, se->b.p, se->b.len);
}

/* The options exec and session_exec share. Returns -1 (bad request) if a number is malformed
 * or a body comes without stdin=1; max_output is clamped to [0, MAX_OUTPUT]. */
struct run_opts {
    long long timeout_ms, maxo, has_stdin, body_len;
};

static int read_run_opts(struct req *r, struct run_opts *o)
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

static void op_exec(int conn, struct req *r)
{
    struct run_opts o;
    int bad = read_run_opts(r, &o);
    long long timeout_ms = o.timeout_ms, maxo = o.maxo, has_stdin = o.has_stdin,
              body_len = o.body_len;
    int argc = req_count(r, "arg");
    const char *cwd = req_get(r, "cwd");
    if (!cwd || !*cwd)
        cwd = "/";
    if (bad || argc == 0) {
        send_error(conn, "bad_request", NULL, 0, "exec needs arg fields and numeric options");
        return;
    }
    char **argv = xcalloc(argc + 1, sizeof(char *));
    for (int i = 0, k = 0; i < r->n; i++)
        if (strcmp(r->key[i], "arg") == 0)
            argv[k++] = r->val[i];
    char **envp = build_env(r);
    char *in = NULL;
    if (body_len > 0) {
        in = xrealloc(NULL, body_len);
        if (read_exact(conn, in, body_len) < 0)
            return;
    }
    if (chdir(cwd) < 0) {
        send_path_error(conn, cwd, errno);
        return;
    }

    int outp[2], errp[2], inp[2] = {-1, -1};
    if (pipe2(outp, O_CLOEXEC) < 0 || pipe2(errp, O_CLOEXEC) < 0) {
        send_error(conn, "internal", NULL, errno, "pipe: %s", strerror(errno));
        return;
    }
    if (has_stdin) {
        if (pipe2(inp, O_CLOEXEC) < 0) {
            send_error(conn, "internal", NULL, errno, "pipe: %s", strerror(errno));
            return;
        }
    } else if ((inp[0] = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0) {
        send_error(conn, "internal", "/dev/null", errno, "/dev/null: %s", strerror(errno));
        return;
    }

    long long t0 = now_us();
    pid_t pid = fork();
    if (pid < 0) {
        send_error(conn, "internal", NULL, errno, "fork: %s", strerror(errno));
        return;
    }
    if (pid == 0) {
        setsid();
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        reset_child_signals();
        prefer_for_oom_kill();
        int fds[3] = {inp[0], outp[1], errp[1]};
        if (place_fds(fds, 3) < 0)
            _exit(126);
        environ = envp;
        execvp(argv[0], argv);
        int e = errno;
        dprintf(2, "dsec-agent: %s: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
    }
    close(outp[1]);
    close(errp[1]);
    close(inp[0]);
    int in_w = inp[1];
    size_t in_off = 0;
    if (in_w >= 0 && body_len == 0) {
        close(in_w);
        in_w = -1;
    }
    if (in_w >= 0)
        set_nonblock(in_w, 1);
    struct stream so = {.fd = outp[0], .cap = (size_t)maxo}, se = {.fd = errp[0], .cap = (size_t)maxo};
    set_nonblock(so.fd, 1);
    set_nonblock(se.fd, 1);

    int status = 0, exited = 0, timed_out = 0;
    long long deadline = timeout_ms > 0 ? now_ms() + timeout_ms : -1, grace_end = -1;
    long long t_end = 0;
    for (;;) {
        if (exited && so.fd < 0 && se.fd < 0)
            break;
        struct pollfd p[5];
        int np = 0, ix_o = -1, ix_e = -1, ix_i = -1, ix_s, ix_c;
        if (so.fd >= 0) { ix_o = np; p[np++] = (struct pollfd){.fd = so.fd, .events = POLLIN}; }
        if (se.fd >= 0) { ix_e = np; p[np++] = (struct pollfd){.fd = se.fd, .events = POLLIN}; }
        if (in_w >= 0) { ix_i = np; p[np++] = (struct pollfd){.fd = in_w, .events = POLLOUT}; }
        ix_s = np;
        p[np++] = (struct pollfd){.fd = exited ? -1 : g_sig_fd, .events = POLLIN};
        ix_c = np;
        p[np++] = (struct pollfd){.fd = conn, .events = POLLRDHUP};
        long long until = exited ? grace_end : deadline;
        int rc = poll(p, np, poll_wait(until));
        if (rc < 0 && errno != EINTR)
            break;
        if (rc == 0) {
            if (exited)
                break; /* grace over: leftovers hold the pipes open, let them */
            timed_out = 1;
            kill(-pid, SIGKILL);
            kill_descendants(getpid(), 1);
            exited = 1;
            t_end = now_us();
            stream_drain(&so);
            stream_drain(&se);
            break;
        }
        if (child_gone(p[ix_c].revents)) {
            /* the client went away (cancelled): nobody wants the result, stop the work */
            kill(-pid, SIGKILL);
            kill_descendants(getpid(), 1);
            _exit(0);
        }
        if (ix_o >= 0 && p[ix_o].revents)
            stream_read(&so);
        if (ix_e >= 0 && p[ix_e].revents)
            stream_read(&se);
        if (ix_i >= 0 && p[ix_i].revents) {
            ssize_t n = write(in_w, in + in_off, body_len - in_off);
            if (n > 0)
                in_off += n;
            if ((n < 0 && errno != EAGAIN && errno != EINTR) || in_off == (size_t)body_len) {
                close(in_w);
                in_w = -1;
            }
        }
        if (p[ix_s].revents) {
            struct signalfd_siginfo si;
            while (read(g_sig_fd, &si, sizeof si) > 0) {
            }
            int st;
            pid_t w;
            while ((w = waitpid(-1, &st, WNOHANG)) > 0)
                if (w == pid) {
                    status = st;
                    exited = 1;
                    t_end = now_us();
                    grace_end = now_ms() + EXIT_GRACE_MS;
                }
        }
    }
    if (!t_end)
        t_end = now_us();
    if (in_w >= 0)
        close(in_w);
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    int code = timed_out ? 128 + SIGKILL
               : WIFEXITED(status) ? WEXITSTATUS(status)
               : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 255;
    send_run_result(conn, code, t_end - t0, timed_out, &so, &se, -1);
}

/* ---------------------------------------------------------------- files */

static void put_entry(struct buf *h, const char *key, const char *name, const struct stat *st)
{
    char t = S_ISREG(st->st_mode) ? 'f' : S_ISDIR(st->st_mode) ? 'd' : S_ISLNK(st->st_mode) ? 'l' : 'o';
    char pre[128];
    int n = snprintf(pre, sizeof pre, "%c %lld %u %lld %ld ", t, (long long)st->st_size,
                     (unsigned)(st->st_mode & 07777), (long long)st->st_mtim.tv_sec,
                     (long)st->st_mtim.tv_nsec);
    size_t nl = strlen(name);
    char *v = xrealloc(NULL, n + nl);
    memcpy(v, pre, n);
    memcpy(v + n, name, nl);
    resp_field(h, key, v, n + nl);
    free(v);
}

static void op_read(int conn, struct req *r)
{
    int bad = 0;
    const char *path = req_get(r, "path");
    long long off = req_num(r, "offset", 0, &bad), length = req_num(r, "length", -1, &bad);
    if (!path || bad || off < 0) {
        send_error(conn, "bad_request", NULL, 0, "read needs path, offset >= 0, length");
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) {
        send_path_error(conn, path, errno);
        return;
    }
    if (S_ISDIR(st.st_mode)) {
        send_path_error(conn, path, EISDIR);
        return;
    }
    set_nonblock(fd, 0);
    if (off > 0 && lseek(fd, off, SEEK_SET) < 0) {
        send_path_error(conn, path, errno);
        return;
    }
    size_t want = length < 0 || length > MAX_FRAME ? MAX_FRAME : (size_t)length;
    struct buf b = {0};
    int eof = 0;
    if (S_ISREG(st.st_mode) && st.st_size > off) {
        size_t hint = st.st_size - off + 1;
        buf_reserve(&b, hint < want ? hint : want);
    }
    while (b.len < want) {
        size_t chunk = want - b.len < (1u << 20) ? want - b.len : (1u << 20);
        buf_reserve(&b, chunk);
        ssize_t n = read(fd, b.p + b.len, chunk);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            send_path_error(conn, path, errno);
            return;
        }
        if (n == 0) {
            eof = 1;
            break;
        }
        b.len += n;
    }
    if (S_ISREG(st.st_mode) && off + (long long)b.len >= st.st_size)
        eof = 1;
    close(fd);
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_num(&h, "eof", eof);
    resp_send(conn, &h, b.p, b.len, NULL, 0);
}

static void op_write(int conn, struct req *r)
{
    int bad = 0;
    const char *path = req_get(r, "path");
    long long mode = req_num(r, "mode", 0644, &bad), off = req_num(r, "offset", 0, &bad);
    long long trunc = req_num(r, "truncate", 1, &bad), parents = req_num(r, "parents", 1, &bad);
    long long left = req_num(r, "body_len", 0, &bad);
    if (!path || !*path || bad || off < 0 || mode < 0 || mode > 07777) {
        send_error(conn, "bad_request", NULL, 0, "write needs path, mode, offset >= 0");
        return;
    }
    int err = 0, fd = -1;
    if (parents) {
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash && slash != dir) {
            *slash = 0;
            if (mkdir_p(dir, 0755) < 0)
                err = errno;
        }
    }
    if (!err) {
        int created = 1;
        fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, (mode_t)mode);
        if (fd < 0 && errno == EEXIST) {
            created = 0;
            fd = open(path, O_WRONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
        }
        struct stat st;
        if (fd < 0 || fstat(fd, &st) < 0)
            err = errno;
        else {
            set_nonblock(fd, 0);
            if (created)
                fchmod(fd, (mode_t)mode); /* exact mode, whatever the umask */
            if (S_ISREG(st.st_mode) && trunc && ftruncate(fd, off) < 0)
                err = errno;
        }
    }
    long long pos = off;
    while (left > 0) {
        ssize_t n = read(conn, g_scratch, left < (long long)sizeof g_scratch ? left : (long long)sizeof g_scratch);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            _exit(0); /* client gone mid-body */
        left -= n;
        for (ssize_t done = 0; !err && done < n;) {
            ssize_t w = pwrite(fd, g_scratch + done, n - done, pos);
            if (w < 0 && errno == ESPIPE)
                w = write(fd, g_scratch + done, n - done);
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0)
                err = errno;
            else {
                done += w;
                pos += w;
            }
        }
    }
    if (fd >= 0 && close(fd) < 0 && !err)
        err = errno;
    if (err) {
        send_path_error(conn, path, err);
        return;
    }
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_num(&h, "written", pos - off);
    resp_send(conn, &h, NULL, 0, NULL, 0);
}

static void op_list(int conn, struct req *r)
{
    const char *path = req_get(r, "path");
    if (!path) {
        send_error(conn, "bad_request", NULL, 0, "list needs path");
        return;
    }
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        send_path_error(conn, path, errno);
        return;
    }
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    struct dirent *e;
    struct stat st;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        if (fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0)
            put_entry(&h, "entry", e->d_name, &st);
    }
    closedir(d);
    resp_send(conn, &h, NULL, 0, NULL, 0);
}

static void op_stat(int conn, struct req *r)
{
    const char *path = req_get(r, "path");
    struct stat st;
    if (!path) {
        send_error(conn, "bad_request", NULL, 0, "stat needs path");
        return;
    }
    if (lstat(path, &st) < 0) {
        send_path_error(conn, path, errno);
        return;
    }
    char name[PATH_MAX];
    snprintf(name, sizeof name, "%s", path);
    size_t l = strlen(name);
    while (l > 1 && name[l - 1] == '/')
        name[--l] = 0;
    char *base = strrchr(name, '/');
    base = base && base[1] ? base + 1 : name;
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    put_entry(&h, "entry", base, &st);
    resp_send(conn, &h, NULL, 0, NULL, 0);
}

static void op_remove(int conn, struct req *r)
{
    int bad = 0;
    const char *path = req_get(r, "path");
    long long rec = req_num(r, "recursive", 0, &bad);
    struct stat st;
    if (!path || bad) {
        send_error(conn, "bad_request", NULL, 0, "remove needs path");
        return;
    }
    int rc;
    if (lstat(path, &st) < 0)
        rc = -1;
    else if (!S_ISDIR(st.st_mode))
        rc = unlink(path);
    else
        rc = rec ? rm_tree(AT_FDCWD, path) : rmdir(path);
    if (rc < 0)
        send_path_error(conn, path, errno);
    else
        send_ok(conn);
}

/* ---------------------------------------------------------------- sessions */

struct pend {
    int fd;
    struct req *r;
    struct pend *next;
};

struct session {
    char id[32];
    pid_t shell;
    int ctl_w, out_r, err_r, mk_r, st_r, st_w;
    int closed;       /* the shell is gone (or going): no more commands */
    int removed;      /* session_close was called: invisible, freed once quiet */
    int reaped;       /* main has collected the shell's wait status */
    pid_t handler;    /* handler running a command, 0 if idle */
    unsigned seq;
    char dir[256];
    struct pend *qh, *qt;
    struct session *next;
};

static struct session *g_sessions;
static unsigned g_session_counter;

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

/* Handler side of a session command. The shell's wait status arrives on st_r if it dies. */
static void op_session_exec(int conn, struct req *r, struct session *s)
{
    struct run_opts o;
    int bad = read_run_opts(r, &o);
    long long timeout_ms = o.timeout_ms, maxo = o.maxo, has_stdin = o.has_stdin,
              body_len = o.body_len;
    const char *cmd = req_get(r, "cmd");
    if (!cmd || bad) {
        send_error(conn, "bad_request", NULL, 0, "session_exec needs cmd and numeric options");
        return;
    }
    char cpath[300], ipath[300];
    snprintf(cpath, sizeof cpath, "%s/c%u", s->dir, s->seq);
    snprintf(ipath, sizeof ipath, "/dev/null");
    if (mkdir_p(s->dir, 0700) < 0) {
        send_error(conn, "internal", s->dir, errno, "session dir %s: %s", s->dir, strerror(errno));
        return;
    }
    size_t cl = strlen(cmd);
    char *text = xrealloc(NULL, cl + 1);
    memcpy(text, cmd, cl);
    text[cl] = '\n';
    if (write_file_all(cpath, text, cl + 1) < 0) {
        send_error(conn, "internal", cpath, errno, "%s: %s", cpath, strerror(errno));
        return;
    }
    free(text);
    if (has_stdin) {
        snprintf(ipath, sizeof ipath, "%s/i%u", s->dir, s->seq);
        int fd = open(ipath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0) {
            send_error(conn, "internal", ipath, errno, "%s: %s", ipath, strerror(errno));
            return;
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
    }

    struct stream so = {.fd = s->out_r}, se = {.fd = s->err_r};
    /* output of background jobs between commands is not this command's (bounded: a job
     * writing nonstop would otherwise keep us here forever) */
    for (int i = 0; i < 64 && stream_read(&so) > 0; i++) {
    }
    for (int i = 0; i < 64 && stream_read(&se) > 0; i++) {
    }
    so.cap = se.cap = (size_t)maxo;
    so.truncated = se.truncated = 0;
    char mk[512];
    size_t mklen = 0;
    int mk_fd = s->mk_r;
    while (mk_fd >= 0) {
        ssize_t n = read(mk_fd, mk, sizeof mk);
        if (n > 0)
            continue;
        if (n == 0) {
            close(mk_fd);
            mk_fd = -1;
        }
        break;
    }

    /* what already runs under the shell (servers started by earlier commands) survives this
     * command's timeout; only what this command started is killed */
    pid_t *before;
    int nbefore = descendants(s->shell, &before);

    char nonce[33], line[1024];
    make_nonce(nonce);
    int ll = snprintf(line, sizeof line,
                      ". '%s' 3>&- <'%s'; command printf '%%s %%d\\n' %s \"$?\" >&3\n",
                      cpath, ipath, nonce);
    long long t0 = now_us(), t_end = 0;
    int shell_dead = 0, got_marker = 0, timed_out = 0, gone = 0, phase = 0;
    int wstatus = 0, code = 0;
    if (mk_fd < 0 || write_all(s->ctl_w, line, ll) < 0)
        phase = 3; /* the shell is gone: just wait for its status below */
    long long deadline = timeout_ms > 0 ? now_ms() + timeout_ms : -1;
    if (phase == 3)
        deadline = now_ms() + SHELL_GRACE_MS;
    long long tick = -1; /* phase 1: re-kill new children (a loop of sleeps) every 50 ms */
    while (!got_marker && !shell_dead) {
        if (phase == 1 && now_ms() >= tick) {
            kill_tree_except(s->shell, 0, before, nbefore);
            tick = now_ms() + 50;
        }
        struct pollfd p[5] = {
            {.fd = so.fd, .events = POLLIN},
            {.fd = se.fd, .events = POLLIN},
            {.fd = mk_fd, .events = POLLIN},
            {.fd = s->st_r, .events = POLLIN},
            {.fd = gone ? -1 : conn, .events = POLLRDHUP},
        };
        int rc = poll(p, 5, poll_wait(phase == 1 && tick < deadline ? tick : deadline));
        if (rc < 0 && errno != EINTR)
            break;
        if (rc == 0 && phase == 1 && now_ms() < deadline)
            continue;
        if (rc == 0 || child_gone(p[4].revents)) {
            if (rc != 0)
                gone = 1;
            else if (phase < 3)
                timed_out = 1;
            if (phase == 0) {
                /* kill what the command started; the shell itself should come back */
                kill_tree_except(s->shell, 0, before, nbefore);
                phase = 1;
                tick = now_ms() + 50;
                deadline = now_ms() + SHELL_GRACE_MS;
            } else if (rc == 0 && phase == 1) {
                /* the shell is stuck in a builtin (while :; do :; done): end the session,
                 * and like session_close take everything it started with it */
                kill_descendants(s->shell, 0);
                kill(s->shell, SIGKILL);
                phase = 2;
                deadline = now_ms() + SHELL_GRACE_MS;
            } else if (rc == 0) {
                break; /* main never told us the status; give up */
            }
            continue;
        }
        if (p[0].revents)
            stream_read(&so);
        if (p[1].revents)
            stream_read(&se);
        if (p[2].revents) {
            ssize_t n = read(mk_fd, mk + mklen, sizeof mk - 1 - mklen);
            if (n == 0) {
                close(mk_fd);
                mk_fd = -1; /* shell gone: its status will come on st_r */
                if (phase == 0)
                    deadline = now_ms() + SHELL_GRACE_MS, phase = 3;
            } else if (n > 0) {
                mklen += n;
                mk[mklen] = 0;
                char *nl;
                while ((nl = memchr(mk, '\n', mklen))) {
                    *nl = 0;
                    if (strncmp(mk, nonce, 32) == 0 && mk[32] == ' ') {
                        got_marker = 1;
                        code = atoi(mk + 33);
                    }
                    mklen -= nl + 1 - mk;
                    memmove(mk, nl + 1, mklen);
                }
                if (mklen == sizeof mk - 1)
                    mklen = 0; /* garbage without newline: drop it */
            }
        }
        if (p[3].revents) {
            if (read(s->st_r, &wstatus, sizeof wstatus) == sizeof wstatus)
                shell_dead = 1;
        }
    }
    t_end = now_us();
    /* the command finished before the marker/status was written, so its output is in the
     * pipes already; after a shell death give late writers a short grace for EOF */
    stream_drain(&so);
    stream_drain(&se);
    if (shell_dead) {
        long long grace = now_ms() + EXIT_GRACE_MS;
        while (so.fd >= 0 || se.fd >= 0) {
            struct pollfd p[2] = {{.fd = so.fd, .events = POLLIN}, {.fd = se.fd, .events = POLLIN}};
            if (poll(p, 2, poll_wait(grace)) <= 0)
                break;
            if (p[0].revents)
                stream_read(&so);
            if (p[1].revents)
                stream_read(&se);
        }
        if (!got_marker)
            code = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus)
                   : WIFSIGNALED(wstatus) ? 128 + WTERMSIG(wstatus) : 255;
    } else if (!got_marker) {
        code = 255;
    }
    if (timed_out)
        code = 128 + SIGKILL;
    unlink(cpath);
    if (has_stdin)
        unlink(ipath);
    if (gone)
        return;
    send_run_result(conn, code, t_end - t0, timed_out, &so, &se, shell_dead || !got_marker);
}

/* ---------------------------------------------------------------- main-process side */

struct conn {
    int fd;
    uint32_t got, hlen;
    unsigned char lenb[4];
    unsigned char *hdr;
    long long t0;
};

static struct conn *g_conns;
static int g_nconns, g_capconns;

static const char *priv_dir(void)
{
    if (g_priv[0])
        return g_priv;
    static const char *const bases[] = {"/run", "/dev/shm", "/tmp"};
    for (unsigned i = 0; i < sizeof bases / sizeof bases[0]; i++) {
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

/* In a freshly forked handler: drop everything that belongs to other requests or sessions. */
static void handler_init(int keep_fd, struct session *keep)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != g_main_pid)
        _exit(1);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    close(g_listen_fd);
    for (int i = 0; i < g_nconns; i++)
        if (g_conns[i].fd != keep_fd)
            close(g_conns[i].fd);
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
    set_nonblock(keep_fd, 0);
}

static void spawn_handler(int fd, struct req *r, struct session *s)
{
    if (s)
        s->seq++;
    pid_t pid = fork();
    if (pid < 0) {
        send_error(fd, "internal", NULL, errno, "fork: %s", strerror(errno));
    } else if (pid == 0) {
        handler_init(fd, s);
        const char *op = req_get(r, "op");
        if (s)
            op_session_exec(fd, r, s);
        else if (!strcmp(op, "exec"))
            op_exec(fd, r);
        else if (!strcmp(op, "read"))
            op_read(fd, r);
        else if (!strcmp(op, "write"))
            op_write(fd, r);
        else if (!strcmp(op, "list"))
            op_list(fd, r);
        else if (!strcmp(op, "stat"))
            op_stat(fd, r);
        else if (!strcmp(op, "remove"))
            op_remove(fd, r);
        _exit(0);
    } else if (s) {
        s->handler = pid;
    }
    close(fd);
    req_free(r);
}

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

static void op_session_open(int fd, struct req *r)
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
    int ctl[2], out[2], err[2], mk[2], st[2], ep[2];
    if (pipe2(ctl, O_CLOEXEC) || pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) ||
        pipe2(mk, O_CLOEXEC) || pipe2(st, O_CLOEXEC) || pipe2(ep, O_CLOEXEC)) {
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
    pid_t pid = fork();
    if (pid == 0) {
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
            if (write(ep[1], e, sizeof e) < 0) {
            }
            _exit(127);
        }
        int fds[4] = {ctl[0], out[1], err[1], mk[1]};
        if (place_fds(fds, 4) < 0)
            _exit(127);
        environ = envp;
        char *argv[] = {(char *)shell, NULL};
        execv(shell, argv);
        e[0] = 2;
        e[1] = errno;
        if (write(ep[1], e, sizeof e) < 0) {
        }
        _exit(127);
    }
    free(envp);
    close(ctl[0]);
    close(out[1]);
    close(err[1]);
    close(mk[1]);
    close(ep[1]);
    int e[2];
    ssize_t n = pid < 0 ? -1 : read(ep[0], e, sizeof e);
    close(ep[0]);
    if (pid < 0 || n == sizeof e) {
        if (pid > 0)
            waitpid(pid, NULL, 0);
        close(ctl[1]);
        close(out[0]);
        close(err[0]);
        close(mk[0]);
        close(st[0]);
        close(st[1]);
        rmdir(s->dir);
        free(s);
        if (pid < 0)
            send_error(fd, "internal", NULL, errno, "fork: %s", strerror(errno));
        else
            send_path_error(fd, e[0] == 1 ? cwd : shell, e[1]);
        return;
    }
    s->shell = pid;
    s->ctl_w = ctl[1];
    s->out_r = out[0];
    s->err_r = err[0];
    s->mk_r = mk[0];
    s->st_r = st[0];
    s->st_w = st[1];
    set_nonblock(s->out_r, 1);
    set_nonblock(s->err_r, 1);
    set_nonblock(s->mk_r, 1);
    set_nonblock(s->st_r, 1);
    s->next = g_sessions;
    g_sessions = s;
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_str(&h, "session", s->id);
    resp_num(&h, "pid", pid);
    resp_send(fd, &h, NULL, 0, NULL, 0);
}

static void op_session_close(int fd, struct req *r)
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

static void reap_children(void)
{
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        for (struct session *s = g_sessions, *next; s; s = next) {
            next = s->next;
            if (s->shell == pid && !s->reaped) {
                s->reaped = 1;
                s->closed = 1;
                if (write(s->st_w, &st, sizeof st) < 0) {
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
}

static void shutdown_agent(int sig)
{
    kill_descendants(getpid(), 1);
    if (g_priv[0])
        rm_tree(AT_FDCWD, g_priv);
    logmsg("signal %d: stopped", sig);
    _exit(0);
}

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
        struct buf h = {0};
        int live = 0;
        for (struct session *s = g_sessions; s; s = s->next)
            live += !s->removed && !s->closed;
        resp_begin(&h);
        resp_str(&h, "ok", "1");
        resp_num(&h, "pid", getpid());
        resp_str(&h, "version", AGENT_VERSION);
        resp_num(&h, "sessions", live);
        resp_send(fd, &h, NULL, 0, NULL, 0);
    } else if (!strcmp(op, "sessions")) {
        struct buf h = {0};
        resp_begin(&h);
        resp_str(&h, "ok", "1");
        for (struct session *s = g_sessions; s; s = s->next)
            if (!s->removed && !s->closed)
                resp_str(&h, "session", s->id);
        resp_send(fd, &h, NULL, 0, NULL, 0);
    } else if (!strcmp(op, "session_open")) {
        op_session_open(fd, r);
    } else if (!strcmp(op, "session_close")) {
        op_session_close(fd, r);
    } else if (!strcmp(op, "session_exec")) {
        struct session *s = session_find(req_get(r, "session"));
        if (!s) {
            send_unknown_session(fd, req_get(r, "session"));
        } else if (s->closed) {
            send_session_closed(fd, s);
        } else {
            struct pend *q = xcalloc(1, sizeof *q);
            q->fd = fd;
            q->r = r;
            if (s->qt)
                s->qt->next = q;
            else
                s->qh = q;
            s->qt = q;
            session_kick(s);
            return;
        }
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

static void accept_all(void)
{
    for (;;) {
        int fd = accept4(g_listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        if (g_nconns == g_capconns) {
            g_capconns = g_capconns ? g_capconns * 2 : 16;
            g_conns = xrealloc(g_conns, g_capconns * sizeof *g_conns);
        }
        g_conns[g_nconns++] = (struct conn){.fd = fd, .t0 = now_ms()};
        conn_progress(g_nconns - 1); /* usually the whole header is already there */
    }
}

static void handle_signals(void)
{
    struct signalfd_siginfo si;
    int child = 0;
    while (read(g_sig_fd, &si, sizeof si) == sizeof si) {
        if (si.ssi_signo == SIGCHLD)
            child = 1;
        else
            shutdown_agent((int)si.ssi_signo);
    }
    if (child)
        reap_children();
}

static void usage(void)
{
    static const char m[] =
        "usage: dsec-agent [--fd N]\n"
        "Serve exec, shell sessions and file operations on the listening unix socket at fd N\n"
        "(default 3). Runs as the sandbox's init; see the protocol notes in dsec-agent.c.\n";
    if (write(2, m, sizeof m - 1) < 0) {
    }
}

int main(int argc, char **argv)
{
    int fd = 3;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--fd") && i + 1 < argc) {
            fd = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--version")) {
            printf("dsec-agent %s\n", AGENT_VERSION);
            return 0;
        } else {
            usage();
            return 2;
        }
    }
    /* keep 0..2 taken so pipes never land there */
    for (int i = 0; i < 3; i++)
        if (fcntl(i, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
            return 1;
    int acc = 0;
    socklen_t al = sizeof acc;
    if (fd < 0 || getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &al) < 0 || !acc) {
        logmsg("fd %d is not a listening socket", fd);
        return 2;
    }
    g_listen_fd = fd;
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    set_nonblock(fd, 1);
    g_main_pid = getpid();
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    signal(SIGPIPE, SIG_IGN);
    if (chdir("/") < 0) {
    }
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    g_sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    if (g_sig_fd < 0) {
        logmsg("signalfd: %s", strerror(errno));
        return 1;
    }

    struct pollfd *p = NULL;
    int pcap = 0;
    for (;;) {
        if (pcap < g_nconns + 2) {
            pcap = g_nconns + 18;
            p = xrealloc(p, pcap * sizeof *p);
        }
        p[0] = (struct pollfd){.fd = g_sig_fd, .events = POLLIN};
        p[1] = (struct pollfd){.fd = g_listen_fd, .events = POLLIN};
        long long next = -1;
        int n = g_nconns;
        for (int i = 0; i < n; i++) {
            p[2 + i] = (struct pollfd){.fd = g_conns[i].fd, .events = POLLIN};
            long long d = g_conns[i].t0 + HEADER_TIMEOUT_MS;
            if (next < 0 || d < next)
                next = d;
        }
        int rc = poll(p, 2 + n, poll_wait(next));
        if (rc < 0 && errno != EINTR) {
            logmsg("poll: %s", strerror(errno));
            return 1;
        }
        if (p[0].revents)
            handle_signals();
        /* connections in p[] are looked up by fd: dispatch reorders g_conns */
        for (int i = 0; i < n; i++) {
            if (!p[2 + i].revents)
                continue;
            for (int j = 0; j < g_nconns; j++)
                if (g_conns[j].fd == p[2 + i].fd) {
                    conn_progress(j);
                    break;
                }
        }
        long long t = now_ms();
        for (int j = g_nconns - 1; j >= 0; j--)
            if (g_conns[j].t0 + HEADER_TIMEOUT_MS <= t) {
                close(g_conns[j].fd);
                free(g_conns[j].hdr);
                conn_drop(j);
            }
        if (p[1].revents)
            accept_all();
    }
}
