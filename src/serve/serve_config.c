/*
 * serve_config.c - `ferry serve`'s keys from a YAML file (libyaml's event
 * parser) and from FERRY_<KEY> variables (serve_config.h).
 *
 * One table names every key, its type and range and where its value goes;
 * the file and the environment both end in set_text(), the one place a
 * value is read, so a key means the same from either and a flag (cli.c's
 * parsers, the same number grammar) means the same again.
 *
 * The file is read as a stream of events, never as a tree: the only
 * shapes accepted are one mapping of keys whose values are scalars, flat
 * sequences of scalars (l2_dirs, allow_uids) or, for layout, one flat
 * mapping; anything else stops the parse at its first event with that
 * event's position. No alias is ever expanded (they are refused), so no
 * input makes the parser do more than read it once.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "core.h"
#include "parse.h"
#include "serve/serve_config.h"

struct ferry__serve_conf_str {
    ferry__serve_conf_str *next;
    char s[];
};

enum ktype {
    K_STR,      /* a non-empty string */
    K_SIZE,     /* bytes, min..max, into a uint64_t */
    K_COUNT,    /* a whole number min..max, into a uint32_t (w 4) or uint64_t (w 8) */
    K_SEED,     /* any uint64_t */
    K_REAL,     /* 0..1 */
    K_BOOL,     /* true / false into an int */
    K_POLICY,   /* lru / s3fifo into an int */
    K_ENGINE,   /* auto / posix / uring */
    K_MODE,     /* octal file mode into an unsigned */
    K_URL,      /* a remote URL (never echoed: it may hold a password) */
    K_INET,     /* HOST:PORT */
    K_DIRS,     /* a list of directories (l2_dir: a list of one) */
    K_UIDS,     /* a list of uids */
    K_LAYOUT    /* a mapping of layout members */
};

typedef struct key {
    const char *name;
    int type;
    size_t off;   /* into ferry__serve_conf */
    int w;        /* K_COUNT: 4 or 8 bytes */
    uint64_t min, max;
    const char *what;
} key;

#define KV(m) offsetof(ferry__serve_conf, kv) + offsetof(ferry_kv_config, m)
#define SC(m) offsetof(ferry__serve_conf, m)
#define T16 (16ull << 40)
static const key keys[] = {
    {"model", K_STR, KV(model), 0, 0, 0, "a model name (llama3-8b, qwen2.5-0.5b, tiny, or any "
                                          "with layout)"},
    {"tp_rank", K_COUNT, KV(tp_rank), 4, 0, 65535, NULL},
    {"tp_world", K_COUNT, KV(tp_world), 4, 1, 65536, NULL},
    {"layout", K_LAYOUT, 0, 0, 0, 0, NULL},
    {"chunk_tokens", K_COUNT, KV(chunk_tokens), 4, 1, 65536, NULL},
    {"hash_seed", K_SEED, KV(hash_seed), 0, 0, 0, NULL},
    {"l1_bytes", K_SIZE, KV(l1_bytes), 0, 4096, T16, NULL},
    {"l2_dir", K_DIRS, 0, 0, 1, 1, NULL},
    {"l2_dirs", K_DIRS, 0, 0, 1, FERRY__SERVE_CONF_MAX_L2, NULL},
    {"l2_bytes", K_SIZE, KV(l2_bytes), 0, 1u << 20, 1ull << 50, NULL},
    {"l2_direct", K_BOOL, KV(l2_direct), 0, 0, 0, NULL},
    {"l2_engine", K_ENGINE, KV(l2_engine), 0, 0, 0, NULL},
    {"l1_policy", K_POLICY, KV(l1_policy), 0, 0, 0, NULL},
    {"l2_policy", K_POLICY, KV(l2_policy), 0, 0, 0, NULL},
    {"watermark", K_REAL, KV(watermark), 0, 0, 0, NULL},
    {"evict_fraction", K_REAL, KV(evict_fraction), 0, 0, 0, NULL},
    {"write_ttl_ms", K_COUNT, KV(write_ttl_ms), 4, 1, UINT32_MAX, NULL},
    {"read_ttl_ms", K_COUNT, KV(read_ttl_ms), 4, 1, UINT32_MAX, NULL},
    {"prefetch_max_bytes", K_SIZE, KV(prefetch_max_bytes), 0, 4096, T16, NULL},
    {"workers", K_COUNT, KV(workers), 4, 1, FERRY_KV_WORKERS_MAX, NULL},
    {"l2_persistent", K_BOOL, KV(l2_persistent), 0, 0, 0, NULL},
    {"remote_url", K_URL, KV(remote_url), 0, 0, 0, NULL},
    {"remote_index_chunks", K_COUNT, KV(remote_index_chunks), 8, 1, 1ull << 40, NULL},
    {"l2_reset", K_BOOL, KV(l2_reset), 0, 0, 0, NULL},
    {"l2_mode", K_MODE, KV(l2_mode), 0, 0, 0, NULL},
    {"server", K_STR, KV(server), 0, 0, 0, "unix:/path/to/ferry.sock"},
    {"server_timeout_ms", K_COUNT, KV(server_timeout_ms), 4, 1, UINT32_MAX, NULL},
    {"pool_wait_ms", K_COUNT, KV(pool_wait_ms), 4, 0, FERRY_KV_POOL_WAIT_MS_MAX, NULL},
    {"socket", K_STR, SC(socket), 0, 0, 0, "a socket path"},
    {"group", K_STR, SC(group), 0, 0, 0, "a group name"},
    {"allow_uids", K_UIDS, 0, 0, 0, FERRY__SERVE_CONF_MAX_ALLOW, NULL},
    {"max_clients", K_COUNT, SC(max_clients), 8, 1, 65536, NULL},
    {"send_timeout_ms", K_COUNT, SC(send_timeout_ms), 8, 1, UINT32_MAX, NULL},
    {"metrics", K_INET, SC(metrics), 0, 0, 0, NULL},
};
#define NKEYS (sizeof keys / sizeof keys[0])
_Static_assert(NKEYS <= 48, "ferry__serve_conf.origin has a row per key");

