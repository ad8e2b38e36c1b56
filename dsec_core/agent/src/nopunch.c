/*
 * dsec-agent no-punch -- PROGRAM ARGS...: run PROGRAM (a VM's QEMU) with hole punching turned
 * into a no-op: fallocate(2) with FALLOC_FL_PUNCH_HOLE returns 0 without doing anything, every
 * other system call is untouched (a seccomp filter, installed before the exec and kept by it).
 *
 * Why: a VM started from a saved state maps that state's RAM file privately, and so do its
 * siblings (vm/migstream.py). When its guest gives memory back (virtio-balloon: inflation or
 * free page reporting), QEMU 7.2 discards the range by punching a hole in the RAM block's file,
 * shared or not (fixed in QEMU 8.1), and then madvise(MADV_DONTNEED)s it: the hole would zero
 * those pages for every sibling and for the saved state itself. With the punch a no-op, the
 * madvise still drops this QEMU's private copies (the host gets the memory back) and the file
 * stays as it was: a page given back reads the saved content again, which a guest that freed it
 * does not look at. QEMU's disks are attached with discard ignored (qemu.py), so a disk never
 * asks for a punch.
 */
#include "agent.h"

#include <errno.h>
#include <linux/audit.h>
#include <linux/falloc.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

int nopunch_main(int argc, char **argv)
{
    if (argc < 4 || strcmp(argv[2], "--")) {
        fprintf(stderr, "usage: dsec-agent no-punch -- PROGRAM [ARGS...]\n");
        return 2;
    }
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_fallocate, 0, 3),
        /* mode, the second argument (its low 32 bits) */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1])),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, FALLOC_FL_PUNCH_HOLE, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | 0), /* "done", not done */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof code / sizeof code[0], .filter = code};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 ||
        syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0) {
        fprintf(stderr, "dsec-agent no-punch: seccomp: %s\n", strerror(errno));
        return 1;
    }
    execv(argv[3], argv + 3);
    fprintf(stderr, "dsec-agent no-punch: exec %s: %s\n", argv[3], strerror(errno));
    return 127;
}
