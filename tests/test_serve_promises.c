/*
 * test_serve_promises.c - `ferry serve` as an operator and an engine team
 * meet it: the real ferry binary run as a daemon, engines as clients of
 * it through the public KV API. A refused start (a second daemon on the
 * socket, a socket whose directory is missing, a path too long for
 * sun_path) says one line and leaves nothing behind (no socket, no L2
 * slab); SIGTERM, SIGINT and SIGHUP stop it cleanly (exit 0, the socket
 * gone, the persistent L2 synced: the next daemon returns the very bytes),
 * unless SIGHUP was ignored (nohup); --max-clients refuses the one past
 * it and serves the rest; a client of another geometry is refused naming
 * both; bytes one client stores another retrieves exactly. Skipped when
 * the binary is not built.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry/kv.h"
#include "ferry_test.h"

#define CT 16       /* the daemons' --chunk-tokens */
#define TB 256u     /* model tiny: 2 heads of 64 bf16 values a token and plane */
#define NTOK (8 * CT)

static char g_ferry[4096];
static char g_dir[256];
static rlim_t g_as_limit; /* run()'s child: RLIMIT_AS when nonzero */

/* ---- the binary ---- */

/* run ferry argv (NULL-terminated): its exit status, stderr (at most len - 1 bytes) */
static int run(char *const *argv, char *err, size_t len)
{
    char pe[320];
    snprintf(pe, sizeof pe, "%s/err.txt", g_dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fe = open(pe, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fo = open("/dev/null", O_WRONLY);
        dup2(fo, 1);
        dup2(fe, 2);
        alarm(30); /* (a daemon that serves where it should not have: ended) */
        struct rlimit as = {g_as_limit, g_as_limit};
        if (g_as_limit)
            setrlimit(RLIMIT_AS, &as);
        execv(g_ferry, argv);
        _exit(127);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    FILE *f = fopen(pe, "r");
    assert_non_null(f);
    err[fread(err, 1, len - 1, f)] = 0;
    fclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static int lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static int exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

/* the entries of directory path */
static int entries(const char *path)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | wc -l", path);
    FILE *p = popen(cmd, "r");
    int n = -1;
    assert_non_null(p);
    assert_int_equal(fscanf(p, "%d", &n), 1);
    pclose(p);
    return n;
}

static char g_log[320];

/* start `ferry serve --socket sock --model tiny --chunk-tokens 16 --l1 4M`
 * and extra (NULL-terminated, may be NULL) in the background, SIGHUP
 * ignored when ign_hup; wait for the socket file (it appears only once the
 * daemon listens). Its pid */
static pid_t daemon_start(const char *sock, const char *const *extra, int ign_hup)
{
    char *argv[32] = {g_ferry, "serve", "--socket", (char *)sock, "--model", "tiny",
                      "--chunk-tokens", "16", "--l1", "4M"};
    int n = 10;
    for (; extra && *extra && n < 31; extra++)
        argv[n++] = (char *)*extra;
    argv[n] = NULL;
    snprintf(g_log, sizeof g_log, "%s/serve.log", g_dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(g_log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 2);
        if (ign_hup)
            signal(SIGHUP, SIG_IGN);
        execv(g_ferry, argv);
        _exit(127);
    }
    for (int i = 0; i < 6000 && !exists(sock); i++) {
        int st = 0;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            char text[2048] = "";
            FILE *f = fopen(g_log, "r");
            if (f) {
                text[fread(text, 1, sizeof text - 1, f)] = 0;
                fclose(f);
            }
            fail_msg("ferry serve exited before serving: %s", text);
        }
        usleep(10000);
    }
    if (!exists(sock)) {
        kill(pid, SIGKILL);
        fail_msg("ferry serve on %s: no socket within 60 s", sock);
    }
    return pid;
}

/* signal the daemon and wait: its exit status (128 + a signal that ended it) */
static int daemon_stop(pid_t pid, int sig)
{
    kill(pid, sig);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* ---- an engine: a client of the daemon ---- */

static ferry_kv_config client_config(const char *sock)
{
    ferry_kv_config c = FERRY_KV_CONFIG_INIT;
    c.model = "tiny";
    c.layout = ft_kv_layout(TB);
    c.chunk_tokens = CT;
    c.l1_bytes = 1; /* map the daemon's pool */
    c.server = sock;
    c.server_timeout_ms = 5000;
    return c;
}

/* open a client of sock: a client that just closed no longer counts
 * against the daemon's max_clients, so none waits its turn */
static void open_client(const ferry_kv_config *c, ferry_kv **kv)
{
    int rc = ferry_kv_open(c, kv);
    if (rc != 0)
        fail_msg("ferry_kv_open of %s: %d (%s)", c->server, rc, ferry_last_error());
}

static void tokens(int32_t *t, int n, int seed)
{
    for (int i = 0; i < n; i++)
        t[i] = seed * 100003 + i * 7 + 1;
}

/* store NTOK tokens of seed's KV (the pattern seed) through a client of sock */
static void store(const char *sock, int seed)
{
    ferry_kv_config c = client_config(sock);
    ferry_kv *kv = NULL;
    open_client(&c, &kv);
    int32_t t[NTOK];
    tokens(t, NTOK, seed);
    size_t bytes = (size_t)NTOK * TB * 4;
    void *img = malloc(bytes);
    assert_non_null(img);
    ft_fill_pattern(img, bytes, (unsigned)seed);
    ferry_kv_buffer b = ft_kv_host_buffer(img, NTOK, TB);
    assert_int_equal(ferry_kv_store(kv, t, NTOK, NULL, &b), NTOK);
    FT_ASSERT_OK(ferry_kv_flush(kv));
    ferry_kv_close(kv);
    free(img);
}

/* retrieve them through another client: the tokens found, and every
 * byte of those compared */
static int retrieve(const char *sock, int seed)
{
    ferry_kv_config c = client_config(sock);
    ferry_kv *kv = NULL;
    open_client(&c, &kv);
    int32_t t[NTOK];
    tokens(t, NTOK, seed);
    size_t bytes = (size_t)NTOK * TB * 4;
    void *img = calloc(1, bytes);
    assert_non_null(img);
    ferry_kv_buffer b = ft_kv_host_buffer(img, NTOK, TB);
    int64_t got = ferry_kv_retrieve(kv, t, NTOK, NULL, &b);
    ferry_kv_close(kv);
    if (got == NTOK && ft_check_pattern(img, bytes, (unsigned)seed) != -1)
        fail_msg("retrieved %d tokens whose bytes differ at %ld", NTOK,
                 ft_check_pattern(img, bytes, (unsigned)seed));
    free(img);
    return (int)got;
}

/* ---- the tests ---- */

/* a refused start says one line and leaves no socket and no L2 slab: a
 * second daemon on a live daemon's socket, a socket whose directory is
 * missing, a path too long for sun_path (a usage error, exit 2), a second
 * daemon on the first's L2 directory */
static void a_refused_start_leaves_nothing_behind(void **state)
{
    (void)state;
    char sock[320], sock2[320], l2a[320], l2b[320], spec_a[340], spec_b[340], nodir[340];
    char longp[400];
    snprintf(sock, sizeof sock, "%s/a.sock", g_dir);
    snprintf(sock2, sizeof sock2, "%s/b.sock", g_dir);
    snprintf(l2a, sizeof l2a, "%s/l2a", g_dir);
    snprintf(l2b, sizeof l2b, "%s/l2b", g_dir);
    snprintf(spec_a, sizeof spec_a, "%s:8M", l2a);
    snprintf(spec_b, sizeof spec_b, "%s:8M", l2b);
    snprintf(nodir, sizeof nodir, "%s/nodir/x.sock", g_dir);
    snprintf(longp, sizeof longp, "%s/%0*d.sock", g_dir, 110, 0);
    assert_int_equal(mkdir(l2a, 0700), 0);
    assert_int_equal(mkdir(l2b, 0700), 0);
    const char *ea[] = {"--l2", spec_a, NULL};
    pid_t pid = daemon_start(sock, ea, 0);
    static char err[1 << 14];
    struct {
        const char *sock, *l2, *want;
        int status;
    } cases[] = {
        {sock, spec_b, "already serving", 1},
        {nodir, spec_b, "the socket's directory", 1},
        {nodir, spec_b, "create it, or give a socket path in an existing directory", 1},
        {longp, spec_b, "too long", 2},
        {sock2, spec_a, "in use by process", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *argv[] = {g_ferry, "serve", "--socket", (char *)cases[i].sock, "--model", "tiny",
                        "--chunk-tokens", "16", "--l1", "4M", "--l2", (char *)cases[i].l2, NULL};
        int st = run(argv, err, sizeof err);
        int left = entries(l2b);
        if (st != cases[i].status || lines(err) != 1 || strncmp(err, "ferry serve: ", 13) ||
            !strstr(err, cases[i].want) || left != 0 || exists(sock2) ||
            strstr(err, ".sock.") /* (a temporary name the operator never gave) */) {
            daemon_stop(pid, SIGKILL);
            fail_msg("case %zu (--socket %s --l2 %s): exit %d (want %d), %d files left in "
                     "%s, b.sock %s; stderr '%s' (want one line with '%s')",
                     i, cases[i].sock, cases[i].l2, st, cases[i].status, left, l2b,
                     exists(sock2) ? "left" : "absent", err, cases[i].want);
        }
    }
    /* the first daemon serves on, and stops cleanly */
    store(sock, 3);
    assert_int_equal(retrieve(sock, 3), NTOK);
    assert_int_equal(daemon_stop(pid, SIGTERM), 0);
    assert_false(exists(sock));
}

/* README's serve.yaml (l1_bytes: 64G) on a host of 23 GiB: the daemon
 * mapped the pool, served, and faulted it in until the kernel's OOM killer
 * ended it and another process of the host. A pool larger than the
 * machine's memory is now refused at start, in one line naming both.
 * (Run under RLIMIT_AS, so that a daemon that does start cannot take the
 * host's memory.) */
static void an_l1_larger_than_memory_is_refused_at_start(void **state)
{
    (void)state;
    /* (a sanitizer's daemon reserves terabytes of shadow at start, which
     * RLIMIT_AS refuses: the plain build runs this, tests/test_kv_l1fill.c
     * holds the same refusal in process under every build) */
    if (FT_UNDER_ASAN || FT_UNDER_TSAN)
        skip();
    char sock[320], l1[32];
    static char err[1 << 14];
    snprintf(sock, sizeof sock, "%s/big.sock", g_dir);
    uint64_t ram = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    snprintf(l1, sizeof l1, "%lluM", (unsigned long long)(2 * ram >> 20));
    char *argv[] = {g_ferry, "serve", "--socket", sock, "--model", "tiny", "--chunk-tokens",
                    "16", "--l1", l1, NULL};
    g_as_limit = (rlim_t)8 << 30;
    int st = run(argv, err, sizeof err);
    g_as_limit = 0;
    if (st != 1 || lines(err) != 1 || !strstr(err, "of memory this process may have") ||
        exists(sock))
        fail_msg("ferry serve --l1 %s on %llu bytes of memory: exit %d (want 1), socket %s; "
                 "stderr '%s'",
                 l1, (unsigned long long)ram, st, exists(sock) ? "left" : "absent", err);
}

/* `ferry serve --socket sock --l2 spec ...` in the background, stderr to log */
static pid_t spawn_serve(const char *sock, const char *spec, const char *log)
{
    char *argv[] = {g_ferry, "serve", "--socket", (char *)sock, "--model", "tiny",
                    "--chunk-tokens", "16", "--l1", "4M", "--l2", (char *)spec, NULL};
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 2);
        execv(g_ferry, argv);
        _exit(127);
    }
    return pid;
}

/* two daemons started on one socket at once, each with an L2 directory of
 * its own: one serves, the other is refused and leaves its directory as
 * it found it (empty: no slab of a store it never served) */
static void two_starts_at_once_one_serves(void **state)
{
    (void)state;
    char sock[320], l2[2][320], spec[2][700], log[2][320];
    snprintf(sock, sizeof sock, "%s/race.sock", g_dir);
    for (int d = 0; d < 2; d++) {
        snprintf(l2[d], sizeof l2[d], "%s/l2race%d", g_dir, d);
        snprintf(spec[d], sizeof spec[d], "%s:64M", l2[d]);
        snprintf(log[d], sizeof log[d], "%s/race%d.log", g_dir, d);
    }
    for (int t = 0; t < 4; t++) {
        for (int d = 0; d < 2; d++) {
            ft_rmtree(l2[d]);
            assert_int_equal(mkdir(l2[d], 0700), 0);
        }
        pid_t pid[2];
        for (int d = 0; d < 2; d++)
            pid[d] = spawn_serve(sock, spec[d], log[d]);
        int loser = -1, st = 0;
        for (int i = 0; i < 6000 && loser < 0; i++) {
            for (int d = 0; d < 2 && loser < 0; d++)
                if (waitpid(pid[d], &st, WNOHANG) == pid[d])
                    loser = d;
            if (loser < 0)
                usleep(10000);
        }
        if (loser < 0) {
            kill(pid[0], SIGKILL);
            kill(pid[1], SIGKILL);
            fail_msg("try %d: two daemons on one socket both serve", t);
        }
        int winner = !loser, left = entries(l2[loser]);
        char err[2048] = "";
        FILE *f = fopen(log[loser], "r");
        assert_non_null(f);
        err[fread(err, 1, sizeof err - 1, f)] = 0;
        fclose(f);
        for (int i = 0; i < 6000 && !exists(sock); i++)
            usleep(10000);
        int wst = daemon_stop(pid[winner], SIGTERM);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 1 || left != 0 || !strstr(err, "race.sock") ||
            wst != 0)
            fail_msg("try %d: the refused daemon exited %d, left %d files in %s (want 0); "
                     "the other stopped with %d; its stderr: '%s'",
                     t, WIFEXITED(st) ? WEXITSTATUS(st) : -1, left, l2[loser], wst, err);
    }
}

