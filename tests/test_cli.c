/*
 * test_cli.c - the `ferry` command's answers to bad input, end to end:
 * every usage error of every subcommand is exit 2 with exactly one line on
 * stderr that names the flag and says what is accepted, and nothing on
 * stdout; failures are exit 1; a missing --dir is refused (and not
 * created) unless --create is given; --json prints exactly one JSON
 * document; `ferry <group> --help` prints the group's usage with exit 0.
 * Runs the ferry binary built next to this test (skipped when absent),
 * with tiny sizes so the whole file runs in seconds.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "ferry_test.h"

static char g_ferry[4096];
static char g_dir[256]; /* this run's scratch directory */

typedef struct run_out {
    int status;
    char out[1 << 16], err[1 << 14];
} run_out;

static void slurp(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t got = fread(buf, 1, n - 1, f);
    buf[got] = 0;
    fclose(f);
}

/* run ferry with args split on spaces ("@" stands for the scratch
 * directory, "@@" for '@'); stdout and stderr kept apart */
/* run_ferry with standard input from the file in (NULL: the test's own) */
static void run_ferry_in(const char *args, const char *in, run_out *r);
/* where set (>= 0), the next runs' standard input and output instead */
static int g_in_fd = -1, g_out_fd = -1;

static void run_ferry(const char *args, run_out *r)
{
    run_ferry_in(args, NULL, r);
}

