/*
 * cmd_slab.c - the persistent slab's commands:
 *
 *   ferry slab check DIR [DIR...] [--repair | --reset] [--json]
 *       Verify a persistent slab: every slab file's header, the journal
 *       (records replayed, records refused, a bad or torn tail) and every
 *       chunk's payload checksum. Without --repair nothing is modified (the
 *       store is opened read-only, under a shared lock). --repair cuts the
 *       journal after its last good record, deletes the chunks whose bytes
 *       fail their checksum and compacts the journal so refused records are
 *       gone too. --reset empties the slab (every chunk dropped), keeping
 *       its size, geometry and tag: what a KV store refused for another
 *       layout needs to be reused. A slab in use by a store (its directory
 *       lock held) is neither checked, repaired nor reset: the command says
 *       which process has it. Exit status: 0 clean (or reset), 1 problems
 *       found (with --repair: found and repaired, each listed) or the slab
 *       is in use, 2 usage error or a slab that cannot be read at all (no
 *       store, a newer format, a foreign or corrupt header). The format
 *       reported is the slab's own (its journal's): a check leaves an
 *       older one as it is, --repair upgrades it to this library's.
 *
 *   ferry slab reset DIR [DIR...] [--json]
 *       The same as slab check --reset.
 *
 *   ferry slab bench [--dir DIR] [--chunks 100000] [--small 4K]
 *                    [--size 4M] [--count 64] [--batch 8] [--engine E] [--json]
 *       (1) creates a slab of `chunks` chunks of `small` bytes, closes it and
 *       times the reopen (index replay + allocator rebuild); (2) stores
 *       `count` chunks of `size` bytes through the non-persistent GDS slab
 *       (for scale), through the persistent slab with no per-put sync and one
 *       fdatasync at the end (the reference: the bytes reach the disk, nothing
 *       is acknowledged before the end), with group commit (`batch` chunks
 *       per commit) and one put at a time, and reports each GB/s and the
 *       ratio to the reference, all measured in this one run.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "core.h"
#include "core/dirlock.h"
#include "pslab/pslab_reader.h"

/* ---- check ---- */
typedef struct bad_list {
    json_t *arr;
    int json;
    int repair;
} bad_list;

static void key_text(const void *key, size_t klen, char *out, size_t n)
{
    const unsigned char *k = key;
    int printable = 1;
    for (size_t i = 0; i < klen; i++)
        if (k[i] < 0x20 || k[i] > 0x7e)
            printable = 0;
    if (printable) {
        snprintf(out, n, "%.*s", (int)(klen < n - 1 ? klen : n - 1), (const char *)k);
        return;
    }
    size_t o = 0;
    out[o++] = '0';
    out[o++] = 'x';
    for (size_t i = 0; i < klen && o + 3 < n; i++)
        o += (size_t)snprintf(out + o, n - o, "%02x", k[i]);
    out[o] = 0;
}

static void on_bad(const void *key, size_t klen, const ferry_pslab_info *info, int code, void *ctx)
{
    bad_list *b = ctx;
    char k[128];
    key_text(key, klen, k, sizeof k);
    if (b->json) {
        json_t *o = json_object();
        json_object_set_new(o, "key", json_string(k));
        json_object_set_new(o, "offset", json_integer((json_int_t)info->offset));
        json_object_set_new(o, "length", json_integer((json_int_t)info->length));
        json_object_set_new(o, "seq", json_integer((json_int_t)info->seq));
        json_object_set_new(o, "error", json_string(ferry_err_name(code)));
        json_array_append_new(b->arr, o);
    } else {
        printf("  bad chunk: key %s, %llu bytes at slab offset %llu (sequence %llu): %s%s\n", k,
               (unsigned long long)info->length, (unsigned long long)info->offset,
               (unsigned long long)info->seq, ferry_strerror(code),
               b->repair ? " -> deleted" : "");
    }
}

/* the open failed with FERRY_EBUSY: say who has the slab; exit 1 */
static int in_use(const char *cmd, const char *const *dirs, unsigned nd, int json,
                  const char *doing)
{
    int pid = 0;
    const char *dir = dirs[0];
    for (unsigned i = 0; i < nd && !pid; i++)
        if ((pid = ferry__dir_lock_holder(dirs[i])) != 0)
            dir = dirs[i];
    if (json) {
        json_t *root = json_object();
        json_object_set_new(root, "dir", json_string(dir));
        json_object_set_new(root, "readable", json_false());
        json_object_set_new(root, "in_use", json_true());
        if (pid > 0)
            json_object_set_new(root, "pid", json_integer(pid));
        json_object_set_new(root, "error", json_string(ferry_err_name(FERRY_EBUSY)));
        json_object_set_new(root, "message", json_string(ferry_last_error()));
        json_dumpf(root, stdout, JSON_INDENT(2));
        printf("\n");
        json_decref(root);
    } else if (pid > 0) {
        fprintf(stderr, "ferry %s: %s: the slab is in use by process %d: not %s "
                "while a store has it open (close that store first)\n", cmd, dir, pid, doing);
    } else {
        fprintf(stderr, "ferry %s: %s: the slab is in use by another process: not %s "
                "while a store has it open (%s)\n", cmd, dir, doing, ferry_last_error());
    }
    return 1;
}

