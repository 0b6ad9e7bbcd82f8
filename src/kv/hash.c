/*
 * hash.c - chunk hashes and keys.
 *
 * Invariant: a chunk's hash depends only on the seed and the token ids of
 * its chunk and of every chunk before it, as little-endian bytes, so two
 * processes on two machines (either endianness) agree on every key. The
 * chain is h_i = XXH3_128(seed, LE(h_{i-1}) || LE(tokens_i)) with h_{-1} =
 * 16 zero bytes. xxHash is compiled inline (XXH_INLINE_ALL, the header of
 * Debian's libxxhash-dev): the streaming calls then inline and hashing runs
 * at about twice the speed of the shared library's (~18 vs ~9 GB/s here),
 * which is what makes a 32k-token lookup fit in 20 microseconds.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kv_impl.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define FERRY__KV_BIG_ENDIAN 1
#else
#define FERRY__KV_BIG_ENDIAN 0
#endif

static void put_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void hash_le(unsigned char out[16], ferry_kv_hash h)
{
    put_le64(out, h.lo);
    put_le64(out + 8, h.hi);
}

static void update_tokens(XXH3_state_t *st, const int32_t *tok, size_t n)
{
#if FERRY__KV_BIG_ENDIAN
    unsigned char buf[1024];
    while (n) {
        size_t k = FERRY__MIN(n, sizeof buf / 4);
        for (size_t i = 0; i < k; i++) {
            uint32_t v = (uint32_t)tok[i];
            buf[4 * i] = (unsigned char)v;
            buf[4 * i + 1] = (unsigned char)(v >> 8);
            buf[4 * i + 2] = (unsigned char)(v >> 16);
            buf[4 * i + 3] = (unsigned char)(v >> 24);
        }
        XXH3_128bits_update(st, buf, 4 * k);
        tok += k;
        n -= k;
    }
#else
    XXH3_128bits_update(st, tok, n * sizeof(int32_t));
#endif
}

void ferry__kv_hash_step(uint64_t seed, const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                         size_t first, size_t count, ferry_kv_hash *prev_io, ferry_kv_hash *out)
{
    size_t full = n / chunk_tokens, rest = n % chunk_tokens;
    ferry_kv_hash prev = *prev_io;
    XXH3_state_t st;
    unsigned char le[16];
    memset(&st, 0, sizeof st); /* quiets a false maybe-uninitialized in xxhash.h */
    for (size_t i = first; i < first + count; i++) {
        size_t len = i < full ? chunk_tokens : rest;
        XXH3_128bits_reset_withSeed(&st, seed);
        hash_le(le, prev);
        XXH3_128bits_update(&st, le, sizeof le);
        update_tokens(&st, tokens + i * (size_t)chunk_tokens, len);
        XXH128_hash_t h = XXH3_128bits_digest(&st);
        prev.lo = h.low64;
        prev.hi = h.high64;
        out[i - first] = prev;
    }
    *prev_io = prev;
}

size_t ferry__kv_hash_chain(uint64_t seed, const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                            int partial, ferry_kv_hash *out, size_t max)
{
    size_t full = n / chunk_tokens, rest = n % chunk_tokens;
    size_t chunks = full + (partial && rest ? 1 : 0);
    size_t todo = FERRY__MIN(chunks, max);
    ferry_kv_hash prev = {0, 0};
    ferry__kv_hash_step(seed, tokens, n, chunk_tokens, 0, todo, &prev, out);
    return chunks;
}

int ferry_kv_hash_chunks(uint64_t seed, const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                         int partial, ferry_kv_hash *out, size_t max)
{
    if ((!tokens && n) || chunk_tokens == 0 || (!out && max))
        return ferry__err_set(NULL, -EINVAL,
                              "kv hash: bad arguments (tokens %p, n %zu, chunk_tokens %u)",
                              (const void *)tokens, n, chunk_tokens);
    size_t c = ferry__kv_hash_chain(seed, tokens, n, chunk_tokens, partial, out, max);
    if (c > INT32_MAX)
        return ferry__err_set(NULL, -EOVERFLOW, "kv hash: %zu chunks is too many", c);
    return (int)c;
}

ferry_kv_hash ferry__kv_namespace(uint64_t seed, const char *model, uint32_t rank,
                                  uint32_t world, const void *salt, size_t salt_len)
{
    XXH3_state_t st;
    unsigned char b[16];
    memset(&st, 0, sizeof st);
    XXH3_128bits_reset_withSeed(&st, seed);
    XXH3_128bits_update(&st, "ferry-kv-ns-1", 13);
    put_le64(b, strlen(model));
    XXH3_128bits_update(&st, b, 8);
    XXH3_128bits_update(&st, model, strlen(model));
    put_le64(b, rank);
    put_le64(b + 8, world);
    XXH3_128bits_update(&st, b, 16);
    put_le64(b, salt ? salt_len : 0);
    XXH3_128bits_update(&st, b, 8);
    if (salt && salt_len)
        XXH3_128bits_update(&st, salt, salt_len);
    XXH128_hash_t h = XXH3_128bits_digest(&st);
    ferry_kv_hash r = {h.low64, h.high64};
    return r;
}

int ferry_kv_key_format(const ferry_kv_key *key, char *buf, size_t len)
{
    if (!key || !key->model || (!buf && len))
        return ferry__err_set(NULL, -EINVAL, "kv key format: key, model or buffer is NULL");
    char salt[24] = "";
    if (key->salt && key->salt_len)
        snprintf(salt, sizeof salt, ":%016llx",
                 (unsigned long long)XXH3_64bits(key->salt, key->salt_len));
    int n = snprintf(buf, len, "ferry1:%s:%u/%u:%016llx%016llx%s", key->model, key->tp_rank,
                     key->tp_world, (unsigned long long)key->hash.hi,
                     (unsigned long long)key->hash.lo, salt);
    if (n < 0)
        return ferry__err_set(NULL, -EINVAL, "kv key format: snprintf failed");
    return n;
}