/* layout's members: a bit each in layout_set */
static const char *const lay_names[] = {"num_layers", "kv", "num_heads", "head_dim", "dtype"};
#define NLAY 5

/* ---- the conf ---- */

void ferry__serve_conf_init(ferry__serve_conf *c)
{
    memset(c, 0, sizeof *c);
    ferry_kv_config kc = FERRY_KV_CONFIG_INIT;
    c->kv = kc;
    c->kv.model = "llama3-8b";
    c->kv.l1_bytes = 2ull << 30;
    c->kv.l2_persistent = 1; /* the daemon's L2 survives its restarts */
    c->socket = "/run/ferry/ferry.sock";
    ferry_kv_layout l = FERRY_KV_LAYOUT_INIT;
    c->layout = l;
}

void ferry__serve_conf_free(ferry__serve_conf *c)
{
    for (ferry__serve_conf_str *s = c->strs, *n; s; s = n) {
        n = s->next;
        free(s);
    }
    c->strs = NULL;
}

const char *ferry__serve_conf_strdup(ferry__serve_conf *c, const char *s)
{
    size_t n = strlen(s) + 1;
    ferry__serve_conf_str *p = malloc(sizeof *p + n);
    if (!p)
        return NULL;
    memcpy(p->s, s, n);
    p->next = c->strs;
    c->strs = p;
    return p->s;
}

const char *ferry__serve_conf_key_name(int i)
{
    return i >= 0 && (size_t)i < NKEYS ? keys[i].name : NULL;
}

int ferry__serve_conf_key(const char *name)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (!strcmp(keys[i].name, name))
            return (int)i;
    return -1;
}

void ferry__serve_conf_mark(ferry__serve_conf *c, const char *name, const char *origin)
{
    int i = ferry__serve_conf_key(name);
    if (i >= 0)
        snprintf(c->origin[i], sizeof c->origin[i], "%s", origin);
}

const char *ferry__serve_conf_origin(const ferry__serve_conf *c, const char *name)
{
    int i = ferry__serve_conf_key(name);
    return i >= 0 ? c->origin[i] : "";
}

int ferry__serve_conf_model_layout(const char *model, ferry_kv_layout *l)
{
    ferry_kv_layout d = FERRY_KV_LAYOUT_INIT;
    if (!strcmp(model, "qwen2.5-0.5b")) {
        d.num_layers = 24;
        d.num_heads = 2;
        d.head_dim = 64;
    } else if (!strcmp(model, "tiny")) {
        d.num_layers = 2;
        d.num_heads = 2;
        d.head_dim = 64;
    } else if (strcmp(model, "llama3-8b")) {
        return -1;
    }
    *l = d;
    return 0;
}

/* ---- one value ---- */