static void run_ferry_in(const char *args, const char *in, run_out *r)
{
    char line[2048], *argv[64];
    int argc = 0;
    argv[argc++] = g_ferry;
    size_t off = 0;
    for (const char *p = args; *p && off + 300 < sizeof line; p++) {
        if (p[0] == '@' && p[1] == '@')
            line[off++] = *p++; /* "@@": a literal '@' */
        else if (*p == '@')
            off += (size_t)snprintf(line + off, sizeof line - off, "%s", g_dir);
        else
            line[off++] = *p;
    }
    line[off] = 0;
    for (char *tok = strtok(line, " "); tok && argc < 63; tok = strtok(NULL, " "))
        argv[argc++] = tok;
    argv[argc] = NULL;
    char po[320], pe[320];
    snprintf(po, sizeof po, "%s/.stdout", g_dir);
    snprintf(pe, sizeof pe, "%s/.stderr", g_dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fo = open(po, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fe = open(pe, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fi = in ? open(in, O_RDONLY) : 0;
        if (fo < 0 || fe < 0 || fi < 0)
            _exit(126);
        dup2(g_in_fd >= 0 ? g_in_fd : fi, 0);
        dup2(g_out_fd >= 0 ? g_out_fd : fo, 1);
        dup2(fe, 2);
        execv(g_ferry, argv);
        _exit(127);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    slurp(po, r->out, sizeof r->out);
    slurp(pe, r->err, sizeof r->err);
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* exit 2, nothing on stdout, one line on stderr: "ferry <cmd>: ..." (or
 * "ferry: ..." for no command) that holds each of the given pieces */
static void expect_usage(const char *args, const char *piece1, const char *piece2)
{
    run_out *r = malloc(sizeof *r);
    assert_non_null(r);
    run_ferry(args, r);
    if (r->status != 2 || count_lines(r->err) != 1 || r->out[0] ||
        strncmp(r->err, "ferry", 5) || (piece1 && !strstr(r->err, piece1)) ||
        (piece2 && !strstr(r->err, piece2)))
        fail_msg("ferry %s: exit %d, stdout '%.200s', stderr '%s' (want exit 2, one line with "
                 "'%s' and '%s')", args, r->status, r->out, r->err, piece1 ? piece1 : "",
                 piece2 ? piece2 : "");
    free(r);
}

static int exists(const char *rel)
{
    char p[512];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", g_dir, rel);
    return stat(p, &st) == 0;
}

static void the_issue_cases_are_usage_errors(void **state)
{
    (void)state;
    expect_usage("bench gds --size 0 --dir @", "--size 0", "accepted: ");
    expect_usage("kv bench --model tiny --dir @ --l2 0", "--l2 0", "accepted: ");
    expect_usage("bench gds --dir @/no/such/dir", "/no/such/dir: no such directory", "--create");
    assert_false(exists("no"));
    expect_usage("moe gen --tokens 0 -o @/t.jsonl", "--tokens 0", "accepted: a whole number 1..");
    expect_usage("moe gen --top-k 0 -o @/t.jsonl", "--top-k 0", "accepted: ");
    expect_usage("moe gen --tokens 99999999 -o @/t.jsonl", "--tokens 99999999", "too large");
    assert_false(exists("t.jsonl"));
    expect_usage("bench io --chunk 1G --size 64M --dir @", "--chunk 1G", "--size 64M");
    expect_usage("bench io --size 0x100000 --dir @", "--size 0x100000", "hexadecimal");
    /* a lowercase b is bits to many: refused with the byte spellings (it
     * read as bytes: --size 64Gb ran a 64 GiB benchmark) */
    /* (each then refused for its --depth 0 if the size were taken) */
    expect_usage("bench io --size 64Gb --depth 0 --dir @", "--size 64Gb", "bits");
    expect_usage("bench io --chunk 8Mb --depth 0 --dir @", "--chunk 8Mb", "64G, 64GiB or 64GB");
    expect_usage("bench gds --size 1kb --depth 0 --dir @", "--size 1kb", "bits");
    expect_usage("bench io --size 4096b --depth 0 --dir @", "--size 4096b", "4096 or 4096B");
    expect_usage("bench io --size 8GB --depth 0 --dir @", "--depth 0", NULL);
    expect_usage("bench io --size 8GiB --depth 0 --dir @", "--depth 0", NULL);
    expect_usage("moe bench --row-bytes 99999T", "--row-bytes 99999T", "accepted: ");
}

static void every_subcommand_refuses_alike(void **state)
{
    (void)state;
    static const struct {
        const char *args, *piece;
    } cases[] = {
        /* unknown options and missing values, one per subcommand */
        {"info --bogus", "--bogus"},
        {"info --dir", "--dir"},
        {"bench io --bogus", "--bogus"},
        {"bench io --chunk", "--chunk"},
        {"bench gds --bogus", "--bogus"},
        {"bench gds --depth", "--depth"},
        {"bench remote --bogus", "--bogus"},
        {"bench remote --value", "--value"},
        {"kv bench --bogus", "--bogus"},
        {"kv bench --docs", "--docs"},
        {"moe gen --bogus", "--bogus"},
        {"moe gen --seed", "--seed"},
        {"moe replay --bogus", "--bogus"},
        {"moe replay @/x --slots", "--slots"},
        {"moe bench --bogus", "--bogus"},
        {"moe bench --row-bytes", "--row-bytes"},
        /* trailing junk, zero, overflow, range, choices */
        {"bench io --size 4Kx --dir @", "--size 4Kx"},
        {"bench io --depth 0 --dir @", "--depth 0"},
        {"bench io --depth 4097 --dir @", "--depth 4097"},
        {"bench io --chunk 5000 --dir @", "--chunk 5000"},
        {"bench io --engine nope --dir @", "--engine nope"},
        {"bench io --device tpu --dir @", "--device tpu"},
        {"bench io --size 99999999999999999999999 --dir @", "too large"},
        {"bench gds --depth 65 --dir @", "--depth 65"},
        {"bench gds --rounds 0 --dir @", "--rounds 0"},
        {"bench gds --stripe 0 --dir @", "--stripe 0"},
        {"bench gds --size 12M --chunk 8M --dir @", "--size 12M"},
        {"bench gds --driver warp --dir @", "--driver warp"},
        {"bench remote --url redis://127.0.0.1:1/0 --clients 0", "--clients 0"},
        {"bench remote --url redis://127.0.0.1:1/0 --count 1.5", "--count 1.5"},
        {"kv bench --l2 8M", "--l2 8M"},
        {"kv bench --layers 0", "--layers 0"},
        {"kv bench --zipf nan", "--zipf nan"},
        {"kv bench --zipf 1e3", "--zipf 1e3"},
        {"kv bench --seed 12x", "--seed 12x"},
        {"kv bench --model gpt5", "--model gpt5"},
        {"kv bench --policy mru", "--policy mru"},
        {"kv bench --persist-rounds 65", "--persist-rounds 65"},
        {"kv bench --model tiny --l1 4K", "--l1 4K"},
        {"kv bench --model tiny --dir @ --l2 8K", "--l2 8K"},
        {"kv bench --paged 0", "--paged 0"},
        {"kv bench --paged 65537", "--paged 65537"},
        {"kv bench --device tpu", "--device tpu"},
        {"moe gen --model huge -o @/t.jsonl", "--model huge"},
        {"moe gen --model small --top-k 17 -o @/t.jsonl", "--top-k 17"},
        {"moe gen --layers 1025 -o @/t.jsonl", "--layers 1025"},
        {"moe gen --model small", "-o FILE"},
        {"moe replay @/x --policy fifo", "--policy fifo"},
        {"moe replay @/x --expert-bytes 0", "--expert-bytes 0"},
        {"moe replay @/x --sweep --policies lru,nope", "--policies lru,nope"},
        {"moe replay @/x --budgets 25%", "--budgets"},
        {"moe replay", "TRACE"},
        {"moe sim", "TRACE"},
        {"moe sim @/x --policies lru,nope", "--policies lru,nope"},
        {"moe sim @/x --hint-accuracy 2", "--hint-accuracy 2"},
        {"moe sim @/x --compute-us 0", "--compute-us 0"},
        {"moe sim @/x --model huge", "--model huge"},
        {"moe bench --row-bytes 0", "--row-bytes 0"},
        {"moe bench --device tpu", "--device tpu"},
        {"moe bench --tokens 8", "--tokens 8"},
        {"moe bench --tokens 9000", "--tokens 9000"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_usage(cases[i].args, cases[i].piece, NULL);
}

static void replay_checks_slots_against_the_trace(void **state)
{
    (void)state;
    run_out *r = malloc(sizeof *r);
    assert_non_null(r);
    /* small: 4 layers x 16 experts */
    run_ferry("moe gen --model small --tokens 32 -o @/small.jsonl", r);
    assert_int_equal(r->status, 0);
    /* small: top-2, so one step's experts are 2 slots; never adjusted */
    expect_usage("moe replay @/small.jsonl --slots 0", "--slots 0", "accepted: a slot count 2..64");
    expect_usage("moe replay @/small.jsonl --slots 1", "--slots 1", "one step's 2 experts");
    expect_usage("moe replay @/small.jsonl --slots 1%", "1 slots, fewer than one step's 2",
                 "3.12% is the least");
    expect_usage("moe replay @/small.jsonl --slots 65", "--slots 65", "accepted: ");
    expect_usage("moe replay @/small.jsonl --slots 0%", "--slots 0%", "accepted: ");
    expect_usage("moe replay @/small.jsonl --slots 101%", "--slots 101%", "accepted: ");
    expect_usage("moe replay @/small.jsonl --sweep --budgets 25%,,50%", "--budgets", "accepted: ");
    run_ferry("moe replay @/small.jsonl --slots 16", r);
    assert_int_equal(r->status, 0);
    /* the default policy is auto, in replay and in the timeline (next to lru) */
    run_ferry("moe replay @/small.jsonl --slots 16 --json", r);
    assert_int_equal(r->status, 0);
    assert_non_null(strstr(r->out, "{\"policy\":\"auto\","));
    run_ferry("moe sim @/small.jsonl --expert-bytes 1M --json", r);
    assert_int_equal(r->status, 0);
    assert_non_null(strstr(r->out, "\"policy\":\"lru\","));
    assert_non_null(strstr(r->out, "\"policy\":\"auto+hints\","));
    assert_null(strstr(r->out, "\"policy\":\"routing\","));
    /* below a layer: P% of 4 x 16 is what the JSON says was used */
    run_ferry("moe replay @/small.jsonl --slots 6.25% --json", r);
    assert_int_equal(r->status, 0);
    assert_non_null(strstr(r->out, "\"slots\":4,"));
    assert_non_null(strstr(r->out, "\"layers\":4,"));
    free(r);
}

/* exit 1 and one line for what fails at run time */
static void failures_exit_1_with_one_line(void **state)
{
    (void)state;
    run_out *r = malloc(sizeof *r);
    assert_non_null(r);
    run_ferry("moe replay /dev/zero", r);
    assert_int_equal(r->status, 1);
    assert_int_equal(count_lines(r->err), 1);
    assert_non_null(strstr(r->err, "not a regular file"));
    run_ferry("moe replay @/missing.jsonl", r);
    assert_int_equal(r->status, 1);
    assert_int_equal(count_lines(r->err), 1);
    assert_non_null(strstr(r->err, "missing.jsonl"));
    /* a remote that cannot be reached: a failure, and its password is
     * never printed, on either stream */
    run_ferry("kv bench --docs 1 --doc-tokens 512 --questions 1 --l1 256M --no-refs "
              "--remote redis://:s3kr1t-pw@@127.0.0.1:1/0", r);
    assert_int_equal(r->status, 1);
    assert_null(strstr(r->out, "s3kr1t-pw"));
    assert_null(strstr(r->err, "s3kr1t-pw"));
    assert_non_null(strstr(r->out, "redis://:***@127.0.0.1:1/0"));
    free(r);
}

static void missing_directories_need_create(void **state)
{
    (void)state;
    run_out *r = malloc(sizeof *r);
    assert_non_null(r);
    expect_usage("bench io --size 64K --chunk 64K --dir @/a/b", "/a/b: no such directory",
                 "--create");
    expect_usage("info --dir @/c", "--create", NULL);
    expect_usage("kv bench --model tiny --dir @/d --l2 1M", "--create", NULL);
    assert_false(exists("a"));
    assert_false(exists("c"));
    assert_false(exists("d"));
    run_ferry("bench io --size 64K --chunk 64K --depth 1 --engine posix --dir @/a/b --create", r);
    if (r->status != 0)
        fail_msg("bench io --create: exit %d: %s", r->status, r->err);
    char p[512];
    struct stat st;
    snprintf(p, sizeof p, "%s/a/b", g_dir);
    assert_int_equal(stat(p, &st), 0);
    assert_true(S_ISDIR(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0700);
    /* a file where a directory should be is not one */
    snprintf(p, sizeof p, "%s/file", g_dir);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fclose(f);
    expect_usage("bench io --dir @/file --create", "not a directory", NULL);
    /* more in flight than one bounce segment may hold (1 GiB) is fine
     * without a device: there is no bounce path then */
    run_ferry("bench io --size 64M --chunk 64M --depth 17 --engine posix --dir @", r);
    if (r->status != 0)
        fail_msg("bench io 1.06 GiB in flight: exit %d: %s", r->status, r->err);
    free(r);
}

/* stdout is exactly one JSON document (jansson refuses trailing text) */
static json_t *one_document(const char *args, run_out *r)
{
    run_ferry(args, r);
    if (r->status != 0)
        fail_msg("ferry %s: exit %d: %s", args, r->status, r->err);
    json_error_t je;
    json_t *j = json_loads(r->out, 0, &je);
    if (!j)
        fail_msg("ferry %s: not one JSON document (%s at line %d): %.300s", args, je.text,
                 je.line, r->out);
    return j;
}

static void json_is_one_document(void **state)
{
    (void)state;
    run_out *r = malloc(sizeof *r);
    assert_non_null(r);
    json_t *j = one_document(
        "bench io --engine all --size 128K --chunk 64K --depth 2 --dir @ --json", r);
    assert_true(json_is_object(j));
    json_t *res = json_object_get(j, "results");
    assert_true(json_is_array(res));
    assert_int_equal(json_array_size(res), 3); /* posix, uring, cufile: each ran or says why */
    json_decref(j);

    j = one_document("bench io --engine posix --sweep --size 128K --depth 2 --dir @ --json", r);
    res = json_object_get(j, "results");
    assert_int_equal(json_array_size(res), 2); /* 64K and 128K chunks */
    assert_int_equal(json_integer_value(json_object_get(json_array_get(res, 1), "chunk_bytes")),
                     128 << 10);
    json_decref(j);

    /* one engine, one chunk: the run's object itself (bench/vs_fio.sh reads it) */
    j = one_document("bench io --engine posix --size 64K --chunk 64K --depth 1 --dir @ --json", r);
    assert_non_null(json_object_get(j, "write"));
    json_decref(j);

    j = one_document("moe gen --model small --tokens 16 --json -o @/j.jsonl", r);
    assert_true(json_is_object(j));
    json_decref(j);
    j = one_document("moe replay @/j.jsonl --sweep --budgets 25%,50% --policies lru,belady --json",
                     r);
    assert_true(json_is_array(j));
    assert_int_equal(json_array_size(j), 4);
    json_decref(j);
    /* the timeline: per budget lru, lru with hints, then the two bounds */
    j = one_document("moe sim @/j.jsonl --budgets 25%,50% --policies lru --json", r);
    assert_true(json_is_array(j));
    assert_int_equal(json_array_size(j), 8);
    assert_true(json_is_true(json_object_get(json_array_get(j, 1), "hints")));
    assert_int_equal(json_integer_value(json_object_get(json_array_get(j, 0), "layers")), 4);
    json_decref(j);
    j = one_document("info --json --dir @", r);
    assert_true(json_is_object(j));
    json_decref(j);

    /* the engine buffer in (host-backend) device memory, paged in 16-token blocks */
    j = one_document("kv bench --model tiny --docs 2 --doc-tokens 512 --questions 4 --l1 4M "
                     "--device host --paged 16 --no-refs --json", r);
    assert_string_equal(json_string_value(json_object_get(j, "buffer_mem")), "device");
    assert_string_equal(json_string_value(json_object_get(j, "device")), "host");
    assert_string_equal(json_string_value(json_object_get(j, "buffer_form")), "paged");
    assert_int_equal(json_integer_value(json_object_get(j, "block_tokens")), 16);
    assert_true(json_real_value(json_object_get(j, "hit_rate")) > 0);
    json_decref(j);
    j = one_document("moe bench --quick --row-bytes 64K --device host --json", r);
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(j, "executor"), "device")), "host");
    json_decref(j);
    /* --tokens sets the trace: each policy's steps, filling and full, are
     * its 128 tokens x 58 layers */
    j = one_document("moe bench --tokens 128 --row-bytes 64K --json", r);
    json_t *pl = json_object_get(j, "planner");
    assert_true(json_array_size(pl) > 0);
    for (size_t i = 0; i < json_array_size(pl); i++) {
        json_t *e = json_array_get(pl, i);
        assert_int_equal(json_integer_value(json_object_get(e, "fill_steps")) +
                             json_integer_value(json_object_get(e, "steady_steps")),
                         128 * 58);
    }
    json_decref(j);
    free(r);
}

/* the product prints measurements; what they are judged against lives in
 * bench/ scripts and the README */
static void benches_print_no_targets(void **state)
{
    (void)state;
    run_out *r = malloc(sizeof *r);
    assert_non_null(r);
    static const char *const runs[] = {
        "kv bench --model tiny --docs 2 --doc-tokens 512 --questions 4 --l1 4M --dir @ --l2 4M",
        "bench gds --size 8M --chunk 1M --rounds 1 --alloc-ops 1000 --dir @",
        "bench io --size 1M --chunk 256K --dir @",
        "moe bench --quick --row-bytes 64K",
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        run_ferry(runs[i], r);
        assert_int_equal(r->status, 0);
        assert_null(strstr(r->out, "target"));
        assert_null(strstr(r->err, "target"));
    }
    free(r);
}

static void group_help_exits_0(void **state)
{
    (void)state;
    run_out *r = malloc(sizeof *r);
    assert_non_null(r);
    static const char *const groups[] = {"kv", "bench", "moe", "slab"};
    for (size_t i = 0; i < 4; i++) {
        char args[64], want[64];
        snprintf(want, sizeof want, "usage: ferry %s <command>", groups[i]);
        for (int h = 0; h < 2; h++) {
            snprintf(args, sizeof args, "%s %s", groups[i], h ? "-h" : "--help");
            run_ferry(args, r);
            if (r->status != 0 || !strstr(r->out, want) || r->err[0])
                fail_msg("ferry %s: exit %d, stdout '%s', stderr '%s'", args, r->status, r->out,
                         r->err);
        }
        /* the group alone: usage on stderr, exit 2 */
        run_ferry(groups[i], r);
        assert_int_equal(r->status, 2);
        assert_non_null(strstr(r->err, want));
        assert_string_equal(r->out, "");
        /* an unknown command of the group: one line naming the group's commands */
        snprintf(args, sizeof args, "%s nope", groups[i]);
        expect_usage(args, "nope", "accepted:");
    }
    run_ferry("kv --help", r);
    assert_non_null(strstr(r->out, "kv bench"));
    run_ferry("slab --help", r);
    assert_non_null(strstr(r->out, "slab check"));
    /* every subcommand's own --help, exit 0 on stdout */
    static const char *const cmds[] = {"info",      "bench io",   "bench gds", "bench remote",
                                       "kv bench",  "moe gen",    "moe replay", "moe bench",
                                       "moe sim"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char args[64];
        snprintf(args, sizeof args, "%s --help", cmds[i]);
        run_ferry(args, r);
        if (r->status != 0 || !strstr(r->out, "usage: ferry") || r->err[0])
            fail_msg("ferry %s: exit %d, stderr '%s'", args, r->status, r->err);
    }
    expect_usage("nosuch", "nosuch", NULL);
    free(r);
}

/* what README's "The command" shows a newcomer, option for option: each
 * works, or is refused in one line, never ignored */
static void the_readmes_options_do_what_it_says(void **state)
{
    (void)state;
    static run_out r_;
    run_out *r = &r_;
    /* moe sim --hints made|trace: the trace's own predictions as hints
     * (was an unknown option though the synopsis and --help showed it) */
    char p[512];
    snprintf(p, sizeof p, "%s/pred.jsonl", g_dir);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fprintf(f, "{\"model\":\"m\",\"num_layers\":2,\"num_experts\":8,\"top_k\":2,"
               "\"expert_bytes\":4096}\n");
    for (int t = 0; t < 64; t++)
        for (int l = 0; l < 2; l++) { /* every prediction wrong: 6 and 7 are never routed */
            int e1 = (t * 3 + l) % 6, e2 = (e1 + 1 + t % 5) % 6;
            fprintf(f, "{\"token\":%d,\"layer\":%d,\"experts\":[%d,%d],\"pred\":[6,7]}\n", t,
                    l, e1, e2);
        }
    fclose(f);
    const char *base = "moe sim @/pred.jsonl --budgets 4 --policies lru --hint-accuracy 1 --json";
    char args[400];
    static char made[sizeof r_.out];
    snprintf(args, sizeof args, "%s --hints made", base);
    run_ferry(args, r);
    if (r->status != 0)
        fail_msg("ferry %s: exit %d: %s", args, r->status, r->err);
    memcpy(made, r->out, sizeof made);
    snprintf(args, sizeof args, "%s --hints trace", base);
    run_ferry(args, r);
    if (r->status != 0)
        fail_msg("ferry %s: exit %d: %s", args, r->status, r->err);
    /* made hints at accuracy 1 are the routes; the trace's are all wrong */
    assert_string_not_equal(made, r->out);
    snprintf(args, sizeof args, "moe sim @/pred.jsonl --budgets 4 --hints trace");
    run_ferry(args, r);
    assert_int_equal(r->status, 0);
    assert_non_null(strstr(r->out, "from the trace's predictions"));
    expect_usage("moe sim @/pred.jsonl --hints guess", "--hints guess", "made or trace");
    expect_usage("moe sim @/pred.jsonl --hints", "--hints", "made or trace");
    run_ferry("moe gen --model small --tokens 16 -o @/nopred.jsonl", r);
    assert_int_equal(r->status, 0);
    expect_usage("moe sim @/nopred.jsonl --hints trace", "--hints trace", "no predictions");
    /* hints' options with no hints, the NVMe link with no experts there: ignored before */
    expect_usage("moe sim @/pred.jsonl --hints trace --hint-steps 0", "--hints",
                 "--hint-steps 0");
    expect_usage("moe sim @/pred.jsonl --hint-steps 0 --hint-accuracy 0.5", "--hint-accuracy",
                 "--hint-steps N");
    expect_usage("moe sim @/pred.jsonl --nvme-gbs 12", "--nvme-gbs 12", "--nvme-share");
    /* moe gen: no "top-32 cover 0.0%" for a model of fewer than 64 experts */
    assert_null(strstr(r->out, "top-32 cover"));
    run_ferry("moe gen --model small --tokens 16 --json -o @/nopred.jsonl", r);
    assert_non_null(strstr(r->out, "\"top32_cover\":null"));
    run_ferry("moe gen --model qwen3-30b-a3b --tokens 16 -o @/q.jsonl", r);
    assert_int_equal(r->status, 0);
    assert_non_null(strstr(r->out, "top-32 cover "));
    /* every subcommand's --help, the slab and serve ones too */
    static const char *const cmds[] = {"slab check", "slab reset", "slab bench", "serve",
                                       "serve status"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        snprintf(args, sizeof args, "%s --help", cmds[i]);
        run_ferry(args, r);
        if (r->status != 0 || !strstr(r->out, "usage: ferry") || r->err[0])
            fail_msg("ferry %s: exit %d, stderr '%s'", args, r->status, r->err);
        snprintf(args, sizeof args, "%s --bogus", cmds[i]);
        char want[64];
        snprintf(want, sizeof want, "see ferry %s --help", cmds[i]);
        expect_usage(args, "--bogus: unknown option", want);
    }
    run_ferry("--help", r);
    assert_non_null(strstr(r->out, "FERRY_DEVICE"));
    assert_non_null(strstr(r->out, "FERRY_KV_READ_DEPTH"));
    expect_usage("slab bench --dir @/none", "--dir", "no such directory");
    /* a device that cannot be opened is named once ("device cuda: device
     * cuda: ..." before) */
    run_ferry("bench io --size 64K --chunk 64K --engine posix --device cuda --dir @", r);
    if (r->status == 1) {
        assert_null(strstr(r->err, "device cuda: device cuda"));
        assert_non_null(strstr(r->err, "device cuda"));
    }
}

/* an option the run would ignore, or an output that could not be written
 * at the end of the work, is refused before anything runs */
static void options_that_would_be_ignored_are_refused(void **state)
{
    (void)state;
    expect_usage("kv bench --workload chat --questions 3", "--questions", "--workload qa");
    expect_usage("kv bench --workload chat --zipf 0.5", "--zipf", "--workload qa");
    expect_usage("kv bench --sessions 3", "--sessions", "--workload chat");
    expect_usage("kv bench --workload qa --turn-tokens 64", "--turn-tokens", "--workload chat");
    expect_usage("kv bench --clients 3", "--clients 3", "--server");
    /* the --cold figure is of the qa documents (a chat run read past its
     * prompts); --persist-rounds shapes --persistent's figure alone */
    expect_usage("kv bench --model tiny --workload chat --dir @ --cold 1", "--cold",
                 "--workload qa");
    expect_usage("kv bench --model tiny --persist-rounds 2", "--persist-rounds 2",
                 "--persistent");
    expect_usage("kv bench --model tiny --dir @ --cold 2 --layerwise 2", "--cold 2",
                 "--layerwise 2");
    /* --plot and -o in a directory that does not exist */
    expect_usage("bench io --sweep --size 128K --dir @ --plot @/none/x.png", "--plot",
                 "none: No such file or directory");
    expect_usage("kv bench --model tiny --plot @/none/x.png", "--plot", "none");
    expect_usage("moe gen --tokens 16 -o @/none/t.jsonl", "-o", "none");
    expect_usage("moe replay @/x --sweep --plot @/none/x.png", "--plot", "none");
    expect_usage("moe sim @/x --plot @/none/x.png", "--plot", "none");
    assert_false(exists("none"));
    /* serve: a group that does not exist, a remote URL ferry does not read:
     * usage errors naming the flag (an exit 1 from deep in the start before) */
    expect_usage("serve --socket @/g.sock --model tiny --l1 4M --group no-such-group-here",
                 "--group no-such-group-here", "no such group");
    expect_usage("serve --socket @/g.sock --model tiny --l1 4M --remote http://u:pw@@x",
                 "--remote", "unknown scheme");
    expect_usage("kv bench --model tiny --l1 4M --remote http://u:pw@@x", "--remote",
                 "unknown scheme");
    assert_false(exists("g.sock"));
    /* the persistence figure's progress line is for a terminal only */
    static run_out r_;
    run_out *r = &r_;
    run_ferry("kv bench --model tiny --docs 1 --doc-tokens 512 --questions 2 --l1 4M --no-refs "
              "--dir @/pc --create --l2 4M --persistent --persist-rounds 1", r);
    if (r->status != 0 || r->err[0])
        fail_msg("kv bench --persistent: exit %d, stderr '%s' (want 0 and nothing)", r->status,
                 r->err);
    assert_non_null(strstr(r->out, "persistence cost"));
}

/* --create makes the --dir directory; without --dir it would make
 * nothing (the default directory exists) and was silently ignored. And
 * --sweep runs --policies, so a --policy beside it would be ignored, as a
 * --slots beside it is refused */
static void create_without_dir_and_policy_with_sweep_are_refused(void **state)
{
    (void)state;
    static const char *const cmds[] = {"info", "bench io --size 64K --chunk 64K",
                                       "bench gds --size 1M --chunk 1M --rounds 1",
                                       "kv bench --model tiny --docs 1 --doc-tokens 256"};
    for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
        char args[160];
        snprintf(args, sizeof args, "%s --create", cmds[i]);
        expect_usage(args, "--create: it makes the --dir directory", "accepted: --dir DIR");
    }
    static run_out r_;
    run_ferry("moe gen --model small --tokens 16 -o @/pol.jsonl", &r_);
    assert_int_equal(r_.status, 0);
    expect_usage("moe replay @/pol.jsonl --sweep --policy lru", "--policy lru",
                 "--sweep takes --policies");
    run_ferry("moe replay @/pol.jsonl --sweep --budgets 25% --policies lru --json", &r_);
    assert_int_equal(r_.status, 0);
}

/* a TRACE of "-" is standard input (it was a file named "-"): the same
 * replay as of the file, and gen's "-o -" writes the trace there; moe sim's --model, which gives only the
 * expert bytes, is refused beside --expert-bytes (it was ignored) */
static void a_dash_trace_is_stdin_and_sim_takes_one_expert_size(void **state)
{
    (void)state;
    static run_out a, b;
    run_ferry("moe gen --model small --tokens 32 -o @/dash.jsonl", &a);
    assert_int_equal(a.status, 0);
    run_ferry("moe replay @/dash.jsonl --slots 25% --policy lru --json", &a);
    assert_int_equal(a.status, 0);
    char path[300];
    snprintf(path, sizeof path, "%s/dash.jsonl", g_dir);
    run_ferry_in("moe replay - --slots 25% --policy lru --json", path, &b);
    assert_int_equal(b.status, 0);
    assert_string_equal(a.out, b.out);
    run_ferry_in("moe sim - --budgets 25% --policies lru --expert-bytes 1M --json", path, &b);
    assert_int_equal(b.status, 0);
    /* and gen's "-o -": the trace on stdout (the file's bytes), its summary on stderr */
    run_ferry("moe gen --model small --tokens 32 -o -", &b);
    assert_int_equal(b.status, 0);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char want[1 << 16];
    size_t n = fread(want, 1, sizeof want - 1, f);
    fclose(f);
    want[n] = 0;
    assert_string_equal(b.out, want);
    assert_non_null(strstr(b.err, "small, 4 layers x 16 experts"));
    expect_usage("moe sim @/dash.jsonl --expert-bytes 1M --model mixtral-8x7b", "--model",
                 "accepted: one of the two");
}

/* the whole of the file at path into buf (n bytes at most, NUL-terminated) */
static size_t slurp_n(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t got = fread(buf, 1, n - 1, f);
    buf[got] = 0;
    fclose(f);
    return got;
}

/* "-" is the process's own standard input and output, whatever they are: a
 * socket (a service's, ssh's) works as a pipe does, and a file opened for
 * appending keeps what it held (opening /dev/stdout again truncated it, and
 * opening /dev/stdin or /dev/stdout of a socket failed with ENXIO) */
static void a_dash_is_the_descriptor_itself(void **state)
{
    (void)state;
    static run_out a, b;
    static char want[1 << 16], got[1 << 16];
    run_ferry("moe gen --model small --tokens 32 -o @/own.jsonl", &a);
    assert_int_equal(a.status, 0);
    char path[300];
    snprintf(path, sizeof path, "%s/own.jsonl", g_dir);
    size_t n = slurp_n(path, want, sizeof want);
    assert_true(n > 0 && n < 100000);

    /* stdout appending to a file of earlier bytes */
    char app[300];
    snprintf(app, sizeof app, "%s/appended.log", g_dir);
    FILE *f = fopen(app, "w");
    assert_non_null(f);
    fputs("earlier line\n", f);
    fclose(f);
    g_out_fd = open(app, O_WRONLY | O_APPEND);
    assert_true(g_out_fd >= 0);
    run_ferry("moe gen --model small --tokens 32 -o -", &b);
    close(g_out_fd);
    g_out_fd = -1;
    slurp_n(app, got, sizeof got);
    if (b.status != 0 || strncmp(got, "earlier line\n", 13) || strcmp(got + 13, want))
        fail_msg("gen -o - >> file: exit %d, '%s'; the file now begins '%.80s'", b.status, b.err,
                 got);

    /* stdout a socket */
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    g_out_fd = sv[1];
    run_ferry("moe gen --model small --tokens 32 -o -", &b);
    g_out_fd = -1;
    close(sv[1]);
    size_t m = 0;
    ssize_t k;
    while (m < sizeof got - 1 && (k = read(sv[0], got + m, sizeof got - 1 - m)) > 0)
        m += (size_t)k;
    got[m] = 0;
    close(sv[0]);
    if (b.status != 0 || strcmp(got, want))
        fail_msg("gen -o - to a socket: exit %d, '%s'; %zu bytes came", b.status, b.err, m);

    /* stdin a socket: the same replay as of the file */
    run_ferry("moe replay @/own.jsonl --slots 25% --policy lru --json", &a);
    assert_int_equal(a.status, 0);
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    assert_int_equal(write(sv[0], want, n), (ssize_t)n);
    shutdown(sv[0], SHUT_WR);
    g_in_fd = sv[1];
    run_ferry("moe replay - --slots 25% --policy lru --json", &b);
    g_in_fd = -1;
    close(sv[0]);
    close(sv[1]);
    if (b.status != 0 || strcmp(a.out, b.out))
        fail_msg("replay - from a socket: exit %d, '%s'", b.status, b.err);
}

/* GET path from 127.0.0.1:port: the whole response (status line first) */
static void http_get(int port, const char *path, char *out, size_t len)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: x\r\n\r\n", path);
    assert_int_equal(write(fd, req, (size_t)n), n);
    size_t got = 0;
    ssize_t r;
    while (got + 1 < len && (r = read(fd, out + got, len - 1 - got)) > 0)
        got += (size_t)r;
    out[got] = 0;
    close(fd);
}

/* ferry serve in the foreground: status answers, /metrics serves the
 * store's and the daemon's families, SIGTERM stops it cleanly (exit 0,
 * socket gone); bad flags are usage errors */
/* a loopback TCP port nobody listens on now: the kernel's pick for port 0 */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

static void serve_runs_and_stops_cleanly(void **state)
{
    (void)state;
    expect_usage("serve --metrics nonsense", "--metrics nonsense", "accepted: ");
    expect_usage("serve --l2 @", "--l2", "DIR:SIZE");
    expect_usage("serve --bogus", "--bogus", NULL);
    char sock[320], metrics[32];
    snprintf(sock, sizeof sock, "%s/serve.sock", g_dir);
    int port = free_port(); /* (a fixed guess may be some connection's source port) */
    snprintf(metrics, sizeof metrics, "127.0.0.1:%d", port);
    char log[340];
    snprintf(log, sizeof log, "%s/serve.log", g_dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 2);
        execl(g_ferry, g_ferry, "serve", "--socket", sock, "--model", "tiny", "--l1", "4M",
              "--metrics", metrics, (char *)NULL);
        _exit(127);
    }
    static run_out r_; /* (static: an assertion that fails leaks nothing) */
    run_out *r = &r_;
    char args[400];
    snprintf(args, sizeof args, "serve status --socket %s", sock);
    /* up to 60 s of wall time (a sanitizer build beside other tests starts
     * slowly); a daemon that exits instead is a failure with its log */
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        run_ferry(args, r);
        if (r->status == 0)
            break;
        int st = 0, gone = waitpid(pid, &st, WNOHANG) == pid;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (gone || now.tv_sec - t0.tv_sec > 60) {
            char text[4096];
            slurp(log, text, sizeof text);
            if (!gone)
                kill(pid, SIGKILL);
            fail_msg("ferry serve did not answer `serve status` (status %d: %s); its log: %s",
                     r->status, r->err, text);
        }
        usleep(20000);
    }
    /* the daemon's own counters too, read-ahead dropped among them; the
     * status query is not one of the clients it reports (none here) */
    if (!strstr(r->out, ": 0 clients besides this status,") || !strstr(r->out, "L1") ||
        !strstr(r->out, "\n  daemon ") || !strstr(r->out, " 0 read-ahead dropped")) {
        kill(pid, SIGKILL); /* (not left serving, holding the runner's output open) */
        fail_msg("serve status: '%s'", r->out);
    }
    /* the same daemon as unix:PATH (a failure below stops the daemon first) */
    snprintf(args, sizeof args, "serve status --socket unix:%s", sock);
    run_ferry(args, r);
    if (r->status != 0 || !strstr(r->out, "clients")) {
        kill(pid, SIGKILL);
        fail_msg("ferry %s: exit %d, stderr '%s'", args, r->status, r->err);
    }
    /* a second daemon on its socket, or on its metrics port: refused in one
     * line, and the first one serves on */
    for (int i = 0; i < 2; i++) {
        if (i)
            snprintf(args, sizeof args, "serve --socket %s.2 --model tiny --l1 4M --metrics %s",
                     sock, metrics);
        else
            snprintf(args, sizeof args, "serve --socket %s --model tiny --l1 4M", sock);
        run_ferry(args, r);
        if (r->status != 1 || count_lines(r->err) != 1 || strncmp(r->err, "ferry serve: ", 13) ||
            !strstr(r->err, i ? "Address already in use" : "already serving")) {
            kill(pid, SIGKILL);
            fail_msg("ferry %s: exit %d, stderr '%s' (want exit 1 and one line)", args,
                     r->status, r->err);
        }
    }
    snprintf(args, sizeof args, "serve status --socket %s", sock);
    run_ferry(args, r);
    if (r->status != 0) {
        kill(pid, SIGKILL);
        fail_msg("the first daemon stopped answering after the refused ones: %s", r->err);
    }
    static char resp[1 << 16];
    http_get(port, "/metrics", resp, sizeof resp);
    assert_non_null(strstr(resp, "200 OK"));
    assert_non_null(strstr(resp, "ferry_kv_lookups_total"));
    assert_non_null(strstr(resp, "ferry_serve_clients"));
    http_get(port, "/nosuch", resp, sizeof resp);
    assert_non_null(strstr(resp, "404"));
    kill(pid, SIGTERM);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_int_equal(access(sock, F_OK), -1);
}

