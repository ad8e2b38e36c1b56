/*
 * Memory: allocation that cannot fail (the agent is init, so running out of memory ends it
 * cleanly rather than half-serving), growable buffers, and the scratch buffer handlers share.
 */
#include "agent.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char g_scratch[READ_CHUNK];

static void die_oom(void)
{
    logmsg("out of memory");
    _exit(70);
}

void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n ? n : 1);
    if (!p)
        die_oom();
    return p;
}

void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p)
        die_oom();
    return p;
}

void buf_reserve(struct buf *b, size_t extra)
{
    if (b->cap - b->len >= extra)
        return;
    size_t c = b->cap ? b->cap : 256;
    while (c - b->len < extra)
        c *= 2;
    b->p = xrealloc(b->p, c);
    b->cap = c;
}

void buf_add(struct buf *b, const void *d, size_t n)
{
    buf_reserve(b, n);
    if (n)
        memcpy(b->p + b->len, d, n);
    b->len += n;
}

void buf_free(struct buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}