/* what key k accepts, for messages */
static const char *accepted(const key *k, char *buf, size_t n)
{
    char a[32], b[32];
    switch (k->type) {
    case K_STR:
        return k->what;
    case K_SIZE:
        snprintf(buf, n, "a size %s..%s (e.g. 4096, 256K, 8M, 2G)",
                 ferry__size_str(k->min, a, sizeof a), ferry__size_str(k->max, b, sizeof b));
        return buf;
    case K_COUNT:
        snprintf(buf, n, "a whole number %llu..%llu", (unsigned long long)k->min,
                 (unsigned long long)k->max);
        return buf;
    case K_SEED: return "a whole number 0..18446744073709551615";
    case K_REAL: return "a decimal number 0..1 (0: the default)";
    case K_BOOL: return "true or false";
    case K_POLICY: return "lru or s3fifo";
    case K_ENGINE: return "auto, posix or uring";
    case K_MODE: return "an octal mode with the owner's read and write bits, at most 0666 "
                        "(e.g. 0600, 0660)";
    case K_URL: return "redis://[user:password@]host:port/db or unix:///path";
    case K_INET: return "HOST:PORT, an IPv4 address and a port 0..65535";
    case K_DIRS:
        snprintf(buf, n, "%s", k->max == 1 ? "a directory" : "a list of 1..16 directories");
        return buf;
    case K_UIDS: return "a list of up to 64 uids (whole numbers 0..4294967294)";
    default: return "a mapping of num_layers, kv, num_heads, head_dim and dtype";
    }
}

/* plain YAML null: no value */
static int is_null(const char *t)
{
    return !*t || !strcmp(t, "~") || !strcmp(t, "null") || !strcmp(t, "Null") ||
           !strcmp(t, "NULL");
}

static const char *parse_real01(const char *t, double *out)
{
    int digits = 0, dots = 0;
    const char *p = t;
    for (; *p; p++) {
        if (*p >= '0' && *p <= '9')
            digits++;
        else if (*p == '.' && !dots)
            dots++;
        else
            break;
    }
    if (!digits)
        return "not a number";
    if (*p)
        return "trailing characters";
    double v = strtod(t, NULL);
    if (!(v >= 0 && v <= 1))
        return "out of range";
    *out = v;
    return NULL;
}

/* any uint64_t, decimal digits only (seeds) */
static const char *parse_u64(const char *t, uint64_t *out)
{
    uint64_t v = 0;
    if (t[0] == '0' && (t[1] == 'x' || t[1] == 'X'))
        return "hexadecimal is not accepted";
    for (const char *p = t; *p; p++) {
        if (*p < '0' || *p > '9')
            return p == t ? "not a number" : "trailing characters";
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10)
            return "too large";
        v = v * 10 + d;
    }
    *out = v;
    return NULL;
}

static const char *parse_mode(const char *t, unsigned *out)
{
    if (t[0] != '0' || !t[1])
        return "not an octal mode (write it with a leading 0, e.g. 0660)";
    unsigned v = 0;
    for (const char *p = t + 1; *p; p++) {
        if (*p < '0' || *p > '7')
            return "not an octal mode";
        if (v > 0777)
            return "too large";
        v = v * 8 + (unsigned)(*p - '0');
    }
    if (v > 0666 || (v & 0111))
        return "only read and write bits, at most 0666";
    if ((v & 0600) != 0600)
        return "the owner needs read and write (0600)";
    *out = v;
    return NULL;
}

static const char *parse_choice(const char *t, const char *const *names, int *out)
{
    for (int i = 0; names[i]; i++)
        if (!strcmp(t, names[i])) {
            *out = i;
            return NULL;
        }
    return !strcmp(names[0], "false") ? "not a boolean" : "unknown";
}

/* a scalar value t of key k into c: NULL, or why not */
static const char *set_scalar(ferry__serve_conf *c, const key *k, const char *t)
{
    static const char *const pol[] = {"lru", "s3fifo", NULL};
    static const char *const eng[] = {"auto", "posix", "uring", NULL};
    static const char *const boo[] = {"false", "true", NULL};
    char *at = (char *)c + k->off;
    uint64_t v = 0;
    int i = 0;
    const char *why = NULL;
    if (is_null(t))
        return "no value";
    switch (k->type) {
    case K_STR:
    case K_URL:
    case K_INET: {
        struct sockaddr_in sa;
        if (k->type == K_URL && ferry_remote_url_validate(t) < 0)
            return "not a URL ferry reads";
        if (k->type == K_INET && ferry__parse_inet4(t, &sa) < 0)
            return "not an address and port";
        const char *s = ferry__serve_conf_strdup(c, t);
        if (!s)
            return "out of memory";
        memcpy(at, &s, sizeof s);
        return NULL;
    }
    case K_SIZE:
    case K_COUNT:
    case K_SEED:
        if (t[0] == '-' || t[0] == '+')
            return "not a whole number";
        why = k->type == K_SEED ? parse_u64(t, &v) : ferry__parse_number(t, k->type == K_SIZE, &v);
        if (!why && k->type != K_SEED && v < k->min)
            why = v == 0 ? "zero means nothing here" : "too small";
        if (!why && k->type != K_SEED && v > k->max)
            why = "too large";
        if (why)
            return why;
        if (k->type == K_COUNT && k->w == 4) {
            uint32_t u = (uint32_t)v;
            memcpy(at, &u, sizeof u);
        } else {
            memcpy(at, &v, sizeof v);
        }
        return NULL;
    case K_REAL: {
        double d = 0;
        if ((why = parse_real01(t, &d)) == NULL)
            memcpy(at, &d, sizeof d);
        return why;
    }
    case K_BOOL:
    case K_POLICY:
        if ((why = parse_choice(t, k->type == K_BOOL ? boo : pol, &i)) == NULL)
            memcpy(at, &i, sizeof i);
        return why;
    case K_ENGINE:
        if ((why = parse_choice(t, eng, &i)) == NULL)
            memcpy(at, &eng[i], sizeof eng[i]);
        return why;
    case K_MODE: {
        unsigned m = 0;
        if ((why = parse_mode(t, &m)) == NULL)
            memcpy(at, &m, sizeof m);
        return why;
    }
    default:
        return "not a single value here";
    }
}

