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

/* one message of libmicrohttpd's (no trailing newline); from any thread */
typedef void (*serve_metrics_log)(const char *msg);

/* serve GET /metrics for s on sa from a thread of its own; its messages go
 * to log (NULL: nowhere), never to stderr. NULL on failure, with the
 * reason in why[0..whylen) ("Address already in use") */
struct MHD_Daemon *serve_metrics_start(ferry_serve *s, const struct sockaddr_in *sa,
                                       serve_metrics_log log, char *why, size_t whylen);
/* stop it (NULL: nothing); before ferry_serve_close */
void serve_metrics_stop(struct MHD_Daemon *d);

#endif
