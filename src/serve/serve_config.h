/*
 * serve_config.h - the configuration of `ferry serve`: a YAML file, the
 * environment and the command line, one set of keys. Private: the CLI and
 * ferry_serve_file_load (ferry/serve.h) read files through it.
 *
 * Keys. The store's are ferry_kv_config's own names (model, tp_rank,
 * tp_world, layout, chunk_tokens, hash_seed, l1_bytes, l2_dir, l2_dirs,
 * l2_bytes, l2_direct, l2_engine, l1_policy, l2_policy, watermark,
 * evict_fraction, write_ttl_ms, read_ttl_ms, prefetch_max_bytes, workers,
 * l2_persistent, remote_url, remote_index_chunks, l2_reset, l2_mode,
 * server, server_timeout_ms); the daemon's are socket, group, allow_uids,
 * max_clients, send_timeout_ms and metrics. Sizes take the flags'
 * suffixes (4096, 256K, 64G, 2T), booleans are true or false, policies
 * lru or s3fifo, l2_mode an octal mode (0600, 0660), lists YAML sequences
 * ([a, b] or "- a" lines), layout a mapping (num_layers, kv, num_heads,
 * head_dim, dtype).
 *
 * Precedence: the built-in defaults, then the file, then the environment
 * (FERRY_<KEY>, the key upper-cased: FERRY_L1_BYTES=64G, FERRY_SOCKET=...;
 * lists comma-separated: FERRY_L2_DIRS=/nvme0/ferry,/nvme1/ferry; layout
 * has no variable), then the flags. A later source replaces a key's value
 * whole (a list too: it never merges with an earlier one).
 *
 * Nothing is ignored: an unknown key, a value of the wrong type (a list
 * where a number belongs, "yes" for a boolean), a bad size, a duplicate
 * key, a second document, an anchor, alias or tag, a file that is not
 * YAML: each is refused with the file, line and column and the key
 * ("ferry.yaml:3:10: l1_bytes: not a number; accepted: a size ..."), or
 * the variable's name. The parser touches no file system but the one
 * file it reads: directories are checked by the command.
 */
#ifndef FERRY_SRC_SERVE_CONFIG_H
#define FERRY_SRC_SERVE_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "ferry.h"

#define FERRY__SERVE_CONF_MAX_ALLOW 64
#define FERRY__SERVE_CONF_MAX_L2 16
#define FERRY__SERVE_CONF_FILE_MAX (1u << 20)
#define FERRY__SERVE_CONF_ORIGIN 128

typedef struct ferry__serve_conf_str ferry__serve_conf_str;

typedef struct ferry__serve_conf {
    /* the hosted store: FERRY_KV_CONFIG_INIT and the daemon's defaults,
     * then what the sources set (strings owned by the conf) */
    ferry_kv_config kv;
    /* the L2 directories (l2_dir is the list of one); kv's l2 fields are
     * set from it by ferry__serve_conf_finish */
    const char *l2[FERRY__SERVE_CONF_MAX_L2];
    unsigned n_l2;
    /* the daemon */
    const char *socket;
    const char *group;      /* NULL: 0600 */
    const char *metrics;    /* HOST:PORT or NULL */
    uint32_t allow[FERRY__SERVE_CONF_MAX_ALLOW];
    size_t nallow;
    uint64_t max_clients;   /* 0: the default */
    uint64_t send_timeout_ms;
    /* layout's members as given (a bit per member in layout_set) */
    ferry_kv_layout layout;
    unsigned layout_set;
    /* where each key's value came from ("" for the default):
     * "FILE:LINE:COL", "FERRY_L1_BYTES", "--l1" */
    char origin[48][FERRY__SERVE_CONF_ORIGIN];
    ferry__serve_conf_str *strs;
} ferry__serve_conf;

/* the defaults: model llama3-8b, l1_bytes 2G, socket /run/ferry/ferry.sock */
void ferry__serve_conf_init(ferry__serve_conf *c);
void ferry__serve_conf_free(ferry__serve_conf *c);

/* Parse YAML text[0..len) (name: the file's name in messages) over c.
 * 0, or -1 with one line in err ("name:LINE:COL: key: why; accepted: ...")
 * and c partly updated (throw it away). */
int ferry__serve_conf_parse(ferry__serve_conf *c, const char *name, const char *text, size_t len, char *err,
                     size_t errlen);
/* ferry__serve_conf_parse on the file at path (at most FERRY__SERVE_CONF_FILE_MAX bytes) */
int ferry__serve_conf_load(ferry__serve_conf *c, const char *path, char *err, size_t errlen);
/* every FERRY_<KEY> variable that is set, over c: 0, or -1 with err */
int ferry__serve_conf_env(ferry__serve_conf *c, char *err, size_t errlen);

/* key i's name, NULL past the last */
const char *ferry__serve_conf_key_name(int i);
/* the key's index (for origins), or -1 */
int ferry__serve_conf_key(const char *key);
/* record that key was set by origin (a flag) */
void ferry__serve_conf_mark(ferry__serve_conf *c, const char *key, const char *origin);
/* where key's value came from: "" for the default */
const char *ferry__serve_conf_origin(const ferry__serve_conf *c, const char *key);
/* a string owned by c (NULL when out of memory) */
const char *ferry__serve_conf_strdup(ferry__serve_conf *c, const char *s);

/* the KV shape of a model ferry knows (llama3-8b, qwen2.5-0.5b, tiny): 0, else -1 */
int ferry__serve_conf_model_layout(const char *model, ferry_kv_layout *l);

/* What no single key shows: the layout (a known model's, or layout's
 * members: num_layers, num_heads and head_dim at least), the L2 list into
 * kv, l2_dir/l2_dirs without l2_bytes. 0, or -1 with err naming the
 * origins. */
int ferry__serve_conf_finish(ferry__serve_conf *c, char *err, size_t errlen);

/* What a daemon's config may not hold though each key reads: a client's
 * keys (server, server_timeout_ms), an allowed uid other than root
 * without a group (the socket is then 0600: it could never connect).
 * 0, or -1 with err naming the origin; `ferry serve` and
 * ferry_serve_file_load refuse the same way. */
int ferry__serve_conf_daemon(const ferry__serve_conf *c, char *err, size_t errlen);

/* An address of the daemon's socket, PATH or unix:PATH (unix:///PATH):
 * NULL and *path (inside addr), or why it is none (tcp:// or any other
 * scheme, unix://HOST/..., empty) */
const char *ferry__serve_socket_parse(const char *addr, const char **path);
/* c's socket as a path (unix:PATH becomes PATH): 0, or -1 with err naming
 * where the value came from (another scheme is never taken for a path) */
int ferry__serve_conf_socket(ferry__serve_conf *c, char *err, size_t errlen);

#endif