/* item n (0-based) of list key k: NULL, or why not */
static const char *set_item(ferry__serve_conf *c, const key *k, unsigned n, const char *t)
{
    if (is_null(t))
        return "no value";
    if (n >= k->max)
        return k->max == 1 ? "one directory only" : "too many items";
    if (k->type == K_DIRS) {
        for (unsigned i = 0; i < n; i++)
            if (!strcmp(c->l2[i], t))
                return "the same directory twice";
        const char *s = ferry__serve_conf_strdup(c, t);
        if (!s)
            return "out of memory";
        c->l2[n] = s;
        c->n_l2 = n + 1;
        return NULL;
    }
    uint64_t v = 0;
    const char *why = t[0] == '-' || t[0] == '+' ? "not a whole number"
                                                   : ferry__parse_number(t, 0, &v);
    if (!why && v > UINT32_MAX - 1)
        why = "too large";
    if (why)
        return why;
    c->allow[n] = (uint32_t)v;
    c->nallow = n + 1;
    return NULL;
}

/* layout member name = t: NULL, or why not (*unknown set for a bad name) */
static const char *set_layout(ferry__serve_conf *c, const char *name, const char *t, int *unknown)
{
    int m = -1;
    for (int i = 0; i < NLAY; i++)
        if (!strcmp(name, lay_names[i]))
            m = i;
    *unknown = m < 0;
    if (m < 0)
        return "unknown member";
    if (is_null(t))
        return "no value";
    if (m == 4) {
        for (int d = 0; d < FERRY_DTYPE_COUNT; d++)
            if (!strcmp(t, ferry_dtype_name(d))) {
                c->layout.dtype = d;
                c->layout_set |= 1u << m;
                return NULL;
            }
        return "unknown dtype";
    }
    uint64_t v = 0;
    const char *why = t[0] == '-' || t[0] == '+' ? "not a whole number"
                                                   : ferry__parse_number(t, 0, &v);
    uint64_t max = m == 1 ? 2 : m == 3 ? 65536 : 4096;
    if (!why && (v < 1 || v > max))
        why = "out of range";
    if (why)
        return why;
    uint32_t u = (uint32_t)v;
    if (m == 0)
        c->layout.num_layers = u;
    else if (m == 1)
        c->layout.kv = u;
    else if (m == 2)
        c->layout.num_heads = u;
    else
        c->layout.head_dim = u;
    c->layout_set |= 1u << m;
    return NULL;
}

static const char *lay_accepted(const char *name)
{
    if (!strcmp(name, "dtype"))
        return "u8, i8, fp8, f16, bf16, i16, f32, i32, f64 or i64";
    if (!strcmp(name, "kv"))
        return "1 (one latent, MLA) or 2 (K and V)";
    if (!strcmp(name, "head_dim"))
        return "a whole number 1..65536";
    if (!strcmp(name, "num_layers") || !strcmp(name, "num_heads"))
        return "a whole number 1..4096";
    return "num_layers, kv, num_heads, head_dim, dtype";
}

/* ---- the file ---- */

typedef struct yp {
    yaml_parser_t p;
    yaml_event_t ev;
    int have;          /* ev holds an event to delete */
    const char *name;
    ferry__serve_conf *c;
    char *err;
    size_t errlen;
} yp;

#define LINE(y) ((y)->ev.start_mark.line + 1)
#define COL(y) ((y)->ev.start_mark.column + 1)

