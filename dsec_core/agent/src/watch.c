/*
 * watch.c: `dsec-agent watch [-r] DIR`, a directory watcher run as a command in the sandbox
 * (E2B's files.watch_dir goes through it: dsec_core/e2b/watch.py), so it works on any image
 * and stops with the command's stream or the sandbox.
 *
 * It watches DIR (and with -r every directory under it, including those made later) with
 * inotify and prints "ready\n" once the watches are in place, then one line per event:
 * "TYPE NAME\n", TYPE being what envd's fsnotify reports (CREATE for a creation or a move in,
 * WRITE, REMOVE, RENAME for a move out, CHMOD for an attribute change), NAME the path relative
 * to DIR with "\\" written "\\\\" and a newline "\\n". "OVERFLOW\n" says events were lost. It
 * exits 0 when DIR itself goes, 2 if DIR is not a directory (the reason on stderr), 3 if it
 * does not exist, 1 on other errors.
 * Not a part of the serving agent: main() hands over before anything of the agent starts.
 */
#include "agent.h"
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#define WATCH_MASK                                                                              \
    (IN_CREATE | IN_MODIFY | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB |              \
     IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW)
#define MAX_WATCHES 65536

static char *g_rel[MAX_WATCHES]; /* watch descriptor -> directory relative to the root ("") */
static int g_recursive;

static void put_line(const char *type, const char *dir, const char *name)
{
    char line[3 * PATH_MAX];
    size_t n = (size_t)snprintf(line, sizeof line, "%s ", type);
    const char *parts[3] = {dir, *dir && *name ? "/" : "", name};
    for (int i = 0; i < 3; i++)
        for (const char *c = parts[i]; *c && n + 3 < sizeof line; c++) {
            if (*c == '\\' || *c == '\n')
                line[n++] = '\\';
            line[n++] = *c == '\n' ? 'n' : *c;
        }
    line[n++] = '\n';
    for (size_t off = 0; off < n;) {
        ssize_t w = write(1, line + off, n - off);
        if (w < 0 && errno != EINTR)
            _exit(1);
        off += w > 0 ? (size_t)w : 0;
    }
}

static int add_tree(int fd, const char *root, const char *rel)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s%s%s", root, *rel ? "/" : "", rel);
    int wd = inotify_add_watch(fd, path, WATCH_MASK);
    if (wd < 0)
        return -1;
    if (wd < MAX_WATCHES) { /* a directory moved within the tree keeps its wd: a new path */
        free(g_rel[wd]);
        g_rel[wd] = strdup(rel);
    }
    if (!g_recursive)
        return 0;
    DIR *d = opendir(path);
    if (!d)
        return 0; /* gone meanwhile: its events say so */
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_type != DT_DIR || !strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char sub[PATH_MAX];
        snprintf(sub, sizeof sub, "%s%s%s", rel, *rel ? "/" : "", e->d_name);
        add_tree(fd, root, sub);
    }
    closedir(d);
    return 0;
}

static const char *event_type(uint32_t mask)
{
    if (mask & (IN_CREATE | IN_MOVED_TO))
        return "CREATE";
    if (mask & IN_MODIFY)
        return "WRITE";
    if (mask & IN_DELETE)
        return "REMOVE";
    if (mask & IN_MOVED_FROM)
        return "RENAME";
    if (mask & IN_ATTRIB)
        return "CHMOD";
    return NULL;
}

/* one event; 1 when the root itself is gone */
static int handle(int fd, const char *root, const struct inotify_event *ev)
{
    if (ev->mask & IN_Q_OVERFLOW) {
        put_line("OVERFLOW", "", "");
        return 0;
    }
    const char *dir = ev->wd >= 0 && ev->wd < MAX_WATCHES ? g_rel[ev->wd] : NULL;
    if (!dir)
        return 0;
    if (ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED))
        return !*dir; /* the root's own end ends the watch; a subdirectory's, nothing */
    /* a new directory is watched before its CREATE is told: whoever sees that line may
     * act in it and be sure to hear of it (what came before the watch is lost: inotify) */
    if (g_recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO))) {
        char sub[PATH_MAX];
        snprintf(sub, sizeof sub, "%s%s%s", dir, *dir ? "/" : "", ev->name);
        add_tree(fd, root, sub);
    }
    const char *type = event_type(ev->mask);
    if (type && ev->len)
        put_line(type, dir, ev->name);
    return 0;
}

int watch_main(int argc, char **argv)
{
    int i = 2;
    if (i < argc && !strcmp(argv[i], "-r")) {
        g_recursive = 1;
        i++;
    }
    if (i + 1 != argc) {
        fprintf(stderr, "usage: dsec-agent watch [-r] DIR\n");
        return 1;
    }
    const char *root = argv[i];
    struct stat st;
    if (stat(root, &st) < 0) {
        fprintf(stderr, "%s: %s\n", root, strerror(errno));
        return errno == ENOENT ? 3 : 1;
    }
    if (!S_ISDIR(st.st_mode)) {
        fprintf(stderr, "%s: not a directory\n", root);
        return 2;
    }
    int fd = inotify_init1(IN_CLOEXEC);
    if (fd < 0 || add_tree(fd, root, "") < 0) {
        fprintf(stderr, "%s: inotify: %s\n", root, strerror(errno));
        return 1;
    }
    put_line("ready", "", "");
    char buf[64 * 1024] __attribute__((aligned(__alignof__(struct inotify_event))));
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return 1;
        for (char *p = buf; p < buf + n;) {
            const struct inotify_event *ev = (const struct inotify_event *)p;
            if (handle(fd, root, ev))
                return 0;
            p += sizeof *ev + ev->len;
        }
    }
}
