/*
 * cmd_info.c - `ferry info [--json] [--dir DIR [--create]]`: what this host can do.
 * Lists the library version, each device backend and I/O engine, whether
 * it is usable here and, when not, why; and whether DIR's file system
 * accepts O_DIRECT.
 */
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli.h"

static const char *const backends[] = {"host", "cuda"};
static const char *const engines[] = {"posix", "uring", "cufile"};

int cmd_info(int argc, char **argv)
{
    int json = 0, create = 0;
    const char *dir = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json"))
            json = 1;
        else if (!strcmp(a, "--create"))
            create = 1;
        else if (!strcmp(a, "--dir")) {
            int rc = cli_opt_string("info", a, v, "a directory", &dir);
            if (rc)
                return rc;
            i++;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: ferry info [--json] [--dir DIR [--create]]\n"
                   "  --dir   the existing directory whose file system is probed (default\n"
                   "          $TMPDIR or /var/tmp); --create makes it first\n");
            return 0;
        } else
            return cli_unknown("info", a);
    }
    if (create && !dir)
        return cli_usage("info", "--create: it makes the --dir directory, and no --dir "
                                 "was given; accepted: --dir DIR --create");
    if (!dir)
        dir = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/var/tmp";
    int drc0 = cli_opt_dir("info", "--dir", dir, create);
    if (drc0)
        return drc0;

    json_t *root = json_object();
    json_object_set_new(root, "version", json_string(ferry_version()));
    json_t *jb = json_array(), *je = json_array();
    if (!json)
        printf("ferry %s\n\ndevice backends:\n", ferry_version());
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++) {
        const char *why = NULL;
        int ok = ferry_device_backend_available(backends[i], &why);
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(backends[i]));
        json_object_set_new(o, "usable", json_boolean(ok));
        json_object_set_new(o, "why", json_string(why ? why : ""));
        json_array_append_new(jb, o);
        if (!json)
            printf("  %-8s %-10s %s\n", backends[i], ok ? "usable" : "unusable", why ? why : "");
    }
    if (!json)
        printf("\nI/O engines (files in %s):\n", dir);
    for (size_t i = 0; i < sizeof engines / sizeof engines[0]; i++) {
        char why[512] = "";
        int rc = ferry_io_engine_probe(engines[i], dir, why, sizeof why);
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(engines[i]));
        json_object_set_new(o, "usable", json_boolean(rc == 0));
        json_object_set_new(o, "why", json_string(why));
        json_array_append_new(je, o);
        if (!json)
            printf("  %-8s %-10s %s\n", engines[i], rc == 0 ? "usable" : "unusable", why);
    }
    /* what "auto" picks here, and why (no device given) */
    ferry_io *io = NULL;
    json_t *ja = json_object();
    if (ferry_io_open(NULL, &io) == 0) {
        json_object_set_new(ja, "engine", json_string(ferry_io_engine(io)));
        json_object_set_new(ja, "reason", json_string(ferry_io_reason(io)));
        if (!json)
            printf("  auto  -> %s\n", ferry_io_reason(io));
        ferry_io_close(io);
    } else {
        json_object_set_new(ja, "error", json_string(ferry_last_error()));
        if (!json)
            printf("  auto  -> none: %s\n", ferry_last_error());
    }
    json_object_set_new(root, "io_auto", ja);
    char dwhy[512] = "";
    int drc = ferry_io_direct_probe(dir, dwhy, sizeof dwhy);
    json_t *jd = json_object();
    json_object_set_new(jd, "dir", json_string(dir));
    json_object_set_new(jd, "usable", json_boolean(drc == 0));
    json_object_set_new(jd, "why", json_string(dwhy));
    if (!json)
        printf("\nO_DIRECT in %s: %s %s\n", dir, drc == 0 ? "usable" : "refused", dwhy);
    json_object_set_new(root, "device_backends", jb);
    json_object_set_new(root, "io_engines", je);
    json_object_set_new(root, "direct_io", jd);
    if (json) {
        char *s = json_dumps(root, JSON_INDENT(2));
        printf("%s\n", s);
        free(s);
    }
    json_decref(root);
    return 0;
}
