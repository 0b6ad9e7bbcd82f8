/*
 * test_serve_config.c - `ferry serve`'s configuration reader (tools/
 * serve_config.c): a file with every key gives exactly those values; each
 * kind of mistake (unknown key, wrong type, bad size, duplicate key, not
 * YAML, a second document, alias/anchor/tag, no value, l2_dir with
 * l2_dirs, a directory twice, a bad layout member) is refused with the
 * file, line, column and key in one line; FERRY_<KEY> variables override
 * the file, lists included, and a URL with a password is never echoed.
 * (The flags over both: test_serve_config_cli.c runs the command.)
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_test.h"
#include "ferry/serve.h"
#include "serve/serve_config.h"

static char g_err[1024];

static int parse(ferry__serve_conf *c, const char *text)
{
    g_err[0] = 0;
    return ferry__serve_conf_parse(c, "f.yaml", text, strlen(text), g_err, sizeof g_err);
}

/* text is refused with a message that starts with where (file:line:col:
 * key) and holds piece */
static void refused(const char *text, const char *where, const char *piece)
{
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    int rc = parse(&c, text);
    ferry__serve_conf_free(&c);
    if (rc != -1)
        fail_msg("accepted: %s", text);
    if (strncmp(g_err, where, strlen(where)))
        fail_msg("%s: message \"%s\" does not start with \"%s\"", text, g_err, where);
    if (piece && !strstr(g_err, piece))
        fail_msg("%s: message \"%s\" does not say \"%s\"", text, g_err, piece);
    assert_null(strchr(g_err, '\n'));
}

static void every_key_is_read(void **state)
{
    (void)state;
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    const char *text =
        "# the daemon of this host\n"
        "model: my-model\n"
        "layout: {num_layers: 28, kv: 1, num_heads: 4, head_dim: 96, dtype: f16}\n"
        "tp_rank: 1\ntp_world: 2\nchunk_tokens: 128\nhash_seed: 18446744073709551615\n"
        "l1_bytes: 1.5G\n"
        "l2_dirs:\n  - /nvme0/ferry\n  - /nvme1/ferry\n"
        "l2_bytes: 2T\nl2_direct: false\nl2_engine: posix\n"
        "l1_policy: s3fifo\nl2_policy: lru\nwatermark: 0.9\nevict_fraction: 0.25\n"
        "write_ttl_ms: 1000\nread_ttl_ms: 2000\nprefetch_max_bytes: 256M\nworkers: 8\n"
        "l2_persistent: false\nremote_url: redis://cache:6379/0\nremote_index_chunks: 4K\n"
        "l2_reset: true\nl2_mode: 0660\nserver_timeout_ms: 3000\n"
        "socket: /run/ferry/a.sock\ngroup: ferry\nallow_uids: [1000, 4294967294]\n"
        "max_clients: 32\nsend_timeout_ms: 700\nmetrics: 127.0.0.1:9400\npool_wait_ms: 150\n";
    if (parse(&c, text) != 0)
        fail_msg("%s", g_err);
    assert_string_equal(c.kv.model, "my-model");
    assert_int_equal(c.kv.tp_rank, 1);
    assert_int_equal(c.kv.tp_world, 2);
    assert_int_equal(c.kv.chunk_tokens, 128);
    assert_true(c.kv.hash_seed == UINT64_MAX);
    assert_true(c.kv.l1_bytes == 3ull << 29);
    assert_int_equal(c.n_l2, 2);
    assert_string_equal(c.l2[0], "/nvme0/ferry");
    assert_string_equal(c.l2[1], "/nvme1/ferry");
    assert_true(c.kv.l2_bytes == 2ull << 40);
    assert_int_equal(c.kv.l2_direct, 0);
    assert_string_equal(c.kv.l2_engine, "posix");
    assert_int_equal(c.kv.l1_policy, FERRY_KV_EVICT_S3FIFO);
    assert_int_equal(c.kv.l2_policy, FERRY_KV_EVICT_LRU);
    assert_true(c.kv.watermark == 0.9 && c.kv.evict_fraction == 0.25);
    assert_int_equal(c.kv.write_ttl_ms, 1000);
    assert_int_equal(c.kv.read_ttl_ms, 2000);
    assert_true(c.kv.prefetch_max_bytes == 256ull << 20);
    assert_int_equal(c.kv.workers, 8);
    assert_int_equal(c.kv.l2_persistent, 0);
    assert_string_equal(c.kv.remote_url, "redis://cache:6379/0");
    assert_int_equal(c.kv.remote_index_chunks, 4096);
    assert_int_equal(c.kv.l2_reset, 1);
    assert_int_equal(c.kv.l2_mode, 0660);
    assert_int_equal(c.kv.server_timeout_ms, 3000);
    assert_int_equal(c.kv.pool_wait_ms, 150);
    assert_string_equal(c.socket, "/run/ferry/a.sock");
    assert_string_equal(c.group, "ferry");
    assert_int_equal(c.nallow, 2);
    assert_int_equal(c.allow[0], 1000);
    assert_int_equal(c.allow[1], 4294967294u);
    assert_int_equal(c.max_clients, 32);
    assert_int_equal(c.send_timeout_ms, 700);
    assert_string_equal(c.metrics, "127.0.0.1:9400");
    assert_string_equal(ferry__serve_conf_origin(&c, "l1_bytes"), "f.yaml:8:1");
    assert_string_equal(ferry__serve_conf_origin(&c, "socket"), "f.yaml:29:1");
    assert_string_equal(ferry__serve_conf_origin(&c, "group"), "f.yaml:30:1");
    assert_string_equal(ferry__serve_conf_origin(&c, "l2_dir"), ""); /* not given */
    ferry__serve_conf_free(&c);
}

