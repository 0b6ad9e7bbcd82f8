/*
 * remote_single.c - topology backend for one Redis/Valkey server (TCP or a
 * unix socket), or anything that looks like one (a cluster proxy).
 *
 * Invariant: one connection per session; a batch goes out as one pipeline
 * and costs one round trip. After a transport failure the connection is
 * closed (remote_conn.c) and connect() makes a fresh one.
 */
#include <errno.h>

#include "remote_int.h"

typedef struct single {
    const ferry__rconf *cf;
    ferry__rconn conn;
} single;

static int s_create(const ferry__rconf *cf, void **state, ferry__errbuf *eb)
{
    single *s = ferry__calloc(1, sizeof *s);
    if (!s)
        return ferry__err_set(eb, -ENOMEM, "remote: out of memory for a session");
    s->cf = cf;
    *state = s;
    return 0;
}

static int s_connect(void *state, ferry__errbuf *eb)
{
    single *s = state;
    const ferry__rurl *u = s->cf->url;
    return ferry__rconn_open(&s->conn, s->cf, u->is_unix ? NULL : u->host, u->port, 1, eb);
}

static int s_connected(void *state)
{
    return ((single *)state)->conn.c != NULL;
}

static int s_exec(void *state, ferry__rcmd *cmds, size_t n, uint64_t deadline_ns,
                  uint64_t *redirects, ferry__errbuf *eb)
{
    single *s = state;
    (void)redirects;
    ferry__rcmd *small[64], **ptrs = small;
    if (n > 64) {
        ptrs = ferry__malloc(n * sizeof *ptrs);
        if (!ptrs)
            return ferry__err_set(eb, -ENOMEM, "remote: out of memory for a %zu-command batch", n);
    }
    for (size_t i = 0; i < n; i++)
        ptrs[i] = &cmds[i];
    int rc = ferry__rconn_exchange(&s->conn, ptrs, n, deadline_ns, eb);
    if (ptrs != small)
        ferry__free(ptrs);
    return rc;
}

static int s_get_into(void *state, ferry__rget *g, uint64_t deadline_ns, ferry__errbuf *eb)
{
    return ferry__rconn_get_into(&((single *)state)->conn, g, deadline_ns, eb);
}

static void s_reset(void *state)
{
    ferry__rconn_close(&((single *)state)->conn);
}

static void s_destroy(void *state)
{
    if (!state)
        return;
    s_reset(state);
    ferry__free(state);
}

const ferry__rtopo_ops ferry__rtopo_single = {
    "single", s_create, s_connect, s_connected, s_exec, s_get_into, s_reset, s_destroy,
};
