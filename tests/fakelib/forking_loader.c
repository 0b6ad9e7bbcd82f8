/*
 * forking_loader.c - a stand-in driver library for the fork tests: with
 * FERRY_TEST_LOADER_FORK=1 in the environment its constructor (run inside
 * the dlopen that loads it, under the loader's lock) forks, as a driver
 * that starts a helper program may; the child exits at once and the
 * constructor waits for it. It exports no driver symbol: a loader that
 * opens it finds the library unusable ("symbol ... missing").
 */
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

__attribute__((constructor)) static void forking_loader_init(void)
{
    const char *v = getenv("FERRY_TEST_LOADER_FORK");
    if (!v || strcmp(v, "1") != 0)
        return;
    pid_t ch = fork();
    if (ch == 0)
        _exit(0);
    if (ch > 0)
        waitpid(ch, NULL, 0);
}
