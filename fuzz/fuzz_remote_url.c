/*
 * fuzz_remote_url.c - the remote tier's URL parser on arbitrary bytes.
 *
 * Checks beyond "no crash": a URL is accepted only with a port in
 * 1..65535 (or a unix path starting with '/'), NUL-terminated fields, a
 * db in range, and a redacted form that hides the password (checked where
 * the URL has no %-escapes and the password occurs once); a refusal is
 * FERRY_EPARSE or FERRY_ENOTSUP with a message.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "remote/remote_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ferry__rurl u;
    ferry__errbuf eb;
    memset(&eb, 0, sizeof eb);
    int rc = ferry__rurl_parse((const char *)data, size, &u, &eb);
    if (rc != 0) {
        if ((rc != FERRY_EPARSE && rc != FERRY_ENOTSUP) || eb.msg[0] == 0)
            abort();
        return 0;
    }
    if (memchr(u.host, 0, sizeof u.host) == NULL || memchr(u.path, 0, sizeof u.path) == NULL ||
        memchr(u.user, 0, sizeof u.user) == NULL ||
        memchr(u.password, 0, sizeof u.password) == NULL ||
        memchr(u.redacted, 0, sizeof u.redacted) == NULL)
        abort();
    if (u.is_unix ? u.path[0] != '/' : (u.port < 1 || u.port > 65535 || u.host[0] == 0))
        abort();
    if (u.db < 0 || u.db > (1 << 24))
        abort();
    if (u.cluster < -1 || u.cluster > 1)
        abort();
    if (u.has_password && !strstr(u.redacted, "***"))
        abort();
    /* without %-escapes the password is written as itself; when it occurs
     * exactly once in the URL, that occurrence is the password and the
     * redacted form must not show it */
    size_t pl = strlen(u.password);
    if (u.has_password && pl >= 4 && !memchr(data, '%', size) && !strpbrk(u.password, "*\\")) {
        size_t occ = 0;
        for (size_t i = 0; i + pl <= size; i++)
            if (!memcmp(data + i, u.password, pl))
                occ++;
        if (occ == 1 && strstr(u.redacted, u.password))
            abort();
    }
    return 0;
}
