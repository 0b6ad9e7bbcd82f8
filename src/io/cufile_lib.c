/*
 * cufile_lib.c - libraries shaped like cuFile, loaded once per process.
 *
 * Invariant: each library (cuFile: ferry__cufile_lib_nv; hipFile: the GDS
 * hipfile driver's own) is dlopened at most once per process, on first
 * use, and never unloaded; its driver is opened (DriverOpen) by the first
 * user and closed (DriverClose) after the last, whether the users are
 * cufile I/O engines, GDS contexts or both. Why: cuFile keeps per-process
 * state behind DriverOpen (its registered buffers and handles among it),
 * and two loaders, each opening and closing the driver on its own, closed
 * it under the other's feet.
 *
 * Everything goes through one function table per library, which a test
 * replaces with fakes (ferry__cufile_set_api, ferry__gdsdl_set_api): that
 * is how the cufile engine and the GDS drivers are tested on machines
 * without a GPU. Calls a library lacks are NULL in the table (async and
 * stream calls before cuFile 1.7, the batch API); each user decides what
 * it cannot do without.
 *
 * Fork: a library's mu is the process's and is held across its dlopen and
 * across DriverOpen / DriverClose, so a fork while another thread is in
 * one of them would leave it locked in the child, whose first cufile
 * probe, I/O engine or GDS context would wait on it forever. Each library
 * is listed on its first use (lib_lock), and a child handler
 * (pthread_atfork, registered before the first is listed) gives the child
 * a fresh list_mu and a fresh mu for every listed library; a load or a
 * driver open in progress publishes nothing until it ends (real_rc, refs),
 * so the child finds it not tried and does it itself. Nothing is taken
 * before a fork: a fork never waits for a DriverOpen (seconds, and a
 * driver that forks from inside it must not deadlock on its own lock).
 * Lock order: list_mu before any library's mu; nothing takes list_mu
 * holding a mu.
 *
 * Also here: the text and ferry code of every cuFile error number.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "cufile_api.h"

static const char *const nv_sonames[] = {"libcufile.so.0", "libcufile.so", NULL};
ferry__cufile_lib ferry__cufile_lib_nv = FERRY__CUFILE_LIB_INIT("cuFile", nv_sonames);

/* ---- error numbers ---- */
static const struct {
    int err;
    const char *text;
} cf_errs[] = {
    {0, "success"},
    {5001, "driver not initialized"},
    {5002, "invalid driver properties"},
    {5003, "driver property limit not supported"},
    {5004, "driver version mismatch"},
    {5005, "driver version read error"},
    {5006, "driver is closing"},
    {5007, "platform not supported"},
    {5008, "I/O not supported (file system or device)"},
    {5009, "device not supported"},
    {5010, "nvidia-fs driver ioctl error"},
    {5011, "CUDA driver error"},
    {5012, "invalid CUDA device pointer"},
    {5013, "invalid CUDA memory type"},
    {5014, "CUDA pointer range error"},
    {5015, "CUDA context mismatch"},
    {5016, "access beyond the maximum pinned size"},
    {5017, "access beyond the mapped size"},
    {5018, "unsupported file type"},
    {5019, "unsupported file open flags"},
    {5020, "file not opened with O_DIRECT"},
    {5021, "invalid value"},
    {5022, "invalid value"},
    {5023, "memory already registered"},
    {5024, "memory not registered"},
    {5025, "permission denied"},
    {5026, "driver already open"},
    {5027, "file handle not registered"},
    {5028, "file handle already registered"},
    {5029, "GPU device not found"},
    {5030, "internal error"},
    {5031, "failed to obtain a new file descriptor"},
    {5033, "nvidia-fs setup error"},
    {5034, "I/O disabled by configuration"},
    {5035, "batch submit failed"},
    {5036, "GPU memory pinning failed"},
    {5037, "batch full"},
    {5038, "async I/O not supported"},
    {5039, "I/O max error"},
};

const char *ferry__cufile_strerror(int err)
{
    if (err < 0)
        err = -err;
    for (size_t i = 0; i < FERRY__ARRAY_LEN(cf_errs); i++)
        if (cf_errs[i].err == err)
            return cf_errs[i].text;
    return err > 5000 && err < 6000 ? "unknown cuFile error" : "not a cuFile error";
}

