/*
 * tier_pslab_async.c - asynchronous reads of the persistent L2, so a
 * retrieve reads its chunks from the persistent slab as one stream in
 * prompt order (as from the non-persistent L2: kv_impl.h's aops), with
 * each chunk's pieces in flight on the drive while the chunks before it
 * are checked and copied out.
 *
 * The slab's own reads (ferry_pslab_get) run on its lanes, one chunk per
 * caller, and return only when the chunk is read and checked; a retrieve
 * would then need a thread per chunk in flight. Here the tier has its own
 * engine over the slab's files (opened again, read-only), shared by every
 * retrieve: begin pins the chunk's entry in the slab (its extent cannot be
 * freed or reused while the reads run), submit maps a piece of the chunk
 * to drives and file offsets (split at a stripe boundary) and queues it,
 * wait reaps for every batch (one reaper at a time; a completion goes to
 * the batch that submitted it), end unpins once the chunk's last piece
 * landed, and verify holds the landed bytes' XXH3-64 against the checksum
 * of the slab's record before the store lets anyone read them: a torn,
 * stale or rotten chunk is FERRY_ECORRUPT, a miss, never data.
 *
 * Only a tier whose chunk images fill their slots exactly (chunk bytes ==
 * slot bytes, the slab's alignment dividing them) reads this way: the
 * slab's checksum covers what was written (a whole slot), the retrieve's
 * covers the chunk image. Others keep the synchronous read path.
 *
 * Locking: aq.mu (aqueue.c) guards the request pool, the batches' ready
 * lists, the reaper's turn and the pins; iomu the engine (submit and
 * reap; a reap returns as soon as one request completed, so a submit
 * usually waits for no more than one request to land, at most for the
 * reap's 50 ms bound).
 * A slot's pin is set by begin and taken by end under aq.mu; submit reads it
 * without: only the read that set it submits for that slot (the store
 * lets one read of a chunk run at a time, and begin refuses a slot whose
 * pin is still held). verify checks the id the pin was taken for. The L1
 * pool's registration with the engine (ferry__kv_tpa_register) runs
 * without iomu, on the store's registering thread while reads go on
 * (ferry/io.h allows it; the kernel's pin must not hold up the reads);
 * `registered` is read by unregister and close only after that thread
 * was joined.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ferry/io.h"
#include "kv/client/kvc.h"
#include "kv/store/tier_pslab.h"
#include "pslab/pslab_reader.h"

/* a piece is at most one stripe unit, so it spans at most two drives */
#define PA_SUB 2
#define PA_DEPTH 32                     /* the engine's requests in flight */
#define PA_PIECE ((uint64_t)2 << 20)    /* bytes per request */

/* a vectored read's pieces: one piece's runs of at least 4096 bytes
 * each (the store reads straight into an engine's buffer only then), one
 * more per drive boundary */
#define PA_IOV (PA_PIECE / FERRY_IO_ALIGN + PA_SUB)

typedef struct pa_rd {
    ferry__kv_aread pub;                /* the store's part first */
    ferry_io_vreq vq[PA_SUB];           /* (a plain read uses vq[k].req alone) */
    struct iovec iov[PA_IOV];           /* a vectored read's pieces, every request's */
    unsigned left;                      /* its requests still in flight (aq.mu) */
    int result;                         /* its first failure (aq.mu) */
    char msg[256];
} pa_rd;

/* a chunk's piece checksums, copied from its pin at begin so its pieces
 * are checked also after end (a worker's check may run late) */
typedef struct pa_sums {
    uint64_t *sum;                      /* n of them (NULL: none) */
    uint32_t piece, n;
} pa_sums;

