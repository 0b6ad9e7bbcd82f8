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
#include "env.h"
#include "sized.h"

/* the member s ends inside, or NULL */
static const char *cut_member(const ferry__sized *d, size_t s)
{
    for (size_t i = 0; i < d->n_later; i++)
        if (s > d->later[i].off && s < d->later[i].end)
            return d->later[i].name;
    return NULL;
}

int ferry__opts_size_fits(const ferry__sized *d, size_t s)
{
#ifndef NDEBUG
    /* the list names every member past the minimum: no gap wider than
     * padding (a member added to a struct but not to its list) */
    size_t at = d->min;
    for (size_t i = 0; i < d->n_later; i++) {
        FERRY__ASSERT(d->later[i].off >= at && d->later[i].off - at < sizeof(void *));
        at = d->later[i].end;
    }
    FERRY__ASSERT(d->full >= at && d->full - at < sizeof(void *));
#endif
    return s >= d->min && s <= d->full && !cut_member(d, s);
}

int ferry__opts_size_ok(ferry__errbuf *eb, const char *what, const ferry__sized *d, size_t s)
{
    if (ferry__opts_size_fits(d, s))
        return 0;
    const char *cut = cut_member(d, s);
    return ferry__err_set(eb, -EINVAL,
                          "%s: %s size %zu is not accepted: accepted %zu (%s) to %zu (its sizeof "
                          "here), an older header's struct ending between two members%s%s",
                          what, d->type, s, d->min, d->min_name, d->full,
                          cut ? ", not inside " : "", cut ? cut : "");
}

int ferry__opts_take(ferry__errbuf *eb, const char *what, const ferry__sized *d, void *dst,
                     const void *src)
{
    /* every open passes here: the first one warns of the library's
     * environment variables it would otherwise ignore (env.c) */
    ferry__env_check();
    size_t s;
    memcpy(&s, src, sizeof s);
    int rc = ferry__opts_size_ok(eb, what, d, s);
    if (rc < 0)
        return rc;
    memcpy(dst, src, s);
    memcpy(dst, &d->full, sizeof d->full);
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
