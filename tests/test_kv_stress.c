/*
 * test_kv_stress.c - 8 threads storing, looking up, retrieving, prefetching,
 * pinning and deleting overlapping prompts on one store with a small L1 and
 * an L2 slab, so evictions, write-throughs and promotions race with every
 * read. Every byte a retrieve reports as loaded is checked against what any
 * writer of that chunk stored (the content is a function of the chunk's
 * hash, the same for every writer); every chunk it reports as a miss must
 * be left untouched. Runs clean under TSan.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 600 */
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/kv.h"
#include "ferry_test.h"
#include "kv/kv_impl.h"

#define CT 16
static unsigned g_tb = 64; /* bytes per token and plane (wider for pieces) */
#define TB g_tb
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)
#define DOCS 6
#define DOC_CHUNKS 6
#define THREADS 8
#define ITERS 250

static ferry_kv *g_kv;
static int32_t g_docs[DOCS][DOC_CHUNKS * CT];
static atomic_long g_checked, g_loaded, g_missed, g_errors;
/* a thread scribbling over the L2 slab file behind the store's back */
static atomic_int g_scribble_stop;
static int g_scribbling;

static ferry_kv_layout small_layout(void)
{
    return ft_kv_layout(TB);
}

static unsigned char content(ferry_kv_hash h, unsigned plane, unsigned row, unsigned j)
{
    unsigned k = (plane * 5 + row * 3 + j) & 7;
    return (unsigned char)((h.lo >> (8 * k)) ^ (h.hi >> (8 * ((k + 3) & 7))) ^ (plane * 31 + row * 7 + j));
}

/* fill a contiguous [PLANES][cap][TB] buffer with the content of each chunk */
static void fill(unsigned char *mem, uint64_t cap, const ferry_kv_hash *h, int nch)
{
    for (int c = 0; c < nch; c++)
        for (unsigned p = 0; p < PLANES; p++)
            for (unsigned r = 0; r < CT; r++) {
                unsigned char *row = mem + ((uint64_t)p * cap + (uint64_t)c * CT + r) * TB;
                for (unsigned j = 0; j < TB; j++)
                    row[j] = content(h[c], p, r, j);
            }
}

typedef struct targ {
    unsigned seed;
    int id;
} targ;

static unsigned rnd(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 16) & 0x7fff;
}

