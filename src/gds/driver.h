/*
 * driver.h - the GDS drivers ferry ships (private).
 *
 * The table itself (ferry_gds_driver) is public, in ferry/gds.h, so a test
 * or a vendor can supply one. The shipped drivers are built here, one per
 * file: drv_cpu.c (ferry's I/O engines and the bounce path), drv_cufile.c
 * and drv_hipfile.c (thin specs over gdsdl.c, which loads any library
 * shaped like cuFile with dlopen and resolves its symbols by prefix:
 * hipFile mirrors cuFile one to one). Each file defines one
 * ferry__gds_backend (name, probe, constructor); gds_driver.c lists them
 * in one table, so adding a driver is adding a file and a table row.
 *
 * Contract of a builtin: the constructor fills *out (ctx allocated) and
 * *destroy; the context calls out->open once, out->close iff open
 * succeeded, then destroy(ctx) always. A call the loaded library lacks
 * (async and stream calls before cuFile 1.7, the batch API) returns
 * FERRY_ENOTSUP, and the context falls back (stream sync + synchronous
 * I/O, one I/O at a time, no stream registration).
 */
#ifndef FERRY_SRC_GDS_DRIVER_H
#define FERRY_SRC_GDS_DRIVER_H

#include <stddef.h>

#include "core.h"
#include "ferry/gds.h"

typedef void (*ferry__gds_destroy_fn)(void *ctx);

struct ferry__gdsdl_spec;

/* one shipped driver: a row of the table in gds_driver.c */
typedef struct ferry__gds_backend {
    const char *name; /* what ferry_gds_config.driver names: "cufile" */
    /* "auto" tries this driver with dev when probe says 1 (a cheap check:
     * the device's backend, a test's fake library; nothing is loaded).
     * NULL: never tried by auto (the cpu driver is auto's last resort) */
    int (*probe)(ferry_device *dev);
    /* the constructor: fills *out (ctx allocated) and *destroy */
    int (*make)(ferry_gds_driver *out, ferry__gds_destroy_fn *destroy);
    /* a cuFile-shaped library's spec (tests install fakes by name); or NULL */
    const struct ferry__gdsdl_spec *dl;
} ferry__gds_backend;

extern const ferry__gds_backend ferry__gds_backend_cpu;
extern const ferry__gds_backend ferry__gds_backend_cufile;
extern const ferry__gds_backend ferry__gds_backend_hipfile;

/* the shipped driver named name, or NULL */
const ferry__gds_backend *ferry__gds_backend_find(const char *name);

/*
 * cufile and hipfile share one implementation (gdsdl.c) over the cuFile
 * function table of src/io/cufile_api.h (hipFile mirrors it one to one):
 * the library is dlopened and every symbol resolved by prefix ("cuFile" +
 * "Read", "hipFile" + "Read") by the I/O layer's loader (io/cufile_lib.c),
 * once per process: cuFile's library is the one the cufile I/O engine
 * uses (ferry__cufile_lib_nv), so both share one load and one DriverOpen. Error numbers are translated with the I/O
 * layer's ferry__cufile_code(), messages name them with
 * ferry__cufile_strerror().
 */
struct ferry__cufile_api;
struct ferry__cufile_lib;

typedef struct ferry__gdsdl_spec {
    const char *driver_name;       /* "cufile" */
    struct ferry__cufile_lib *lib; /* sonames, symbol prefix, the loader's state */
} ferry__gdsdl_spec;

int ferry__gdsdl_driver(const ferry__gdsdl_spec *spec, ferry_gds_driver *out,
                        ferry__gds_destroy_fn *destroy);
/* a backend's probe: 1 when dev is a cuda device, or a test table with
 * allow_host_device is installed for this library */
int ferry__gdsdl_probe(const ferry__gdsdl_spec *spec, ferry_device *dev);

/*
 * Tests: make the driver named driver_name ("cufile" or "hipfile") use
 * this function table instead of loading its library (NULL restores the
 * library). "cufile" installs it for the cufile I/O engine too (one
 * library, one table: ferry__cufile_set_api). The table must outlive the contexts opened while installed.
 * allow_host_device lets the driver run against the host device backend,
 * and makes "auto" try it there.
 */
void ferry__gdsdl_set_api(const char *driver_name, const struct ferry__cufile_api *api);

#endif
