/*
 * serve_fixture.c - a ferry daemon in a thread (serve_fixture.h).
 */
#include "serve_fixture.h"

#include "ferry_test.h"

static void *srv_main(void *arg)
{
    ferry_serve_run(arg);
    return NULL;
}

void ft_srv_open(ft_srv *v, const ferry_serve_config *sc)
{
    FT_ASSERT_OK(ferry_serve_open(sc, &v->s));
    assert_int_equal(pthread_create(&v->th, NULL, srv_main, v->s), 0);
}

void ft_srv_close(ft_srv *v)
{
    ferry_serve_stop(v->s);
    pthread_join(v->th, NULL);
    FT_ASSERT_OK(ferry_serve_close(v->s));
    v->s = NULL;
}