struct ferry__kv_tpa {
    ferry_pslab *ps;
    ferry_io *io;
    ferry_file *f[FERRY_PSLAB_MAX_DIRS];
    unsigned nf;
    int direct;                         /* the files are O_DIRECT: read whole extents */
    ferry__pslab_pin *pin;              /* per slot: the chunk read there (see above) */
    ferry_kv_hash *pid;                 /* per slot: the id that pin was taken for */
    pa_sums *sums;                      /* per slot: that chunk's piece checksums (aq.mu) */
    uint64_t capacity;
    void *registered;                   /* the L1 pool while registered */
    ferry__kv_aq aq;                    /* requests, batches, the reaper's turn */
    pthread_mutex_t iomu;               /* the engine */
};

static ferry__kv_tpa *tpa_of(ferry__kv_tier *t)
{
    return ferry__kv_tier_pslab_tpa(t);
}

static ferry__kv_aread *pa_get(ferry__kv_tier *t)
{
    return ferry__kv_aq_get(&tpa_of(t)->aq);
}

static void pa_put(ferry__kv_tier *t, ferry__kv_aread *pub)
{
    ferry__kv_aq_put(&tpa_of(t)->aq, pub);
}

static int pa_begin(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, size_t len)
{
    ferry__kv_tpa *a = tpa_of(t);
    if (loc >= a->capacity)
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: read of slot %llu (capacity "
                              "%llu)", (unsigned long long)loc, (unsigned long long)a->capacity);
    uint8_t k[FERRY__KV_PSLAB_KEY];
    ferry__kv_pslab_key(id, k);
    ferry__pslab_pin pin;
    int rc = ferry__pslab_pin_get(a->ps, k, sizeof k, &pin);
    if (rc < 0)
        return ferry__err_set(NULL, rc, "kv persistent L2: reading slot %llu: %s",
                              (unsigned long long)loc, ferry_pslab_last_error(a->ps));
    uint64_t span = a->direct ? pin.ext : pin.length;
    if (pin.length != len || span > t->slot_bytes) {
        ferry__pslab_pin_put(a->ps, &pin);
        return ferry__err_set(NULL, FERRY_EMISMATCH, "kv persistent L2: slot %llu holds a "
                              "chunk of %llu bytes, not the %zu asked (another layout)",
                              (unsigned long long)loc, (unsigned long long)pin.length, len);
    }
    /* the store reads a chunk once at a time and a slot holds one chunk,
     * so a slot still being read means its chunk was evicted and the slot
     * given to another while the first read ran (a lock's TTL ran out):
     * refused, so neither read sees the other's pin */
    uint64_t *sum = pin.npieces ? ferry__malloc(pin.npieces * sizeof *sum) : NULL;
    if (pin.npieces && !sum) {
        ferry__pslab_pin_put(a->ps, &pin);
        return ferry__err_set(NULL, -ENOMEM, "kv persistent L2: out of memory for the %u "
                              "piece checksums of slot %llu", pin.npieces,
                              (unsigned long long)loc);
    }
    if (sum)
        memcpy(sum, pin.psum, pin.npieces * sizeof *sum);
    pthread_mutex_lock(&a->aq.mu);
    int busy = a->pin[loc].ent != NULL;
    if (!busy) {
        a->pin[loc] = pin;
        a->pid[loc] = *id;
        uint64_t *old = a->sums[loc].sum;
        a->sums[loc] = (pa_sums){sum, pin.npieces ? pin.piece : 0, pin.npieces};
        sum = old; /* (freed below) */
    }
    pthread_mutex_unlock(&a->aq.mu);
    ferry__free(sum);
    if (busy) {
        ferry__pslab_pin_put(a->ps, &pin);
        return ferry__err_set(NULL, -EBUSY, "kv persistent L2: slot %llu is still being read "
                              "by an earlier read", (unsigned long long)loc);
    }
    return 0;
}

static void pa_end(ferry__kv_tier *t, uint64_t loc)
{
    ferry__kv_tpa *a = tpa_of(t);
    if (loc >= a->capacity)
        return;
    pthread_mutex_lock(&a->aq.mu);
    ferry__pslab_pin pin = a->pin[loc];
    a->pin[loc].ent = NULL; /* (its checksum stays for verify) */
    pthread_mutex_unlock(&a->aq.mu);
    ferry__pslab_pin_put(a->ps, &pin);
}

