/*
 * test_pslab_pieces.c - the persistent slab's piece checksums (format 3):
 * a bad piece is a miss naming it, pieces torn at their edges, short last
 * pieces, what a pin returns and checks, stores of formats 1 and 2 read
 * and upgraded (and left untouched read-only), and piece puts through
 * replay, compaction, a torn piece table and damage to one.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "ferry_test.h"
#include "pslab/pslab_impl.h"

#define MiB (1024ull * 1024)
#define PIECE FERRY__PSLAB_PIECE

/* ---- helpers ---- */
static ferry_pslab_options opts(const char *const *dirs, uint64_t bytes)
{
    ferry_pslab_options o = FERRY_PSLAB_OPTIONS_INIT;
    o.dirs = dirs;
    o.n_dirs = 1;
    o.bytes = bytes;
    o.flags = FERRY_PSLAB_CREATE;
    return o;
}

static ferry_pslab *open_ok(const ferry_pslab_options *o)
{
    ferry_pslab *p = NULL;
    FT_ASSERT_OK(ferry_pslab_open(o, &p));
    assert_non_null(p);
    return p;
}

static void path_in(const char *dir, const char *name, char *out, size_t n)
{
    snprintf(out, n, "%s/%s", dir, name);
}

/* change the byte at off of path (xor 0x5a) */
static void flip_byte(const char *path, uint64_t off)
{
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b = 0;
    assert_int_equal(pread(fd, &b, 1, (off_t)off), 1);
    b ^= 0x5a;
    assert_int_equal(pwrite(fd, &b, 1, (off_t)off), 1);
    close(fd);
}

static uint8_t *read_all(const char *path, size_t *n)
{
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    *n = (size_t)st.st_size;
    uint8_t *b = malloc(*n ? *n : 1);
    assert_non_null(b);
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, b, *n, 0), (ssize_t)*n);
    close(fd);
    return b;
}

static uint32_t file_u32(const char *path, uint64_t off)
{
    uint8_t b[4];
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, b, 4, (off_t)off), 4);
    close(fd);
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* where slab byte off of a one-drive store lies in its file */
static uint64_t slab_file_off(uint64_t off)
{
    return ferry__pslab_data_off(4096) + off;
}

/* each piece's XXH3-64, computed here from the format's definition */
static uint64_t piece_sum(const uint8_t *b, size_t n, uint32_t piece, uint32_t k)
{
    size_t at = (size_t)k * piece;
    return XXH3_64bits(b + at, n - at < piece ? n - at : piece);
}

/* the checksum the record carries: the XXH3-64 of its piece table (little endian) */
static uint64_t table_sum(const uint8_t *b, size_t n, uint32_t piece)
{
    size_t np = (n + piece - 1) / piece;
    uint8_t *t = malloc(8 * np);
    for (size_t i = 0; i < np; i++) {
        uint64_t s = piece_sum(b, n, piece, (uint32_t)i);
        for (int j = 0; j < 8; j++)
            t[8 * i + (size_t)j] = (uint8_t)(s >> (8 * j));
    }
    uint64_t s = XXH3_64bits(t, 8 * np);
    free(t);
    return s;
}

static void put_pattern(ferry_pslab *p, const char *key, size_t n, unsigned seed)
{
    uint8_t *b = malloc(n);
    assert_non_null(b);
    ft_fill_pattern(b, n, seed);
    FT_ASSERT_OK(ferry_pslab_put(p, key, strlen(key), b, n));
    free(b);
}

/* 1 when key holds exactly the n pattern bytes of seed */
static int reads_exact(ferry_pslab *p, const char *key, size_t n, unsigned seed)
{
    uint8_t *b = malloc(n + 4096);
    size_t len = 0;
    int rc = ferry_pslab_get(p, key, strlen(key), b, n + 4096, &len);
    int ok = rc == 0 && len == n && ft_check_pattern(b, n, seed) == -1;
    free(b);
    return ok;
}

static int get_rc(ferry_pslab *p, const char *key, size_t cap)
{
    uint8_t *b = malloc(cap);
    size_t len = 0;
    int rc = ferry_pslab_get(p, key, strlen(key), b, cap, &len);
    free(b);
    return rc;
}

