/*
 * The agent policy document: what the node asks the agent to enforce before it serves (a
 * seccomp filter, Landlock file rules and scopes), read from the descriptor --policy-fd names.
 * The agent applies it to itself and to every process it starts, and reports the outcome on
 * the descriptor --status-fd names, so the backend can fail the create with the reason.
 *
 * DOCUMENT (version 1; every backend hands over the same bytes, the container backend as a
 * sealed memfd at fd 4, a VM backend over its own channel)
 *   document = "DSECPOL1", then fields up to the end (at most 4 MiB)
 *   field    = u8 klen, key[klen], u32le vlen, value[vlen]     keys may repeat (lists)
 * The field encoding is the wire protocol's (wire.c), except that values may hold any byte.
 *   seccomp             a classic BPF program for seccomp(SECCOMP_SET_MODE_FILTER): struct
 *                       sock_filter[] (u16 code, u8 jt, u8 jf, u32 k) in the machine's byte order,
 *                       1 to 4096 instructions; at most once
 *   landlock.read_only  an absolute path: no writes beneath it (repeatable)
 *   landlock.hidden     an absolute path: nothing at all beneath it, reads included (repeatable)
 *   landlock.scope      "signal" or "abstract_unix" (repeatable)
 * A key the agent does not know is refused: a newer node must not believe an older agent
 * enforces what it skipped. Paths are text without NUL bytes.
 *
 * STATUS: one line, then the descriptor is closed: "ok", or "error <part>: <message>" with
 * <part> one of document, landlock, seccomp. After an error the agent exits (status 3) without
 * serving: a sandbox never runs without the policy it was created with.
 *
 * Order: Landlock first (it walks the file system and starts the domain thread, landlock.c),
 * then the seccomp filter, installed with TSYNC on every thread of the agent, so the agent,
 * its handlers and every process they start run under it, root included.
 */
#include "agent.h"

#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define POLICY_MAGIC "DSECPOL1"
#define MAX_POLICY (4u << 20)
#define MAX_BPF_INSNS 4096

/* The parsed document; pointers into the raw bytes, which outlive it. */
struct policy {
    const unsigned char *bpf;
    uint32_t bpf_len;
    int has_bpf;
    struct file_rules files;
};

/* ---------------------------------------------------------------- status */

static int g_status_fd = -1;

/* Report the outcome once and close the status descriptor (also logged on refusal). */
static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if (n > (int)sizeof line - 2)
        n = sizeof line - 2;
    if (strncmp(line, "ok", 2) != 0)
        logmsg("policy refused: %s", line);
    line[n++] = '\n';
    if (g_status_fd >= 0) {
        if (write_all(g_status_fd, line, n) < 0) {
        }
        close(g_status_fd);
        g_status_fd = -1;
    }
}

void policy_report_failure(int status_fd, const char *why)
{
    g_status_fd = status_fd;
    report("error agent: %s", why);
}

/* ---------------------------------------------------------------- reading and parsing */

