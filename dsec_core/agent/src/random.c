/*
 * op wake: what a VM started from a saved state (a fast start, a fork) needs before anything
 * runs in it. It wakes with the CRNG state of every other VM started from that state, and would
 * hand out the same "random" numbers until the kernel reseeds on its own: the node's fresh bytes
 * (seed) are mixed into the pool and the CRNG reseeded at once. It also wakes with the hostname
 * the state was saved under: hostname, if given, replaces it; and with the clock of the instant
 * the state was saved: time (nanoseconds since the epoch, the host's now), if given, sets it.
 * Needs CAP_SYS_ADMIN over the kernel (a VM guest's root has it; a container's does not).
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <string.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_SEED 256

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

void op_wake(int conn, struct req *r)
{
    const char *hex = req_get(r, "seed");
    size_t n = hex ? strlen(hex) : 0;
    if (!n || n % 2 || n / 2 > MAX_SEED) {
        send_error(conn, "bad_request", NULL, 0, "wake needs a seed of 1-%d bytes in hex",
                   MAX_SEED);
        return;
    }
    union {
        struct rand_pool_info info;
        unsigned char raw[sizeof(struct rand_pool_info) + MAX_SEED];
    } u;
    unsigned char *seed = u.raw + sizeof(struct rand_pool_info);
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            send_error(conn, "bad_request", NULL, 0, "wake: the seed is not lowercase hex");
            return;
        }
        seed[i] = (unsigned char)(hi << 4 | lo);
    }
    u.info.entropy_count = (int)(n / 2 * 8);
    u.info.buf_size = (int)(n / 2);
    int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || ioctl(fd, RNDADDENTROPY, &u.info) < 0 || ioctl(fd, RNDRESEEDCRNG) < 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        send_error(conn, "internal", NULL, e, "wake: reseeding: %s", strerror(e));
        return;
    }
    close(fd);
    const char *now = req_get(r, "time");
    if (now) {
        char *end = NULL;
        errno = 0;
        unsigned long long ns = strtoull(now, &end, 10);
        if (errno || end == now || *end) {
            send_error(conn, "bad_request", NULL, 0, "wake: time is not nanoseconds");
            return;
        }
        struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ULL),
                              .tv_nsec = (long)(ns % 1000000000ULL)};
        if (clock_settime(CLOCK_REALTIME, &ts) < 0) {
            send_error(conn, "internal", NULL, errno, "wake: clock_settime: %s",
                       strerror(errno));
            return;
        }
    }
    const char *host = req_get(r, "hostname");
    if (host && sethostname(host, strlen(host)) < 0) {
        send_error(conn, "internal", NULL, errno, "wake: sethostname: %s", strerror(errno));
        return;
    }
    send_ok(conn);
}
