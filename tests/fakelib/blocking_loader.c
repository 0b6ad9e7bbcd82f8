/*
 * blocking_loader.c - a stand-in driver library for the fork tests: its
 * constructor (run inside the dlopen that loads it) writes one byte to the
 * fd in FERRY_TEST_LOADER_SIGNAL_FD ("inside the load"), then blocks
 * reading one byte from FERRY_TEST_LOADER_RELEASE_FD before it returns, and
 * registers a fork handler as a real driver may. Without those variables
 * it does nothing. It exports no driver symbol: a loader that opens it
 * finds the library unusable ("symbol ... missing").
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

static int env_fd(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? atoi(v) : -1;
}

static void nothing(void)
{
}

__attribute__((constructor)) static void blocking_loader_init(void)
{
    int sig = env_fd("FERRY_TEST_LOADER_SIGNAL_FD");
    int rel = env_fd("FERRY_TEST_LOADER_RELEASE_FD");
    if (sig < 0 || rel < 0)
        return;
    char b = 1;
    if (write(sig, &b, 1) != 1)
        return;
    while (read(rel, &b, 1) < 0 && errno == EINTR)
        ;
    pthread_atfork(nothing, nothing, nothing);
}
