/*
 * ferry/testctl.h - the one test-control entry point.
 *
 * What a test (or a fault drill) may switch on inside the library and a
 * program never needs: today, fault injection into the host device
 * backend. ferry.h does not include this header. A program that never
 * calls ferry_test_control pays one relaxed flag read per counted device
 * call and nothing else.
 */
#ifndef FERRY_TESTCTL_H
#define FERRY_TESTCTL_H

#include "core.h"
#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Host device fault injection. Counted calls, by kind:
 *  - ALLOC: ferry_device_alloc, ferry_device_host_alloc, ferry_device_pin;
 *    the Nth fails at once with fail_code, allocating nothing.
 *  - COPY: ferry_memcpy_*_async, ferry_device_upload/download (one each);
 *    the Nth is still queued but moves nothing, and its error is reported
 *    asynchronously (ferry/device.h); upload/download return it directly.
 *  - SYNC: ferry_stream_sync, ferry_event_sync (not the helpers' internal
 *    sync); the Nth still WAITS for the work (so the caller may release its
 *    buffers) and then returns fail_code.
 *  - EVENT: ferry_event_record; the Nth records nothing.
 * Only the Nth counted call fails (a retry succeeds). short_copy applies to
 * every copy larger than it: short_copy bytes move and FERRY_ESHORT is
 * reported as an asynchronous error. memset is never counted.
 */
enum ferry_fault_kind {
    FERRY_FAULT_ALLOC = 1u << 0,  /**< device alloc, host pinned alloc, pin */
    FERRY_FAULT_COPY = 1u << 1,   /**< any memcpy */
    FERRY_FAULT_SYNC = 1u << 2,   /**< stream/event synchronize */
    FERRY_FAULT_EVENT = 1u << 3   /**< event record */
};

/** The faults of one device (FERRY_TEST_DEVICE_FAULTS). */
typedef struct ferry_device_faults {
    size_t size;          /**< sizeof(ferry_device_faults) */
    uint64_t fail_nth;    /**< fail the Nth counted call (1-based), any value; 0 = never */
    /** code the failed call returns: a negative code, or 0 -> FERRY_EINJECTED;
     *  positive values -EINVAL */
    int fail_code;
    /** if nonzero, copies move at most this many bytes and report
     *  FERRY_ESHORT; any value */
    size_t short_copy;
    /** which calls fail_nth counts: FERRY_FAULT_* bits (0xf); 0 = all;
     *  other bits -EINVAL */
    unsigned fault_mask;
} ferry_device_faults;
#define FERRY_DEVICE_FAULTS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_device_faults), FERRY_FIELD(fail_nth) 0, \
     FERRY_FIELD(fail_code) 0, FERRY_FIELD(short_copy) 0, FERRY_FIELD(fault_mask) 0}

enum ferry_test_op {
    /**
     * target: a ferry_device *; arg: a const ferry_device_faults * (NULL,
     * or all zero, clears them). The counter restarts. Errors: -EINVAL
     * (NULL device, a size other than sizeof(ferry_device_faults), a
     * positive fail_code, unknown fault_mask bits: the message names the
     * field and the accepted range), FERRY_ENOTSUP on a device that is not
     * the host backend (unless clearing).
     */
    FERRY_TEST_DEVICE_FAULTS = 1
};

/**
 * Apply test control `op` (enum ferry_test_op) to target with arg, as the
 * op describes. Unknown op: -EINVAL. Not for production paths: it exists
 * so that tests can make the library's outside world fail on cue.
 */
FERRY_API int ferry_test_control(int op, void *target, const void *arg);

#ifdef __cplusplus
}
#endif
#endif
