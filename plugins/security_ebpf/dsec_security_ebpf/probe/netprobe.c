// netprobe: what a program in a sandbox tries in order to get data out, one attempt per run.
// Built static by the egress policy's test helpers and copied into sandboxes, since a test
// image (busybox) has no tool that reports exactly which call failed and why.
//
//   netprobe tcp ADDR PORT DATA      connect(), then send DATA
//   netprobe tfo ADDR PORT DATA      TCP fast open: sendto(MSG_FASTOPEN), no connect()
//   netprobe udp ADDR PORT DATA      sendto() on an unconnected socket
//   netprobe udpc ADDR PORT DATA     connect(), then send()
//   netprobe mapped ADDR PORT DATA   TCP over an IPv6 socket to ::ffff:ADDR
//   netprobe dns ADDR PORT NAME      a DNS query for NAME (data hidden in the name)
//   netprobe raw ADDR PORT DATA      a raw socket writing its own IP and UDP headers
//   netprobe icmp ADDR               an ICMP echo through a "ping" socket
//   netprobe packet                  an AF_PACKET socket
//   netprobe userns-raw ADDR PORT DATA   unshare a user namespace, then as raw
//   netprobe unix PATH DATA          connect() to a unix socket
//   netprobe loopconnect N           N TCP connects to a listener of its own on 127.0.0.1;
//                                    prints the mean time of one, in nanoseconds (benchmarks)
// It prints "ok" or "<step>: <errno name>" and exits 0 only if the data went out.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/udp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int fail(const char *step)
{
    printf("%s: %s\n", step, strerrorname_np(errno) ? strerrorname_np(errno) : "?");
    return 1;
}

static struct sockaddr_in v4(const char *addr, const char *port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(port))};
    inet_pton(AF_INET, addr, &sa.sin_addr);
    return sa;
}

static int tcp(char **a, int fastopen)
{
    struct sockaddr_in sa = v4(a[0], a[1]);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct timeval tv = {.tv_sec = 3};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (fastopen) {
        if (sendto(fd, a[2], strlen(a[2]), MSG_FASTOPEN, (void *)&sa, sizeof(sa)) < 0)
            return fail("sendto");
    } else {
        if (connect(fd, (void *)&sa, sizeof(sa)) < 0)
            return fail("connect");
        if (send(fd, a[2], strlen(a[2]), 0) < 0)
            return fail("send");
    }
    shutdown(fd, SHUT_WR);
    char buf[64];
    read(fd, buf, sizeof(buf));  // let the server take it before we go
    puts("ok");
    return 0;
}

static int mapped(char **a)
{
    struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_port = htons(atoi(a[1]))};
    char text[64];
    snprintf(text, sizeof(text), "::ffff:%s", a[0]);
    inet_pton(AF_INET6, text, &sa.sin6_addr);
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd < 0)
        return fail("socket");
    if (connect(fd, (void *)&sa, sizeof(sa)) < 0)
        return fail("connect");
    if (send(fd, a[2], strlen(a[2]), 0) < 0)
        return fail("send");
    shutdown(fd, SHUT_WR);
    char buf[64];
    read(fd, buf, sizeof(buf));
    puts("ok");
    return 0;
}

static int udp(char **a, int connected)
{
    struct sockaddr_in sa = v4(a[0], a[1]);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (connected) {
        if (connect(fd, (void *)&sa, sizeof(sa)) < 0)
            return fail("connect");
        if (send(fd, a[2], strlen(a[2]), 0) < 0)
            return fail("send");
    } else if (sendto(fd, a[2], strlen(a[2]), 0, (void *)&sa, sizeof(sa)) < 0) {
        return fail("sendto");
    }
    puts("ok");
    return 0;
}

static int dns(char **a)
{
    unsigned char q[512] = {0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0};
    size_t n = 12;
    char name[256];
    snprintf(name, sizeof(name), "%s", a[2]);
    for (char *label = strtok(name, "."); label && n < 400; label = strtok(NULL, ".")) {
        q[n++] = strlen(label);
        memcpy(q + n, label, strlen(label));
        n += strlen(label);
    }
    q[n++] = 0;
    q[n++] = 0, q[n++] = 1, q[n++] = 0, q[n++] = 1;  // A, IN
    struct sockaddr_in sa = v4(a[0], a[1]);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (sendto(fd, q, n, 0, (void *)&sa, sizeof(sa)) < 0)
        return fail("sendto");
    puts("ok");
    return 0;
}

