/* Kernel keys from inside a sandbox, for tests/test_uid_ranges.py.
 *
 *   keys session NAME   join a new session keyring NAME; prints its serial
 *   keys fill           add "user" keys to the session keyring until the kernel refuses;
 *                       prints "<count> <errno name>"
 *   keys add            add one key; prints "ok" or the errno name
 *
 * Raw syscalls: no libkeyutils in a busybox sandbox. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KEYCTL_JOIN_SESSION_KEYRING 1
#define KEY_SPEC_SESSION_KEYRING -3

static const char *errname(int e)
{
    switch (e) {
    case EDQUOT: return "EDQUOT";
    case EPERM: return "EPERM";
    case ENOMEM: return "ENOMEM";
    case ENOSYS: return "ENOSYS";
    default: return strerror(e);
    }
}

static long add_one(int i)
{
    char desc[32];
    snprintf(desc, sizeof desc, "k%d", i);
    return syscall(SYS_add_key, "user", desc, "x", 1, KEY_SPEC_SESSION_KEYRING);
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "session")) {
        long id = syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, argv[2]);
        if (id < 0) {
            printf("%s\n", errname(errno));
            return 1;
        }
        printf("%ld\n", id);
        return 0;
    }
    if (argc == 2 && !strcmp(argv[1], "fill")) {
        int n = 0;
        while (n < 100000 && add_one(n) >= 0)
            n++;
        printf("%d %s\n", n, errname(errno));
        return 0;
    }
    if (argc == 2 && !strcmp(argv[1], "add")) {
        long id = add_one(1000000);
        printf("%s\n", id < 0 ? errname(errno) : "ok");
        return id < 0;
    }
    fprintf(stderr, "usage: keys session NAME | fill | add\n");
    return 2;
}
