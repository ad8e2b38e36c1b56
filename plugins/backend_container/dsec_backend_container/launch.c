/*
 * dsec-runc-launch: run runc in a mount namespace of its own that holds one sandbox's root
 * filesystem and none of the node's other sandboxes' mounts.
 *
 *     dsec-runc-launch [--log FILE] --keep ROOTFS [--hide DIR]... -- RUNC ARGS...
 *
 * Why: runc reads /proc/self/mountinfo several times per start (the rootfs' parent mount,
 * the cgroup v1 mounts), the kernel formats every line of it each time, and the container's
 * namespace starts as a copy of runc's. In the node's namespace every live sandbox adds two
 * mounts (its writable disk and its overlay), so a create at 2,000 live sandboxes read and
 * copied 4,000 mounts it never uses, and took four times as long as at 10.
 *
 * What: unshare(CLONE_NEWNS); make every mount private (nothing done here reaches the node's
 * namespace, or any other); clone the ROOTFS mount (open_tree, detached); detach each DIR
 * (the node bind-mounts its sandboxes' directories onto themselves, so each is one mount
 * whose children are all the sandboxes' mounts: one umount2 drops them all); attach the
 * clone at ROOTFS again; exec runc. The files under each DIR stay visible (the bind's root
 * is the directory itself). The namespace goes when runc's last process leaves it; the
 * container's own namespace, copied from it, holds only what it needs.
 *
 * A DIR that is not a mount point is left alone (a node that could not bind it still works,
 * only slower). Any other failure exits 125 before runc runs, with the reason on stderr and
 * appended to FILE (runc's log, where the node reads why a start failed).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x4
#endif

#define MAX_HIDE 16

static const char *log_path;

static int fail(const char *what, const char *path)
{
    char msg[4096];
    int n = snprintf(msg, sizeof msg, "dsec-runc-launch: %s %s: %s\n", what, path,
                     strerror(errno));
    if (n > (int)sizeof msg - 1)
        n = (int)sizeof msg - 1;
    if (write(2, msg, (size_t)n) < 0) {
        /* nowhere else to say it */
    }
    int fd = log_path ? open(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600) : -1;
    if (fd >= 0) {
        if (write(fd, msg, (size_t)n) < 0) {
            /* the exit code still says it failed */
        }
        close(fd);
    }
    return 125;
}

int main(int argc, char **argv)
{
    const char *keep = NULL;
    const char *hide[MAX_HIDE];
    int nhide = 0, i = 1;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        }
        if (i + 1 >= argc)
            break;
        if (strcmp(argv[i], "--log") == 0) {
            log_path = argv[++i];
        } else if (strcmp(argv[i], "--keep") == 0) {
            keep = argv[++i];
        } else if (strcmp(argv[i], "--hide") == 0 && nhide < MAX_HIDE) {
            hide[nhide++] = argv[++i];
        } else {
            fprintf(stderr, "dsec-runc-launch: bad argument %s\n", argv[i]);
            return 125;
        }
    }
    if (keep == NULL || i >= argc) {
        fprintf(stderr, "usage: dsec-runc-launch [--log FILE] --keep ROOTFS [--hide DIR]... -- ARGV...\n");
        return 125;
    }
    if (unshare(CLONE_NEWNS) != 0)
        return fail("unshare", "(mount namespace)");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        return fail("making private", "/");
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, keep, OPEN_TREE_CLONE | O_CLOEXEC);
    if (tree < 0)
        return fail("cloning", keep);
    for (int h = 0; h < nhide; h++) {
        if (umount2(hide[h], MNT_DETACH) != 0 && errno != EINVAL)
            return fail("detaching", hide[h]);
    }
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, keep, MOVE_MOUNT_F_EMPTY_PATH) != 0)
        return fail("attaching", keep);
    close(tree);
    execv(argv[i], &argv[i]);
    return fail("executing", argv[i]);
}
