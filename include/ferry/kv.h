/*
 * ferry/kv.h - the tiered KV-cache store: chunk keys, prefix lookup, a
 * pinned host tier (L1) and an NVMe slab tier (L2), eviction, metrics.
 *
 * An inference engine calls ferry after a prefill to store the KV cache of
 * a prompt, and before the next prefill to learn how many leading tokens
 * are already cached and to load them into its own buffers instead of
 * recomputing them.
 *
 * Keys. A prompt's token ids are cut into chunks of chunk_tokens (256 by
 * default). Chunk i's hash is chained over the previous one:
 *     h_0 = XXH3_128(seed, 16 zero bytes || tokens_0)
 *     h_i = XXH3_128(seed, h_{i-1} || tokens_i)
 * where a hash is its 16 bytes little-endian (low 64 bits first) and tokens
 * are int32 little-endian, so the hash is the same in every process and on
 * every machine. A chunk's key is (model, TP rank, TP world size, chunk
 * hash, optional cache salt); the salt isolates tenants. A partial last
 * chunk (fewer than chunk_tokens tokens) is stored and found only when the
 * request asks for it (FERRY_KV_PARTIAL).
 *
 * Chunk data. One chunk holds, for chunk_tokens tokens, the K and V of
 * every layer as one tensor [kv][layers][chunk_tokens][heads * head_dim] of
 * the layout's dtype. Llama-3-8B (32 layers, 8 KV heads, head_dim 128,
 * bf16): 2*32*256*8*128*2 = 32 MiB per chunk.
 *
 * Tiers. L1 is a pool of host memory (pinned through the store's device
 * when it has one) carved into chunk slots. L2, when configured, is an
 * NVMe slab (ferry/gds.h; over several drives, striped: l2_dirs) divided
 * into chunk extents. A store goes to L1
 * and, when L2 is configured, is written through to L2 in the background
 * (ferry_kv_flush() waits for it). Write-through is best effort: a chunk
 * keeps its L1 slot read-locked until its L2 write lands, and when all of
 * L2 is taken by chunks resident there or writes still in flight, the
 * chunk stays in L1 only (counted in the L2 tier's failures); a store that
 * finds L1 full of chunks waiting for their write waits for one to land.
 * A lookup or retrieve that finds a chunk
 * only in L2 promotes it to L1. Chunks move engine buffer <-> L1 with the
 * device's asynchronous copies and L1 <-> L2 through the slab's I/O
 * engines; the copies of one chunk overlap the disk I/O of the next.
 *
 * Fork. A store belongs to the process that opened it. Its L1 pool,
 * unless pinned through a device, is a mapping of its own kept out of a
 * fork's child (MADV_DONTFORK), so a fork of a process with a multi-GiB
 * pool registered with L2's io_uring engines copies none of it (it used
 * to copy every pinned page, seconds a fork). In the child every call on
 * the parent's store and on its operations returns FERRY_ESTATE, with a
 * message naming the opener's process id and the child's, touching
 * nothing of the store (a warning is logged once a process);
 * ferry_kv_close, ferry_kv_close_begin and ferry_kv_op_free there release
 * nothing. A child opens a store of its own. The check costs one load a
 * call: the id is kept in a page the kernel zeroes in every child that
 * does not share the parent's memory (MADV_WIPEONFORK), so it holds for
 * fork(), _Fork() and a raw clone alike (before Linux 4.14: fork()'s
 * pthread_atfork handlers only).
 *
 * One owner per directory. An L2 directory belongs to one open store at a
 * time: ferry_kv_open takes an exclusive lock on it (l2_dir/ferry.lock,
 * dropped at ferry_kv_close and by the kernel when the process dies, so a
 * crash never leaves it locked), and a second store on the same directory,
 * in this process or another, gets FERRY_EBUSY naming the directory and
 * the owner's pid. Give every TP rank and every store its own l2_dir
 * (".../rank0", ".../rank1"); one cache shared by several processes is a
 * server's job, not a shared directory's. An L2 over several drives
 * (l2_dirs) locks each of its directories the same way. Files are created 0600 and
 * directories 0700: KV caches hold what prompts can be rebuilt from.
 *
 * Verified reads. No byte read from below L1 reaches an engine buffer
 * unchecked. The L2 slab keeps, for each chunk it holds, the chunk's id
 * and a checksum (XXH3-64) of its bytes, and every read is checked
 * against both before the chunk counts as found: a chunk whose bytes
 * changed on disk (another program writing the slab file, a torn or
 * rotten block) is a miss (status FERRY_ECORRUPT), its L2 copy is
 * dropped, and it is counted in corrupt_chunks and logged. The
 * persistent slab and the remote tier check their own checksums the same
 * way. A retrieve reports only the chunks it verified. A chunk it does
 * not report leaves its destination untouched, except one that failed its
 * check while being copied into a host buffer, or one read straight into
 * it (below): its destination tokens are zeroed, so the engine never holds
 * the bad bytes.
 *
 * Direct reads. A retrieve into a host buffer reads a chunk that is only
 * in a persistent L2 straight into the buffer, with no L1 slot and no
 * copy, when every run of the buffer the chunk fills (one per layer and
 * K/V for a contiguous buffer, one per block of those for a paged one)
 * starts and ends on a 4096-byte boundary (pinned host memory, page-aligned
 * allocations), no two runs overlap (nor, in the whole retrieve, any two
 * tokens it writes: a block table naming one block for two chunks sends
 * every chunk of it through L1, copied out one after another, and the
 * shared block holds whole rows of one of those chunks, or zeros where
 * one failed its check), the whole chunk
 * goes to the buffer
 * (none of it below skip_tokens), and the buffer lies in huge pages
 * (transparent or hugetlbfs, as the kernel reports them, Linux 6.7+; a
 * read into 4 KiB pages went at half the rate on a VM's disk). The
 * environment variable FERRY_KV_DIRECT=1 drops that last condition (any
 * aligned buffer; bare-metal NVMe reads 4 KiB pages at full rate),
 * FERRY_KV_DIRECT=0 turns direct reads off; it is read once per process.
 * Each piece of the chunk is one vectored read into its runs, checked
 * there against its checksum. Such a
 * chunk is NOT promoted into L1 (a later retrieve reads it from L2 again);
 * every other chunk (a buffer from malloc, a device buffer) goes through
 * L1 as above. A direct chunk with a bad piece or a failed read is a miss
 * whose destination tokens are zeroed before the retrieve returns, after
 * every read of it landed (untouched when none of its reads was started;
 * the one exception: the L2 read queue itself breaking, an engine
 * failure, leaves reads the kernel may still finish).
 *
 * Read depth. A retrieve from a persistent L2 keeps 16 reads of 2 MiB in
 * flight; the environment variable FERRY_KV_READ_DEPTH=1..32 sets another
 * depth (read at each retrieve; any other value is ignored, and warned of
 * at the process's first open, as a FERRY_KV_DIRECT of neither 0 nor 1
 * is). On the
 * development VM's virtual disk depths 2 to 16 read alike.
 *
 * States. A chunk goes absent -> being written (invisible: lookups and
 * retrieves miss it) -> ready -> read-locked (counted, by retrieves in
 * flight and by ferry_kv_pin()). Locks carry a TTL (write 600 s, read
 * 300 s by default): a lock older than its TTL is ignored, so a crashed
 * writer or a reader that never unpinned does not hold memory forever.
 * Deleting a locked chunk answers FERRY_ELOCKED.
 *
 * Remote tier. With remote_url, a Redis/Valkey server (ferry/remote.h) is a
 * third tier below L1 and L2, shared by every store (in any process or
 * machine) that opens the same URL with the same model, TP rank/world,
 * layout, chunk size and hash seed. A chunk's server key is the remote's
 * key_prefix ("ferry:kv:" by default) and the 32 hex digits of its id (chunk
 * hash xor the namespace digest of model, TP rank/world, salt), and its
 * value carries a layout fingerprint, so a value written for another layout
 * under the same key is refused (a miss). The key leaves the layout out:
 * stores of one model, TP rank/world and seed but different layouts (dtype,
 * heads, layers) under one key_prefix use the same keys for the same tokens,
 * so they never read each other's bytes but do replace (and ferry_kv_delete)
 * each other's values; give each layout its own key_prefix to keep both.
 * A chunk is one value, so a geometry whose chunk and value header exceed
 * FERRY_REMOTE_VALUE_MAX (Redis's 512 MiB) is refused at open (-EINVAL
 * naming the chunk's size and the largest chunk_tokens that fits).
 * What other clients of the server do to a value (overwrite, truncate,
 * SETRANGE, delete, evict, FLUSHALL), even between a lookup and the
 * retrieve, makes that chunk a miss, never other bytes (ferry/remote.h says
 * what a shared server may do). A store writes each new chunk through to the
 * remote asynchronously (queued by a worker; never waiting on the network;
 * dropped when the remote is down or its bounded queue is full:
 * remote_dropped). Other stores see a chunk once its write has landed
 * (ferry_kv_flush waits for that), and this store counts a chunk as
 * remote-resident only on the server's word, never because its put was
 * queued: a chunk evicted locally before its write landed is a miss until it
 * has. A lookup that misses the local index asks the remote, in one
 * pipelined round trip, about all the chunks from the first local miss on,
 * and indexes those it has as resident in FERRY_KV_TIER_REMOTE; a retrieve
 * (or prefetch) does the same for chunks it does not find locally, then
 * fetches each remote chunk into an L1 slot (promotion; checksums verified
 * by the remote module) before copying it out. A value that is gone, refused
 * (other layout, corrupt) or unreachable is a miss for exactly that chunk,
 * never bytes. While the remote is down (after a timeout or refused
 * connection, for its backoff period) every remote question is answered as a
 * miss at once. The index remembers at most remote_index_chunks remote-only
 * chunks (forgetting one never deletes it on the server). ferry_kv_delete
 * deletes the chunks' remote copies too; ferry_kv_clear is local only.
 *
 * Eviction. Each tier has its own policy (LRU or S3-FIFO). When a tier's
 * usage reaches the watermark (0.8), chunks are evicted until usage is
 * watermark - evict_fraction (0.6); a locked chunk is never evicted. A
 * chunk evicted from L1 that is still in L2 stays findable (in L2).
 *
 * Thread-safety: every function may be called from several threads at once
 * on one store. ferry_kv_close() may be called while other threads are
 * inside calls on the store: it refuses calls that begin after it started
 * (FERRY_ESTATE, "the store is closing") and waits until the calls already
 * inside have returned before it frees anything. A call that begins after
 * ferry_kv_close() returned uses a freed handle (as with any freed
 * object). To end the calls inside that wait for an L1 slot (up to
 * pool_wait_ms) at once rather than wait for them, call
 * ferry_kv_close_begin() first. Buffers given to an asynchronous call stay the caller's and
 * must not be touched (or freed) until the operation completes, nor be
 * given to another call meanwhile: two operations in flight into buffers
 * that overlap race, and a direct read (below) whose checked bytes another
 * write changed is a miss, zeroed.
 *
 * Token ids are 0 .. 2^31-1: a negative id is refused (-EINVAL, naming its
 * position), as is a negative block id.
 */
