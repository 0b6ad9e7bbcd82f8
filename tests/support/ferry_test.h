/*
 * ferry_test.h - shared helpers for the cmocka tests.
 *
 * Include after <stdarg.h>, <stddef.h>, <setjmp.h> (cmocka's prerequisites);
 * this header includes them itself for convenience.
 */
#ifndef FERRY_TEST_H
#define FERRY_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <cmocka.h>

#include "ferry.h"
#include "ferry/testctl.h"

/* FT_UNDER_TSAN: 1 in a ThreadSanitizer build (GCC's and clang's ways of
 * saying so), else 0, for the tests it cannot run: its runtime kills a
 * child that starts threads after a multi-threaded fork, and sees only
 * fork(), so a _Fork child's exit reports the parent's threads as leaked.
 * Each skip says which reason is its own. */
#if defined(__SANITIZE_THREAD__)
#define FT_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FT_UNDER_TSAN 1
#endif
#endif
#ifndef FT_UNDER_TSAN
#define FT_UNDER_TSAN 0
#endif
/* FT_UNDER_ASAN: 1 in an AddressSanitizer build, else 0 */
#if defined(__SANITIZE_ADDRESS__)
#define FT_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FT_UNDER_ASAN 1
#endif
#endif
#ifndef FT_UNDER_ASAN
#define FT_UNDER_ASAN 0
#endif

/* Fill buf's whole 8-byte words with a mix of their index from seed
 * (splitmix64: no period, so any 8 bytes name where they came from). */
void ft_fill_mixed(void *buf, size_t bytes, uint64_t seed);

/* ---- allocation fault injection through ferry_set_allocator ---- */
/* Install a counting allocator; allocation number fail_at (1-based) and,
 * when sticky, every later one returns NULL. fail_at 0 = never fail. */
void ft_alloc_install(uint64_t fail_at, int sticky);
/* With the allocator installed: every malloc or calloc of exactly n bytes fails
 * (0: none), beside fail_at's count. */
void ft_alloc_fail_size(size_t n);
/* Restore the default allocator. */
void ft_alloc_reset(void);
/* Allocations made since install, and blocks still live (leaks if > 0 at the end). */
uint64_t ft_alloc_count(void);
int64_t ft_alloc_live(void);
/* Number of allocations that failed. */
uint64_t ft_alloc_failures(void);
/*
 * Out of memory at every allocation, one run each: run(ctx) with
 * allocation n failing (and, with FT_OOM_STICKY, every later one) for n =
 * 1, 2, ... until a run in which no allocation was refused, at most max
 * runs. A run returns 0 or more, or -ENOMEM when an allocation it needed
 * was refused (one it could do without may be refused and the run still
 * succeed; with FT_OOM_STRICT it may not), and leaves no block allocated.
 * Fails the test when no run was clean within max, or when none ran out of
 * memory at all (the loop would test nothing). Returns the clean run's n.
 *
 * A run sets up and tears down around the calls under test with
 * ft_oom_pause() / ft_oom_resume(): while paused, allocations go through
 * the same counting allocator (every block is freed by the allocator that
 * made it, and the live count covers the whole run) but are never refused
 * and do not count towards n. A run starts armed.
 */
#define FT_OOM_STICKY 1
#define FT_OOM_STRICT 2
uint64_t ft_oom_each(uint64_t max, int flags, int (*run)(void *ctx), void *ctx);
void ft_oom_pause(void);
/* With the counting allocator installed: the k-th allocation from now (1:
 * the very next) fails, once; the counts go on (no re-install). */
void ft_alloc_fail_next(uint64_t k);
void ft_oom_resume(void);

/* ---- host device faults ---- */
/* ferry_test_control(FERRY_TEST_DEVICE_FAULTS, dev, ...) with these values
 * (all zero clears); returns its code. */
int ft_device_faults(ferry_device *dev, uint64_t fail_nth, int fail_code, size_t short_copy,
                     unsigned fault_mask);

/* ---- the KV tests' layout ---- */
/* 2 layers, K and V, 2 heads of token_bytes / 4 bf16 values: token_bytes
 * per token and plane (64 gives 16-token chunks of 4 KiB) */
ferry_kv_layout ft_kv_layout(unsigned token_bytes);
/* a contiguous host buffer of that layout at img, capacity tokens */
ferry_kv_buffer ft_kv_host_buffer(void *img, uint64_t capacity, unsigned token_bytes);

/* ---- a deadline for threaded KV tests (kv_watchdog.c) ---- */
/* Unless ft_kv_watchdog_stop() comes first, `seconds` without an
 * ft_kv_watchdog_kick() print "what: no progress", the queues and counters
 * of kv (may be NULL) and exit the test with 1: a deadlock fails with a
 * message instead of hanging until CTest's timeout. One at a time. */
void ft_kv_watchdog_start(ferry_kv *kv, unsigned seconds, const char *what);
void ft_kv_watchdog_kick(void);
void ft_kv_watchdog_stop(void);

/* ---- temporary directories ---- */
/* mkdtemp under $FERRY_TEST_TMPDIR or /var/tmp (a real disk, O_DIRECT-capable)
 * into buf; returns buf. */
char *ft_tmpdir(char *buf, size_t len);
/* rm -rf path (only paths ft_tmpdir made). */
void ft_rmtree(const char *path);

/* Fill with a position-dependent pattern: byte i = (seed + i) % 251. */
void ft_fill_pattern(void *buf, size_t len, unsigned seed);
/* Index of the first byte that differs from the pattern, or -1. */
long ft_check_pattern(const void *buf, size_t len, unsigned seed);

/* ---- forked children ---- */
/* A thread body: sleeps 300 ms, then writes one byte to *(int *)fd_ptr
 * (lets a stand-in driver blocked on a pipe go on). */
void *ft_write_byte_after_300ms(void *fd_ptr);
/* Waits for pid: its exit status, or -(signal) when a signal ended it. */
int ft_child_exit(pid_t pid);

/* The child pid exits 0; a signal (SIGALRM: it hung) fails naming what */
#define FT_ASSERT_CHILD_OK(pid, what)                                                \
    do {                                                                           \
        int ft_x_ = ft_child_exit(pid);                                            \
        if (ft_x_ < 0)                                                             \
            fail_msg("%s died of signal %d (SIGALRM: it hung)", (what), -ft_x_);   \
        assert_int_equal(ft_x_, 0);                                                \
    } while (0)

#define FT_ASSERT_OK(expr)                                                        \
    do {                                                                          \
        int ft_rc_ = (expr);                                                      \
        if (ft_rc_ < 0)                                                           \
            fail_msg("%s -> %d (%s): %s", #expr, ft_rc_, ferry_strerror(ft_rc_),  \
                     ferry_last_error());                                         \
    } while (0)

#endif
