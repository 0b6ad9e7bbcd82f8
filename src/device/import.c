/*
 * import.c - streams and events the engine made, used by ferry without
 * being owned by it (ferry_stream_import, ferry_event_import): the
 * backend fills the handle in, the front tracks the wrapper for close and
 * marks it imported so destroy frees only the wrapper.
 */
#include <errno.h>
#include <pthread.h>

#include "device/device_impl.h"

/* a failure, recorded on the device (under its lock) and the thread */
static int fail(ferry_device *dev, int code, const char *what, const char *why)
{
    pthread_mutex_lock(&dev->lock);
    if (why)
        ferry__err_set(&dev->err, code, "device %s: %s import: %s", dev->ops->name, what, why);
    else
        ferry__err_pass(&dev->err, code);
    pthread_mutex_unlock(&dev->lock);
    return code;
}

int ferry_stream_import(ferry_device *dev, uint64_t handle, ferry_stream **out)
{
    if (!dev || !out)
        return ferry__err_set(NULL, -EINVAL, "stream import: %s is NULL", dev ? "out" : "dev");
    if (!dev->ops->stream_import)
        return fail(dev, FERRY_ENOTSUP, "stream", "this backend has no engine streams to wrap");
    ferry_stream *s = ferry__calloc(1, sizeof *s);
    if (!s)
        return fail(dev, -ENOMEM, "stream", "out of memory");
    s->dev = dev;
    s->imported = 1;
    int rc = dev->ops->stream_import(dev, s, handle);
    if (rc < 0) {
        ferry__free(s);
        return fail(dev, rc, NULL, NULL);
    }
    ferry__dev_track_stream(dev, s);
    *out = s;
    return 0;
}

int ferry_event_import(ferry_device *dev, uint64_t handle, ferry_event **out)
{
    if (!dev || !out)
        return ferry__err_set(NULL, -EINVAL, "event import: %s is NULL", dev ? "out" : "dev");
    if (!dev->ops->event_import)
        return fail(dev, FERRY_ENOTSUP, "event", "this backend has no engine events to wrap");
    ferry_event *e = ferry__calloc(1, sizeof *e);
    if (!e)
        return fail(dev, -ENOMEM, "event", "out of memory");
    e->dev = dev;
    e->imported = 1;
    int rc = dev->ops->event_import(dev, e, handle);
    if (rc < 0) {
        ferry__free(e);
        return fail(dev, rc, NULL, NULL);
    }
    ferry__dev_track_event(dev, e);
    *out = e;
    return 0;
}