#ifndef FERRY_KV_H
#define FERRY_KV_H

#include "core.h"
#include "device.h"
#include "slab.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FERRY_KV_CHUNK_TOKENS_DEFAULT 256u
/** The default hash seed (any 64-bit value; stores that share chunks must agree). */
#define FERRY_KV_HASH_SEED_DEFAULT 0x66657272794b5631ull /* "ferryKV1" */
#define FERRY_KV_WRITE_TTL_MS_DEFAULT 600000u
#define FERRY_KV_READ_TTL_MS_DEFAULT 300000u

/* ---- chunk hashes and keys ---- */

/** A 128-bit chunk hash (XXH3-128): lo = low 64 bits. */
typedef struct ferry_kv_hash {
    uint64_t lo;
    uint64_t hi;
} ferry_kv_hash;

/**
 * Hash tokens[0..n) into chained chunk hashes (see the top of this file).
 * Full chunks always; a partial last chunk too when `partial` is nonzero.
 * Writes at most max hashes to out (out may be NULL when max is 0).
 * Returns the number of chunks the tokens make (which may exceed max).
 * Errors: -EINVAL (tokens NULL with n > 0, chunk_tokens 0). Thread-safe.
 */
FERRY_API int ferry_kv_hash_chunks(uint64_t seed, const int32_t *tokens, size_t n,
                                   uint32_t chunk_tokens, int partial, ferry_kv_hash *out,
                                   size_t max);

/** The full key of one chunk. */
typedef struct ferry_kv_key {
    const char *model;
    uint32_t tp_rank;
    uint32_t tp_world;
    ferry_kv_hash hash;
    const void *salt;   /**< NULL or salt_len bytes */
    size_t salt_len;
} ferry_kv_key;

/**
 * The key as a printable, stable string (what a remote or persistent tier
 * stores under): "ferry1:<model>:<rank>/<world>:<hash hex 32>[:<salt hex 16>]"
 * where the salt part is the XXH3-64 of the salt bytes. Writes at most len
 * bytes (NUL-terminated when len > 0); returns the length the full string
 * needs (excluding the NUL), like snprintf. Errors: -EINVAL (key or model NULL).
 */
FERRY_API int ferry_kv_key_format(const ferry_kv_key *key, char *buf, size_t len);

/* ---- layouts and buffers ---- */

/** The shape of the engine's KV cache for one TP rank. */
typedef struct ferry_kv_layout {
    size_t size;           /**< sizeof(ferry_kv_layout) */
    uint32_t num_layers;
    uint32_t kv;           /**< 2 (K and V) or 1 (one latent, MLA) */
    uint32_t num_heads;    /**< KV heads on this rank */
    uint32_t head_dim;
    int dtype;             /**< enum ferry_dtype (ferry/slab.h) */
} ferry_kv_layout;
/** Llama-3-8B: 32 layers, K and V, 8 KV heads, head_dim 128, bf16. */
#define FERRY_KV_LAYOUT_INIT \
    {FERRY_FIELD(size) sizeof(ferry_kv_layout), FERRY_FIELD(num_layers) 32, FERRY_FIELD(kv) 2, \
     FERRY_FIELD(num_heads) 8, FERRY_FIELD(head_dim) 128, FERRY_FIELD(dtype) FERRY_DTYPE_BF16}

/**
 * Bytes of one chunk of chunk_tokens tokens in layout l. Errors: -EINVAL
 * (NULL, a zero dimension, kv not 1 or 2, unknown dtype), -EOVERFLOW.
 */
FERRY_API int ferry_kv_layout_chunk_bytes(const ferry_kv_layout *l, uint32_t chunk_tokens,
                                          uint64_t *out);

enum ferry_kv_mem {
    FERRY_KV_MEM_HOST = 0,    /**< addresses are host pointers */
    FERRY_KV_MEM_DEVICE = 1   /**< addresses are ferry_devptr of the store's device */
};
enum ferry_kv_form {
    /** One tensor [kv][layers][capacity_tokens][heads*head_dim] at base. */
    FERRY_KV_CONTIGUOUS = 0,
    /**
     * Paged blocks, described by strides as DLPack and torch describe
     * tensors: for each (kv, layer) plane p a cache of num_blocks blocks at
     * block_bases[p] (p = kv * num_layers + layer); block b at
     * + b * block_stride, its row r (token t of the sequence lives in block
     * block_table[t / block_tokens] at row t % block_tokens) at
     * + r * token_stride, head h of that row at + h * head_stride, and the
     * head's head_dim elements one contiguous run. The defaults (0) are
     * vLLM's NHD blocks [block_tokens][heads][head_dim]: token_stride =
     * heads * head_dim * dtype size, head_stride = head_dim * dtype size,
     * block_stride = block_tokens * token_stride. Every layout of a paged
     * cache whose head_dim runs are contiguous is one choice of strides:
     *  - NHD [2][blocks][bt][heads][hd]: base K = t, base V = t + 1 plane;
     *  - HND [2][blocks][heads][bt][hd]: token_stride = hd, head_stride =
     *    bt * hd (elements; the fields are bytes);
     *  - FlashInfer [blocks][2][bt][heads][hd]: base V = base K + bt*heads*hd,
     *    block_stride = 2 * bt * heads * hd;
     *  - packed K|V [blocks][heads][bt][2*hd]: base V = base K + hd,
     *    token_stride = 2 * hd, head_stride = bt * 2 * hd;
     *  - MLA [blocks][bt][dim] (kv 1, one head); cross-layer blocks (one
     *    tensor for every layer): a base per plane.
     * The chunk images in the tiers are one canonical form whatever the
     * strides, so a prefix stored from one layout is retrieved into any
     * other. Strides that make two runs of one block overlap, or a block
     * overlap the next, are refused (-EINVAL naming the stride) before any
     * byte moves. Copies go one contiguous run at a time (rows of several
     * heads, or blocks back to back, are one run where the strides allow).
     */    FERRY_KV_PAGED = 1
};

/**
 * Where an engine's KV cache is: the source of a store, the destination of
 * a retrieve. Token t of the request is token t of the buffer.
 */