static void a_plain_file_finishes(void **state)
{
    (void)state;
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    assert_int_equal(parse(&c, "model: tiny\nl1_bytes: 4M\nl2_dir: /x\nl2_bytes: 64M\n"), 0);
    assert_int_equal(ferry__serve_conf_finish(&c, g_err, sizeof g_err), 0);
    assert_int_equal(c.kv.layout.num_layers, 2);
    assert_string_equal(c.kv.l2_dir, "/x");
    assert_int_equal(c.kv.l2_persistent, 1);
    ferry__serve_conf_free(&c);
    /* the defaults alone, and an empty file, finish as llama3-8b */
    const char *empties[] = {"", "# only a comment\n", "~\n", "---\n...\n"};
    for (size_t i = 0; i < sizeof empties / sizeof *empties; i++) {
        ferry__serve_conf_init(&c);
        assert_int_equal(parse(&c, empties[i]), 0);
        assert_int_equal(ferry__serve_conf_finish(&c, g_err, sizeof g_err), 0);
        assert_string_equal(c.kv.model, "llama3-8b");
        assert_int_equal(c.kv.layout.num_layers, 32);
        assert_true(c.kv.l1_bytes == 2ull << 30);
        ferry__serve_conf_free(&c);
    }
    /* a layout's members in block style, dtype and kv defaulted */
    ferry__serve_conf_init(&c);
    assert_int_equal(parse(&c, "model: m\nlayout:\n  num_layers: 3\n  num_heads: 5\n"
                               "  head_dim: 7\n"), 0);
    assert_int_equal(ferry__serve_conf_finish(&c, g_err, sizeof g_err), 0);
    assert_int_equal(c.kv.layout.num_layers, 3);
    assert_int_equal(c.kv.layout.kv, 2);
    assert_int_equal(c.kv.layout.dtype, FERRY_DTYPE_BF16);
    ferry__serve_conf_free(&c);
}