/* src into out (n bytes, n > 0) with control bytes written as \n, \t or
 * \xHH: a key or value read from the file may hold line breaks (a plain
 * scalar folded over lines), and a message stays one line */
static void one_line(char *out, size_t n, const char *src)
{
    size_t o = 0;
    for (const unsigned char *q = (const unsigned char *)src; *q && o + 1 < n; q++) {
        char esc[5];
        if (*q >= 0x20 && *q != 0x7f) {
            out[o++] = (char)*q;
            continue;
        }
        if (*q == '\n' || *q == '\t')
            snprintf(esc, sizeof esc, "\\%c", *q == '\n' ? 'n' : 't');
        else
            snprintf(esc, sizeof esc, "\\x%02x", *q);
        size_t k = strlen(esc);
        if (o + k + 1 > n)
            break;
        memcpy(out + o, esc, k);
        o += k;
    }
    out[o] = 0;
}

static int fail_at(yp *y, const char *what, const char *why, const char *acc)
{
    char msg[1024];
    snprintf(msg, sizeof msg, "%s:%zu:%zu: %s: %s%s%s", y->name, LINE(y), COL(y), what, why,
             acc ? "; accepted: " : "", acc ? acc : "");
    if (y->errlen)
        one_line(y->err, y->errlen, msg);
    return -1;
}

static const char *kind_of(const yaml_event_t *e)
{
    switch (e->type) {
    case YAML_SCALAR_EVENT: return "a single value";
    case YAML_SEQUENCE_START_EVENT: return "a list";
    case YAML_MAPPING_START_EVENT: return "a mapping";
    default: return "something else";
    }
}

/* the next event into y->ev: 0, or -1 (not YAML, an alias, anchor or tag) */
static int next(yp *y)
{
    if (y->have)
        yaml_event_delete(&y->ev);
    y->have = 0;
    if (!yaml_parser_parse(&y->p, &y->ev)) {
        snprintf(y->err, y->errlen, "%s:%zu:%zu: not valid YAML: %s%s%s", y->name,
                 y->p.problem_mark.line + 1, y->p.problem_mark.column + 1,
                 y->p.problem ? y->p.problem : "a syntax error", y->p.context ? " " : "",
                 y->p.context ? y->p.context : "");
        return -1;
    }
    y->have = 1;
    const yaml_event_t *e = &y->ev;
    const yaml_char_t *anchor = NULL, *tag = NULL;
    if (e->type == YAML_ALIAS_EVENT)
        return fail_at(y, "*alias", "aliases are not accepted", "plain values");
    if (e->type == YAML_SCALAR_EVENT) {
        anchor = e->data.scalar.anchor;
        tag = e->data.scalar.tag;
    } else if (e->type == YAML_SEQUENCE_START_EVENT) {
        anchor = e->data.sequence_start.anchor;
        tag = e->data.sequence_start.tag;
    } else if (e->type == YAML_MAPPING_START_EVENT) {
        anchor = e->data.mapping_start.anchor;
        tag = e->data.mapping_start.tag;
    }
    if (anchor)
        return fail_at(y, "&anchor", "anchors are not accepted", "plain values");
    if (tag)
        return fail_at(y, "!tag", "tags are not accepted", "plain values");
    return 0;
}

static const char *scalar(const yp *y)
{
    return (const char *)y->ev.data.scalar.value;
}

/* a list value of key k, its SEQUENCE_START in y->ev */
static int list_value(yp *y, const key *k)
{
    char acc[160];
    if (y->ev.type != YAML_SEQUENCE_START_EVENT)
        return fail_at(y, k->name, "a single value where a list belongs",
                       accepted(k, acc, sizeof acc));
    if (k->type == K_DIRS)
        y->c->n_l2 = 0;
    else
        y->c->nallow = 0;
    for (unsigned n = 0;; n++) {
        if (next(y) < 0)
            return -1;
        if (y->ev.type == YAML_SEQUENCE_END_EVENT)
            return n == 0 && k->min > 0 ? fail_at(y, k->name, "an empty list",
                                                  accepted(k, acc, sizeof acc))
                                        : 0;
        if (y->ev.type != YAML_SCALAR_EVENT)
            return fail_at(y, k->name, "a list inside the list", accepted(k, acc, sizeof acc));
        const char *why = set_item(y->c, k, n, scalar(y));
        if (why)
            return fail_at(y, k->name, why, accepted(k, acc, sizeof acc));
    }
}

