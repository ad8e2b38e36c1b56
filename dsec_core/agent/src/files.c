/*
 * File operations: read, write, list, stat and remove, plus the directory helpers sessions use.
 * They run in a handler child, never in main, because a path can be anything (a FIFO, a hung
 * network mount) and a blocked open or read must not freeze the agent.
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
#include <unistd.h>

int mkdir_p(const char *path, mode_t mode)
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
int rm_tree(int dfd, const char *name)
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

/* ---------------------------------------------------------------- operations */

/* One "entry" field in the format of the wire table (see wire.c). */
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

void op_read(int conn, struct req *r)
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

void op_write(int conn, struct req *r)
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

void op_list(int conn, struct req *r)
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

void op_stat(int conn, struct req *r)
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

void op_remove(int conn, struct req *r)
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