typedef struct ferry_kv_buffer {
    size_t size;                 /**< sizeof(ferry_kv_buffer) */
    ferry_kv_layout layout;      /**< must equal the store's: else FERRY_EMISMATCH */
    int mem;                     /**< enum ferry_kv_mem */
    int form;                    /**< enum ferry_kv_form */
    /* FERRY_KV_CONTIGUOUS */
    uint64_t base;               /**< host address ((uintptr_t)p) or ferry_devptr */
    uint64_t capacity_tokens;    /**< tokens the tensor holds */
    /* FERRY_KV_PAGED */
    const uint64_t *block_bases; /**< kv * num_layers addresses */
    uint32_t block_tokens;       /**< tokens per block (vLLM's block_size) */
    uint64_t block_stride;       /**< bytes between blocks; 0 = block_tokens * token bytes */
    uint64_t num_blocks;         /**< blocks in each cache (block ids must be below) */
    const int32_t *block_table;  /**< the sequence's block ids */
    size_t table_len;            /**< entries in block_table */
    /* grown after the first version: a paged buffer's strides in bytes (0: NHD's) */
    uint64_t token_stride;       /**< bytes between a block's rows */
    uint64_t head_stride;        /**< bytes between a row's heads */
} ferry_kv_buffer;
/** The smallest size a buffer may give: the first version's (up to
 *  table_len; a shorter buffer's strides are NHD's). */
#define FERRY_KV_BUFFER_MIN_SIZE \
    (offsetof(ferry_kv_buffer, table_len) + sizeof(size_t))
#define FERRY_KV_BUFFER_INIT \
    {FERRY_FIELD(size) sizeof(ferry_kv_buffer), FERRY_FIELD(layout) FERRY_KV_LAYOUT_INIT, \
     FERRY_FIELD(mem) FERRY_KV_MEM_HOST, FERRY_FIELD(form) FERRY_KV_CONTIGUOUS, \
     FERRY_FIELD(base) 0, FERRY_FIELD(capacity_tokens) 0, FERRY_FIELD(block_bases) NULL, \
     FERRY_FIELD(block_tokens) 0, FERRY_FIELD(block_stride) 0, FERRY_FIELD(num_blocks) 0, \
     FERRY_FIELD(block_table) NULL, FERRY_FIELD(table_len) 0, FERRY_FIELD(token_stride) 0, \
     FERRY_FIELD(head_stride) 0}

/* ---- the store ---- */

enum ferry_kv_policy {
    FERRY_KV_EVICT_LRU = 0,
    FERRY_KV_EVICT_S3FIFO = 1
};

/** Tiers, as reported per chunk by lookups and in metrics. */
enum ferry_kv_tier {
    FERRY_KV_TIER_NONE = 0,
    FERRY_KV_TIER_L1 = 1,       /**< host memory */
    FERRY_KV_TIER_L2 = 2,       /**< NVMe slab */
    FERRY_KV_TIER_REMOTE = 3,   /**< Redis/Valkey (remote_url) */
    FERRY_KV_TIERS = 4
};

#define FERRY_KV_WORKERS_MAX 256u

/* the remote tier's options (ferry/remote.h); kv.h needs only the name */
typedef struct ferry_remote_options ferry_remote_options;

typedef struct ferry_kv_config {
    size_t size;                 /**< sizeof(ferry_kv_config), or an older header's (a prefix) */
    const char *model;           /**< model name (part of every key); required */
    uint32_t tp_rank;            /**< tensor-parallel rank */
    uint32_t tp_world;           /**< tensor-parallel world size; 0 -> 1 */
    ferry_kv_layout layout;      /**< the engine's KV shape on this rank */
    uint32_t chunk_tokens;       /**< 0 -> 256 */
    uint64_t hash_seed;          /**< 0 -> FERRY_KV_HASH_SEED_DEFAULT */
    uint64_t l1_bytes;           /**< host pool: a chunk .. the memory the process may have */
    const char *l2_dir;          /**< NVMe slab directory, one per store (locked); NULL: no L2 */
    uint64_t l2_bytes;           /**< slab size (with l2_dir) */
    int l2_direct;               /**< O_DIRECT on the slab (falls back when refused) */
    const char *l2_engine;       /**< I/O engine for the slab: NULL/"auto", "posix", "uring" */
    int l1_policy;               /**< enum ferry_kv_policy */
    int l2_policy;
    double watermark;            /**< evict when usage >= this; 0 -> 0.8 */
    double evict_fraction;       /**< ... down to watermark - this; 0 -> 0.2 */
    uint32_t write_ttl_ms;       /**< 0 -> 600000 */
    uint32_t read_ttl_ms;        /**< 0 -> 300000 */
    ferry_device *device;        /**< for device buffers and a pinned L1; NULL: host only */
    uint64_t prefetch_max_bytes; /**< bound on prefetch bytes in flight; 0 -> l1_bytes / 4 */
    unsigned workers;            /**< threads for async ops and write-through; 0 -> 2; at most
                                      FERRY_KV_WORKERS_MAX */
    /**
     * 1: the L2 slab is persistent (ferry/pslab.h): chunks written through
     * before the store was closed (or the process died, once their write
     * was acknowledged) are found again by the next ferry_kv_open of the
     * same l2_dir with the same model, TP rank/world, layout and chunk size.
     * An existing slab keeps the size it was made with: an open with
     * another l2_bytes uses it as it is (a warning names both sizes);
     * l2_reset makes it anew, empty, at the size configured.
     */
    int l2_persistent;
    /**
     * The remote tier: a Redis/Valkey URL (ferry/remote.h's grammar), NULL:
     * none. ferry_kv_open connects (and fails when it cannot, unless
     * remote_options->flags has FERRY_REMOTE_LAZY).
     */
    const char *remote_url;
    /**
     * Options of the remote client (timeouts, backoff, write queue bounds,
     * TTL, connections, key_prefix, flags); NULL: the defaults. The store
     * supplies the layout fingerprint (options->layout is ignored) and,
     * when key_prefix is NULL, "ferry:kv:"; zero timeouts become 200 ms to
     * connect and 300 ms per socket read or write (the longest an engine
     * thread waits on a hung server, once per backoff period). Copied at
     * open.
     */
    const ferry_remote_options *remote_options;
    /** Remote-only chunks the index remembers at most; 0 -> 65536. */
    uint64_t remote_index_chunks;
    /**
     * With l2_persistent: 1 starts the persistent L2 empty, dropping what
     * l2_dir holds. 0 (the default) keeps it, and a persistent L2 made for
     * another layout, chunk size, hash seed, model or TP rank/world (the
     * slab records them) is refused with FERRY_EMISMATCH naming what
     * differs, its chunks left as they are (`ferry slab check DIR
     * --reset` empties it from the command line).
     */
    int l2_reset;
    /**
     * Mode of the files ferry creates for L2 (slab, journal, lock file):
     * 0 means 0600, directories 0700; otherwise read/write bits only, the
     * owner's included (0660 for a deliberate group: directories 0770).
     * Used by the persistent L2 and the non-persistent L2 slab alike.
     */
    unsigned l2_mode;
    /**
     * A `ferry serve` daemon to use instead of an in-process store:
     * "unix:/run/ferry/ferry.sock" (or a bare path). NULL: in-process.
     * Every ferry_kv_* call then works against the daemon (docs/PROTOCOL.md),
     * which owns the tiers: the tier fields above (l1_*, l2_*, remote_*,
     * policies, watermarks, TTLs, workers) are the daemon's business and
     * ignored here; model, TP rank/world, salt, layout, chunk size and hash
     * seed stay the client's (the layout, chunk size and seed must match the
     * daemon's: else FERRY_EMISMATCH). With l1_bytes 0 the client maps no
     * pool and may only look chunks up (a scheduler). A daemon that is
     * unreachable, dies or stops answering is FERRY_ECONN within
     * server_timeout_ms; the next call connects again. Through a server
     * a pin is held by the daemon for this store's connection (it brings
     * the chunk up to the daemon's L1) and ends with it: a reconnect
     * forgets the pins. One store's calls (and the asynchronous
     * operations, run on its workers) take turns on its one connection.
     * With device set, the mapped pool is registered with that device
     * (ferry_device_pin) for each connection and unregistered before it is
     * unmapped, so device buffers move by DMA between the engine's memory
     * and the slots; a refused registration is logged and copies go
     * unregistered.
     */
    const char *server;
    /** How long one round trip to the server may take; 0 -> 2000 ms. */
    uint32_t server_timeout_ms;
    /**
     * An L2 over several drives: l2_dirs[0..l2_n_dirs), one directory per
     * drive (at most FERRY_KV_L2_DIRS_MAX, each distinct), each holding
     * l2_bytes, with l2_dir NULL. The slab is striped across them (in 4 MiB
     * units, 1 MiB when persistent), so every chunk's reads and writes go
     * to all the drives at once, and each directory is locked as l2_dir is
     * (FERRY_EBUSY for one another store holds). A persistent L2 records
     * every directory's place: reopen it with the same directories in the
     * same order (another order, a missing directory or another count is
     * refused and nothing is changed; l2_reset starts it over). The loss of
     * one drive loses the whole L2 (every chunk has bytes on each). 0: the
     * L2 is l2_dir alone.
     */
    const char *const *l2_dirs;
    unsigned l2_n_dirs;
    /**
     * Back-pressure: how long a store or retrieve that finds every L1 slot
     * locked (held by writers, readers, pins or write-throughs in flight)
     * waits for one to free, in milliseconds, 0 to 60000; the
     * FERRY_KV_CONFIG_INIT default is FERRY_KV_POOL_WAIT_MS_DEFAULT. 0
     * declines at once: the chunk reports FERRY_ENOSPACE (a store that
     * placed nothing returns it). Waiters are served first come, first
     * served; a call waits only while it holds no slot of its own (so two
     * callers each holding part of the pool never wait for each other: one
     * proceeds, or both decline within the deadline), and a store longer
     * than what is free commits the chunks it placed and waits for the rest
     * (it streams through the pool in pieces that fit). Through a server the
     * daemon waits on this client's behalf, and each round trip may take
     * server_timeout_ms plus this. Outside 0 to 60000: -EINVAL at open.
     */
    int32_t pool_wait_ms;
} ferry_kv_config;
/** The default of ferry_kv_config.pool_wait_ms. */
#define FERRY_KV_POOL_WAIT_MS_DEFAULT 300
/** The longest ferry_kv_config.pool_wait_ms accepted. */
#define FERRY_KV_POOL_WAIT_MS_MAX 60000
/** Directories an L2 may stripe over. */
#define FERRY_KV_L2_DIRS_MAX 16u
#define FERRY_KV_CONFIG_INIT \
    {FERRY_FIELD(size) sizeof(ferry_kv_config), FERRY_FIELD(model) NULL, FERRY_FIELD(tp_rank) 0, \
     FERRY_FIELD(tp_world) 1, FERRY_FIELD(layout) FERRY_KV_LAYOUT_INIT, \
     FERRY_FIELD(chunk_tokens) 0, FERRY_FIELD(hash_seed) 0, FERRY_FIELD(l1_bytes) 0, \
     FERRY_FIELD(l2_dir) NULL, FERRY_FIELD(l2_bytes) 0, FERRY_FIELD(l2_direct) 1, \
     FERRY_FIELD(l2_engine) NULL, FERRY_FIELD(l1_policy) FERRY_KV_EVICT_LRU, \
     FERRY_FIELD(l2_policy) FERRY_KV_EVICT_LRU, FERRY_FIELD(watermark) 0, \
     FERRY_FIELD(evict_fraction) 0, FERRY_FIELD(write_ttl_ms) 0, FERRY_FIELD(read_ttl_ms) 0, \
     FERRY_FIELD(device) NULL, FERRY_FIELD(prefetch_max_bytes) 0, FERRY_FIELD(workers) 0, \
     FERRY_FIELD(l2_persistent) 0, FERRY_FIELD(remote_url) NULL, \
     FERRY_FIELD(remote_options) NULL, FERRY_FIELD(remote_index_chunks) 0, \
     FERRY_FIELD(l2_reset) 0, FERRY_FIELD(l2_mode) 0, FERRY_FIELD(server) NULL, \
     FERRY_FIELD(server_timeout_ms) 0, FERRY_FIELD(l2_dirs) NULL, FERRY_FIELD(l2_n_dirs) 0, \
     FERRY_FIELD(pool_wait_ms) FERRY_KV_POOL_WAIT_MS_DEFAULT}
