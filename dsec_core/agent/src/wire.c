/*
 * The wire protocol: frame and field encoding, request parsing, responses and errors.
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
 *   op=exec  arg..., env K=V..., cwd, timeout_ms, max_output, stdin, background, exclusive,
 *            body=stdin                       -> exit_code, duration_us, truncated, timed_out,
 *                                                cpu_us, maxrss_kb (unless timed out),
 *                                                stdout_len; body = stdout ++ stderr
 *            When the command exits, what it left running is killed unless background=1;
 *            exclusive=1 kills every other process in the sandbox before it starts.
 *            stream=1 sends the output as it comes, before the result: frames with
 *            chunk=out|err and the bytes as the body; the result then has stdout_len=0 and
 *            no body (max_output still bounds each stream's total).
 *            interactive=1 (implies stream=1) keeps the connection two-way while the command
 *            runs: the agent first sends started=1 pid=<pid>, then chunks (max_output bounds
 *            each chunk, not the total) and the result; the client may send frames of fields
 *            at any time: a body (body_len) is input for stdin (stdin=1 keeps it open; else
 *            input is dropped), eof=1 closes stdin once the input before it is written,
 *            rows+cols resize the terminal, signal=N sends signal N to the command. pty=1
 *            (with rows, cols; default 24x80) runs the command on a new pseudo-terminal of
 *            the sandbox as its controlling tty (fds 0-2): its output is chunk=out, and eof=1
 *            is the terminal's EOF character.
 *   op=session_open  cwd, env..., shell       -> session, pid (of the shell)
 *   op=session_exec  session, cmd, timeout_ms, max_output, stdin, body=stdin
 *                                             -> as exec, plus session_closed=1 if the shell died
 *            What a session command leaves running lives until the session closes or ends.
 *   op=session_close session                  -> (ok)
 *   op=sessions                               -> session...
 *   op=read   path, offset, length(-1: to EOF) -> eof; body = data (at most 16 MiB per call)
 *   op=write  path, mode, offset, truncate, parents, body=data -> written
 *   op=list   path                            -> entry...      op=stat path -> entry
 *   op=remove path, recursive                 -> (ok)
 *   op=wake seed (hex, 1-256 bytes), hostname, time (ns) -> (ok); CRNG reseeded, hostname and
 *     clock set (random.c)
 *   op=freeze on (0|1), path, seconds -> (ok, frozen); a filesystem frozen, thawed after
 *     seconds unless thawed first (freeze.c)
 *   op=reclaim bytes -> (ok, freed); a VM guest's proactive reclaim (freeze.c)
 *   op=ifup dev, address, prefix, gateway -> (ok); a VM guest's card configured (netconf.c)
 * entry = "<t> <size> <mode> <mtime_s> <mtime_ns> <name>", t in f d l o (file dir symlink other),
 *         mode = permission bits (st_mode & 07777) in decimal; name runs to the end of the value.
 * Errors: error=<kind> message=<text> [path=] [errno=] [name= session=...]; kinds: path,
 *         unknown_session, session_closed, bad_request, internal.
 * Closing (or half-closing) the connection before the response cancels the request: the
 * command's process tree is killed. In sessions fd 3 is reserved (the end-marker pipe).
 *
 * START-UP (before any connection is served): with --policy-fd N the agent reads the agent
 * policy document from fd N, "DSECPOL1" then fields in the encoding above (values may hold any
 * byte): seccomp (a BPF program), landlock.read_only, landlock.hidden, landlock.scope (see
 * policy.c for each). It enforces all of it on itself and on everything it will start, then
 * writes one line on --status-fd, "ok" or "error <part>: <message>", and closes it; after an
 * error it exits (status 3) without serving. Without --policy-fd it serves at once.
 */
#include "agent.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

/* ---------------------------------------------------------------- frames */

static void put_u32(unsigned char *p, uint32_t v)
{
    p[0] = v;
    p[1] = v >> 8;
    p[2] = v >> 16;
    p[3] = v >> 24;
}

uint32_t get_u32(const unsigned char *p)
{
    return p[0] | p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ---------------------------------------------------------------- responses */

void resp_begin(struct buf *h)
{
    h->len = 0;
    buf_reserve(h, 4);
    h->len = 4;
}

void resp_field(struct buf *h, const char *k, const void *v, size_t n)
{
    unsigned char kl = (unsigned char)strlen(k), lb[4];
    put_u32(lb, (uint32_t)n);
    buf_add(h, &kl, 1);
    buf_add(h, k, kl);
    buf_add(h, lb, 4);
    buf_add(h, v, n);
}

void resp_str(struct buf *h, const char *k, const char *v) { resp_field(h, k, v, strlen(v)); }

void resp_num(struct buf *h, const char *k, long long v)
{
    char s[32];
    int n = snprintf(s, sizeof s, "%lld", v);
    resp_field(h, k, s, n);
}

int resp_send(int fd, struct buf *h, const void *b1, size_t n1, const void *b2, size_t n2)
{
    if (n1 + n2)
        resp_num(h, "body_len", (long long)(n1 + n2));
    put_u32((unsigned char *)h->p, (uint32_t)(h->len - 4));
    struct iovec iov[3] = {{h->p, h->len}, {(void *)b1, n1}, {(void *)b2, n2}};
    int rc = writev_all(fd, iov, 3);
    buf_free(h);
    return rc;
}

void send_ok(int fd)
{
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_send(fd, &h, NULL, 0, NULL, 0);
}

void send_error(int fd, const char *kind, const char *path, int err, const char *fmt, ...)
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

void send_path_error(int fd, const char *path, int err)
{
    send_error(fd, "path", path, err, "%s", strerror(err));
}

/* ---------------------------------------------------------------- requests */

void req_free(struct req *r)
{
    if (!r)
        return;
    free(r->key);
    free(r->val);
    free(r->arena);
    free(r);
}

/* Parse a header frame's fields; NULL (and *why) if malformed. Values become C strings. */
struct req *req_parse(const unsigned char *raw, uint32_t len, const char **why)
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

const char *req_get(const struct req *r, const char *k)
{
    for (int i = 0; i < r->n; i++)
        if (strcmp(r->key[i], k) == 0)
            return r->val[i];
    return NULL;
}

int req_count(const struct req *r, const char *k)
{
    int c = 0;
    for (int i = 0; i < r->n; i++)
        c += strcmp(r->key[i], k) == 0;
    return c;
}

/* A number field; *bad is set (and dflt returned) if present but not a number. */
long long req_num(const struct req *r, const char *k, long long dflt, int *bad)
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