/* what could never work as meant is a usage error (exit 2, one line naming
 * the fix, nothing created): --allow-uid without --group (the socket is
 * 0600: the uid could never reach it), and the client's key
 * server_timeout_ms in the daemon's config file, as server is */
static void client_keys_and_unreachable_uids_are_refused(void **state)
{
    (void)state;
    char sock[320], conf[320];
    snprintf(sock, sizeof sock, "%s/use.sock", g_dir);
    snprintf(conf, sizeof conf, "%s/use.yaml", g_dir);
    FILE *f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "model: tiny\nchunk_tokens: 16\nl1_bytes: 4M\nserver_timeout_ms: 3000\n");
    fclose(f);
    static char err[4096];
    char *a1[] = {g_ferry, "serve", "--socket", sock, "--model", "tiny", "--l1", "4M",
                  "--allow-uid", "1001", NULL};
    int st = run(a1, err, sizeof err);
    if (st != 2 || lines(err) != 1 || !strstr(err, "--allow-uid") || !strstr(err, "--group") ||
        exists(sock))
        fail_msg("--allow-uid without --group: exit %d, socket %s: '%s'", st,
                 exists(sock) ? "made" : "absent", err);
    char *a2[] = {g_ferry, "serve", "--socket", sock, "--config", conf, NULL};
    st = run(a2, err, sizeof err);
    if (st != 2 || lines(err) != 1 || !strstr(err, "server_timeout_ms") ||
        !strstr(err, "client's key") || exists(sock))
        fail_msg("server_timeout_ms in the daemon's config: exit %d, socket %s: '%s'", st,
                 exists(sock) ? "made" : "absent", err);
    /* uid 0 reaches a 0600 socket: allowed alone, it is no error */
    pid_t pid = daemon_start(sock, (const char *[]){"--allow-uid", "0", NULL}, 0);
    assert_int_equal(daemon_stop(pid, SIGTERM), 0);
}

