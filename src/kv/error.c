/*
 * error.c - a store's last failure, for either backend: the message goes
 * on the store (ferry_kv_last_error) and the calling thread
 * (ferry_last_error), under the store's err_mu; a NULL store (an op whose
 * store has closed) keeps the thread's only.
 */
#include <stdarg.h>

#include "kv/kv_impl.h"

int ferry__kv_err(ferry_kv *kv, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (!kv) { /* an op whose store closed: the thread's message only */
        int rc = ferry__err_vset(NULL, code, fmt, ap);
        va_end(ap);
        return rc;
    }
    pthread_mutex_lock(&kv->err_mu);
    int rc = ferry__err_vset(&kv->err, code, fmt, ap);
    pthread_mutex_unlock(&kv->err_mu);
    va_end(ap);
    return rc;
}

int ferry__kv_err_pass(ferry_kv *kv, int code)
{
    if (!kv)
        return code;
    pthread_mutex_lock(&kv->err_mu);
    int rc = ferry__err_pass(&kv->err, code);
    pthread_mutex_unlock(&kv->err_mu);
    return rc;
}