/*
 * A reset the library refused before it changed anything: say why in the
 * CLI's words (the library's message names its options, which a CLI user
 * cannot set). -ENOENT: a directory is missing, or holds no slab; else the
 * slab's header is unreadable, so its size cannot be kept. Exit 2.
 */
/* -ENOENT from an open that creates nothing: which directory is missing,
 * or that the first holds no slab, in msg; the directory named */
static const char *no_slab_msg(const char *const *dirs, unsigned nd, const char *doing,
                               char *msg, size_t n)
{
    struct stat st;
    for (unsigned i = 0; i < nd; i++)
        if (stat(dirs[i], &st) != 0 || !S_ISDIR(st.st_mode)) {
            snprintf(msg, n, "no directory %s: nothing to %s (nothing was created); give the "
                     "directories of an existing slab", dirs[i], doing);
            return dirs[i];
        }
    char jp[4200];
    snprintf(jp, sizeof jp, "%s/%s", dirs[0], FERRY_PSLAB_JOURNAL);
    if (stat(jp, &st) == 0) { /* a slab whose file is missing: the library says which */
        snprintf(msg, n, "%s: cannot %s the slab: %s", dirs[0], doing, ferry_last_error());
        return dirs[0];
    }
    snprintf(msg, n, "%s holds no slab (no %s, no %s): nothing to %s, nothing was changed; a "
             "store creates its slab when it opens (a KV store's persistent L2 directory)",
             dirs[0], FERRY_PSLAB_JOURNAL, FERRY_PSLAB_FILE, doing);
    return dirs[0];
}

/* a refused reset, printed (JSON on stdout, else a line on stderr): exit 2 */
static int reset_says_no(const char *cmd, const char *dir, int rc, const char *msg, int json)
{
    if (json) {
        json_t *root = json_object();
        json_object_set_new(root, "dir", json_string(dir));
        json_object_set_new(root, "reset", json_false());
        json_object_set_new(root, "error", json_string(ferry_err_name(rc)));
        json_object_set_new(root, "message", json_string(msg));
        json_dumpf(root, stdout, JSON_INDENT(2));
        printf("\n");
        json_decref(root);
    } else {
        fprintf(stderr, "ferry %s: %s (%s)\n", cmd, msg, ferry_err_name(rc));
    }
    return 2;
}

static int reset_refused(const char *cmd, const char *const *dirs, unsigned nd, int json, int rc)
{
    char msg[2048];
    const char *dir = dirs[0];
    if (rc == -ENOENT)
        dir = no_slab_msg(dirs, nd, "reset", msg, sizeof msg);
    else
        snprintf(msg, sizeof msg, "%s: the slab's header cannot be read, so a reset cannot keep "
                 "its size; nothing was changed. To start afresh remove %s/%s and %s/%s (a store "
                 "creates a new slab when it opens)", dir, dir, FERRY_PSLAB_FILE, dir,
                 FERRY_PSLAB_JOURNAL);
    return reset_says_no(cmd, dir, rc, msg, json);
}

/*
 * The directories must be the slab's own, all of them in their order: the
 * library's reset makes a new slab of whatever directories it is given, so
 * one drive of a striped slab would become a slab of its own (the others
 * orphaned, the size the whole slab's). A read-only open says whether they
 * are (FERRY_EMISMATCH: another count or order, or not every drive of a
 * reset that was interrupted, its marker says); any other answer is left
 * to the reset itself (a slab in use, unreadable or of a newer format).
 * 0 to go on, else the exit status (2, printed; nothing changed).
 */
static int reset_dirs_ok(const char *cmd, const char *const *dirs, unsigned nd, int json)
{
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = nd;
    o.flags = FERRY_PSLAB_READONLY;
    o.engine = "posix";
    ferry_pslab *p = NULL;
    int rc = ferry_pslab_open(&o, &p);
    if (rc >= 0) {
        ferry_pslab_close(p);
        return 0;
    }
    if (rc != FERRY_EMISMATCH)
        return 0;
    char msg[2048];
    if (strstr(ferry_last_error(), FERRY_PSLAB_RESET_MARK)) /* (says what to do itself) */
        snprintf(msg, sizeof msg, "%s: %s", dirs[0], ferry_last_error());
    else
        snprintf(msg, sizeof msg, "%s: not the slab's directories: %s; nothing was changed. "
                 "Give every directory of the slab, in its order (as the store was opened), or "
                 "to start afresh remove %s and %s from each", dirs[0], ferry_last_error(),
                 FERRY_PSLAB_FILE, FERRY_PSLAB_JOURNAL);
    return reset_says_no(cmd, dirs[0], rc, msg, json);
}