static void every_mistake_names_its_place(void **state)
{
    (void)state;
    /* unknown keys, at the top and in layout */
    refused("model: tiny\nl1_byte: 4M\n", "f.yaml:2:1: l1_byte: unknown key", "accepted: ");
    refused("layout: {num_layers: 2, layers: 3}\n", "f.yaml:1:25: layout.layers: unknown",
            "num_layers");
    /* a key folded over lines holds line breaks: the message stays one line */
    refused("{model: ti, l2_b\n\n\nyte, x: 1}\n", "f.yaml:1:13: l2_b\\n\\nyte: unknown key",
            NULL);
    refused("layout: {num_la\n\nyers: 3}\n", "f.yaml:1:10: layout.num_la\\nyers: unknown member",
            NULL);
    /* wrong types */
    refused("model: [a, b]\n", "f.yaml:1:8: model: a list where a single value", NULL);
    refused("l1_bytes: {a: 1}\n", "f.yaml:1:11: l1_bytes: a mapping", NULL);
    refused("allow_uids: 1000\n", "f.yaml:1:13: allow_uids: a single value where a list", NULL);
    refused("l2_dirs: [[/a], /b]\n", "f.yaml:1:11: l2_dirs: a list inside the list", NULL);
    refused("layout: 3\n", "f.yaml:1:9: layout: not a mapping", NULL);
    refused("l2_direct: yes\n", "f.yaml:1:12: l2_direct: not a boolean", "true or false");
    refused("l1_policy: fifo\n", "f.yaml:1:12: l1_policy: unknown", "lru or s3fifo");
    refused("workers: -1\n", "f.yaml:1:10: workers: not a whole number", NULL);
    refused("workers: 1000\n", "f.yaml:1:10: workers: too large", "1..256");
    refused("watermark: 1.5\n", "f.yaml:1:12: watermark: out of range", NULL);
    refused("l2_mode: 0777\n", "f.yaml:1:10: l2_mode: only read and write bits", NULL);
    refused("l2_mode: 600\n", "f.yaml:1:10: l2_mode: not an octal mode", NULL);
    refused("metrics: localhost\n", "f.yaml:1:10: metrics: not an address", NULL);
    refused("layout: {num_layers: 2, dtype: f17}\n", "f.yaml:1:32: layout.dtype: unknown dtype",
            "bf16");
    /* bad sizes: the flags' grammar and ranges */
    refused("l1_bytes: 4Q\n", "f.yaml:1:11: l1_bytes: trailing characters", "a size 4K..16T");
    refused("l1_bytes: 0x100\n", "f.yaml:1:11: l1_bytes: hexadecimal", NULL);
    refused("l1_bytes: 1K\n", "f.yaml:1:11: l1_bytes: too small", NULL);
    refused("l2_bytes: 99999999999999999999T\n", "f.yaml:1:11: l2_bytes: too large", NULL);
    refused("l1_bytes: 1.0000001G\n", "f.yaml:1:11: l1_bytes: more than 6 decimals", NULL);
    /* duplicates */
    refused("socket: /a\nmodel: x\nsocket: /b\n", "f.yaml:3:1: socket: a duplicate key", NULL);
    refused("layout: {kv: 2, kv: 1}\n", "f.yaml:1:17: layout.kv: a duplicate key", NULL);
    refused("l2_dir: /a\nl2_dirs: [/b]\n", "f.yaml:2:1: l2_dirs: l2_dir and l2_dirs", NULL);
    refused("l2_dirs: [/a, /b, /a]\n", "f.yaml:1:19: l2_dirs: the same directory twice", NULL);
    /* not YAML, or YAML this file does not take */
    refused("model: tiny\n  l1: [\n", "f.yaml:2:5: not valid YAML", NULL);
    refused("model: \"open\n", "f.yaml:", "not valid YAML");
    refused("---\nmodel: tiny\n---\nmodel: tiny\n", "f.yaml:3:1: the file: a second document",
            NULL);
    refused("- a\n- b\n", "f.yaml:1:1: the file: not a mapping", NULL);
    refused("? [a]\n: 1\n", "f.yaml:1:3: a key: not a plain name", NULL);
    refused("model: &m tiny\n", "f.yaml:1:8: &anchor: anchors are not accepted", NULL);
    refused("group: *g\n", "f.yaml:1:8: *alias: aliases are not accepted", NULL);
    refused("l1_bytes: !!int 4096\n", "f.yaml:1:11: !tag: tags are not accepted", NULL);
    refused("socket:\n", "f.yaml:1:8: socket: no value", NULL);
    refused("socket: ~\n", "f.yaml:1:9: socket: no value", NULL);
    /* a URL is judged, never echoed (it may hold a password) */
    refused("remote_url: http://user:hunter2@cache/0\n", "f.yaml:1:13: remote_url: not a URL",
            NULL);
    assert_null(strstr(g_err, "hunter2"));
}

