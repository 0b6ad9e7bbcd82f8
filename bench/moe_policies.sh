#!/usr/bin/env bash
# Expert-cache policies against Belady on the generator's default traces:
# hit-rate tables at 12.5% and 25% of all experts for each model preset,
# a sweep plot per preset, the online ceiling (bench/moe_ceiling.c), and the
# planner/executor benchmark.
# usage: bench/moe_policies.sh BUILD_DIR [OUT_DIR] [--quick]
set -euo pipefail
build=${1:-build}
out=${2:-$(mktemp -d -p /var/tmp ferry-moe-XXXXXX)}
quick=${3:-}
mkdir -p "$out"
ferry="$build/ferry"
tokens=2048
[ "$quick" = "--quick" ] && tokens=128
for model in deepseek-v3 qwen3-30b-a3b mixtral-8x7b; do
    trace="$out/$model.jsonl"
    echo "== $model ($tokens tokens, seed 1)"
    "$ferry" moe gen --model "$model" --tokens "$tokens" --seed 1 -o "$trace"
    plot=()
    command -v gnuplot >/dev/null && plot=(--plot "$out/$model.png")
    "$ferry" moe replay "$trace" --sweep --budgets 12.5%,25% "${plot[@]}"
done
echo "== online ceiling: eviction by the generator's true next-turn probabilities"
"$build/moe_ceiling" --tokens "$tokens"
echo "== planner and executor"
if [ "$quick" = "--quick" ]; then "$ferry" moe bench --quick; else "$ferry" moe bench; fi
echo "output in $out"
