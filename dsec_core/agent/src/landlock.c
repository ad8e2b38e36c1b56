/*
 * The sandbox's file policy as a Landlock ruleset: read_only paths (no writes beneath them) and
 * hidden paths (nothing beneath them, reads included), plus scopes (signals, abstract unix
 * sockets). The ruleset is built once, at start, by walking the sandbox's file system; the
 * domain thread (domain.c) enforces it on itself, and every command and session shell is forked
 * from that thread, so they all share one Landlock domain and the agent stays outside it.
 *
 * HOW A DENY IS BUILT FROM GRANTS
 * A Landlock ruleset handles a set of rights, denies them everywhere, and grants them back only
 * beneath the files and directories its rules name: a grant on a directory covers everything
 * below it. So "everything except beneath P" is built along the path from / down to P:
 *   - every entry of an ancestor A of P other than the next step towards P gets the rights of
 *     where it is (everything, unless A is itself beneath a protected path): a directory
 *     beneath it, a file for itself (symlinks get nothing: access follows them to their
 *     target, whose own rules decide);
 *   - A itself gets only the rights that are allowed beneath every protected path under A
 *     (for a read_only P: reading, listing and running; for a hidden P: nothing), since a
 *     grant on A reaches P too;
 *   - P gets its own rights: read_only: execute, read files, list directories; hidden: none.
 * What this cannot express, by construction:
 *   - rights on an ancestor itself: nothing can be created, removed or renamed directly in an
 *     ancestor of a protected path (not even at the top level: / is everyone's ancestor), and
 *     an ancestor of a hidden path cannot be listed;
 *   - entries that appear after the start: a new entry in an ancestor has the ancestor's own
 *     rights, not its siblings' (so a protected path that does not exist yet is protected
 *     through its nearest existing ancestor), and an entry replaced later (renamed over by the
 *     node's own file API) loses its rule;
 *   - metadata: Landlock does not mediate stat, chmod, chown, utimes or xattrs, so names can be
 *     tested for existence beneath a hidden path, and modes changed beneath a read-only one.
 * Paths are resolved with realpath first (/bin -> /usr/bin on merged-/usr systems), so the
 * walk never crosses a symlink; a path missing at start is resolved as far as it exists.
 *
 * Landlock ABI: file rules need 3 (TRUNCATE; REFER from 2 makes cross-directory renames and
 * links work where allowed), scopes need 6; IOCTL_DEV (5) is handled when present.
 */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Our own copies of the uapi definitions: the build host's headers may predate the ABI. */
#define LL_CREATE_RULESET_VERSION (1u << 0)
#define LL_RULE_PATH_BENEATH 1
#define LL_EXECUTE (1ull << 0)
#define LL_WRITE_FILE (1ull << 1)
#define LL_READ_FILE (1ull << 2)
#define LL_READ_DIR (1ull << 3)
#define LL_ABI1_ALL ((1ull << 13) - 1) /* EXECUTE .. MAKE_SYM */
#define LL_REFER (1ull << 13)
#define LL_TRUNCATE (1ull << 14)
#define LL_IOCTL_DEV (1ull << 15)
#define LL_SCOPE_ABSTRACT_UNIX (1ull << 0)
#define LL_SCOPE_SIGNAL (1ull << 1)
#define LL_READ_SET (LL_EXECUTE | LL_READ_FILE | LL_READ_DIR)
#define LL_FILE_SET (LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV)
#define MAX_WALKED 100000 /* entries the walk may visit: a bound on start-up time */

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#endif

