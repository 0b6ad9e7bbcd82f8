/*
 * test_pslab_cli.c - `ferry slab check DIR [--repair] [--json]` end to end:
 * the exit status (0 clean, 1 problems, 2 unreadable/usage) and what it
 * says, on a clean slab, one with bad payloads and a torn journal tail
 * (found, then repaired, then clean), one of a newer format, and none;
 * a slab in use by a store (named, left alone) and --reset; a missing
 * directory, a plain one, an unreadable slab header and part of a slab
 * striped over several directories: refused in the CLI's words, and
 * nothing made or changed.
 * Runs the ferry binary built next to this test (skipped when absent).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "ferry_test.h"
#include "io/sys.h"
#include "pslab/pslab_impl.h"

static char g_ferry[4096];

/* run ferry with args, output into out; returns the exit status */
static int run_ferry(const char *args, char *out, size_t n)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", g_ferry, args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t got = fread(out, 1, n - 1, f);
    out[got] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void make_store(const char *d, int n)
{
    const char *dirs[] = {d};
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.bytes = 4 << 20;
    o.flags = FERRY_PSLAB_CREATE;
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    uint8_t buf[6000];
    for (int i = 0; i < n; i++) {
        char k[32];
        int kl = snprintf(k, sizeof k, "chunk-%d", i);
        ft_fill_pattern(buf, sizeof buf, (unsigned)i);
        FT_ASSERT_OK(ferry_pslab_put(p, k, (size_t)kl, buf, sizeof buf));
    }
    FT_ASSERT_OK(ferry_pslab_close(p));
}

static void flip(const char *path, uint64_t off)
{
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    assert_int_equal(pread(fd, &b, 1, (off_t)off), 1);
    b ^= 0xff;
    assert_int_equal(pwrite(fd, &b, 1, (off_t)off), 1);
    close(fd);
}

