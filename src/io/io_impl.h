/*
 * io_impl.h - the private contract between the I/O front (io.c) and its
 * engines (posix.c, uring.c, cufile.c) and the CPU bounce path (bounce.c).
 *
 * The front owns everything a user sees: validation, splitting requests at
 * max_request, continuing short transfers, retrying EINTR/EAGAIN, error
 * messages, the pending and done queues. An engine only moves "parts": one
 * contiguous range, one syscall's worth (pread, an SQE, a cuFile batch
 * entry), and reports the raw result (bytes or -errno) without judging it.
 * That split keeps every engine small and makes fault handling identical
 * across engines: a test that injects a short read through the syscall or
 * completion seam exercises the same continuation code for all of them.
 *
 * Parts come from a fixed pool of `slots` per engine (depth, or what the
 * engine asks for), allocated at open: submit and reap never allocate.
 */
#ifndef FERRY_SRC_IO_IMPL_H
#define FERRY_SRC_IO_IMPL_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "core.h"
#include "ferry/io.h"
#include "live_table.h"

typedef struct ferry__part {
    struct ferry__part *next; /* free list, engine queues */
    ferry_io_req *parent;
    ferry_file *file;
    int op;                   /* FERRY_IO_READ / FERRY_IO_WRITE */
    int fd;
    char *buf;                /* host memory at the current position; NULL for device */
    ferry_devptr dev;         /* device memory at the current position */
    size_t len;               /* bytes still to move */
    uint64_t off;             /* file offset of the current position */
    size_t done;              /* bytes moved so far */
    unsigned retries;         /* consecutive EINTR/EAGAIN/zero results */
    int64_t res;              /* set by the engine: bytes or -errno/-FERRY_E* */
    uint64_t eng[4];          /* the engine's own */
    /* a vectored read (FERRY_IO_READV): its pieces (buf is the first's),
     * the whole request in one part; NULL for any other */
    const struct iovec *iov;
    unsigned niov;
} ferry__part;

typedef struct ferry__io_ops {
    const char *name;
    size_t default_max_request;
    /* parts with iov (vectored reads) are read with one preadv / READV */
    int vec;
    /* parts the engine can hold in flight for a given depth */
    unsigned (*slots)(unsigned depth);
    int (*init)(ferry_io *io);
    void (*fini)(ferry_io *io);
    /* the fd is open; the engine may register it or set f->fallback */
    int (*file_open)(ferry_io *io, ferry_file *f);
    void (*file_close)(ferry_io *io, ferry_file *f);
    /* host buffer registration; NULL: accepted and ignored */
    int (*buf_register)(ferry_io *io, void *buf, size_t len);
    int (*buf_unregister)(ferry_io *io, void *buf);
    /* device buffer registration (cufile); NULL: accepted and ignored */
    int (*dev_register)(ferry_io *io, ferry_devptr p, size_t len);
    int (*dev_unregister)(ferry_io *io, ferry_devptr p);
    /* whether parts with device memory can go to this engine for file f */
    int (*dev_ok)(ferry_io *io, const ferry_file *f);
    /*
     * Start n parts. Returns how many were taken (the front fails the rest
     * with the error it records) or a negative code when none were.
     */
    int (*submit)(ferry_io *io, ferry__part **parts, unsigned n);
    /*
     * Wait until at least min parts completed (timeout_ms: -1 forever, 0
     * poll) and return up to max of them with res set. Returns the count
     * (0 on timeout) or a negative code when the engine itself broke.
     */
    int (*wait)(ferry_io *io, ferry__part **out, unsigned min, unsigned max, int timeout_ms);
    /*
     * Device memory <-> file without bounce (cufile). NULL, or a return of
     * FERRY_ENOTSUP, sends the transfer to the CPU bounce path.
     */
    int (*dev_rw)(ferry_io *io, ferry_file *f, ferry_stream *s, int op, ferry_devptr p, size_t len,
                  uint64_t off);
} ferry__io_ops;

struct ferry__bounce;

struct ferry_io {
    const ferry__io_ops *ops;
    void *eng;
    ferry__errbuf err;
    char reason[512];
    unsigned depth;
    size_t max_request;
    size_t bounce_bytes;
    ferry_device *device;
    /* part pool */
    ferry__part *parts;
    unsigned nparts;
    ferry__part *free_parts;
    unsigned parts_busy;
    ferry__part **scratch;      /* nparts pointers for engine calls */
    /* requests: pending (not fully dispatched) and done (not reaped) */
    ferry_io_req *pend_head, *pend_tail;
    ferry_io_req *done_head, *done_tail;
    unsigned ndone;
    unsigned inflight;          /* submitted and not reaped (user requests) */
    unsigned nfiles;
    struct ferry__bounce *bounce;
};

struct ferry_file {
    ferry_io *io;
    char *path;
    int fd;
    unsigned flags;             /* FERRY_FILE_* as opened */
    int direct;                 /* O_DIRECT in effect */
    int gds;                    /* cufile: handle registered, device parts go by DMA */
    int slot;                   /* uring: fixed-file index, or -1 */
    void *eng;                  /* engine's per-file state (cuFile handle) */
    char fallback[384];         /* empty when no fallback happened */
};