/* `serve status` names the remote tier once it has worked (it printed L1
 * and L2 only: a daemon's Redis was invisible); needs the server CI starts */
static void serve_status_shows_the_remote(void **state)
{
    (void)state;
    const char *url = getenv("FERRY_TEST_REDIS_URL");
    if (!url || !*url)
        skip();
    char sock[320], args[700];
    snprintf(sock, sizeof sock, "%s/remote.sock", g_dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        dup2(fd, 2);
        execl(g_ferry, g_ferry, "serve", "--socket", sock, "--model", "tiny", "--l1", "64M",
              "--remote", url, (char *)NULL);
        _exit(127);
    }
    static run_out r_;
    run_out *r = &r_;
    snprintf(args, sizeof args, "serve status --socket %s", sock);
    for (int i = 0; i < 3000; i++) { /* up to 60 s */
        run_ferry(args, r);
        if (r->status == 0 || waitpid(pid, NULL, WNOHANG) == pid)
            break;
        usleep(20000);
    }
    if (r->status != 0) {
        kill(pid, SIGKILL);
        fail_msg("ferry serve --remote %s did not answer: %s", url, r->err);
    }
    int before = strstr(r->out, "\n  remote ") != NULL; /* nothing done yet: no line */
    snprintf(args, sizeof args, "kv bench --model tiny --docs 2 --doc-tokens 512 --questions 4 "
             "--no-refs --server %s", sock);
    run_ferry(args, r);
    int bench = r->status;
    snprintf(args, sizeof args, "serve status --socket %s", sock);
    run_ferry(args, r);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    assert_false(before);
    assert_int_equal(bench, 0);
    assert_int_equal(r->status, 0);
    if (!strstr(r->out, "\n  remote ") || !strstr(r->out, " puts ("))
        fail_msg("serve status: no remote line in '%s'", r->out);
}

