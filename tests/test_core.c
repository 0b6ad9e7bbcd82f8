/*
 * test_core.c - error codes, messages, logging levels, the allocation hook,
 * size parsing and the version.
 */
/* ferry-test-labels: concurrent */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core.h"
#include "dirlock.h"
#include "env.h"
#include "kv/store/store_int.h"
#include "sized.h"
#include "ferry_test.h"

static void strerror_never_null_and_names_codes(void **state)
{
    (void)state;
    assert_string_equal(ferry_strerror(0), "success");
    assert_string_equal(ferry_err_name(FERRY_ENOTFOUND), "FERRY_ENOTFOUND");
    assert_string_equal(ferry_strerror(FERRY_ELOCKED), "key is locked");
    assert_string_equal(ferry_err_name(-EIO), "EIO");
    assert_non_null(strstr(ferry_strerror(-ENOSPC), "space"));
    assert_non_null(ferry_strerror(-99999));
    assert_non_null(ferry_strerror(12345));
    assert_string_equal(ferry_err_name(-99999), "FERRY_EUNKNOWN");
    /* library codes live below -4096, never colliding with errno */
    assert_true(FERRY_ENODEV < -4096);
    assert_true(FERRY_EEXIST < -4096);
}

static void error_messages_go_to_handle_and_thread(void **state)
{
    (void)state;
    ferry__errbuf eb = {0};
    int rc = ferry__err_set(&eb, -EIO, "file %s: read of %d bytes at %d: %s", "/x", 4096, 8192,
                            "EIO");
    assert_int_equal(rc, -EIO);
    assert_int_equal(eb.code, -EIO);
    assert_string_equal(eb.msg, "file /x: read of 4096 bytes at 8192: EIO");
    assert_string_equal(ferry_last_error(), eb.msg);
    ferry__errbuf other = {0};
    assert_int_equal(ferry__err_pass(&other, -EIO), -EIO);
    assert_string_equal(other.msg, eb.msg);
}

/* a fork while other threads write messages: the child's own message on a
 * buffer of the same lock is written, never spun on forever (the lock a
 * writer held at the fork is free in the child) */
static ferry__errbuf g_fork_eb;
static atomic_int g_fork_stop;

static void *write_messages(void *arg)
{
    (void)arg;
    while (!atomic_load(&g_fork_stop))
        ferry__err_set(&g_fork_eb, -EIO, "file /x: read of %d bytes at %d: EIO", 4096, 8192);
    return NULL;
}