/* SIGTERM, SIGINT and SIGHUP: a clean stop (exit 0, socket removed, L2
 * synced: a new daemon on the directory returns the bytes exactly) */
static void stop_signals_stop_cleanly(void **state)
{
    (void)state;
    char sock[320], l2[320], spec[340];
    snprintf(sock, sizeof sock, "%s/sig.sock", g_dir);
    snprintf(l2, sizeof l2, "%s/l2sig", g_dir);
    snprintf(spec, sizeof spec, "%s:8M", l2);
    assert_int_equal(mkdir(l2, 0700), 0);
    const char *e[] = {"--l2", spec, NULL};
    const int sigs[] = {SIGTERM, SIGINT, SIGHUP};
    for (int i = 0; i < 3; i++) {
        pid_t pid = daemon_start(sock, e, 0);
        store(sock, 10 + i);
        int st = daemon_stop(pid, sigs[i]);
        if (st != 0 || exists(sock))
            fail_msg("%s: exit %d (want 0), socket %s", strsignal(sigs[i]), st,
                     exists(sock) ? "left behind" : "removed");
        pid = daemon_start(sock, e, 0);
        int got = retrieve(sock, 10 + i);
        assert_int_equal(daemon_stop(pid, SIGTERM), 0);
        if (got != NTOK)
            fail_msg("after %s the next daemon returned %d of %d tokens", strsignal(sigs[i]),
                     got, NTOK);
    }
    /* started with SIGHUP ignored (nohup): a hang-up leaves it serving */
    pid_t pid = daemon_start(sock, e, 1);
    kill(pid, SIGHUP);
    usleep(200000);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, WNOHANG), 0);
    assert_int_equal(retrieve(sock, 10), NTOK);
    assert_int_equal(daemon_stop(pid, SIGTERM), 0);
}

