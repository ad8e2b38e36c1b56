/*
 * drive.c: `dsec-agent drive [SOCKET]`, the bridge a loop in an agent sandbox uses to drive its
 * workers through the node (SandboxSpec.drives), for shells that cannot open a unix socket.
 *
 * It connects to SOCKET (default DRIVE_SOCKET, which the node passes into sandboxes that drive
 * others) and copies stdin to the socket and the socket to stdout, until the node closes: write
 * one JSON request per line, read one JSON answer per line (dsec_core/node/drive.py has the
 * protocol). stdin's end half-closes the socket, so `echo '{...}' | dsec-agent drive` prints the
 * answer and exits 0; it exits 1 if the socket cannot be reached or an I/O error cuts it short.
 * Not a part of the serving agent: main() hands over before anything of the agent starts.
 */
#include "agent.h"
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define DRIVE_SOCKET "/.dsec/drive/drive.sock"

static int copy_some(int from, int to)
{
    char buf[65536];
    ssize_t n = read(from, buf, sizeof buf);
    if (n < 0)
        return errno == EINTR ? 1 : -1;
    for (ssize_t off = 0; off < n;) {
        ssize_t w = write(to, buf + off, (size_t)(n - off));
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        off += w;
    }
    return n > 0;
}

int drive_bridge(const char *path)
{
    if (!path)
        path = DRIVE_SOCKET;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        fprintf(stderr, "dsec-agent drive: socket path too long: %s\n", path);
        return 1;
    }
    strcpy(addr.sun_path, path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0 || connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        fprintf(stderr, "dsec-agent drive: cannot reach %s: %s\n", path, strerror(errno));
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    struct pollfd p[2] = {{.fd = 0, .events = POLLIN}, {.fd = s, .events = POLLIN}};
    for (;;) {
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        if (p[1].revents) {
            int r = copy_some(s, 1);
            if (r < 0)
                return 1;
            if (r == 0)
                return 0; /* the node closed: every answer is out */
        }
        if (p[0].fd >= 0 && p[0].revents) {
            int r = copy_some(0, s);
            if (r < 0)
                return 1;
            if (r == 0) {
                shutdown(s, SHUT_WR);
                p[0].fd = -1;
            }
        }
    }
}
