#!/bin/sh
# moe_real_traces.sh - replay published routing traces of real MoE models
# (issue 15: judge the default policy on real decode routing, not only on
# the generator).
#
#   bench/moe_real_traces.sh [--granite FILE] [--olmoe DIR] [--mixtral DIR] [--ferry F] [--out DIR]
#
# Neither source is kept in ferry; fetch them from the commits cited here
# (and in bench/moe_convert_trace.py, which converts them):
#
#   --granite  scripts/moe_expert_trace.json of github.com/justinchuby/onnx-genai
#              at 44604f3187bad3e415c21fb523da171675f0e135 (granite-3.0-1b-a400m-
#              instruct, 24 layers x 32 experts, top-8; 3 prompts x 64 greedy
#              decode tokens, prefill per token too):
#                git -C onnx-genai show 44604f3187bad3e415c21fb523da171675f0e135:scripts/moe_expert_trace.json > granite.json
#   --olmoe    stage3_residency/traces/full/chunks of github.com/helloimrizy-pages/opt
#              at cdd89062f93bb6e7b04fdd25a602757d542a1ad7 (OLMoE-1B-7B-0924, 16 layers
#              x 64 experts, top-8; 400 prompts in 4 domains, greedy decode up to
#              128 tokens, 51,112 tokens; needs numpy):
#                git -C opt archive cdd89062f93bb6e7b04fdd25a602757d542a1ad7 stage3_residency/traces/full/chunks | tar -x
#   --mixtral  a directory holding gsm8k_2_routing.jsonl and humaneval_2_routing.jsonl of
#              routing_data_collected/ in github.com/Mario928/speculative-moe at
#              216e26eb86ee09fa46bb0e8c000be7e9758e10b6 (Mixtral-8x7B-Instruct FP8 in
#              vLLM, 32 layers x 8 experts, top-2; 2 GSM8K and 2 HumanEval problems,
#              greedy decode, 78-252 whole tokens each; later commits hold them in LFS):
#                for f in gsm8k_2 humaneval_2; do git -C speculative-moe show \
#                  216e26eb86ee09fa46bb0e8c000be7e9758e10b6:routing_data_collected/${f}_routing.jsonl > DIR/${f}_routing.jsonl; done
#
# --ferry defaults to build/ferry, --out (the converted traces) to a new
# temporary directory; PYTHON names the interpreter (default: the first of
# python3, /usr/bin/python3 that has numpy). Prints, per trace and budget,
# the hit rates of lru, successor, trio, auto (the default) and belady,
# auto - lru in points,
# auto's share of the LRU -> Belady gap, and the two checks: at
# 12.5% auto >= LRU + 15% of the gap, at 25% auto no more than 0.2 points
# below LRU.
set -eu

granite='' olmoe='' mixtral='' ferry=build/ferry out=''
while [ $# -gt 0 ]; do
    case $1 in
    --granite) granite=$2; shift 2 ;;
    --olmoe) olmoe=$2; shift 2 ;;
    --mixtral) mixtral=$2; shift 2 ;;
    --ferry) ferry=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: moe_real_traces.sh [--granite FILE] [--olmoe DIR] [--mixtral DIR] [--ferry F] [--out DIR]" >&2
       exit 2 ;;
    esac
done
[ -n "$granite$olmoe$mixtral" ] || { echo "moe_real_traces.sh: give --granite, --olmoe and/or --mixtral" >&2; exit 2; }
[ -x "$ferry" ] || { echo "moe_real_traces.sh: $ferry: not an executable (build it first)" >&2; exit 2; }
here=$(dirname "$0")
[ -n "$out" ] || out=$(mktemp -d)
mkdir -p "$out"
if [ -z "${PYTHON:-}" ]; then
    for p in python3 /usr/bin/python3; do
        if "$p" -c 'import numpy' 2>/dev/null; then PYTHON=$p; break; fi
    done
    PYTHON=${PYTHON:-python3}
fi

traces=
conv() { # name format src option...
    name=$1 fmt=$2 src=$3
    shift 3
    "$PYTHON" "$here/moe_convert_trace.py" --format "$fmt" "$src" "$@" -o "$out/$name.jsonl"
    traces="$traces $name"
}
if [ -n "$granite" ]; then
    conv granite-all-decode onnx-genai "$granite" --prompt all
    conv granite-prose-decode onnx-genai "$granite" --prompt english_prose
    conv granite-code-decode onnx-genai "$granite" --prompt code
    conv granite-math-decode onnx-genai "$granite" --prompt math
    conv granite-all-prefill-decode onnx-genai "$granite" --prompt all --prefill batch
fi
if [ -n "$olmoe" ]; then
    for d in all general coding math reasoning; do
        conv olmoe-$d-decode olmoe-race "$olmoe" --domain $d
    done
fi
if [ -n "$mixtral" ]; then
    for d in gsm8k humaneval; do
        conv mixtral-$d-decode vllm-jsonl "$mixtral/${d}_2_routing.jsonl" --problem all
        for p in 0 1; do
            conv mixtral-$d-p$p-decode vllm-jsonl "$mixtral/${d}_2_routing.jsonl" --problem $p
        done
    done
fi

for t in $traces; do
    for s in 12.5% 25%; do
        for p in lru successor trio auto; do
            printf '%s %s %s ' "$t" "$s" "$p"
            "$ferry" moe replay "$out/$t.jsonl" --slots "$s" --policy "$p" --json | tr -d '\n'
            echo
        done
    done
done | "$PYTHON" -c '
import json, sys
rows = {}
for line in sys.stdin:
    t, s, p, js = line.split(" ", 3)
    d = json.loads(js)
    r = rows.setdefault((t, s), {"slots": d["slots"]})
    r[p] = 100.0 * d["hit_rate"]
    r["belady"] = 100.0 * d["belady"]["hit_rate"]
print("| trace | slots | lru | successor | trio | auto | belady | auto - lru | share of gap | check |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (t, s), r in rows.items():
    gap = r["belady"] - r["lru"]
    d = r["auto"] - r["lru"]
    share = "%.1f%%" % (100.0 * d / gap) if gap > 0 else "-"
    if s == "12.5%":
        need = r["lru"] + 0.15 * gap
        chk = "%s (>= %.2f)" % ("ok" if r["auto"] >= need else "MISS", need)
    else:
        chk = "ok" if d >= -0.2 else "MISS"
    print("| %s | %s (%d) | %.2f | %.2f | %.2f | %.2f | %.2f | %+.2f | %s | %s |" % (
        t, s, r["slots"], r["lru"], r["successor"], r["trio"], r["auto"], r["belady"], d, share,
        chk))
'
