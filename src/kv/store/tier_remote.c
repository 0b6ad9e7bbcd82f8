/*
 * tier_remote.c - the remote tier: chunks shared through Redis/Valkey
 * (ferry/remote.h), below L1 and L2.
 *
 * Design. The server keeps the bytes; this tier keeps no location. A
 * chunk's server key is the remote's key_prefix ("ferry:kv:" by default)
 * followed by the 32 hex digits of its id (chunk hash xor the namespace
 * digest of model, TP rank/world, salt and seed), so every process that
 * agrees on those finds the same key. Values carry the store's layout
 * fingerprint (model, TP, layout dims, dtype, chunk size, seed): a value
 * written for another layout under the same key is refused by the remote
 * module (FERRY_EMISMATCH) and becomes a miss.
 *
 * What the store's index holds for this tier is knowledge, not data: an
 * entry "resident" here means "the server had it when we last asked". The
 * tier's capacity bounds how many such entries the index remembers
 * (evicting one only forgets it; release never deletes on the server),
 * and a read that finds the value gone, refused or unreachable fails, so
 * the store drops that knowledge and reports a miss for exactly that
 * chunk. Writes are ferry_remote_put: encoded (copied) and queued for the
 * remote's writer thread, never waiting on the network; the remote drops
 * them when it is down or its queue is full.
 *
 * Invariant: nothing but a value that passed the remote module's checks
 * (header, key hash, layout, payload checksum) and has exactly the
 * store's chunk size is ever reported as read.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "ferry/remote.h"
#include "kv/kv_impl.h"
#include "remote/remote_int.h"

#define KEY_HEX 32u
#define STACK_KEYS 64u

typedef struct rtier {
    ferry_remote *r;
    uint64_t chunk_bytes;
    /* errors: failures of this tier's calls that the remote module does not
     * count itself (bad arguments, out of memory); remote_errors adds the
     * module's count of transport failures and error replies, which covers
     * the writer thread's refused write-throughs and dead servers */
    atomic_uint_fast64_t exists_calls, asked, found, puts, put_bytes, gets, get_bytes, misses,
        refused, errors;
} rtier;

/* codes the remote module counted in its stats.errors */
static int counted_by_remote(int rc)
{
    return rc == FERRY_EREMOTE || rc == -EAGAIN || rc == FERRY_ENOSPACE ||
           (rc < 0 && rc > -4096 && rc != -EINVAL && rc != -ENOMEM);
}

int ferry__kv_remote_key(const ferry_kv_hash *id, char *buf, size_t len)
{
    if (!id || !buf || len < KEY_HEX + 1)
        return -EINVAL;
    snprintf(buf, len, "%016llx%016llx", (unsigned long long)id->hi, (unsigned long long)id->lo);
    return (int)KEY_HEX;
}

static int r_reserve(ferry__kv_tier *t, uint64_t *loc)
{
    (void)t;
    *loc = 0; /* the server keeps the bytes: nothing to hand out */
    return 0;
}

static void r_release(ferry__kv_tier *t, uint64_t loc)
{
    /* forgetting a chunk does not delete it on the server: other processes
     * may be using it, and the server's TTL/maxmemory policy ages it out */
    (void)t;
    (void)loc;
}

static int r_write(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, const void *src,
                   size_t len)
{
    (void)loc;
    rtier *p = t->impl;
    char key[KEY_HEX + 1];
    ferry__kv_remote_key(id, key, sizeof key);
    int rc = ferry_remote_put(p->r, key, KEY_HEX, src, len);
    if (rc == 0) {
        atomic_fetch_add(&p->puts, 1);
        atomic_fetch_add(&p->put_bytes, len);
        return 0;
    }
    if (rc != -ENOMEM && !counted_by_remote(rc))
        atomic_fetch_add(&p->errors, 1); /* the others are counted as dropped by the remote */
    return ferry__err_set(NULL, rc, "kv remote %s: write-through of chunk %s (%zu bytes) "
                                    "dropped: %s",
                          ferry_remote_url(p->r), key, len, ferry_last_error());
}