/* ---- issue 25: server addresses, timeouts, a refused start ---- */

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* a Unix-domain listener at path that never says a word: it does not
 * accept (connections wait in its backlog), or with accept, a child
 * process takes each connection and holds it; *child: that child, or -1 */
static int mute_listener(const char *path, int accept_them, pid_t *child)
{
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    assert_true(strlen(path) < sizeof a.sun_path);
    memcpy(a.sun_path, path, strlen(path) + 1);
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 16), 0);
    *child = -1;
    if (accept_them) {
        *child = fork();
        assert_true(*child >= 0);
        if (*child == 0) {
            for (;;)
                (void)accept(fd, NULL, NULL); /* each held until this child is killed */
        }
    }
    return fd;
}

static void mute_listener_end(int fd, pid_t child, const char *path)
{
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
    }
    close(fd);
    unlink(path);
}

/* kv bench through a daemon that never answers: exit 1 within about the
 * library's 2 s (not 30 s), one line naming the address and the timeout */
static void kv_bench_server_gives_up_within_the_timeout(void **state)
{
    (void)state;
    static run_out r_;
    run_out *r = &r_;
    char path[320];
    snprintf(path, sizeof path, "%s/m.sock", g_dir);
    static const char *const run =
        "kv bench --model tiny --docs 1 --doc-tokens 256 --questions 1 --no-refs --l1 4M "
        "--server unix:@/m.sock";
    char args[400];
    for (int accept_them = 0; accept_them < 2; accept_them++) {
        pid_t child;
        int fd = mute_listener(path, accept_them, &child);
        double t0 = now_s();
        run_ferry(run, r);
        double took = now_s() - t0;
        mute_listener_end(fd, child, path);
        if (r->status != 1 || count_lines(r->err) != 1 || !strstr(r->err, "m.sock") ||
            !strstr(r->err, "server timeout 2000 ms, the default") || took > 12)
            fail_msg("kv bench against a mute %s listener: exit %d after %.1f s, stderr '%s' "
                     "(want exit 1 within about 2 s, one line naming the socket and timeout)",
                     accept_them ? "accepting" : "non-accepting", r->status, took, r->err);
    }
    /* --server-timeout is the limit: 3 s is neither the 2 s default nor 30 s */
    pid_t child;
    int fd = mute_listener(path, 1, &child);
    snprintf(args, sizeof args, "%s --server-timeout 3000", run);
    double t0 = now_s();
    run_ferry(args, r);
    double took = now_s() - t0;
    mute_listener_end(fd, child, path);
    if (r->status != 1 || count_lines(r->err) != 1 || took < 2.9 || took > 15 ||
        !strstr(r->err, "server timeout 3000 ms, --server-timeout"))
        fail_msg("kv bench --server-timeout 3000: exit %d after %.1f s: %s", r->status, took,
                 r->err);
    /* its value is checked like every count, and it needs --server */
    expect_usage("kv bench --server-timeout 500", "--server-timeout 500", "--server");
    expect_usage("kv bench --server @/m.sock --server-timeout -5", "--server-timeout -5",
                 "accepted: a whole number 1..");
    expect_usage("kv bench --server @/m.sock --server-timeout 2s", "--server-timeout 2s",
                 "accepted: ");
    expect_usage("kv bench --server @/m.sock --server-timeout 0", "--server-timeout 0",
                 "accepted: ");
    expect_usage("kv bench --server @/m.sock --server-timeout 99999999999", "99999999999",
                 "accepted: ");
}

