/*
 * sized.c - structs versioned by their leading size field
 * (docs/ARCHITECTURE.md, Conventions).
 *
 * Options: a caller built against an older header passes a prefix of
 * this header's struct; the members past its size keep their defaults.
 * Stats: a snapshot is written only as far as the caller's header knows.
 */
#include <errno.h>
#include <string.h>

#include "core.h"
#include "sized.h"

int ferry__opts_take(ferry__errbuf *eb, const char *what, void *dst, size_t full,
                     const void *src, size_t min, const ferry__member *members, size_t n)
{
    size_t s;
    memcpy(&s, src, sizeof s);
    const char *cut = NULL;
    for (size_t i = 0; i < n && !cut; i++)
        if (s > members[i].off && s < members[i].end)
            cut = members[i].name;
    if (s < min || s > full || cut)
        return ferry__err_set(eb, -EINVAL,
                              "%s size %zu is not accepted: an older header's struct (a prefix "
                              "of at least %zu bytes, the first version's) up to this "
                              "library's %zu, ending between members%s%s",
                              what, s, min, full, cut ? ", not inside " : "", cut ? cut : "");
    memcpy(dst, src, s);
    memcpy(dst, &full, sizeof full);
    return 0;
}

int ferry__stats_put(ferry__errbuf *eb, const char *what, void *out, const void *snap,
                     size_t full)
{
    size_t s;
    memcpy(&s, out, sizeof s);
    if (s < sizeof s)
        return ferry__err_set(eb, -EINVAL,
                              "%s: out->size %zu is not set (this library's struct is %zu "
                              "bytes; set out->size to your header's sizeof)",
                              what, s, full);
    if (s > full)
        s = full;
    memcpy((char *)out + sizeof s, (const char *)snap + sizeof s, s - sizeof s);
    return 0;
}
