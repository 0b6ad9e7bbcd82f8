#!/usr/bin/env bash
# vs_fio.sh - ferry's I/O engines against fio, the reference for "what the
# drive can do". Each round runs fio (ioengine=io_uring, direct=1, rw=write
# then rw=read, same size, bs=chunk, iodepth=depth) and then
# `ferry bench io --json` for each engine, alternately, so drift (other load,
# drive temperature, page cache state) hits both alike. Prints each round
# and the median ratio ferry/fio for write and read per engine.
#
# fio gets the same io_uring features ferry's uring engine uses (registered
# buffers and files: --fio-opts "--fixedbufs=1 --registerfiles=1" by
# default), so the reference is fio at its best, not its defaults; pass
# --fio-opts "" for fio's defaults.
#
# usage: bench/vs_fio.sh [--ferry PATH] [--size 2G] [--chunk 8M] [--depth 8]
#                        [--dir /var/tmp] [--rounds 5] [--engines "uring posix"]
#                        [--fio-opts "--fixedbufs=1 --registerfiles=1"]
# needs: fio, jq
set -euo pipefail

ferry=build/ferry
size=2G
chunk=8M
depth=8
dir=/var/tmp
rounds=5
engines="uring posix"
fio_opts="--fixedbufs=1 --registerfiles=1"
while [ $# -gt 0 ]; do
    case "$1" in
    --ferry) ferry=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --chunk) chunk=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --engines) engines=$2; shift 2 ;;
    --fio-opts) fio_opts=$2; shift 2 ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "vs_fio.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
for tool in fio jq; do
    command -v $tool >/dev/null || { echo "vs_fio.sh: $tool is not installed" >&2; exit 2; }
done
[ -x "$ferry" ] || { echo "vs_fio.sh: $ferry is not an executable (--ferry PATH)" >&2; exit 2; }

work=$(mktemp -d -p "$dir" ferry-vs-fio-XXXXXX)
trap 'rm -rf "$work"' EXIT
export FERRY_NO_PROGRESS=1

fio_run() { # rw -> GB/s
    fio --name=ferry-ref --filename="$work/fio.bin" --rw="$1" --bs="$chunk" --iodepth="$depth" \
        --size="$size" --direct=1 --ioengine=io_uring $fio_opts --output-format=json 2>/dev/null |
        jq -r --arg rw "$1" '.jobs[0][if $rw == "write" then "write" else "read" end].bw_bytes / 1e9'
}

declare -A ratios
printf '%-6s %-7s %10s %10s %10s %10s %8s %8s\n' round engine fio_w ferry_w fio_r ferry_r w_ratio r_ratio
for ((i = 1; i <= rounds; i++)); do
    fw=$(fio_run write)
    fr=$(fio_run read)
    rm -f "$work/fio.bin"
    for e in $engines; do
        out=$("$ferry" bench io --engine "$e" --size "$size" --chunk "$chunk" --depth "$depth" \
            --dir "$work" --json)
        if [ "$(echo "$out" | jq -r 'has("error")')" = true ]; then
            echo "round $i: $e: $(echo "$out" | jq -r .error)" >&2
            continue
        fi
        mw=$(echo "$out" | jq -r .write.gb_per_s)
        mr=$(echo "$out" | jq -r .read.gb_per_s)
        rw=$(awk -v a="$mw" -v b="$fw" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }')
        rr=$(awk -v a="$mr" -v b="$fr" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }')
        ratios[$e.w]+="$rw "
        ratios[$e.r]+="$rr "
        printf '%-6s %-7s %10.3f %10.3f %10.3f %10.3f %8s %8s\n' "$i" "$e" "$fw" "$mw" "$fr" "$mr" "$rw" "$rr"
    done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END {
    if (NR == 0) { print "n/a"; exit } print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo
echo "median ferry/fio over $rounds rounds (size $size, chunk $chunk, depth $depth, $dir, fio $fio_opts):"
for e in $engines; do
    printf '  %-6s write %s  read %s\n' "$e" "$(echo "${ratios[$e.w]:-}" | median)" \
        "$(echo "${ratios[$e.r]:-}" | median)"
done
