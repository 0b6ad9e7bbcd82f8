#!/usr/bin/env bash
# serve_pool.sh - `ferry kv bench --server` against a fresh `ferry serve`
# daemon per run, its shared pool in huge pages as a production host would
# reserve them, with the goals those figures are held to (the goals live
# here and in the README, never in ferry's own output):
#
#   pool copies  store and retrieve through the daemon's pool against a
#                memcpy of the same bytes in the client, alternating
#                rounds (median of 9)                  goal >= 0.90x memcpy
#   fairness     N client processes storing and retrieving at once: each
#                one's share of the bytes               goal >= 1/16
#                and the aggregate against one client alone
#                                                       goal >= 0.80x
#   lookup       a 32k-token prompt's lookup, one client and N at once
#                                           goal (N=8) p50 <= 25 us, p99 <= 100 us
#
# Without huge pages the pool is a memfd of 4 KiB pages and stores into it
# run 0.8-0.9x of memcpy; the daemon logs which it got. This script raises
# vm.nr_hugepages by the pool's pages (root; without root it runs on
# whatever is reserved) and gives them back on exit.
#
# Next to the lookup, each run prints socket_rtt (bench/socket_rtt.c, built
# beside ferry): a bare request and reply of a lookup's sizes between two
# processes over a Unix socket, the floor under any lookup through a daemon.
#
# usage: bench/serve_pool.sh [--ferry build/ferry] [--runs 3] [--model llama3-8b]
#                            [--l1 1G] [--clients 8]
set -euo pipefail
ferry=build/ferry runs=3 model=llama3-8b l1=1G clients=8
while [ $# -gt 0 ]; do
    case "$1" in
    --ferry) ferry=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --l1) l1=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "serve_pool.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
case "$l1" in
*G) bytes=$(( ${l1%G} << 30 )) ;;
*M) bytes=$(( ${l1%M} << 20 )) ;;
*) bytes=$l1 ;;
esac
pool_pages=$(( (bytes >> 21) + 16 ))
tmp=$(mktemp -d -p /tmp ferry-serve-pool-XXXXXX)
added=0 daemon=
cleanup() {
    [ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
    if [ "$added" -gt 0 ]; then
        n=$(cat /proc/sys/vm/nr_hugepages)
        echo $(( n > added ? n - added : 0 )) >/proc/sys/vm/nr_hugepages 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
before=$(cat /proc/sys/vm/nr_hugepages)
if echo $(( before + pool_pages )) >/proc/sys/vm/nr_hugepages 2>/dev/null; then
    added=$(( $(cat /proc/sys/vm/nr_hugepages) - before ))
fi
echo "huge pages: $before reserved before, $added added for the pool"
for r in $(seq "$runs"); do
    sock=$tmp/ferry.sock
    rm -f "$sock"
    "$ferry" serve --socket "$sock" --model "$model" --l1 "$l1" >"$tmp/serve.log" 2>&1 &
    daemon=$!
    for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.1; done
    [ -S "$sock" ] || { cat "$tmp/serve.log" >&2; echo "serve_pool.sh: no daemon" >&2; exit 1; }
    echo "== run $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
    grep -i -E "huge pages|4 KiB" "$tmp/serve.log" | head -2 || true
    "$ferry" kv bench --model "$model" --l1 "$l1" --server "unix:$sock" --clients "$clients" |
        grep -E "pool copies|fairness|lookup"
    rtt=$(dirname "$ferry")/socket_rtt
    [ -x "$rtt" ] && "$rtt" | sed 's/^/  /'
    kill "$daemon"
    wait "$daemon" 2>/dev/null || true
    daemon=
done
echo "goals: pool copies >= 0.90x memcpy; each client >= 1/16 of the bytes, aggregate >= 0.80x one" \
     "client; lookup with $clients clients p50 <= 25 us, p99 <= 100 us"
