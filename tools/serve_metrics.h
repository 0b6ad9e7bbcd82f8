/*
 * serve_metrics.h - `ferry serve --metrics HOST:PORT`: Prometheus text over
 * HTTP (libmicrohttpd), the store's families and the daemon's. Private to
 * the CLI.
 */
#ifndef FERRY_SERVE_METRICS_H
#define FERRY_SERVE_METRICS_H

#include <netinet/in.h>
#include <stddef.h>

#include "ferry.h"

struct MHD_Daemon;

/* serve GET /metrics for s on sa from a thread of its own; NULL on failure */
struct MHD_Daemon *serve_metrics_start(ferry_serve *s, const struct sockaddr_in *sa);
/* stop it (NULL: nothing); before ferry_serve_close */
void serve_metrics_stop(struct MHD_Daemon *d);

#endif
