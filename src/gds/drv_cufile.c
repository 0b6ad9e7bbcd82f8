/*
 * drv_cufile.c - the "cufile" GDS driver: NVIDIA cuFile (GPUDirect
 * Storage), libcufile.so.0 loaded with dlopen when a context first opens
 * it (by the I/O layer's loader, shared with the cufile I/O engine).
 * The calls themselves are gdsdl.c's, shared with hipFile; this file only
 * names the library and the prefix of its symbols, so that the driver
 * list stays one file per backend.
 */
#include "driver.h"
#include "io/cufile_api.h"

/* the library the cufile I/O engine loads: one load, one DriverOpen */
static const ferry__gdsdl_spec cufile_spec = {"cufile", &ferry__cufile_lib_nv};

static int cufile_probe(ferry_device *dev)
{
    return ferry__gdsdl_probe(&cufile_spec, dev);
}

static int cufile_make(ferry_gds_driver *out, ferry__gds_destroy_fn *destroy)
{
    return ferry__gdsdl_driver(&cufile_spec, out, destroy);
}

const ferry__gds_backend ferry__gds_backend_cufile = {"cufile", cufile_probe, cufile_make,
                                                      &cufile_spec};
