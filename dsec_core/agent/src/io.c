/*
 * Descriptors and time: whole reads and writes, non-blocking mode, poll timeouts from deadlines
 * on the monotonic clock, and the agent's log lines on stderr.
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

void logmsg(const char *fmt, ...)
{
    char line[512];
    int n = snprintf(line, sizeof line, "dsec-agent[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2)
        n = sizeof line - 2;
    line[n++] = '\n';
    if (write(2, line, n) < 0) { /* nowhere left to complain */ }
}

long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

long long now_ms(void) { return now_us() / 1000; }

int poll_wait(long long deadline_ms)
{
    if (deadline_ms < 0)
        return -1;
    long long left = deadline_ms - now_ms();
    if (left < 0)
        return 0;
    return left > INT_MAX ? INT_MAX : (int)left;
}

void set_nonblock(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK);
}

/* Write everything; works on blocking and non-blocking fds (waits up to 10 s per stall). */
int writev_all(int fd, struct iovec *iov, int cnt)
{
    while (cnt > 0) {
        if (iov->iov_len == 0) {
            iov++;
            cnt--;
            continue;
        }
        ssize_t n = writev(fd, iov, cnt);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN) {
                struct pollfd p = {.fd = fd, .events = POLLOUT};
                if (poll(&p, 1, 10000) <= 0)
                    return -1;
                continue;
            }
            return -1;
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= n;
        }
    }
    return 0;
}

int write_all(int fd, const void *p, size_t n)
{
    struct iovec iov = {(void *)p, n};
    return writev_all(fd, &iov, 1);
}

int read_exact(int fd, void *p, size_t n)
{
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= r;
    }
    return 0;
}