static void test_clean_slab_exits_0(void **state)
{
    (void)state;
    char d[256], out[16384], args[512];
    ft_tmpdir(d, sizeof d);
    make_store(d, 5);
    snprintf(args, sizeof args, "slab check %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "5 chunks read, 0 failed"));
    assert_non_null(strstr(out, "clean"));
    ft_rmtree(d);
}

static void test_bad_payload_and_torn_tail_found_repaired_then_clean(void **state)
{
    (void)state;
    char d[256], out[16384], args[512], path[300];
    ft_tmpdir(d, sizeof d);
    make_store(d, 6);
    snprintf(path, sizeof path, "%s/%s", d, FERRY_PSLAB_FILE);
    flip(path, 4096 + 2 * 8192 + 10); /* chunk-2: 6000 bytes in the third 8 KiB extent */
    snprintf(path, sizeof path, "%s/%s", d, FERRY_PSLAB_JOURNAL);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(truncate(path, st.st_size - 3), 0); /* the last record torn */

    snprintf(args, sizeof args, "slab check %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "bad chunk: key chunk-2"));
    assert_non_null(strstr(out, "problems found"));
    /* without --repair nothing changed */
    struct stat st2;
    assert_int_equal(stat(path, &st2), 0);
    assert_int_equal(st2.st_size, st.st_size - 3);

    snprintf(args, sizeof args, "slab check %s --repair", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "-> deleted"));
    assert_non_null(strstr(out, "journal cut after its last good record"));
    assert_non_null(strstr(out, "4 chunks remain")); /* 6 - torn 5th - bad 2nd */

    snprintf(args, sizeof args, "slab check %s --json", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    assert_non_null(j);
    assert_true(json_is_true(json_object_get(j, "clean")));
    assert_int_equal(json_integer_value(json_object_get(j, "chunks")), 4);
    assert_int_equal(json_array_size(json_object_get(j, "bad_chunks")), 0);
    json_decref(j);
    ft_rmtree(d);
}

/* a check reports the slab's own format: an older one as it is (nothing
 * changed), this library's after --repair upgraded its journal */
static void test_check_reports_the_slabs_own_format(void **state)
{
    (void)state;
    char d[256], out[16384], args[512];
    ft_tmpdir(d, sizeof d);
    atomic_store(&ferry__pslab_test_format, 2);
    make_store(d, 3);
    atomic_store(&ferry__pslab_test_format, 0);
    snprintf(args, sizeof args, "slab check %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "format 2,"));
    assert_non_null(strstr(out, "3 chunks read, 0 failed"));
    snprintf(args, sizeof args, "slab check %s --repair", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "slab check %s --json", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    assert_non_null(j);
    assert_int_equal(json_integer_value(json_object_get(j, "format")), FERRY_PSLAB_FORMAT);
    assert_int_equal(json_integer_value(json_object_get(j, "chunks")), 3);
    json_decref(j);
    ft_rmtree(d);
}

static void test_unreadable_and_usage_exit_2(void **state)
{
    (void)state;
    char d[256], out[16384], args[512], path[300];
    ft_tmpdir(d, sizeof d);
    snprintf(args, sizeof args, "slab check %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 2); /* no store */
    assert_int_equal(run_ferry("slab check", out, sizeof out), 2);
    assert_int_equal(run_ferry("slab check --bogus x", out, sizeof out), 2);

    make_store(d, 2);
    snprintf(path, sizeof path, "%s/%s", d, FERRY_PSLAB_FILE);
    uint8_t blk[FERRY__PSLAB_HDR_BYTES];
    int fd = open(path, O_RDWR);
    assert_int_equal(pread(fd, blk, sizeof blk, 0), (ssize_t)sizeof blk);
    ferry__pslab_hdr h;
    FT_ASSERT_OK(ferry__pslab_hdr_decode(blk, sizeof blk, &h, NULL, 0));
    h.version = FERRY_PSLAB_FORMAT + 1;
    ferry__pslab_hdr_encode(&h, blk);
    assert_int_equal(pwrite(fd, blk, sizeof blk, 0), (ssize_t)sizeof blk);
    close(fd);
    snprintf(args, sizeof args, "slab check %s --json", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 2);
    assert_non_null(strstr(out, "FERRY_EVERSION"));
    ft_rmtree(d);
}


/* a store holding the slab: check says who and exits 1; --repair and
 * --reset refuse; nothing is changed */
static void test_slab_in_use_is_named_and_left_alone(void **state)
{
    (void)state;
    char d[256], out[16384], args[512], pid[64];
    ft_tmpdir(d, sizeof d);
    make_store(d, 3);
    const char *dirs[] = {d};
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    snprintf(pid, sizeof pid, "in use by process %d", (int)getpid());
    snprintf(args, sizeof args, "slab check %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    assert_non_null(strstr(out, pid));
    assert_null(strstr(out, "clean"));
    snprintf(args, sizeof args, "slab check %s --repair", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    assert_non_null(strstr(out, pid));
    snprintf(args, sizeof args, "slab check %s --reset", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    assert_non_null(strstr(out, pid));
    snprintf(args, sizeof args, "slab reset %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    assert_non_null(strstr(out, pid));
    snprintf(args, sizeof args, "slab check %s --json", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    assert_non_null(j);
    assert_true(json_is_true(json_object_get(j, "in_use")));
    assert_int_equal(json_integer_value(json_object_get(j, "pid")), getpid());
    json_decref(j);
    /* the store's chunks were not touched by any of it */
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.chunks, 3);
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(args, sizeof args, "slab check %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "3 chunks read, 0 failed"));
    ft_rmtree(d);
}

/* --reset empties a slab and keeps its size and tag; only when asked */
static void test_reset_empties_the_slab_keeping_its_tag(void **state)
{
    (void)state;
    char d[256], out[16384], args[512];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    const char *tag = "ferry-kv/1;layers=2;model=m";
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.bytes = 4 << 20;
    o.flags = FERRY_PSLAB_CREATE;
    o.tag = tag;
    o.tag_len = strlen(tag);
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_put(p, "k", 1, "value", 5));
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(args, sizeof args, "slab check %s --reset --repair", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 2);
    snprintf(args, sizeof args, "slab check %s --reset", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "reset"));
    o.flags = 0;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p)); /* the same tag and size still open it */
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.chunks, 0);
    assert_int_equal(s.capacity, 4 << 20);
    FT_ASSERT_OK(ferry_pslab_close(p));
    /* `slab reset DIR` is the same */
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_put(p, "k", 1, "value", 5));
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(args, sizeof args, "slab reset %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.chunks, 0);
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(args, sizeof args, "slab reset %s --bogus", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 2);
    o.tag = "another";
    o.tag_len = 7;
    assert_int_equal(ferry_pslab_open(&o, &p), FERRY_EMISMATCH);
    ft_rmtree(d);
}

/* entries in dir (not . and ..); -1 when it does not exist */
static int entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            n++;
    closedir(d);
    return n;
}

/* a slab striped over two directories: a reset given one of them, the
 * other alone, both in the other order or a third one besides is refused
 * (exit 2, naming the mismatch) and changes nothing: the library's reset
 * would make a new one-drive slab of the whole size in the one directory,
 * orphaning the other; given both in order, the reset empties it */
static void test_reset_of_part_of_a_striped_slab_is_refused(void **state)
{
    (void)state;
    char a[256], b[256], c[256], out[16384], args[1024];
    ft_tmpdir(a, sizeof a);
    ft_tmpdir(b, sizeof b);
    ft_tmpdir(c, sizeof c);
    const char *dirs[] = {a, b};
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 2;
    o.bytes = 8 << 20;
    o.flags = FERRY_PSLAB_CREATE;
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_put(p, "k", 1, "value", 5));
    FT_ASSERT_OK(ferry_pslab_close(p));
    char forms[5][1024];
    snprintf(forms[0], sizeof forms[0], "slab reset %s", a);
    snprintf(forms[1], sizeof forms[1], "slab reset %s --json", a);
    snprintf(forms[2], sizeof forms[2], "slab check %s --reset", b);
    snprintf(forms[3], sizeof forms[3], "slab reset %s %s", b, a);
    snprintf(forms[4], sizeof forms[4], "slab reset %s %s %s", a, b, c);
    static const char *const why[5] = {"1 directories given", "1 directories given",
                                       "another order", "another order",
                                       "3 directories given"};
    for (size_t i = 0; i < 5; i++) {
        int st = run_ferry(forms[i], out, sizeof out);
        if (st != 2 || !strstr(out, "FERRY_EMISMATCH") || !strstr(out, why[i]) ||
            !strstr(out, "nothing was changed"))
            fail_msg("ferry %s: exit %d, '%s'", forms[i], st, out);
    }
    char f[512];
    struct stat st;
    snprintf(f, sizeof f, "%s/%s", c, FERRY_PSLAB_FILE); /* the third directory: no slab */
    assert_int_not_equal(stat(f, &st), 0);
    assert_int_equal(entries(c), 0); /* nor a lock file: nothing was changed */
    snprintf(args, sizeof args, "slab check %s %s %s", a, b, c);
    assert_int_equal(run_ferry(args, out, sizeof out), 2);
    assert_non_null(strstr(out, "3 directories given"));
    assert_int_equal(entries(c), 0);
    snprintf(args, sizeof args, "slab check %s %s", a, b);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "2 drive(s), 8388608 bytes"));
    o.flags = 0;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p)); /* still the two-drive slab, its chunk kept */
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.chunks, 1);
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(args, sizeof args, "slab reset %s %s", a, b);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.chunks, 0);
    assert_int_equal(s.drives, 2);
    assert_int_equal(s.capacity, 8 << 20);
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(a);
    ft_rmtree(b);
    ft_rmtree(c);
}