/** The smallest size field ferry_kv_open takes: a config that ends at
 *  l1_bytes (what an L1-only store needs); the fields past a caller's size
 *  take their defaults, so a program built against an older header keeps
 *  working. */
#define FERRY_KV_CONFIG_MIN_SIZE (offsetof(ferry_kv_config, l1_bytes) + sizeof(uint64_t))

typedef struct ferry_kv ferry_kv;

/**
 * Open a store. Allocates the L1 pool (pinned through cfg->device when it
 * is set) and, with l2_dir, locks that directory and creates the slab
 * (ferry_gds_open). A pool that is not pinned is not faulted in by open:
 * open faults its first 8 MiB and a thread of the store the rest (about a
 * second for 8 GiB; the process's resident memory grows by the whole pool
 * then, as when open did it), while the store is already in use; a store
 * into a page the thread has not reached faults that page itself, and
 * close stops the thread within a step. The thread faults in only while
 * the host keeps a reserve of memory available (a 32nd of the memory the
 * process may have, 64 MiB to 4 GiB; a warning says where it stopped):
 * the pages past that are taken as chunks arrive. A pool larger than the
 * memory the process may have (the host's, or the lowest limit of its
 * cgroup and those above it where lower) could never be backed and is
 * refused, -ENOMEM naming both sizes; one larger than the memory
 * available at open is warned of (a cgroup's inactive page cache counts
 * as available: it is reclaimed before anything is killed). A pinned
 * pool is faulted in by the pinning, inside open. Errors: -EINVAL (NULL, no model, bad layout, l1_bytes
 * below one chunk, watermark or evict_fraction outside [0, 1] or NaN, a
 * fraction above the watermark, tp_rank not below tp_world, an unknown
 * policy, more than FERRY_KV_WORKERS_MAX workers, an empty l2_dir; l2_dirs
 * with l2_dir, NULL, empty or repeated entries, more than
 * FERRY_KV_L2_DIRS_MAX; with remote_url, a chunk over the remote's value
 * limit), FERRY_EBUSY (l2_dir is another open store's), FERRY_EMISMATCH (a
 * persistent L2 made for another layout, chunk size, hash seed, model or
 * TP rank/world; nothing is changed, see l2_reset), -ENOMEM, and the
 * slab's errors. *out owned by
 * the caller: ferry_kv_close().
 */
FERRY_API int ferry_kv_open(const ferry_kv_config *cfg, ferry_kv **out);
/**
 * Wait for the calls other threads are inside, every operation and
 * background write, then free the store and its tiers. A layerwise store
 * still lacking layers is abandoned (-ECANCELED, nothing of it committed),
 * before the other operations are waited for: one waiting for an L1 slot
 * such a store held takes it then.
 * Operations not yet freed stay valid handles: their wait, test, cancel,
 * wait_layer and free answer from the operation's end, layer_done answers
 * -ECANCELED; free them with ferry_kv_op_free before or after the close.
 * NULL does nothing. Call it once per store. In a forked child of the
 * process that opened the store it releases nothing (logs a warning): the
 * store's threads, L1 pool, files and connection are its opener's, and a
 * child opens a store of its own (its other calls on the store: see Fork
 * above).
 */
FERRY_API void ferry_kv_close(ferry_kv *kv);
/**
 * Begin closing the store, for an engine shutting down while other threads
 * are inside calls on it: ferry_kv_close() then waits milliseconds, not
 * the pool_wait_ms a call waiting for an L1 slot would wait out. It frees
 * nothing; ferry_kv_close() must still be called, once, after it.
 *
 * From its return on:
 * - calls on the store that begin are refused (FERRY_ESTATE, "the store
 *   is closing"), as once ferry_kv_close() began; calls on its
 *   operations (wait, layer_done, ...) go on as before until
 *   ferry_kv_close();
 * - every wait for an L1 slot (back-pressure, pool_wait_ms) ends at once,
 *   and no call waits for one again: in process, a store's, retrieve's,
 *   layerwise store's or asynchronous operation's wait in the pool's
 *   queue; through a server, a client's wait for the daemon's answer to a
 *   request that may wait for a slot (a reservation for a store, the
 *   promotion of a retrieve), which closes that connection (the daemon
 *   lets go of what it held) and connects no more. The call returns
 *   -ECANCELED with a message naming the close;
 * - such a call ends as a cancelled operation does (ferry_kv_op_cancel).
 *   A waiter holds no slot: a store's chunks committed before the wait
 *   stay stored, whole (req->status 0), and no byte of the rest is ever
 *   visible (-ECANCELED; through a server, a chunk whose commit had
 *   already been sent may be stored, whole, though it reports -ECANCELED).
 *   A retrieve reports only chunks it copied whole and verified
 *   (req->status 0); every other chunk's destination is untouched, or,
 *   where a server's bytes it could no longer vouch for had reached it
 *   (-ECANCELED), zeroed in a host buffer and left as copied in a device
 *   buffer (never reported loaded). No byte is written to an L1 or pool
 *   slot after that slot may be reused, nor into the caller's buffer
 *   after the call (an operation: its end) returned.
 * Calls that do not wait for a slot (copies, I/O, a lookup) finish as
 * they would; ferry_kv_close() waits for them. Layerwise operations
 * lacking layers are abandoned by ferry_kv_close(), as without this call.
 *
 * Thread-safety: any thread, while other threads are inside calls on the
 * store, as often as wanted, but never once ferry_kv_close() has begun
 * (the handle is freed then): the caller orders the two (the Python
 * package calls it inside its call guard). NULL does nothing; in a forked
 * child of the opener it does nothing (logs a warning). A program that
 * never calls it keeps ferry_kv_close()'s behaviour above: the calls
 * inside finish undisturbed.
 */