static void finishing_checks_what_no_key_shows(void **state)
{
    (void)state;
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    assert_int_equal(parse(&c, "model: my-model\n"), 0);
    assert_int_equal(ferry__serve_conf_finish(&c, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "f.yaml:1:1: model my-model: not a model ferry knows"));
    ferry__serve_conf_free(&c);
    ferry__serve_conf_init(&c);
    assert_int_equal(parse(&c, "model: m\nlayout: {num_layers: 2, head_dim: 64}\n"), 0);
    assert_int_equal(ferry__serve_conf_finish(&c, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "f.yaml:2:1: layout: give num_layers, num_heads and head_dim"));
    ferry__serve_conf_free(&c);
    ferry__serve_conf_init(&c);
    assert_int_equal(parse(&c, "l2_dirs: [/a, /b]\nl2_bytes: 2T\n"), 0);
    assert_int_equal(ferry__serve_conf_finish(&c, g_err, sizeof g_err), 0);
    assert_null(c.kv.l2_dir);
    assert_int_equal(c.kv.l2_n_dirs, 2);
    assert_string_equal(c.kv.l2_dirs[1], "/b");
    assert_true(c.kv.l2_bytes == 2ull << 40); /* on each */
    ferry__serve_conf_free(&c);
    ferry__serve_conf_init(&c);
    assert_int_equal(parse(&c, "l2_dir: /x\n"), 0);
    assert_int_equal(ferry__serve_conf_finish(&c, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "f.yaml:1:1: the L2 directories need l2_bytes"));
    ferry__serve_conf_free(&c);
}

