/*
 * fuzz_remote_frame.c - the reply framer (ferry__rframe) and the pipelined
 * exchange that reads through it (ferry__rconn_exchange) on arbitrary
 * bytes from the "server".
 *
 * Byte 0 picks the bounds (reply_max from 16 bytes to 64 KiB, arrays
 * allowed or not) and byte 1 how many commands are in flight (1..4). The
 * rest is scanned by the framer, whole and then in pieces of every size
 * 1..7, which must agree; then it is queued on a socketpair and read by an
 * exchange. Checks: framing is the same however the bytes are split, a
 * framed reply never exceeds its bound, the exchange returns 0 only with
 * a reply for every command, and a failure closes the connection.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "remote/remote_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* frame as many replies as data holds, in pieces of step bytes: the
 * number framed, and the code of the first failure (0 for none) */
static size_t frame_all(const uint8_t *data, size_t size, size_t max, uint32_t elems,
                        size_t step, int *code, size_t *ends, size_t nends)
{
    ferry__rframe f;
    char what[200];
    ferry__rframe_start(&f, max, elems);
    size_t framed = 0, off = 0, start = 0;
    *code = 0;
    while (off < size) {
        size_t n = step ? (size - off < step ? size - off : step) : size - off, took = 0;
        int rc = ferry__rframe_scan(&f, data + off, n, &took, what, sizeof what);
        if (rc < 0) {
            *code = rc;
            return framed;
        }
        if (took > n)
            abort();
        off += took;
        if (rc == 1) {
            if (off - start > max)
                abort(); /* a reply over its bound got through */
            if (framed < nends)
                ends[framed] = off;
            framed++;
            start = off;
            ferry__rframe_start(&f, max, elems);
        } else if (took != n) {
            abort(); /* not done, yet it left bytes unread */
        }
    }
    return framed;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2 || size > 70000)
        return 0;
    size_t max = (size_t)16 << (data[0] & 15);
    if (max > FERRY__RREPLY_SMALL)
        max = FERRY__RREPLY_SMALL;
    uint32_t elems = (data[0] & 16) ? 64 : 0;
    size_t ncmd = (size_t)(data[1] & 3) + 1;
    data += 2;
    size -= 2;

    int code0;
    size_t ends0[8], ends1[8];
    size_t framed0 = frame_all(data, size, max, elems, 0, &code0, ends0, 8);
    for (size_t step = 1; step <= 7; step++) {
        int code1;
        size_t framed1 = frame_all(data, size, max, elems, step, &code1, ends1, 8);
        if (framed1 != framed0 || code1 != code0)
            abort();
        for (size_t i = 0; i < framed0 && i < 8; i++)
            if (ends0[i] != ends1[i])
                abort();
    }

    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
        return 0;
    int big = 1 << 20;
    setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    for (size_t off = 0; off < size;) {
        ssize_t n = write(sv[1], data + off, size - off);
        if (n <= 0)
            break;
        off += (size_t)n;
    }
    shutdown(sv[1], SHUT_WR);
    redisContext *ctx = redisConnectFd(sv[0]);
    if (!ctx) {
        close(sv[0]);
        close(sv[1]);
        return 0;
    }
    ferry__rconn c;
    memset(&c, 0, sizeof c);
    c.c = ctx;
    c.port = 1;
    c.timeout_ms = 1000;
    memcpy(c.host, "fuzz", 5);
    ferry__rcmd cmds[4], *ptrs[4];
    memset(cmds, 0, sizeof cmds);
    for (size_t i = 0; i < ncmd; i++) {
        cmds[i].argc = 1;
        cmds[i].argv[0] = "PING";
        cmds[i].argvlen[0] = 4;
        cmds[i].key_arg = -1;
        cmds[i].reply_max = max;
        cmds[i].reply_elems = elems;
        ptrs[i] = &cmds[i];
    }
    ferry__errbuf eb;
    int rc = ferry__rconn_exchange(&c, ptrs, ncmd, 0, &eb);
    if (rc == 0) {
        for (size_t i = 0; i < ncmd; i++)
            if (!cmds[i].reply)
                abort();
        if (framed0 < ncmd)
            abort(); /* hiredis parsed more than the framer let through */
        ferry__rcmd_release(cmds, ncmd);
    } else if (rc > 0 || c.c != NULL) {
        abort();
    }
    for (size_t i = 0; i < ncmd; i++)
        if (cmds[i].reply)
            abort(); /* a failure keeps no reply */
    ferry__rconn_close(&c);
    close(sv[1]);
    return 0;
}