/* the forked resetter's death: it is killed as it opens this file */
static const char *g_kill_at;

static int open_or_die(const char *path, int flags, mode_t mode)
{
    if (g_kill_at && strcmp(path, g_kill_at) == 0)
        _exit(9);
    return ferry__sys_default()->open(path, flags, mode);
}

/*
 * A reset of a two-drive slab killed part way (after the journal went and
 * drive a was rewritten, as it opens drive b's slab file): `ferry slab
 * reset a` then used to find no journal to check the directories by and
 * make a one-drive slab of the whole size in a, silently dropping b. Now
 * it is refused (exit 2, FERRY_EMISMATCH) naming b, nothing changed, and
 * `ferry slab reset a b` completes the reset: both drives, size kept.
 */
static void test_reset_killed_part_way_needs_every_drive(void **state)
{
    (void)state;
    char a[256], b[256], out[16384], args[1024], bfile[600];
    ft_tmpdir(a, sizeof a);
    ft_tmpdir(b, sizeof b);
    const char *dirs[] = {a, b};
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 2;
    o.bytes = 8 << 20;
    o.flags = FERRY_PSLAB_CREATE;
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_put(p, "k", 1, "value", 5));
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(bfile, sizeof bfile, "%s/%s", b, FERRY_PSLAB_FILE);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        static ferry__sys t;
        t = *ferry__sys_default();
        t.open = open_or_die;
        g_kill_at = bfile;
        ferry__sys_set(&t);
        o.flags = FERRY_PSLAB_RESET;
        o.bytes = 0;
        p = NULL;
        _exit(ferry_pslab_open(&o, &p) == 0 ? 0 : 1);
    }
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    assert_true(WIFEXITED(ws));
    assert_int_equal(WEXITSTATUS(ws), 9); /* (killed inside the reset) */
    char jp[600];
    struct stat st;
    snprintf(jp, sizeof jp, "%s/%s", a, FERRY_PSLAB_JOURNAL);
    assert_int_not_equal(stat(jp, &st), 0); /* the journal went first */

    const char *forms[][2] = {{"slab reset", ""}, {"slab reset", " --json"},
                              {"slab check", " --reset"}};
    for (size_t i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "%s %s%s", forms[i][0], a, forms[i][1]);
        int rc = run_ferry(args, out, sizeof out);
        if (rc != 2 || !strstr(out, "FERRY_EMISMATCH") || !strstr(out, b) ||
            !strstr(out, "interrupted") || !strstr(out, "nothing was changed"))
            fail_msg("ferry %s: exit %d, '%s'", args, rc, out);
        if (i == 0)
            print_message("ferry %s: %s", args, out);
    }
    snprintf(jp, sizeof jp, "%s/%s", a, FERRY_PSLAB_JOURNAL);
    assert_int_not_equal(stat(jp, &st), 0); /* (no one-drive slab was made) */
    snprintf(args, sizeof args, "slab reset %s %s", a, b);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "8388608 bytes"));
    o.flags = 0;
    p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.drives, 2);
    assert_int_equal(s.chunks, 0);
    assert_int_equal(s.capacity, 8 << 20);
    FT_ASSERT_OK(ferry_pslab_close(p));
    for (int i = 0; i < 2; i++) {
        snprintf(jp, sizeof jp, "%s/%s", dirs[i], FERRY_PSLAB_RESET_MARK);
        assert_int_not_equal(stat(jp, &st), 0);
    }
    ft_rmtree(a);
    ft_rmtree(b);
}