static void error_locks_are_free_in_a_forked_child(void **state)
{
    (void)state;
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&th[i], NULL, write_messages, NULL), 0);
    int bad = 0;
    for (int i = 0; i < 200 && !bad; i++) {
        fflush(NULL);
        pid_t c = fork();
        if (c == 0) {
            alarm(5);
            ferry__err_set(&g_fork_eb, -ENOENT, "the child's");
            _exit(strcmp(ferry__err_msg(&g_fork_eb), "the child's") == 0 ? 0 : 1);
        }
        int ws = 0;
        assert_int_equal(waitpid(c, &ws, 0), c);
        bad = !(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    }
    atomic_store(&g_fork_stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    assert_false(bad);
}

static int g_logged;
static char g_last_log[256];
static void log_cb(int level, const char *msg, void *ctx)
{
    (void)ctx;
    (void)level;
    g_logged++;
    snprintf(g_last_log, sizeof g_last_log, "%s", msg);
}

static void log_levels_filter_and_parse(void **state)
{
    (void)state;
    assert_int_equal(ferry_log_level_parse("debug"), FERRY_LOG_DEBUG);
    assert_int_equal(ferry_log_level_parse("WARN"), FERRY_LOG_WARN);
    assert_int_equal(ferry_log_level_parse("3"), FERRY_LOG_INFO);
    assert_int_equal(ferry_log_level_parse("loud"), -1);
    ferry_log_set_callback(log_cb, NULL);
    ferry_log_set_level(FERRY_LOG_WARN);
    g_logged = 0;
    ferry__log(FERRY_LOG_INFO, "hidden");
    assert_int_equal(g_logged, 0);
    ferry__log(FERRY_LOG_ERROR, "shown %d", 7);
    assert_int_equal(g_logged, 1);
    assert_string_equal(g_last_log, "shown 7");
    ferry_log_set_level(FERRY_LOG_OFF);
    ferry__log(FERRY_LOG_ERROR, "off");
    assert_int_equal(g_logged, 1);
    ferry_log_set_callback(NULL, NULL);
    ferry_log_set_level(FERRY_LOG_WARN);
}

/* the level is clamped to OFF..TRACE, as the header says */
static void log_level_out_of_range_is_clamped(void **state)
{
    (void)state;
    ferry_log_set_level(99);
    assert_int_equal(ferry_log_get_level(), FERRY_LOG_TRACE);
    ferry_log_set_level(-5);
    assert_int_equal(ferry_log_get_level(), FERRY_LOG_OFF);
    ferry_log_set_level(FERRY_LOG_TRACE + 1);
    assert_int_equal(ferry_log_get_level(), FERRY_LOG_TRACE);
    ferry_log_set_level(FERRY_LOG_WARN);
    assert_int_equal(ferry_log_get_level(), FERRY_LOG_WARN);
}

/* a callback replaced while other threads log: each call gets the pair's
 * own ctx (never another callback's), and once ferry_log_set_callback
 * returned no thread is inside the pair it replaced nor enters it (its ctx
 * is marked retired then; the callback looks at entry and after a pause) */
#define SWAP_PAIRS 300
typedef struct {
    char tag;
    atomic_int retired;
} swap_ctx;
static swap_ctx g_swap[SWAP_PAIRS];
static atomic_int g_swap_stop, g_swap_calls, g_swap_mixed, g_swap_late;

static void swap_check(char tag, void *ctx)
{
    swap_ctx *c = ctx;
    atomic_fetch_add(&g_swap_calls, 1);
    if (c->tag != tag)
        atomic_fetch_add(&g_swap_mixed, 1);
    if (atomic_load(&c->retired))
        atomic_fetch_add(&g_swap_late, 1);
    for (volatile int i = 0; i < 2000; i++) /* a callback that takes a while */
        ;
    if (atomic_load(&c->retired))
        atomic_fetch_add(&g_swap_late, 1);
}

static void swap_cb_a(int level, const char *msg, void *ctx)
{
    (void)level;
    (void)msg;
    swap_check('a', ctx);
}

static void swap_cb_b(int level, const char *msg, void *ctx)
{
    (void)level;
    (void)msg;
    swap_check('b', ctx);
}

static void *swap_logger(void *arg)
{
    (void)arg;
    while (!atomic_load(&g_swap_stop))
        ferry__log(FERRY_LOG_ERROR, "line");
    return NULL;
}

static void log_callback_swaps_whole_pairs_while_threads_log(void **state)
{
    (void)state;
    ferry_log_set_level(FERRY_LOG_WARN);
    g_swap[0].tag = 'a';
    ferry_log_set_callback(swap_cb_a, &g_swap[0]);
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&th[i], NULL, swap_logger, NULL), 0);
    for (int k = 1; k < SWAP_PAIRS; k++) {
        /* each pair called before the next: the swaps meet calls */
        int c0 = atomic_load(&g_swap_calls);
        for (int w = 0; w < 100000 && atomic_load(&g_swap_calls) < c0 + 1; w++)
            sched_yield();
        g_swap[k].tag = k % 2 ? 'b' : 'a';
        ferry_log_set_callback(k % 2 ? swap_cb_b : swap_cb_a, &g_swap[k]);
        atomic_store(&g_swap[k - 1].retired, 1);
    }
    atomic_store(&g_swap_stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    ferry_log_set_callback(NULL, NULL);
    assert_true(atomic_load(&g_swap_calls) >= SWAP_PAIRS);
    assert_int_equal(atomic_load(&g_swap_mixed), 0);
    assert_int_equal(atomic_load(&g_swap_late), 0);
}

/* the library's environment variables: a valid value reads as before, a
 * bad one as unset and is flagged; the read depth's rules are the store's
 * own (ferry__kv_read_depth, read at each retrieve) */