/* a finished read: onto its batch's ready list (aq.mu held) */
static void pa_deliver(pa_rd *r)
{
    r->pub.result = r->result;
    r->pub.why = r->result < 0 ? r->msg : NULL;
    ferry__kv_aq_land(&r->pub);
}

/* the requests of bytes [off, off + len) of the chunk pinned at pin into
 * dst, or with iov (niov of them) into those runs in order: how many
 * (1..PA_SUB), or -EINVAL when the piece spans more drives or runs */
static int pa_plan(ferry__kv_tpa *a, const ferry__pslab_pin *pin, pa_rd *r, uint64_t off,
                   char *dst, uint64_t len, const struct iovec *iov, unsigned niov)
{
    unsigned n = 0, ni = 0, k = 0;
    size_t skip = 0; /* bytes of iov[k] given to the requests before */
    while (len) {
        if (n == PA_SUB)
            return -EINVAL;
        unsigned d;
        uint64_t foff, run;
        ferry__pslab_locate(a->ps, pin->offset + off, &d, &foff, &run);
        uint64_t seg = FERRY__MIN(len, run);
        ferry_io_vreq *v = &r->vq[n++];
        ferry_io_req *q = &v->req;
        memset(v, 0, sizeof *v);
        q->op = FERRY_IO_READ;
        q->file = a->f[d];
        q->buf = dst;
        q->len = (size_t)seg;
        q->offset = foff;
        q->user = r;
        if (iov) {
            q->op = FERRY_IO_READV;
            q->buf = NULL;
            v->iov = &r->iov[ni];
            for (uint64_t got = 0; got < seg; v->niov++) {
                if (k == niov || ni == PA_IOV)
                    return -EINVAL;
                size_t take = (size_t)FERRY__MIN(iov[k].iov_len - skip, seg - got);
                r->iov[ni++] = (struct iovec){(char *)iov[k].iov_base + skip, take};
                got += take;
                skip += take;
                if (skip == iov[k].iov_len) {
                    k++;
                    skip = 0;
                }
            }
        }
        if (dst)
            dst += seg;
        off += seg;
        len -= seg;
    }
    return (int)n;
}