int ferry__cufile_code(int err)
{
    if (err < 0)
        err = -err;
    switch (err) {
    case 0:
        return 0;
    case 5001: case 5007: case 5029:
        return FERRY_ENODEV;
    case 5008: case 5009: case 5018: case 5034: case 5038:
        return FERRY_ENOTSUP;
    case 5012: case 5013: case 5014: case 5016: case 5017:
        return -EFAULT;
    case 5019: case 5020: case 5021: case 5022:
        return -EINVAL;
    case 5023: case 5026: case 5028:
        return FERRY_EEXIST;
    case 5024: case 5027:
        return FERRY_ESTATE;
    case 5025:
        return -EACCES;
    case 5036:
        return -ENOMEM;
    default:
        return FERRY_EDRIVER;
    }
}

int ferry__cufile_ret_code(ssize_t ret, int saved_errno)
{
    if (ret >= 0)
        return 0;
    if (ret == -1)
        return -(saved_errno ? saved_errno : EIO);
    return ferry__cufile_code((int)-ret);
}


/* ---- the library ---- */

static pthread_mutex_t list_mu = PTHREAD_MUTEX_INITIALIZER;
static ferry__cufile_lib *g_listed; /* through next_listed, newest first */
static pthread_once_t list_once = PTHREAD_ONCE_INIT;

/* the child of a fork: one thread; list_mu and any library's mu perhaps
 * held by a thread it does not have, each given a fresh one (a library
 * listed is so before its mu is first taken). A load or a driver open the
 * fork cut short left real_rc at 1 and refs at 0: the child's own, when
 * it wants one */
static void fork_child(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    list_mu = fresh;
    for (ferry__cufile_lib *l = g_listed; l; l = l->next_listed)
        l->mu = fresh;
}

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, fork_child);
}

/* l->mu, l listed for the fork handlers first */
static void lib_lock(ferry__cufile_lib *l)
{
    if (!atomic_load_explicit(&l->listed, memory_order_acquire)) {
        pthread_once(&list_once, register_atfork);
        pthread_mutex_lock(&list_mu);
        if (!atomic_load_explicit(&l->listed, memory_order_relaxed)) {
            l->next_listed = g_listed;
            /* linked before it is the head: a fork's child walks the list
             * without list_mu ordering the two (fork_child) */
            atomic_thread_fence(memory_order_release);
            g_listed = l;
            atomic_store_explicit(&l->listed, 1, memory_order_release);
        }
        pthread_mutex_unlock(&list_mu);
    }
    pthread_mutex_lock(&l->mu);
}

void ferry__cufile_lib_set_api(ferry__cufile_lib *l, const ferry__cufile_api *api)
{
    lib_lock(l);
    l->test_api = api;
    l->refs = 0;
    pthread_mutex_unlock(&l->mu);
}

void ferry__cufile_set_api(const ferry__cufile_api *api)
{
    ferry__cufile_lib_set_api(&ferry__cufile_lib_nv, api);
}

const ferry__cufile_api *ferry__cufile_lib_test_api(ferry__cufile_lib *l)
{
    lib_lock(l);
    const ferry__cufile_api *a = l->test_api;
    pthread_mutex_unlock(&l->mu);
    return a;
}

/* the symbols of the table: prefix + suffix; a missing required one
 * makes the library unusable */
static const struct {
    size_t off;
    const char *suffix;
    int required;
} lib_syms[] = {
    {offsetof(ferry__cufile_api, DriverOpen), "DriverOpen", 1},
    {offsetof(ferry__cufile_api, HandleRegister), "HandleRegister", 1},
    {offsetof(ferry__cufile_api, HandleDeregister), "HandleDeregister", 1},
    {offsetof(ferry__cufile_api, BufRegister), "BufRegister", 1},
    {offsetof(ferry__cufile_api, BufDeregister), "BufDeregister", 1},
    {offsetof(ferry__cufile_api, Read), "Read", 1},
    {offsetof(ferry__cufile_api, Write), "Write", 1},
    {offsetof(ferry__cufile_api, ReadAsync), "ReadAsync", 0},
    {offsetof(ferry__cufile_api, WriteAsync), "WriteAsync", 0},
    {offsetof(ferry__cufile_api, StreamRegister), "StreamRegister", 0},
    {offsetof(ferry__cufile_api, StreamDeregister), "StreamDeregister", 0},
    {offsetof(ferry__cufile_api, BatchIOSetUp), "BatchIOSetUp", 0},
    {offsetof(ferry__cufile_api, BatchIOSubmit), "BatchIOSubmit", 0},
    {offsetof(ferry__cufile_api, BatchIOGetStatus), "BatchIOGetStatus", 0},
    {offsetof(ferry__cufile_api, BatchIOCancel), "BatchIOCancel", 0},
    {offsetof(ferry__cufile_api, BatchIODestroy), "BatchIODestroy", 0},
};

