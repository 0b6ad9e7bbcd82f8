/*
 * remote_cluster.c - topology backend for a Redis Cluster.
 *
 * Invariant: every command goes to the master that owns its key's slot as
 * far as this session knows; when the session's map is wrong the cluster
 * says so (MOVED: the slot has a new owner, remembered at once and the
 * whole map re-read before the next batch; ASK: this one key is being
 * migrated, ask the target once after ASKING) and the command is sent
 * again, at most FERRY__RCLUSTER_HOPS times. So a resharding cluster costs
 * extra round trips, never a wrong answer. A batch is split by node, every
 * node's pipeline is written out before any reply is read, so the nodes
 * answer in parallel (one round trip for the batch). After a transport
 * failure every connection of the session is closed, because replies left
 * unread on another node would answer the next commands.
 *
 * The slot of a key is CRC16-CCITT (XMODEM) of the key, or of the first
 * non-empty {hash tag} in it, mod 16384, exactly as Redis computes it
 * (cluster.c keyHashSlot). Node connections open lazily; only masters are
 * used (no reads from replicas). Cluster mode has only database 0.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "remote_int.h"

#define FERRY__RCLUSTER_HOPS 5
#define NO_NODE 0xffffu

uint16_t ferry__rcluster_crc16(const void *buf, size_t len)
{
    const uint8_t *p = buf;
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)(p[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

unsigned ferry_remote_key_slot(const void *key, size_t len)
{
    const char *k = key;
    if (!k)
        len = 0;
    const char *open = len ? memchr(k, '{', len) : NULL;
    if (open) {
        size_t s = (size_t)(open - k);
        const char *close = memchr(open + 1, '}', len - s - 1);
        if (close && close > open + 1)
            return ferry__rcluster_crc16(open + 1, (size_t)(close - open - 1)) & 16383u;
    }
    return ferry__rcluster_crc16(k ? k : "", len) & 16383u;
}

/* CLUSTER SLOTS on c before deadline_ns (0: its command timeout); on 0
 * cmd holds the reply, for ferry__rcmd_release */
static int cluster_slots(ferry__rconn *c, ferry__rcmd *cmd, uint64_t deadline_ns,
                         ferry__errbuf *eb)
{
    ferry__rcmd *p = cmd;
    *cmd = (ferry__rcmd){0};
    cmd->key_arg = -1;
    cmd->argc = 2;
    cmd->argv[0] = "CLUSTER";
    cmd->argvlen[0] = 7;
    cmd->argv[1] = "SLOTS";
    cmd->argvlen[1] = 5;
    cmd->reply_max = FERRY__RREPLY_SLOTS;
    cmd->reply_elems = FERRY__RREPLY_SLOTS_ELEMS;
    return ferry__rconn_exchange(c, &p, 1, deadline_ns, eb);
}

int ferry__rcluster_probe(ferry__rconn *c, ferry__errbuf *eb)
{
    ferry__rcmd cmd;
    int rc = cluster_slots(c, &cmd, 0, eb);
    if (rc)
        return rc;
    int is = cmd.reply->type == REDIS_REPLY_ARRAY;
    if (!is)
        FERRY_LOGD("remote %s:%d: CLUSTER SLOTS answered %s: using the single-server path",
                   c->host, c->port, cmd.reply->type == REDIS_REPLY_ERROR ? cmd.reply->str : "?");
    ferry__rcmd_release(&cmd, 1);
    return is;
}

typedef struct cnode {
    char host[FERRY__RURL_HOST_MAX];
    int port;
    ferry__rconn conn;
} cnode;

typedef struct cluster {
    const ferry__rconf *cf;
    cnode *nodes;
    size_t nnodes, cap;
    int have_map, need_refresh;
    uint16_t slot_node[FERRY_REMOTE_SLOTS];
} cluster;

