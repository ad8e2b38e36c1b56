/*
 * The agent channel of a VM: many unix stream connections carried over one byte stream (a
 * virtio-serial port), for guests the host cannot hand a listening socket (no vsock here).
 *
 * Two ends run the same engine. On the host, `dsec-agent forward --listen-fd N --serial-fd M`
 * accepts the node's connections on the listening socket at fd N (the sandbox's agent socket)
 * and carries each as a stream over fd M (one end of a socketpair whose other end QEMU holds as
 * the port's chardev). In the guest, the agent started with `--serial PATH` (the port's device)
 * turns each stream the host opens into a connection of its own accept loop: a socketpair whose
 * one end goes to the loop as if accepted, the other end pumped here. Both half-closes travel,
 * so a request body ended by shutdown(SHUT_WR) ends in the guest as well.
 *
 * Frames, both ways: u32le stream id, u8 type, u32le length, then that many bytes (at most
 * MUX_MAX_DATA). Types:
 *   OPEN   host -> guest: a new stream (ids only ever grow, so none is reused)
 *   DATA   bytes of the stream
 *   EOF    the sender's side will send no more (its socket read end hit EOF)
 *   CLOSE  the stream is gone (an error, or both sides done): drop it
 *   ACK    u32le n: the receiver wrote n more bytes of the stream into its socket
 *   RESET  (stream 0) host -> guest: a new host end connected; forget every stream
 * Flow control is per stream and per direction: a sender keeps at most MUX_WINDOW bytes
 * unacknowledged, so one stalled connection cannot make the other end buffer without bound
 * or stall the rest (the port is read whenever it has bytes).
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MUX_HDR 9
#define MUX_MAX_DATA (64 * 1024)
#define MUX_WINDOW (256 * 1024)
#define MUX_ACK_EVERY (32 * 1024)
#define MUX_OUT_CAP (1024 * 1024) /* stop reading sockets while the port has this much queued */

enum { F_OPEN = 1, F_DATA, F_EOF, F_CLOSE, F_ACK, F_RESET };

struct mstream {
    uint32_t id;
    int fd;
    int rd_eof;      /* our socket's read side ended and EOF was sent */
    int peer_eof;    /* the other end sent EOF: shut our socket's write side once out drains */
    int shut;        /* done that */
    uint32_t credit; /* bytes we may still send */
    uint32_t unacked;/* bytes written into our socket not yet acknowledged */
    struct buf out;  /* bytes for our socket */
    size_t out_off;
};

static int g_role_host;
static int g_serial = -1;
static int g_serial_down; /* guest: the host end is not connected; look again later */
static struct mstream *g_ms;
static int g_nms, g_capms;
static uint32_t g_next_id = 1;
static struct buf g_sout; /* frames for the port */
static size_t g_sout_off;
static struct buf g_sin;  /* bytes from the port not yet parsed */
static void (*g_deliver)(int fd);

static void put_u32(unsigned char *p, uint32_t v)
{
    p[0] = v;
    p[1] = v >> 8;
    p[2] = v >> 16;
    p[3] = v >> 24;
}

static void frame(uint32_t id, int type, const void *data, uint32_t n)
{
    unsigned char h[MUX_HDR];
    put_u32(h, id);
    h[4] = (unsigned char)type;
    put_u32(h + 5, n);
    buf_add(&g_sout, h, sizeof h);
    if (n)
        buf_add(&g_sout, data, n);
}

static struct mstream *find(uint32_t id)
{
    for (int i = 0; i < g_nms; i++)
        if (g_ms[i].id == id)
            return &g_ms[i];
    return NULL;
}

static struct mstream *add(uint32_t id, int fd)
{
    if (g_nms == g_capms) {
        g_capms = g_capms ? 2 * g_capms : 16;
        g_ms = xrealloc(g_ms, g_capms * sizeof *g_ms);
    }
    struct mstream *s = &g_ms[g_nms++];
    *s = (struct mstream){.id = id, .fd = fd, .credit = MUX_WINDOW};
    set_nonblock(fd, 1);
    return s;
}

static void drop(struct mstream *s)
{
    shutdown(s->fd, SHUT_RDWR); /* copies of fd elsewhere must not keep the stream open */
    close(s->fd);
    buf_free(&s->out);
    *s = g_ms[--g_nms];
}

static void drop_all(void)
{
    while (g_nms)
        drop(&g_ms[g_nms - 1]);
}

/* A stream both ends finished (or that failed) is dropped; 1 if it was. */
static int settle(struct mstream *s, int failed)
{
    if (failed) {
        frame(s->id, F_CLOSE, NULL, 0);
        drop(s);
        return 1;
    }
    if (s->peer_eof && !s->shut && s->out.len == s->out_off) {
        shutdown(s->fd, SHUT_WR);
        s->shut = 1;
    }
    if (s->rd_eof && s->shut) {
        frame(s->id, F_CLOSE, NULL, 0);
        drop(s);
        return 1;
    }
    return 0;
}

