/*
 * ferry.c - the `ferry` command: dispatches to the subcommands listed below.
 * Two-word commands ("bench io") are matched on their first two arguments.
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const cli_command commands[] = {
    {"info", cmd_info, "library version, device backends and I/O engines usable here"},
    {"kv bench", cmd_kv_bench, "KV store under QA/chat workloads: hit rate, GB/s, lookup latency vs references"},
    {"bench io", cmd_bench_io, "write then read a file per I/O engine: GB/s, IOPS, p50/p99, CPU"},
    {"bench remote", cmd_bench_remote, "remote tier (Redis/Valkey) retrieve throughput vs redis-benchmark GET"},
    {"bench gds", cmd_bench_gds, "store/load KV chunks through the GDS slab tier vs bench io; allocator ops/s"},
    {"slab check", cmd_slab_check, "verify a persistent slab (headers, journal, every checksum); --repair"},
    {"slab reset", cmd_slab_reset, "empty a persistent slab a store refused for another layout"},
    {"slab bench", cmd_slab_bench, "persistent slab: reopen time of 100,000 chunks, store GB/s vs the GDS slab"},
    {"moe gen", cmd_moe_gen, "write a synthetic MoE routing trace calibrated to real models"},
    {"moe replay", cmd_moe_replay, "replay a routing trace through an expert cache policy vs Belady"},
    {"moe sim", cmd_moe_sim, "a decode timeline: stall and tokens/s per policy, with and without hints"},
    {"moe bench", cmd_moe_bench, "expert planner cost per layer-step and slot-write throughput"},
    {"serve status", cmd_serve_status, "a running daemon's tiers, clients and hit rates"},
    {"serve", cmd_serve, "one KV cache per host, shared by every engine process (foreground)"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: ferry <command> [options]   (ferry <command> --help)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].summary);
    fprintf(f, "\nexit status: 0 ok, 1 failure, 2 usage error (one line on stderr names the\n"
               "option and what it accepts)\n"
               "env: FERRY_LOG=error|warn|info|debug|trace, FERRY_IO_ENGINE=posix|uring|cufile,\n"
               "     FERRY_DEVICE=host|cuda, FERRY_NO_PROGRESS=1 (no progress bars on a terminal),\n"
               "     FERRY_KV_DIRECT=0|1, FERRY_KV_READ_DEPTH=1..32 (a retrieve's reads straight\n"
               "     into the engine's buffer, and the reads in flight), and ferry serve's keys\n"
               "     as FERRY_<KEY> (ferry serve --help)\n");
}

/* the commands of a group ("kv", "bench", ...), or 0 when it is none */
static int group_usage(FILE *f, const char *group)
{
    size_t gl = strlen(group);
    int n = 0;
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        const char *name = commands[i].name;
        if (strncmp(name, group, gl) || name[gl] != ' ')
            continue;
        if (f && !n)
            fprintf(f, "usage: ferry %s <command> [options]   (ferry %s <command> --help)\n\n"
                       "commands:\n", group, group);
        if (f)
            fprintf(f, "  %-14s %s\n", name, commands[i].summary);
        n++;
    }
    return n;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("ferry %s\n", ferry_version());
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        const char *name = commands[i].name;
        const char *sp = strchr(name, ' ');
        if (!sp) {
            if (!strcmp(argv[1], name))
                return commands[i].run(argc - 1, argv + 1);
            continue;
        }
        size_t n = (size_t)(sp - name);
        if (strlen(argv[1]) == n && !strncmp(argv[1], name, n) && argc >= 3 &&
            !strcmp(argv[2], sp + 1))
            return commands[i].run(argc - 2, argv + 2);
    }
    /* a group alone or with --help: its usage; with anything else, which
     * of its commands exist */
    if (argc >= 3 && (!strcmp(argv[2], "-h") || !strcmp(argv[2], "--help") ||
                      !strcmp(argv[2], "help")) && group_usage(stdout, argv[1]))
        return 0;
    if (argc == 2 && group_usage(stderr, argv[1]))
        return 2;
    if (group_usage(NULL, argv[1])) {
        /* one line: the group's commands are what it accepts */
        fprintf(stderr, "ferry %s: %s: unknown command; accepted:", argv[1], argv[2]);
        for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
            const char *name = commands[i].name;
            size_t gl = strlen(argv[1]);
            if (!strncmp(name, argv[1], gl) && name[gl] == ' ')
                fprintf(stderr, " %s", name + gl + 1);
        }
        fprintf(stderr, " (ferry %s --help)\n", argv[1]);
        return 2;
    }
    fprintf(stderr, "ferry: %s: unknown command; see ferry --help\n", argv[1]);
    return 2;
}