static int raw(char **a)
{
    int fd = socket(AF_INET, SOCK_RAW, IPPROTO_RAW);
    if (fd < 0)
        return fail("socket");
    struct sockaddr_in sa = v4(a[0], a[1]);
    unsigned char pkt[256] = {0};
    size_t len = strlen(a[2]);
    struct iphdr *ip = (void *)pkt;
    struct udphdr *udp = (void *)(pkt + sizeof(*ip));
    ip->version = 4, ip->ihl = 5, ip->ttl = 64, ip->protocol = IPPROTO_UDP;
    ip->tot_len = htons(sizeof(*ip) + sizeof(*udp) + len);
    ip->daddr = sa.sin_addr.s_addr;
    udp->dest = sa.sin_port, udp->source = htons(40000);
    udp->len = htons(sizeof(*udp) + len);
    memcpy(pkt + sizeof(*ip) + sizeof(*udp), a[2], len);
    if (sendto(fd, pkt, sizeof(*ip) + sizeof(*udp) + len, 0, (void *)&sa, sizeof(sa)) < 0)
        return fail("sendto");
    puts("ok");
    return 0;
}

static int icmp(char **a)
{
    int fd = socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP);
    if (fd < 0)
        return fail("socket");
    unsigned char echo[16] = {8, 0};
    struct sockaddr_in sa = v4(a[0], "0");
    if (sendto(fd, echo, sizeof(echo), 0, (void *)&sa, sizeof(sa)) < 0)
        return fail("sendto");
    puts("ok");
    return 0;
}

static int packet(void)
{
    if (socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)) < 0)
        return fail("socket");
    puts("ok");
    return 0;
}

static int unix_connect(char **a)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", a[0]);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(fd, (void *)&sa, sizeof(sa)) < 0)
        return fail("connect");
    if (send(fd, a[1], strlen(a[1]), 0) < 0)
        return fail("send");
    puts("ok");
    return 0;
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int loopconnect(int n)
{
    struct sockaddr_in sa = v4("127.0.0.1", "0");
    socklen_t len = sizeof(sa);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (bind(l, (void *)&sa, sizeof(sa)) < 0 || listen(l, 16) < 0)
        return fail("listen");
    getsockname(l, (void *)&sa, &len);
    long long start = now_ns();
    for (int i = 0; i < n; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (void *)&sa, sizeof(sa)) < 0)
            return fail("connect");
        int c = accept(l, NULL, NULL);
        close(c);
        close(fd);
    }
    printf("%lld\n", (now_ns() - start) / n);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    const char *what = argv[1];
    char **a = argv + 2;
    int n = argc - 2;
    if (!strcmp(what, "tcp") && n == 3)
        return tcp(a, 0);
    if (!strcmp(what, "tfo") && n == 3)
        return tcp(a, 1);
    if (!strcmp(what, "udp") && n == 3)
        return udp(a, 0);
    if (!strcmp(what, "udpc") && n == 3)
        return udp(a, 1);
    if (!strcmp(what, "mapped") && n == 3)
        return mapped(a);
    if (!strcmp(what, "dns") && n == 3)
        return dns(a);
    if (!strcmp(what, "raw") && n == 3)
        return raw(a);
    if (!strcmp(what, "icmp") && n == 1)
        return icmp(a);
    if (!strcmp(what, "packet") && n == 0)
        return packet();
    if (!strcmp(what, "userns-raw") && n == 3) {
        if (unshare(CLONE_NEWUSER) < 0)
            return fail("unshare");
        return raw(a);
    }
    if (!strcmp(what, "unix") && n == 2)
        return unix_connect(a);
    if (!strcmp(what, "loopconnect") && n == 1)
        return loopconnect(atoi(a[0]));
    fprintf(stderr, "netprobe: bad arguments\n");
    return 2;
}