/* cmd: "slab reset" or "slab check" (--reset), for its messages */
static int slab_reset(const char *cmd, const char *const *dirs, unsigned nd, int json)
{
    int st = reset_dirs_ok(cmd, dirs, nd, json);
    if (st)
        return st;
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = nd;
    o.flags = FERRY_PSLAB_RESET;
    o.engine = "posix";
    ferry_pslab *p = NULL;
    int rc = ferry_pslab_open(&o, &p);
    if (rc == FERRY_EBUSY)
        return in_use(cmd, dirs, nd, json, "resetting it");
    if (rc == -ENOENT || rc == FERRY_ECORRUPT || rc == FERRY_EVERSION)
        return reset_refused(cmd, dirs, nd, json, rc);
    if (rc < 0) {
        fprintf(stderr, "ferry %s: %s: %s (%s)\n", cmd, dirs[0], ferry_last_error(),
                ferry_err_name(rc));
        return rc == -EINVAL ? 2 : 1;
    }
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p, &s);
    rc = ferry_pslab_close(p);
    if (rc < 0) {
        fprintf(stderr, "ferry %s: %s: closing after the reset: %s\n", cmd, dirs[0],
                ferry_last_error());
        return 1;
    }
    if (json) {
        json_t *root = json_object();
        json_object_set_new(root, "dir", json_string(dirs[0]));
        json_object_set_new(root, "reset", json_true());
        json_object_set_new(root, "capacity", json_integer((json_int_t)s.capacity));
        json_object_set_new(root, "chunks", json_integer(0));
        json_dumpf(root, stdout, JSON_INDENT(2));
        printf("\n");
        json_decref(root);
    } else {
        printf("slab %s: reset: every chunk dropped; an empty slab of %llu bytes, alignment "
               "%zu, with its old tag, is in its place\n", dirs[0],
               (unsigned long long)s.capacity, s.alignment);
    }
    return 0;
}

/* the arguments of slab check and slab reset */
typedef struct slab_args {
    int json, repair, reset;
    const char *dirs[FERRY_PSLAB_MAX_DIRS];
    unsigned nd;
    unsigned format; /* the open slab's (its journal's; --repair upgrades it) */
} slab_args;

/* parse cmd's arguments (modes: --repair/--reset allowed); -1 to go on,
 * else the exit status (help printed: 0; usage error: 2) */
static int slab_parse(const char *cmd, int modes, const char *help, int argc, char **argv,
                      slab_args *a)
{
    memset(a, 0, sizeof *a);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            a->json = 1;
        else if (modes && !strcmp(argv[i], "--repair"))
            a->repair = 1;
        else if (modes && !strcmp(argv[i], "--reset"))
            a->reset = 1;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("%s", help);
            return 0;
        } else if (argv[i][0] == '-')
            return cli_unknown(cmd, argv[i]);
        else if (a->nd < FERRY_PSLAB_MAX_DIRS)
            a->dirs[a->nd++] = argv[i];
        else
            return cli_usage(cmd, "at most %u directories", FERRY_PSLAB_MAX_DIRS);
    }
    if (!a->nd)
        return cli_usage(cmd, "which directory? (ferry %s DIR)", cmd);
    if (a->repair && a->reset)
        return cli_usage(cmd, "--repair and --reset exclude each other");
    return -1;
}

/* a slab that cannot be read at all: say why (exit 2) */
static int slab_unreadable(const slab_args *a, int rc)
{
    char msg[2048];
    const char *dir = a->dirs[0];
    if (rc == -ENOENT)
        dir = no_slab_msg(a->dirs, a->nd, a->repair ? "repair" : "check", msg, sizeof msg);
    else
        snprintf(msg, sizeof msg, "%s: cannot read the slab: %s", dir, ferry_last_error());
    if (a->json) {
        json_t *root = json_object();
        json_object_set_new(root, "dir", json_string(dir));
        json_object_set_new(root, "readable", json_false());
        json_object_set_new(root, "error", json_string(ferry_err_name(rc)));
        json_object_set_new(root, "message", json_string(msg));
        json_dumpf(root, stdout, JSON_INDENT(2));
        printf("\n");
        json_decref(root);
    } else {
        fprintf(stderr, "ferry slab check: %s (%s)\n", msg, ferry_err_name(rc));
    }
    return 2;
}

/* the text report's head: what the slab is and what its journal held */
static void slab_print_head(const slab_args *a, const ferry_pslab_stats *s0)
{
    printf("slab %s: format %u, %u drive(s), %llu bytes, alignment %zu, stripe %llu, "
           "creation id %016llx, generation %llu\n", a->dirs[0], a->format,
           s0->drives, (unsigned long long)s0->capacity, s0->alignment,
           (unsigned long long)s0->stripe_bytes, (unsigned long long)s0->creation_id,
           (unsigned long long)s0->generation);
    printf("headers: ok\n");
    printf("journal: %llu records replayed, %llu refused (out of range or overlapping), "
           "%llu bytes of bad or torn tail%s\n",
           (unsigned long long)s0->replayed_records, (unsigned long long)s0->dropped_records,
           (unsigned long long)s0->torn_bytes, s0->torn_bytes && a->repair ? " -> cut" : "");
    if (s0->damaged_chunks)
        printf("journal damage: a bad record that a later commit proves durable; the %llu "
               "chunk(s) recorded before it are dropped (any may have been rewritten or "
               "deleted by it)%s\n", (unsigned long long)s0->damaged_chunks,
               a->repair ? " -> journal rewritten without them" : "");
    printf("index: %llu chunks, %llu bytes stored in %llu bytes of extents (opened in "
           "%.3f ms)\n", (unsigned long long)s0->recovered,
           (unsigned long long)s0->bytes_stored, (unsigned long long)s0->bytes_used,
           (double)s0->open_ns / 1e6);
    printf("payloads:\n");
}

