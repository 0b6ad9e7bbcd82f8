/*
 * serve_file.c - the daemon's configuration file for a program that embeds
 * the daemon (ferry/serve.h, ferry_serve_file_load): the very reader
 * `ferry serve --config` uses (serve_config.c), the environment's
 * FERRY_<KEY> over it when asked, then a ferry_serve_config ready for
 * ferry_serve_open whose strings and arrays the file handle owns. The
 * socket is read as the CLI reads it: unix:PATH is PATH, tcp:// or any
 * other scheme is refused (never bound as a file of that name), and what
 * the CLI refuses in a daemon's config (a client's keys, an allowed uid
 * without a group) is refused with the same message.
 */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "core.h"
#include "ferry/serve.h"
#include "serve/serve_config.h"

struct ferry_serve_file {
    ferry__serve_conf c;
    ferry_serve_config sc;
};

int ferry_serve_file_load(const char *path, int env, ferry_serve_file **out)
{
    if (!path || !out)
        return ferry__err_set(NULL, -EINVAL, "serve file load: path or out is NULL");
    if (access(path, R_OK) != 0)
        return ferry__err_set(NULL, -errno, "serve file %s: %s", path, strerror(errno));
    ferry_serve_file *f = ferry__calloc(1, sizeof *f);
    if (!f)
        return ferry__err_set(NULL, -ENOMEM, "serve file %s: out of memory", path);
    ferry__serve_conf_init(&f->c);
    char err[512];
    if (ferry__serve_conf_load(&f->c, path, err, sizeof err) < 0 ||
        (env && ferry__serve_conf_env(&f->c, err, sizeof err) < 0) ||
        ferry__serve_conf_finish(&f->c, err, sizeof err) < 0 ||
        ferry__serve_conf_daemon(&f->c, err, sizeof err) < 0 ||
        ferry__serve_conf_socket(&f->c, err, sizeof err) < 0) {
        ferry_serve_file_free(f);
        return ferry__err_set(NULL, -EINVAL, "%s", err);
    }
    ferry_serve_config sc = FERRY_SERVE_CONFIG_INIT;
    sc.socket_path = f->c.socket;
    sc.group = f->c.group;
    sc.allow_uids = f->c.nallow ? f->c.allow : NULL;
    sc.n_allow_uids = f->c.nallow;
    sc.max_clients = (unsigned)f->c.max_clients;
    sc.send_timeout_ms = (uint32_t)f->c.send_timeout_ms;
    sc.kv = &f->c.kv;
    f->sc = sc;
    *out = f;
    return 0;
}

const ferry_serve_config *ferry_serve_file_config(const ferry_serve_file *f)
{
    return f ? &f->sc : NULL;
}

const char *ferry_serve_file_metrics(const ferry_serve_file *f)
{
    return f ? f->c.metrics : NULL;
}

void ferry_serve_file_free(ferry_serve_file *f)
{
    if (!f)
        return;
    ferry__serve_conf_free(&f->c);
    ferry__free(f);
}