/* a stop right after the socket file appears (a start-up script that waits
 * for it) is a clean stop too: the signal is never the default kill */
static void a_stop_as_soon_as_the_socket_appears(void **state)
{
    (void)state;
    char sock[320];
    snprintf(sock, sizeof sock, "%s/early.sock", g_dir);
    for (int i = 0; i < 5; i++) {
        /* (daemon_start polls every 10 ms; this one as fast as it can) */
        char *argv[] = {g_ferry, "serve", "--socket", sock, "--model", "tiny", "--l1", "4M",
                        NULL};
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            int fd = open("/dev/null", O_WRONLY);
            dup2(fd, 2);
            execv(g_ferry, argv);
            _exit(127);
        }
        while (!exists(sock)) {
            int st = 0;
            assert_int_equal(waitpid(pid, &st, WNOHANG), 0);
        }
        int st = daemon_stop(pid, SIGTERM);
        if (st != 0 || exists(sock))
            fail_msg("try %d: SIGTERM as the socket appeared: exit %d, socket %s", i, st,
                     exists(sock) ? "left behind" : "removed");
    }
}

/* --max-clients 1: the second client is refused naming the limit, the
 * first is served; once it leaves, another client retrieves its bytes */
static void max_clients_from_the_flag(void **state)
{
    (void)state;
    char sock[320];
    snprintf(sock, sizeof sock, "%s/max.sock", g_dir);
    const char *e[] = {"--max-clients", "1", NULL};
    pid_t pid = daemon_start(sock, e, 0);
    ferry_kv_config c = client_config(sock);
    ferry_kv *a = NULL, *b = NULL;
    FT_ASSERT_OK(ferry_kv_open(&c, &a));
    /* (many times: the daemon may close before the client's HELLO is
     * sent, and the refusal must still be what the client reports) */
    for (int i = 0; i < 2000; i++) {
        int rc = ferry_kv_open(&c, &b);
        if (rc != FERRY_EBUSY || !strstr(ferry_last_error(), "max_clients 1")) {
            daemon_stop(pid, SIGKILL);
            fail_msg("try %d: a second client past --max-clients 1: %d (%s)", i, rc,
                     ferry_last_error());
        }
    }
    /* the daemon full, `ferry serve status` still shows it (a monitor is
     * no client of max_clients), and the engine past it is still refused */
    static char out[1 << 14];
    char *st_argv[] = {g_ferry, "serve", "status", "--socket", sock, NULL};
    int st = run(st_argv, out, sizeof out);
    if (st != 0) {
        daemon_stop(pid, SIGKILL);
        fail_msg("ferry serve status of a daemon at --max-clients 1: exit %d: %s", st, out);
    }
    assert_int_equal(ferry_kv_open(&c, &b), FERRY_EBUSY);
    assert_int_equal(ferry_kv_lookup(a, (int32_t[CT]){0}, CT, NULL), 0);
    ferry_kv_close(a);
    store(sock, 21); /* (the first left: at once another client's turn) */
    assert_int_equal(retrieve(sock, 21), NTOK);
    assert_int_equal(daemon_stop(pid, SIGTERM), 0);
}

