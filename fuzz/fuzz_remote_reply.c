/*
 * fuzz_remote_reply.c - the direct GET reply reader (ferry__rconn_get_into)
 * on arbitrary bytes from the "server".
 *
 * The bytes are queued on one end of a socketpair, which is then shut for
 * writing; the reader runs on the other end through a hiredis context made
 * with redisConnectFd. Byte 0 picks the destination capacity. Checks: the
 * call returns 0 with a known outcome or a negative code (then the
 * connection is closed); a hit never claims more bytes than the capacity.
 * The value format is the one ferry writes (layout "L", key "k"), so a
 * well-formed hit needs a correct header and checksums.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "remote/remote_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 60000)
        return 0;
    size_t cap = (size_t)data[0] * 16;
    data++;
    size--;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
        return 0;
    int big = 1 << 20;
    setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    size_t off = 0;
    while (off < size) {
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
    struct timeval tv = {1, 0};
    redisSetTimeout(ctx, tv);
    ferry__rconn c;
    memset(&c, 0, sizeof c);
    c.c = ctx;
    c.port = 1;
    c.timeout_ms = 1000;
    memcpy(c.host, "fuzz", 5);
    uint8_t *dst = malloc(cap ? cap : 1);
    ferry__rget g;
    memset(&g, 0, sizeof g);
    g.key = "k";
    g.key_len = 1;
    g.layout = "L";
    g.layout_len = 1;
    g.key_sum = ferry__rvalue_key_sum("k", 1);
    g.dst = dst;
    g.cap = cap;
    ferry__errbuf eb;
    int rc = ferry__rconn_get_into(&c, &g, 0, &eb);
    if (rc == 0) {
        if (g.kind != FERRY__RGET_VALUE && g.kind != FERRY__RGET_NIL &&
            g.kind != FERRY__RGET_ERROR)
            abort();
        if (g.kind == FERRY__RGET_VALUE && g.code == 0 && g.payload_len > cap)
            abort();
    } else if (rc > 0 || c.c != NULL) {
        abort(); /* a failure closes the connection */
    }
    ferry__rconn_close(&c); /* redisFree closes sv[0] */
    close(sv[1]);
    free(dst);
    return 0;
}