static int r_read(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, void *dst, size_t len)
{
    (void)loc;
    rtier *p = t->impl;
    char key[KEY_HEX + 1];
    ferry__kv_remote_key(id, key, sizeof key);
    atomic_fetch_add(&p->gets, 1);
    int rc = ferry_remote_get(p->r, key, KEY_HEX, dst, len);
    if (rc >= 0 && (uint64_t)rc == p->chunk_bytes) {
        atomic_fetch_add(&p->get_bytes, (uint64_t)rc);
        return 0;
    }
    if (rc >= 0) {
        /* a matching layout fingerprint with another size cannot come from
         * a ferry writer of this layout: refuse it */
        atomic_fetch_add(&p->refused, 1);
        return ferry__err_set(NULL, FERRY_ECORRUPT,
                              "kv remote %s: chunk %s has %d payload bytes, expected %llu",
                              ferry_remote_url(p->r), key, rc,
                              (unsigned long long)p->chunk_bytes);
    }
    if (rc == FERRY_ENOTFOUND)
        atomic_fetch_add(&p->misses, 1);
    else if (rc == -ENOBUFS)
        atomic_fetch_add(&p->refused, 1);
    /* a refusal by header or checksum is in the remote's corrupt and
     * mismatched counts, which remote_refused adds */
    else if (rc != FERRY_EMISMATCH && rc != FERRY_ECORRUPT && rc != FERRY_EVERSION &&
             !counted_by_remote(rc))
        atomic_fetch_add(&p->errors, 1);
    return ferry__err_set(NULL, rc, "kv remote %s: reading chunk %s: %s", ferry_remote_url(p->r),
                          key, ferry_last_error());
}

static void *r_host_ptr(ferry__kv_tier *t, uint64_t loc)
{
    (void)t;
    (void)loc;
    return NULL;
}

static void r_close(ferry__kv_tier *t)
{
    rtier *p = t->impl;
    if (!p)
        return;
    ferry_remote_close(p->r);
    ferry__free(p);
    t->impl = NULL;
}

static const ferry__kv_tier_ops remote_ops = {
    .name = "remote",
    .reserve = r_reserve,
    .release = r_release,
    .write = r_write,
    .read = r_read,
    .host_ptr = r_host_ptr,
    .close = r_close,
    .exists = ferry__kv_remote_exists,
    .forget = ferry__kv_remote_delete,
    .flush = ferry__kv_remote_flush,
    .counts = ferry__kv_remote_counts,
};