FERRY_API void ferry_kv_close_begin(ferry_kv *kv);
/**
 * The message of this store's last failure, "" if none, as the calling
 * thread's own copy: taken whole, it does not change while it is read
 * (valid until this thread's fourth next *_last_error call). With several
 * threads on one store it may be another thread's failure:
 * ferry_last_error() is the calling thread's own last failure.
 */
FERRY_API const char *ferry_kv_last_error(const ferry_kv *kv);
/** Bytes of one chunk of this store. */
FERRY_API uint64_t ferry_kv_chunk_bytes(const ferry_kv *kv);
/** Tokens per chunk of this store. */
FERRY_API uint32_t ferry_kv_chunk_tokens(const ferry_kv *kv);

enum ferry_kv_flags {
    /** Include a partial last chunk (fewer than chunk_tokens tokens). */
    FERRY_KV_PARTIAL = 1u << 0
};

/**
 * Per-request options and optional per-chunk results. NULL means: no salt,
 * no flags, no per-chunk results.
 */
typedef struct ferry_kv_req {
    size_t size;            /**< sizeof(ferry_kv_req) */
    const void *salt;       /**< cache salt (tenant); NULL or salt_len bytes */
    size_t salt_len;
    unsigned flags;         /**< enum ferry_kv_flags */
    /** Out, optional: per chunk, the tier it was found in (lookup) or
     *  FERRY_KV_TIER_NONE. max_chunks entries. */
    uint8_t *tiers;
    /** Out, optional: per chunk, 0 (stored/retrieved/already present) or
     *  the code that chunk failed with (FERRY_ENOTFOUND for a miss); a
     *  store or retrieve that fails before it reaches the chunks (the
     *  daemon gone) gives each of them its own code, never the array's
     *  old contents. */
    int *status;
    size_t max_chunks;      /**< entries in tiers/status */
    /**
     * Retrieve only: the leading tokens the engine already holds. Their
     * chunks are found (and checked) as for any retrieve and count in its
     * result, but no byte below this token is written into dst, so blocks
     * the engine shares with other requests stay untouched; a chunk that
     * straddles it is copied from this token on. 0: copy everything.
     * (Added after max_chunks: read only when size covers it.)
     */
    uint64_t skip_tokens;
} ferry_kv_req;
/** The smallest size a request may give: the first version's (up to max_chunks). */
#define FERRY_KV_REQ_MIN_SIZE (offsetof(ferry_kv_req, max_chunks) + sizeof(size_t))
#define FERRY_KV_REQ_INIT \
    {FERRY_FIELD(size) sizeof(ferry_kv_req), FERRY_FIELD(salt) NULL, FERRY_FIELD(salt_len) 0, \
     FERRY_FIELD(flags) 0, FERRY_FIELD(tiers) NULL, FERRY_FIELD(status) NULL, \
     FERRY_FIELD(max_chunks) 0, FERRY_FIELD(skip_tokens) 0}

/**
 * How many leading tokens of tokens[0..n) are cached (in whole chunks, plus
 * a partial last chunk with FERRY_KV_PARTIAL). req->tiers (if set) gets the
 * tier of each chunk looked at (the first miss gets NONE; later entries are
 * not written). Takes no locks: a chunk may be evicted before a retrieve
 * (pin it with ferry_kv_pin() to prevent that). With a remote tier, a
 * local miss costs one pipelined round trip to the server (none while it
 * is down: a miss at once); a chunk the remote has is reported as
 * FERRY_KV_TIER_REMOTE. Errors: -EINVAL (tokens NULL, n 0).
 */
FERRY_API int ferry_kv_lookup(ferry_kv *kv, const int32_t *tokens, size_t n,
                              const ferry_kv_req *req);

/**
 * Store the KV of tokens[0..n) from src (token t at src's token t). Chunks
 * already present are skipped (counted as stored); chunks another writer
 * is writing are skipped and not counted (their status FERRY_ELOCKED, and
 * ferry_kv_last_error says they were skipped; a layerwise store answers
 * the same). Chunks move in batches of at most half of L1, so a prompt
 * longer than L1 streams through it (to L2 when configured; without L2 its
 * first chunks are evicted by its last). A batch that finds every L1 slot
 * locked waits for its first slot up to cfg->pool_wait_ms, then takes what
 * is free; the rest goes in the next batch, after this one is committed.
 * Returns the number of leading tokens stored or already present. Stops at
 * the first chunk it cannot place
 * (memory exhausted, or no slot within the deadline: the chunk is declined
 * FERRY_ENOSPACE, nothing half-written becomes visible); req->status says
 * why per chunk. Errors: -EINVAL (tokens NULL,
 * n 0, bad buffer), FERRY_EMISMATCH (src->layout differs from the store's),
 * -ENOBUFS (src holds fewer tokens than n), FERRY_ENODEV (device memory
 * without a device), FERRY_ENOSPACE / -ENOMEM (not even the first chunk
 * could be placed: the message names the pool and what holds its slots,
 * through a server the clients holding them too), device copy errors. The
 * same through a server.
 */
FERRY_API int ferry_kv_store(ferry_kv *kv, const int32_t *tokens, size_t n,
                             const ferry_kv_req *req, const ferry_kv_buffer *src);

/**
 * Load the cached KV of tokens[0..n) into dst. Every chunk that is present
 * is copied (L2 hits are promoted to L1 first, except those read straight
 * into an aligned host dst: see "Direct reads" above; the L2 reads of later
 * chunks running ahead on the store's workers while earlier ones are
 * copied out); req->status gets 0 or FERRY_ENOTFOUND per chunk (a chunk
 * evicted since a lookup, or whose L2 read failed, is a miss: its bytes in
 * dst are not written), or FERRY_ENOSPACE (in L2, but every L1 slot stayed
 * locked for cfg->pool_wait_ms, so it could not be promoted; a chunk that
 * is there is never FERRY_ENOTFOUND for want of room). Returns the number of leading
 * tokens loaded. Errors: as ferry_kv_store (dst too small: -ENOBUFS),
 * device copy errors (the chunks of the failed window report the code).
 */
FERRY_API int ferry_kv_retrieve(ferry_kv *kv, const int32_t *tokens, size_t n,
                                const ferry_kv_req *req, const ferry_kv_buffer *dst);

/* ---- chunks named by the caller ---- */
/*
 * Engines that name their own pages (SGLang's HiCache names each page by a
 * SHA-256 of its tokens and prefix) store and find chunks by those names
 * instead of by token chains. A named chunk is any chunk from its id on:
 * the same tiers, checks, persistence, metrics and daemon; its id is a
 * hash of the name's bytes in the request's namespace (model, TP rank and
 * world, salt), in a domain of its own, so a name never finds a token
 * chain's chunk nor another model's. Chunk i of a call is tokens
 * [i * chunk_tokens, (i + 1) * chunk_tokens) of the buffer (a page of
 * chunk_tokens tokens). Counts are in chunks. req (may be NULL): salt,
 * status, tiers and max_chunks as for the token forms; FERRY_KV_PARTIAL
 * and skip_tokens are refused (-EINVAL): a named chunk is always whole.
 */
/** One chunk's name: len bytes at bytes (1 .. FERRY_KV_NAME_MAX). */
typedef struct ferry_kv_name {
    const void *bytes;
    size_t len;
} ferry_kv_name;
#define FERRY_KV_NAME_MAX 1024u
/**
 * Store chunks names[0..n) from src (as ferry_kv_store does each chunk:
 * skipped when present, FERRY_ELOCKED when another writer holds it).
 * Returns the leading chunks stored or present; req->status per chunk.
 * Errors: as ferry_kv_store (a store that placed no chunk:
 * FERRY_ENOSPACE), -EINVAL (a NULL or empty name, one longer than
 * FERRY_KV_NAME_MAX, n 0).
 */
