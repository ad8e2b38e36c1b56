/*
 * op ifup: a VM guest's network card given the address the node's policy allotted its sandbox
 * (dsec_core/vm/guestnet.py): IPv6 off, loopback up, the card's IPv4 address and netmask set
 * (replacing the one it had: a fork wakes with its parent's), the card up, a route to the
 * gateway on the card and the default route through it. All by ioctl, in the agent: running
 * busybox `ip` for each step took a TCG guest a quarter of a second.
 * Fields: dev (default eth0), address, prefix (1-32), gateway (optional).
 */
#include "agent.h"
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

static void write_sysctl(const char *path)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd >= 0) { /* a kernel without IPv6 has no such file */
        if (write(fd, "1", 1) < 0) {
            /* nothing to do: IPv6 stays as it was */
        }
        close(fd);
    }
}

static int set_up(int s, const char *dev)
{
    struct ifreq ifr = {0};
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", dev);
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        return -1;
    ifr.ifr_flags |= IFF_UP;
    return ioctl(s, SIOCSIFFLAGS, &ifr);
}

static int set_addr(int s, const char *dev, unsigned long req, struct in_addr a)
{
    struct ifreq ifr = {0};
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", dev);
    struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
    sin->sin_family = AF_INET;
    sin->sin_addr = a;
    return ioctl(s, req, &ifr);
}

static int add_route(int s, const char *dev, struct in_addr dst, struct in_addr mask,
                     struct in_addr *gw)
{
    struct rtentry rt = {0};
    char name[IFNAMSIZ];
    snprintf(name, sizeof name, "%s", dev);
    ((struct sockaddr_in *)&rt.rt_dst)->sin_family = AF_INET;
    ((struct sockaddr_in *)&rt.rt_dst)->sin_addr = dst;
    ((struct sockaddr_in *)&rt.rt_genmask)->sin_family = AF_INET;
    ((struct sockaddr_in *)&rt.rt_genmask)->sin_addr = mask;
    ((struct sockaddr_in *)&rt.rt_gateway)->sin_family = AF_INET;
    rt.rt_flags = RTF_UP;
    if (gw) {
        ((struct sockaddr_in *)&rt.rt_gateway)->sin_addr = *gw;
        rt.rt_flags |= RTF_GATEWAY;
    } else {
        rt.rt_flags |= RTF_HOST;
    }
    rt.rt_dev = name;
    if (ioctl(s, SIOCADDRT, &rt) < 0 && errno != EEXIST) /* a fork's routes are its parent's */
        return -1;
    return 0;
}

void op_ifup(int conn, struct req *r)
{
    const char *dev = req_get(r, "dev");
    const char *address = req_get(r, "address");
    const char *gateway = req_get(r, "gateway");
    int bad = 0;
    long long prefix = req_num(r, "prefix", 32, &bad);
    struct in_addr addr, gw, mask, any = {0}, host = {.s_addr = 0xffffffff};
    if (!dev)
        dev = "eth0";
    if (bad || prefix < 1 || prefix > 32 || !address || inet_pton(AF_INET, address, &addr) != 1 ||
        (gateway && inet_pton(AF_INET, gateway, &gw) != 1) || strlen(dev) >= IFNAMSIZ ||
        strchr(dev, '/') || dev[0] == '.') {
        send_error(conn, "bad_request", NULL, 0,
                   "ifup needs an IPv4 address, a prefix of 1-32, a device name and an "
                   "IPv4 gateway if any");
        return;
    }
    mask.s_addr = htonl(prefix == 32 ? 0xffffffffu : ~(0xffffffffu >> prefix));
    char path[96];
    write_sysctl("/proc/sys/net/ipv6/conf/all/disable_ipv6");
    snprintf(path, sizeof path, "/proc/sys/net/ipv6/conf/%s/disable_ipv6", dev);
    write_sysctl(path);
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    const char *step = "socket";
    if (s < 0)
        goto fail;
    step = "bringing up lo";
    if (set_up(s, "lo") < 0)
        goto fail;
    step = "setting the address";
    if (set_addr(s, dev, SIOCSIFADDR, addr) < 0)
        goto fail;
    step = "setting the netmask";
    if (set_addr(s, dev, SIOCSIFNETMASK, mask) < 0)
        goto fail;
    step = "bringing up the card";
    if (set_up(s, dev) < 0)
        goto fail;
    if (gateway) {
        step = "adding the route to the gateway";
        if (add_route(s, dev, gw, host, NULL) < 0)
            goto fail;
        step = "adding the default route";
        if (add_route(s, dev, any, any, &gw) < 0)
            goto fail;
    }
    close(s);
    struct buf h = {0};
    resp_begin(&h);
    resp_str(&h, "ok", "1");
    resp_send(conn, &h, NULL, 0, NULL, 0);
    return;
fail:;
    int e = errno;
    if (s >= 0)
        close(s);
    send_error(conn, "internal", NULL, e, "ifup %s: %s: %s", dev, step,
               strerror(e));
}