static void env_values_read_as_their_readers_do(void **state)
{
    (void)state;
    int bad = -1;
    assert_int_equal(ferry__env_log_level("debug", &bad), FERRY_LOG_DEBUG);
    assert_int_equal(bad, 0);
    assert_int_equal(ferry__env_log_level("Warning", &bad), FERRY_LOG_WARN);
    assert_int_equal(bad, 0);
    assert_int_equal(ferry__env_log_level("0", &bad), FERRY_LOG_OFF);
    assert_int_equal(bad, 0);
    assert_int_equal(ferry__env_log_level("verbose", &bad), FERRY_LOG_WARN);
    assert_int_equal(bad, 1);
    assert_int_equal(ferry__env_log_level("", &bad), FERRY_LOG_WARN);
    assert_int_equal(bad, 0);
    assert_int_equal(ferry__env_log_level(NULL, &bad), FERRY_LOG_WARN);
    assert_int_equal(bad, 0);
    static const struct {
        const char *v;
        int mode, bad;
    } direct[] = {{"0", 0, 0}, {"1", 1, 0}, {NULL, 2, 0}, {"", 2, 0},
                  {"2", 2, 1}, {"yes", 2, 1}, {"1 ", 2, 1}, {"01", 2, 1}};
    for (size_t i = 0; i < sizeof direct / sizeof direct[0]; i++) {
        assert_int_equal(ferry__env_kv_direct(direct[i].v, &bad), direct[i].mode);
        assert_int_equal(bad, direct[i].bad);
    }
    static const char *const depths[] = {"1", "2", "16", "32", "+4", " 8", "0", "33", "4x",
                                         "-1", "", "99999999999999999999", "x"};
    for (size_t i = 0; i < sizeof depths / sizeof depths[0]; i++) {
        assert_int_equal(setenv("FERRY_KV_READ_DEPTH", depths[i], 1), 0);
        unsigned want = ferry__kv_read_depth(7);
        if (ferry__env_read_depth(depths[i], 7, &bad) != want)
            fail_msg("FERRY_KV_READ_DEPTH=%s: %u here, %u in the store", depths[i],
                     ferry__env_read_depth(depths[i], 7, NULL), want);
        assert_int_equal(bad, depths[i][0] && want == 7);
    }
    assert_int_equal(unsetenv("FERRY_KV_READ_DEPTH"), 0);
    assert_int_equal(ferry__env_read_depth(NULL, 7, &bad), 7);
    assert_int_equal(bad, 0);
}

/* a bad value of each is one warning naming the variable, its value and
 * what is used instead; unset or valid values say nothing */
static void env_bad_values_are_warned_of(void **state)
{
    (void)state;
    static const char *const vars[] = {"FERRY_LOG", "FERRY_KV_DIRECT", "FERRY_KV_READ_DEPTH"};
    static const char *const bad[] = {"verbose", "yes", "64"};
    static const char *const good[] = {"warn", "1", "8"};
    ferry_log_set_callback(log_cb, NULL);
    ferry_log_set_level(FERRY_LOG_WARN);
    for (size_t i = 0; i < 3; i++)
        unsetenv(vars[i]);
    g_logged = 0;
    assert_int_equal(ferry__env_warn(), 0);
    assert_int_equal(g_logged, 0);
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(setenv(vars[i], good[i], 1), 0);
        assert_int_equal(ferry__env_warn(), 0);
        assert_int_equal(g_logged, 0);
        char want[64];
        snprintf(want, sizeof want, "%s=%s: ", vars[i], bad[i]);
        assert_int_equal(setenv(vars[i], bad[i], 1), 0);
        assert_int_equal(ferry__env_warn(), 1);
        assert_int_equal(g_logged, 1);
        if (strncmp(g_last_log, want, strlen(want)) || !strstr(g_last_log, "using"))
            fail_msg("%s: '%s'", want, g_last_log);
        g_logged = 0;
        unsetenv(vars[i]);
    }
    ferry_log_set_callback(NULL, NULL);
}

static void allocation_hook_injects_oom(void **state)
{
    (void)state;
    ft_alloc_install(2, 0);
    void *a = ferry__malloc(10);
    void *b = ferry__malloc(10);
    void *c = ferry__aligned_alloc(4096, 100);
    assert_non_null(a);
    assert_null(b);
    assert_non_null(c);
    assert_true(FERRY__IS_ALIGNED(c, 4096));
    assert_int_equal(ft_alloc_live(), 2);
    ferry__free(a);
    ferry__free(c);
    assert_int_equal(ft_alloc_live(), 0);
    assert_int_equal(ft_alloc_failures(), 1);
    ft_alloc_reset();
    a = ferry__malloc(1);
    assert_non_null(a);
    ferry__free(a);
}