/* tcp:// (or any scheme but unix) is not a path: refused wherever a
 * daemon's address is given, naming what is accepted */
/* a bad value of the library's own environment variables is one warning
 * line each at the first open (it used to be dropped in silence): the
 * variable, its value, what is used instead; the command runs as without
 * it (here: a slab check of no slab, exit 2 in its own line) */
static void bad_environment_values_are_warned_of_once(void **state)
{
    (void)state;
    run_out *r = malloc(sizeof *r);
    assert_non_null(r);
    static const char *const vars[] = {"FERRY_LOG", "FERRY_KV_DIRECT", "FERRY_KV_READ_DEPTH"};
    static const char *const bad[] = {"verbose", "yes", "64"};
    for (size_t i = 0; i < 3; i++)
        assert_int_equal(setenv(vars[i], bad[i], 1), 0);
    run_ferry("slab check @/none", r);
    for (size_t i = 0; i < 3; i++)
        unsetenv(vars[i]);
    assert_int_equal(r->status, 2);
    assert_int_equal(count_lines(r->err), 4);
    for (size_t i = 0; i < 3; i++) {
        char want[80];
        snprintf(want, sizeof want, "ferry warn: %s=%s: ", vars[i], bad[i]);
        const char *at = strstr(r->err, want);
        if (!at || strstr(at + 1, want) || !strstr(at, "using"))
            fail_msg("want one '%s...using...' line: '%s'", want, r->err);
    }
    assert_non_null(strstr(r->err, "ferry slab check: "));
    free(r);
}