FERRY_API int ferry_kv_store_named(ferry_kv *kv, const ferry_kv_name *names, size_t n,
                                   const ferry_kv_req *req, const ferry_kv_buffer *src);
/**
 * Load every chunk of names[0..n) that is cached into dst, as
 * ferry_kv_retrieve does (req->status: 0, FERRY_ENOTFOUND or
 * FERRY_ENOSPACE per chunk; a chunk not loaded leaves its tokens as they
 * were, or zeroed after a failed check). Returns the leading chunks
 * loaded. Errors: as ferry_kv_retrieve and ferry_kv_store_named.
 */
FERRY_API int ferry_kv_retrieve_named(ferry_kv *kv, const ferry_kv_name *names, size_t n,
                                      const ferry_kv_req *req, const ferry_kv_buffer *dst);
/** The leading chunks of names[0..n) that are cached (req->tiers per chunk). */
FERRY_API int ferry_kv_lookup_named(ferry_kv *kv, const ferry_kv_name *names, size_t n,
                                    const ferry_kv_req *req);
/**
 * ferry_kv_lookup_named of n names of name_len bytes each, back to back:
 * name i is bytes [i * name_len, (i + 1) * name_len) of names (SGLang's
 * page keys are all 64 bytes). The same chunks and ids as the array form,
 * without an array of ferry_kv_name to build: the call an engine's
 * per-page exists makes. names stays the caller's; nothing is kept after
 * the call. Errors: as ferry_kv_lookup_named (-EINVAL: names NULL, n 0,
 * name_len 0 or above FERRY_KV_NAME_MAX). Thread-safe.
 */
FERRY_API int ferry_kv_lookup_named_packed(ferry_kv *kv, const void *names, size_t name_len,
                                           size_t n, const ferry_kv_req *req);
/** Delete the named chunks: as ferry_kv_delete (returns the chunks deleted). */
FERRY_API int ferry_kv_delete_named(ferry_kv *kv, const ferry_kv_name *names, size_t n,
                                    const ferry_kv_req *req);

/* ---- asynchronous forms ---- */
typedef struct ferry_kv_op ferry_kv_op;

/**
 * Queue a store/retrieve on the store's workers. The tokens and salt are
 * hashed before the call returns (they may be reused at once); src/dst,
 * its block table and req's out-arrays must stay valid until the op
 * completes. Returns 0 and *op, to be freed with ferry_kv_op_free(). Errors
 * found before queueing: as the blocking forms, -ENOMEM.
 */
FERRY_API int ferry_kv_store_async(ferry_kv *kv, const int32_t *tokens, size_t n,
                                   const ferry_kv_req *req, const ferry_kv_buffer *src,
                                   ferry_kv_op **op);
FERRY_API int ferry_kv_retrieve_async(ferry_kv *kv, const int32_t *tokens, size_t n,
                                      const ferry_kv_req *req, const ferry_kv_buffer *dst,
                                      ferry_kv_op **op);
/**
 * Wait up to timeout_ms (-1: forever) for op. Returns its result (as the
 * blocking form would), or -ETIMEDOUT when still running. Thread-safe:
 * an op may be waited on, tested and cancelled from any number of threads
 * at once, and freed by its owner while those calls are still inside (it
 * is reference-counted: its memory goes when the last of them returns).
 * A call that begins after ferry_kv_op_free returned uses a freed handle.
 */
FERRY_API int ferry_kv_op_wait(ferry_kv_op *op, int timeout_ms);
/**
 * Stop op and wait until it no longer touches the caller's buffer: an op
 * still queued moves nothing; a running retrieve starts no new read and
 * copies no further chunk into dst (copies already under way finish, reads
 * in flight land in L1 and stay there; a chunk being read straight into dst
 * (direct reads, above) reads no further piece and its pieces in flight
 * are waited for: it is then either whole and checked, status 0, or its
 * destination tokens are zeroed (untouched if no read of it had started),
 * status -ECANCELED); a running store reads no further
 * batch from src (chunks already committed stay stored). Returns the op's
 * result: -ECANCELED when the cancel stopped it (req->status: 0 for each
 * chunk that was moved, -ECANCELED for each that was not), else what it
 * returned had it not been asked (it was done already). After it returns,
 * the engine may free or reuse the buffer at once. A layerwise retrieve
 * stops between layers (the layers copied before stay: they hold the
 * chunks' bytes), a layerwise store not yet at its last layer aborts its
 * reservations (nothing of it becomes visible). Through a server the op
 * stops between its batches (each at most a quarter of the daemon's pool:
 * reserved, copied and committed, or acquired, copied and released). The
 * op is still freed with ferry_kv_op_free.
 * Errors: -EINVAL (NULL). Thread-safe.
 */
FERRY_API int ferry_kv_op_cancel(ferry_kv_op *op);
/** ferry_kv_op_wait(op, 0) but -EAGAIN while running. */
FERRY_API int ferry_kv_op_test(ferry_kv_op *op);
/**
 * Wait for op if it is still running (a layerwise store still lacking
 * layers is abandoned: nothing of it commits), then free it. Calls other
 * threads are inside on op finish first. Valid before and after the close
 * of op's store. NULL does nothing; call it once per op.
 */
FERRY_API void ferry_kv_op_free(ferry_kv_op *op);

/* ---- layer by layer ---- */
/*
 * Engines overlap KV movement with compute a layer at a time: a retrieve
 * whose layer l is usable as soon as it landed, while later layers still
 * move (the engine runs layer l's attention meanwhile), and a store fed a
 * layer at a time as prefill computes it.
 *
 * A layerwise retrieve first holds every chunk it loads in L1 (promoted
 * from L2 or the remote tier, read-locked), then copies layer 0 of every
 * chunk, then layer 1, and so on. It loads the leading run of chunks
 * present (the first miss ends it; later chunks report FERRY_ENOTFOUND,
 * like the rest of a run cut short) and holds at most half of L1 at once
 * (chunks past that report FERRY_ENOSPACE). For a device buffer each
 * layer's copies are queued on one stream (opt->stream, else one of the
 * store's) followed by an event per layer; ferry_kv_op_stream_wait_layer
 * makes the engine's own stream wait for that event on the device, without
 * blocking the host once the layer's copies are queued.
 *
 * A layerwise store reserves, when it is made, the L1 slots of the chunks
 * in its window: at most a quarter of L1 (through a server, of the
 * daemon's pool), so that one long prefill does not hold the pool that
 * other writers need for as long as its layers take (chunks already
 * present are skipped, as ferry_kv_store skips them). The chunks past the
 * window take their layers into chunk images of the operation's own, in
 * this process's memory (pinned when src is on a device): as much memory
 * as those chunks' bytes, given back when the op ends. It takes layer l
 * from src when ferry_kv_op_layer_done(op, l, ...) says it is ready, in
 * any order. Its chunks stay invisible (lookups and retrieves miss them)
 * until every layer was copied: then the window's chunks are committed
 * together, and the staged ones are stored as ferry_kv_store stores them
 * (waiting for slots up to pool_wait_ms, in batches that fit, each chunk's
 * code in req->status), all written through to the lower tiers like any
 * store (with the lower tier's checksum). When this process has no memory
 * for the staged images, the chunks past the window report -ENOMEM and
 * the window's are stored. A store cancelled or freed before its last
 * layer, or whose process or server connection died, commits nothing and
 * gives its slots and images back.
 *
 * Both forms work through a server (cfg->server): the client copies each
 * layer into or out of the daemon's shared pool itself, on a connection of
 * the operation's own, so its reservations and locks end with it.
 */
typedef struct ferry_kv_layers_opt {
    size_t size;            /**< sizeof(ferry_kv_layers_opt) */
    /**
     * Device buffers: the stream ferry queues its copies on (an engine's
     * transfer stream, e.g. from ferry_stream_import, used only by this
     * operation while it runs); NULL: one of the store's own.
     */
    ferry_stream *stream;
    uint32_t flags;         /**< reserved: 0 */
} ferry_kv_layers_opt;
/** The smallest size an options struct may give: up to stream. */
#define FERRY_KV_LAYERS_OPT_MIN_SIZE (offsetof(ferry_kv_layers_opt, stream) + sizeof(void *))
#define FERRY_KV_LAYERS_OPT_INIT \
    {FERRY_FIELD(size) sizeof(ferry_kv_layers_opt), FERRY_FIELD(stream) NULL, \
     FERRY_FIELD(flags) 0}

/**
 * Start a layerwise retrieve of tokens[0..n) into dst (opt may be NULL).
 * Returns 0 and *op at once; the chunks are found, held and copied on the
 * store's workers. ferry_kv_op_wait(op) returns what ferry_kv_retrieve
 * would (the leading tokens loaded; req->status per chunk), once every
 * layer landed and the chunks were let go. Errors before starting: as
 * ferry_kv_retrieve_async, -EINVAL (a bad opt).
 */