static int node_index(cluster *c, const char *host, size_t hlen, int port, ferry__errbuf *eb)
{
    if (hlen == 0 || (hlen == 1 && host[0] == '?')) {
        /* the node does not know its own address: it is the seed's */
        host = c->cf->url->host;
        hlen = strlen(host);
    }
    if (hlen >= FERRY__RURL_HOST_MAX || port <= 0 || port > 65535)
        return ferry__err_set(eb, FERRY_EREMOTE, "remote cluster: bad node address '%.*s:%d'",
                              (int)FERRY__MIN(hlen, 64), host, port);
    for (size_t i = 0; i < c->nnodes; i++)
        if (c->nodes[i].port == port && strlen(c->nodes[i].host) == hlen &&
            !memcmp(c->nodes[i].host, host, hlen))
            return (int)i;
    if (c->nnodes >= NO_NODE - 1)
        return ferry__err_set(eb, FERRY_EREMOTE, "remote cluster: too many nodes");
    if (c->nnodes == c->cap) {
        size_t nc = c->cap ? c->cap * 2 : 8;
        cnode *nn = ferry__realloc(c->nodes, nc * sizeof *nn);
        if (!nn)
            return ferry__err_set(eb, -ENOMEM, "remote cluster: out of memory for %zu nodes", nc);
        c->nodes = nn;
        c->cap = nc;
    }
    cnode *n = &c->nodes[c->nnodes];
    memset(n, 0, sizeof *n);
    memcpy(n->host, host, hlen);
    n->host[hlen] = 0;
    n->port = port;
    return (int)c->nnodes++;
}

static int node_conn(cluster *c, int i, ferry__errbuf *eb)
{
    cnode *n = &c->nodes[i];
    if (n->conn.c)
        return 0;
    return ferry__rconn_open(&n->conn, c->cf, n->host, n->port, 0, eb);
}

static int parse_slots(cluster *c, const redisReply *r, ferry__errbuf *eb)
{
    for (size_t s = 0; s < FERRY_REMOTE_SLOTS; s++)
        c->slot_node[s] = NO_NODE;
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
            e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
            return ferry__err_set(eb, FERRY_EREMOTE,
                                  "remote cluster: CLUSTER SLOTS entry %zu is malformed", i);
        long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        if (lo < 0 || hi < lo || hi >= (long long)FERRY_REMOTE_SLOTS)
            return ferry__err_set(eb, FERRY_EREMOTE,
                                  "remote cluster: CLUSTER SLOTS range %lld-%lld is invalid", lo,
                                  hi);
        const redisReply *m = e->element[2];
        int idx = node_index(c, m->element[0]->str, m->element[0]->len,
                             (int)m->element[1]->integer, eb);
        if (idx < 0)
            return idx;
        for (long long s = lo; s <= hi; s++)
            c->slot_node[s] = (uint16_t)idx;
    }
    return 0;
}

/* read the slot map from the first node that answers, before deadline_ns
 * (0: each node its own command timeout) */
static int refresh(cluster *c, uint64_t deadline_ns, ferry__errbuf *eb)
{
    int rc = -ENOTCONN;
    for (size_t i = 0; i < c->nnodes; i++) {
        rc = node_conn(c, (int)i, eb);
        if (rc)
            continue;
        ferry__rcmd cmd;
        rc = cluster_slots(&c->nodes[i].conn, &cmd, deadline_ns, eb);
        if (rc)
            continue;
        if (cmd.reply->type != REDIS_REPLY_ARRAY) {
            rc = ferry__err_set(eb, FERRY_EREMOTE, "remote cluster %s:%d: CLUSTER SLOTS: %s",
                                c->nodes[i].host, c->nodes[i].port,
                                cmd.reply->type == REDIS_REPLY_ERROR ? cmd.reply->str
                                                                     : "not an array");
            ferry__rcmd_release(&cmd, 1);
            return rc;
        }
        rc = parse_slots(c, cmd.reply, eb);
        ferry__rcmd_release(&cmd, 1);
        if (rc)
            return rc;
        c->have_map = 1;
        c->need_refresh = 0;
        return 0;
    }
    return rc;
}