/* Write what stream s holds for its socket; 1 if it was dropped. */
static int flush_stream(struct mstream *s)
{
    while (s->out_off < s->out.len) {
        ssize_t n = write(s->fd, s->out.p + s->out_off, s->out.len - s->out_off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            break;
        if (n <= 0)
            return settle(s, 1);
        s->out_off += n;
        s->unacked += n;
    }
    if (s->out_off == s->out.len) {
        s->out.len = s->out_off = 0;
    }
    if (s->unacked >= MUX_ACK_EVERY || (s->unacked && s->out.len == 0)) {
        unsigned char a[4];
        put_u32(a, s->unacked);
        frame(s->id, F_ACK, a, 4);
        s->unacked = 0;
    }
    return settle(s, 0);
}

/* Read what stream s's socket has, within its credit; 1 if it was dropped. */
static int pump_stream(struct mstream *s)
{
    while (!s->rd_eof && s->credit > 0 && g_sout.len - g_sout_off < MUX_OUT_CAP) {
        uint32_t want = s->credit < MUX_MAX_DATA ? s->credit : MUX_MAX_DATA;
        ssize_t n = read(s->fd, g_scratch, want < sizeof g_scratch ? want : sizeof g_scratch);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            break;
        if (n < 0)
            return settle(s, 1);
        if (n == 0) {
            s->rd_eof = 1;
            frame(s->id, F_EOF, NULL, 0);
            break;
        }
        frame(s->id, F_DATA, g_scratch, (uint32_t)n);
        s->credit -= (uint32_t)n;
    }
    return settle(s, 0);
}

static void on_frame(uint32_t id, int type, const unsigned char *d, uint32_t n)
{
    if (type == F_RESET) {
        drop_all();
        return;
    }
    if (type == F_OPEN) {
        if (g_role_host || find(id))
            return;
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
            logmsg("mux: socketpair: %s", strerror(errno));
            frame(id, F_CLOSE, NULL, 0);
            return;
        }
        add(id, sv[0]);
        set_nonblock(sv[1], 1);
        g_deliver(sv[1]);
        return;
    }
    struct mstream *s = find(id);
    if (!s)
        return; /* dropped here already: what was in flight is moot */
    switch (type) {
    case F_DATA:
        if (s->peer_eof || s->out.len - s->out_off + n > MUX_WINDOW) {
            settle(s, 1); /* over the window: the other end broke the protocol */
            return;
        }
        buf_add(&s->out, d, n);
        flush_stream(s);
        break;
    case F_EOF:
        s->peer_eof = 1;
        settle(s, 0);
        break;
    case F_CLOSE:
        drop(s);
        break;
    case F_ACK:
        if (n == 4) {
            s->credit += get_u32(d);
            pump_stream(s);
        }
        break;
    }
}

/* 0 while the port is open, -1 once it ended. */
static int read_serial(void)
{
    for (;;) {
        buf_reserve(&g_sin, READ_CHUNK);
        ssize_t n = read(g_serial, g_sin.p + g_sin.len, READ_CHUNK);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            break;
        if (n <= 0)
            return -1;
        g_sin.len += n;
    }
    size_t off = 0;
    while (g_sin.len - off >= MUX_HDR) {
        const unsigned char *h = (const unsigned char *)g_sin.p + off;
        uint32_t len = get_u32(h + 5);
        if (len > MUX_WINDOW) {
            logmsg("mux: a frame of %u bytes: the stream is out of step", len);
            return -1;
        }
        if (g_sin.len - off < MUX_HDR + len)
            break;
        on_frame(get_u32(h), h[4], h + MUX_HDR, len);
        off += MUX_HDR + len;
    }
    memmove(g_sin.p, g_sin.p + off, g_sin.len - off);
    g_sin.len -= off;
    return 0;
}

