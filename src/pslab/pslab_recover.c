/*
 * pslab_recover.c - opening an existing store: each slab file's header
 * checked against the options and the first drive's, then the journal
 * replayed (pslab_fmt.c) and what the replay found acted on.
 *
 * Invariant: nothing is written before every slab file has proved to
 * belong to this store, as this drive, at full size, and the options
 * (geometry, tag) agree with it - a mismatch is refused naming both sides,
 * never repaired, so a store opened with the wrong directories or for
 * another model is left as it was. After the replay the journal holds
 * exactly its good records: a torn tail is cut, and what a killed
 * predecessor left in the page cache is synced before the first append (so
 * the next barrier tells the truth); damage (a bad record that a barrier
 * proves was durable) marks the journal for a rewrite.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "pslab/pslab_impl.h"

uint64_t ferry__pslab_round_capacity(uint64_t bytes, uint64_t align, uint64_t stripe,
                                     unsigned drives)
{
    uint64_t c = align_up(bytes, align);
    if (drives > 1)
        c = align_up(c, stripe * drives);
    return c;
}

static int check_against_options(ferry_pslab *p, const ferry_pslab_options *o,
                                 const ferry__pslab_geom *g, const char *path)
{
    if (o->n_dirs != g->drives)
        return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: %s belongs to a slab of %u drives, %u "
                                 "directories given", path, g->drives, o->n_dirs);
    if (o->alignment && o->alignment != g->alignment)
        return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: %s has alignment %u, %zu asked", path,
                                 g->alignment, o->alignment);
    if (o->stripe_bytes && g->drives > 1 && o->stripe_bytes != g->stripe)
        return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: %s has stripe %llu, %zu asked", path,
                                 (unsigned long long)g->stripe, o->stripe_bytes);
    if (o->bytes &&
        ferry__pslab_round_capacity(o->bytes, g->alignment, g->stripe, g->drives) != g->capacity)
        return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: %s holds %llu bytes, %llu asked", path,
                                 (unsigned long long)g->capacity, (unsigned long long)o->bytes);
    return 0;
}

/* tag bytes as text for a message: printable as is, else hex */
static void tag_text(const uint8_t *t, size_t n, char *out, size_t cap)
{
    if (!n) {
        snprintf(out, cap, "(none)");
        return;
    }
    int printable = 1;
    for (size_t i = 0; i < n; i++)
        printable &= t[i] >= 0x20 && t[i] < 0x7f;
    size_t o = 0;
    out[0] = 0;
    if (printable) {
        snprintf(out, cap, "\"%.*s\"", (int)FERRY__MIN(n, cap - 3), (const char *)t);
        return;
    }
    for (size_t i = 0; i < n && o + 3 < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%02x", t[i]);
}

/*
 * For tags of "key=value" fields separated by ';' (the KV store's), name
 * the fields that differ - "heads: 2 here, 4 asked" - so the message says
 * what differs without a diff by eye. Empty when the tags are not of that
 * form.
 */
static void tag_diff(const uint8_t *have, size_t hn, const uint8_t *want, size_t wn, char *out,
                     size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (size_t i = 0; i < wn && o + 64 < cap;) {
        size_t j = i;
        while (j < wn && want[j] != ';')
            j++;
        const uint8_t *eq = memchr(want + i, '=', j - i);
        if (eq) {
            size_t kl = (size_t)(eq - (want + i)) + 1; /* "key=" */
            const uint8_t *hv = NULL;
            size_t hl = 0;
            for (size_t a = 0; a < hn;) {
                size_t b = a;
                while (b < hn && have[b] != ';')
                    b++;
                if (b - a >= kl && !memcmp(have + a, want + i, kl)) {
                    hv = have + a + kl;
                    hl = b - a - kl;
                }
                a = b + 1;
            }
            size_t vl = j - i - kl;
            if (!hv || hl != vl || memcmp(hv, want + i + kl, vl)) {
                int k = snprintf(out + o, cap - o, "%s%.*s %.*s here, %.*s asked",
                                 o ? "; " : "", (int)(kl - 1), (const char *)(want + i),
                                 hv ? (int)hl : 4, hv ? (const char *)hv : "none", (int)vl,
                                 (const char *)(want + i + kl));
                if (k < 0 || (size_t)k >= cap - o)
                    break;
                o += (size_t)k;
            }
        }
        i = j + 1;
    }
}

/* the stored tag against the one asked: equal, or FERRY_EMISMATCH quoting both */
static int check_tag(ferry_pslab *p, const ferry_pslab_options *o, const ferry__pslab_hdr *h,
                     const char *path)
{
    if (!o->tag)
        return 0;
    if (h->tag_len == o->tag_len && (!h->tag_len || !memcmp(h->tag, o->tag, o->tag_len)))
        return 0;
    char have[400], want[400], diff[300] = "";
    tag_text(h->tag, h->tag_len, have, sizeof have);
    tag_text(o->tag, o->tag_len, want, sizeof want);
    if (h->tag_len)
        tag_diff(h->tag, h->tag_len, o->tag, o->tag_len, diff, sizeof diff);
    return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: %s was made for %s, not %s%s%s%s: "
                             "refused, nothing changed (FERRY_PSLAB_RESET, or `ferry slab "
                             "check --reset`, starts it empty)", path, have, want,
                             diff[0] ? " (" : "", diff, diff[0] ? ")" : "");
}

