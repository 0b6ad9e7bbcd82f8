/*
 * live.c - which asynchronous requests are in flight, in the whole process.
 *
 * Invariant: a ferry_io_req is in this table (core's live_table.h, which
 * says why a table for the process, keyed by the request's address) from
 * the moment a ferry_io_submit accepts it until it is reaped or its engine
 * closes, and accepting it is one look-up-and-insert under its chain's
 * lock: of any number of threads submitting one request at once, to one
 * engine or to several, exactly one takes it, and a request in flight on
 * one engine submitted to another is known as busy there. The node is the
 * request's own private words (ferry__rq.live), so submit still never
 * allocates; and as those words are full, the key is the request the node
 * is in, not a word of its own.
 */
#include <stddef.h>

#include "io_impl.h"
#include "live_table.h"

static const void *rq_key(const ferry__live_node *n)
{
    return (const char *)n - offsetof(ferry__rq, live) - offsetof(ferry_io_req, priv_);
}

static ferry__live_table g_live = FERRY__LIVE_TABLE_INIT(rq_key);

int ferry__io_live_take(ferry_io_req *r)
{
    return ferry__live_take(&g_live, &ferry__rq_of(r)->live, NULL, NULL);
}

int ferry__io_live_held(const ferry_io_req *r)
{
    return ferry__live_held(&g_live, r);
}

void ferry__io_live_drop(ferry_io_req *r)
{
    ferry__live_drop(&g_live, &ferry__rq_of(r)->live);
}

unsigned ferry__io_live_longest(void)
{
    return ferry__live_longest(&g_live);
}
