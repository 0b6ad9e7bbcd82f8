/*
 * test_serve_ahead.c - read-ahead a daemon queues for a client (PREFETCH,
 * and the reads an ACQUIRE queues before its acquires) is for that client
 * alone: once the client is gone (it hung up, its connection ended, or
 * the daemon is closing: its connection is cut) nothing more is queued for
 * it, and what was queued and not begun is dropped at once, its L1 slots
 * given back, even while every I/O worker is busy with other reads. A
 * read that had begun lands as any other (its slot is never handed on
 * under it). Counted: ferry_serve_stats.ahead_dropped.
 *
 * The I/O workers are held busy by jobs of the test's own (queued on the
 * store's I/O queue), so the read-ahead stays queued as long as the test
 * likes.
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 120 */
#include <errno.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"
#include "kv/kv_impl.h"
#include "kv/kv_slots.h"
#include "proto/proto.h"
#include "serve_fixture.h"

#define CT 16
#define TB 64u
#define PLANES 4u
#define CHUNK (PLANES * CT * TB)
#define SLOTS 8
#define WORKERS 2
#define NA 8 /* chunks only in L2 */

static char g_dir[256], g_sock[300], g_l2[300];

static int setup(void **state)
{
    (void)state;
    ft_tmpdir(g_dir, sizeof g_dir);
    snprintf(g_sock, sizeof g_sock, "%s/ferry.sock", g_dir);
    snprintf(g_l2, sizeof g_l2, "%s/l2", g_dir);
    assert_int_equal(mkdir(g_l2, 0700), 0);
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

static atomic_int g_blocked, g_release;

static int teardown(void **state)
{
    (void)state;
    atomic_store(&g_release, 1); /* (a failed case's workers go) */
    for (int i = 0; atomic_load(&g_blocked) && i < 5000; i++)
        usleep(1000);
    ft_rmtree(g_dir);
    return 0;
}

static ferry_kv_hash id_of(uint64_t k)
{
    ferry_kv_hash h = {0xa0000u + k, 0x5eed};
    return h;
}

/* ---- the I/O workers held busy ---- */

static void blocker_run(ferry_kv *kv, ferry__kv_job *j)
{
    (void)kv;
    (void)j;
    atomic_fetch_add(&g_blocked, 1);
    while (!atomic_load(&g_release))
        usleep(1000);
    atomic_fetch_sub(&g_blocked, 1);
}

/* every I/O worker of kv runs a job of ours until workers_go */
static void workers_hold(ferry_kv *kv)
{
    atomic_store(&g_release, 0);
    for (int i = 0; i < WORKERS; i++) {
        ferry__kv_job *j = ferry__calloc(1, sizeof *j);
        assert_non_null(j);
        j->kind = FERRY__KV_JOB_COPY; /* (the I/O queue) */
        j->run = blocker_run;
        ferry__kv_enqueue(kv, j);
    }
    for (int i = 0; atomic_load(&g_blocked) < WORKERS; i++) {
        if (i > 5000)
            fail_msg("the I/O workers never took the test's jobs");
        usleep(1000);
    }
}

static void workers_go(ferry_kv *kv)
{
    atomic_store(&g_release, 1);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    assert_int_equal(atomic_load(&g_blocked), 0);
}

/* ---- the daemon ---- */

static void srv_start(ft_srv *v)
{
    ferry_kv_config kc = FERRY_KV_CONFIG_INIT;
    kc.model = "ahead-model";
    kc.layout = ft_kv_layout(TB);
    kc.chunk_tokens = CT;
    kc.l1_bytes = (uint64_t)SLOTS * CHUNK;
    kc.l2_dir = g_l2;
    kc.l2_bytes = 4u << 20;
    kc.workers = WORKERS;
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = g_sock;
    sc.kv = &kc;
    ft_srv_open(v, &sc);
}

/* chunks 0..NA-1 stored and written through to L2, then pushed out of L1
 * by as many others: each is in L2 alone */
static void fill_l2_only(ferry_kv *kv)
{
    for (int round = 0; round < 2; round++) {
        for (uint64_t k = 0; k < NA; k++) {
            ferry__kv_entry *e;
            uint64_t slot, gen;
            FT_ASSERT_OK(ferry__kv_slot_reserve(kv, id_of(k + 100u * (uint64_t)round), 1, &e,
                                                &slot, &gen));
            FT_ASSERT_OK(ferry__kv_slot_commit(kv, e, 0));
        }
        FT_ASSERT_OK(ferry_kv_flush(kv));
    }
    ferry_kv_hash ids[NA];
    uint8_t tiers[NA];
    for (uint64_t k = 0; k < NA; k++)
        ids[k] = id_of(k);
    assert_int_equal(ferry__kv_slot_lookup(kv, ids, NA, NA, tiers), NA);
    for (int k = 0; k < NA; k++)
        assert_int_equal(tiers[k], FERRY_KV_TIER_L2);
}

/* read-ahead queued and not landed (chunks) */
static uint64_t ahead_inflight(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->mu);
    uint64_t n = kv->prefetch_inflight / kv->slot_bytes;
    pthread_mutex_unlock(&kv->mu);
    return n;
}