/* reset of a missing directory: refused naming it (ENOENT), nothing made */
static void test_reset_of_a_missing_directory_creates_nothing(void **state)
{
    (void)state;
    char d[256], m[300], out[16384], args[512];
    ft_tmpdir(d, sizeof d);
    snprintf(m, sizeof m, "%s/missing", d);
    const char *forms[][2] = {{"reset", ""}, {"check", " --reset"}, {"reset", " --json"}};
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        snprintf(args, sizeof args, "slab %s %s%s", forms[i][0], m, forms[i][1]);
        assert_int_equal(run_ferry(args, out, sizeof out), 2);
        assert_int_equal(entries(m), -1); /* not created */
        assert_non_null(strstr(out, m));
        assert_non_null(strstr(out, "ENOENT"));
        assert_null(strstr(out, "options."));
    }
    assert_int_equal(entries(d), 0);
    ft_rmtree(d);
}

/* a plain directory: reset and check say there is no slab, in the CLI's
 * words (no library option named), and leave no file there - a lock file
 * included */
static void test_plain_directory_is_left_empty(void **state)
{
    (void)state;
    char d[256], out[16384], args[512];
    ft_tmpdir(d, sizeof d);
    const char *forms[][2] = {{"reset", ""},         {"check", " --reset"},
                              {"check", ""},         {"check", " --json"},
                              {"check", " --repair"}, {"reset", " --json"}};
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        snprintf(args, sizeof args, "slab %s %s%s", forms[i][0], d, forms[i][1]);
        assert_int_equal(run_ferry(args, out, sizeof out), 2);
        assert_int_equal(entries(d), 0); /* no lock file left */
        assert_non_null(strstr(out, "holds no slab"));
        assert_null(strstr(out, "options."));
        assert_null(strstr(out, "FERRY_PSLAB_"));
    }
    ft_rmtree(d);
}

/* a slab whose header cannot be read: a reset cannot keep its size; it
 * says what to do instead of naming a library option, and drops nothing */