static int c_create(const ferry__rconf *cf, void **state, ferry__errbuf *eb)
{
    cluster *c = ferry__calloc(1, sizeof *c);
    if (!c)
        return ferry__err_set(eb, -ENOMEM, "remote: out of memory for a cluster session");
    c->cf = cf;
    int rc = node_index(c, cf->url->host, strlen(cf->url->host), cf->url->port, eb);
    if (rc < 0) {
        ferry__free(c);
        return rc;
    }
    for (size_t s = 0; s < FERRY_REMOTE_SLOTS; s++)
        c->slot_node[s] = NO_NODE;
    *state = c;
    return 0;
}

static int c_connect(void *state, ferry__errbuf *eb)
{
    return refresh(state, 0, eb);
}

static int c_connected(void *state)
{
    return ((cluster *)state)->have_map;
}

static void c_reset(void *state)
{
    cluster *c = state;
    for (size_t i = 0; i < c->nnodes; i++)
        ferry__rconn_close(&c->nodes[i].conn);
    c->have_map = 0;
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381": 1 MOVED, 2 ASK,
 * 0 neither; *node set for 1 and 2 */
static int redirection(cluster *c, const redisReply *r, unsigned *slot, int *node,
                       ferry__errbuf *eb)
{
    if (r->type != REDIS_REPLY_ERROR)
        return 0;
    int kind;
    const char *p;
    if (!strncmp(r->str, "MOVED ", 6)) {
        kind = 1;
        p = r->str + 6;
    } else if (!strncmp(r->str, "ASK ", 4)) {
        kind = 2;
        p = r->str + 4;
    } else
        return 0;
    char *e;
    unsigned long s = strtoul(p, &e, 10);
    if (e == p || *e != ' ' || s >= FERRY_REMOTE_SLOTS)
        return ferry__err_set(eb, FERRY_EREMOTE, "remote cluster: malformed redirection '%s'",
                              r->str);
    const char *addr = e + 1, *colon = strrchr(addr, ':');
    if (!colon)
        return ferry__err_set(eb, FERRY_EREMOTE, "remote cluster: malformed redirection '%s'",
                              r->str);
    int port = atoi(colon + 1);
    int idx = node_index(c, addr, (size_t)(colon - addr), port, eb);
    if (idx < 0)
        return idx;
    *slot = (unsigned)s;
    *node = idx;
    return kind;
}

/*
 * One hop of c_exec: group the commands not done by node (ASKING before
 * each one to ask), send every node's pipeline, then read them all: the
 * nodes work in parallel, one round trip for the batch. On a failure the
 * commands' replies are released; after a transport failure the session
 * starts afresh, because other nodes may hold replies it will not read.
 */
static int exchange(cluster *c, ferry__rcmd *cmds, size_t n, const int *target,
                    const unsigned char *ask, ferry__rcmd *asking, ferry__rcmd **ptrs,
                    uint64_t deadline_ns, ferry__errbuf *eb)
{
    const unsigned char *done = ask + n;
    int rc = 0;
    size_t m = 0, nn = c->nnodes;
    size_t *start = ferry__calloc(2 * nn + 1, sizeof *start), *cnt = start + nn;
    if (!start) {
        ferry__rcmd_release(cmds, n);
        return ferry__err_set(eb, -ENOMEM, "remote cluster: out of memory");
    }
    for (size_t nd = 0; nd < nn; nd++) {
        start[nd] = m;
        for (size_t i = 0; i < n; i++) {
            if (done[i] || target[i] != (int)nd)
                continue;
            if (ask[i])
                ptrs[m++] = &asking[i];
            ptrs[m++] = &cmds[i];
        }
        cnt[nd] = m - start[nd];
    }
    for (size_t nd = 0; nd < nn && rc == 0; nd++) {
        if (!cnt[nd])
            continue;
        rc = node_conn(c, (int)nd, eb);
        if (rc == 0)
            rc = ferry__rconn_send(&c->nodes[nd].conn, ptrs + start[nd], cnt[nd], deadline_ns,
                                   eb);
    }
    for (size_t nd = 0; nd < nn && rc == 0; nd++)
        if (cnt[nd])
            rc = ferry__rconn_recv(&c->nodes[nd].conn, ptrs + start[nd], cnt[nd], deadline_ns,
                                   eb);
    ferry__free(start);
    ferry__rcmd_release(asking, n);
    if (rc) {
        ferry__rcmd_release(cmds, n);
        c_reset(c);
    }
    return rc;
}

static int c_exec(void *state, ferry__rcmd *cmds, size_t n, uint64_t deadline_ns,
                  uint64_t *redirects, ferry__errbuf *eb)
{
    cluster *c = state;
    int rc = 0;
    if (c->need_refresh || !c->have_map) {
        rc = refresh(c, deadline_ns, eb);
        if (rc)
            return rc;
    }
    /* per command: target node (-1 = route by slot), ask flag, done flag */
    int *target = ferry__malloc(n * sizeof *target);
    unsigned char *ask = ferry__calloc(n ? n : 1, 2);
    ferry__rcmd **ptrs = ferry__malloc(2 * n * sizeof *ptrs);
    ferry__rcmd *asking = ferry__calloc(n ? n : 1, sizeof *asking);
    if (!target || !ask || !ptrs || !asking) {
        rc = ferry__err_set(eb, -ENOMEM, "remote cluster: out of memory for a %zu-command batch",
                            n);
        goto out;
    }
    unsigned char *done = ask + n;
    for (size_t i = 0; i < n; i++) {
        asking[i].argc = 1;
        asking[i].argv[0] = "ASKING";
        asking[i].argvlen[0] = 6;
        asking[i].key_arg = -1;
        cmds[i].reply = NULL;
    }
    size_t left = n;
    for (int hop = 0; left && hop <= FERRY__RCLUSTER_HOPS; hop++) {
        for (size_t i = 0; i < n; i++) {
            if (done[i] || ask[i])
                continue;
            int k = cmds[i].key_arg;
            unsigned s = k >= 0 ? ferry_remote_key_slot(cmds[i].argv[k], cmds[i].argvlen[k]) : 0;
            target[i] = c->slot_node[s] == NO_NODE ? 0 : c->slot_node[s];
        }
        if ((rc = exchange(c, cmds, n, target, ask, asking, ptrs, deadline_ns, eb)) != 0)
            goto out;
        for (size_t i = 0; i < n; i++) {
            if (done[i] || !cmds[i].reply)
                continue;
            unsigned slot = 0;
            int node = -1;
            int kind = redirection(c, cmds[i].reply, &slot, &node, eb);
            if (kind < 0) {
                rc = kind;
                ferry__rcmd_release(cmds, n);
                goto out;
            }
            if (kind == 0) {
                done[i] = 1;
                left--;
                continue;
            }
            if (redirects)
                (*redirects)++;
            freeReplyObject(cmds[i].reply);
            cmds[i].reply = NULL;
            if (kind == 1) {
                c->slot_node[slot] = (uint16_t)node;
                c->need_refresh = 1;
                ask[i] = 0;
            } else {
                target[i] = node;
                ask[i] = 1;
            }
        }
    }
    if (left) {
        ferry__rcmd_release(cmds, n);
        rc = ferry__err_set(eb, FERRY_EREMOTE,
                            "remote cluster: %zu command(s) still redirected after %d hops "
                            "(the cluster is resharding or misconfigured)",
                            left, FERRY__RCLUSTER_HOPS);
    }
out:
    ferry__free(target);
    ferry__free(ask);
    ferry__free(ptrs);
    ferry__free(asking);
    return rc;
}

static void c_destroy(void *state)
{
    cluster *c = state;
    if (!c)
        return;
    c_reset(c);
    ferry__free(c->nodes);
    ferry__free(c);
}

const ferry__rtopo_ops ferry__rtopo_cluster = {
    "cluster", c_create, c_connect, c_connected, c_exec, NULL, c_reset, c_destroy,
};
