/*
 * test_live_table.c - the process's tables of requests in flight
 * (src/core/live_table.h) across fork, on tables of the test's own:
 *   - a look-up of a table no take has used yet, in a thread beside a
 *     fork: the child takes that key (before, the look-up's chain lock
 *     could stay held in the child, the table being on no list for the
 *     fork handler to free, and the child's take hung);
 *   - a table whose first take met a fork between its going on the list
 *     and its flag saying so (the state a child gets then, made here by
 *     clearing the flag): its next take does not list it twice, and a
 *     fork after returns (before, the table became its own successor and
 *     the child's fork handler walked that loop for ever).
 */
/* ferry-test-labels: concurrent */
/* ferry-test-timeout: 120 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/live_table.h"
#include "ferry_test.h"

/* a node standing for the key it names */
typedef struct keyed {
    ferry__live_node node;
    const void *key;
} keyed;

static const void *keyed_key(const ferry__live_node *n)
{
    return ((const keyed *)(const void *)((const char *)n - offsetof(keyed, node)))->key;
}

/* the child's exit status; a child still running after 10 s is killed
 * and reported as hung (-1) */
static int wait_child(pid_t pid)
{
    for (int i = 0; i < 10000; i++) {
        int st = 0;
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (w < 0 && errno != EINTR)
            return -2;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

/* ---- a look-up beside a fork, on a table never taken ---- */
static ferry__live_table g_unused = FERRY__LIVE_TABLE_INIT(keyed_key);
static const char g_key[1];
static atomic_int g_stop;

static void *look_up(void *arg)
{
    (void)arg;
    while (!atomic_load(&g_stop))
        (void)ferry__live_held(&g_unused, g_key);
    return NULL;
}

static void a_look_up_beside_a_fork_leaves_no_lock_held_in_the_child(void **state)
{
    (void)state;
    pthread_t th;
    atomic_store(&g_stop, 0);
    assert_int_equal(pthread_create(&th, NULL, look_up, NULL), 0);
    int hung = 0, bad = 0;
    for (int i = 0; i < 300 && !hung; i++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            keyed k = {{NULL}, g_key};
            int taken = ferry__live_take(&g_unused, &k.node, NULL, NULL);
            if (taken)
                ferry__live_drop(&g_unused, &k.node);
            _exit(taken ? 0 : 3);
        }
        int rc = wait_child(pid);
        hung += rc == -1;
        bad += rc != 0 && rc != -1;
    }
    atomic_store(&g_stop, 1);
    pthread_join(th, NULL);
    if (hung)
        fail_msg("a child's take hung on a chain lock a look-up held at the fork");
    assert_int_equal(bad, 0);
    assert_int_equal(ferry__live_held(&g_unused, g_key), 0);
}

/* ---- a table listed, its flag clear ---- */
static ferry__live_table g_half = FERRY__LIVE_TABLE_INIT(keyed_key);

static void a_table_listed_with_its_flag_clear_is_listed_once(void **state)
{
    (void)state;
    static const char a[1], b[1];
    keyed ka = {{NULL}, a}, kb = {{NULL}, b};
    assert_int_equal(ferry__live_take(&g_half, &ka.node, NULL, NULL), 1);
    ferry__live_drop(&g_half, &ka.node);
    /* what a child sees when the fork fell between the push and the flag */
    atomic_store(&g_half.listed, 0);
    assert_int_equal(ferry__live_take(&g_half, &kb.node, NULL, NULL), 1);
    assert_int_equal(ferry__live_held(&g_half, b), 1);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) /* (the handler emptied the child's copy) */
        _exit(ferry__live_held(&g_half, b) ? 3 : 0);
    int rc = wait_child(pid);
    ferry__live_drop(&g_half, &kb.node);
    if (rc == -1)
        fail_msg("fork's child hung in the handler (the table listed twice: a loop)");
    assert_int_equal(rc, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_look_up_beside_a_fork_leaves_no_lock_held_in_the_child),
        cmocka_unit_test(a_table_listed_with_its_flag_clear_is_listed_once),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
