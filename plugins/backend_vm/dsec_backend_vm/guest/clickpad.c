/* clickpad: a tiny guest program that proves a VM's display and input work end to end.
 *
 * It paints the Linux framebuffer /dev/fb0 (any of 16, 24 or 32 bpp, colour layout taken from
 * FBIOGET_VSCREENINFO) with a background and one button, the rectangle BUTTON_X0..BUTTON_X1 x
 * BUTTON_Y0..BUTTON_Y1 (half-open), red. It then reads evdev events from every
 * /dev/input/event* (looked for again every second, so a device probed late is still found):
 * absolute pointers (ABS_X/ABS_Y, scaled from the device's absinfo range to the screen),
 * relative mice (REL_X/REL_Y) and BTN_LEFT. A left press inside the button paints it green.
 *
 * Lines on stdout, the host's only view of it besides the screen:
 *   ready WxH        once the first frame is drawn
 *   clicked N        the Nth left press inside the button
 *   miss X Y         a left press outside it, at pixel (X, Y)
 *   key CODE         a key press (EV_KEY below BTN_MISC), CODE as in linux/input-event-codes.h
 *
 * The host side (dsec_backend_vm.screen and its tests) shares the constants below; keep them
 * in step with CLICKPAD_BUTTON there.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fb.h>
#include <linux/input.h>
#include <linux/kd.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#define BUTTON_X0 100
#define BUTTON_X1 300
#define BUTTON_Y0 100
#define BUTTON_Y1 180
#define MAX_DEVICES 32

struct rgb {
    uint8_t r, g, b;
};

static const struct rgb BACKGROUND = {0x20, 0x30, 0x40};
static const struct rgb RED = {0xff, 0x00, 0x00};
static const struct rgb GREEN = {0x00, 0xff, 0x00};

struct screen {
    uint8_t *mem;
    size_t size;
    unsigned width, height, line, bytes_per_pixel;
    struct fb_bitfield red, green, blue;
};

struct device {
    int fd;
    char name[64];
    int abs_min[2], abs_max[2]; /* [0] x, [1] y; max < min when the axis is absent */
};

struct pointer {
    long x, y;
    int press; /* a BTN_LEFT press seen since the last SYN_REPORT */
};

static unsigned channel(uint8_t value, const struct fb_bitfield *f)
{
    if (f->length == 0)
        return 0;
    return ((unsigned)value >> (8 - (f->length > 8 ? 8 : f->length))) << f->offset;
}

static void fill(struct screen *s, unsigned x0, unsigned y0, unsigned x1, unsigned y1,
                 struct rgb c)
{
    uint32_t pixel = channel(c.r, &s->red) | channel(c.g, &s->green) | channel(c.b, &s->blue);
    if (x1 > s->width)
        x1 = s->width;
    if (y1 > s->height)
        y1 = s->height;
    for (unsigned y = y0; y < y1; y++) {
        uint8_t *row = s->mem + (size_t)y * s->line;
        for (unsigned x = x0; x < x1; x++)
            memcpy(row + (size_t)x * s->bytes_per_pixel, &pixel, s->bytes_per_pixel);
    }
}