static int pa_send(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread *pub, uint64_t loc,
                   uint64_t off, void *dst, size_t len, const struct iovec *iov, unsigned niov)
{
    ferry__kv_tpa *a = tpa_of(t);
    pa_rd *r = (pa_rd *)pub;
    const ferry__pslab_pin *pin = loc < a->capacity ? &a->pin[loc] : NULL;
    if (!pin || !pin->ent)
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: read of slot %llu without "
                              "begin", (unsigned long long)loc);
    uint64_t span = a->direct ? pin->ext : pin->length;
    uint64_t want = off < span ? FERRY__MIN((uint64_t)len, span - off) : 0;
    if (iov && want != len) /* (its every byte is the chunk's: the runs fill whole) */
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: a vectored read of %zu bytes "
                              "at byte %llu of slot %llu reaches past its chunk", len,
                              (unsigned long long)off, (unsigned long long)loc);
    r->result = 0;
    r->msg[0] = 0;
    int n = want ? pa_plan(a, pin, r, off, dst, want, iov, niov) : 0;
    if (n < 0)
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: a read of %llu bytes at byte "
                              "%llu of slot %llu spans more than %d drives (or %u runs, more "
                              "than %u)", (unsigned long long)want, (unsigned long long)off,
                              (unsigned long long)loc, PA_SUB, niov, (unsigned)PA_IOV);
    r->left = (unsigned)n; /* (before any reaper can see it) */
    int broken = ferry__kv_aq_enter(&a->aq, b, pub);
    if (!broken && n == 0) { /* past the chunk's bytes: nothing to read */
        pthread_mutex_lock(&a->aq.mu);
        pa_deliver(r);
        pthread_mutex_unlock(&a->aq.mu);
    }
    if (broken)
        return ferry__err_set(NULL, broken, "kv persistent L2: read of slot %llu: the tier's "
                              "read queue broke earlier (%s)", (unsigned long long)loc,
                              ferry_strerror(broken));
    if (n == 0)
        return 0;
    ferry_io_req *qs[PA_SUB] = {&r->vq[0].req, &r->vq[1].req};
    char why[200] = "";
    pthread_mutex_lock(&a->iomu);
    int k = ferry_io_submit(a->io, qs, (unsigned)n);
    if (k != n) /* (the engine's message, before another thread's call) */
        snprintf(why, sizeof why, "kv persistent L2: submitting the read of %llu bytes at "
                 "byte %llu of slot %llu: %s", (unsigned long long)want,
                 (unsigned long long)off, (unsigned long long)loc, ferry_io_last_error(a->io));
    pthread_mutex_unlock(&a->iomu);
    if (k == n)
        return 0;
    int code = k < 0 ? k : FERRY_EDRIVER;
    if (k <= 0) {
        ferry__kv_aq_leave(&a->aq, b);
        return ferry__err_set(NULL, code, "%s", why);
    }
    pthread_mutex_lock(&a->aq.mu);
    /* part of it is in flight: it lands failed once that part landed,
     * which a reaper may have seen already (then it is delivered here) */
    r->result = code;
    snprintf(r->msg, sizeof r->msg, "%s", why);
    r->left -= (unsigned)(n - k);
    if (r->left == 0) {
        pa_deliver(r);
        pthread_cond_broadcast(&a->aq.cv);
    }
    pthread_mutex_unlock(&a->aq.mu);
    return 0;
}

static int pa_submit(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread *pub, uint64_t loc,
                     uint64_t off, void *dst, size_t len)
{
    return pa_send(t, b, pub, loc, off, dst, len, NULL, 0);
}

static int pa_submitv(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread *pub,
                      uint64_t loc, uint64_t off, const struct iovec *iov, unsigned niov,
                      size_t len)
{
    return pa_send(t, b, pub, loc, off, NULL, len, iov, niov);
}

/* one reaper's turn (without aq.mu): what completed lands in its batch */
static int pa_reap(void *ctx)
{
    ferry__kv_tpa *a = ctx;
    ferry_io_req *done[32];
    char why[200] = "";
    pthread_mutex_lock(&a->iomu);
    int k = ferry_io_reap(a->io, done, 1, 32, 50);
    if (k < 0)
        snprintf(why, sizeof why, "%s", ferry_io_last_error(a->io));
    pthread_mutex_unlock(&a->iomu);
    if (k < 0)
        FERRY_LOGW("kv persistent L2: the read queue broke: %s", why);
    pthread_mutex_lock(&a->aq.mu);
    for (int i = 0; i < k; i++) {
        ferry_io_req *q = done[i];
        pa_rd *r = q->user;
        if (r->result == 0 && q->result != (int64_t)q->len) {
            r->result = q->result < 0 ? (int)q->result : -EIO;
            snprintf(r->msg, sizeof r->msg, "kv persistent L2: read of %zu bytes at offset %llu "
                     "of %s: %s", q->len, (unsigned long long)q->offset,
                     ferry_file_path(q->file),
                     q->result < 0 ? ferry_strerror((int)q->result) : "short read");
        }
        FERRY__ASSERT(r->left > 0);
        if (--r->left == 0)
            pa_deliver(r);
    }
    pthread_mutex_unlock(&a->aq.mu);
    return k < 0 ? k : 0;
}

static int pa_wait(ferry__kv_tier *t, ferry__kv_abatch *b, ferry__kv_aread **out)
{
    ferry__kv_tpa *a = tpa_of(t);
    return ferry__kv_aq_wait(&a->aq, b, out, pa_reap, a, "kv persistent L2");
}

