/*
 * dsec-runc-launch: run runc in a mount namespace of its own that holds one sandbox's root
 * filesystem and none of the node's other sandboxes' mounts.
 *
 *     dsec-runc-launch [--log FILE] [--ns-fd N] [--exec-fd M] [--mask FILE]... --keep ROOTFS
 *                      [--hide DIR]... -- RUNC ARGS...
 *     dsec-runc-launch --hold [--mask FILE]... [--hide DIR]...
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
 * Copying the node's namespace still costs O(mounts) of kernel time (~5 ms at 2,000). So the
 * node makes one namespace to copy from instead (--hold: unshare, make private, detach every
 * DIR, which the node lists as every mount runc needs nothing under; say "ready" on stdout
 * and wait for stdin to close while the node opens /proc/PID/ns/mnt) and hands it to each
 * start as --ns-fd N: the ROOTFS mount is cloned in the node's namespace first, then the
 * launcher enters N and unshares a copy of that small namespace.
 *
 * --exec-fd M: run the program open at M (execveat, AT_EMPTY_PATH), not RUNC's path; RUNC is
 * then only its argv[0]. The node hands a sealed memfd copy of runc here (launch.py,
 * SealedBinary): runc's init finds /proc/self/exe already a sealed memfd and skips the copy
 * of its own 9 MB binary and the second exec it makes on every start (CVE-2019-5736's guard).
 *
 * --mask FILE: bind /dev/null over FILE in the new namespace (not when entering N, whose
 * namespace was masked by its --hold). crun refuses this host's hybrid cgroups while the
 * cgroup v2 hierarchy lists a controller (hugetlb is bound there, unused), reading
 * /sys/fs/cgroup/unified/cgroup.controllers; the node masks that file for crun alone.
 *
 * A DIR that is not a mount point (or no longer exists) is left alone (a node that could not bind it still works,
 * only slower). Any other failure exits 125 before runc runs, with the reason on stderr and
 * appended to FILE (runc's log, where the node reads why a start failed).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
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
#ifndef SYS_execveat
#define SYS_execveat 322
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x4
#endif

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
    const char **hide = calloc((size_t)argc, sizeof *hide);
    const char **mask = calloc((size_t)argc, sizeof *mask);
    int nmask = 0, nhide = 0, i = 1, hold = 0, ns_fd = -1, exec_fd = -1;
    if (hide == NULL || mask == NULL)
        return fail("allocating", "arguments");
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        }
        if (strcmp(argv[i], "--hold") == 0) {
            hold = 1;
            continue;
        }
        if (i + 1 >= argc)
            break;
        if (strcmp(argv[i], "--ns-fd") == 0) {
            ns_fd = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--exec-fd") == 0) {
            exec_fd = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--log") == 0) {
            log_path = argv[++i];
        } else if (strcmp(argv[i], "--keep") == 0) {
            keep = argv[++i];
        } else if (strcmp(argv[i], "--hide") == 0) {
            hide[nhide++] = argv[++i];
        } else if (strcmp(argv[i], "--mask") == 0) {
            mask[nmask++] = argv[++i];
        } else {
            fprintf(stderr, "dsec-runc-launch: bad argument %s\n", argv[i]);
            return 125;
        }
    }
    if (!hold && (keep == NULL || i >= argc)) {
        fprintf(stderr, "usage: dsec-runc-launch [--log FILE] [--ns-fd N] [--exec-fd M] [--mask FILE]... "
                        "--keep ROOTFS [--hide DIR]... -- ARGV...\n"
                        "       dsec-runc-launch --hold [--mask FILE]... [--hide DIR]...\n");
        return 125;
    }
    int tree = -1;
    if (!hold) {
        /* in the node's namespace, where the sandbox's root filesystem is */
        tree = (int)syscall(SYS_open_tree, AT_FDCWD, keep, OPEN_TREE_CLONE | O_CLOEXEC);
        if (tree < 0)
            return fail("cloning", keep);
    }
    if (ns_fd >= 0) {
        if (setns(ns_fd, CLONE_NEWNS) != 0)
            return fail("entering", "the launch namespace");
        close(ns_fd);
    }
    if (unshare(CLONE_NEWNS) != 0)
        return fail("unshare", "(mount namespace)");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        return fail("making private", "/");
    for (int h = 0; h < nhide; h++) {
        if (umount2(hide[h], MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT)
            return fail("detaching", hide[h]);
    }
    for (int m = 0; ns_fd < 0 && m < nmask; m++) {
        if (mount("/dev/null", mask[m], NULL, MS_BIND, NULL) != 0 && errno != ENOENT)
            return fail("masking", mask[m]);
    }
    if (hold) {
        char c;
        if (write(1, "ready\n", 6) != 6)
            return fail("answering", "ready");
        while (read(0, &c, 1) > 0) {
        }
        return 0;
    }
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, keep, MOVE_MOUNT_F_EMPTY_PATH) != 0)
        return fail("attaching", keep);
    close(tree);
    if (exec_fd >= 0) {
        /* closed by the exec (an ELF program needs no path to itself): runc never sees it */
        if (fcntl(exec_fd, F_SETFD, FD_CLOEXEC) != 0)
            return fail("marking close-on-exec", "the program's descriptor");
        syscall(SYS_execveat, exec_fd, "", &argv[i], environ, AT_EMPTY_PATH);
        return fail("executing (from its descriptor)", argv[i]);
    }
    execv(argv[i], &argv[i]);
    return fail("executing", argv[i]);
}
