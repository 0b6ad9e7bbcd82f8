/*
 * test_serve_config_cli.c - `ferry serve --config FILE` end to end: the
 * daemon serves what the file says; FERRY_<KEY> overrides the file and a
 * flag overrides both (the L1 size `ferry serve status` reports, and the
 * socket it answers on); `ferry serve status --config FILE` finds the
 * file's socket; a bad file is a usage error (exit 2) in one line naming
 * file:line:column and the key, and nothing is served. Runs the ferry
 * binary built next to this test (skipped when absent).
 */
#include <fcntl.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_test.h"

static char g_ferry[4096];
static char g_dir[256];

/* run ferry argv (NULL-terminated) with env (NAME=VALUE strings, NULL-
 * terminated) added; its exit status, stdout and stderr (each
 * NUL-terminated, at most len - 1 bytes) */
static int run(char *const *argv, char *const *env, char *out, char *err, size_t len)
{
    char po[320], pe[320];
    snprintf(po, sizeof po, "%s/out.txt", g_dir);
    snprintf(pe, sizeof pe, "%s/err.txt", g_dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fo = open(po, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fe = open(pe, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fo, 1);
        dup2(fe, 2);
        for (char *const *e = env; e && *e; e++)
            putenv(*e);
        execv(g_ferry, argv);
        _exit(127);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    const char *paths[2] = {po, pe};
    char *bufs[2] = {out, err};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(paths[i], "r");
        assert_non_null(f);
        size_t n = fread(bufs[i], 1, len - 1, f);
        bufs[i][n] = 0;
        fclose(f);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* start `ferry serve` with args and env, wait until `serve status` with
 * status_args answers; its output in out; then SIGTERM: exit 0 */
static void serve_and_ask(char *const *args, char *const *env, char *const *status_args,
                          char *const *status_env, char *out, size_t len)
{
    char log[320];
    snprintf(log, sizeof log, "%s/serve.log", g_dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 2);
        for (char *const *e = env; e && *e; e++)
            putenv(*e);
        execv(g_ferry, args);
        _exit(127);
    }
    static char err[1 << 14];
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (run(status_args, status_env, out, err, len) == 0)
            break;
        int st = 0, gone = waitpid(pid, &st, WNOHANG) == pid;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (gone || now.tv_sec - t0.tv_sec > 60) {
            char text[4096] = "";
            FILE *f = fopen(log, "r");
            if (f) {
                text[fread(text, 1, sizeof text - 1, f)] = 0;
                fclose(f);
            }
            if (!gone)
                kill(pid, SIGKILL);
            fail_msg("ferry serve did not answer (status: %s); its log: %s", err, text);
        }
        usleep(20000);
    }
    kill(pid, SIGTERM);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

static void flags_over_environment_over_file(void **state)
{
    (void)state;
    char conf[320], sock_file[320], sock_env[320], sock_flag[320], l2[320];
    snprintf(conf, sizeof conf, "%s/ferry.yaml", g_dir);
    snprintf(sock_file, sizeof sock_file, "%s/file.sock", g_dir);
    snprintf(sock_env, sizeof sock_env, "FERRY_SOCKET=%s/env.sock", g_dir);
    snprintf(sock_flag, sizeof sock_flag, "%s/flag.sock", g_dir);
    snprintf(l2, sizeof l2, "%s/l2", g_dir);
    assert_int_equal(mkdir(l2, 0700), 0);
    char text[1024];
    snprintf(text, sizeof text,
             "# a daemon for the tests\nmodel: tiny\nl1_bytes: 4M\nsocket: %s\n"
             "l2_dir: %s\nl2_bytes: 8M\nworkers: 2\n",
             sock_file, l2);
    write_file(conf, text);
    static char out[1 << 14];
    /* the file alone: its socket, its L1, its L2 */
    char *a1[] = {g_ferry, "serve", "--config", conf, NULL};
    char *s1[] = {g_ferry, "serve", "status", "--config", conf, NULL};
    serve_and_ask(a1, NULL, s1, NULL, out, sizeof out);
    assert_non_null(strstr(out, sock_file));
    assert_non_null(strstr(out, "of 4194304 bytes"));
    assert_non_null(strstr(out, "of 8388608 bytes"));
    /* the environment over the file */
    char *e2[] = {"FERRY_L1_BYTES=6M", sock_env, NULL};
    char *s2[] = {g_ferry, "serve", "status", "--config", conf, NULL};
    serve_and_ask(a1, e2, s2, e2, out, sizeof out);
    assert_non_null(strstr(out, sock_env + strlen("FERRY_SOCKET=")));
    assert_non_null(strstr(out, "of 6291456 bytes"));
    /* a flag over both */
    char *a3[] = {g_ferry, "serve", "--config", conf, "--l1", "5M", "--socket", sock_flag, NULL};
    char *s3[] = {g_ferry, "serve", "status", "--socket", sock_flag, NULL};
    serve_and_ask(a3, e2, s3, NULL, out, sizeof out);
    assert_non_null(strstr(out, sock_flag));
    assert_non_null(strstr(out, "of 5242880 bytes"));
    assert_non_null(strstr(out, "of 8388608 bytes"));
}

/* --l2 twice, and l2_dirs in the file: one L2 striped over both */
static void two_l2_directories(void **state)
{
    (void)state;
    char conf[320], sock[320], a[320], b[320], la[340], lb[340], lb4[340], text[1024];
    snprintf(conf, sizeof conf, "%s/two.yaml", g_dir);
    snprintf(sock, sizeof sock, "%s/two.sock", g_dir);
    snprintf(a, sizeof a, "%s/nvme0", g_dir);
    snprintf(b, sizeof b, "%s/nvme1", g_dir);
    assert_int_equal(mkdir(a, 0700), 0);
    assert_int_equal(mkdir(b, 0700), 0);
    snprintf(la, sizeof la, "%s:8M", a);
    snprintf(lb, sizeof lb, "%s:8M", b);
    snprintf(lb4, sizeof lb4, "%s:4M", b);
    static char out[1 << 14], err[1 << 14];
    char *st[] = {g_ferry, "serve", "status", "--socket", sock, NULL};
    char *a1[] = {g_ferry, "serve", "--model", "tiny", "--l1", "4M", "--socket", sock,
                  "--l2", la, "--l2", lb, NULL};
    serve_and_ask(a1, NULL, st, NULL, out, sizeof out);
    assert_non_null(strstr(out, "of 16777216 bytes")); /* L2: 8 MiB on each */
    /* the same from a file, and the daemon finds its chunks' slab again */
    snprintf(text, sizeof text, "model: tiny\nl1_bytes: 4M\nsocket: %s\nl2_dirs:\n  - %s\n"
             "  - %s\nl2_bytes: 8M\n", sock, a, b);
    write_file(conf, text);
    char *a2[] = {g_ferry, "serve", "--config", conf, NULL};
    serve_and_ask(a2, NULL, st, NULL, out, sizeof out);
    assert_non_null(strstr(out, "of 16777216 bytes"));
    /* sizes that differ, a directory twice, a missing one: usage errors */
    char *a3[] = {g_ferry, "serve", "--model", "tiny", "--l2", la, "--l2", lb4, NULL};
    assert_int_equal(run(a3, NULL, out, err, sizeof out), 2);
    assert_non_null(strstr(err, "the same SIZE for every --l2"));
    char *a4[] = {g_ferry, "serve", "--model", "tiny", "--l2", la, "--l2", la, NULL};
    assert_int_equal(run(a4, NULL, out, err, sizeof out), 2);
    assert_non_null(strstr(err, "given twice"));
    char *a5[] = {g_ferry, "serve", "--model", "tiny", "--l2", la, "--l2", "/nonexistent/x:8M",
                  NULL};
    assert_int_equal(run(a5, NULL, out, err, sizeof out), 2);
    assert_non_null(strstr(err, "--l2 /nonexistent/x: no such directory"));
}

static void a_bad_file_serves_nothing(void **state)
{
    (void)state;
    char conf[320];
    snprintf(conf, sizeof conf, "%s/bad.yaml", g_dir);
    write_file(conf, "model: tiny\nl1_bytes: 4M\nl1_bytes: 8M\n");
    static char out[1 << 14], err[1 << 14];
    char *a[] = {g_ferry, "serve", "--config", conf, NULL};
    assert_int_equal(run(a, NULL, out, err, sizeof out), 2);
    char want[512];
    snprintf(want, sizeof want, "ferry serve: %s:3:1: l1_bytes: a duplicate key", conf);
    assert_non_null(strstr(err, want));
    assert_string_equal(out, "");
    assert_int_equal(strchr(err, '\n') - err + 1, (long)strlen(err)); /* one line */
    /* a bad variable: named, exit 2 */
    char *e[] = {"FERRY_WORKERS=many", NULL};
    char *a2[] = {g_ferry, "serve", "--model", "tiny", NULL};
    assert_int_equal(run(a2, e, out, err, sizeof out), 2);
    assert_non_null(strstr(err, "FERRY_WORKERS=many: not a number"));
    /* a missing file, a second --config */
    char *a3[] = {g_ferry, "serve", "--config", "/nonexistent/ferry.yaml", NULL};
    assert_int_equal(run(a3, NULL, out, err, sizeof out), 2);
    assert_non_null(strstr(err, "/nonexistent/ferry.yaml: cannot read it"));
    char *a4[] = {g_ferry, "serve", "--config", conf, "--config", conf, NULL};
    assert_int_equal(run(a4, NULL, out, err, sizeof out), 2);
    assert_non_null(strstr(err, "given twice"));
    /* l2_dir that does not exist: named with the file's position */
    write_file(conf, "model: tiny\nl2_dir: /nonexistent/l2\nl2_bytes: 8M\n");
    assert_int_equal(run(a, NULL, out, err, sizeof out), 2);
    snprintf(want, sizeof want, "%s:2:1: l2_dir /nonexistent/l2: no such directory", conf);
    assert_non_null(strstr(err, want));
    /* a socket that is a network address: named with the file's position,
     * for the daemon and for `serve status` alike, never taken for a path */
    write_file(conf, "model: tiny\nl1_bytes: 4M\nsocket: tcp://127.0.0.1:9400\n");
    char *a5[] = {g_ferry, "serve", "status", "--config", conf, NULL};
    char **runs[] = {a, a5};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(run(runs[i], NULL, out, err, sizeof out), 2);
        snprintf(want, sizeof want, "%s:3:1: socket tcp://127.0.0.1:9400: ", conf);
        if (!strstr(err, want) || !strstr(err, "accepted: unix:/path/to/ferry.sock") ||
            strchr(err, '\n') - err + 1 != (long)strlen(err))
            fail_msg("%s: stderr '%s' (want one line with '%s')", i ? "serve status" : "serve",
                     err, want);
    }
}

int main(void)
{
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return 77;
    self[n] = 0;
    snprintf(g_ferry, sizeof g_ferry, "%s/../ferry", dirname(self));
    if (access(g_ferry, X_OK) != 0) {
        fprintf(stderr, "skip: %s not built\n", g_ferry);
        return 77;
    }
    unsetenv("FERRY_L1_BYTES");
    unsetenv("FERRY_SOCKET");
    unsetenv("FERRY_WORKERS");
    unsetenv("FERRY_L2_DIR");
    unsetenv("FERRY_L2_DIRS");
    unsetenv("FERRY_L2_BYTES");
    unsetenv("FERRY_MODEL");
    ft_tmpdir(g_dir, sizeof g_dir);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(flags_over_environment_over_file),
        cmocka_unit_test(two_l2_directories),
        cmocka_unit_test(a_bad_file_serves_nothing),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    ft_rmtree(g_dir);
    return rc;
}
