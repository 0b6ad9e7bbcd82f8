#!/usr/bin/env bash
# Short forms of every benchmark, run by CI to prove they work (figures are
# not judged here; the README's figures come from the full runs it names).
# usage: bench/smoke.sh BUILD_DIR
set -euo pipefail
build=${1:-build}
dir=$(mktemp -d -p /var/tmp ferry-smoke-XXXXXX)
trap 'rm -rf "$dir"' EXIT
run() { echo "+ $*"; "$@"; }
export FERRY_NO_PROGRESS=1

run "$build/ferry" info --dir "$dir"
run "$build/bench_device" --backend host --size 32M --chunk 4M --rounds 1
run "$build/ferry" bench io --size 64M --dir "$dir"
run "$build/ferry" bench io --engine all --size 16M --chunk 1M --depth 4 --device host --json --dir "$dir"
run bench/vs_fio.sh --ferry "$build/ferry" --size 64M --rounds 2 --dir "$dir"
# (77: not root, or no hugetlbfs here: the script says why and measures nothing)
rc=0; run bench/retrieve_vs_fio.sh --ferry "$build/ferry" --quick --dir "$dir" || rc=$?
[ $rc = 0 ] || [ $rc = 77 ]
if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then run bench/remote_vs_redis_benchmark.sh "$build" --quick; fi
run "$build/ferry" moe gen --model small --tokens 64 -o "$dir/moe_trace.jsonl"
run "$build/ferry" moe replay "$dir/moe_trace.jsonl" --slots 25% --policy routing --json
run "$build/ferry" moe replay "$dir/moe_trace.jsonl" --sweep --budgets 25%,50% --policies lru,routing,belady
run bench/moe_timeline.sh "$build" "$dir/moe_timeline" --quick
run "$build/ferry" moe bench --quick
run "$build/ferry" moe bench --quick --device host --json
run "$build/ferry" kv bench --model tiny --docs 4 --doc-tokens 2048 --questions 16 --l1 8M --dir "$dir" --l2 32M --json
run "$build/ferry" kv bench --model tiny --docs 4 --doc-tokens 2048 --questions 16 --l1 8M --dir "$dir/kvp" --create --l2 32M --persistent --persist-rounds 1 --no-refs --json
run "$build/ferry" kv bench --model tiny --docs 2 --doc-tokens 1024 --questions 8 --l1 8M --device host --paged 16 --no-refs --json
run "$build/ferry" kv bench --model tiny --docs 1 --doc-tokens 2048 --l1 8M --layerwise 2 --device host --paged 16
run "$build/ferry" kv bench --workload chat --model tiny --sessions 4 --turns 4 --turn-tokens 512 --l1 4M --policy s3fifo --no-refs --plot "$dir/kv_hit_rate.png"
run "$build/ferry" bench gds --dir "$dir" --size 64M --chunk 8M --rounds 1 --alloc-ops 200000
run "$build/ferry" bench gds --dir "$dir/d0" --dir "$dir/d1" --create --size 32M --chunk 4M --device host --rounds 1 --alloc-ops 100000 --json
FERRY_GPU_SH_DEVICE=host FERRY_GPU_SH_BUILD="$build" FERRY_GPU_SH_NO_BUILD=1 run bench/gpu.sh "$dir/gpu"
run jq -e '.steps | length > 0' "$dir/gpu/gpu-report.json"
run "$build/ferry" slab bench --dir "$dir" --chunks 5000 --count 8 --size 1M --batch 4 --json
if command -v redis-server >/dev/null; then (
  redis-server --port 0 --unixsocket "$dir/kv-redis.sock" --save '' --appendonly no --dir "$dir" --logfile "$dir/kv-redis.log" & rpid=$!
  trap 'kill $rpid 2>/dev/null || true; wait $rpid 2>/dev/null || true' EXIT
  for _ in $(seq 250); do [ -S "$dir/kv-redis.sock" ] && break; sleep 0.02; done
  run "$build/ferry" kv bench --model tiny --docs 4 --doc-tokens 2048 --questions 16 --l1 1M --remote "unix://$dir/kv-redis.sock" --json
); fi
FERRY_LIB="$build/libferry.so.0" run /usr/bin/python3 bench/py_prefill.py --rounds 1 --tokens 128 --layers 2 --dim 64 --chunk 32
FERRY_LIB="$build/libferry.so.0" run /usr/bin/python3 bench/py_prefill.py --rounds 1 --tokens 128 --layers 2 --dim 64 --chunk 32 --l2 "$dir/pyl2"
run "$build/kv_calls" --chunks 2 --lookup-tokens 4096 --iters 20
FERRY_LIB="$build/libferry.so.0" run /usr/bin/python3 bench/py_overhead.py --build "$build" --rounds 1 --chunks 2 --lookup-tokens 4096 --iters 20
(
  mkdir -p "$dir/serve-l2"
  "$build/ferry" serve --socket "$dir/ferry.sock" --model tiny --l1 64M --l2 "$dir/serve-l2:64M" & spid=$!
  trap 'kill $spid 2>/dev/null || true; wait $spid 2>/dev/null || true' EXIT
  for _ in $(seq 500); do "$build/ferry" serve status --socket "$dir/ferry.sock" >/dev/null 2>&1 && break; sleep 0.02; done
  run "$build/ferry" serve status --socket "$dir/ferry.sock"
  run "$build/ferry" kv bench --model tiny --docs 4 --doc-tokens 2048 --questions 16 --l1 8M --server "unix:$dir/ferry.sock" --clients 2 --no-refs --json
  run "$build/ferry" kv bench --model tiny --docs 1 --doc-tokens 2048 --l1 8M --server "unix:$dir/ferry.sock" --layerwise 2 --json
  kill -TERM $spid; wait $spid
)