static uint64_t l1_used(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->mu);
    uint64_t n = kv->tier[FERRY_KV_TIER_L1]->used;
    pthread_mutex_unlock(&kv->mu);
    return n;
}

static uint64_t dropped(ferry_serve *s)
{
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    FT_ASSERT_OK(ferry_serve_stats_get(s, &ss));
    return ss.ahead_dropped;
}

static uint64_t prefetched(ferry_kv *kv)
{
    ferry_kv_stats m = FERRY_KV_STATS_INIT;
    FT_ASSERT_OK(ferry_kv_stats_get(kv, &m));
    return m.prefetched_chunks;
}

/* a raw client: HELLO (no pool) */
static void raw_open(ft_raw *r)
{
    assert_int_equal(ft_raw_connect(r, g_sock), 0);
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_HELLO;
    q.hello.layout = ft_kv_layout(TB);
    q.hello.chunk_tokens = CT;
    q.hello.seed = FERRY_KV_HASH_SEED_DEFAULT;
    q.hello.flags = FERRY__HELLO_NO_POOL;
    ft_raw_req(r, &q);
    int32_t rc;
    char msg[256];
    assert_int_equal(ft_raw_reply(r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, 0);
}

/* a PREFETCH of chunks 0..n-1, answered */
static void raw_prefetch(ft_raw *r, uint32_t n)
{
    ferry__proto_chunk ch[NA];
    memset(ch, 0, sizeof ch);
    for (uint32_t i = 0; i < n; i++)
        ch[i].id = id_of(i);
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_PREFETCH;
    q.n = n;
    q.chunks = ch;
    ft_raw_req(r, &q);
    int32_t rc;
    char msg[256];
    assert_int_equal(ft_raw_reply(r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, (int32_t)n);
}

/* ---- the cases ---- */

/* a client PREFETCHes chunks only in L2 while every I/O worker is busy,
 * then hangs up: its queued reads go at once, their slots free, before
 * any worker is free to run them; nothing is read for it afterwards */
static void test_hung_up_clients_queued_read_ahead_is_dropped(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    ferry_kv *kv = ferry_serve_kv(v.s);
    fill_l2_only(kv);
    workers_hold(kv);
    uint64_t used0 = l1_used(kv), drop0 = dropped(v.s), pf0 = prefetched(kv);
    ft_raw r;
    raw_open(&r);
    raw_prefetch(&r, NA);
    uint64_t queued = ahead_inflight(kv);
    print_message("PREFETCH of %d chunks queued %llu reads (L1: %llu slots used, then %llu)\n",
                  NA, (unsigned long long)queued, (unsigned long long)used0,
                  (unsigned long long)l1_used(kv));
    assert_true(queued > 0);
    uint64_t used1 = l1_used(kv);
    ft_raw_close(&r); /* (as a kill -9 would) */
    int i = 0;
    for (; ahead_inflight(kv) && i < 2000; i++)
        usleep(1000);
    print_message("after the hang-up: %llu reads still queued after %d ms, %llu dropped\n",
                  (unsigned long long)ahead_inflight(kv), i,
                  (unsigned long long)(dropped(v.s) - drop0));
    assert_int_equal(ahead_inflight(kv), 0); /* (the workers are still held) */
    assert_int_equal(atomic_load(&g_blocked), WORKERS);
    assert_int_equal(dropped(v.s) - drop0, queued);
    assert_int_equal(l1_used(kv), used1 - queued);
    workers_go(kv);
    assert_int_equal(prefetched(kv), pf0); /* nothing was read for it */
    FT_ASSERT_OK(ferry__kv_check(kv));
    ft_srv_close(&v);
}

/* a cut connection's thread queues no read-ahead (PREFETCH, ACQUIRE); and
 * read-ahead a worker picks up after its connection was cut is dropped
 * unread, not read into L1 for nobody */
static void test_cut_connection_reads_nothing_ahead(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    ferry_kv *kv = ferry_serve_kv(v.s);
    fill_l2_only(kv);
    ferry_kv_hash ids[NA];
    for (uint64_t k = 0; k < NA; k++)
        ids[k] = id_of(k);
    workers_hold(kv);
    uint64_t used0 = l1_used(kv), drop0 = dropped(v.s), pf0 = prefetched(kv);
    /* this thread as a connection's: cut first, then asked to read ahead */
    ferry__kv_cut *cut = ferry__kv_cut_new();
    assert_non_null(cut);
    ferry__kv_thread_cut(cut);
    atomic_store(&cut->why, 1);
    ferry__kv_slot_prefetch(kv, ids, NA);
    assert_int_equal(ahead_inflight(kv), 0);
    assert_int_equal(l1_used(kv), used0);
    /* not cut yet: queued; then cut without anyone withdrawing it */
    atomic_store(&cut->why, 0);
    ferry__kv_slot_prefetch(kv, ids, NA);
    uint64_t queued = ahead_inflight(kv), used1 = l1_used(kv);
    assert_true(queued > 0);
    ferry__kv_thread_cut(NULL);
    atomic_store(&cut->why, 1);
    ferry__kv_cut_put(cut); /* (the queued reads hold it still) */
    workers_go(kv);         /* the workers pick them up: dropped unread */
    assert_int_equal(ahead_inflight(kv), 0);
    assert_int_equal(prefetched(kv), pf0);
    assert_int_equal(dropped(v.s) - drop0, queued);
    assert_int_equal(l1_used(kv), used1 - queued);
    uint8_t tiers[NA];
    assert_int_equal(ferry__kv_slot_lookup(kv, ids, NA, NA, tiers), NA);
    for (int k = 0; k < NA; k++)
        assert_int_equal(tiers[k], FERRY_KV_TIER_L2); /* none read into L1 */
    FT_ASSERT_OK(ferry__kv_check(kv));
    ft_srv_close(&v);
}

/* a connection that is not cut keeps its read-ahead: what it PREFETCHed
 * lands in L1 once a worker is free (the drop is for clients gone only) */
static void test_live_clients_read_ahead_lands(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    ferry_kv *kv = ferry_serve_kv(v.s);
    fill_l2_only(kv);
    workers_hold(kv);
    uint64_t drop0 = dropped(v.s), pf0 = prefetched(kv);
    ft_raw r;
    raw_open(&r);
    raw_prefetch(&r, NA);
    uint64_t queued = ahead_inflight(kv);
    assert_true(queued > 0);
    usleep(100000); /* (the accept loop has looked at it by now) */
    assert_int_equal(ahead_inflight(kv), queued);
    workers_go(kv);
    assert_int_equal(prefetched(kv) - pf0, queued);
    assert_int_equal(dropped(v.s), drop0);
    ft_raw_close(&r);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ft_srv_close(&v);
}

/* ---- the count where the daemon's counters are listed ---- */

/* the daemon's counters after the store's in a STATS reply (raw) */
static ferry_serve_stats raw_serve_stats(ft_raw *r)
{
    ferry__proto_req q;
    memset(&q, 0, sizeof q);
    q.hdr.type = FERRY__P_STATS;
    ft_raw_req(r, &q);
    int32_t rc;
    char msg[256];
    assert_int_equal(ft_raw_reply(r, &rc, msg, sizeof msg), 0);
    assert_int_equal(rc, 0);
    (void)ferry__proto_get_u32(&r->rd);
    uint32_t kv_size = ferry__proto_get_u32(&r->rd);
    assert_true(r->rd.p + kv_size <= r->rd.end);
    r->rd.p += kv_size;
    uint32_t size = ferry__proto_get_u32(&r->rd);
    ferry_serve_stats ss = FERRY_SERVE_STATS_INIT;
    assert_false(r->rd.err);
    assert_int_equal(size, sizeof ss);
    assert_true(r->rd.p + size <= r->rd.end);
    memcpy(&ss, r->rd.p, size);
    return ss;
}

/* `ferry serve status --socket g_sock`'s output into out; its exit status
 * (-1: the CLI is not built next to the tests) */
static int run_status(char *out, size_t len)
{
    char self[4096], cmd[8192];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return -1;
    self[n] = 0;
    snprintf(cmd, sizeof cmd, "%s/../ferry", dirname(self));
    if (access(cmd, X_OK) != 0)
        return -1;
    snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " serve status --socket %s", g_sock);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t got = fread(out, 1, len - 1, p);
    out[got] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* read-ahead dropped for a client that hung up is counted where every
 * other daemon counter is: the STATS reply (after the store's counters)
 * and `ferry serve status` (which showed none of the daemon's counters,
 * so the drops were visible in the metrics alone) */
static void test_status_lists_read_ahead_dropped(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    ferry_kv *kv = ferry_serve_kv(v.s);
    fill_l2_only(kv);
    workers_hold(kv);
    ft_raw r, watch;
    raw_open(&watch);
    raw_open(&r);
    raw_prefetch(&r, NA);
    uint64_t queued = ahead_inflight(kv);
    assert_true(queued > 0);
    ft_raw_close(&r);
    for (int i = 0; ahead_inflight(kv) && i < 2000; i++)
        usleep(1000);
    workers_go(kv);
    uint64_t n = dropped(v.s);
    assert_int_equal(n, queued);
    ferry_serve_stats ss = raw_serve_stats(&watch);
    assert_int_equal(ss.ahead_dropped, n);
    assert_true(ss.connections >= 2);
    ft_raw_close(&watch);
    static char out[8192];
    int st = run_status(out, sizeof out);
    if (st < 0) {
        ft_srv_close(&v);
        skip();
    }
    print_message("ferry serve status:\n%s", out);
    char want[64];
    snprintf(want, sizeof want, " %llu read-ahead dropped", (unsigned long long)n);
    assert_int_equal(st, 0);
    if (!strstr(out, want))
        fail_msg("serve status lacks '%s': '%s'", want, out);
    ft_srv_close(&v);
}

/* ---- flush and a withdrawal under way ---- */

struct cutter {
    ferry_kv *kv;
    ferry__kv_cut *cut;
};

static void *cutter_run(void *arg)
{
    struct cutter *c = arg;
    atomic_store(&c->cut->why, 1);
    ferry__kv_ahead_cut(c->kv, c->cut); /* (its drops wait for kv->mu) */
    return NULL;
}

struct flusher {
    ferry_kv *kv;
    atomic_int done;
    int rc;
};

static void *flusher_run(void *arg)
{
    struct flusher *f = arg;
    f->rc = ferry_kv_flush(f->kv);
    atomic_store(&f->done, 1);
    return NULL;
}

/* nothing left on the I/O queue (read-ahead withdrawn, or taken) */
static int io_queue_empty(ferry_kv *kv)
{
    pthread_mutex_lock(&kv->qmu);
    int empty = !kv->q[1].head;
    pthread_mutex_unlock(&kv->qmu);
    return empty;
}

/* ferry_kv_flush waits for read-ahead another thread withdrew and is still
 * dropping (it returned once the queues were empty and the workers idle,
 * with the dropped chunks' L1 slots and read-ahead budget not yet given
 * back): after flush, L1 usage and the counters show the drop done. The
 * withdrawer is held between its withdrawal and its drops by the store's
 * mutex, which the test holds */
static void test_flush_waits_for_read_ahead_being_dropped(void **state)
{
    (void)state;
    ft_srv v;
    srv_start(&v);
    ferry_kv *kv = ferry_serve_kv(v.s);
    fill_l2_only(kv);
    ferry_kv_hash ids[NA];
    for (uint64_t k = 0; k < NA; k++)
        ids[k] = id_of(k);
    workers_hold(kv);
    uint64_t drop0 = dropped(v.s);
    ferry__kv_cut *cut = ferry__kv_cut_new();
    assert_non_null(cut);
    ferry__kv_thread_cut(cut);
    ferry__kv_slot_prefetch(kv, ids, NA);
    ferry__kv_thread_cut(NULL);
    uint64_t queued = ahead_inflight(kv), used1 = l1_used(kv);
    assert_true(queued > 0);
    pthread_mutex_lock(&kv->mu);
    struct cutter c = {kv, cut};
    pthread_t tc, tf;
    assert_int_equal(pthread_create(&tc, NULL, cutter_run, &c), 0);
    int i = 0;
    for (; !io_queue_empty(kv) && i < 5000; i++)
        usleep(1000);
    int withdrawn = io_queue_empty(kv);
    atomic_store(&g_release, 1); /* the workers go idle: only the drops remain */
    for (i = 0; atomic_load(&g_blocked) && i < 5000; i++)
        usleep(1000);
    struct flusher f = {kv, 0, 0};
    assert_int_equal(pthread_create(&tf, NULL, flusher_run, &f), 0);
    usleep(200000);
    int early = atomic_load(&f.done);
    pthread_mutex_unlock(&kv->mu);
    assert_int_equal(pthread_join(tf, NULL), 0);
    uint64_t used2 = l1_used(kv), inflight2 = ahead_inflight(kv), drop2 = dropped(v.s) - drop0;
    assert_int_equal(pthread_join(tc, NULL), 0);
    ferry__kv_cut_put(cut);
    print_message("flush with a withdrawal under way: returned %s; right after it %llu of "
                  "%llu chunks dropped, %llu still in flight\n",
                  early ? "before the drops (stale)" : "after the drops",
                  (unsigned long long)drop2, (unsigned long long)queued,
                  (unsigned long long)inflight2);
    assert_true(withdrawn);
    FT_ASSERT_OK(f.rc);
    assert_false(early);
    assert_int_equal(drop2, queued);
    assert_int_equal(inflight2, 0);
    assert_int_equal(used2, used1 - queued);
    FT_ASSERT_OK(ferry__kv_check(kv));
    ft_srv_close(&v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hung_up_clients_queued_read_ahead_is_dropped, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_cut_connection_reads_nothing_ahead, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_live_clients_read_ahead_lands, setup, teardown),
        cmocka_unit_test_setup_teardown(test_flush_waits_for_read_ahead_being_dropped, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_status_lists_read_ahead_dropped, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