/*
 * A submitted request's private words (ferry_io_req.priv_): io.c's queues
 * and live.c's table of requests in flight. 32 bytes, all of priv_, so
 * sizes are packed: a piece is a multiple of FERRY_IO_ALIGN of at most
 * FERRY_IO_REQUEST_MAX, and a request has at most the engine's parts
 * (slots(FERRY_IO_DEPTH_MAX) <= 2 * FERRY_IO_DEPTH_MAX) outstanding.
 */
typedef struct ferry__rq {
    ferry_io_req *next;   /* io.c: the pending or done list */
    ferry__live_node live; /* live.c: its link in the table, from submit until reaped;
                            * written only under that chain's lock */
    uint64_t cursor;      /* bytes handed to parts */
    unsigned piece_pg : 20; /* split size in FERRY_IO_ALIGN pages */
    unsigned flags : 4;     /* io.c's RQ_* */
    uint16_t outstanding; /* parts in the engine */
    uint16_t pad;         /* RQ_EOF_OK: bytes at the end that may lie past EOF */
} ferry__rq;
_Static_assert(sizeof(ferry__rq) <= sizeof(((ferry_io_req *)0)->priv_), "ferry__rq fits priv_");
_Static_assert(FERRY_IO_REQUEST_MAX / FERRY_IO_ALIGN < (1u << 20), "a piece fits piece_pg");
_Static_assert(2u * FERRY_IO_DEPTH_MAX <= UINT16_MAX, "outstanding parts fit 16 bits");

static inline ferry__rq *ferry__rq_of(ferry_io_req *r)
{
    return (ferry__rq *)(void *)r->priv_;
}

/*
 * The process's table of requests submitted through ferry_io_submit and
 * not yet reaped (live.c), keyed by the request's address. take is one
 * look-up-and-insert: 1 when r was taken (it is in the table now), 0 when
 * it was there already (in flight on some engine; nothing written). held
 * says whether r is there; drop takes a request that take took out.
 * Each walks one chain of requests, a few long at hundreds of thousands
 * in the table.
 */
int ferry__io_live_take(ferry_io_req *r);
int ferry__io_live_held(const ferry_io_req *r);
void ferry__io_live_drop(ferry_io_req *r);
/* test seam: the longest chain a take or drop walks now (a scan of all) */
unsigned ferry__io_live_longest(void);

/* engines */
extern const ferry__io_ops ferry__io_posix_ops;
extern const ferry__io_ops ferry__io_uring_ops;
extern const ferry__io_ops ferry__io_cufile_ops;

/* probes (really try); 0 or a negative code with why[] filled */
int ferry__uring_probe(char *why, size_t why_len);
int ferry__cufile_probe(char *why, size_t why_len);

/*
 * The front's synchronous transfer, used by the helpers, the bounce path
 * (host memory: buf) and the cufile engine (device memory: buf NULL, dev):
 * splits into pieces so `depth` are in flight. When
 * min_len < len (a read padded for O_DIRECT), reaching end of file after
 * min_len bytes is success.
 */
int ferry__io_rw(ferry_io *io, ferry_file *f, int op, void *buf, ferry_devptr dev, size_t len,
                 uint64_t off, size_t min_len);

/*
 * The same in two halves: start queues the transfer in r (the caller's,
 * untouched until finish returns) and returns at once; finish drives the
 * engine until r is done and returns 0 or its error. Every started request
 * must be finished before r or its buffer goes away.
 */
int ferry__io_start(ferry_io *io, ferry_io_req *r, ferry_file *f, int op, void *buf,
                    ferry_devptr dev, size_t len, uint64_t off, size_t min_len);
/* start with requests of piece bytes each (rounded up to FERRY_IO_ALIGN,
 * at most the engine's largest; 0: the engine's choice, as start), so
 * several transfers started one after another share the engine's depth
 * in order instead of the first one taking all of it */
int ferry__io_start_piece(ferry_io *io, ferry_io_req *r, ferry_file *f, int op, void *buf,
                          ferry_devptr dev, size_t len, uint64_t off, size_t min_len,
                          size_t piece);
int ferry__io_finish(ferry_io *io, ferry_io_req *r);

/* the CPU path for device memory (bounce.c) */
int ferry__bounce_rw(ferry_io *io, ferry_file *f, ferry_stream *s, int op, ferry_devptr p,
                     size_t len, uint64_t off);
void ferry__bounce_free(ferry_io *io);
/* test seam: bounce buffer k (0 or 1), NULL before the first transfer */
void *ferry__bounce_buffer(const ferry_io *io, int k);

/* the file's description for messages: "file PATH" */
const char *ferry__op_name(int op);

/* posix engine pieces the cufile engine reuses for host memory and
 * fallback files (its CPU side) */
int ferry__posix_create(ferry_io *io, unsigned threads, void **out);
void ferry__posix_destroy(void *st);
int ferry__posix_submit(void *st, ferry__part **parts, unsigned n);
int ferry__posix_wait(void *st, ferry__part **out, unsigned min, unsigned max, int timeout_ms);
unsigned ferry__posix_busy(void *st);

#endif