/* layout's mapping, its MAPPING_START in y->ev */
static int layout_value(yp *y, const key *k)
{
    char acc[160], what[64];
    if (y->ev.type != YAML_MAPPING_START_EVENT)
        return fail_at(y, k->name, "not a mapping", accepted(k, acc, sizeof acc));
    unsigned seen = 0;
    for (;;) {
        if (next(y) < 0)
            return -1;
        if (y->ev.type == YAML_MAPPING_END_EVENT)
            return 0;
        if (y->ev.type != YAML_SCALAR_EVENT)
            return fail_at(y, "layout", "a member's name must be a plain word",
                           accepted(k, acc, sizeof acc));
        char name[32];
        snprintf(name, sizeof name, "%s", scalar(y));
        snprintf(what, sizeof what, "layout.%s", name);
        int unknown = 0;
        for (int i = 0; i < NLAY; i++)
            if (!strcmp(name, lay_names[i]) && (seen & (1u << i)))
                return fail_at(y, what, "a duplicate key", "each member once");
        for (int i = 0; i < NLAY; i++)
            if (!strcmp(name, lay_names[i]))
                seen |= 1u << i;
        size_t kl = strlen(scalar(y)), kc = COL(y), kline = LINE(y);
        if (kl >= sizeof name)
            return fail_at(y, "layout", "unknown member", lay_accepted(""));
        if (next(y) < 0)
            return -1;
        if (y->ev.type != YAML_SCALAR_EVENT) {
            char why[64];
            snprintf(why, sizeof why, "%s where a single value belongs", kind_of(&y->ev));
            return fail_at(y, what, why, lay_accepted(name));
        }
        const char *why = set_layout(y->c, name, scalar(y), &unknown);
        if (why && unknown) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s:%zu:%zu: %s: unknown member; accepted: %s", y->name,
                     kline, kc, what, lay_accepted(""));
            if (y->errlen)
                one_line(y->err, y->errlen, msg);
            return -1;
        }
        if (why)
            return fail_at(y, what, why, lay_accepted(name));
    }
}

/* one key: value pair, the key's SCALAR in y->ev */
static int pair(yp *y, uint64_t *seen)
{
    char acc[160], keyname[64];
    snprintf(keyname, sizeof keyname, "%s", scalar(y));
    int i = ferry__serve_conf_key(scalar(y));
    if (i < 0 || strlen(scalar(y)) >= sizeof keyname)
        return fail_at(y, keyname, "unknown key",
                       "ferry_kv_config's names (model, l1_bytes, l2_dir, l2_dirs, l2_bytes, "
                       "remote_url, workers, ...) and socket, group, allow_uids, max_clients, "
                       "send_timeout_ms, metrics; see ferry serve --help");
    const key *k = &keys[i];
    if (*seen & (1ull << i))
        return fail_at(y, k->name, "a duplicate key", "each key once");
    int other = k->type == K_DIRS ? ferry__serve_conf_key(k->max == 1 ? "l2_dirs" : "l2_dir") : -1;
    if (other >= 0 && (*seen & (1ull << other)))
        return fail_at(y, k->name, "l2_dir and l2_dirs both given", "one of them");
    *seen |= 1ull << i;
    snprintf(y->c->origin[i], sizeof y->c->origin[i], "%s:%zu:%zu", y->name, LINE(y), COL(y));
    if (other >= 0)
        y->c->origin[other][0] = 0;
    if (next(y) < 0)
        return -1;
    if (k->type == K_LAYOUT)
        return layout_value(y, k);
    if (k->type == K_UIDS || (k->type == K_DIRS && k->max > 1))
        return list_value(y, k);
    if (y->ev.type != YAML_SCALAR_EVENT) {
        char why[64];
        snprintf(why, sizeof why, "%s where a single value belongs", kind_of(&y->ev));
        return fail_at(y, k->name, why, accepted(k, acc, sizeof acc));
    }
    const char *why = k->type == K_DIRS ? (y->c->n_l2 = 0, set_item(y->c, k, 0, scalar(y)))
                                        : set_scalar(y->c, k, scalar(y));
    return why ? fail_at(y, k->name, why, accepted(k, acc, sizeof acc)) : 0;
}

/* the document's content, its first event in y->ev */
static int document(yp *y)
{
    if (y->ev.type == YAML_SCALAR_EVENT && y->ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
        is_null(scalar(y)))
        return 0; /* an empty document */
    if (y->ev.type != YAML_MAPPING_START_EVENT)
        return fail_at(y, "the file", "not a mapping of keys", "key: value lines");
    uint64_t seen = 0;
    for (;;) {
        if (next(y) < 0)
            return -1;
        if (y->ev.type == YAML_MAPPING_END_EVENT)
            return 0;
        if (y->ev.type != YAML_SCALAR_EVENT)
            return fail_at(y, "a key", "not a plain name", "key: value lines");
        if (pair(y, &seen) < 0)
            return -1;
    }
}