/*
 * Slab file i: open it on the commit lane, check its size and header
 * (read into blk) against the options (drive 0) or drive 0's geometry
 * (the others). Drive 0's header sets the store's geometry.
 */
static int check_slab_file(ferry_pslab *p, const ferry_pslab_options *o, unsigned i, uint8_t *blk)
{
    lane *l = &p->cl;
    char why[256];
    char path[PATH_MAX_];
    ferry__pslab_slab_path(p, i, path, sizeof path);
    int rc = ferry_file_open(l->io, path, ferry__pslab_file_flags(p), &l->f[i]);
    if (rc < 0)
        return ferry__pslab_fail_io(p, rc, "pslab: opening slab file %s", path);
    uint64_t size = 0;
    if ((rc = ferry_file_size(l->f[i], &size)) < 0)
        return ferry__pslab_fail_io(p, rc, "pslab: size of %s", path);
    if (size < FERRY__PSLAB_HDR_BLOCK)
        return ferry__pslab_fail(p, FERRY_ECORRUPT, "pslab: slab file %s is truncated: %llu "
                                 "bytes, shorter than its header block", path,
                                 (unsigned long long)size);
    if ((rc = ferry_io_pread(l->io, l->f[i], blk, FERRY__PSLAB_HDR_BLOCK, 0)) < 0)
        return ferry__pslab_fail_io(p, rc, "pslab: reading the header of %s", path);
    ferry__pslab_hdr h;
    rc = ferry__pslab_hdr_decode(blk, FERRY__PSLAB_HDR_BLOCK, &h, why, sizeof why);
    if (rc < 0)
        return ferry__pslab_fail(p, rc, "pslab: slab file %s: %s", path, why);
    if (i == 0) {
        if ((rc = check_against_options(p, o, &h.g, path)) < 0 ||
            (rc = check_tag(p, o, &h, path)) < 0)
            return rc;
        p->g = h.g;
        p->data_off = ferry__pslab_data_off(h.g.alignment);
        p->share = h.g.capacity / h.g.drives;
        if (p->direct && h.g.alignment < FERRY_IO_ALIGN) {
            FERRY_LOGW("pslab: %s: alignment %u is below O_DIRECT's %u: buffered I/O",
                       path, h.g.alignment, FERRY_IO_ALIGN);
            p->direct = 0;
            p->st.direct = 0;
        }
    } else if (memcmp(&h.g, &p->g, sizeof h.g) != 0) {
        return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: slab file %s belongs to another "
                                 "slab (creation id %016llx, the first drive's: %016llx)", path,
                                 (unsigned long long)h.g.creation_id,
                                 (unsigned long long)p->g.creation_id);
    }
    if (h.drive != i)
        return ferry__pslab_fail(p, FERRY_EMISMATCH, "pslab: slab file %s is drive %u of the "
                                 "slab but was given as directory %u (directories in another "
                                 "order)", path, h.drive, i);
    if (size < p->data_off + p->share)
        return ferry__pslab_fail(p, FERRY_ECORRUPT, "pslab: slab file %s is truncated: %llu "
                                 "bytes, its geometry needs %llu", path,
                                 (unsigned long long)size,
                                 (unsigned long long)(p->data_off + p->share));
    return 0;
}

/* every slab file, in directory order: the first failure ends the check */
static int check_slab_files(ferry_pslab *p, const ferry_pslab_options *o)
{
    lane *l = &p->cl;
    uint8_t *blk = NULL;
    int rc = ferry_io_buffer_alloc(l->io, FERRY__PSLAB_HDR_BLOCK, (void **)&blk);
    if (rc < 0)
        return ferry__err_set(&p->err, -ENOMEM, "pslab %s: out of memory", p->dirs[0]);
    for (unsigned i = 0; i < o->n_dirs && rc >= 0; i++)
        rc = check_slab_file(p, o, i, blk);
    ferry_io_buffer_free(l->io, blk);
    return rc < 0 ? rc : 0;
}

/*
 * Open the journal and replay it into p's index and allocator; *L says
 * what the replay found, *jlen the journal's size.
 */