/* what a check found, as one JSON document (takes bad_chunks) */
static void slab_print_json(const slab_args *a, const ferry_pslab_stats *s0,
                            const ferry_pslab_stats *s1, json_t *bad_chunks, int problems,
                            int io_failed)
{
    json_t *root = json_object();
    json_object_set_new(root, "dir", json_string(a->dirs[0]));
    json_object_set_new(root, "readable", json_true());
    json_object_set_new(root, "format", json_integer(a->format));
    json_object_set_new(root, "drives", json_integer(s0->drives));
    json_object_set_new(root, "capacity", json_integer((json_int_t)s0->capacity));
    json_object_set_new(root, "alignment", json_integer((json_int_t)s0->alignment));
    json_object_set_new(root, "stripe", json_integer((json_int_t)s0->stripe_bytes));
    char id[32];
    snprintf(id, sizeof id, "%016llx", (unsigned long long)s0->creation_id);
    json_object_set_new(root, "creation_id", json_string(id));
    json_object_set_new(root, "generation", json_integer((json_int_t)s0->generation));
    json_object_set_new(root, "records", json_integer((json_int_t)s0->replayed_records));
    json_object_set_new(root, "refused_records", json_integer((json_int_t)s0->dropped_records));
    json_object_set_new(root, "torn_bytes", json_integer((json_int_t)s0->torn_bytes));
    json_object_set_new(root, "damaged_chunks", json_integer((json_int_t)s0->damaged_chunks));
    json_object_set_new(root, "chunks", json_integer((json_int_t)s0->recovered));
    json_object_set_new(root, "bad_chunks", bad_chunks);
    json_object_set_new(root, "chunks_after", json_integer((json_int_t)s1->chunks));
    json_object_set_new(root, "open_ms", json_real((double)s0->open_ns / 1e6));
    json_object_set_new(root, "clean", json_boolean(!problems));
    json_object_set_new(root, "repaired", json_boolean(a->repair && problems && !io_failed));
    json_dumpf(root, stdout, JSON_INDENT(2));
    printf("\n");
    json_decref(root);
}

/* the text report's tail: the payloads and the verdict */
static void slab_print_tail(const slab_args *a, const ferry_pslab_stats *s0,
                            const ferry_pslab_stats *s1, uint64_t bad, int problems,
                            int io_failed, int compacted)
{
    printf("  %llu chunks read, %llu failed their checksum%s\n",
           (unsigned long long)s0->recovered, (unsigned long long)bad,
           bad && a->repair ? " (deleted)" : "");
    if (!problems)
        printf("clean\n");
    else if (a->repair && !io_failed)
        printf("repaired:%s%s%s%s%s; %llu chunks remain\n",
               s0->torn_bytes ? (s0->damaged_chunks ? " journal rewritten without its bad records"
                                                    : " journal cut after its last good record")
                              : "",
               s0->torn_bytes && bad ? "," : "", bad ? " bad chunks deleted" : "",
               compacted ? "," : "",
               compacted ? " journal compacted (refused and deleted records gone)" : "",
               (unsigned long long)s1->chunks);
    else
        printf("problems found: run with --repair to drop what is bad\n");
}

static int slab_check(int argc, char **argv)
{
    slab_args a;
    int st = slab_parse("slab check", 1,
                        "usage: ferry slab check DIR [DIR...] [--repair | --reset] [--json]\n"
                        "  --repair  cut a bad journal tail, delete chunks failing their "
                        "checksum\n"
                        "  --reset   drop every chunk: an empty slab of the same size and tag\n"
                        "exit status: 0 clean (or reset), 1 problems found (repaired with "
                        "--repair) or the slab is in use by a store, 2 usage or unreadable "
                        "slab\n",
                        argc, argv, &a);
    if (st >= 0)
        return st;
    if (a.reset)
        return slab_reset("slab check", a.dirs, a.nd, a.json);
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = a.dirs;
    o.n_dirs = a.nd;
    o.flags = a.repair ? 0 : FERRY_PSLAB_READONLY;
    o.engine = "posix";
    ferry_pslab *p = NULL;
    int rc = ferry_pslab_open(&o, &p);
    if (rc == FERRY_EBUSY)
        return in_use("slab check", a.dirs, a.nd, a.json, a.repair ? "repairing it" : "checking it");
    if (rc < 0)
        return slab_unreadable(&a, rc);
    ferry_pslab_stats s0 = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p, &s0);
    a.format = ferry__pslab_format(p);
    if (!a.json)
        slab_print_head(&a, &s0);
    bad_list bl = {json_array(), a.json, a.repair};
    uint64_t bad = 0;
    rc = ferry_pslab_verify(p, a.repair, &bad, on_bad, &bl);
    int io_failed = rc < 0;
    if (io_failed)
        fprintf(stderr, "ferry slab check: %s: reading the payloads: %s (%s)\n", a.dirs[0],
                ferry_last_error(), ferry_err_name(rc));
    int compacted = 0;
    if (!io_failed && a.repair && (s0.dropped_records || bad)) {
        rc = ferry_pslab_compact(p);
        if (rc < 0)
            fprintf(stderr, "ferry slab check: %s: compacting the journal: %s\n", a.dirs[0],
                    ferry_last_error());
        else
            compacted = 1;
    }
    ferry_pslab_stats s1 = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p, &s1);
    int crc = ferry_pslab_close(p);
    int problems = s0.torn_bytes || s0.dropped_records || bad || io_failed;
    if (a.json) {
        slab_print_json(&a, &s0, &s1, bl.arr, problems, io_failed);
    } else {
        json_decref(bl.arr);
        slab_print_tail(&a, &s0, &s1, bad, problems, io_failed, compacted);
    }
    if (crc < 0)
        fprintf(stderr, "ferry slab check: %s: closing: %s\n", a.dirs[0], ferry_last_error());
    return problems ? 1 : 0;
}