int ferry__kv_tier_remote_open(const char *url, const ferry_remote_options *opt,
                               uint64_t chunk_bytes, uint64_t slot_bytes, uint64_t capacity,
                               ferry__errbuf *eb, ferry__kv_tier **out)
{
    if (!url || !opt || !chunk_bytes || !capacity)
        return ferry__err_set(eb, -EINVAL, "kv remote: no URL, options, chunk size or capacity");
    ferry__kv_tier *t = ferry__calloc(1, sizeof *t);
    rtier *p = ferry__calloc(1, sizeof *p);
    if (!t || !p) {
        ferry__free(t);
        ferry__free(p);
        return ferry__err_set(eb, -ENOMEM, "kv remote: out of memory for the tier");
    }
    p->chunk_bytes = chunk_bytes;
    t->ops = &remote_ops;
    t->impl = p;
    t->id = FERRY_KV_TIER_REMOTE;
    t->slot_bytes = slot_bytes;
    t->capacity = capacity;
    int rc = ferry_remote_open(url, opt, &p->r);
    if (rc < 0) {
        ferry__free(p);
        t->impl = NULL;
        ferry__kv_tier_free(t);
        /* never the raw URL: it may hold the password */
        char why[FERRY__ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", ferry_last_error());
        ferry__rurl u;
        ferry__errbuf peb;
        const char *shown = "(an unparsable URL)";
        if (ferry__rurl_parse(url, strlen(url), &u, &peb) == 0)
            shown = u.redacted;
        return ferry__err_set(eb, rc, "kv remote: opening %s: %s", shown, why);
    }
    *out = t;
    return 0;
}

/* keys[i] for ids[i], formatted into hex (KEY_HEX bytes each) */
static void make_keys(const ferry_kv_hash *ids, size_t n, char *hex, ferry_remote_key *keys)
{
    for (size_t i = 0; i < n; i++) {
        char k[KEY_HEX + 1];
        ferry__kv_remote_key(&ids[i], k, sizeof k);
        memcpy(hex + i * KEY_HEX, k, KEY_HEX);
        keys[i].data = hex + i * KEY_HEX;
        keys[i].len = KEY_HEX;
    }
}

typedef int (*batch_fn)(ferry_remote *r, const ferry_remote_key *keys, size_t n);

static int batch(ferry__kv_tier *t, const ferry_kv_hash *ids, size_t n, batch_fn fn)
{
    rtier *p = t->impl;
    char hex_stack[STACK_KEYS * KEY_HEX];
    ferry_remote_key keys_stack[STACK_KEYS] = {{NULL, 0}};
    char *hex = hex_stack;
    ferry_remote_key *keys = keys_stack;
    if (n > STACK_KEYS) {
        hex = ferry__malloc(n * KEY_HEX);
        keys = ferry__malloc(n * sizeof *keys);
        if (!hex || !keys) {
            ferry__free(hex);
            ferry__free(keys);
            return ferry__err_set(NULL, -ENOMEM, "kv remote: out of memory for %zu keys", n);
        }
    }
    make_keys(ids, n, hex, keys);
    int rc = fn(p->r, keys, n);
    if (hex != hex_stack) {
        ferry__free(hex);
        ferry__free(keys);
    }
    return rc;
}

int ferry__kv_remote_exists(ferry__kv_tier *t, const ferry_kv_hash *ids, size_t n)
{
    if (!n)
        return 0;
    rtier *p = t->impl;
    atomic_fetch_add(&p->exists_calls, 1);
    atomic_fetch_add(&p->asked, n);
    int rc = batch(t, ids, n, ferry_remote_exists);
    if (rc > 0)
        atomic_fetch_add(&p->found, (uint64_t)rc);
    else if (rc < 0 && !counted_by_remote(rc))
        atomic_fetch_add(&p->errors, 1);
    return rc;
}

int ferry__kv_remote_delete(ferry__kv_tier *t, const ferry_kv_hash *ids, size_t n)
{
    return n ? batch(t, ids, n, ferry_remote_delete) : 0;
}

int ferry__kv_remote_flush(ferry__kv_tier *t)
{
    rtier *p = t->impl;
    return ferry_remote_flush(p->r, 0);
}

void ferry__kv_remote_counts(ferry__kv_tier *t, ferry_kv_stats *m)
{
    rtier *p = t->impl;
    m->remote_lookups = atomic_load(&p->exists_calls);
    m->remote_lookup_chunks = atomic_load(&p->asked);
    m->remote_found_chunks = atomic_load(&p->found);
    m->remote_puts = atomic_load(&p->puts);
    m->remote_put_bytes = atomic_load(&p->put_bytes);
    m->remote_gets = atomic_load(&p->gets);
    m->remote_get_bytes = atomic_load(&p->get_bytes);
    m->remote_misses = atomic_load(&p->misses);
    m->remote_refused = atomic_load(&p->refused);
    m->remote_errors = atomic_load(&p->errors);
    ferry_remote_stats rm = FERRY_REMOTE_STATS_INIT;
    if (ferry_remote_stats_get(p->r, &rm) == 0) {
        m->remote_errors += rm.errors;
        /* values refused by their header or checksums, by a get or by a
         * lookup's header check alike (a lookup that stops at a value of
         * another layout or key refuses it as much as a get does) */
        m->remote_refused += rm.corrupt + rm.mismatched;
        m->remote_degraded = rm.degraded;
        m->remote_dropped = rm.dropped;
        m->remote_written = rm.puts_written;
        m->remote_down = rm.down;
    }
}