static void the_environment_overrides_the_file(void **state)
{
    (void)state;
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    assert_int_equal(parse(&c, "l1_bytes: 1G\nsocket: /file.sock\nl2_dirs: [/a, /b]\n"
                               "l2_bytes: 1G\nallow_uids: [5]\nworkers: 3\n"),
                     0);
    setenv("FERRY_L1_BYTES", "8G", 1);
    setenv("FERRY_SOCKET", "/env.sock", 1);
    setenv("FERRY_L2_DIR", "/c", 1);
    setenv("FERRY_ALLOW_UIDS", "7,8,9", 1);
    assert_int_equal(ferry__serve_conf_env(&c, g_err, sizeof g_err), 0);
    assert_true(c.kv.l1_bytes == 8ull << 30);
    assert_string_equal(c.socket, "/env.sock");
    assert_int_equal(c.n_l2, 1); /* replaced whole, not merged */
    assert_string_equal(c.l2[0], "/c");
    assert_int_equal(c.nallow, 3);
    assert_int_equal(c.allow[2], 9);
    assert_int_equal(c.kv.workers, 3); /* not in the environment: the file's */
    assert_string_equal(ferry__serve_conf_origin(&c, "l1_bytes"), "FERRY_L1_BYTES");
    assert_string_equal(ferry__serve_conf_origin(&c, "l2_dirs"), "");
    assert_string_equal(ferry__serve_conf_origin(&c, "workers"), "f.yaml:6:1");
    assert_int_equal(ferry__serve_conf_finish(&c, g_err, sizeof g_err), 0);
    assert_string_equal(c.kv.l2_dir, "/c");
    ferry__serve_conf_free(&c);
    unsetenv("FERRY_L2_DIR");
    unsetenv("FERRY_ALLOW_UIDS");
    unsetenv("FERRY_SOCKET");
    /* a bad variable is refused by name, like a bad key */
    setenv("FERRY_L1_BYTES", "lots", 1);
    ferry__serve_conf_init(&c);
    assert_int_equal(ferry__serve_conf_env(&c, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "FERRY_L1_BYTES=lots: not a number; accepted: a size"));
    ferry__serve_conf_free(&c);
    unsetenv("FERRY_L1_BYTES");
    setenv("FERRY_L2_DIRS", "/a,/a", 1);
    ferry__serve_conf_init(&c);
    assert_int_equal(ferry__serve_conf_env(&c, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "FERRY_L2_DIRS=/a,/a: the same directory twice"));
    ferry__serve_conf_free(&c);
    setenv("FERRY_L2_DIR", "/b", 1);
    setenv("FERRY_L2_DIRS", "/a,/c", 1);
    ferry__serve_conf_init(&c);
    assert_int_equal(ferry__serve_conf_env(&c, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "both set"));
    ferry__serve_conf_free(&c);
    unsetenv("FERRY_L2_DIR");
    unsetenv("FERRY_L2_DIRS");
    setenv("FERRY_REMOTE_URL", "redis://u:hunter2@", 1);
    ferry__serve_conf_init(&c);
    assert_int_equal(ferry__serve_conf_env(&c, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "FERRY_REMOTE_URL: not a URL"));
    assert_null(strstr(g_err, "hunter2"));
    ferry__serve_conf_free(&c);
    unsetenv("FERRY_REMOTE_URL");
}

static void files_are_read_whole_or_refused(void **state)
{
    (void)state;
    char dir[256], path[320];
    ft_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/ferry.yaml", dir);
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    assert_int_equal(ferry__serve_conf_load(&c, path, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "cannot read it"));
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("model: tiny\nworkers: 4\n", f);
    fclose(f);
    assert_int_equal(ferry__serve_conf_load(&c, path, g_err, sizeof g_err), 0);
    assert_int_equal(c.kv.workers, 4);
    f = fopen(path, "w");
    for (unsigned i = 0; i < FERRY__SERVE_CONF_FILE_MAX / 8 + 1; i++)
        fputs("#comment", f);
    fclose(f);
    assert_int_equal(ferry__serve_conf_load(&c, path, g_err, sizeof g_err), -1);
    assert_non_null(strstr(g_err, "larger than"));
    ferry__serve_conf_free(&c);
    ft_rmtree(dir);
}

