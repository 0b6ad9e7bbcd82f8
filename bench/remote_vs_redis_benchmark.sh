#!/usr/bin/env bash
# Remote tier retrieve throughput vs redis-benchmark GET of the same value
# size on the same server, in one run (issue 6: target ratio >= 0.8x).
#
# usage: bench/remote_vs_redis_benchmark.sh BUILD_DIR [--url URL] [--quick] [--rounds R]
#                                           [--sizes "64K 1M 4M"] [--clients "1 4"]
# Without --url it starts its own redis-server on a free 127.0.0.1 port in a
# temp dir (persistence off) and stops it at the end. Prints one line per
# (size, clients) with ferry GET/s, redis-benchmark GET/s (alternating for
# --rounds rounds, best of each; default 3) and their ratio;
# with $OUT set, each run's JSON is also written to $OUT/remote_<size>_c<clients>.json.
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR [--url URL] [--quick] [--sizes LIST] [--clients LIST]}
shift
url=${FERRY_BENCH_REDIS_URL:-}
sizes="64K 256K 1M 4M"
clients="1 4"
count_for() { # about 1 GB moved per measurement, 200..20000 requests
  local b
  b=$(numfmt --from=iec "$1")
  local n=$(( (1024 * 1024 * 1024) / b ))
  (( n < 200 )) && n=200
  (( n > 20000 )) && n=20000
  echo "$n"
}
quick=0
rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --url) url=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --quick) quick=1; sizes="64K 1M"; clients="1"; rounds=2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
command -v redis-benchmark >/dev/null || { echo "redis-benchmark is not installed" >&2; exit 77; }

dir=""
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  [ -n "$dir" ] && rm -rf "$dir"
}
trap cleanup EXIT
if [ -z "$url" ]; then
  command -v redis-server >/dev/null || { echo "redis-server is not installed" >&2; exit 77; }
  dir=$(mktemp -d -p /var/tmp ferry-remote-bench-XXXXXX)
  for _ in $(seq 50); do
    port=$(( 20000 + RANDOM % 10000 ))
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
      --logfile "$dir/redis.log" >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 100); do
      redis-cli -p "$port" ping >/dev/null 2>&1 && break
      sleep 0.02
    done
    if redis-cli -p "$port" ping >/dev/null 2>&1; then break; fi
    kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""
  done
  [ -n "$pid" ] || { echo "could not start redis-server" >&2; exit 1; }
  url="redis://127.0.0.1:$port/0"
fi

printf '%-8s %-7s %-8s %14s %14s %8s\n' value clients count ferry_GET/s redis_GET/s ratio
for s in $sizes; do
  for c in $clients; do
    n=$(count_for "$s")
    (( quick )) && n=200
    out=$("$build/ferry" bench remote --url "$url" --value "$s" --count "$n" --clients "$c" \
      --rounds "$rounds" --json)
    if [ -n "${OUT:-}" ]; then echo "$out" > "$OUT/remote_${s}_c${c}.json"; fi
    field() { echo "$out" | sed -n "s/.*\"$1\": \([0-9.eE+-]*\).*/\1/p" | head -1; }
    fg=$(field ferry_get_per_s); rb=$(field redis_benchmark_get_per_s); ra=$(field ratio)
    printf '%-8s %-7s %-8s %14.1f %14s %8s\n' "$s" "$c" "$n" "$fg" \
      "$( [ -n "$rb" ] && printf '%.1f' "$rb" || echo n/a)" \
      "$( [ -n "$ra" ] && printf '%.2fx' "$ra" || echo n/a)"
  done
done