static void server_addresses_are_unix_sockets_only(void **state)
{
    (void)state;
    static const char *const bad[] = {"tcp://127.0.0.1:9400", "http://localhost/x",
                                      "redis://127.0.0.1:6379/0", "unix://host/ferry.sock",
                                      "unix:"};
    static const char *const cmds[] = {"kv bench --model tiny --server", "serve --socket",
                                       "serve status --socket"};
    char args[200];
    for (size_t c = 0; c < sizeof cmds / sizeof cmds[0]; c++)
        for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
            snprintf(args, sizeof args, "%s %s", cmds[c], bad[b]);
            expect_usage(args, bad[b], "accepted: unix:/path/to/ferry.sock or /path");
        }
    /* nothing was created for any of them */
    assert_false(exists("tcp:"));
    assert_int_equal(access("tcp:", F_OK), -1);
    /* from the environment: named by its variable */
    setenv("FERRY_SOCKET", "tcp://127.0.0.1:9400", 1);
    expect_usage("serve status", "FERRY_SOCKET", "accepted: unix:");
    expect_usage("serve --model tiny", "FERRY_SOCKET", "accepted: unix:");
    unsetenv("FERRY_SOCKET");
    /* the accepted forms reach the socket: no daemon there, a failure (1) */
    static run_out r_;
    run_out *r = &r_;
    static const char *const good[] = {"serve status --socket @/none.sock",
                                       "serve status --socket unix:@/none.sock",
                                       "serve status --socket unix://@/none.sock"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        run_ferry(good[i], r);
        char want[320];
        snprintf(want, sizeof want, "serve status: %s/none.sock: no daemon answers", g_dir);
        if (r->status != 1 || count_lines(r->err) != 1 || !strstr(r->err, want))
            fail_msg("ferry %s: exit %d, stderr '%s' (want exit 1, '%s')", good[i], r->status,
                     r->err, want);
    }
    run_ferry("kv bench --model tiny --docs 1 --doc-tokens 256 --questions 1 --no-refs --l1 4M "
              "--server @/none.sock", r);
    assert_int_equal(r->status, 1);
    assert_int_equal(count_lines(r->err), 1);
    assert_non_null(strstr(r->err, "none.sock: connect"));
}