static int pa_broken(ferry__kv_tier *t)
{
    return ferry__kv_aq_broken(&tpa_of(t)->aq);
}

static int pa_verify(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, uint64_t sum)
{
    ferry__kv_tpa *a = tpa_of(t);
    if (loc >= a->capacity)
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: verify of slot %llu",
                              (unsigned long long)loc);
    pthread_mutex_lock(&a->aq.mu);
    ferry__pslab_pin pin = a->pin[loc];
    int same = a->pid[loc].lo == id->lo && a->pid[loc].hi == id->hi;
    uint32_t piece = a->sums[loc].piece;
    pthread_mutex_unlock(&a->aq.mu);
    if (same && piece) /* (the store checks those piece by piece) */
        return ferry__err_set(NULL, -EINVAL, "kv persistent L2: the chunk in slot %llu has "
                              "piece checksums, not one whole", (unsigned long long)loc);
    if (!same) /* (not damage: the slot went to another chunk) */
        return ferry__err_set(NULL, FERRY_ENOTFOUND, "kv persistent L2: slot %llu was read "
                              "for another chunk since: a miss", (unsigned long long)loc);
    if (pin.checksum == sum)
        return 0;
    return ferry__err_set(NULL, FERRY_ECORRUPT, "kv persistent L2: the chunk of %llu bytes in "
                          "slot %llu (slab offset %llu) fails its checksum (%016llx, recorded "
                          "%016llx): a miss", (unsigned long long)pin.length,
                          (unsigned long long)loc, (unsigned long long)pin.offset,
                          (unsigned long long)sum, (unsigned long long)pin.checksum);
}

static uint64_t pa_vpiece(ferry__kv_tier *t, uint64_t loc)
{
    ferry__kv_tpa *a = tpa_of(t);
    if (loc >= a->capacity)
        return 0;
    pthread_mutex_lock(&a->aq.mu);
    uint64_t piece = a->sums[loc].piece;
    pthread_mutex_unlock(&a->aq.mu);
    return piece;
}

/* the checksum recorded for piece k of the chunk read from loc (copied
 * at its begin: a later read of the slot may replace it) */
static int pa_psum(ferry__kv_tier *t, uint64_t loc, const ferry_kv_hash *id, uint64_t k,
                   uint64_t *sum)
{
    ferry__kv_tpa *a = tpa_of(t);
    int rc = -EINVAL;
    if (loc < a->capacity) {
        pthread_mutex_lock(&a->aq.mu);
        const pa_sums *ps = &a->sums[loc];
        /* (not damage when the slot was read for another chunk since) */
        rc = a->pid[loc].lo != id->lo || a->pid[loc].hi != id->hi ? FERRY_ENOTFOUND
             : k < ps->n                                          ? 0
                                                                  : -EINVAL;
        if (rc == 0)
            *sum = ps->sum[k];
        pthread_mutex_unlock(&a->aq.mu);
    }
    if (rc < 0)
        return ferry__err_set(NULL, rc, "kv persistent L2: slot %llu holds no piece %llu of "
                              "chunk %016llx%016llx now%s", (unsigned long long)loc,
                              (unsigned long long)k, (unsigned long long)id->hi,
                              (unsigned long long)id->lo,
                              rc == FERRY_ENOTFOUND ? " (read for another chunk since): a miss"
                                                    : "");
    return 0;
}

/* up to 8 chunks in flight for one retrieve, read in 2 MiB pieces (the
 * slab's own request size), 16 of them in flight, so chunks land one after
 * another in prompt order and each is copied out while the next is read */
const ferry__kv_tier_aops ferry__kv_tpa_aops = {
    .depth = 8,
    .pdepth = 16,
    .get = pa_get,
    .put = pa_put,
    .begin = pa_begin,
    .end = pa_end,
    .submit = pa_submit,
    .submitv = pa_submitv,
    .wait = pa_wait,
    .broken = pa_broken,
    .verify = pa_verify,
    .vpiece = pa_vpiece,
    .psum = pa_psum,
};

