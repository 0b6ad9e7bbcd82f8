/*
 * kv_bench_store.c - the store a `ferry kv bench` run opens and the
 * engine's buffer it stores from and retrieves into.
 *
 * The engine buffer is host memory by default. With --device it is device
 * memory of that device (the store is given the device, so its L1 is
 * pinned through it and chunks move by the device's copies); with
 * --paged N it is vLLM's paged form: for each (kv, layer) a cache of
 * blocks of N tokens, the prompt's tokens placed through a block table
 * that runs backwards, so no two neighbouring blocks are neighbours in
 * memory.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kv_bench.h"

/* the remote client's options for a run (key prefix unique to it, values
 * expire after an hour so an interrupted run leaves nothing for long) */
ferry_remote_options kvb_remote_opts(const opts *o)
{
    ferry_remote_options ro = FERRY_REMOTE_OPTIONS_INIT;
    ro.key_prefix = o->remote_prefix;
    ro.ttl_s = 3600;
    return ro;
}

int kvb_open_store(const opts *o, const ferry_kv_layout *l, uint64_t l1, uint64_t l2,
                   const char *dir, ferry_kv **kv)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.prefetch_max_bytes = o->prefetch_max;
    c.model = o->model;
    c.layout = *l;
    c.chunk_tokens = o->chunk_tokens;
    c.l1_bytes = l1;
    c.l1_policy = c.l2_policy =
        !strcmp(o->policy, "s3fifo") ? FERRY_KV_EVICT_S3FIFO : FERRY_KV_EVICT_LRU;
    if (dir && l2) {
        c.l2_dir = dir;
        c.l2_bytes = l2;
        c.l2_direct = 1;
        c.l2_engine = o->engine;
        c.l2_persistent = o->persistent;
    }
    ferry_remote_options ro = kvb_remote_opts(o);
    if (o->remote) {
        c.remote_url = o->remote;
        c.remote_options = &ro;
    }
    c.device = o->dev;
    c.workers = 2;
    c.server = o->server; /* the daemon's tiers; l1 > 0: the pool is mapped */
    c.server_timeout_ms = o->server_timeout_ms; /* 0: the library's default */
    return ferry_kv_open(&c, kv);
}

const char *kvb_buffer_mem(const opts *o)
{
    return o->dev ? "device" : "host";
}

const char *kvb_buffer_form(const opts *o)
{
    return o->paged ? "paged" : "contiguous";
}

/* host memory of bytes, on huge pages where the kernel gives them, as an
 * engine's pinned KV cache is: in this VM, copies into freshly written
 * 4 KiB pages of a large buffer intermittently ran 3-4x slower (the L2
 * retrieve figure collapsing to 0.3x in whole runs), with identical code */
static void *host_mem(size_t bytes)
{
    void *p = NULL;
    size_t align = bytes >= (2u << 20) ? (2u << 20) : 4096;
    if (posix_memalign(&p, align, bytes))
        return NULL;
#ifdef MADV_HUGEPAGE
    if (align > 4096)
        (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    unsigned char *c = p;
    for (size_t i = 0; i < bytes; i += 4096)
        c[i] = (unsigned char)(i >> 12);
    return p;
}

/* the paged form over the memory at base: kv * layers caches of nblocks
 * blocks each, the table backwards */
static int make_paged(engine_buf *e, const ferry_kv_layout *l, uint64_t base, uint32_t bt,
                      uint64_t nblocks, uint64_t block_bytes)
{
    size_t ncache = (size_t)l->kv * l->num_layers;
    e->bases = malloc(ncache * sizeof *e->bases);
    e->table = malloc((size_t)nblocks * sizeof *e->table);
    if (!e->bases || !e->table)
        return -ENOMEM;
    for (size_t i = 0; i < ncache; i++)
        e->bases[i] = base + i * nblocks * block_bytes;
    for (uint64_t i = 0; i < nblocks; i++)
        e->table[i] = (int32_t)(nblocks - 1 - i);
    e->b.form = FERRY_KV_PAGED;
    e->b.block_bases = e->bases;
    e->b.block_tokens = bt;
    e->b.block_stride = 0;
    e->b.num_blocks = nblocks;
    e->b.block_table = e->table;
    e->b.table_len = (size_t)nblocks;
    return 0;
}

int kvb_buffer_alloc(const opts *o, const ferry_kv_layout *l, uint64_t cap, engine_buf *e)
{
    memset(e, 0, sizeof *e);
    ferry_kv_buffer d = FERRY_KV_BUFFER_INIT;
    d.layout = *l;
    d.capacity_tokens = cap;
    e->b = d;
    uint64_t tb = (uint64_t)l->num_heads * l->head_dim * ferry_dtype_size(l->dtype);
    uint32_t bt = o && o->paged ? o->paged : 0;
    uint64_t nblocks = bt ? (cap + bt - 1) / bt : 0;
    uint64_t tokens = bt ? nblocks * bt : cap;
    size_t bytes = (size_t)(l->kv * l->num_layers * tokens * tb);
    uint64_t base;
    if (o && o->dev) {
        int rc = ferry_device_alloc(o->dev, bytes, &e->devmem);
        if (rc == 0)
            rc = ferry_device_memset(o->dev, e->devmem, 0x5a, bytes);
        if (rc < 0) {
            if (e->devmem)
                ferry_device_free(o->dev, e->devmem);
            e->devmem = 0;
            return rc;
        }
        e->dev = o->dev;
        e->b.mem = FERRY_KV_MEM_DEVICE;
        base = e->devmem;
    } else {
        if (!(e->host = host_mem(bytes)))
            return -ENOMEM;
        base = (uint64_t)(uintptr_t)e->host;
    }
    e->b.base = base;
    if (bt) {
        int rc = make_paged(e, l, base, bt, nblocks, bt * tb);
        if (rc < 0) {
            kvb_buffer_free(e);
            return rc;
        }
    }
    return 0;
}

void kvb_buffer_free(engine_buf *e)
{
    if (!e)
        return;
    if (e->dev && e->devmem)
        ferry_device_free(e->dev, e->devmem);
    free(e->host);
    free(e->bases);
    free(e->table);
    memset(e, 0, sizeof *e);
}