/* a start that is refused says so in exactly one line: no info lines
 * before it, no raw libmicrohttpd line ("Failed to bind to port") */
static void a_refused_serve_says_one_line(void **state)
{
    (void)state;
    /* the metrics port is taken (by this test) */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 1), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    int port = ntohs(a.sin_port);
    static run_out r_;
    run_out *r = &r_;
    char args[400], want[64];
    snprintf(args, sizeof args, "serve --socket @/taken.sock --model tiny --l1 4M --metrics "
             "127.0.0.1:%d", port);
    run_ferry(args, r);
    close(fd);
    snprintf(want, sizeof want, "metrics 127.0.0.1:%d", port);
    if (r->status != 1 || count_lines(r->err) != 1 || strncmp(r->err, "ferry serve: ", 13) ||
        !strstr(r->err, want) || !strstr(r->err, "Address already in use") || r->out[0])
        fail_msg("ferry %s: exit %d, stdout '%s', stderr '%s' (want exit 1 and one line)", args,
                 r->status, r->out, r->err);
    assert_false(exists("taken.sock")); /* the daemon it opened is closed again */
}

int main(void)
{
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return 77;
    self[n] = 0;
    snprintf(g_ferry, sizeof g_ferry, "%s/../ferry", dirname(self));
    if (access(g_ferry, X_OK) != 0) {
        fprintf(stderr, "skip: %s not built\n", g_ferry);
        return 77;
    }
    setenv("FERRY_NO_PROGRESS", "1", 1);
    unsetenv("FERRY_LOG"); /* ferry serve's own default: info lines, held until it serves */
    unsetenv("FERRY_SOCKET");
    unsetenv("FERRY_IO_ENGINE");
    ft_tmpdir(g_dir, sizeof g_dir);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(the_issue_cases_are_usage_errors),
        cmocka_unit_test(every_subcommand_refuses_alike),
        cmocka_unit_test(replay_checks_slots_against_the_trace),
        cmocka_unit_test(failures_exit_1_with_one_line),
        cmocka_unit_test(missing_directories_need_create),
        cmocka_unit_test(json_is_one_document),
        cmocka_unit_test(benches_print_no_targets),
        cmocka_unit_test(group_help_exits_0),
        cmocka_unit_test(serve_runs_and_stops_cleanly),
        cmocka_unit_test(kv_bench_server_gives_up_within_the_timeout),
        cmocka_unit_test(bad_environment_values_are_warned_of_once),
        cmocka_unit_test(server_addresses_are_unix_sockets_only),
        cmocka_unit_test(a_refused_serve_says_one_line),
        cmocka_unit_test(the_readmes_options_do_what_it_says),
        cmocka_unit_test(options_that_would_be_ignored_are_refused),
        cmocka_unit_test(create_without_dir_and_policy_with_sweep_are_refused),
        cmocka_unit_test(a_dash_trace_is_stdin_and_sim_takes_one_expert_size),
        cmocka_unit_test(a_dash_is_the_descriptor_itself),
        cmocka_unit_test(serve_status_shows_the_remote),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    ft_rmtree(g_dir);
    return rc;
}