/* ---- bench ---- */
typedef struct bench_opts {
    const char *dir;
    uint64_t chunks, small, size, count, batch;
    const char *engine;
    int json;
} bench_opts;

static int mkdir_in(const char *base, const char *name, char *out, size_t n)
{
    snprintf(out, n, "%s/%s", base, name);
    return 0;
}

static void rm_store(const char *d)
{
    static const char *const names[] = {FERRY_PSLAB_FILE, FERRY_PSLAB_JOURNAL, FERRY_GDS_SLAB_NAME,
                                        FERRY_PSLAB_LOCK};
    char p[4200];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (snprintf(p, sizeof p, "%s/%s", d, names[i]) < (int)sizeof p)
            unlink(p);
    rmdir(d);
}

/* reopen time of a slab of o->chunks small chunks; seconds, or < 0 */
static int bench_reopen(const bench_opts *o, const char *d, double *create_s, double *reopen_s,
                        ferry_pslab_stats *st)
{
    const char *dirs[] = {d};
    ferry_pslab_options po = FERRY_PSLAB_OPTIONS_INIT;
    po.dirs = dirs;
    po.n_dirs = 1;
    po.bytes = o->chunks * FERRY__ALIGN_UP(o->small, 4096) + (64u << 20);
    po.flags = FERRY_PSLAB_CREATE;
    po.engine = o->engine;
    po.direct = 0; /* filling it fast; the reopen reads the journal, not the data */
    ferry_pslab *p = NULL;
    int rc = ferry_pslab_open(&po, &p);
    if (rc < 0)
        return cli_fail("slab bench", "creating the slab", rc);
    uint8_t *buf = malloc(o->small);
    enum { B = 1024 };
    ferry_pslab_item *items = calloc(B, sizeof *items);
    char(*keys)[40] = calloc(B, 40);
    for (uint64_t i = 0; i < o->small; i++)
        buf[i] = (uint8_t)(i * 31);
    uint64_t t0 = ferry__now_ns();
    for (uint64_t i = 0; i < o->chunks && rc >= 0; i += B) {
        unsigned n = (unsigned)FERRY__MIN((uint64_t)B, o->chunks - i);
        for (unsigned j = 0; j < n; j++) {
            items[j].klen = (size_t)snprintf(keys[j], 40, "model/chunk/%016llx",
                                             (unsigned long long)(i + j));
            items[j].key = keys[j];
            items[j].data = buf;
            items[j].len = o->small;
        }
        rc = ferry_pslab_put_many(p, items, n);
        if (rc >= 0 && (unsigned)rc != n)
            rc = items[0].result < 0 ? items[0].result : -EIO;
        cli_progress("creating", i + n, o->chunks);
    }
    cli_progress_end();
    free(items);
    free(keys);
    free(buf);
    if (rc < 0) {
        rc = cli_fail("slab bench", "storing the small chunks", rc);
        ferry_pslab_close(p);
        return rc;
    }
    *create_s = (double)(ferry__now_ns() - t0) / 1e9;
    if ((rc = ferry_pslab_close(p)) < 0)
        return cli_fail("slab bench", "closing", rc);
    po.flags = 0;
    po.bytes = 0;
    t0 = ferry__now_ns();
    rc = ferry_pslab_open(&po, &p);
    if (rc < 0)
        return cli_fail("slab bench", "reopening", rc);
    *reopen_s = (double)(ferry__now_ns() - t0) / 1e9;
    st->size = sizeof *st;
    ferry_pslab_stats_get(p, st);
    ferry_pslab_close(p);
    return st->recovered == o->chunks ? 0 : cli_fail("slab bench", "reopen lost chunks", -EIO);
}

/* store o->count chunks of o->size through the non-persistent GDS slab: GB/s */
static int bench_gds(const bench_opts *o, const char *d, const void *buf, double *gbs)
{
    const char *dirs[] = {d};
    ferry_gds_config c = FERRY_GDS_CONFIG_INIT;
    c.dirs = dirs;
    c.n_dirs = 1;
    c.bytes = o->count * FERRY__ALIGN_UP(o->size, 4096);
    c.direct = 1;
    c.driver = "cpu";
    c.engine = o->engine;
    ferry_gds *g = NULL;
    int rc = ferry_gds_open(&c, &g);
    if (rc < 0)
        return cli_fail("slab bench", "opening the GDS slab (reference)", rc);
    ferry_slab *s = ferry_gds_slab(g);
    uint64_t t0 = ferry__now_ns();
    for (uint64_t i = 0; i < o->count && rc >= 0; i++) {
        ferry_extent e;
        rc = ferry_slab_alloc_bytes(s, o->size, &e);
        if (rc >= 0)
            rc = ferry_gds_extent_pwrite(g, &e, buf);
    }
    double t = (double)(ferry__now_ns() - t0) / 1e9;
    if (rc < 0)
        rc = cli_fail("slab bench", "storing through the GDS slab", rc);
    ferry_gds_close(g);
    if (rc < 0)
        return rc;
    *gbs = (double)o->count * (double)o->size / t / 1e9;
    return 0;
}