/* a client of another chunk size or layout is refused, naming the
 * daemon's; the daemon serves the right ones on */
static void another_geometry_is_refused(void **state)
{
    (void)state;
    char sock[320];
    snprintf(sock, sizeof sock, "%s/geo.sock", g_dir);
    pid_t pid = daemon_start(sock, NULL, 0);
    ferry_kv_config c = client_config(sock);
    c.chunk_tokens = 2 * CT;
    ferry_kv *kv = NULL;
    int rc = ferry_kv_open(&c, &kv);
    char why[512];
    snprintf(why, sizeof why, "%s", ferry_last_error());
    c = client_config(sock);
    c.layout.num_layers = 3;
    int rc2 = ferry_kv_open(&c, &kv);
    if (rc != FERRY_EMISMATCH || rc2 != FERRY_EMISMATCH || !strstr(why, "16 tokens")) {
        daemon_stop(pid, SIGKILL);
        fail_msg("another geometry: %d (%s), %d (%s)", rc, why, rc2, ferry_last_error());
    }
    store(sock, 31);
    assert_int_equal(retrieve(sock, 31), NTOK);
    assert_int_equal(daemon_stop(pid, SIGTERM), 0);
}

/* --group and --allow-uid (root only: it needs another uid): a uid that
 * is not allowed is refused naming it, even through a 0660 socket of its
 * group; --allow-uid lets it in */