static void sizes_parse_with_suffixes(void **state)
{
    (void)state;
    uint64_t v = 0;
    FT_ASSERT_OK(ferry_parse_size("8M", &v));
    assert_int_equal(v, 8u << 20);
    FT_ASSERT_OK(ferry_parse_size("256k", &v));
    assert_int_equal(v, 256u << 10);
    FT_ASSERT_OK(ferry_parse_size("2GiB", &v));
    assert_int_equal(v, 2ull << 30);
    FT_ASSERT_OK(ferry_parse_size("4096", &v));
    assert_int_equal(v, 4096);
    FT_ASSERT_OK(ferry_parse_size("1.5G", &v));
    assert_int_equal(v, 3ull << 29);
    v = 77;
    assert_int_equal(ferry_parse_size("8Q", &v), -EINVAL);
    assert_int_equal(ferry_parse_size("", &v), -EINVAL);
    assert_int_equal(ferry_parse_size("-1", &v), -EINVAL);
    assert_int_equal(ferry_parse_size("abc", &v), -EINVAL);
    assert_int_equal(v, 77); /* untouched on failure */
}

/* a lowercase b is bits to many: refused, with the byte spellings to use;
 * every upper-case B form reads as before */
static void sizes_with_a_lowercase_b_are_refused(void **state)
{
    (void)state;
    static const struct {
        const char *s, *hint;
    } bits[] = {{"64Gb", "64G, 64GiB or 64GB"}, {"8Mb", "8M, 8MiB or 8MB"},
                {"1kb", "1K, 1KiB or 1KB"},     {"8Mib", "8M, 8MiB or 8MB"},
                {"1.5gb", "1.5G, 1.5GiB or 1.5GB"}, {"100b", "100 or 100B"},
                {"2TIb", "2T, 2TiB or 2TB"}};
    for (size_t i = 0; i < sizeof bits / sizeof *bits; i++) {
        uint64_t v = 77;
        int rc = ferry_parse_size(bits[i].s, &v);
        if (rc != -EINVAL || v != 77)
            fail_msg("ferry_parse_size(\"%s\") = %d, %llu: want -EINVAL, untouched", bits[i].s,
                     rc, (unsigned long long)v);
        const char *m = ferry_last_error();
        if (!strstr(m, bits[i].s) || !strstr(m, "bits") || !strstr(m, bits[i].hint))
            fail_msg("message for \"%s\": \"%s\" (want it to say bits and \"%s\")", bits[i].s,
                     m, bits[i].hint);
    }
    static const struct {
        const char *s;
        uint64_t v;
    } bytes[] = {{"64G", 64ull << 30}, {"64GB", 64ull << 30}, {"64GiB", 64ull << 30},
                 {"64gB", 64ull << 30}, {"64giB", 64ull << 30}, {"64GIB", 64ull << 30},
                 {"1k", 1024},          {"1KB", 1024},          {"100B", 100}};
    for (size_t i = 0; i < sizeof bytes / sizeof *bytes; i++) {
        uint64_t v = 0;
        FT_ASSERT_OK(ferry_parse_size(bytes[i].s, &v));
        if (v != bytes[i].v)
            fail_msg("ferry_parse_size(\"%s\") = %llu, want %llu", bytes[i].s,
                     (unsigned long long)v, (unsigned long long)bytes[i].v);
    }
}

/* every errno has its name, and the new library code too */
static void every_errno_has_a_name(void **state)
{
    (void)state;
    assert_string_equal(ferry_err_name(-ENOBUFS), "ENOBUFS");
    assert_string_equal(ferry_err_name(-EHOSTUNREACH), "EHOSTUNREACH");
    for (int e = 1; e < 134; e++) {
        if (e == 41 || e == 58) /* unassigned on Linux */
            continue;
        assert_string_not_equal(ferry_err_name(-e), "FERRY_EUNKNOWN");
    }
    assert_string_equal(ferry_err_name(FERRY_EBUSY), "FERRY_EBUSY");
    assert_true(strstr(ferry_strerror(FERRY_EBUSY), "owned") != NULL);
}

/* one owner per directory: a second lock in this process and one in a
 * child are refused with FERRY_EBUSY naming the directory and our pid; the
 * lock goes with the owner's close, and with the owner's death */
