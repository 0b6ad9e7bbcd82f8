/*
 * test_remote_cluster.c - the remote tier against a real 3-node Redis
 * Cluster started on loopback ports (redis-server --cluster-enabled yes,
 * joined by redis-cli --cluster create). Skipped (77) without
 * redis-server/redis-cli.
 */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "ferry_test.h"
#include "remote/remote_int.h"
#include "redis_server.h"

static ft_redis_cluster g_cl;
static const char LAYOUT[] = "llama-3-8b|bf16|L32";

static ferry_remote *open_cluster(int node, const char *extra_query)
{
    char url[160];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/0%s", g_cl.node[node].port,
             extra_query ? extra_query : "");
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    o.layout = LAYOUT;
    o.layout_len = sizeof LAYOUT - 1;
    o.key_prefix = "c:";
    o.command_timeout_ms = 2000;
    ferry_remote *r = NULL;
    FT_ASSERT_OK(ferry_remote_open(url, &o, &r));
    return r;
}

static ferry_remote_stats metrics(ferry_remote *r)
{
    ferry_remote_stats m = FERRY_REMOTE_STATS_INIT;
    FT_ASSERT_OK(ferry_remote_stats_get(r, &m));
    return m;
}

static int setup(void **state)
{
    (void)state;
    return ft_redis_cluster_start(&g_cl) == 0 ? 0 : -1;
}
static int teardown(void **state)
{
    (void)state;
    ft_redis_cluster_destroy(&g_cl);
    return 0;
}

static void slots_match_cluster_keyslot(void **state)
{
    (void)state;
    unsigned seed = 12345;
    for (int i = 0; i < 300; i++) {
        char key[40];
        size_t n = 1 + rand_r(&seed) % 30;
        for (size_t j = 0; j < n; j++)
            key[j] = "ab{}c:-x0123456789"[rand_r(&seed) % 18];
        const char *argv[] = {"CLUSTER", "KEYSLOT", key};
        size_t lens[] = {7, 7, n};
        char out[32];
        assert_int_equal(ft_redis_cmd_bin(&g_cl.node[0], out, sizeof out, 3, argv, lens),
                         REDIS_REPLY_INTEGER);
        if ((unsigned)atoi(out) != ferry_remote_key_slot(key, n))
            fail_msg("key '%.*s': redis says slot %s, ferry %u", (int)n, key, out,
                     ferry_remote_key_slot(key, n));
    }
}

static void keys_spread_over_nodes_and_read_back(void **state)
{
    (void)state;
    ferry_remote *r = open_cluster(0, NULL);
    assert_int_equal(metrics(r).cluster, 1);
    enum { N = 120 };
    uint8_t buf[2048];
    ferry_remote_key keys[N];
    char names[N][16];
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "chunk-%d", i);
        keys[i].data = names[i];
        keys[i].len = strlen(names[i]);
        ft_fill_pattern(buf, sizeof buf, (unsigned)i);
        if (i % 2)
            FT_ASSERT_OK(ferry_remote_put(r, names[i], keys[i].len, buf, sizeof buf));
        else
            FT_ASSERT_OK(ferry_remote_put_sync(r, names[i], keys[i].len, buf, sizeof buf));
    }
    FT_ASSERT_OK(ferry_remote_flush(r, 10000));
    /* every node holds some of them */
    for (int n = 0; n < 3; n++) {
        static const char *const dbsize[] = {"DBSIZE", NULL};
        char out[32];
        assert_int_equal(ft_redis_cmd(&g_cl.node[n], out, sizeof out, dbsize),
                         REDIS_REPLY_INTEGER);
        assert_true(atoi(out) > 0);
    }
    /* another handle, seeded from another node, reads them all */
    ferry_remote *r2 = open_cluster(2, NULL);
    for (int i = 0; i < N; i++) {
        assert_int_equal(ferry_remote_get(r2, names[i], keys[i].len, buf, sizeof buf),
                         (int)sizeof buf);
        assert_int_equal(ft_check_pattern(buf, sizeof buf, (unsigned)i), -1);
    }
    /* prefix lookup across nodes, then a hole */
    assert_int_equal(ferry_remote_exists(r2, keys, N), N);
    assert_int_equal(ferry_remote_delete(r2, keys + 50, 1), 1);
    assert_int_equal(ferry_remote_exists(r, keys, N), 50);
    assert_int_equal(ferry_remote_delete(r, keys, N), N - 1);
    assert_int_equal(ferry_remote_exists(r, keys, N), 0);
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.errors, 0);
    assert_int_equal(m.redirects, 0); /* the slot map was right all along */
    assert_int_equal(m.puts_written, N);
    ferry_remote_close(r);
    ferry_remote_close(r2);
}

