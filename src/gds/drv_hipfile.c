/*
 * drv_hipfile.c - the "hipfile" GDS driver: AMD hipFile (ROCm's GPU I/O
 * library), libhipfile.so loaded with dlopen when a context opens it.
 * hipFile mirrors cuFile one to one (hipFileRead for cuFileRead, the same
 * flags and return convention), so the calls are gdsdl.c's; this file
 * names the library and the symbol prefix.
 */
#include "driver.h"
#include "io/cufile_api.h"

static const char *const hipfile_libs[] = {"libhipfile.so", "libhipfile.so.0", NULL};
static ferry__cufile_lib hipfile_lib = FERRY__CUFILE_LIB_INIT("hipFile", hipfile_libs);
static const ferry__gdsdl_spec hipfile_spec = {"hipfile", &hipfile_lib};

static int hipfile_probe(ferry_device *dev)
{
    return ferry__gdsdl_probe(&hipfile_spec, dev);
}

static int hipfile_make(ferry_gds_driver *out, ferry__gds_destroy_fn *destroy)
{
    return ferry__gdsdl_driver(&hipfile_spec, out, destroy);
}

const ferry__gds_backend ferry__gds_backend_hipfile = {"hipfile", hipfile_probe, hipfile_make,
                                                      &hipfile_spec};