static void directory_lock_has_one_owner(void **state)
{
    (void)state;
    char dir[256], sub[300], msg[64];
    ft_tmpdir(dir, sizeof dir);
    snprintf(sub, sizeof sub, "%s/a/b", dir);
    ferry__errbuf eb = {0};
    assert_int_equal(ferry__mkdir_p(sub, 0, 0, &eb), -ENOENT); /* no --create: refused */
    FT_ASSERT_OK(ferry__mkdir_p(sub, 0, 1, &eb));
    struct stat st;
    assert_int_equal(stat(sub, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0700);
    int fd = -1, fd2 = -1;
    FT_ASSERT_OK(ferry__dir_lock(sub, 0, 0, "test", &eb, &fd));
    char lock[400];
    snprintf(lock, sizeof lock, "%s/%s", sub, FERRY__LOCK_FILE);
    assert_int_equal(stat(lock, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(ferry__dir_lock(sub, 0, 0, "test", &eb, &fd2), FERRY_EBUSY);
    snprintf(msg, sizeof msg, "process %d", (int)getpid());
    assert_non_null(strstr(eb.msg, msg));
    assert_non_null(strstr(eb.msg, sub));
    assert_int_equal(ferry__dir_lock(sub, 0, 1, "test", &eb, &fd2), FERRY_EBUSY); /* shared too */
    assert_int_equal(ferry__dir_lock_holder(sub), (int)getpid());
    pid_t c = fork();
    if (c == 0) {
        int f = -1;
        _exit(ferry__dir_lock(sub, 0, 0, "child", NULL, &f) == FERRY_EBUSY ? 0 : 1);
    }
    int ws = 0;
    assert_int_equal(waitpid(c, &ws, 0), c);
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    ferry__dir_unlock(fd);
    assert_int_equal(ferry__dir_lock_holder(sub), 0);
    /* two shared holders (checkers) at once, and they exclude an owner */
    FT_ASSERT_OK(ferry__dir_lock(sub, 0, 1, "check", &eb, &fd));
    FT_ASSERT_OK(ferry__dir_lock(sub, 0, 1, "check", &eb, &fd2));
    int fd3 = -1;
    assert_int_equal(ferry__dir_lock(sub, 0, 0, "test", &eb, &fd3), FERRY_EBUSY);
    ferry__dir_unlock(fd);
    ferry__dir_unlock(fd2);
    /* a child that takes the lock and dies with it held leaves it free */
    c = fork();
    if (c == 0) {
        int f = -1;
        if (ferry__dir_lock(sub, 0, 0, "child", NULL, &f) != 0)
            _exit(1);
        kill(getpid(), SIGKILL);
        _exit(2);
    }
    assert_int_equal(waitpid(c, &ws, 0), c);
    assert_true(WIFSIGNALED(ws));
    FT_ASSERT_OK(ferry__dir_lock(sub, 0, 0, "test", &eb, &fd));
    ferry__dir_unlock(fd);
    /* modes: a group mode is kept, nonsense refused */
    assert_int_equal(ferry__dir_mode(0660), 0770u);
    assert_int_equal(ferry__file_mode(0), 0600u);
    assert_int_equal(ferry__mode_check(0777, "x", &eb), -EINVAL);
    assert_int_equal(ferry__mode_check(0066, "x", &eb), -EINVAL);
    FT_ASSERT_OK(ferry__mode_check(0640, "x", &eb));
    ft_rmtree(dir);
}

/* a fork's child does not hold its parent's directory locks: once the
 * parent unlocks (a store closed, reopened), the directory is free while
 * the child lives on; and the child's own unlock of the inherited number
 * closes nothing of its own */
static void directory_lock_is_not_a_forked_childs(void **state)
{
    (void)state;
    char dir[256];
    ft_tmpdir(dir, sizeof dir);
    ferry__errbuf eb = {0};
    int fd = -1, rd = -1;
    FT_ASSERT_OK(ferry__dir_lock(dir, 0, 0, "test", &eb, &fd));
    int go[2], done[2];
    assert_int_equal(pipe(go), 0);
    assert_int_equal(pipe(done), 0);
    fflush(NULL);
    pid_t c = fork();
    if (c == 0) {
        alarm(10);
        close(go[1]);
        close(done[0]);
        char b;
        if (write(done[1], "r", 1) != 1) /* running (past fork's handlers) */
            _exit(4);
        if (read(go[0], &b, 1) != 1) /* the parent unlocked and locked again */
            _exit(1);
        ferry__dir_unlock(fd);       /* the parent's number: none of ours */
        if (write(done[1], "x", 1) != 1)
            _exit(2);
        _exit(read(go[0], &b, 1) == 0 ? 0 : 3); /* live until the parent is done */
    }
    close(go[0]);
    close(done[1]);
    char b;
    assert_int_equal(read(done[0], &b, 1), 1); /* the child is running */
    ferry__dir_unlock(fd);
    assert_int_equal(ferry__dir_lock_holder(dir), 0); /* free, the child alive */
    FT_ASSERT_OK(ferry__dir_lock(dir, 0, 0, "test", &eb, &fd));
    assert_int_equal(write(go[1], "x", 1), 1);
    assert_int_equal(read(done[0], &b, 1), 1);
    /* the child's unlock left the parent's new lock held */
    assert_int_equal(ferry__dir_lock(dir, 0, 1, "check", &eb, &rd), FERRY_EBUSY);
    ferry__dir_unlock(fd);
    close(go[1]);
    int ws = 0;
    assert_int_equal(waitpid(c, &ws, 0), c);
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    close(done[0]);
    ft_rmtree(dir);
}

/* another process makes g_theirs between a mkdir_p's start and its mkdir */
static char g_theirs[300];
static void theirs_made_first(int step, const char *path)
{
    if (step == FERRY__DIRLOCK_MKDIR && strcmp(path, g_theirs) == 0)
        (void)mkdir(path, 0700);
}

/* what a mkdir_p made is what its own mkdir calls made: below the prefix
 * it reports kept, and none that was there or that another process made
 * meanwhile; "." ".." and empty names make nothing; a failed one removes
 * what it made */
static void mkdir_p_reports_the_directories_it_made(void **state)
{
    (void)state;
    char dir[256], p[700];
    ft_tmpdir(dir, sizeof dir);
    size_t n = strlen(dir), kept = 0;
    ferry__errbuf eb = {0};
    snprintf(p, sizeof p, "%s/a/b/", dir);
    FT_ASSERT_OK(ferry__mkdir_p_made(p, 0, 1, &kept, &eb));
    assert_int_equal(kept, n);
    FT_ASSERT_OK(ferry__mkdir_p_made(p, 0, 1, &kept, &eb));
    assert_int_equal(kept, strlen(p)); /* all there: none made */
    snprintf(p, sizeof p, "%s/a/./c//d", dir);
    FT_ASSERT_OK(ferry__mkdir_p_made(p, 0, 1, &kept, &eb));
    assert_int_equal(kept, n + 2); /* ".../a" was there */
    snprintf(p, sizeof p, "%s/a/c/d", dir);
    FT_ASSERT_OK(ferry__mkdir_p_made(p, 0, 0, &kept, &eb)); /* (no create) */
    assert_int_equal(kept, strlen(p));
    snprintf(g_theirs, sizeof g_theirs, "%s/t", dir);
    snprintf(p, sizeof p, "%s/t/u", dir);
    ferry__dirlock_seam(theirs_made_first);
    int rc = ferry__mkdir_p_made(p, 0, 1, &kept, &eb);
    ferry__dirlock_seam(NULL);
    FT_ASSERT_OK(rc);
    assert_int_equal(kept, strlen(g_theirs)); /* t is another's, u ours */
    /* a name too long after a new directory: refused, the new one gone */
    snprintf(p, sizeof p, "%s/new/%0300d", dir, 0);
    assert_int_equal(ferry__mkdir_p_made(p, 0, 1, &kept, &eb), -ENAMETOOLONG);
    assert_int_equal(kept, strlen(p));
    assert_non_null(strstr(eb.msg, "mkdir"));
    struct stat st;
    snprintf(p, sizeof p, "%s/new", dir);
    assert_int_equal(stat(p, &st), -1);
    ft_rmtree(dir);
}

/* another opener's cleanup removes g_gone (an empty directory it made)
 * once, just before the mkdir_p that found it there makes a name in it */
static char g_gone[300], g_under[300];
static void theirs_removed(int step, const char *path)
{
    if (step == FERRY__DIRLOCK_MKDIR && g_gone[0] && strcmp(path, g_under) == 0) {
        (void)rmdir(g_gone);
        g_gone[0] = 0;
    }
}

/* a directory that was there when a mkdir_p came to it, removed by its
 * maker (a refused opener's cleanup, a failed mkdir_p's) before the
 * mkdir_p made the next name in it: made again, not "No such file" for
 * a directory the caller asked to be made - and this call's own now */
static void mkdir_p_makes_again_what_another_removed(void **state)
{
    (void)state;
    char dir[256], p[700];
    ft_tmpdir(dir, sizeof dir);
    ferry__errbuf eb = {0};
    size_t kept = 0;
    snprintf(g_gone, sizeof g_gone, "%s/x", dir);
    snprintf(g_under, sizeof g_under, "%s/x/y", dir);
    snprintf(p, sizeof p, "%s/x/y/z", dir);
    assert_int_equal(mkdir(g_gone, 0700), 0); /* another's, empty */
    ferry__dirlock_seam(theirs_removed);
    int rc = ferry__mkdir_p_made(p, 0, 1, &kept, &eb);
    ferry__dirlock_seam(NULL);
    if (rc != 0)
        fail_msg("mkdir_p %s, its parent removed by another meanwhile: %d (%s)", p, rc, eb.msg);
    assert_int_equal(g_gone[0], 0); /* (the seam ran) */
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    assert_true(S_ISDIR(st.st_mode));
    assert_int_equal(kept, strlen(dir)); /* x made again: by this call */
    /* a name under one that is no directory (a dangling link) still fails */
    snprintf(p, sizeof p, "%s/link", dir);
    assert_int_equal(symlink("nowhere", p), 0);
    snprintf(p, sizeof p, "%s/link/a", dir);
    assert_int_equal(ferry__mkdir_p_made(p, 0, 1, &kept, &eb), -ENOENT);
    assert_int_equal(kept, strlen(p));
    ft_rmtree(dir);
}

/* another opener's cleanup: the lock file removed once, between the
 * locker's open of it and its lock (dirlock's seam) */
static int g_removals;
static void lock_file_removed(int step, const char *path)
{
    if (step == FERRY__DIRLOCK_LOCK && g_removals > 0) {
        g_removals--;
        (void)unlink(path);
    }
}

/* a lock file removed while it is being taken (a refused opener removes
 * the one it made): the lock is held on the file the name has when the
 * call returns, exclusive or shared, so a second locker in another
 * process is refused rather than taking a new file as a second owner */
static void directory_lock_is_on_the_file_the_name_has(void **state)
{
    (void)state;
    char dir[256], lock[400];
    ft_tmpdir(dir, sizeof dir);
    snprintf(lock, sizeof lock, "%s/%s", dir, FERRY__LOCK_FILE);
    ferry__errbuf eb = {0};
    for (int shared = 0; shared < 2; shared++) {
        int fd = -1;
        g_removals = 1;
        ferry__dirlock_seam(lock_file_removed);
        int rc = ferry__dir_lock(dir, 0, shared, "test", &eb, &fd);
        ferry__dirlock_seam(NULL);
        FT_ASSERT_OK(rc);
        assert_int_equal(g_removals, 0); /* (the seam ran) */
        struct stat held, named;
        assert_int_equal(fstat(fd, &held), 0);
        assert_int_equal(stat(lock, &named), 0);
        if (held.st_dev != named.st_dev || held.st_ino != named.st_ino)
            fail_msg("%s lock held on inode %llu, the name %s has inode %llu",
                     shared ? "a shared" : "an exclusive", (unsigned long long)held.st_ino,
                     lock, (unsigned long long)named.st_ino);
        fflush(NULL);
        pid_t c = fork();
        if (c == 0) {
            int f = -1;
            _exit(ferry__dir_lock(dir, 0, 0, "child", NULL, &f) == FERRY_EBUSY ? 0 : 1);
        }
        FT_ASSERT_CHILD_OK(c, "a second locker, refused");
        ferry__dir_unlock(fd);
    }
    ft_rmtree(dir);
}

/* a warning at the rate of the I/O: the first few, then one a second
 * carrying how many were held back */
static void repeated_warnings_are_rate_limited(void **state)
{
    (void)state;
    ferry__warnlim w;
    memset(&w, 0, sizeof w);
    uint64_t quiet = 77;
    int said = 0;
    for (int i = 0; i < 1000; i++)
        said += ferry__warn_ok(&w, &quiet);
    assert_int_equal(said, FERRY__WARN_BURST);
    assert_int_equal(quiet, 0);
    usleep(1100 * 1000);
    assert_int_equal(ferry__warn_ok(&w, &quiet), 1);
    assert_int_equal(quiet, 1000 - FERRY__WARN_BURST);
    assert_int_equal(ferry__warn_ok(&w, &quiet), 0);
}

static void version_matches_macros(void **state)
{
    (void)state;
    assert_string_equal(ferry_version(), FERRY_VERSION_STRING);
    assert_int_equal(ferry_version_number(), FERRY_VERSION_NUMBER);
}

/* sized.c: the one rule for options prefixes and stats sizes */
typedef struct v2 {
    size_t size;
    uint32_t a;      /* the first version ends here (with padding: 16) */
    uint64_t b;      /* added later */
    uint16_t c;      /* added later */
} v2;

static void sized_structs_take_prefixes_and_write_what_the_caller_knows(void **state)
{
    (void)state;
    static const ferry__member later[] = {FERRY__MEMBER(v2, b), FERRY__MEMBER(v2, c)};
    static const ferry__sized d = FERRY__SIZED(v2, offsetof(v2, a) + 4, later);
    v2 src = {0, 7, 8, 9}, dst;
    /* a prefix: the members past it keep the defaults dst held */
    static const size_t ok[] = {12, 16, 24, 26, sizeof(v2)};
    for (size_t i = 0; i < FERRY__ARRAY_LEN(ok); i++) {
        src.size = ok[i];
        dst = (v2){sizeof(v2), 1, 2, 3};
        FT_ASSERT_OK(ferry__opts_take(NULL, "test", &d, &dst, &src));
        assert_int_equal(dst.size, sizeof(v2));
        assert_int_equal(dst.a, 7);
        assert_int_equal(dst.b, ok[i] >= 24 ? 8 : 2);
        assert_int_equal(dst.c, ok[i] >= 26 ? 9 : 3);
    }
    /* below the minimum, inside a member, or a newer header's size */
    static const size_t bad[] = {0, 8, 11, 17, 23, 25, sizeof(v2) + 8};
    for (size_t i = 0; i < FERRY__ARRAY_LEN(bad); i++) {
        src.size = bad[i];
        dst = (v2){sizeof(v2), 1, 2, 3};
        assert_int_equal(ferry__opts_take(NULL, "test", &d, &dst, &src), -EINVAL);
        assert_int_equal(dst.a, 1); /* untouched */
        assert_non_null(strstr(ferry_last_error(), "v2 size"));
    }
    assert_non_null(strstr(ferry_last_error(), "accepted 12 (offsetof(v2, a) + 4) to 32"));
    src.size = 17;
    ferry__opts_take(NULL, "test", &d, &dst, &src);
    assert_non_null(strstr(ferry_last_error(), "inside b"));

    /* stats: only out->size bytes written, out->size kept */
    v2 snap = {sizeof(v2), 7, 8, 9};
    unsigned char raw[sizeof(v2) + 8];
    memset(raw, 0xA5, sizeof raw);
    v2 *out = (v2 *)(void *)raw;
    out->size = 16; /* an older header's struct: size and a */
    FT_ASSERT_OK(ferry__stats_put(NULL, "test", out, &snap, sizeof snap));
    assert_int_equal(out->size, 16);
    assert_int_equal(out->a, 7);
    for (size_t k = 16; k < sizeof raw; k++)
        assert_int_equal(raw[k], 0xA5);
    out->size = 4;
    assert_int_equal(ferry__stats_put(NULL, "test", out, &snap, sizeof snap), -EINVAL);
    out->size = sizeof raw; /* a newer header's: our whole struct, nothing more */
    FT_ASSERT_OK(ferry__stats_put(NULL, "test", out, &snap, sizeof snap));
    assert_int_equal(out->c, 9);
    assert_int_equal(raw[sizeof(v2)], 0xA5);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(strerror_never_null_and_names_codes),
        cmocka_unit_test(error_messages_go_to_handle_and_thread),
        cmocka_unit_test(error_locks_are_free_in_a_forked_child),
        cmocka_unit_test(log_levels_filter_and_parse),
        cmocka_unit_test(log_level_out_of_range_is_clamped),
        cmocka_unit_test(log_callback_swaps_whole_pairs_while_threads_log),
        cmocka_unit_test(env_values_read_as_their_readers_do),
        cmocka_unit_test(env_bad_values_are_warned_of),
        cmocka_unit_test(allocation_hook_injects_oom),
        cmocka_unit_test(sizes_parse_with_suffixes),
        cmocka_unit_test(sizes_with_a_lowercase_b_are_refused),
        cmocka_unit_test(version_matches_macros),
        cmocka_unit_test(every_errno_has_a_name),
        cmocka_unit_test(directory_lock_has_one_owner),
        cmocka_unit_test(directory_lock_is_not_a_forked_childs),
        cmocka_unit_test(directory_lock_is_on_the_file_the_name_has),
        cmocka_unit_test(mkdir_p_reports_the_directories_it_made),
        cmocka_unit_test(mkdir_p_makes_again_what_another_removed),
        cmocka_unit_test(repeated_warnings_are_rate_limited),
        cmocka_unit_test(sized_structs_take_prefixes_and_write_what_the_caller_knows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