FERRY_API int ferry_kv_retrieve_layers(ferry_kv *kv, const int32_t *tokens, size_t n,
                                       const ferry_kv_req *req, const ferry_kv_buffer *dst,
                                       const ferry_kv_layers_opt *opt, ferry_kv_op **op);
/**
 * Wait up to timeout_ms (-1: forever) until layer `layer` of a layerwise
 * retrieve is in dst (device buffers: its copies completed). Returns the
 * leading tokens it holds for that layer (the same for every layer; 0
 * when nothing was cached), -ETIMEDOUT, or the code that stopped the
 * operation before that layer (-ECANCELED after a cancel, a copy error).
 * Layers may be waited for in any order and more than once. Errors:
 * -EINVAL (NULL, layer >= num_layers), FERRY_ESTATE (op is not a
 * layerwise retrieve).
 */
FERRY_API int ferry_kv_op_wait_layer(ferry_kv_op *op, uint32_t layer, int timeout_ms);
/**
 * Make the engine's stream wait, on the device, for layer `layer` of a
 * layerwise retrieve into a device buffer: waits on the host (up to
 * timeout_ms) only until that layer's copies are queued, then queues a
 * wait for their event on stream (ferry_stream_wait_event), so the
 * engine's later work on stream starts after the layer landed. Returns as
 * ferry_kv_op_wait_layer. Errors: as ferry_kv_op_wait_layer, -EINVAL
 * (stream NULL or of another device), FERRY_ESTATE (a host buffer: use
 * ferry_kv_op_wait_layer).
 */
FERRY_API int ferry_kv_op_stream_wait_layer(ferry_kv_op *op, uint32_t layer,
                                            ferry_stream *stream, int timeout_ms);
/**
 * Start a layerwise store of tokens[0..n) from src (opt may be NULL):
 * reserves its window's L1 slots now (a store through a server: in the
 * daemon's pool) and images for the chunks past it, and returns 0 and
 * *op. The layers then come through
 * ferry_kv_op_layer_done. ferry_kv_op_wait(op) returns what ferry_kv_store
 * would, once the last layer was copied and the chunks committed; asked
 * while layers are still missing it answers FERRY_ESTATE at once (it
 * would wait for calls that only the caller can make), as does
 * ferry_kv_op_test; the op goes on and still takes its layers. Errors before
 * starting: as ferry_kv_store_async, FERRY_ENOSPACE / -ENOMEM (not even
 * the first new chunk could be reserved or staged), -EINVAL (a bad opt).
 */
FERRY_API int ferry_kv_store_layers(ferry_kv *kv, const int32_t *tokens, size_t n,
                                    const ferry_kv_req *req, const ferry_kv_buffer *src,
                                    const ferry_kv_layers_opt *opt, ferry_kv_op **op);
/**
 * Layer `layer` of src is ready: copy it into the store's slots. Host
 * buffers are read before the call returns. Device buffers: stream is the
 * engine's stream that computes the layer; the copies are queued after
 * the work already queued on it (an event recorded there, which ferry's
 * copy stream waits for on the device), so the call does not block; NULL
 * stream: src is ready now. After the last layer the chunks are committed
 * on the store's workers. Returns 0. Errors: -EINVAL (NULL, layer >=
 * num_layers, a stream of another device), FERRY_ESTATE (op is not a
 * layerwise store, or that layer was done already), -ECANCELED (the op
 * was cancelled), copy errors (the op then fails and commits nothing).
 */
FERRY_API int ferry_kv_op_layer_done(ferry_kv_op *op, uint32_t layer, ferry_stream *stream);

/**
 * Bring the leading chunks of tokens that are only in L2 (or the remote
 * tier, asked as a lookup asks it) up to L1 in the background, up to cfg->prefetch_max_bytes in flight (chunks beyond the
 * bound are not queued). Returns the number of leading tokens that are in
 * L1 or on their way. Errors: -EINVAL.
 */
FERRY_API int ferry_kv_prefetch(ferry_kv *kv, const int32_t *tokens, size_t n,
                                const ferry_kv_req *req);

/**
 * Read-lock the leading cached chunks of tokens so that no eviction or
 * delete takes them (until ferry_kv_unpin() or the read TTL). Returns the
 * number of leading tokens pinned. ferry_kv_unpin() drops one pin from
 * each of the leading pinned chunks and returns the tokens unpinned.
 */
FERRY_API int ferry_kv_pin(ferry_kv *kv, const int32_t *tokens, size_t n,
                           const ferry_kv_req *req);
FERRY_API int ferry_kv_unpin(ferry_kv *kv, const int32_t *tokens, size_t n,
                             const ferry_kv_req *req);

/**
 * Delete the chunks of tokens from every tier. Returns the number of
 * chunks deleted (from at least one tier). A chunk that is locked (pinned,
 * being read or written) is left in place and the call returns
 * FERRY_ELOCKED after deleting the others. With a remote tier the chunks'
 * server copies are deleted too (one pipelined round trip); while the
 * remote is down they stay there, and a write-through of the same chunk
 * still queued may land after the delete.
 */
FERRY_API int ferry_kv_delete(ferry_kv *kv, const int32_t *tokens, size_t n,
                              const ferry_kv_req *req);
/** Delete every unlocked chunk from the local tiers (the remote tier's
 *  server copies stay: other stores may share them). Returns the number
 *  deleted, or FERRY_ELOCKED when locked chunks remain (the others are
 *  deleted). */
FERRY_API int ferry_kv_clear(ferry_kv *kv);
/** Wait until every queued op, write-through and prefetch is done and,
 *  with a remote tier, every write-through queued for the server was
 *  written or dropped (each write bounded by the remote's timeouts). A
 *  prefetch is done once it landed in L1 or was dropped with its L1 slot
 *  and read-ahead budget given back; that includes read-ahead a daemon
 *  withdrew for a client that left (its drop may be under way in another
 *  thread when flush is called), so stats and tier usage read after flush
 *  returns count every one of them. */
FERRY_API int ferry_kv_flush(ferry_kv *kv);
/** ferry_kv_flush(), then, with a persistent L2 (l2_persistent), make
 *  every chunk written through so far durable: the slab's group commit
 *  (slab fdatasync, journal append, journal fdatasync) of what its
 *  write-throughs queued. Returns the number of chunks written through
 *  to the persistent L2 since the previous ferry_kv_sync (or the open)
 *  that are durable now and still there (a write-through that failed, or
 *  a chunk evicted again before the commit, is not counted; chunks stored
 *  by other threads during the call may be), so a caller that stored n
 *  new chunks and gets n knows all of them are durable. 0 without a
 *  persistent L2, where there is nothing more to do. Errors: those of
 *  ferry_kv_flush, or the commit's (the persistent L2 then refuses
 *  further write-throughs until the store is reopened; see
 *  docs/DURABILITY.md). */
FERRY_API int ferry_kv_sync(ferry_kv *kv);

/* ---- metrics ---- */
#define FERRY_KV_HIST_BUCKETS 40   /**< bucket b counts latencies in [2^b, 2^(b+1)) ns */

typedef struct ferry_kv_tier_stats {
    uint64_t hits;             /**< chunks found in this tier by lookups and retrieves */
    uint64_t evictions;        /**< chunks evicted from it */
    uint64_t bytes_written;    /**< into this tier */
    uint64_t bytes_read;       /**< out of it */
    uint64_t used_bytes;       /**< now */
    uint64_t capacity_bytes;
    uint64_t chunks;           /**< resident now */
    double usage;              /**< used / capacity */
    uint64_t failures;         /**< allocation or I/O failures in this tier */
} ferry_kv_tier_stats;

/*
 * Through a server (cfg->server) the counters are the daemon's store's, all
 * its clients together, but for stores, retrieves, store_ns and
 * retrieve_ns: those are this client's own calls and their latency, as the
 * client timed them. The daemon sees its clients' chunks (reservations,
 * commits, acquisitions, lookups), not their calls: their chunks count in
 * its stored_chunks, retrieved_chunks, misses and byte counters, and the
 * daemon's own stores and retrieves (`ferry serve status`, its metrics)
 * count only calls made on its own store (ferry_serve_kv).
 */