static int write_serial(void)
{
    while (g_sout_off < g_sout.len) {
        ssize_t n = write(g_serial, g_sout.p + g_sout_off, g_sout.len - g_sout_off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return 0;
        if (n <= 0)
            return -1;
        g_sout_off += n;
    }
    g_sout.len = g_sout_off = 0;
    return 0;
}

/* ---------------------------------------------------------------- the engine's interface */

void mux_init(int serial_fd, int host, void (*deliver)(int fd))
{
    g_serial = serial_fd;
    g_role_host = host;
    g_deliver = deliver;
    fcntl(serial_fd, F_SETFD, FD_CLOEXEC);
    set_nonblock(serial_fd, 1);
    if (host)
        frame(0, F_RESET, NULL, 0);
}

int mux_active(void) { return g_serial >= 0; }

/* Host: carry a connection the forwarder accepted as a new stream. */
void mux_open(int fd)
{
    struct mstream *s = add(g_next_id++, fd);
    frame(s->id, F_OPEN, NULL, 0);
}

int mux_npollfds(void) { return g_serial < 0 ? 0 : 1 + g_nms; }

/* Fill p[0..mux_npollfds()) and return how many; *wait_ms is lowered when the port must be
 * looked at again later (a guest whose host end is away). */
int mux_pollfds(struct pollfd *p, int *wait_ms)
{
    if (g_serial < 0)
        return 0;
    short ev = g_sout.len > g_sout_off ? POLLOUT : 0;
    if (g_serial_down) {
        p[0] = (struct pollfd){.fd = -1};
        if (*wait_ms < 0 || *wait_ms > 20)
            *wait_ms = 20;
    } else {
        p[0] = (struct pollfd){.fd = g_serial, .events = POLLIN | ev};
    }
    for (int i = 0; i < g_nms; i++) {
        struct mstream *s = &g_ms[i];
        short e = 0;
        if (!s->rd_eof && s->credit > 0 && g_sout.len - g_sout_off < MUX_OUT_CAP)
            e |= POLLIN;
        if (s->out_off < s->out.len)
            e |= POLLOUT;
        p[1 + i] = (struct pollfd){.fd = s->fd, .events = e};
    }
    return 1 + g_nms;
}

/* Act on what poll reported for the n entries mux_pollfds filled; -1 once the port ended
 * for good (host: QEMU is gone), else 0. */
int mux_handle(const struct pollfd *p, int n)
{
    if (g_serial < 0)
        return 0;
    int serial_gone = 0;
    if (g_serial_down) {
        g_serial_down = 0; /* try again: the host end may be back */
    } else if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
        /* POLLHUP with nothing to read: a guest's port whose host end is not connected */
        if (read_serial() < 0 || !(p[0].revents & POLLIN))
            serial_gone = 1;
    }
    /* streams by fd: frames above may have dropped and reordered g_ms */
    for (int i = 1; i < n; i++) {
        if (!p[i].revents || p[i].fd < 0)
            continue;
        for (int j = 0; j < g_nms; j++)
            if (g_ms[j].fd == p[i].fd) {
                if (!flush_stream(&g_ms[j]))
                    pump_stream(&g_ms[j]);
                break;
            }
    }
    /* streams whose credit came back in an ACK and that poll did not report */
    for (int j = 0; j < g_nms; j++)
        if (!g_ms[j].rd_eof && g_ms[j].credit > 0)
            if (pump_stream(&g_ms[j]))
                j--;
    if (!serial_gone && write_serial() < 0)
        serial_gone = 1;
    if (serial_gone) {
        drop_all();
        g_sin.len = 0;
        g_sout.len = g_sout_off = 0;
        if (g_role_host)
            return -1;
        g_serial_down = 1; /* the host end went away; it may come back (a restored VM) */
    }
    return 0;
}

/* In a forked handler: the port and the streams are main's. */
void mux_close_fds_in_handler(void)
{
    if (g_serial >= 0)
        close(g_serial);
    for (int i = 0; i < g_nms; i++)
        close(g_ms[i].fd);
}

/* ---------------------------------------------------------------- the host's forwarder */

/* dsec-agent forward --listen-fd N --serial-fd M: runs on the host until the port's other end
 * (QEMU) goes away; the backend starts it next to QEMU. */
int forward_main(int argc, char **argv)
{
    int lfd = -1, sfd = -1;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--listen-fd"))
            lfd = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--serial-fd"))
            sfd = atoi(argv[i + 1]);
    }
    if (lfd < 0 || sfd < 0) {
        fprintf(stderr, "usage: dsec-agent forward --listen-fd N --serial-fd M\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    fcntl(lfd, F_SETFD, FD_CLOEXEC);
    set_nonblock(lfd, 1);
    mux_init(sfd, 1, NULL);
    struct pollfd *p = NULL;
    int cap = 0;
    for (;;) {
        if (cap < 1 + mux_npollfds()) {
            cap = 1 + mux_npollfds() + 16;
            p = xrealloc(p, cap * sizeof *p);
        }
        int wait_ms = -1;
        int n = mux_pollfds(p + 1, &wait_ms);
        p[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
        if (poll(p, 1 + n, wait_ms) < 0 && errno != EINTR)
            return 1;
        if (p[0].revents) {
            int fd;
            while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0)
                mux_open(fd);
        }
        if (mux_handle(p + 1, n) < 0)
            return 0;
    }
}
