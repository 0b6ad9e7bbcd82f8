/*
 * ferry/core.h - version, error codes, logging and the allocation hook.
 *
 * Conventions for the whole library (see docs/ARCHITECTURE.md):
 *  - Functions return int: 0 (or a count) on success, a negative code on
 *    failure: -errno for system errors, FERRY_E* (below -4096) for library
 *    errors. ferry_strerror() names any of them and never returns NULL.
 *  - Out-parameters are left untouched on failure.
 *  - Every failure also records a message naming what and where (file,
 *    offset, size, cause). Handles keep their own last message
 *    (ferry_<object>_last_error()); ferry_last_error() is the calling
 *    thread's most recent one, whatever the handle.
 *  - Objects are opaque; destroy/close(NULL) does nothing; option structs
 *    carry their size first and have an _INIT macro.
 */
#ifndef FERRY_CORE_H
#define FERRY_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(FERRY_BUILDING) && defined(__GNUC__)
#define FERRY_API __attribute__((visibility("default")))
#else
#define FERRY_API
#endif

/*
 * FERRY_FIELD(member) opens one member's value in an _INIT macro. C gets a
 * designated initializer (".member ="), so the compiler checks each name
 * against the struct; C++ before C++20 has no designated lists, so there
 * the same values stand positionally. Every _INIT therefore names every
 * member, in declaration order: both languages see a complete list.
 */
#ifdef __cplusplus
#define FERRY_FIELD(member)
#else
#define FERRY_FIELD(member) .member =
#endif

#define FERRY_VERSION_MAJOR 0
#define FERRY_VERSION_MINOR 1
#define FERRY_VERSION_PATCH 0
#define FERRY_VERSION_STRING "0.1.0"
/** MAJOR * 10000 + MINOR * 100 + PATCH, for compile-time comparisons. */
#define FERRY_VERSION_NUMBER \
    (FERRY_VERSION_MAJOR * 10000 + FERRY_VERSION_MINOR * 100 + FERRY_VERSION_PATCH)

/** The library's version string at run time ("0.1.0"). */
FERRY_API const char *ferry_version(void);
/** The library's FERRY_VERSION_NUMBER at run time. */
FERRY_API int ferry_version_number(void);

/*
 * Library error codes. One list generates the enum, ferry_strerror() and
 * ferry_err_name(). New codes are appended at the end; values never change.
 */
#define FERRY_ERRORS(X)                                                         \
    X(ENODEV, -4097, "no such device, driver or library on this host")          \
    X(ENOTSUP, -4098, "operation not supported by this backend")                \
    X(EDRIVER, -4099, "the device or storage driver reported an error")         \
    X(ESTATE, -4100, "object is in the wrong state for this call")              \
    X(EALIGN, -4101, "buffer, offset or length not aligned for direct I/O")     \
    X(ESHORT, -4102, "short transfer that could not be completed")              \
    X(ENOTFOUND, -4103, "key does not exist")                                   \
    X(ELOCKED, -4104, "key is locked")                                          \
    X(ENOTREADABLE, -4105, "key is not readable")                               \
    X(ENOTWRITABLE, -4106, "key is not writable")                               \
    X(ECORRUPT, -4107, "stored data failed its checksum or format check")       \
    X(EVERSION, -4108, "stored data has an unsupported format version")         \
    X(EPARSE, -4109, "malformed input")                                         \
    X(EMISMATCH, -4110, "layout or geometry does not match")                    \
    X(ENOSPACE, -4111, "out of space in the pool or slab")                      \
    X(EREMOTE, -4112, "the remote tier reported an error")                      \
    X(EINJECTED, -4113, "fault injected by a test")                             \
    X(EBOUNDS, -4114, "address or range outside every registered region")       \
    X(EEXIST, -4115, "already registered or already exists")                   \
    X(EBUSY, -4116, "the directory or resource is owned by another opener")     \
    X(ECONN, -4117, "the connection to the server failed, was refused or was lost")

enum ferry_error {
#define FERRY__ERR_ENUM(name, value, text) FERRY_##name = (value),
    FERRY_ERRORS(FERRY__ERR_ENUM)
#undef FERRY__ERR_ENUM
    FERRY_OK = 0
};