static void *worker(void *arg)
{
    targ *a = arg;
    unsigned s = a->seed;
    const uint64_t cap = DOC_CHUNKS * CT;
    unsigned char *mem = malloc(PLANES * cap * TB);
    if (!mem) {
        atomic_fetch_add(&g_errors, 1);
        return NULL;
    }
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = small_layout();
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = cap;
    for (int it = 0; it < ITERS; it++) {
        int d = (int)(rnd(&s) % DOCS);
        int nch = 1 + (int)(rnd(&s) % DOC_CHUNKS);
        size_t n = (size_t)nch * CT;
        const int32_t *tok = g_docs[d];
        ferry_kv_hash h[DOC_CHUNKS];
        ferry_kv_hash_chunks(FERRY_KV_HASH_SEED_DEFAULT, tok, n, CT, 0, h, DOC_CHUNKS);
        unsigned op = rnd(&s) % 100;
        if (op < 35) {
            fill(mem, cap, h, nch);
            int rc;
            if (op < 8) {
                ferry_kv_op *o;
                rc = ferry_kv_store_async(g_kv, tok, n, NULL, &b, &o);
                if (rc == 0) {
                    rc = ferry_kv_op_wait(o, -1);
                    ferry_kv_op_free(o);
                }
            } else {
                rc = ferry_kv_store(g_kv, tok, n, NULL, &b);
            }
            /* racing writers and a pool of locked chunks may decline some */
            if (rc < 0 && rc != FERRY_ENOSPACE && rc != -ENOMEM) {
                fprintf(stderr, "store: %d %s\n", rc, ferry_last_error());
                atomic_fetch_add(&g_errors, 1);
            }
        } else if (op < 80) {
            int look = ferry_kv_lookup(g_kv, tok, n, NULL);
            if (look < 0 || look > (int)n || look % CT) {
                atomic_fetch_add(&g_errors, 1);
                continue;
            }
            memset(mem, 0xEE, PLANES * cap * TB);
            int st[DOC_CHUNKS];
            ferry_kv_req r = FERRY_KV_REQ_INIT;
            r.status = st;
            r.max_chunks = DOC_CHUNKS;
            int got;
            if (op < 45) {
                ferry_kv_op *o;
                got = ferry_kv_retrieve_async(g_kv, tok, n, &r, &b, &o);
                if (got == 0) {
                    got = ferry_kv_op_wait(o, -1);
                    ferry_kv_op_free(o);
                }
            } else {
                got = ferry_kv_retrieve(g_kv, tok, n, &r, &b);
            }
            if (got < 0) {
                fprintf(stderr, "retrieve: %d %s\n", got, ferry_last_error());
                atomic_fetch_add(&g_errors, 1);
                continue;
            }
            for (int c = 0; c < nch; c++) {
                int ok = st[c] == 0;
                if (ok)
                    atomic_fetch_add(&g_loaded, 1);
                else
                    atomic_fetch_add(&g_missed, 1);
                if (!ok && st[c] != FERRY_ENOTFOUND && st[c] != FERRY_ENOSPACE &&
                    !(g_scribbling && st[c] == FERRY_ECORRUPT))
                    atomic_fetch_add(&g_errors, 1);
                /* a chunk that failed its check while being copied into
                 * this host buffer was zeroed there, never left bad (one
                 * checked before its copy is untouched) */
                unsigned char miss = 0xEE;
                if (st[c] == FERRY_ECORRUPT && mem[(uint64_t)c * CT * TB] == 0)
                    miss = 0;
                for (unsigned p = 0; p < PLANES; p++)
                    for (unsigned rr = 0; rr < CT; rr++) {
                        const unsigned char *row =
                            mem + ((uint64_t)p * cap + (uint64_t)c * CT + rr) * TB;
                        for (unsigned j = 0; j < TB; j++) {
                            unsigned char want = ok ? content(h[c], p, rr, j) : miss;
                            if (row[j] != want) {
                                fprintf(stderr,
                                        "thread %d: doc %d chunk %d plane %u row %u byte %u: %02x, "
                                        "want %02x (%s)\n",
                                        a->id, d, c, p, rr, j, row[j], want,
                                        ok ? "loaded" : "miss");
                                atomic_fetch_add(&g_errors, 1);
                                goto next;
                            }
                        }
                    }
                atomic_fetch_add(&g_checked, 1);
            next:;
            }
        } else if (op < 88) {
            int rc = ferry_kv_delete(g_kv, tok, n, NULL);
            if (rc < 0 && rc != FERRY_ELOCKED)
                atomic_fetch_add(&g_errors, 1);
        } else if (op < 94) {
            int p = ferry_kv_pin(g_kv, tok, n, NULL);
            if (p < 0)
                atomic_fetch_add(&g_errors, 1);
            else if (p > 0 && ferry_kv_unpin(g_kv, tok, (size_t)p, NULL) < 0)
                atomic_fetch_add(&g_errors, 1);
        } else {
            if (ferry_kv_prefetch(g_kv, tok, n, NULL) < 0)
                atomic_fetch_add(&g_errors, 1);
        }
        ft_kv_watchdog_kick();
    }
    free(mem);
    return NULL;
}

static void *scribbler(void *arg)
{
    const char *dir = arg;
    char path[400];
    snprintf(path, sizeof path, "%s/ferry_slab.bin", dir);
    int fd = open(path, O_WRONLY);
    if (fd < 0) {
        atomic_fetch_add(&g_errors, 1);
        return NULL;
    }
    unsigned s = 99;
    unsigned char junk[256];
    while (!atomic_load(&g_scribble_stop)) {
        memset(junk, (int)(rnd(&s) & 0xff), sizeof junk);
        off_t off = (off_t)(rnd(&s) % (24 * CHUNK - sizeof junk));
        if (pwrite(fd, junk, sizeof junk, off) != (ssize_t)sizeof junk)
            atomic_fetch_add(&g_errors, 1);
        usleep(200);
    }
    close(fd);
    return NULL;
}