int ferry__serve_conf_parse(ferry__serve_conf *c, const char *name, const char *text, size_t len, char *err,
                     size_t errlen)
{
    yp y;
    memset(&y, 0, sizeof y);
    y.name = name;
    y.c = c;
    y.err = err;
    y.errlen = errlen;
    if (!yaml_parser_initialize(&y.p)) {
        snprintf(err, errlen, "%s: out of memory for the YAML parser", name);
        return -1;
    }
    yaml_parser_set_input_string(&y.p, (const unsigned char *)text, len);
    int rc = next(&y); /* STREAM_START */
    int docs = 0;
    while (rc == 0) {
        if ((rc = next(&y)) < 0 || y.ev.type == YAML_STREAM_END_EVENT)
            break;
        /* DOCUMENT_START */
        if (docs++)
            rc = fail_at(&y, "the file", "a second document", "one document");
        else if ((rc = next(&y)) == 0 && (rc = document(&y)) == 0)
            rc = next(&y); /* DOCUMENT_END */
    }
    if (y.have)
        yaml_event_delete(&y.ev);
    yaml_parser_delete(&y.p);
    return rc < 0 ? -1 : 0;
}

int ferry__serve_conf_load(ferry__serve_conf *c, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot read it: %s", path, strerror(errno));
        return -1;
    }
    char *buf = malloc(FERRY__SERVE_CONF_FILE_MAX + 1);
    size_t n = buf ? fread(buf, 1, FERRY__SERVE_CONF_FILE_MAX + 1, f) : 0;
    int bad = ferror(f);
    fclose(f);
    int rc = -1;
    if (!buf)
        snprintf(err, errlen, "%s: out of memory", path);
    else if (bad)
        snprintf(err, errlen, "%s: cannot read it", path);
    else if (n > FERRY__SERVE_CONF_FILE_MAX)
        snprintf(err, errlen, "%s: larger than %u bytes: not a configuration file", path,
                 FERRY__SERVE_CONF_FILE_MAX);
    else
        rc = ferry__serve_conf_parse(c, path, buf, n, err, errlen);
    free(buf);
    return rc;
}

/* ---- the environment ---- */

/* FERRY_<KEY> = v for list key k: comma-separated items */
static const char *env_list(ferry__serve_conf *c, const key *k, const char *v)
{
    if (k->type == K_DIRS)
        c->n_l2 = 0;
    else
        c->nallow = 0;
    char item[4096];
    unsigned n = 0;
    for (const char *p = v;; n++) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len >= sizeof item)
            return "an item too long";
        memcpy(item, p, len);
        item[len] = 0;
        const char *why = set_item(c, k, n, item);
        if (why)
            return why;
        if (!comma)
            return NULL;
        p = comma + 1;
    }
}

int ferry__serve_conf_env(ferry__serve_conf *c, char *err, size_t errlen)
{
    for (size_t i = 0; i < NKEYS; i++) {
        const key *k = &keys[i];
        if (k->type == K_LAYOUT)
            continue;
        char var[64];
        size_t n = (size_t)snprintf(var, sizeof var, "FERRY_%s", k->name);
        for (size_t j = 6; j < n && j < sizeof var; j++)
            if (var[j] >= 'a' && var[j] <= 'z')
                var[j] = (char)(var[j] - 'a' + 'A');
        const char *v = getenv(var);
        if (!v)
            continue;
        const char *why = k->type == K_UIDS || (k->type == K_DIRS && k->max > 1)
                              ? env_list(c, k, v)
                          : k->type == K_DIRS ? (c->n_l2 = 0, set_item(c, k, 0, v))
                                              : set_scalar(c, k, v);
        char acc[160];
        if (why) {
            /* a URL is not echoed: it may hold a password */
            snprintf(err, errlen, "%s%s%s: %s; accepted: %s", var, k->type == K_URL ? "" : "=",
                     k->type == K_URL ? "" : v, why, accepted(k, acc, sizeof acc));
            return -1;
        }
        snprintf(c->origin[i], sizeof c->origin[i], "%s", var);
        int other = k->type == K_DIRS ? ferry__serve_conf_key(k->max == 1 ? "l2_dirs" : "l2_dir") : -1;
        if (other >= 0 && c->origin[other][0] && !strncmp(c->origin[other], "FERRY_", 6)) {
            snprintf(err, errlen, "%s and FERRY_%s: both set; accepted: one of them", var,
                     k->max == 1 ? "L2_DIRS" : "L2_DIR");
            return -1;
        }
        if (other >= 0)
            c->origin[other][0] = 0;
    }
    return 0;
}

/* ---- what no single key shows ---- */