static int node_cmd(int node, char *out, size_t len, const char *a0, const char *a1,
                    const char *a2, const char *a3, const char *a4)
{
    const char *argv[] = {a0, a1, a2, a3, a4, NULL};
    return ft_redis_cmd(&g_cl.node[node], out, len, argv);
}

static void ask_and_moved_during_a_slot_migration(void **state)
{
    (void)state;
    ferry_remote *r = open_cluster(0, "?cluster=yes");
    /* two keys sharing a hash tag, so one slot */
    const char *k1 = "{mig}one", *k2 = "{mig}two";
    char full1[32];
    snprintf(full1, sizeof full1, "c:%s", k1);
    unsigned slot = ferry_remote_key_slot(full1, strlen(full1));
    int src = ft_redis_cluster_owner(&g_cl, slot);
    assert_true(src >= 0);
    int dst = (src + 1) % 3;
    FT_ASSERT_OK(ferry_remote_put_sync(r, k1, strlen(k1), "value-one", 9));
    char slot_s[16], port_s[16], out[256];
    snprintf(slot_s, sizeof slot_s, "%u", slot);
    snprintf(port_s, sizeof port_s, "%d", g_cl.node[dst].port);
    /* start migrating the slot: k1 stays on the source for now */
    assert_int_equal(node_cmd(dst, out, sizeof out, "CLUSTER", "SETSLOT", slot_s, "IMPORTING",
                              g_cl.ids[src]),
                     REDIS_REPLY_STATUS);
    assert_int_equal(node_cmd(src, out, sizeof out, "CLUSTER", "SETSLOT", slot_s, "MIGRATING",
                              g_cl.ids[dst]),
                     REDIS_REPLY_STATUS);
    /* k2 does not exist on the source: the source answers ASK, the client
     * asks the target, which takes the write */
    uint64_t before = metrics(r).redirects;
    FT_ASSERT_OK(ferry_remote_put_sync(r, k2, strlen(k2), "value-two", 9));
    assert_true(metrics(r).redirects > before);
    char v[16];
    assert_int_equal(ferry_remote_get(r, k2, strlen(k2), v, sizeof v), 9);
    assert_memory_equal(v, "value-two", 9);
    /* k1 still on the source: served directly */
    assert_int_equal(ferry_remote_get(r, k1, strlen(k1), v, sizeof v), 9);
    assert_memory_equal(v, "value-one", 9);
    /* move k1 and finish the migration on every node */
    const char *mig[] = {"MIGRATE", "127.0.0.1", port_s, full1, "0", "5000", NULL};
    assert_int_equal(ft_redis_cmd(&g_cl.node[src], out, sizeof out, mig), REDIS_REPLY_STATUS);
    for (int n = 0; n < 3; n++)
        assert_int_equal(node_cmd(n, out, sizeof out, "CLUSTER", "SETSLOT", slot_s, "NODE",
                                  g_cl.ids[dst]),
                         REDIS_REPLY_STATUS);
    /* the old owner now answers MOVED; the client follows and learns */
    before = metrics(r).redirects;
    assert_int_equal(ferry_remote_get(r, k1, strlen(k1), v, sizeof v), 9);
    assert_memory_equal(v, "value-one", 9);
    assert_true(metrics(r).redirects > before);
    before = metrics(r).redirects;
    assert_int_equal(ferry_remote_get(r, k2, strlen(k2), v, sizeof v), 9);
    assert_int_equal(metrics(r).redirects, before); /* map updated: no more redirects */
    ferry_remote_key ks[2] = {{k1, strlen(k1)}, {k2, strlen(k2)}};
    assert_int_equal(ferry_remote_exists(r, ks, 2), 2);
    assert_int_equal(metrics(r).errors, 0);
    ferry_remote_close(r);
}