static void run(int policy, int with_l2)
{
    char dir[256] = "";
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "stress";
    c.layout = small_layout();
    c.chunk_tokens = CT;
    c.l1_bytes = 12 * CHUNK;
    c.l1_policy = policy;
    c.l2_policy = policy;
    c.workers = 3;
    if (with_l2) {
        ft_tmpdir(dir, sizeof dir);
        c.l2_dir = dir;
        c.l2_bytes = 24 * CHUNK;
        c.l2_engine = "posix";
        c.prefetch_max_bytes = 4 * CHUNK;
    }
    FT_ASSERT_OK(ferry_kv_open(&c, &g_kv));
    /* documents share prefixes: doc d starts with doc d-1's first chunks */
    for (int d = 0; d < DOCS; d++)
        for (int i = 0; i < DOC_CHUNKS * CT; i++)
            g_docs[d][i] = (d > 0 && i < 2 * CT) ? g_docs[d - 1][i] : d * 100000 + i * 13 + 1;
    atomic_store(&g_checked, 0);
    atomic_store(&g_loaded, 0);
    atomic_store(&g_missed, 0);
    atomic_store(&g_errors, 0);
    pthread_t th[THREADS];
    targ args[THREADS];
    /* no operation finishing for a minute is a deadlock: fail, with the
     * store's state, rather than hang until the test's timeout */
    ft_kv_watchdog_start(g_kv, 60, "test_kv_stress");
    for (int i = 0; i < THREADS; i++) {
        args[i].seed = 1234u + (unsigned)i * 7919u + (unsigned)policy * 31u;
        args[i].id = i;
        assert_int_equal(pthread_create(&th[i], NULL, worker, &args[i]), 0);
    }
    pthread_t sth;
    atomic_store(&g_scribble_stop, 0);
    if (g_scribbling)
        assert_int_equal(pthread_create(&sth, NULL, scribbler, dir), 0);
    for (int i = 0; i < THREADS; i++)
        pthread_join(th[i], NULL);
    if (g_scribbling) {
        atomic_store(&g_scribble_stop, 1);
        pthread_join(sth, NULL);
    }
    FT_ASSERT_OK(ferry_kv_flush(g_kv));
    ft_kv_watchdog_stop();
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(g_kv, &m));
    printf("  %s%s: %ld chunks loaded and checked, %ld misses checked untouched; "
           "evictions L1 %llu L2 %llu, L2 hits %llu, prefetched %llu, corrupt %llu\n",
           policy == FERRY_KV_EVICT_LRU ? "lru" : "s3fifo", with_l2 ? "+l2" : "",
           (long)atomic_load(&g_loaded), (long)atomic_load(&g_missed),
           (unsigned long long)m.tier[FERRY_KV_TIER_L1].evictions,
           (unsigned long long)m.tier[FERRY_KV_TIER_L2].evictions,
           (unsigned long long)m.tier[FERRY_KV_TIER_L2].hits,
           (unsigned long long)m.prefetched_chunks, (unsigned long long)m.corrupt_chunks);
    if (g_scribbling)
        assert_true(m.corrupt_chunks > 0);
    else
        assert_int_equal(m.corrupt_chunks, 0);
    assert_int_equal(atomic_load(&g_errors), 0);
    assert_true(atomic_load(&g_loaded) > 0);
    assert_true(atomic_load(&g_checked) == atomic_load(&g_loaded) + atomic_load(&g_missed));
    FT_ASSERT_OK(ferry__kv_check(g_kv));
    assert_true(m.tier[FERRY_KV_TIER_L1].evictions > 0);
    if (with_l2)
        assert_true(m.tier[FERRY_KV_TIER_L2].hits > 0);
    ferry_kv_close(g_kv);
    g_kv = NULL;
    if (with_l2)
        ft_rmtree(dir);
}

static void eight_threads_lru_with_l2(void **state)
{
    (void)state;
    run(FERRY_KV_EVICT_LRU, 1);
}

/* the same while another thread overwrites random bytes of the L2 slab
 * file: every chunk a retrieve reports is still exact, every other one
 * untouched (or zeroed, when it failed its check on the way out) */
static void eight_threads_with_l2_written_behind_the_store(void **state)
{
    (void)state;
    g_scribbling = 1;
    run(FERRY_KV_EVICT_LRU, 1);
    g_scribbling = 0;
}

static void eight_threads_s3fifo_with_l2(void **state)
{
    (void)state;
    run(FERRY_KV_EVICT_S3FIFO, 1);
}

static void eight_threads_l1_only(void **state)
{
    (void)state;
    run(FERRY_KV_EVICT_LRU, 0);
}

/* ---- retrieves only, L2-only prompts longer than a quarter of L1 ----
 * Each retrieve keeps up to a quarter of L1 in reads and holds the slots
 * its copies read: four at once over an L1 of 16 chunks must still each
 * get the whole prompt (waiting for room, never reporting a stored chunk
 * as a miss for want of L1 slots), byte for byte. */
#define RP 16 /* prompts */
#define RC 12 /* chunks each */
#define RTHREADS 4
#define RITERS 60

static int32_t g_rtok[RP][RC * CT];
static unsigned char *g_rsrc;
static atomic_long g_short, g_bad;

