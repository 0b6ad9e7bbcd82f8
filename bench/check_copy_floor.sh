#!/usr/bin/env bash
# check_copy_floor.sh - a copying retrieve's CPU per GB against its floor,
# in one run: `ferry kv bench --cold` (the L2-only retrieve of 8 documents
# x 2048 tokens of Llama-3-8B into plain malloc memory: its CPU s/GB and
# the split) next to build/check_copy_floor (ferry's fused check and copy
# alone over the same slab's bytes: no reads in flight), alone and with
# fio reading the drive beside it, as the drive does during a retrieve.
# The retrieve's goal (issue 26: <= 0.10 CPU s/GB into host memory) can
# only be met where the floor with the drive busy leaves room for the
# reads' own handling ("the rest").
#
# usage: bench/check_copy_floor.sh [--build build] [--dir /var/tmp] [--rounds 3]
# needs: fio, jq
set -euo pipefail
build=build
dir=/var/tmp
rounds=3
while [ $# -gt 0 ]; do
    case "$1" in
    --build) build=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "check_copy_floor.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
for tool in fio jq; do
    command -v $tool >/dev/null || { echo "check_copy_floor.sh: $tool is not installed" >&2; exit 2; }
done
for x in "$build/ferry" "$build/check_copy_floor"; do
    [ -x "$x" ] || { echo "check_copy_floor.sh: $x is not built" >&2; exit 2; }
done
work=$(mktemp -d "$dir/ferry-floor-XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "check_copy_floor.sh: $(date -u '+%F %T') UTC, load $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs, dir $dir"
cold=(kv bench --docs 8 --doc-tokens 2048 --dir "$work" --l2 3G --l1 256M --json)
"$build/ferry" "${cold[@]}" --cold 1 >/dev/null # the documents stored once
slab=$work/ferry-kv-bench-cold/ferry_pslab.bin
for ((i = 1; i <= rounds; i++)); do
    "$build/ferry" "${cold[@]}" --cold 1 | jq -r '.cold_l2_retrieve.rounds[] |
        "retrieve: \(.gb_per_s * 100 | round / 100) GB/s, \(.cpu_s / .bytes * 1e9 * 1000 | round / 1000) CPU s/GB (checking \(.check_s / .bytes * 1e9 * 1000 | round / 1000), copying \(.copy_s / .bytes * 1e9 * 1000 | round / 1000))"'
    echo "floor, the drive idle:"
    "$build/check_copy_floor" "$slab" 1 1 2>/dev/null | sed -n 's/^round 1: /  /p'
    fio --name=busy --filename="$slab" --rw=read --bs=4M --iodepth=16 --direct=1 \
        --ioengine=io_uring --readonly --time_based --runtime=30 >/dev/null 2>&1 &
    fpid=$!
    sleep 1
    echo "floor, fio reading the drive beside it:"
    "$build/check_copy_floor" "$slab" 1 1 2>/dev/null | sed -n 's/^round 1: /  /p'
    kill "$fpid" 2>/dev/null || true
    wait "$fpid" 2>/dev/null || true
done