/* The whole document, at most MAX_POLICY bytes; NULL (and *why) otherwise. */
static unsigned char *read_document(int fd, uint32_t *len, const char **why)
{
    size_t cap = 64 * 1024, n = 0;
    unsigned char *p = xrealloc(NULL, cap);
    for (;;) {
        if (n == cap) {
            if (cap >= MAX_POLICY) {
                *why = "the document is over 4 MiB";
                free(p);
                return NULL;
            }
            cap *= 2;
            p = xrealloc(p, cap);
        }
        ssize_t r = read(fd, p + n, cap - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            *why = strerror(errno);
            free(p);
            return NULL;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    *len = (uint32_t)n;
    return p;
}

static char *dup_text(const unsigned char *v, uint32_t n)
{
    char *s = xrealloc(NULL, (size_t)n + 1);
    memcpy(s, v, n);
    s[n] = 0;
    return s;
}

static void add_path(char ***list, int *n, const unsigned char *v, uint32_t vl)
{
    *list = xrealloc(*list, (size_t)(*n + 1) * sizeof **list);
    (*list)[(*n)++] = dup_text(v, vl);
}

/* One field into p; 0, or -1 with *why. */
static int take_field(struct policy *p, const char *key, const unsigned char *v, uint32_t vl,
                      const char **why)
{
    int path = !strcmp(key, "landlock.read_only") || !strcmp(key, "landlock.hidden");
    if (path && (vl == 0 || v[0] != '/' || memchr(v, 0, vl))) {
        *why = "a landlock path is not an absolute path without NUL bytes";
        return -1;
    }
    if (!strcmp(key, "seccomp")) {
        if (p->has_bpf || vl == 0 || vl % sizeof(struct sock_filter) ||
            vl / sizeof(struct sock_filter) > MAX_BPF_INSNS) {
            *why = "seccomp must be one program of 1 to 4096 instructions";
            return -1;
        }
        p->bpf = v, p->bpf_len = vl, p->has_bpf = 1;
    } else if (!strcmp(key, "landlock.read_only")) {
        add_path(&p->files.read_only, &p->files.n_read_only, v, vl);
    } else if (!strcmp(key, "landlock.hidden")) {
        add_path(&p->files.hidden, &p->files.n_hidden, v, vl);
    } else if (!strcmp(key, "landlock.scope") && vl == 6 && !memcmp(v, "signal", 6)) {
        p->files.scope |= SCOPE_SIGNAL;
    } else if (!strcmp(key, "landlock.scope") && vl == 13 && !memcmp(v, "abstract_unix", 13)) {
        p->files.scope |= SCOPE_ABSTRACT_UNIX;
    } else {
        *why = !strcmp(key, "landlock.scope") ? "unknown landlock.scope" : "unknown key";
        return -1;
    }
    return 0;
}

/* 0, or -1 with *why (and *bad_key, the key at fault, if any). */
static int parse_document(const unsigned char *raw, uint32_t len, struct policy *p,
                          const char **why, char *bad_key, size_t bad_len)
{
    size_t ml = sizeof POLICY_MAGIC - 1;
    if (len < ml || memcmp(raw, POLICY_MAGIC, ml)) {
        *why = "it does not start with " POLICY_MAGIC;
        return -1;
    }
    for (uint32_t i = ml; i < len;) {
        uint8_t kl = raw[i++];
        if (kl == 0 || len - i < (uint32_t)kl + 4) {
            *why = "a truncated field";
            return -1;
        }
        char key[256];
        memcpy(key, raw + i, kl);
        key[kl] = 0;
        i += kl;
        uint32_t vl = get_u32(raw + i);
        i += 4;
        if (len - i < vl) {
            *why = "a truncated field value";
            return -1;
        }
        if (take_field(p, key, raw + i, vl, why) < 0) {
            snprintf(bad_key, bad_len, "%s", key);
            return -1;
        }
        i += vl;
    }
    return 0;
}

/* ---------------------------------------------------------------- seccomp */

/* Install the filter on every thread of the agent (TSYNC). 0, or -1 with the reason in err. */
static int install_seccomp(const struct policy *p, char *err, size_t errlen)
{
    /* a copy: the document's bytes need not be aligned for struct sock_filter */
    struct sock_filter *insns = xrealloc(NULL, p->bpf_len);
    memcpy(insns, p->bpf, p->bpf_len);
    struct sock_fprog prog = {
        .len = (unsigned short)(p->bpf_len / sizeof(struct sock_filter)),
        .filter = insns,
    };
    long rc = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog);
    int e = errno;
    free(insns);
    if (rc == 0)
        return 0;
    if (rc > 0)
        snprintf(err, errlen, "thread %ld could not take the filter (TSYNC)", rc);
    else
        snprintf(err, errlen, "seccomp(SECCOMP_SET_MODE_FILTER): %s", strerror(e));
    return -1;
}

/* ---------------------------------------------------------------- applying */

static void policy_free(struct policy *p)
{
    for (int i = 0; i < p->files.n_read_only; i++)
        free(p->files.read_only[i]);
    for (int i = 0; i < p->files.n_hidden; i++)
        free(p->files.hidden[i]);
    free(p->files.read_only);
    free(p->files.hidden);
}

/* Read the document on policy_fd, enforce it and report on status_fd (-1: only the log). Both
 * descriptors are closed: commands must not inherit them. 0 if everything is in force. */
int policy_apply(int policy_fd, int status_fd)
{
    g_status_fd = status_fd;
    const char *why = NULL;
    uint32_t len = 0;
    unsigned char *raw = read_document(policy_fd, &len, &why);
    if (policy_fd != status_fd) /* one socket may carry both (a VM's channel) */
        close(policy_fd);
    if (!raw) {
        report("error document: cannot read it: %s", why);
        return -1;
    }
    struct policy p = {0};
    char key[256] = "", err[512] = "";
    int rc = -1;
    if (parse_document(raw, len, &p, &why, key, sizeof key) < 0) {
        report("error document: %s%s%s", why, key[0] ? ": " : "", key);
    } else if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) {
        /* runc sets it already; seccomp and Landlock both need it without CAP_SYS_ADMIN */
        report("error agent: PR_SET_NO_NEW_PRIVS: %s", strerror(errno));
    } else if (files_rules_present(&p.files) && landlock_prepare(&p.files, err, sizeof err) < 0) {
        report("error landlock: %s", err);
    } else if (p.has_bpf && install_seccomp(&p, err, sizeof err) < 0) {
        report("error seccomp: %s", err);
    } else {
        report("ok");
        rc = 0;
    }
    policy_free(&p);
    free(raw);
    return rc;
}