/* the chunk's bytes as the slab file holds them now */
static uint8_t *stored_bytes(const char *dir, const ferry__pslab_pin *pin)
{
    char path[300];
    path_in(dir, FERRY_PSLAB_FILE, path, sizeof path);
    uint8_t *b = malloc(pin->length);
    assert_non_null(b);
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, b, pin->length, (off_t)slab_file_off(pin->offset)),
                     (ssize_t)pin->length);
    close(fd);
    return b;
}

static uint64_t piece_len(const ferry__pslab_pin *pin, uint32_t k)
{
    uint64_t at = (uint64_t)k * pin->piece;
    return pin->length - at < pin->piece ? pin->length - at : pin->piece;
}

/* ---- a bad piece ---- */

/* a byte changed inside piece 3 of a 5-piece chunk: the pin's check of
 * that piece fails and of the others passes; the get is FERRY_ECORRUPT
 * naming key, piece, its slab offset and length; the other chunks read
 * exactly; the chunk is dropped */
static void test_one_bad_piece_is_a_miss_naming_it(void **state)
{
    (void)state;
    char d[256], path[300], want[160];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = opts(dirs, 64 * MiB);
    ferry_pslab *p = open_ok(&o);
    size_t n = 4 * PIECE + 12345;
    put_pattern(p, "before", 3 * MiB, 1);
    put_pattern(p, "five-pieces", n, 2);
    put_pattern(p, "after", 100000, 3);

    ferry__pslab_pin pin;
    FT_ASSERT_OK(ferry__pslab_pin_get(p, "five-pieces", 11, &pin));
    assert_int_equal(pin.piece, PIECE);
    assert_int_equal(pin.npieces, 5);
    assert_non_null(pin.psum);
    path_in(d, FERRY_PSLAB_FILE, path, sizeof path);
    flip_byte(path, slab_file_off(pin.offset + 3 * (uint64_t)PIECE + 1000));
    uint8_t *b = stored_bytes(d, &pin);
    for (uint32_t k = 0; k < 5; k++) {
        int rc = ferry__pslab_pin_check(&pin, b + (size_t)k * PIECE, (uint64_t)k * PIECE,
                                        piece_len(&pin, k));
        assert_int_equal(rc, k == 3 ? FERRY_ECORRUPT : 0);
        if (k == 3)
            assert_non_null(strstr(ferry_last_error(), "piece 3 "));
    }
    /* several pieces at once: the bad one among them fails them */
    assert_int_equal(ferry__pslab_pin_check(&pin, b, 0, n), FERRY_ECORRUPT);
    FT_ASSERT_OK(ferry__pslab_pin_check(&pin, b, 0, 3 * (uint64_t)PIECE));
    FT_ASSERT_OK(ferry__pslab_pin_check(&pin, b + 4 * PIECE, 4 * (uint64_t)PIECE, 12345));
    free(b);
    uint64_t off = pin.offset;
    ferry__pslab_pin_put(p, &pin);
    assert_null(pin.ent);

    uint8_t *buf = malloc(n);
    memset(buf, 0xEE, n);
    size_t len = 7;
    assert_int_equal(ferry_pslab_get(p, "five-pieces", 11, buf, n, &len), FERRY_ECORRUPT);
    assert_int_equal(len, 7);
    for (size_t i = 0; i < n; i++)
        if (buf[i])
            fail_msg("byte %zu of a corrupt chunk's buffer is 0x%02x, not zeroed", i, buf[i]);
    const char *msg = ferry_pslab_last_error(p);
    assert_non_null(strstr(msg, "\"five-pieces\""));
    assert_non_null(strstr(msg, "piece 3 of 5"));
    snprintf(want, sizeof want, "(%llu bytes at slab offset %llu)", (unsigned long long)PIECE,
             (unsigned long long)(off + 3 * (uint64_t)PIECE));
    assert_non_null(strstr(msg, want));
    free(buf);
    assert_true(reads_exact(p, "before", 3 * MiB, 1));
    assert_true(reads_exact(p, "after", 100000, 3));
    assert_int_equal(get_rc(p, "five-pieces", n), FERRY_ENOTFOUND); /* dropped */
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.corrupt, 1);
    FT_ASSERT_OK(ferry_pslab_close(p));
    /* stays dropped after a reopen, and the others stay */
    o.flags = 0;
    p = open_ok(&o);
    assert_int_equal(get_rc(p, "five-pieces", n), FERRY_ENOTFOUND);
    assert_true(reads_exact(p, "before", 3 * MiB, 1));
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* verify finds a bad piece too, and reports the chunk */
static void test_verify_checks_each_piece(void **state)
{
    (void)state;
    char d[256], path[300];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = opts(dirs, 32 * MiB);
    ferry_pslab *p = open_ok(&o);
    put_pattern(p, "a", 3 * PIECE, 4);
    put_pattern(p, "b", 3 * PIECE, 5);
    ferry_pslab_info info;
    FT_ASSERT_OK(ferry_pslab_stat(p, "b", 1, &info));
    path_in(d, FERRY_PSLAB_FILE, path, sizeof path);
    flip_byte(path, slab_file_off(info.offset + 2 * (uint64_t)PIECE));
    uint64_t bad = 0;
    FT_ASSERT_OK(ferry_pslab_verify(p, 1, &bad, NULL, NULL));
    assert_int_equal(bad, 1);
    assert_int_equal(get_rc(p, "b", 3 * PIECE), FERRY_ENOTFOUND);
    assert_true(reads_exact(p, "a", 3 * PIECE, 4));
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* ---- edges ---- */

/* the last byte of piece k and, in another chunk, the first byte of piece
 * k + 1: each is caught as its own piece, never the neighbour */
static void test_piece_torn_at_its_edge(void **state)
{
    (void)state;
    char d[256], path[300];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = opts(dirs, 64 * MiB);
    ferry_pslab *p = open_ok(&o);
    size_t n = 4 * PIECE + 77;
    path_in(d, FERRY_PSLAB_FILE, path, sizeof path);
    for (int first = 0; first < 2; first++) {
        const char *key = first ? "edge-first" : "edge-last";
        put_pattern(p, key, n, 20 + (unsigned)first);
        ferry__pslab_pin pin;
        FT_ASSERT_OK(ferry__pslab_pin_get(p, key, strlen(key), &pin));
        uint32_t k = first ? 2 : 1; /* the piece whose edge byte changes */
        uint64_t at = first ? 2 * (uint64_t)PIECE : 2 * (uint64_t)PIECE - 1;
        flip_byte(path, slab_file_off(pin.offset + at));
        uint8_t *b = stored_bytes(d, &pin);
        for (uint32_t j = 0; j < pin.npieces; j++)
            assert_int_equal(ferry__pslab_pin_check(&pin, b + (size_t)j * PIECE,
                                                    (uint64_t)j * PIECE, piece_len(&pin, j)),
                             j == k ? FERRY_ECORRUPT : 0);
        free(b);
        ferry__pslab_pin_put(p, &pin);
        assert_int_equal(get_rc(p, key, n), FERRY_ECORRUPT);
        char want[32];
        snprintf(want, sizeof want, "piece %u of 5", k);
        assert_non_null(strstr(ferry_pslab_last_error(p), want));
    }
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* a last piece shorter than the rest, a chunk of whole pieces, one of
 * exactly one piece and one smaller than a piece: their sums are those of
 * the format's definition, they read exactly, and the short last piece
 * is checked (and caught) alone */
static void test_short_last_piece_and_small_chunks(void **state)
{
    (void)state;
    char d[256], path[300];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = opts(dirs, 64 * MiB);
    ferry_pslab *p = open_ok(&o);
    path_in(d, FERRY_PSLAB_FILE, path, sizeof path);
    static const struct {
        const char *key;
        size_t n;
        uint32_t np;
    } c[] = {{"short-last", 3 * PIECE + 5, 4},
             {"whole", 2 * PIECE, 2},
             {"one", PIECE, 1},
             {"small", 100 * 1024 + 3, 1},
             {"byte", 1, 1}};
    for (unsigned i = 0; i < 5; i++) {
        put_pattern(p, c[i].key, c[i].n, 30 + i);
        uint8_t *want = malloc(c[i].n);
        ft_fill_pattern(want, c[i].n, 30 + i);
        ferry__pslab_pin pin;
        FT_ASSERT_OK(ferry__pslab_pin_get(p, c[i].key, strlen(c[i].key), &pin));
        assert_int_equal(pin.piece, PIECE);
        assert_int_equal(pin.npieces, c[i].np);
        assert_int_equal(pin.length, c[i].n);
        for (uint32_t k = 0; k < pin.npieces; k++)
            assert_true(pin.psum[k] == piece_sum(want, c[i].n, PIECE, k));
        assert_true(pin.checksum == table_sum(want, c[i].n, PIECE));
        ferry_pslab_info info;
        FT_ASSERT_OK(ferry_pslab_stat(p, c[i].key, strlen(c[i].key), &info));
        assert_true(info.checksum == pin.checksum);
        FT_ASSERT_OK(ferry__pslab_pin_check(&pin, want, 0, c[i].n));
        uint32_t last = pin.npieces - 1;
        FT_ASSERT_OK(ferry__pslab_pin_check(&pin, want + (size_t)last * PIECE,
                                            (uint64_t)last * PIECE, piece_len(&pin, last)));
        /* not a piece boundary, or not whole pieces: refused, not checked */
        assert_int_equal(ferry__pslab_pin_check(&pin, want + 1, 1, c[i].n - 1), -EINVAL);
        if (c[i].n > PIECE)
            assert_int_equal(ferry__pslab_pin_check(&pin, want, 0, PIECE - 1), -EINVAL);
        ferry__pslab_pin_put(p, &pin);
        assert_true(reads_exact(p, c[i].key, c[i].n, 30 + i));
        free(want);
    }
    /* the short last piece's last byte */
    ferry_pslab_info info;
    FT_ASSERT_OK(ferry_pslab_stat(p, "short-last", 10, &info));
    flip_byte(path, slab_file_off(info.offset + 3 * (uint64_t)PIECE + 4));
    assert_int_equal(get_rc(p, "short-last", 4 * PIECE), FERRY_ECORRUPT);
    assert_non_null(strstr(ferry_pslab_last_error(p), "piece 3 of 4 (5 bytes"));
    for (unsigned i = 1; i < 5; i++)
        assert_true(reads_exact(p, c[i].key, c[i].n, 30 + i));
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* the writer's piece: 2 MiB, the alignment when larger, doubled for
 * chunks that would need more than 65536 pieces, none past 1 GiB pieces */
static void test_piece_size_choice(void **state)
{
    (void)state;
    const uint64_t G = 1024 * MiB;
    assert_int_equal(ferry__pslab_piece_for(1, 4096), PIECE);
    assert_int_equal(ferry__pslab_piece_for(128 * G, 4096), PIECE);
    assert_int_equal(ferry__pslab_piece_for(128 * G + 1, 4096), 2 * PIECE);
    assert_int_equal(ferry__pslab_piece_for(1, 8 * MiB), 8 * MiB);
    assert_int_equal(ferry__pslab_piece_for(64 * 1024 * G, 512), 1u << 30);
    assert_int_equal(ferry__pslab_piece_for(64 * 1024 * G + 1, 512), 0);
    assert_int_equal(ferry__pslab_npieces(128 * G, PIECE), FERRY__PSLAB_PIECES_MAX);
    assert_int_equal(ferry__pslab_npieces(5, 0), 0);

    /* a store aligned to 4 MiB writes 4 MiB pieces: each starts aligned */
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = opts(dirs, 64 * MiB);
    o.alignment = 4 * MiB;
    o.stripe_bytes = 4 * MiB;
    ferry_pslab *p = open_ok(&o);
    put_pattern(p, "big-align", 9 * MiB, 40);
    ferry__pslab_pin pin;
    FT_ASSERT_OK(ferry__pslab_pin_get(p, "big-align", 9, &pin));
    assert_int_equal(pin.piece, 4 * MiB);
    assert_int_equal(pin.npieces, 3);
    ferry__pslab_pin_put(p, &pin);
    assert_true(reads_exact(p, "big-align", 9 * MiB, 40));
    FT_ASSERT_OK(ferry_pslab_close(p));
    ft_rmtree(d);
}

/* ---- old formats ---- */

/*
 * A store of format 1 or 2 (made through the test seam): a read-only open
 * reads its chunks exactly (checked whole: pin.piece 0) and leaves its
 * files byte for byte; a writable open upgrades its journal to format 3
 * and keeps its chunks; new puts carry piece sums; after a reopen both
 * kinds read, a bad byte in an old chunk is caught by its whole sum.
 */
static void test_old_format_store_is_read_and_upgraded(void **state)
{
    (void)state;
    for (unsigned fmt = 1; fmt <= 2; fmt++) {
        char d[256], jp[300], sp[300];
        ft_tmpdir(d, sizeof d);
        const char *dirs[] = {d};
        path_in(d, FERRY_PSLAB_JOURNAL, jp, sizeof jp);
        path_in(d, FERRY_PSLAB_FILE, sp, sizeof sp);
        ferry_pslab_options o = opts(dirs, 32 * MiB);
        atomic_store(&ferry__pslab_test_format, fmt);
        ferry_pslab *p = open_ok(&o);
        put_pattern(p, "old-big", 5 * MiB + 3, 50);
        put_pattern(p, "old-small", 1000, 51);
        put_pattern(p, "old-gone", 1000, 52);
        FT_ASSERT_OK(ferry_pslab_delete(p, "old-gone", 8));
        FT_ASSERT_OK(ferry_pslab_close(p));
        atomic_store(&ferry__pslab_test_format, 0);
        assert_int_equal(file_u32(jp, 8), fmt);
        assert_int_equal(file_u32(sp, 8), fmt);

        /* read-only: exact, whole sums, no file changed */
        size_t jn0 = 0, sn0 = 0, jn1 = 0, sn1 = 0;
        uint8_t *j0 = read_all(jp, &jn0), *s0 = read_all(sp, &sn0);
        o.flags = FERRY_PSLAB_READONLY;
        o.bytes = 0;
        p = open_ok(&o);
        assert_true(reads_exact(p, "old-big", 5 * MiB + 3, 50));
        assert_true(reads_exact(p, "old-small", 1000, 51));
        assert_int_equal(get_rc(p, "old-gone", 4096), FERRY_ENOTFOUND);
        ferry__pslab_pin pin;
        FT_ASSERT_OK(ferry__pslab_pin_get(p, "old-big", 7, &pin));
        assert_int_equal(pin.piece, 0);
        assert_int_equal(pin.npieces, 0);
        assert_null(pin.psum);
        uint8_t *b = stored_bytes(d, &pin);
        assert_true(pin.checksum == XXH3_64bits(b, pin.length));
        FT_ASSERT_OK(ferry__pslab_pin_check(&pin, b, 0, pin.length));
        assert_int_equal(ferry__pslab_pin_check(&pin, b, 0, PIECE), -EINVAL);
        free(b);
        ferry__pslab_pin_put(p, &pin);
        FT_ASSERT_OK(ferry_pslab_close(p));
        uint8_t *j1 = read_all(jp, &jn1), *s1 = read_all(sp, &sn1);
        assert_int_equal(jn1, jn0);
        assert_int_equal(sn1, sn0);
        assert_memory_equal(j1, j0, jn0);
        assert_memory_equal(s1, s0, sn0);
        free(j0), free(j1), free(s0), free(s1);

        /* writable: the journal becomes format 3, the old records stay */
        o.flags = 0;
        p = open_ok(&o);
        assert_int_equal(file_u32(jp, 8), FERRY_PSLAB_FORMAT);
        assert_int_equal(file_u32(sp, 8), fmt); /* (same layout: headers left as they are) */
        assert_true(reads_exact(p, "old-big", 5 * MiB + 3, 50));
        put_pattern(p, "new-big", 5 * MiB + 3, 53);
        FT_ASSERT_OK(ferry__pslab_pin_get(p, "new-big", 7, &pin));
        assert_int_equal(pin.piece, PIECE);
        assert_int_equal(pin.npieces, 3);
        ferry__pslab_pin_put(p, &pin);
        FT_ASSERT_OK(ferry_pslab_close(p));

        p = open_ok(&o);
        assert_true(reads_exact(p, "old-big", 5 * MiB + 3, 50));
        assert_true(reads_exact(p, "old-small", 1000, 51));
        assert_true(reads_exact(p, "new-big", 5 * MiB + 3, 53));
        FT_ASSERT_OK(ferry__pslab_pin_get(p, "old-small", 9, &pin));
        assert_int_equal(pin.piece, 0);
        ferry__pslab_pin_put(p, &pin);
        FT_ASSERT_OK(ferry__pslab_pin_get(p, "new-big", 7, &pin));
        assert_int_equal(pin.npieces, 3);
        ferry__pslab_pin_put(p, &pin);
        uint64_t bad = 9;
        FT_ASSERT_OK(ferry_pslab_verify(p, 0, &bad, NULL, NULL));
        assert_int_equal(bad, 0);
        /* an old chunk's bad byte: its whole sum catches it */
        ferry_pslab_info info;
        FT_ASSERT_OK(ferry_pslab_stat(p, "old-big", 7, &info));
        flip_byte(sp, slab_file_off(info.offset + 4 * MiB));
        assert_int_equal(get_rc(p, "old-big", 6 * MiB), FERRY_ECORRUPT);
        assert_non_null(strstr(ferry_pslab_last_error(p), "\"old-big\": chunk of"));
        assert_true(reads_exact(p, "new-big", 5 * MiB + 3, 53));
        FT_ASSERT_OK(ferry_pslab_close(p));
        ft_rmtree(d);
    }
}

/* a journal or slab header of a newer format: FERRY_EVERSION pointing to
 * the CLI's reset */
static void test_newer_format_points_to_slab_reset(void **state)
{
    (void)state;
    for (int journal = 0; journal < 2; journal++) {
        char d[256], path[300];
        ft_tmpdir(d, sizeof d);
        const char *dirs[] = {d};
        ferry_pslab_options o = opts(dirs, 4 * MiB);
        ferry_pslab *p = open_ok(&o);
        put_pattern(p, "k", 1000, 60);
        FT_ASSERT_OK(ferry_pslab_close(p));
        path_in(d, journal ? FERRY_PSLAB_JOURNAL : FERRY_PSLAB_FILE, path, sizeof path);
        size_t n = 0;
        uint8_t *b = read_all(path, &n);
        if (journal) {
            ferry__pslab_jhdr h;
            FT_ASSERT_OK(ferry__pslab_jhdr_decode(b, n, &h, NULL, 0));
            h.version = FERRY_PSLAB_FORMAT + 1;
            ferry__pslab_jhdr_encode(&h, b);
        } else {
            ferry__pslab_hdr h;
            FT_ASSERT_OK(ferry__pslab_hdr_decode(b, n, &h, NULL, 0));
            h.version = FERRY_PSLAB_FORMAT + 1;
            ferry__pslab_hdr_encode(&h, b);
        }
        int fd = open(path, O_WRONLY);
        assert_int_equal(pwrite(fd, b, FERRY__PSLAB_HDR_BYTES, 0), FERRY__PSLAB_HDR_BYTES);
        close(fd);
        free(b);
        o.flags = 0;
        p = NULL;
        assert_int_equal(ferry_pslab_open(&o, &p), FERRY_EVERSION);
        assert_null(p);
        assert_non_null(strstr(ferry_last_error(), "newer"));
        assert_non_null(strstr(ferry_last_error(), "`ferry slab reset"));
        ft_rmtree(d);
    }
}

/* ---- replay ---- */

/* piece puts survive a reopen and a compaction with their sums; an
 * overwrite replaces them */
static void test_piece_sums_survive_reopen_and_compaction(void **state)
{
    (void)state;
    char d[256];
    ft_tmpdir(d, sizeof d);
    const char *dirs[] = {d};
    ferry_pslab_options o = opts(dirs, 64 * MiB);
    ferry_pslab *p = open_ok(&o);
    put_pattern(p, "x", 5 * MiB, 70);
    put_pattern(p, "y", 3 * MiB, 71);
    put_pattern(p, "x", 7 * MiB + 1, 72); /* overwrite: history */
    put_pattern(p, "z", 2 * MiB, 73);
    FT_ASSERT_OK(ferry_pslab_delete(p, "z", 1));
    uint64_t sums[8];
    ferry__pslab_pin pin;
    FT_ASSERT_OK(ferry__pslab_pin_get(p, "x", 1, &pin));
    assert_int_equal(pin.npieces, 4);
    memcpy(sums, pin.psum, 4 * sizeof *sums);
    ferry__pslab_pin_put(p, &pin);
    FT_ASSERT_OK(ferry_pslab_compact(p));
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.compactions, 1);
    assert_int_equal(s.journal_records, 2);
    FT_ASSERT_OK(ferry__pslab_pin_get(p, "x", 1, &pin));
    assert_memory_equal(pin.psum, sums, 4 * sizeof *sums);
    ferry__pslab_pin_put(p, &pin);
    FT_ASSERT_OK(ferry_pslab_close(p));
    /* the store's format is its journal's; the slab header keeps format
     * 2's layout and number, which an older library still reads */
    char jp[300], sp[300];
    path_in(d, FERRY_PSLAB_JOURNAL, jp, sizeof jp);
    path_in(d, FERRY_PSLAB_FILE, sp, sizeof sp);
    assert_int_equal(file_u32(jp, 8), 3);
    assert_int_equal(file_u32(sp, 8), 2);
    o.flags = 0;
    for (int round = 0; round < 2; round++) {
        p = open_ok(&o);
        FT_ASSERT_OK(ferry__pslab_pin_get(p, "x", 1, &pin));
        assert_int_equal(pin.piece, PIECE);
        assert_int_equal(pin.npieces, 4);
        assert_memory_equal(pin.psum, sums, 4 * sizeof *sums);
        ferry__pslab_pin_put(p, &pin);
        assert_true(reads_exact(p, "x", 7 * MiB + 1, 72));
        assert_true(reads_exact(p, "y", 3 * MiB, 71));
        assert_int_equal(get_rc(p, "z", 3 * MiB), FERRY_ENOTFOUND);
        FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
        assert_int_equal(s.torn_bytes, 0);
        assert_int_equal(s.dropped_records, 0);
        FT_ASSERT_OK(ferry_pslab_close(p));
    }
    ft_rmtree(d);
}

/* three piece puts a, b, c, one commit each (so c's record is a barrier);
 * returns the journal offsets of b's record and of its table */
static void three_puts(const char *d, uint64_t *b_rec, uint64_t *b_tab)
{
    const char *dirs[] = {d};
    ferry_pslab_options o = opts(dirs, 64 * MiB);
    ferry_pslab *p = open_ok(&o);
    put_pattern(p, "a", 5 * MiB, 80);     /* 3 pieces */
    put_pattern(p, "bb", 9 * MiB, 81);    /* 5 pieces */
    put_pattern(p, "ccc", 1 * MiB, 82);   /* 1 piece */
    FT_ASSERT_OK(ferry_pslab_close(p));   /* (no history: the journal stays as written) */
    *b_rec = FERRY__PSLAB_JHDR_BYTES + ferry__pslab_rec_size_p(1, 3);
    *b_tab = *b_rec + FERRY__PSLAB_REC_PFIXED + 2;
}

/* the journal ends in the middle of a piece table: a torn tail, cut; what
 * came before stands */
static void test_torn_tail_inside_a_piece_table(void **state)
{
    (void)state;
    char d[256], jp[300];
    ft_tmpdir(d, sizeof d);
    uint64_t brec, btab;
    three_puts(d, &brec, &btab);
    path_in(d, FERRY_PSLAB_JOURNAL, jp, sizeof jp);
    struct stat st;
    assert_int_equal(stat(jp, &st), 0);
    assert_int_equal((uint64_t)st.st_size, btab + 5 * 8 + ferry__pslab_rec_size_p(3, 1));
    uint64_t cut = btab + 2 * 8 + 3; /* b's table: two sums and a bit */
    assert_int_equal(truncate(jp, (off_t)cut), 0);
    const char *dirs[] = {d};
    ferry_pslab_options o = opts(dirs, 0);
    o.flags = 0;
    ferry_pslab *p = open_ok(&o);
    ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
    FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
    assert_int_equal(s.torn_bytes, cut - brec);
    assert_int_equal(s.chunks, 1);
    assert_int_equal(s.damaged_chunks, 0);
    assert_true(reads_exact(p, "a", 5 * MiB, 80));
    assert_int_equal(get_rc(p, "bb", 10 * MiB), FERRY_ENOTFOUND);
    FT_ASSERT_OK(ferry_pslab_close(p));
    assert_int_equal(stat(jp, &st), 0);
    assert_int_equal((uint64_t)st.st_size, brec); /* cut at the last good record */
    ft_rmtree(d);
}

/* damage proven durable (a barrier after it) in b's record: a byte of its
 * table, or one byte of its head, costs b alone; a byte of each costs every
 * chunk recorded before the damage (it cannot be pinned to a key); c, after
 * it, stands - and the rewritten journal says the same */
static void test_damaged_piece_table_costs_its_key(void **state)
{
    (void)state;
    for (int how = 0; how < 3; how++) {
        char d[256], jp[300];
        ft_tmpdir(d, sizeof d);
        uint64_t brec, btab;
        three_puts(d, &brec, &btab);
        path_in(d, FERRY_PSLAB_JOURNAL, jp, sizeof jp);
        if (how != 1)
            flip_byte(jp, btab + 8 * 3 + 5); /* piece 3's sum */
        if (how != 0)
            flip_byte(jp, brec + 20); /* its slab offset */
        const char *dirs[] = {d};
        ferry_pslab_options o = opts(dirs, 0);
        o.flags = 0;
        ferry_pslab *p = open_ok(&o);
        ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
        FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
        assert_int_equal(get_rc(p, "bb", 10 * MiB), FERRY_ENOTFOUND);
        assert_true(reads_exact(p, "ccc", 1 * MiB, 82));
        if (how < 2) {
            assert_int_equal(s.damaged_chunks, 0); /* b was not indexed before: nothing older */
            assert_true(reads_exact(p, "a", 5 * MiB, 80));
            assert_int_equal(s.chunks, 2);
        } else {
            assert_int_equal(s.damaged_chunks, 1); /* a */
            assert_int_equal(get_rc(p, "a", 6 * MiB), FERRY_ENOTFOUND);
            assert_int_equal(s.chunks, 1);
        }
        FT_ASSERT_OK(ferry_pslab_close(p));
        p = open_ok(&o);
        FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
        assert_int_equal(s.torn_bytes, 0);
        assert_int_equal(s.chunks, how < 2 ? 2 : 1);
        assert_int_equal(get_rc(p, "bb", 10 * MiB), FERRY_ENOTFOUND);
        FT_ASSERT_OK(ferry_pslab_close(p));
        ft_rmtree(d);
    }
}

/* damage to the record of an overwrite: identified (table or one head
 * byte), only its key is dropped - never its older value */
static void test_damaged_overwrite_never_brings_the_old_value(void **state)
{
    (void)state;
    for (int head = 0; head < 2; head++) {
        char d[256], jp[300];
        ft_tmpdir(d, sizeof d);
        const char *dirs[] = {d};
        ferry_pslab_options o = opts(dirs, 64 * MiB);
        ferry_pslab *p = open_ok(&o);
        put_pattern(p, "k", 3 * MiB, 90);   /* 2 pieces */
        put_pattern(p, "j", 1000, 91);      /* 1 piece */
        put_pattern(p, "k", 5 * MiB, 92);   /* the overwrite: 3 pieces */
        put_pattern(p, "j", 2000, 93);      /* a later commit: a barrier */
        /* as a killed owner leaves it (a close would compact the history) */
        char c[256], cmd[1400];
        ft_tmpdir(c, sizeof c);
        snprintf(cmd, sizeof cmd, "cp %s/%s %s/%s %s/", d, FERRY_PSLAB_FILE, d,
                 FERRY_PSLAB_JOURNAL, c);
        assert_int_equal(system(cmd), 0);
        FT_ASSERT_OK(ferry_pslab_close(p));
        path_in(c, FERRY_PSLAB_JOURNAL, jp, sizeof jp);
        uint64_t rec = FERRY__PSLAB_JHDR_BYTES + ferry__pslab_rec_size_p(1, 2) +
                       ferry__pslab_rec_size_p(1, 1);
        flip_byte(jp, head ? rec + 9 : rec + FERRY__PSLAB_REC_PFIXED + 1 + 8 + 2);
        const char *cd[] = {c};
        ferry_pslab_options oc = opts(cd, 0);
        oc.flags = 0;
        p = open_ok(&oc);
        ferry_pslab_stats s = FERRY_PSLAB_STATS_INIT;
        FT_ASSERT_OK(ferry_pslab_stats_get(p, &s));
        assert_int_equal(s.damaged_chunks, 1);
        assert_int_equal(get_rc(p, "k", 6 * MiB), FERRY_ENOTFOUND); /* never the 3 MiB one */
        assert_true(reads_exact(p, "j", 2000, 93));
        FT_ASSERT_OK(ferry_pslab_close(p));
        ft_rmtree(c);
        ft_rmtree(d);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_bad_piece_is_a_miss_naming_it),
        cmocka_unit_test(test_verify_checks_each_piece),
        cmocka_unit_test(test_piece_torn_at_its_edge),
        cmocka_unit_test(test_short_last_piece_and_small_chunks),
        cmocka_unit_test(test_piece_size_choice),
        cmocka_unit_test(test_old_format_store_is_read_and_upgraded),
        cmocka_unit_test(test_newer_format_points_to_slab_reset),
        cmocka_unit_test(test_piece_sums_survive_reopen_and_compaction),
        cmocka_unit_test(test_torn_tail_inside_a_piece_table),
        cmocka_unit_test(test_damaged_piece_table_costs_its_key),
        cmocka_unit_test(test_damaged_overwrite_never_brings_the_old_value),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