static void allow_uid_from_the_flag(void **state)
{
    (void)state;
    struct group *gr = getgrgid(65534);
    if (getuid() != 0 || !gr)
        skip();
    char group[64], sock[320];
    snprintf(group, sizeof group, "%s", gr->gr_name);
    snprintf(sock, sizeof sock, "%s/uid.sock", g_dir);
    assert_int_equal(chmod(g_dir, 0755), 0);
    for (int allow = 0; allow < 2; allow++) {
        const char *e[] = {"--group", group, allow ? "--allow-uid" : NULL, "65534", NULL};
        pid_t pid = daemon_start(sock, e, 0);
        struct stat st;
        assert_int_equal(stat(sock, &st), 0);
        assert_int_equal(st.st_mode & 0777, 0660);
        assert_int_equal(st.st_gid, 65534);
        pid_t ch = fork();
        assert_true(ch >= 0);
        if (ch == 0) {
            if (setgid(65534) != 0 || setuid(65534) != 0)
                _exit(3);
            ferry_kv_config c = client_config(sock);
            c.l1_bytes = 0;
            ferry_kv *kv = NULL;
            int rc = ferry_kv_open(&c, &kv);
            if (rc == 0) {
                ferry_kv_close(kv);
                _exit(0);
            }
            _exit(rc == -EACCES && strstr(ferry_last_error(), "uid 65534") ? 1 : 2);
        }
        int got = ft_child_exit(ch);
        /* a monitor (ferry serve status) of that uid: refused alike */
        char pe[320], err[1024] = "";
        snprintf(pe, sizeof pe, "%s/status-uid.txt", g_dir);
        ch = fork();
        assert_true(ch >= 0);
        if (ch == 0) {
            int fe = open(pe, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            int fo = open("/dev/null", O_WRONLY);
            dup2(fo, 1);
            dup2(fe, 2);
            if (setgid(65534) != 0 || setuid(65534) != 0)
                _exit(3);
            execl(g_ferry, g_ferry, "serve", "status", "--socket", sock, (char *)NULL);
            _exit(127);
        }
        int mon = ft_child_exit(ch);
        FILE *f = fopen(pe, "r");
        assert_non_null(f);
        err[fread(err, 1, sizeof err - 1, f)] = 0;
        fclose(f);
        assert_int_equal(daemon_stop(pid, SIGTERM), 0);
        assert_int_equal(got, allow ? 0 : 1);
        if (allow ? mon != 0 : mon == 0 || !strstr(err, "uid 65534"))
            fail_msg("ferry serve status as uid 65534 (%s): exit %d: %s",
                     allow ? "allowed" : "not allowed", mon, err);
    }
    assert_int_equal(chmod(g_dir, 0700), 0);
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
    static const char *const vars[] = {"FERRY_L1_BYTES", "FERRY_SOCKET", "FERRY_WORKERS",
                                       "FERRY_L2_DIR", "FERRY_L2_DIRS", "FERRY_L2_BYTES",
                                       "FERRY_MODEL", "FERRY_MAX_CLIENTS", "FERRY_GROUP",
                                       "FERRY_ALLOW_UIDS", "FERRY_LOG", "FERRY_CHUNK_TOKENS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
    ft_tmpdir(g_dir, sizeof g_dir);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_refused_start_leaves_nothing_behind),
        cmocka_unit_test(an_l1_larger_than_memory_is_refused_at_start),
        cmocka_unit_test(two_starts_at_once_one_serves),
        cmocka_unit_test(client_keys_and_unreachable_uids_are_refused),
        cmocka_unit_test(stop_signals_stop_cleanly),
        cmocka_unit_test(a_stop_as_soon_as_the_socket_appears),
        cmocka_unit_test(max_clients_from_the_flag),
        cmocka_unit_test(another_geometry_is_refused),
        cmocka_unit_test(allow_uid_from_the_flag),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    ft_rmtree(g_dir);
    return rc;
}
