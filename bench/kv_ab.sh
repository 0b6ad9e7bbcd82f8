#!/usr/bin/env bash
# kv_ab.sh - two builds of ferry, A and B, on the same `ferry kv bench` in
# alternating runs (A B A B ...), so drift on the machine (other load, the
# drive's cache, the VM's neighbours) hits both alike. Each run measures
# its own L2 retrieve against `bench io` reads of the same slab (15
# alternating rounds inside the run); this script prints every run's
# median ratio and, per build, the median over its runs, and B/A of those
# medians: what B costs or gains over A on the L2 retrieve path.
#
# Typical use: the cost of a change, A = a build of the commit before it
# (git worktree add /tmp/a <commit> && cmake -S /tmp/a -B /tmp/a/build &&
# cmake --build /tmp/a/build --target ferry_cli), B = this tree's build.
#
# usage: bench/kv_ab.sh --a PATH --b PATH [--runs 6] [--dir /var/tmp/fbk]
#                       [-- extra kv bench flags]
# default workload: --docs 8 --doc-tokens 2048 --questions 32 --l1 1G --l2 2G
# needs: jq
set -euo pipefail

a=""
b=""
runs=6
dir=/var/tmp/fbk
extra=(--docs 8 --doc-tokens 2048 --questions 32 --l1 1G --l2 2G)
while [ $# -gt 0 ]; do
    case "$1" in
    --a) a=$2; shift 2 ;;
    --b) b=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "kv_ab.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
if [ -z "$a" ] || [ -z "$b" ]; then
    echo "kv_ab.sh: --a and --b (two ferry binaries) are required" >&2
    exit 2
fi
mkdir -p "$dir"

median() { sort -g | awk '{v[NR]=$1} END {if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }

ra=()
rb=()
for ((i = 1; i <= runs; i++)); do
    for which in a b; do
        bin=$a
        [ "$which" = b ] && bin=$b
        j=$("$bin" kv bench "${extra[@]}" --dir "$dir" --json 2>/dev/null)
        r=$(jq -r '.references.l2_retrieve_ratio' <<<"$j")
        io=$(jq -r '[.references.l2_rounds[].io_read_gb_per_s] | sort | .[length/2|floor]' <<<"$j")
        rt=$(jq -r '.references.l2_retrieve_gb_per_s' <<<"$j")
        printf 'run %d %s: L2 retrieve %.2f GB/s, bench io %.2f GB/s, ratio %.3f (load %s)\n' \
            "$i" "$which" "$rt" "$io" "$r" "$(cut -d' ' -f1 /proc/loadavg)"
        if [ "$which" = a ]; then ra+=("$r"); else rb+=("$r"); fi
    done
done
ma=$(printf '%s\n' "${ra[@]}" | median)
mb=$(printf '%s\n' "${rb[@]}" | median)
printf 'A median ratio %.3f over %d runs: %s\n' "$ma" "$runs" "${ra[*]}"
printf 'B median ratio %.3f over %d runs: %s\n' "$mb" "$runs" "${rb[*]}"
awk -v a="$ma" -v b="$mb" 'BEGIN { printf "B/A %.3f (%+.1f%%)\n", b / a, (b / a - 1) * 100 }'