void ferry__kv_tpa_close(ferry__kv_tpa *a)
{
    if (!a)
        return;
    /* reads still in flight (none but after a failure) land first: their
     * files and buffers must outlive them */
    ferry_io_req *done[32];
    while (a->io && ferry_io_inflight(a->io) && ferry_io_reap(a->io, done, 1, 32, 100) >= 0)
        ;
    if (a->registered)
        ferry_io_unregister_buffer(a->io, a->registered);
    for (unsigned i = 0; i < a->nf; i++)
        if (a->f[i])
            ferry_file_close(a->f[i]);
    if (a->io)
        ferry_io_close(a->io);
    for (uint64_t i = 0; a->sums && i < a->capacity; i++)
        ferry__free(a->sums[i].sum);
    ferry__free(a->sums);
    ferry__free(a->pin);
    ferry__free(a->pid);
    ferry__kv_aq_fini(&a->aq);
    pthread_mutex_destroy(&a->iomu);
    ferry__free(a);
}

int ferry__kv_tpa_open(ferry_pslab *ps, const char *engine, uint64_t capacity,
                       const ferry_pslab_stats *s, ferry__kv_tpa **out)
{
    ferry__kv_tpa *a = ferry__calloc(1, sizeof *a);
    if (!a)
        return ferry__err_set(NULL, -ENOMEM, "kv persistent L2: out of memory for its reads");
    ferry__kv_aq_init(&a->aq, sizeof(pa_rd));
    pthread_mutex_init(&a->iomu, NULL);
    a->ps = ps;
    a->capacity = capacity;
    a->direct = s->direct;
    a->pin = ferry__calloc(capacity ? capacity : 1, sizeof *a->pin);
    a->pid = ferry__calloc(capacity ? capacity : 1, sizeof *a->pid);
    a->sums = ferry__calloc(capacity ? capacity : 1, sizeof *a->sums);
    if (!a->pin || !a->pid || !a->sums) {
        ferry__kv_tpa_close(a);
        return ferry__err_set(NULL, -ENOMEM, "kv persistent L2: out of memory for %llu slots' "
                              "reads", (unsigned long long)capacity);
    }
    ferry_io_options o = FERRY_IO_OPTIONS_INIT;
    o.engine = engine;
    o.depth = PA_DEPTH;
    o.max_request = PA_PIECE;
    int rc = ferry_io_open(&o, &a->io);
    a->nf = s->drives ? s->drives : 1;
    for (unsigned i = 0; rc == 0 && i < a->nf; i++) {
        char path[4096];
        ferry__pslab_slab_path(ps, i, path, sizeof path);
        rc = ferry_file_open(a->io, path,
                             FERRY_FILE_READ | (a->direct ? FERRY_FILE_REQUIRE_DIRECT : 0u),
                             &a->f[i]);
    }
    if (rc < 0) {
        rc = ferry__err_set(NULL, rc, "kv persistent L2: an engine for its reads: %s",
                            ferry_last_error());
        ferry__kv_tpa_close(a);
        return rc;
    }
    *out = a;
    return 0;
}

int ferry__kv_tpa_register(ferry__kv_tpa *a, void *pool, size_t len)
{
    if (!a || a->registered)
        return 0;
    int rc = ferry_io_register_buffer(a->io, pool, len);
    if (rc < 0)
        return ferry__err_set(NULL, rc, "kv persistent L2: %s", ferry_io_last_error(a->io));
    a->registered = pool;
    return 0;
}

void ferry__kv_tpa_unregister(ferry__kv_tpa *a)
{
    if (!a || !a->registered)
        return;
    if (ferry_io_unregister_buffer(a->io, a->registered) < 0)
        FERRY_LOGW("kv persistent L2: unregistering the L1 pool: %s", ferry_io_last_error(a->io));
    a->registered = NULL;
}