/* the public loader: the same reader, a config ferry_serve_open takes */
static void the_library_loads_a_file_for_an_embedded_daemon(void **state)
{
    (void)state;
    char dir[256], path[300], sock[300];
    assert_non_null(ft_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/ferry.yaml", dir);
    snprintf(sock, sizeof sock, "%s/ferry.sock", dir);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fprintf(fp, "model: tiny\nl1_bytes: 16M\nchunk_tokens: 16\nsocket: %s\n"
                "max_clients: 7\npool_wait_ms: 120\nmetrics: 127.0.0.1:9401\n", sock);
    fclose(fp);
    ferry_serve_file *f = NULL;
    FT_ASSERT_OK(ferry_serve_file_load(path, 0, &f));
    const ferry_serve_config *sc = ferry_serve_file_config(f);
    assert_string_equal(sc->socket_path, sock);
    assert_int_equal(sc->max_clients, 7);
    assert_int_equal(sc->kv->pool_wait_ms, 120);
    assert_true(sc->kv->l1_bytes == 16u << 20);
    assert_string_equal(ferry_serve_file_metrics(f), "127.0.0.1:9401");
    ferry_serve *srv = NULL;
    FT_ASSERT_OK(ferry_serve_open(sc, &srv));
    assert_int_equal(ferry_kv_chunk_tokens(ferry_serve_kv(srv)), 16);
    assert_int_equal(ferry_serve_close(srv), 0);
    ferry_serve_file_free(f);
    /* a mistake names its place; a missing file is -ENOENT */
    fp = fopen(path, "w");
    assert_non_null(fp);
    fputs("model: tiny\nl1_bytes: lots\n", fp);
    fclose(fp);
    f = NULL;
    assert_int_equal(ferry_serve_file_load(path, 0, &f), -EINVAL);
    assert_null(f);
    assert_non_null(strstr(ferry_last_error(), "ferry.yaml:2:11: l1_bytes"));
    snprintf(path, sizeof path, "%s/none.yaml", dir);
    assert_int_equal(ferry_serve_file_load(path, 0, &f), -ENOENT);
    assert_int_equal(ferry_serve_file_load(NULL, 0, &f), -EINVAL);
    ferry_serve_file_free(NULL);
    ft_rmtree(dir);
}

/* what `ferry serve --config` refuses in a daemon's file the library's
 * loader refuses too, with the CLI's message: a client's keys (server,
 * server_timeout_ms, from the file or the environment) and an allowed uid
 * other than root without a group (the socket would be 0600); with a
 * group, or uid 0 alone, the file loads */
static void the_library_refuses_what_the_cli_refuses(void **state)
{
    (void)state;
    char dir[256], path[300];
    assert_non_null(ft_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/ferry.yaml", dir);
    static const struct {
        const char *extra, *why;
    } bad[] = {
        {"server_timeout_ms: 3000\n",
         "ferry.yaml:3:1: server_timeout_ms: a client's key (how long an engine waits for "
         "the daemon); accepted: no server_timeout_ms (set it in the engines' config)"},
        {"server: /run/ferry/other.sock\n",
         "ferry.yaml:3:1: server: a client's key; accepted: no server (the daemon hosts the "
         "store itself)"},
        {"allow_uids: [0, 1234]\n",
         "ferry.yaml:3:1: uid 1234 cannot reach the socket without a group (it is 0600); "
         "accepted: a group uid 1234 is in too (--group NAME, or group: NAME; the socket is "
         "then 0660)"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        FILE *fp = fopen(path, "w");
        assert_non_null(fp);
        fprintf(fp, "model: tiny\nl1_bytes: 4M\n%s", bad[i].extra);
        fclose(fp);
        ferry_serve_file *f = NULL;
        int rc = ferry_serve_file_load(path, 0, &f);
        if (rc != -EINVAL || f || !strstr(ferry_last_error(), bad[i].why))
            fail_msg("%s: %d, '%s'", bad[i].extra, rc, ferry_last_error());
    }
    /* from the environment: its variable named */
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fputs("model: tiny\nl1_bytes: 4M\n", fp);
    fclose(fp);
    ferry_serve_file *f = NULL;
    setenv("FERRY_SERVER_TIMEOUT_MS", "3000", 1);
    int rc = ferry_serve_file_load(path, 1, &f);
    unsetenv("FERRY_SERVER_TIMEOUT_MS");
    if (rc != -EINVAL || f ||
        !strstr(ferry_last_error(), "FERRY_SERVER_TIMEOUT_MS: server_timeout_ms: a client's"))
        fail_msg("FERRY_SERVER_TIMEOUT_MS: %d, '%s'", rc, ferry_last_error());
    /* what the CLI takes, the library takes */
    static const char *const good[] = {"allow_uids: [1234]\ngroup: ferry\n", "allow_uids: [0]\n"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        fp = fopen(path, "w");
        assert_non_null(fp);
        fprintf(fp, "model: tiny\nl1_bytes: 4M\n%s", good[i]);
        fclose(fp);
        f = NULL;
        if (ferry_serve_file_load(path, 0, &f) != 0)
            fail_msg("%s: %s", good[i], ferry_last_error());
        assert_int_equal(ferry_serve_file_config(f)->n_allow_uids, 1);
        ferry_serve_file_free(f);
    }
    ft_rmtree(dir);
}

/* the file's socket reads for an embedded daemon as `ferry serve` reads
 * it: unix:PATH is PATH (a client's server string names the same
 * socket), another scheme is refused naming its place; neither is taken
 * for a file of that name */
static void an_embedded_daemons_socket_reads_as_the_clis(void **state)
{
    (void)state;
    char dir[256], path[300], sock[300];
    assert_non_null(ft_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/ferry.yaml", dir);
    snprintf(sock, sizeof sock, "%s/ferry.sock", dir);
    static const char *const forms[] = {"unix:", "unix://"};
    for (int i = 0; i < 2; i++) {
        FILE *fp = fopen(path, "w");
        assert_non_null(fp);
        fprintf(fp, "model: tiny\nl1_bytes: 4M\nchunk_tokens: 16\nsocket: %s%s\n", forms[i],
                sock);
        fclose(fp);
        ferry_serve_file *f = NULL;
        FT_ASSERT_OK(ferry_serve_file_load(path, 0, &f));
        const ferry_serve_config *sc = ferry_serve_file_config(f);
        assert_string_equal(sc->socket_path, sock);
        ferry_serve *srv = NULL;
        FT_ASSERT_OK(ferry_serve_open(sc, &srv));
        struct stat st;
        assert_int_equal(stat(sock, &st), 0);
        assert_true(S_ISSOCK(st.st_mode));
        assert_int_equal(ferry_serve_close(srv), 0);
        ferry_serve_file_free(f);
    }
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fputs("model: tiny\nl1_bytes: 4M\nsocket: tcp://127.0.0.1:9400\n", fp);
    fclose(fp);
    ferry_serve_file *f = NULL;
    assert_int_equal(ferry_serve_file_load(path, 0, &f), -EINVAL);
    assert_null(f);
    assert_non_null(strstr(ferry_last_error(), "ferry.yaml:3:1: socket tcp://127.0.0.1:9400: "));
    assert_non_null(strstr(ferry_last_error(), "accepted: unix:/path/to/ferry.sock"));
    ft_rmtree(dir);
}

int main(void)
{
    /* a developer's own FERRY_<KEY> must not change what these tests read */
    static const char *const keys[] = {"MODEL", "TP_", "CHUNK_", "HASH_", "L1_", "L2_",
                                       "WATERMARK", "EVICT_", "WRITE_", "READ_", "PREFETCH_",
                                       "WORKERS", "REMOTE_", "SERVER", "SOCKET", "GROUP",
                                       "ALLOW_", "MAX_", "SEND_", "METRICS"};
    for (int again = 1; again;) {
        again = 0;
        for (char **e = environ; *e && !again; e++) {
            for (size_t k = 0; k < sizeof keys / sizeof *keys && !again; k++) {
                if (strncmp(*e, "FERRY_", 6) || strncmp(*e + 6, keys[k], strlen(keys[k])))
                    continue;
                char name[128];
                snprintf(name, sizeof name, "%.*s", (int)strcspn(*e, "="), *e);
                unsetenv(name);
                again = 1;
            }
        }
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_key_is_read),
        cmocka_unit_test(the_library_loads_a_file_for_an_embedded_daemon),
        cmocka_unit_test(an_embedded_daemons_socket_reads_as_the_clis),
        cmocka_unit_test(the_library_refuses_what_the_cli_refuses),
        cmocka_unit_test(a_plain_file_finishes),
        cmocka_unit_test(every_mistake_names_its_place),
        cmocka_unit_test(finishing_checks_what_no_key_shows),
        cmocka_unit_test(the_environment_overrides_the_file),
        cmocka_unit_test(files_are_read_whole_or_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
