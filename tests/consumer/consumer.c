/* consumer.c - a program built against the installed libferry, as C and as
 * C++, through pkg-config and through the CMake package. */
#include <ferry.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    if (strcmp(ferry_version(), FERRY_VERSION_STRING) != 0) {
        fprintf(stderr, "version mismatch: %s vs %s\n", ferry_version(), FERRY_VERSION_STRING);
        return 1;
    }
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *dev = NULL;
    int rc = ferry_device_open(&o, &dev);
    if (rc < 0) {
        fprintf(stderr, "open: %s\n", ferry_strerror(rc));
        return 1;
    }
    ferry_devptr p = 0;
    rc = ferry_device_alloc(dev, 4096, &p);
    if (rc == 0)
        rc = ferry_device_free(dev, p);
    ferry_device_close(dev);
    printf("consumer ok: ferry %s, %s\n", ferry_version(), rc == 0 ? "alloc ok" : "alloc failed");
    return rc == 0 ? 0 : 1;
}