static unsigned char rbyte(size_t i)
{
    return (unsigned char)((i * 131 + 7) ^ (i >> 13));
}

static void *retriever(void *arg)
{
    unsigned seed = *(unsigned *)arg;
    size_t pb = (size_t)PLANES * RC * CT * TB;
    unsigned char *mem = malloc(pb);
    ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
    b.layout = small_layout();
    b.base = (uint64_t)(uintptr_t)mem;
    b.capacity_tokens = RC * CT;
    for (int it = 0; mem && it < RITERS; it++) {
        int p = (int)(rnd(&seed) % RP);
        memset(mem, 0, pb);
        int got = ferry_kv_retrieve(g_kv, g_rtok[p], RC * CT, NULL, &b);
        if (got != RC * CT)
            atomic_fetch_add(&g_short, 1);
        if (got > 0 && memcmp(mem, g_rsrc + (size_t)p * pb, pb) != 0)
            atomic_fetch_add(&g_bad, 1);
    }
    free(mem);
    return NULL;
}

static void four_retrieves(uint64_t piece)
{
    char dir[256] = "";
    ft_tmpdir(dir, sizeof dir);
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "rstress";
    c.layout = small_layout();
    c.chunk_tokens = CT;
    c.l1_bytes = 16 * CHUNK;
    c.workers = 2;
    c.l2_dir = dir;
    c.l2_bytes = 512 * CHUNK;
    c.l2_engine = "posix";
    FT_ASSERT_OK(ferry_kv_open(&c, &g_kv));
    g_kv->tier[FERRY_KV_TIER_L2]->apiece = piece;
    size_t pb = (size_t)PLANES * RC * CT * TB;
    g_rsrc = malloc((size_t)RP * pb);
    assert_non_null(g_rsrc);
    for (size_t i = 0; i < (size_t)RP * pb; i++)
        g_rsrc[i] = rbyte(i);
    for (int p = 0; p < RP; p++) {
        for (int i = 0; i < RC * CT; i++)
            g_rtok[p][i] = p * 100000 + i * 7 + 1;
        ferry_kv_buffer b = FERRY_KV_BUFFER_INIT;
        b.layout = small_layout();
        b.base = (uint64_t)(uintptr_t)(g_rsrc + (size_t)p * pb);
        b.capacity_tokens = RC * CT;
        assert_int_equal(ferry_kv_store(g_kv, g_rtok[p], RC * CT, NULL, &b), RC * CT);
        FT_ASSERT_OK(ferry_kv_flush(g_kv));
    }
    atomic_store(&g_short, 0);
    atomic_store(&g_bad, 0);
    pthread_t th[RTHREADS];
    unsigned seeds[RTHREADS];
    for (int i = 0; i < RTHREADS; i++) {
        seeds[i] = 17u + (unsigned)i * 7919u;
        assert_int_equal(pthread_create(&th[i], NULL, retriever, &seeds[i]), 0);
    }
    for (int i = 0; i < RTHREADS; i++)
        pthread_join(th[i], NULL);
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(g_kv, &m));
    assert_int_equal(atomic_load(&g_bad), 0);
    assert_int_equal(atomic_load(&g_short), 0);
    assert_true(m.tier[FERRY_KV_TIER_L2].hits > 0);
    FT_ASSERT_OK(ferry__kv_check(g_kv));
    ferry_kv_close(g_kv);
    g_kv = NULL;
    free(g_rsrc);
    g_rsrc = NULL;
    ft_rmtree(dir);
}

static void four_retrieves_of_l2_prompts_each_get_all(void **state)
{
    (void)state;
    four_retrieves(0);
}

/* the same with chunks of 16 KiB read in 4 pieces each */
static void four_retrieves_of_chunks_read_in_pieces_each_get_all(void **state)
{
    (void)state;
    g_tb = 256;
    four_retrieves(4096);
    g_tb = 64;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(eight_threads_lru_with_l2),
        cmocka_unit_test(eight_threads_s3fifo_with_l2),
        cmocka_unit_test(eight_threads_l1_only),
        cmocka_unit_test(eight_threads_with_l2_written_behind_the_store),
        cmocka_unit_test(four_retrieves_of_l2_prompts_each_get_all),
        cmocka_unit_test(four_retrieves_of_chunks_read_in_pieces_each_get_all),
    };
    /* FERRY_TEST_FILTER=eight_threads_s3fifo* runs the matching tests only */
    const char *filter = getenv("FERRY_TEST_FILTER");
    if (filter && *filter)
        cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
