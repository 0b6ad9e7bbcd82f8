#!/usr/bin/env bash
# retrieve_profile.sh - where the L2-only retrieve's time goes: `perf
# record` of `ferry kv bench --cold N` (the retrieve of bench/retrieve_vs_fio.sh),
# its samples sorted into copy-out, XXH3 verification, reads, locking and
# the rest, as CPU seconds per round on the retrieving thread and on the
# store's workers, next to the rounds' wall time: what the retrieving
# thread did not spend on the CPU, it spent waiting for chunks to land.
# Only samples inside the retrieves count (opening the store, faulting its
# L1 in and closing it are left out).
#
# Build with frame pointers so the call chains are whole:
#   cmake -S . -B build-prof -DCMAKE_C_FLAGS=-fno-omit-frame-pointer
#   cmake --build build-prof --target ferry_cli
# usage: bench/retrieve_profile.sh [--ferry build-prof/ferry] [--dir /var/tmp]
#                                  [--l1 256M] [--rounds 4]
# needs: perf, python3
set -euo pipefail
ferry=build-prof/ferry
dir=/var/tmp
l1=256M
rounds=4
while [ $# -gt 0 ]; do
    case "$1" in
    --ferry) ferry=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --l1) l1=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "retrieve_profile.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
for tool in perf python3 jq; do
    command -v $tool >/dev/null || { echo "retrieve_profile.sh: $tool is not installed" >&2; exit 2; }
done
work=$(mktemp -d -p "$dir" ferry-retrieve-profile-XXXXXX)
trap 'rm -rf "$work"' EXIT
export FERRY_NO_PROGRESS=1
args=(kv bench --docs 8 --doc-tokens 2048 --l1 "$l1" --l2 3G --dir "$work" --json)
"$ferry" "${args[@]}" --cold 1 >/dev/null # the documents into the slab, once
freq=1999
echo "load $(cut -d' ' -f1-3 /proc/loadavg); ferry ${args[*]} --cold $rounds under perf record -F $freq -g"
perf record -q -F $freq -g -o "$work/perf.data" "$ferry" "${args[@]}" --cold "$rounds" >"$work/out.json"
jq -r '.cold_l2_retrieve.rounds[] | "  round: \(.gb_per_s * 100 | round / 100) GB/s, \(.seconds * 1000 | round) ms"' \
    "$work/out.json"
wall=$(jq '[.cold_l2_retrieve.rounds[].seconds] | add' "$work/out.json")
cat >"$work/sort.py" <<'PY'
import collections, re, sys
freq, rounds, wall = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
samples, cur = [], None
for line in sys.stdin:
    if not line.strip():
        if cur: samples.append(cur)
        cur = None
    elif not line[0].isspace() or re.match(r'^\s*\d+\s*$', line):
        cur = {'tid': int(line.split()[0]), 'stack': []}
    elif cur is not None:
        m = re.match(r'\s*[0-9a-f]+\s+(.*)\s+\((.*)\)\s*$', line)
        if m: cur['stack'].append((m.group(1), m.group(2)))
if cur: samples.append(cur)
main = collections.Counter(s['tid'] for s in samples
                           if any('cmd_kv_bench' in f[0] for f in s['stack'])).most_common(1)[0][0]
SETUP = r'kv_open|l1_open|prefault|ferry_kv_close|kvb_buffer|make_workload|plain_buffer|cold_fill|_dl_|exit'
def cat(s):
    syms = ' '.join(f[0] for f in s['stack'])
    leaf = s['stack'][0] if s['stack'] else ('?', '?')
    if re.search(SETUP, syms) or (s['tid'] == main and not re.search(r'(^| )rt_|ferry__kv|ferry_kv_retrieve', syms)):
        return None
    if 'exc_page_fault' in syms: return 'page faults'
    if 'xxhash' in leaf[1] or 'XXH' in leaf[0]: return 'XXH3 verification'
    if re.search(r'memmove|memcpy|copy_stream', leaf[0]): return 'copy-out'
    if re.search(r'futex|lll_lock|pthread_mutex|pthread_cond', syms): return 'locking, waking'
    if re.search(r'io_uring|blk_|virtio|bio_|iomap|ferry__io|ferry_io', syms) or 'liburing' in leaf[1]:
        return 'reads (submit, complete)'
    return 'other'
per = collections.defaultdict(lambda: [0, 0])
for s in samples:
    k = cat(s)
    if k: per[k][0 if s['tid'] == main else 1] += 1
print('per round (2 GiB), CPU ms:  retrieving thread  workers')
tm = tw = 0
for k, (m, w) in sorted(per.items(), key=lambda kv: -sum(kv[1])):
    tm += m; tw += w
    print('  %-26s %10.0f %9.0f' % (k, m / freq / rounds * 1e3, w / freq / rounds * 1e3))
print('  %-26s %10.0f %9.0f' % ('CPU in all', tm / freq / rounds * 1e3, tw / freq / rounds * 1e3))
print('  retrieving thread waiting: %.0f ms of %.0f ms wall' % ((wall - tm / freq) / rounds * 1e3, wall / rounds * 1e3))
PY
perf script -i "$work/perf.data" -F tid,ip,sym,dso 2>/dev/null |
    python3 "$work/sort.py" "$freq" "$rounds" "$wall"