/** A human description of any code: 0, -errno or FERRY_E*. Never NULL. */
FERRY_API const char *ferry_strerror(int code);
/** The code's symbolic name ("FERRY_ENOTFOUND", "EIO", ...). Never NULL. */
FERRY_API const char *ferry_err_name(int code);
/**
 * The message of the most recent failure in the calling thread, "" if none.
 * Valid until the thread's next failing call into ferry.
 */
FERRY_API const char *ferry_last_error(void);

/* ---- logging ---- */
enum ferry_log_level {
    FERRY_LOG_OFF = 0,
    FERRY_LOG_ERROR = 1,
    FERRY_LOG_WARN = 2,
    FERRY_LOG_INFO = 3,
    FERRY_LOG_DEBUG = 4,
    FERRY_LOG_TRACE = 5
};
/** Where log lines go. msg has no trailing newline. Must be thread-safe. */
typedef void (*ferry_log_fn)(int level, const char *msg, void *ctx);
/**
 * The current level. Initially taken from env FERRY_LOG
 * (off|error|warn|info|debug|trace or 0..5; default warn).
 */
FERRY_API int ferry_log_get_level(void);
/**
 * Set the level. A level out of FERRY_LOG_OFF..FERRY_LOG_TRACE is clamped
 * to the nearer end (-1 reads as off, 9 as trace); nothing is returned, so
 * validate a user's value with ferry_log_level_parse first. Thread-safe:
 * any thread may log while another sets the level.
 */
FERRY_API void ferry_log_set_level(int level);
/**
 * Route log lines to fn, called with ctx (fn NULL restores stderr).
 * Thread-safe, while other threads log and against other setters: the pair
 * (fn, ctx) is replaced as one, so a logging thread calls either the old
 * fn with the old ctx or the new fn with the new ctx, never a mix. When
 * this returns, no thread is inside the previous callback nor will enter
 * it: the previous ctx may be freed then. It waits for the calls of the
 * previous callback in progress, so it must not be called from inside a
 * log callback (it would wait for itself).
 */
FERRY_API void ferry_log_set_callback(ferry_log_fn fn, void *ctx);
/** Parse "warn", "debug", "3", ...; -1 when unknown. */
FERRY_API int ferry_log_level_parse(const char *s);

/* ---- allocation hook ---- */
/**
 * Every allocation ferry makes for its own bookkeeping goes through these.
 * aligned_alloc must accept any power-of-two alignment >= sizeof(void*) and
 * any size; free must accept pointers from malloc, calloc, realloc and
 * aligned_alloc. Tests use it to inject out-of-memory.
 */
typedef struct ferry_allocator {
    void *(*malloc)(size_t size, void *ctx);
    void *(*calloc)(size_t n, size_t size, void *ctx);
    void *(*realloc)(void *p, size_t size, void *ctx);
    void *(*aligned_alloc)(size_t alignment, size_t size, void *ctx);
    void (*free)(void *p, void *ctx);
    void *ctx;
} ferry_allocator;
/**
 * Install a (NULL: the default, libc) allocator. Not thread-safe: call
 * before any other ferry call or when no ferry object is alive.
 */
FERRY_API void ferry_set_allocator(const ferry_allocator *a);

/**
 * Parse "8M", "256k", "2G", "4096", "1.5G" into bytes (suffixes K, M, G, T
 * are powers of 1024, then "iB" or "B" optional; digits alone are taken
 * exactly, a fraction is rounded to the nearest byte). Digits first: no
 * sign, space, hexadecimal or exponent (as the CLI and the daemon's
 * config). A lowercase "b" ("64Gb", "8Mib", "1kb", "100b") is refused,
 * not read as bytes: it means bits to many; the message says to write G,
 * GiB or GB. -EINVAL if bad or above 2^64 - 1 bytes (*out untouched, the
 * message quotes s).
 */
FERRY_API int ferry_parse_size(const char *s, uint64_t *out);

#ifdef __cplusplus
}
#endif
#endif
