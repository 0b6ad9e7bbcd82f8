/*
 * serve_fixture.h - a ferry daemon in a thread of the test's process,
 * for the tests that talk to one through its socket.
 */
#ifndef FERRY_TEST_SERVE_FIXTURE_H
#define FERRY_TEST_SERVE_FIXTURE_H

#include <pthread.h>

#include "ferry/serve.h"

typedef struct ft_srv {
    ferry_serve *s;
    pthread_t th;
} ft_srv;

/* open a daemon with sc and run it on a thread (fails the test on an
 * error) */
void ft_srv_open(ft_srv *v, const ferry_serve_config *sc);
/* stop it, join its thread and close it: v->s is NULL after */
void ft_srv_close(ft_srv *v);

#endif