/* the same through the persistent slab, batch chunks per group commit: GB/s */
static int bench_pslab(const bench_opts *o, const char *d, const void *buf, uint64_t batch,
                       int sync, double *gbs, uint64_t *commits)
{
    const char *dirs[] = {d};
    ferry_pslab_options po = FERRY_PSLAB_OPTIONS_INIT;
    po.dirs = dirs;
    po.n_dirs = 1;
    po.bytes = o->count * FERRY__ALIGN_UP(o->size, 4096);
    po.flags = FERRY_PSLAB_CREATE;
    po.engine = o->engine;
    po.sync = sync;
    ferry_pslab *p = NULL;
    int rc = ferry_pslab_open(&po, &p);
    if (rc < 0)
        return cli_fail("slab bench", "creating the persistent slab", rc);
    ferry_pslab_item *items = calloc(batch, sizeof *items);
    char(*keys)[40] = calloc(batch, 40);
    uint64_t t0 = ferry__now_ns();
    for (uint64_t i = 0; i < o->count && rc >= 0; i += batch) {
        unsigned n = (unsigned)FERRY__MIN(batch, o->count - i);
        for (unsigned j = 0; j < n; j++) {
            items[j].klen = (size_t)snprintf(keys[j], 40, "chunk-%llu",
                                             (unsigned long long)(i + j));
            items[j].key = keys[j];
            items[j].data = buf;
            items[j].len = o->size;
        }
        if (batch == 1) {
            rc = ferry_pslab_put(p, items[0].key, items[0].klen, buf, o->size);
        } else {
            rc = ferry_pslab_put_many(p, items, n);
            if (rc >= 0 && (unsigned)rc != n)
                rc = -EIO;
        }
    }
    /* the non-durable reference still has to reach the disk: one flush at the
     * end; batch mode: the last batch too */
    if (rc >= 0 && sync != FERRY_PSLAB_SYNC_FULL)
        rc = ferry_pslab_sync(p);
    double t = (double)(ferry__now_ns() - t0) / 1e9;
    free(items);
    free(keys);
    ferry_pslab_stats st = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p, &st);
    if (rc < 0)
        rc = cli_fail("slab bench", "storing through the persistent slab", rc);
    ferry_pslab_close(p);
    if (rc < 0)
        return rc;
    *gbs = (double)o->count * (double)o->size / t / 1e9;
    *commits = st.commits;
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* latency of n puts of o->small bytes, one at a time: p50, p99 in microseconds */
static int bench_latency(const bench_opts *o, const char *d, int sync, unsigned n, double *p50,
                         double *p99, uint64_t *syncs)
{
    const char *dirs[] = {d};
    ferry_pslab_options po = FERRY_PSLAB_OPTIONS_INIT;
    po.dirs = dirs;
    po.n_dirs = 1;
    po.bytes = (uint64_t)n * FERRY__ALIGN_UP(o->small, 4096);
    po.flags = FERRY_PSLAB_CREATE;
    po.engine = o->engine;
    po.sync = sync;
    ferry_pslab *p = NULL;
    int rc = ferry_pslab_open(&po, &p);
    if (rc < 0)
        return cli_fail("slab bench", "creating the latency slab", rc);
    uint8_t *buf = malloc(o->small);
    uint64_t *lat = malloc(n * sizeof *lat);
    memset(buf, 0x5a, o->small);
    for (unsigned i = 0; i < n && rc >= 0; i++) {
        char k[32];
        int kl = snprintf(k, sizeof k, "lat-%u", i);
        uint64_t t0 = ferry__now_ns();
        rc = ferry_pslab_put(p, k, (size_t)kl, buf, o->small);
        lat[i] = ferry__now_ns() - t0;
    }
    ferry_pslab_stats st = FERRY_PSLAB_STATS_INIT;
    ferry_pslab_stats_get(p, &st);
    *syncs = st.commits;
    if (rc < 0)
        rc = cli_fail("slab bench", "timing puts", rc);
    ferry_pslab_close(p);
    if (rc == 0) {
        qsort(lat, n, sizeof *lat, cmp_u64);
        *p50 = (double)lat[n / 2] / 1e3;
        *p99 = (double)lat[(size_t)n * 99 / 100] / 1e3;
    }
    free(buf);
    free(lat);
    return rc;
}

/* what slab bench measured */
typedef struct bench_res {
    double create_s, reopen_s, gds, none1, none2, grp, one, bat;
    uint64_t cgrp, cone, cnone, cbat;
    double l50, l99, n50, n99;
    uint64_t lsync, nsync;
    ferry_pslab_stats st;
} bench_res;