typedef struct ferry_kv_stats {
    size_t size;               /**< set by the caller: sizeof(ferry_kv_stats) */
    uint64_t lookups;          /**< lookup calls */
    uint64_t lookup_tokens;    /**< tokens asked about */
    uint64_t hit_tokens;       /**< tokens found */
    uint64_t stores;           /**< store calls */
    uint64_t stored_chunks;    /**< chunks written (not counting ones already present) */
    uint64_t stored_bytes;
    uint64_t retrieves;        /**< retrieve calls */
    uint64_t retrieved_chunks;
    uint64_t retrieved_bytes;
    uint64_t misses;           /**< chunks asked of retrieve and not found */
    uint64_t prefetched_chunks;
    uint64_t deleted_chunks;
    uint64_t failures;         /**< calls or chunks that failed (any cause) */
    uint64_t alloc_failures;   /**< stores declined for lack of memory */
    uint64_t lock_expired;     /**< locks ignored after their TTL */
    uint64_t chunks;           /**< chunks in the index now */
    ferry_kv_tier_stats tier[FERRY_KV_TIERS]; /**< index by enum ferry_kv_tier */
    uint64_t lookup_ns[FERRY_KV_HIST_BUCKETS];
    uint64_t store_ns[FERRY_KV_HIST_BUCKETS];
    uint64_t retrieve_ns[FERRY_KV_HIST_BUCKETS];
    /* the remote tier (all 0 without one); tier[FERRY_KV_TIER_REMOTE] has
     * its hits (chunks lookups and retrieves found only there), bytes, the
     * remote-resident chunks the index remembers (chunks, used_bytes; usage
     * is their share of remote_index_chunks) and capacity_bytes 0 (the
     * server's is not known here) */
    uint64_t remote_lookups;       /**< round trips asking which chunks the remote has */
    uint64_t remote_lookup_chunks; /**< chunks asked about */
    uint64_t remote_found_chunks;  /**< chunks it had (a leading run of those asked) */
    uint64_t remote_puts;          /**< write-throughs queued for the remote */
    uint64_t remote_put_bytes;     /**< their payload bytes */
    uint64_t remote_written;       /**< values the server acknowledged */
    uint64_t remote_dropped;       /**< write-throughs dropped (remote down, queue full) */
    uint64_t remote_gets;          /**< chunk fetches */
    uint64_t remote_get_bytes;     /**< payload bytes fetched and verified */
    uint64_t remote_misses;        /**< fetches that found nothing (gone, or remote down) */
    uint64_t remote_refused;       /**< values refused (by a fetch or a lookup's header check):
                                        other layout or key, corrupt, newer format */
    uint64_t remote_errors;        /**< transport failures and error replies */
    uint64_t remote_degraded;      /**< remote calls answered at once because it was down */
    uint32_t remote_down;          /**< 1 while the remote is marked down */
    /** chunks read from L2 or the remote whose key or checksum did not match
     *  what was stored: each became a miss (and lost that copy), never bytes */
    uint64_t corrupt_chunks;
    /** chunks moved between device buffers and L1, and the device driver
     *  calls that moved them: a chunk's runs go in one batched copy where
     *  the driver has one (calls / chunks = 1), else one call per run */
    uint64_t device_chunks;
    uint64_t device_copy_calls;
    /** back-pressure (ferry_kv_config.pool_wait_ms): waits for an L1 slot
     *  (each time a call found every slot locked and waited), the time
     *  spent in them (microseconds), and the declines (a call that found
     *  no slot within its deadline, or at once with a deadline of 0) */
    uint64_t pool_waits;
    uint64_t pool_wait_us;
    uint64_t pool_declines;
    /** where the CPU of retrieves from L2 goes, in CPU microseconds (the
     *  threads' own CPU time): checking the chunks read from L2 against
     *  their checksums, and copying them out into host buffers (a whole
     *  chunk checked while it is copied counts as copy). The rest (submitting
     *  and reaping reads, the index, copies of L1 hits) is the process's
     *  CPU time less these two. */
    uint64_t retrieve_check_us;
    uint64_t retrieve_copy_us;
    /** per retrieve that read from L2: the time from its start until the
     *  first bytes of its first such chunk, checked, are in the engine's
     *  buffer (first_bytes), and until that whole chunk is (first_chunk),
     *  with the sums of those times in ns (a mean over a span of calls) */
    uint64_t retrieve_first_bytes_ns[FERRY_KV_HIST_BUCKETS];
    uint64_t retrieve_first_chunk_ns[FERRY_KV_HIST_BUCKETS];
    uint64_t retrieve_first_bytes_sum_ns;
    uint64_t retrieve_first_chunk_sum_ns;
    /** the sums in ns of lookup_ns, store_ns and retrieve_ns's latencies
     *  (a mean over a span of calls; through a server, from the same
     *  counters as their histograms: the daemon's lookups, the client's
     *  own stores and retrieves) */
    uint64_t lookup_sum_ns;
    uint64_t store_sum_ns;
    uint64_t retrieve_sum_ns;
} ferry_kv_stats;

#define FERRY_KV_STATS_INIT \
    {FERRY_FIELD(size) sizeof(ferry_kv_stats), FERRY_FIELD(lookups) 0, \
     FERRY_FIELD(lookup_tokens) 0, FERRY_FIELD(hit_tokens) 0, FERRY_FIELD(stores) 0, \
     FERRY_FIELD(stored_chunks) 0, FERRY_FIELD(stored_bytes) 0, FERRY_FIELD(retrieves) 0, \
     FERRY_FIELD(retrieved_chunks) 0, FERRY_FIELD(retrieved_bytes) 0, FERRY_FIELD(misses) 0, \
     FERRY_FIELD(prefetched_chunks) 0, FERRY_FIELD(deleted_chunks) 0, FERRY_FIELD(failures) 0, \
     FERRY_FIELD(alloc_failures) 0, FERRY_FIELD(lock_expired) 0, FERRY_FIELD(chunks) 0, \
     FERRY_FIELD(tier) {{0, 0, 0, 0, 0, 0, 0, 0, 0}}, FERRY_FIELD(lookup_ns) {0}, \
     FERRY_FIELD(store_ns) {0}, FERRY_FIELD(retrieve_ns) {0}, FERRY_FIELD(remote_lookups) 0, \
     FERRY_FIELD(remote_lookup_chunks) 0, FERRY_FIELD(remote_found_chunks) 0, \
     FERRY_FIELD(remote_puts) 0, FERRY_FIELD(remote_put_bytes) 0, FERRY_FIELD(remote_written) 0, \
     FERRY_FIELD(remote_dropped) 0, FERRY_FIELD(remote_gets) 0, FERRY_FIELD(remote_get_bytes) 0, \
     FERRY_FIELD(remote_misses) 0, FERRY_FIELD(remote_refused) 0, FERRY_FIELD(remote_errors) 0, \
     FERRY_FIELD(remote_degraded) 0, FERRY_FIELD(remote_down) 0, FERRY_FIELD(corrupt_chunks) 0, \
     FERRY_FIELD(device_chunks) 0, FERRY_FIELD(device_copy_calls) 0, \
     FERRY_FIELD(pool_waits) 0, FERRY_FIELD(pool_wait_us) 0, FERRY_FIELD(pool_declines) 0, \
     FERRY_FIELD(retrieve_check_us) 0, FERRY_FIELD(retrieve_copy_us) 0, \
     FERRY_FIELD(retrieve_first_bytes_ns) {0}, FERRY_FIELD(retrieve_first_chunk_ns) {0}, \
     FERRY_FIELD(retrieve_first_bytes_sum_ns) 0, FERRY_FIELD(retrieve_first_chunk_sum_ns) 0, \
     FERRY_FIELD(lookup_sum_ns) 0, FERRY_FIELD(store_sum_ns) 0, FERRY_FIELD(retrieve_sum_ns) 0}

/**
 * A snapshot of the store's counters, as every ferry_<object>_stats_get:
 * the caller sets out->size (sizeof(ferry_kv_stats) of its header, e.g.
 * with FERRY_KV_STATS_INIT) and only that many bytes are written, so a
 * program built against an older, smaller ferry_kv_stats keeps working;
 * out->size is left as the caller set it. Errors: -EINVAL (NULL, or
 * out->size not set).
 */
FERRY_API int ferry_kv_stats_get(const ferry_kv *kv, ferry_kv_stats *out);
/**
 * The q-quantile (0..1) of a latency histogram, in nanoseconds (the upper
 * edge of the bucket it falls in, interpolated); 0 when the histogram is empty.
 */
FERRY_API double ferry_kv_hist_quantile(const uint64_t hist[FERRY_KV_HIST_BUCKETS], double q);
/**
 * The same counters as Prometheus text exposition (ferry_kv_* families, tier
 * labels, histograms in seconds). Writes at most len bytes, NUL-terminated
 * when len > 0; returns the length of the whole text (like snprintf), or
 * -EINVAL.
 */
FERRY_API int ferry_kv_metrics_prometheus(ferry_kv *kv, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