static void *lib_sym(void *h, const char *prefix, const char *suffix)
{
    char name[96];
    snprintf(name, sizeof name, "%s%s", prefix, suffix);
    return dlsym(h, name);
}

/* dlopen the first soname that opens and resolve the table (caller holds mu) */
static int load_real(ferry__cufile_lib *l)
{
    void *h = NULL;
    const char *so = NULL;
    char tried[200] = "";
    for (const char *const *s = l->sonames; *s && !h; s++) {
        h = dlopen(*s, RTLD_NOW | RTLD_LOCAL);
        if (h) {
            so = *s;
        } else {
            const char *e = dlerror();
            size_t n = strlen(tried);
            snprintf(tried + n, sizeof tried - n, "%s%s", n ? "; " : "", e ? e : *s);
        }
    }
    if (!h) {
        snprintf(l->why, sizeof l->why, "%s not found: %s", l->sonames[0], tried);
        return FERRY_ENODEV;
    }
    ferry__cufile_api *a = &l->real;
    memset(a, 0, sizeof *a);
    for (size_t i = 0; i < FERRY__ARRAY_LEN(lib_syms); i++) {
        void *p = lib_sym(h, l->prefix, lib_syms[i].suffix);
        if (!p && lib_syms[i].required) {
            snprintf(l->why, sizeof l->why, "%s lacks %s%s (too old?)", so, l->prefix,
                     lib_syms[i].suffix);
            dlclose(h);
            return FERRY_ENODEV;
        }
        memcpy((char *)a + lib_syms[i].off, &p, sizeof p);
    }
    void *close_fn = lib_sym(h, l->prefix, "DriverClose_v2");
    if (!close_fn)
        close_fn = lib_sym(h, l->prefix, "DriverClose");
    memcpy(&a->DriverClose, &close_fn, sizeof close_fn);
    a->allow_host_device = 0;
    return 0; /* h stays open for the life of the process */
}

const ferry__cufile_api *ferry__cufile_lib_api(ferry__cufile_lib *l, char *why, size_t why_len)
{
    lib_lock(l);
    const ferry__cufile_api *a = l->test_api;
    if (!a) {
        if (l->real_rc == 1) {
            int rc = load_real(l);
            /* the table whole before real_rc says so (fork_child) */
            atomic_thread_fence(memory_order_release);
            l->real_rc = rc;
        }
        a = l->real_rc == 0 ? &l->real : NULL;
        if (!a && why)
            snprintf(why, why_len, "%s", l->why);
    }
    pthread_mutex_unlock(&l->mu);
    return a;
}

int ferry__cufile_lib_open(ferry__cufile_lib *l, const ferry__cufile_api *a,
                           ferry__CUfileError_t *e)
{
    lib_lock(l);
    e->err = 0;
    e->cu_err = 0;
    if (l->refs == 0)
        *e = a->DriverOpen();
    if (e->err == 0)
        l->refs++;
    pthread_mutex_unlock(&l->mu);
    return e->err == 0 ? 0 : FERRY_EDRIVER;
}

void ferry__cufile_lib_close(ferry__cufile_lib *l, const ferry__cufile_api *a,
                             ferry__CUfileError_t *e)
{
    lib_lock(l);
    e->err = 0;
    e->cu_err = 0;
    if (l->refs && --l->refs == 0 && a->DriverClose)
        *e = a->DriverClose();
    pthread_mutex_unlock(&l->mu);
}