/* slab bench's options: -1 to go on, else the exit status */
static int bench_parse(int argc, char **argv, bench_opts *o)
{
    static const char *const engines[] = {"posix", "uring", NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0, idx = 0;
        if (!strcmp(a, "--json"))
            o->json = 1;
        else if (!strcmp(a, "--dir"))
        {
            rc = cli_opt_string("slab bench", a, v, "a directory", &o->dir), i++;
            struct stat st;
            if (rc == 0 && stat(o->dir, &st) != 0)
                rc = cli_bad("slab bench", a, o->dir, "an existing directory", "%s",
                             errno == ENOENT ? "no such directory" : strerror(errno));
            else if (rc == 0 && !S_ISDIR(st.st_mode))
                rc = cli_bad("slab bench", a, o->dir, "an existing directory", "not a directory");
        }
        else if (!strcmp(a, "--engine")) {
            rc = cli_opt_choice("slab bench", a, v, engines, &idx), i++;
            o->engine = engines[idx];
        } else if (!strcmp(a, "--chunks"))
            rc = cli_opt_count("slab bench", a, v, 1, 10000000, &o->chunks), i++;
        else if (!strcmp(a, "--small"))
            rc = cli_opt_size("slab bench", a, v, 1, 1u << 20, 0, &o->small), i++;
        else if (!strcmp(a, "--size"))
            rc = cli_opt_size("slab bench", a, v, 1, 1u << 30, 0, &o->size), i++;
        else if (!strcmp(a, "--count"))
            rc = cli_opt_count("slab bench", a, v, 1, 100000, &o->count), i++;
        else if (!strcmp(a, "--batch"))
            rc = cli_opt_count("slab bench", a, v, 1, 100000, &o->batch), i++;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: ferry slab bench [--dir DIR] [--chunks 100000] [--small 4K] "
                   "[--size 4M] [--count 64] [--batch 8] [--engine posix|uring] [--json]\n"
                   "ranges: --chunks 1..10000000, --small 1..1M, --size 1..1G, "
                   "--count 1..100000, --batch 1..100000\n");
            return 0;
        } else
            return cli_unknown("slab bench", a);
        if (rc)
            return rc;
    }
    return -1;
}

/* every measurement, in dirs d[0..4) (each emptied after) */
static int bench_all(const bench_opts *o, char d[4][4200], bench_res *r)
{
    int rc = bench_reopen(o, d[0], &r->create_s, &r->reopen_s, &r->st);
    rm_store(d[0]);
    if (rc == 0)
        rc = bench_latency(o, d[0], FERRY_PSLAB_SYNC_FULL, 200, &r->l50, &r->l99, &r->lsync);
    rm_store(d[0]);
    if (rc == 0)
        rc = bench_latency(o, d[0], FERRY_PSLAB_SYNC_NONE, 200, &r->n50, &r->n99, &r->nsync);
    rm_store(d[0]);
    void *buf = NULL;
    if (rc == 0 && posix_memalign(&buf, 4096, FERRY__ALIGN_UP(o->size, 4096)) != 0)
        rc = cli_fail("slab bench", "allocating the chunk buffer", -ENOMEM);
    if (rc == 0) {
        for (uint64_t i = 0; i < o->size; i++)
            ((uint8_t *)buf)[i] = (uint8_t)(i * 7 + 1);
        /* the non-persistent runs before and after, so drift of the disk shows */
        rc = bench_gds(o, d[1], buf, &r->gds);
        rm_store(d[1]);
        if (rc == 0)
            rc = bench_pslab(o, d[1], buf, o->batch, FERRY_PSLAB_SYNC_NONE, &r->none1, &r->cnone);
        rm_store(d[1]);
        if (rc == 0)
            rc = bench_pslab(o, d[2], buf, o->batch, FERRY_PSLAB_SYNC_FULL, &r->grp, &r->cgrp);
        rm_store(d[2]);
        if (rc == 0)
            rc = bench_pslab(o, d[3], buf, 1, FERRY_PSLAB_SYNC_FULL, &r->one, &r->cone);
        rm_store(d[3]);
        if (rc == 0)
            rc = bench_pslab(o, d[3], buf, 1, FERRY_PSLAB_SYNC_BATCH, &r->bat, &r->cbat);
        rm_store(d[3]);
        if (rc == 0)
            rc = bench_pslab(o, d[1], buf, o->batch, FERRY_PSLAB_SYNC_NONE, &r->none2, &r->cnone);
    }
    free(buf);
    return rc;
}

