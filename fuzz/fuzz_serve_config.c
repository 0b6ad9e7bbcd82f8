/*
 * fuzz_serve_config.c - `ferry serve --config FILE`'s YAML reader on
 * arbitrary bytes.
 *
 * Checks beyond "no crash, no leak": a refusal always says where (the
 * file's name, a line and a column, or a key's origin) in one line; an
 * accepted file leaves every value in its key's range (the L2 list and
 * the uid list within their bounds, distinct directories, sizes and
 * counts in range), and finishing it (layout, L2) either refuses with a
 * message or yields a layout whose chunk size the store computes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "serve/serve_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_values(const ferry__serve_conf *c)
{
    if (c->n_l2 > FERRY__SERVE_CONF_MAX_L2 || c->nallow > FERRY__SERVE_CONF_MAX_ALLOW)
        abort();
    for (unsigned i = 0; i < c->n_l2; i++)
        for (unsigned j = 0; j < i; j++)
            if (!strcmp(c->l2[i], c->l2[j]))
                abort();
    if (c->kv.l1_bytes < 4096 || c->kv.l1_bytes > (16ull << 40))
        abort();
    if (c->kv.l2_bytes && (c->kv.l2_bytes < (1u << 20) || c->kv.l2_bytes > (1ull << 50)))
        abort();
    if (!(c->kv.watermark >= 0 && c->kv.watermark <= 1) ||
        !(c->kv.evict_fraction >= 0 && c->kv.evict_fraction <= 1))
        abort();
    if (c->kv.workers > FERRY_KV_WORKERS_MAX || c->kv.chunk_tokens > 65536)
        abort();
    if (c->kv.l2_mode && ((c->kv.l2_mode & 0600) != 0600 || c->kv.l2_mode > 0666))
        abort();
    if (!c->kv.model || !*c->kv.model || !c->socket || !*c->socket)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ferry__serve_conf c;
    ferry__serve_conf_init(&c);
    char err[1024];
    err[0] = 0;
    int rc = ferry__serve_conf_parse(&c, "fuzz.yaml", (const char *)data, size, err, sizeof err);
    if (rc < 0) {
        /* "fuzz.yaml:LINE:COL: ..." */
        if (strncmp(err, "fuzz.yaml:", 10) || !strchr(err + 10, ':') || strchr(err, '\n'))
            abort();
    } else {
        if (rc != 0)
            abort();
        check_values(&c);
        err[0] = 0;
        if (ferry__serve_conf_finish(&c, err, sizeof err) < 0) {
            if (!err[0])
                abort();
        } else {
            uint64_t bytes = 0;
            uint32_t ct = c.kv.chunk_tokens ? c.kv.chunk_tokens : 256;
            if (ferry_kv_layout_chunk_bytes(&c.kv.layout, ct, &bytes) < 0 &&
                bytes != 0)
                abort();
        }
    }
    ferry__serve_conf_free(&c);
    return 0;
}