static void cluster_refuses_a_database(void **state)
{
    (void)state;
    char url[128];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/3", g_cl.node[0].port);
    ferry_remote *r = NULL;
    assert_int_equal(ferry_remote_open(url, NULL, &r), -EINVAL);
    assert_null(r);
    assert_non_null(strstr(ferry_last_error(), "only database 0"));
    /* cluster=no on a cluster node: the single-server path, which sees
     * MOVED as an error reply for keys of other nodes */
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/0?cluster=no", g_cl.node[0].port);
    FT_ASSERT_OK(ferry_remote_open(url, NULL, &r));
    assert_int_equal(metrics(r).cluster, 0);
    int moved = 0;
    for (int i = 0; i < 20 && !moved; i++) {
        char k[16], v[4];
        snprintf(k, sizeof k, "key%d", i);
        int rc = ferry_remote_get(r, k, strlen(k), v, sizeof v);
        if (rc == FERRY_EREMOTE && strstr(ferry_remote_last_error(r), "MOVED"))
            moved = 1;
        else
            assert_int_equal(rc, FERRY_ENOTFOUND);
    }
    assert_true(moved);
    ferry_remote_close(r);
}

/* Another writer's value under the same key, bigger than the reader's
 * destination (another layout with bigger chunks, or this layout's value
 * of another size, or not ferry's at all), is refused on the cluster path
 * as on a single server: never data, and not a reply out of bounds that
 * would mark the whole shared remote down. */
static void bigger_values_of_other_writers_are_refused(void **state)
{
    (void)state;
    static const char OTHER[] = "mistral-7b|fp16|L40";
    ferry_remote *r = open_cluster(0, NULL);
    char url[160];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/0", g_cl.node[1].port);
    ferry_remote_options o = FERRY_REMOTE_OPTIONS_INIT;
    o.layout = OTHER;
    o.layout_len = sizeof OTHER - 1;
    o.key_prefix = "c:";
    o.command_timeout_ms = 2000;
    ferry_remote *other = NULL;
    FT_ASSERT_OK(ferry_remote_open(url, &o, &other));
    size_t big = 1u << 20;
    uint8_t *v = malloc(big), small[4096];
    ft_fill_pattern(v, big, 3);
    FT_ASSERT_OK(ferry_remote_put_sync(other, "shared", 6, v, big));
    assert_int_equal(ferry_remote_get(r, "shared", 6, small, sizeof small), FERRY_EMISMATCH);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "mine", 4, v, big));
    assert_int_equal(ferry_remote_get(r, "mine", 4, small, sizeof small), -ENOBUFS);
    assert_non_null(strstr(ferry_remote_last_error(r), "1048576"));
    /* a foreign value, larger, under the server key */
    char node_out[32];
    unsigned slot = ferry_remote_key_slot("c:foreign", 9);
    int owner = ft_redis_cluster_owner(&g_cl, slot);
    assert_true(owner >= 0);
    const char *argv[] = {"SET", "c:foreign", (const char *)v};
    size_t lens[] = {3, 9, big};
    assert_int_equal(ft_redis_cmd_bin(&g_cl.node[owner], node_out, sizeof node_out, 3, argv,
                                      lens),
                     REDIS_REPLY_STATUS);
    assert_int_equal(ferry_remote_get(r, "foreign", 7, small, sizeof small), FERRY_ECORRUPT);
    /* still up, and the right value of the right size is data */
    ferry_remote_stats m = metrics(r);
    assert_int_equal(m.down, 0);
    FT_ASSERT_OK(ferry_remote_put_sync(r, "mine", 4, v, sizeof small));
    assert_int_equal(ferry_remote_get(r, "mine", 4, small, sizeof small), (int)sizeof small);
    assert_int_equal(ft_check_pattern(small, sizeof small, 3), -1);
    free(v);
    ferry_remote_close(other);
    ferry_remote_close(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(slots_match_cluster_keyslot),
        cmocka_unit_test(keys_spread_over_nodes_and_read_back),
        cmocka_unit_test(ask_and_moved_during_a_slot_migration),
        cmocka_unit_test(cluster_refuses_a_database),
        cmocka_unit_test(bigger_values_of_other_writers_are_refused),
    };
    if (!ft_redis_available()) {
        fprintf(stderr, "redis-server/redis-cli not installed: skipping\n");
        return 77;
    }
    return cmocka_run_group_tests_name("remote_cluster", tests, setup, teardown);
}
