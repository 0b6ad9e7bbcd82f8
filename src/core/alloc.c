/*
 * alloc.c - the allocation hook. Every bookkeeping allocation in ferry goes
 * through here, so a test can make the Nth allocation fail and check that
 * the caller unwinds cleanly (no leak, nothing half-visible).
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

static void *d_malloc(size_t n, void *c)
{
    (void)c;
    return malloc(n);
}
static void *d_calloc(size_t n, size_t s, void *c)
{
    (void)c;
    return calloc(n, s);
}
static void *d_realloc(void *p, size_t n, void *c)
{
    (void)c;
    return realloc(p, n);
}
static void *d_aligned(size_t a, size_t n, void *c)
{
    (void)c;
    void *p = NULL;
    if (a < sizeof(void *))
        a = sizeof(void *);
    if (posix_memalign(&p, a, n ? n : a) != 0)
        return NULL;
    return p;
}
static void d_free(void *p, void *c)
{
    (void)c;
    free(p);
}

static const ferry_allocator default_alloc = {d_malloc, d_calloc, d_realloc, d_aligned, d_free,
                                              NULL};
static ferry_allocator g_alloc = {d_malloc, d_calloc, d_realloc, d_aligned, d_free, NULL};

void ferry_set_allocator(const ferry_allocator *a)
{
    g_alloc = a ? *a : default_alloc;
}

void *ferry__malloc(size_t n)
{
    return g_alloc.malloc(n ? n : 1, g_alloc.ctx);
}
void *ferry__calloc(size_t n, size_t size)
{
    return g_alloc.calloc(n ? n : 1, size ? size : 1, g_alloc.ctx);
}
void *ferry__realloc(void *p, size_t n)
{
    return g_alloc.realloc(p, n ? n : 1, g_alloc.ctx);
}
void *ferry__aligned_alloc(size_t alignment, size_t n)
{
    return g_alloc.aligned_alloc(alignment, n, g_alloc.ctx);
}
void ferry__free(void *p)
{
    if (p)
        g_alloc.free(p, g_alloc.ctx);
}
char *ferry__strdup(const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *d = ferry__malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}