struct ll_ruleset_attr {
    uint64_t handled_access_fs, handled_access_net, scoped;
};
struct ll_path_beneath {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

/* A protected path, resolved; rights = what stays allowed beneath it. */
struct prot {
    char *path;
    uint64_t rights;
};

static struct prot *g_prot;
static int g_nprot;
static uint64_t g_handled;
static int g_ruleset = -1;
static int g_walked;
static char *g_err;
static size_t g_errlen;

int files_rules_present(const struct file_rules *f)
{
    return f->n_read_only || f->n_hidden || f->scope;
}

/* ---------------------------------------------------------------- paths */

/* 1 if p is d or beneath it. */
static int beneath(const char *p, const char *d)
{
    size_t n = strlen(d);
    if (n == 1 && d[0] == '/')
        return 1;
    return !strncmp(p, d, n) && (p[n] == 0 || p[n] == '/');
}

int landlock_protects(const char *path)
{
    for (int i = 0; i < g_nprot; i++)
        if (beneath(path, g_prot[i].path))
            return 1;
    return 0;
}

/* realpath of the longest existing prefix of path, with the rest appended; NULL on error. */
static char *resolve(const char *path)
{
    size_t keep = strlen(path);
    for (;;) {
        char head[PATH_MAX];
        if (keep >= sizeof head) {
            errno = ENAMETOOLONG;
            return NULL;
        }
        memcpy(head, path, keep);
        head[keep] = 0;
        char *real = realpath(head, NULL);
        if (real) {
            const char *rest = path + keep;
            char *out = xrealloc(NULL, strlen(real) + strlen(rest) + 1);
            strcpy(out, real);
            strcat(out, real[strlen(real) - 1] == '/' && rest[0] == '/' ? rest + 1 : rest);
            free(real);
            return out;
        }
        if ((errno != ENOENT && errno != ENOTDIR) || keep == 1)
            return NULL;
        while (keep > 1 && path[keep - 1] != '/')
            keep--;
        keep = keep > 1 ? keep - 1 : 1;
    }
}

static int add_protected(char **paths, int n, uint64_t rights)
{
    for (int i = 0; i < n; i++) {
        char *real = resolve(paths[i]);
        if (!real) {
            snprintf(g_err, g_errlen, "%s: %s", paths[i], strerror(errno));
            return -1;
        }
        g_prot = xrealloc(g_prot, (size_t)(g_nprot + 1) * sizeof *g_prot);
        g_prot[g_nprot++] = (struct prot){.path = real, .rights = rights};
    }
    return 0;
}

/* ---------------------------------------------------------------- rules */

static int grant(int fd, uint64_t access, const char *path)
{
    if (!access)
        return 0;
    struct ll_path_beneath pb = {.allowed_access = access, .parent_fd = fd};
    if (syscall(SYS_landlock_add_rule, g_ruleset, LL_RULE_PATH_BENEATH, &pb, 0) < 0) {
        snprintf(g_err, g_errlen, "landlock_add_rule %s: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* The rights at path given those of its parent: narrowed by any protection of path itself. */
static uint64_t rights_at(const char *path, uint64_t parent)
{
    for (int i = 0; i < g_nprot; i++)
        if (!strcmp(g_prot[i].path, path))
            parent &= g_prot[i].rights;
    return parent;
}

/* What a grant on dir may carry: e narrowed by every protected path strictly beneath it.
 * *deeper says whether there is any. */
static uint64_t own_rights(const char *dir, uint64_t e, int *deeper)
{
    *deeper = 0;
    for (int i = 0; i < g_nprot; i++)
        if (strcmp(g_prot[i].path, dir) && beneath(g_prot[i].path, dir)) {
            e &= g_prot[i].rights;
            *deeper = 1;
        }
    return e;
}

static int on_the_way(const char *path)
{
    for (int i = 0; i < g_nprot; i++)
        if (beneath(g_prot[i].path, path))
            return 1;
    return 0;
}

static int walk_dir(int dfd, char *path, size_t plen, uint64_t e);

/* One entry of a directory on the way to a protected path (path holds its full name). */
static int walk_entry(int dfd, const char *name, char *path, size_t plen, uint64_t e)
{
    if (++g_walked > MAX_WALKED) {
        snprintf(g_err, g_errlen, "over %d entries beside the protected paths", MAX_WALKED);
        return -1;
    }
    int fd = openat(dfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return 0; /* gone since the listing: nothing to grant */
    struct stat st;
    int rc = 0;
    uint64_t ce = rights_at(path, e);
    if (fstat(fd, &st) < 0 || S_ISLNK(st.st_mode))
        rc = 0;
    else if (S_ISDIR(st.st_mode) && on_the_way(path))
        rc = walk_dir(fd, path, plen, ce);
    else
        rc = grant(fd, S_ISDIR(st.st_mode) ? ce : ce & LL_FILE_SET, path);
    close(fd);
    return rc;
}

/* Grant what dir (open as dfd, named path[0..plen)) and its entries may have, e being the
 * rights at dir. Recurses only towards protected paths. */
static int walk_dir(int dfd, char *path, size_t plen, uint64_t e)
{
    int deeper;
    uint64_t own = own_rights(path, e, &deeper);
    if (!deeper)
        return grant(dfd, e, path);
    if (grant(dfd, own, path) < 0)
        return -1;
    int lfd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = lfd < 0 ? NULL : fdopendir(lfd);
    if (!d) {
        snprintf(g_err, g_errlen, "cannot list %s: %s", path, strerror(errno));
        if (lfd >= 0)
            close(lfd);
        return -1;
    }
    int rc = 0;
    struct dirent *de;
    while (rc == 0 && (de = readdir(d))) {
        const char *n = de->d_name;
        if (!strcmp(n, ".") || !strcmp(n, ".."))
            continue;
        size_t sep = plen > 1, nl = strlen(n);
        if (plen + sep + nl >= PATH_MAX) {
            snprintf(g_err, g_errlen, "a path beneath %s is too long", path);
            rc = -1;
            break;
        }
        if (sep)
            path[plen] = '/';
        memcpy(path + plen + sep, n, nl + 1);
        rc = walk_entry(dfd, n, path, plen + sep + nl, e);
        path[plen] = 0;
    }
    closedir(d);
    return rc;
}

/* ---------------------------------------------------------------- the ruleset */

/* What the rules need of the kernel: 0, or -1 with the reason. */
static int check_abi(const struct file_rules *f, int *abi)
{
    *abi = (int)syscall(SYS_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
    if (*abi < 0) {
        snprintf(g_err, g_errlen, "this kernel has no Landlock (%s)",
                 errno == EOPNOTSUPP ? "disabled at boot" : strerror(errno));
        return -1;
    }
    int files = f->n_read_only || f->n_hidden;
    if (files && *abi < 3) {
        snprintf(g_err, g_errlen,
                 "file rules need Landlock ABI 3 (truncate), the kernel has ABI %d", *abi);
        return -1;
    }
    if (f->scope && *abi < 6) {
        snprintf(g_err, g_errlen, "scope needs Landlock ABI 6, the kernel has ABI %d", *abi);
        return -1;
    }
    return 0;
}

static int create_ruleset(const struct file_rules *f, int abi)
{
    int files = f->n_read_only || f->n_hidden;
    g_handled = files ? LL_ABI1_ALL | LL_REFER | LL_TRUNCATE | (abi >= 5 ? LL_IOCTL_DEV : 0) : 0;
    struct ll_ruleset_attr attr = {
        .handled_access_fs = g_handled,
        .scoped = (f->scope & SCOPE_SIGNAL ? LL_SCOPE_SIGNAL : 0) |
                  (f->scope & SCOPE_ABSTRACT_UNIX ? LL_SCOPE_ABSTRACT_UNIX : 0),
    };
    /* the kernel takes a shorter struct from older callers; ours is zero past what it knows */
    size_t size = attr.scoped ? sizeof attr : sizeof attr.handled_access_fs;
    g_ruleset = (int)syscall(SYS_landlock_create_ruleset, &attr, size, 0);
    if (g_ruleset < 0) {
        snprintf(g_err, g_errlen, "landlock_create_ruleset: %s", strerror(errno));
        return -1;
    }
    fcntl(g_ruleset, F_SETFD, FD_CLOEXEC);
    return 0;
}

static int build_rules(void)
{
    char path[PATH_MAX] = "/";
    int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) {
        snprintf(g_err, g_errlen, "/: %s", strerror(errno));
        return -1;
    }
    int rc = walk_dir(root, path, 1, rights_at("/", g_handled));
    close(root);
    return rc;
}

/* Build the ruleset for f and start the domain thread that enforces it. 0, or -1 with the
 * reason in err. */
int landlock_prepare(const struct file_rules *f, char *err, size_t errlen)
{
    g_err = err, g_errlen = errlen;
    int abi;
    if (check_abi(f, &abi) < 0 || create_ruleset(f, abi) < 0)
        return -1;
    if (add_protected(f->read_only, f->n_read_only, LL_READ_SET) < 0 ||
        add_protected(f->hidden, f->n_hidden, 0) < 0)
        return -1;
    /* before the walk: the session directory must exist to get its rule (sessions.c) */
    if (g_handled && session_dir_prepare() < 0)
        logmsg("no session directory outside the protected paths: sessions will fail");
    if (g_handled && build_rules() < 0)
        return -1;
    int rc = domain_start(g_ruleset, err, errlen);
    close(g_ruleset);
    g_ruleset = -1;
    return rc;
}