static int replay_journal(ferry_pslab *p, ferry__pslab_load *L, uint64_t *jlen)
{
    lane *l = &p->cl;
    char why[256];
    unsigned jfl = FERRY_FILE_READ;
    if (!(p->flags & FERRY_PSLAB_READONLY))
        jfl |= FERRY_FILE_WRITE;
    int rc = ferry_file_open(l->io, p->jpath, jfl, &p->jf);
    if (rc < 0)
        return ferry__pslab_fail_io(p, rc, "pslab: opening journal %s", p->jpath);
    if ((rc = ferry_file_size(p->jf, jlen)) < 0)
        return ferry__pslab_fail_io(p, rc, "pslab: size of %s", p->jpath);
    if (*jlen > ((uint64_t)1 << 40))
        return ferry__pslab_fail(p, FERRY_ECORRUPT, "pslab: journal %s is %llu bytes: not a "
                                 "journal", p->jpath, (unsigned long long)*jlen);
    uint8_t *jb = ferry__malloc(*jlen ? (size_t)*jlen : 1);
    if (!jb)
        return ferry__err_set(&p->err, -ENOMEM, "pslab: out of memory reading journal %s "
                              "(%llu bytes)", p->jpath, (unsigned long long)*jlen);
    if (*jlen && (rc = ferry_io_pread(l->io, p->jf, jb, (size_t)*jlen, 0)) < 0) {
        ferry__free(jb);
        return ferry__pslab_fail_io(p, rc, "pslab: reading journal %s", p->jpath);
    }
    rc = ferry__pslab_index_load(jb, (size_t)*jlen, &p->g, &p->idx, &p->alloc, L, why,
                                 sizeof why);
    ferry__free(jb);
    if (rc < 0)
        return ferry__pslab_fail(p, rc, "pslab: journal %s: %s", p->jpath, why);
    return 0;
}

/*
 * Act on what the replay found: say so for damage and for a torn tail,
 * cut the tail and sync what a killed predecessor left (unless read-only),
 * and take over the journal's position, sequence and counters.
 */
static int settle_journal(ferry_pslab *p, const ferry__pslab_load *L, uint64_t jlen)
{
    int rc;
    if (L->damaged)
        FERRY_LOGW("pslab: journal %s: %llu bad record(s) from offset %llu (%llu bytes) that "
                   "later commits prove durable: damage, not a torn tail (%llu identified as "
                   "one record with one byte changed: only its key dropped; any other drops "
                   "every chunk recorded before it); %llu chunk(s) dropped%s",
                   p->jpath, (unsigned long long)L->damaged,
                   (unsigned long long)L->bad_off, (unsigned long long)L->damaged_bytes,
                   (unsigned long long)L->damaged_known, (unsigned long long)L->damaged_chunks,
                   (p->flags & FERRY_PSLAB_READONLY) ? " (read-only: file left as is)"
                                                     : "; the journal is rewritten");
    if (L->torn) {
        FERRY_LOGW("pslab: journal %s: bad or torn record at offset %llu; %llu bytes after it "
                   "dropped%s", p->jpath, (unsigned long long)L->good_end,
                   (unsigned long long)(jlen - L->good_end),
                   (p->flags & FERRY_PSLAB_READONLY) ? " (read-only: file left as is)" : "");
        if (!(p->flags & FERRY_PSLAB_READONLY)) {
            rc = ferry_file_truncate(p->jf, L->good_end);
            if (rc == 0)
                rc = ferry_file_sync(p->jf);
            if (rc < 0)
                return ferry__pslab_fail_io(p, rc, "pslab: cutting journal %s at %llu", p->jpath,
                                            (unsigned long long)L->good_end);
        }
    }
    p->jsize = L->good_end;
    p->jversion = L->jh.version;
    if (!(p->flags & FERRY_PSLAB_READONLY)) {
        /* what a killed predecessor appended may still sit in the page
         * cache: on the disk before a barrier may say it is */
        rc = ferry_file_sync(p->jf);
        if (rc < 0)
            return ferry__pslab_fail_io(p, rc, "pslab: fdatasync of journal %s", p->jpath);
        p->jsynced = p->jsize;
    }
    p->jrecords = L->records;
    p->generation = L->jh.generation;
    p->next_seq = L->next_seq;
    p->st.durable_seq = L->next_seq - 1;
    p->st.recovered = p->idx.count;
    p->st.replayed_records = L->records;
    p->st.dropped_records = L->dropped;
    p->st.torn_bytes = jlen - L->good_end + L->damaged_bytes;
    p->st.damaged_chunks = L->damaged_chunks;
    p->need_compact = !(p->flags & FERRY_PSLAB_READONLY) &&
                      (L->damaged || p->jversion < ferry__pslab_write_format());
    return 0;
}

int ferry__pslab_recover(ferry_pslab *p, const ferry_pslab_options *o)
{
    int rc = check_slab_files(p, o);
    if (rc < 0)
        return rc;
    ferry__pslab_load L;
    uint64_t jlen = 0;
    if ((rc = replay_journal(p, &L, &jlen)) < 0)
        return rc;
    return settle_journal(p, &L, jlen);
}