static void test_reset_of_an_unreadable_header_changes_nothing(void **state)
{
    (void)state;
    char d[256], out[16384], args[512], path[300];
    ft_tmpdir(d, sizeof d);
    make_store(d, 2);
    snprintf(path, sizeof path, "%s/%s", d, FERRY_PSLAB_FILE);
    flip(path, 0); /* the magic */
    snprintf(path, sizeof path, "%s/%s", d, FERRY_PSLAB_JOURNAL);
    struct stat st0, st1;
    assert_int_equal(stat(path, &st0), 0);
    snprintf(args, sizeof args, "slab reset %s", d);
    assert_int_equal(run_ferry(args, out, sizeof out), 2);
    assert_int_equal(stat(path, &st1), 0); /* the journal is still there, whole */
    assert_int_equal(st1.st_size, st0.st_size);
    assert_non_null(strstr(out, "cannot keep its size"));
    assert_non_null(strstr(out, "remove"));
    assert_null(strstr(out, "options."));
    ft_rmtree(d);
}


/* a byte flipped in a journal record that a later commit proves durable:
 * check reports the damage and the chunks dropped (exit 1), --repair
 * rewrites the journal, then it is clean and the old value never returns */
static void test_journal_damage_is_reported_and_repaired(void **state)
{
    (void)state;
    char d[256], c[256], out[16384], args[512], cmd[1200], path[300];
    ft_tmpdir(d, sizeof d);
    ft_tmpdir(c, sizeof c);
    const char *dirs[] = {d};
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.bytes = 4 << 20;
    o.flags = FERRY_PSLAB_CREATE;
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    FT_ASSERT_OK(ferry_pslab_put(p, "a", 1, "old", 3));
    FT_ASSERT_OK(ferry_pslab_put(p, "a", 1, "new", 3)); /* the record to damage */
    FT_ASSERT_OK(ferry_pslab_put(p, "b", 1, "bbb", 3)); /* a later commit */
    /* the files as a killed owner leaves them (no close: history stays) */
    snprintf(cmd, sizeof cmd, "cp %s/%s %s/%s %s/", d, FERRY_PSLAB_FILE, d, FERRY_PSLAB_JOURNAL,
             c);
    assert_int_equal(system(cmd), 0);
    FT_ASSERT_OK(ferry_pslab_close(p));
    snprintf(path, sizeof path, "%s/%s", c, FERRY_PSLAB_JOURNAL);
    /* header 64, record "a"=old (one piece), then the overwrite's sequence field */
    flip(path, FERRY__PSLAB_JHDR_BYTES + ferry__pslab_rec_size_p(1, 1) + 10);
    snprintf(args, sizeof args, "slab check %s", c);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "journal damage"));
    snprintf(args, sizeof args, "slab check %s --repair", c);
    assert_int_equal(run_ferry(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "journal rewritten"));
    snprintf(args, sizeof args, "slab check %s --json", c);
    assert_int_equal(run_ferry(args, out, sizeof out), 0);
    const char *cd[] = {c};
    o.dirs = cd;
    o.flags = 0;
    FT_ASSERT_OK(ferry_pslab_open(&o, &p));
    char buf[8];
    size_t len = 0;
    /* "a": its latest value was in the damaged record: a miss, never "old" */
    assert_int_equal(ferry_pslab_get(p, "a", 1, buf, sizeof buf, &len), FERRY_ENOTFOUND);
    FT_ASSERT_OK(ferry_pslab_get(p, "b", 1, buf, sizeof buf, &len));
    assert_memory_equal(buf, "bbb", 3);
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(c);
    ft_rmtree(d);
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
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clean_slab_exits_0),
        cmocka_unit_test(test_bad_payload_and_torn_tail_found_repaired_then_clean),
        cmocka_unit_test(test_check_reports_the_slabs_own_format),
        cmocka_unit_test(test_unreadable_and_usage_exit_2),
        cmocka_unit_test(test_slab_in_use_is_named_and_left_alone),
        cmocka_unit_test(test_reset_empties_the_slab_keeping_its_tag),
        cmocka_unit_test(test_journal_damage_is_reported_and_repaired),
        cmocka_unit_test(test_reset_of_a_missing_directory_creates_nothing),
        cmocka_unit_test(test_plain_directory_is_left_empty),
        cmocka_unit_test(test_reset_of_an_unreadable_header_changes_nothing),
        cmocka_unit_test(test_reset_of_part_of_a_striped_slab_is_refused),
        cmocka_unit_test(test_reset_killed_part_way_needs_every_drive),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
