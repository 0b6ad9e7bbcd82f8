#!/usr/bin/env bash
# The decode timeline (`ferry moe sim`) on the generator's traces, in one
# run: per budget, LRU, the routing policy and auto (the default) without
# and with hints one layer ahead (90% right), next to every expert resident
# and Belady's misses on an ideal link; then the value of a hint by horizon
# and accuracy; a plot of stall against budget per model.
#  - qwen3-30b-a3b experts (9.4 MB, bf16) on a 50 GB/s host link (PCIe 5),
#    300 us of compute per layer-step: the link about as fast as compute;
#  - deepseek-v3 experts (44 MB, fp8) at 25 GB/s, 100 us per layer-step:
#    the link 18x slower than compute, where one layer of lead cannot pay
#    for a wrong row.
# usage: bench/moe_timeline.sh BUILD_DIR [OUT_DIR] [--quick]
set -euo pipefail
build=${1:-build}
out=${2:-$(mktemp -d -p /var/tmp ferry-moe-sim-XXXXXX)}
quick=${3:-}
mkdir -p "$out"
ferry="$build/ferry"
tokens=256
[ "$quick" = "--quick" ] && tokens=32
export FERRY_NO_PROGRESS=1
plot() { command -v gnuplot >/dev/null && echo --plot "$1" || true; }
"$ferry" moe gen --model qwen3-30b-a3b --tokens "$tokens" --seed 1 -o "$out/qwen.jsonl" >/dev/null
"$ferry" moe gen --model deepseek-v3 --tokens "$tokens" --seed 1 -o "$out/ds.jsonl" >/dev/null
echo "== qwen3-30b-a3b, $tokens tokens: 300 us compute, 50 GB/s"
"$ferry" moe sim "$out/qwen.jsonl" --budgets 6.25%,12.5%,25%,50% --policies lru,routing,auto \
    --compute-us 300 --link-gbs 50 $(plot "$out/qwen-stall.png")
echo "== deepseek-v3, $tokens tokens: 100 us compute, 25 GB/s"
"$ferry" moe sim "$out/ds.jsonl" --budgets 6.25%,12.5%,25% --policies lru,routing,auto \
    --compute-us 100 --link-gbs 25 $(plot "$out/ds-stall.png")
echo "== qwen3-30b-a3b, half the experts on NVMe at 12 GB/s (host 50 GB/s, 300 us)"
"$ferry" moe sim "$out/qwen.jsonl" --budgets 12.5%,25% --policies lru,routing,auto \
    --compute-us 300 --link-gbs 50 --nvme-share 0.5 --nvme-gbs 12
echo "== qwen3-30b-a3b at 25%: LRU with hints by horizon (layer-steps) and accuracy"
for h in 1 2 48; do
    for a in 0.5 0.9 1; do
        printf 'hint-steps %-3s accuracy %-4s ' "$h" "$a"
        "$ferry" moe sim "$out/qwen.jsonl" --budgets 25% --policies lru --compute-us 300 \
            --link-gbs 50 --hint-steps "$h" --hint-accuracy "$a" | grep 'lru+hints' |
            awk '{print "stall", $5, "ms, tokens/s", $4}'
    done
done
echo "output in $out"
