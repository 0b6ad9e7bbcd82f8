/*
 * test_core.c - error codes, messages, logging levels, the allocation hook,
 * size parsing and the version.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
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

static void version_matches_macros(void **state)
{
    (void)state;
    assert_string_equal(ferry_version(), FERRY_VERSION_STRING);
    assert_int_equal(ferry_version_number(), FERRY_VERSION_NUMBER);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(strerror_never_null_and_names_codes),
        cmocka_unit_test(error_messages_go_to_handle_and_thread),
        cmocka_unit_test(log_levels_filter_and_parse),
        cmocka_unit_test(allocation_hook_injects_oom),
        cmocka_unit_test(sizes_parse_with_suffixes),
        cmocka_unit_test(version_matches_macros),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