static void bench_print_json(const bench_opts *o, const bench_res *r)
{
    double ref = (r->none1 + r->none2) / 2;
    json_t *j = json_object();
    json_object_set_new(j, "chunks", json_integer((json_int_t)o->chunks));
    json_object_set_new(j, "small_bytes", json_integer((json_int_t)o->small));
    json_object_set_new(j, "create_s", json_real(r->create_s));
    json_object_set_new(j, "reopen_s", json_real(r->reopen_s));
    json_object_set_new(j, "journal_bytes", json_integer((json_int_t)r->st.journal_bytes));
    json_object_set_new(j, "put_us_p50", json_real(r->l50));
    json_object_set_new(j, "put_us_p99", json_real(r->l99));
    json_object_set_new(j, "put_nosync_us_p50", json_real(r->n50));
    json_object_set_new(j, "put_nosync_us_p99", json_real(r->n99));
    json_object_set_new(j, "chunk_bytes", json_integer((json_int_t)o->size));
    json_object_set_new(j, "count", json_integer((json_int_t)o->count));
    json_object_set_new(j, "batch", json_integer((json_int_t)o->batch));
    json_object_set_new(j, "gds_gbs", json_real(r->gds));
    json_object_set_new(j, "nosync_gbs", json_real(ref));
    json_object_set_new(j, "nosync_gbs_before", json_real(r->none1));
    json_object_set_new(j, "nosync_gbs_after", json_real(r->none2));
    json_object_set_new(j, "group_gbs", json_real(r->grp));
    json_object_set_new(j, "group_commits", json_integer((json_int_t)r->cgrp));
    json_object_set_new(j, "single_gbs", json_real(r->one));
    json_object_set_new(j, "single_commits", json_integer((json_int_t)r->cone));
    json_object_set_new(j, "batch_mode_gbs", json_real(r->bat));
    json_object_set_new(j, "batch_mode_commits", json_integer((json_int_t)r->cbat));
    json_object_set_new(j, "batch_mode_ratio", json_real(ref > 0 ? r->bat / ref : 0));
    json_object_set_new(j, "group_ratio", json_real(ref > 0 ? r->grp / ref : 0));
    json_object_set_new(j, "single_ratio", json_real(ref > 0 ? r->one / ref : 0));
    json_dumpf(j, stdout, JSON_INDENT(2));
    printf("\n");
    json_decref(j);
}

static void bench_print_text(const bench_opts *o, const bench_res *r)
{
    double ref = (r->none1 + r->none2) / 2;
    printf("reopen: %llu chunks of %llu bytes: created in %.3f s, reopened in %.3f s "
           "(journal %llu bytes)\n", (unsigned long long)o->chunks,
           (unsigned long long)o->small, r->create_s, r->reopen_s,
           (unsigned long long)r->st.journal_bytes);
    printf("put of %llu bytes, one at a time: durable p50 %.0f us, p99 %.0f us; without "
           "fdatasync p50 %.0f us, p99 %.0f us (the fdatasync pair costs %.0f us)\n",
           (unsigned long long)o->small, r->l50, r->l99, r->n50, r->n99, r->l50 - r->n50);
    printf("store %llu chunks of %llu bytes, O_DIRECT, one writer:\n",
           (unsigned long long)o->count, (unsigned long long)o->size);
    printf("  GDS slab (non-persistent, for scale)  %8.3f GB/s\n", r->gds);
    printf("  persistent slab, one flush at the end %8.3f GB/s  (%.3f before, %.3f after) = ref\n",
           ref, r->none1, r->none2);
    printf("  durable, group commit of %-4llu         %8.3f GB/s  %.3f x ref, %llu commits\n",
           (unsigned long long)o->batch, r->grp, ref > 0 ? r->grp / ref : 0,
           (unsigned long long)r->cgrp);
    printf("  durable, one put at a time            %8.3f GB/s  %.3f x ref, %llu commits\n",
           r->one, ref > 0 ? r->one / ref : 0, (unsigned long long)r->cone);
    printf("  SYNC_BATCH (64 MiB / 100 ms), one put %8.3f GB/s  %.3f x ref, %llu commits\n",
           r->bat, ref > 0 ? r->bat / ref : 0, (unsigned long long)r->cbat);
}

static int slab_bench(int argc, char **argv)
{
    bench_opts o = {NULL, 100000, 4096, 4u << 20, 64, 8, NULL, 0};
    int st = bench_parse(argc, argv, &o);
    if (st >= 0)
        return st;
    char base[4096];
    snprintf(base, sizeof base, "%s/ferry-slab-bench-XXXXXX",
             o.dir ? o.dir : (getenv("TMPDIR") ? getenv("TMPDIR") : "/var/tmp"));
    if (!mkdtemp(base)) {
        fprintf(stderr, "ferry slab bench: mkdtemp %s: %s\n", base, strerror(errno));
        return 2;
    }
    static const char *const names[4] = {"reopen", "ref", "group", "single"};
    char d[4][4200];
    for (int i = 0; i < 4; i++)
        mkdir_in(base, names[i], d[i], sizeof d[i]);
    bench_res r;
    memset(&r, 0, sizeof r);
    int rc = bench_all(&o, d, &r);
    for (int i = 0; i < 4; i++)
        rm_store(d[i]);
    rmdir(base);
    if (rc)
        return rc;
    if (o.json)
        bench_print_json(&o, &r);
    else
        bench_print_text(&o, &r);
    return 0;
}

int cmd_slab_check(int argc, char **argv)
{
    return slab_check(argc, argv);
}

/* ferry slab reset DIR [DIR...] [--json]: slab check --reset by its own name */
int cmd_slab_reset(int argc, char **argv)
{
    slab_args a;
    int st = slab_parse("slab reset", 0,
                        "usage: ferry slab reset DIR [DIR...] [--json]\n"
                        "  drop every chunk of a persistent slab: an empty slab of the same "
                        "size,\n  geometry and tag (what a store refused for another layout "
                        "needs to be\n  reused); refused while a store has it open\n"
                        "exit status: 0 reset, 1 failed or in use, 2 usage or unreadable "
                        "slab\n",
                        argc, argv, &a);
    return st >= 0 ? st : slab_reset("slab reset", a.dirs, a.nd, a.json);
}

int cmd_slab_bench(int argc, char **argv)
{
    return slab_bench(argc, argv);
}