static int open_screen(struct screen *s)
{
    struct fb_var_screeninfo var;
    struct fb_fix_screeninfo fix;
    int fd = open("/dev/fb0", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        perror("clickpad: /dev/fb0");
        return -1;
    }
    if (ioctl(fd, FBIOGET_VSCREENINFO, &var) < 0 || ioctl(fd, FBIOGET_FSCREENINFO, &fix) < 0) {
        perror("clickpad: framebuffer geometry");
        close(fd);
        return -1;
    }
    if (var.bits_per_pixel != 16 && var.bits_per_pixel != 24 && var.bits_per_pixel != 32) {
        fprintf(stderr, "clickpad: %u bits per pixel is not handled\n", var.bits_per_pixel);
        close(fd);
        return -1;
    }
    s->width = var.xres;
    s->height = var.yres;
    s->line = fix.line_length;
    s->bytes_per_pixel = var.bits_per_pixel / 8;
    s->red = var.red;
    s->green = var.green;
    s->blue = var.blue;
    s->size = fix.smem_len;
    s->mem = mmap(NULL, s->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (s->mem == MAP_FAILED) {
        perror("clickpad: mmap /dev/fb0");
        return -1;
    }
    return 0;
}

/* Keep the framebuffer console (its blinking cursor, kernel messages) off our pixels. */
static void console_to_graphics(void)
{
    int fd = open("/dev/tty0", O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return;
    ioctl(fd, KDSETMODE, KD_GRAPHICS);
    close(fd);
}

static void add_device(struct device *devices, int *count, const char *name)
{
    char path[96 + sizeof devices[0].name];
    struct input_absinfo info;
    struct device *d;
    for (int i = 0; i < *count; i++)
        if (strcmp(devices[i].name, name) == 0)
            return;
    if (*count >= MAX_DEVICES || strlen(name) >= sizeof devices[0].name)
        return;
    strcpy(path, "/dev/input/");
    strcat(path, name);
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return;
    d = &devices[(*count)++];
    d->fd = fd;
    strcpy(d->name, name);
    for (int axis = 0; axis < 2; axis++) {
        d->abs_min[axis] = 0;
        d->abs_max[axis] = -1;
        if (ioctl(fd, EVIOCGABS(axis == 0 ? ABS_X : ABS_Y), &info) == 0) {
            d->abs_min[axis] = info.minimum;
            d->abs_max[axis] = info.maximum;
        }
    }
}

static void scan_devices(struct device *devices, int *count)
{
    DIR *dir = opendir("/dev/input");
    struct dirent *e;
    if (dir == NULL)
        return;
    while ((e = readdir(dir)) != NULL)
        if (strncmp(e->d_name, "event", 5) == 0)
            add_device(devices, count, e->d_name);
    closedir(dir);
}

static long clamp(long v, long lo, long hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* Absolute value v in [min, max] to a pixel in [0, size): the same split of the axis into
 * size equal parts that QEMU uses when it scales a pixel to its 0..0x7fff range. */
static long scale_abs(int v, int min, int max, unsigned size)
{
    if (max < min)
        return 0;
    long long span = (long long)max - min + 1;
    return clamp((long)(((long long)v - min) * size / span), 0, (long)size - 1);
}

static int inside_button(long x, long y)
{
    return x >= BUTTON_X0 && x < BUTTON_X1 && y >= BUTTON_Y0 && y < BUTTON_Y1;
}

static void handle(struct screen *s, const struct device *d, const struct input_event *ev,
                   struct pointer *p, unsigned *clicks)
{
    switch (ev->type) {
    case EV_ABS:
        if (ev->code == ABS_X)
            p->x = scale_abs(ev->value, d->abs_min[0], d->abs_max[0], s->width);
        else if (ev->code == ABS_Y)
            p->y = scale_abs(ev->value, d->abs_min[1], d->abs_max[1], s->height);
        break;
    case EV_REL:
        if (ev->code == REL_X)
            p->x = clamp(p->x + ev->value, 0, (long)s->width - 1);
        else if (ev->code == REL_Y)
            p->y = clamp(p->y + ev->value, 0, (long)s->height - 1);
        break;
    case EV_KEY:
        if (ev->code == BTN_LEFT && ev->value == 1)
            p->press = 1;
        else if (ev->code < BTN_MISC && ev->value == 1)
            printf("key %u\n", ev->code);
        break;
    case EV_SYN:
        /* A press is judged at the end of its report, after the position in the same one. */
        if (ev->code == SYN_REPORT && p->press) {
            p->press = 0;
            if (inside_button(p->x, p->y)) {
                fill(s, BUTTON_X0, BUTTON_Y0, BUTTON_X1, BUTTON_Y1, GREEN);
                printf("clicked %u\n", ++*clicks);
            } else {
                printf("miss %ld %ld\n", p->x, p->y);
            }
        }
        break;
    }
}

int main(void)
{
    struct screen s;
    struct device devices[MAX_DEVICES];
    struct pollfd fds[MAX_DEVICES];
    struct pointer p = {0, 0, 0};
    unsigned clicks = 0;
    int count = 0;

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (open_screen(&s) < 0)
        return 1;
    console_to_graphics();
    fill(&s, 0, 0, s.width, s.height, BACKGROUND);
    fill(&s, BUTTON_X0, BUTTON_Y0, BUTTON_X1, BUTTON_Y1, RED);
    scan_devices(devices, &count);
    printf("ready %ux%u\n", s.width, s.height);

    for (;;) {
        for (int i = 0; i < count; i++) {
            fds[i].fd = devices[i].fd;
            fds[i].events = POLLIN;
        }
        int n = poll(fds, count, 1000);
        if (n < 0 && errno != EINTR) {
            perror("clickpad: poll");
            return 1;
        }
        if (n <= 0) {
            scan_devices(devices, &count);
            continue;
        }
        for (int i = 0; i < count; i++) {
            struct input_event ev[64];
            if (!(fds[i].revents & POLLIN))
                continue;
            ssize_t got = read(devices[i].fd, ev, sizeof ev);
            for (ssize_t k = 0; got > 0 && k < got / (ssize_t)sizeof ev[0]; k++)
                handle(&s, &devices[i], &ev[k], &p, &clicks);
        }
    }
}
