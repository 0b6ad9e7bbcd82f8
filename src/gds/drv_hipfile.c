/*
 * drv_hipfile.c - the "hipfile" GDS driver: AMD hipFile (ROCm's GPU I/O
 * library), libhipfile.so loaded with dlopen when a context opens it.
 * hipFile mirrors cuFile one to one (hipFileRead for cuFileRead, the same
 * flags and return convention), so the calls are gdsdl.c's; this file
 * names the library and the symbol prefix.
 */
#include "driver.h"

static const char *const hipfile_libs[] = {"libhipfile.so", "libhipfile.so.0", NULL};
static const ferry__gdsdl_spec hipfile_spec = {"hipfile", hipfile_libs, "hipFile"};

int ferry__gds_hipfile_driver(ferry_gds_driver *out, ferry__gds_destroy_fn *destroy)
{
    return ferry__gdsdl_driver(&hipfile_spec, out, destroy);
}
