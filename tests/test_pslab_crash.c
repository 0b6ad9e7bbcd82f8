/*
 * test_pslab_crash.c - kill -9 at random moments: a forked writer runs a
 * script of puts, overwrites and deletes on a persistent slab and reports
 * each acknowledged op through a pipe; the parent kills it with SIGKILL
 * after a random delay, reopens the slab and checks that it equals the
 * state after the acknowledged ops (or after those plus the one op in
 * flight), byte for byte, with nothing else in it and nothing corrupt.
 * Many rounds on the same slab, so every round also recovers the previous
 * rounds' crashes.
 */
/* ferry-test-timeout: 300 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"
#include "test_pslab_model.h"

#define OPS 400

static ferry_pslab_options opts(const char *const *dirs, unsigned flags)
{
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.bytes = 64ull << 20;
    o.flags = flags;
    o.compact_bytes = 64 * 1024; /* compactions happen inside the crash window too */
    return o;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void writer(const char *dir, const pm_op *ops, int n, int fd)
{
    const char *dirs[] = {dir};
    ferry_pslab_options o = opts(dirs, FERRY_PSLAB_CREATE);
    ferry_pslab *p = NULL;
    if (ferry_pslab_open(&o, &p) != 0)
        _exit(3);
    uint8_t *buf = malloc(PM_MAX_LEN);
    for (int i = 0; i < n; i++) {
        if (pm_do(p, &ops[i], buf) != 0)
            _exit(4);
        int32_t v = i;
        if (write(fd, &v, sizeof v) != (ssize_t)sizeof v)
            _exit(5);
    }
    /* everything done: wait for the kill */
    for (;;)
        pause();
}

static void test_sigkill_at_random_points_loses_nothing_acknowledged(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    pm_state *st = malloc(sizeof *st), *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    pm_init(st);
    pm_op *ops = malloc(OPS * sizeof *ops);
    int64_t vctr = 1;
    uint64_t seed = (uint64_t)time(NULL);
    const char *env = getenv("FERRY_TEST_SEED");
    if (env)
        seed = strtoull(env, NULL, 0);
    print_message("seed %llu (FERRY_TEST_SEED to repeat)\n", (unsigned long long)seed);
    uint64_t r = seed;
    int rounds = 0, acked_total = 0, inflight_durable = 0;
    uint64_t slow_us = 0;
    uint64_t t0 = now_ms();
    while (rounds < 60 && now_ms() - t0 < 12000) {
        pm_script(st, seed + (uint64_t)rounds * 7919, ops, OPS, &vctr);
        int pfd[2];
        assert_int_equal(pipe(pfd), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(pfd[0]);
            writer(d, ops, OPS, pfd[1]);
        }
        close(pfd[1]);
        r = pm_mix(r + 1);
        /* slow hosts (sanitizers) need longer to open the store: grow the window
         * while rounds end before the first acknowledgement */
        usleep((useconds_t)(2000 + slow_us + r % 100000));
        kill(pid, SIGKILL);
        int ws = 0;
        assert_int_equal(waitpid(pid, &ws, 0), pid);
        if (!(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL))
            fail_msg("writer did not die by SIGKILL (status 0x%x)", ws);
        int32_t v, acked = 0;
        while (read(pfd[0], &v, sizeof v) == (ssize_t)sizeof v) {
            assert_int_equal(v, acked);
            acked++;
        }
        close(pfd[0]);
        if (acked == 0 && slow_us < 2000000)
            slow_us += 50000;

        *a = *st;
        for (int i = 0; i < acked; i++)
            pm_apply(a, &ops[i]);
        *b = *a;
        if (acked < OPS)
            pm_apply(b, &ops[acked]);

        ferry_pslab_options o = opts(dirs, FERRY_PSLAB_READONLY);
        ferry_pslab *p = NULL;
        int rc = ferry_pslab_open(&o, &p);
        if (rc == -ENOENT && acked_total == 0 && acked == 0) {
            rounds++; /* killed before the store was created */
            continue;
        }
        FT_ASSERT_OK(rc);
        int wrong = 0, corrupt = 0;
        int m = pm_match(p, a, b, &wrong, &corrupt);
        if (!m || wrong || corrupt)
            fail_msg("round %d: %d ops acknowledged; store matches %d, %d wrong, %d corrupt",
                     rounds, acked, m, wrong, corrupt);
        ferry_pslab_close(p);
        *st = (m & 1) ? *a : *b;
        inflight_durable += !(m & 1);
        acked_total += acked;
        rounds++;
    }
    print_message("%d rounds, %d acknowledged ops, %d times the op in flight was durable\n",
                  rounds, acked_total, inflight_durable);
    assert_true(rounds >= 10);
    assert_true(acked_total > 0);
    free(st);
    free(a);
    free(b);
    free(ops);
    ft_rmtree(d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sigkill_at_random_points_loses_nothing_acknowledged),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
