/*
 * gds_live.c - which asynchronous host requests are in flight, in the
 * whole process.
 *
 * Invariant: a ferry_gds_req is in this table (core's live_table.h, which
 * says why a table for the process, keyed by the request's address) from
 * the moment a ferry_gds_submit accepts it until it is reaped or its
 * context closes, and accepting it is one look-up-and-insert under its
 * chain's lock: of any number of threads submitting one request at once,
 * to one context or to several, exactly one takes it and every other
 * learns which context holds it (FERRY_EBUSY naming that). A request's
 * priv_ is one word, the context's, so its node is in a record of the
 * hop's (ferry__gds_live) that names the request and the context.
 */
#include <stddef.h>

#include "gds_impl.h"

static const ferry__gds_live *rec_of(const ferry__live_node *n)
{
    return (const ferry__gds_live *)(const void *)((const char *)n -
                                                   offsetof(ferry__gds_live, node));
}

static const void *rec_key(const ferry__live_node *n)
{
    return rec_of(n)->req;
}

static ferry__live_table g_live = FERRY__LIVE_TABLE_INIT(rec_key);

/* (under the holder's chain lock: its hop is not retired meanwhile) */
static void owner_seen(const ferry__live_node *holder, void *arg)
{
    *(ferry_gds **)arg = rec_of(holder)->owner;
}

ferry_gds *ferry__gds_live_take(ferry__gds_live *e)
{
    ferry_gds *owner = NULL;
    if (ferry__live_take(&g_live, &e->node, owner_seen, &owner))
        return NULL;
    FERRY__ASSERT(owner);
    return owner;
}

void ferry__gds_live_drop(ferry__gds_live *e)
{
    ferry__live_drop(&g_live, &e->node);
}

unsigned ferry__gds_live_longest(void)
{
    return ferry__live_longest(&g_live);
}