static const char *from(const ferry__serve_conf *c, const char *name)
{
    const char *o = ferry__serve_conf_origin(c, name);
    return *o ? o : "the default";
}

int ferry__serve_conf_finish(ferry__serve_conf *c, char *err, size_t errlen)
{
    if (c->layout_set) {
        unsigned need = 1u << 0 | 1u << 2 | 1u << 3;
        if ((c->layout_set & need) != need) {
            snprintf(err, errlen, "%s: layout: give num_layers, num_heads and head_dim (kv "
                     "defaults to 2, dtype to bf16)", from(c, "layout"));
            return -1;
        }
        c->kv.layout = c->layout;
    } else if (ferry__serve_conf_model_layout(c->kv.model, &c->kv.layout) < 0) {
        snprintf(err, errlen, "%s: model %s: not a model ferry knows the KV shape of; accepted: "
                 "llama3-8b, qwen2.5-0.5b or tiny, or give layout", from(c, "model"),
                 c->kv.model);
        return -1;
    }
    c->kv.l2_dir = NULL;
    if (c->n_l2 && !c->kv.l2_bytes) {
        snprintf(err, errlen, "%s: the L2 directories need l2_bytes (%s); accepted: l2_bytes: "
                 "SIZE, e.g. 2T", from(c, c->n_l2 > 1 ? "l2_dirs" : "l2_dir"),
                 c->n_l2 > 1 ? "each directory's share" : "the slab's size");
        return -1;
    }
    c->kv.l2_dirs = NULL;
    c->kv.l2_n_dirs = 0;
    if (c->n_l2 == 1)
        c->kv.l2_dir = c->l2[0];
    else if (c->n_l2 > 1) {
        c->kv.l2_dirs = c->l2; /* striped over them, l2_bytes on each */
        c->kv.l2_n_dirs = c->n_l2;
    }
    return 0;
}

int ferry__serve_conf_daemon(const ferry__serve_conf *c, char *err, size_t errlen)
{
    if (c->kv.server) {
        snprintf(err, errlen, "%s: server: a client's key; accepted: no server (the daemon "
                 "hosts the store itself)", from(c, "server"));
        return -1;
    }
    /* (how long an engine waits for the daemon: no daemon's setting) */
    const char *sto = ferry__serve_conf_origin(c, "server_timeout_ms");
    if (*sto) {
        snprintf(err, errlen, "%s: server_timeout_ms: a client's key (how long an engine "
                 "waits for the daemon); accepted: no server_timeout_ms (set it in the "
                 "engines' config)", sto);
        return -1;
    }
    /* without a group the socket is 0600: an allowed uid other than root
     * (which any mode admits) could never connect */
    for (size_t i = 0; !c->group && i < c->nallow; i++) {
        if (c->allow[i] == 0)
            continue;
        const char *o = ferry__serve_conf_origin(c, "allow_uids");
        snprintf(err, errlen, "%s: uid %u cannot reach the socket without a group (it is "
                 "0600); accepted: a group uid %u is in too (--group NAME, or group: NAME; "
                 "the socket is then 0660)", *o ? o : "--allow-uid", (unsigned)c->allow[i],
                 (unsigned)c->allow[i]);
        return -1;
    }
    return 0;
}

/* ---- the socket ---- */

const char *ferry__serve_socket_parse(const char *addr, const char **path)
{
    const char *p = addr;
    if (!strncmp(p, "unix:", 5)) {
        p += 5;
        /* unix:///run/x is unix:/run/x; unix://run/x would name a host */
        if (!strncmp(p, "//", 2)) {
            if (p[2] != '/')
                return "unix://HOST/... names a host; a Unix-domain socket has none";
            p += 2;
        }
        if (!*p)
            return "names no socket";
    } else {
        size_t n = 0;
        while (isalnum((unsigned char)p[n]) || (n && strchr("+.-", p[n])))
            n++;
        if (n && isalpha((unsigned char)p[0]) && !strncmp(p + n, "://", 3))
            return "an address of another scheme; ferry serve listens on a Unix-domain "
                   "socket only";
    }
    if (!*p)
        return "empty";
    *path = p;
    return NULL;
}

int ferry__serve_conf_socket(ferry__serve_conf *c, char *err, size_t errlen)
{
    const char *path = NULL, *why = ferry__serve_socket_parse(c->socket, &path);
    if (!why) {
        c->socket = path;
        return 0;
    }
    snprintf(err, errlen, "%s: socket %s: %s; accepted: unix:/path/to/ferry.sock or "
             "/path/to/ferry.sock (a Unix-domain socket)", from(c, "socket"), c->socket, why);
    return -1;
}
