#!/usr/bin/env bash
# retrieve_vs_fio.sh - ferry's data paths against their references, in one
# run, with the goals they are held to (the goals live here and in the
# README, never in ferry's own output):
#
#   retrieve  the L2-only retrieve of a fresh client (`ferry kv bench
#             --cold 1`: 8 documents x 2048 tokens of Llama-3-8B KV, 32 MiB
#             chunks, a persistent L2 synced and reopened so every chunk
#             comes from the drive, an L1 of 8 and of 32 chunks, the engine
#             buffer plain host memory) against fio reading the same
#             directory (4 MiB x depth 16): the slab file ferry reads
#             (its first bytes, where the documents lie, read-only: the
#             same blocks) and a file fio wrote itself.  goal >= 0.90x fio
#             on the slab (the fresh file's ratio printed next to it)
#             and its CPU seconds per GB retrieved         goal <= 0.10
#   serve     the same retrieve through a `ferry serve` daemon (its
#             persistent L2 in the same directory, its L1 the smaller of
#             the two above; `ferry kv bench --server --cold 1`: a new
#             client process each round)             goal >= 0.90x fio
#   io        `ferry bench io --engine uring` write and read against fio,
#             8 MiB x depth 8 and 256 KiB x depth 32.    goal >= 0.95x fio
#             (ferry between two fio runs, against their mean; the
#             second fio's ratio to the first is the noise floor)
#   l1        L1 store and retrieve against memcpy of the same bytes
#             (`ferry kv bench`'s own reference).        goal >= 0.80x memcpy
#
# fio gets huge-page buffers as ferry's engines have (a hugetlbfs mount,
# --iomem=mmaphuge, registered files and buffers): with 4 KiB-page buffers
# it reads 2-3x slower on some VMs and swings between runs. Setting that up
# needs root; this script raises vm.nr_hugepages, mounts hugetlbfs on a
# temporary directory and undoes both on exit. Rounds alternate which side
# goes first (the retrieve rounds put fio before and after ferry and take
# the mean), so drift (other load, the host's cache) hits both alike; each
# round's ratio is ferry's figure over the reference measured next to it,
# and the summary gives the median and the range over the rounds, with the
# load average at the start and at the end.
#
# usage: bench/retrieve_vs_fio.sh [--ferry build/ferry] [--dir /var/tmp]
#                                 [--rounds 5] [--parts "retrieve serve io l1"]
#                                 [--base OLD/ferry] [--cold-args "ARGS"] [--quick]
#   --base:  another build (with `kv bench --cold`) whose retrieve runs in
#            the same rounds, next to this one: what a change gained (serve:
#            a daemon of each build, each its own L2 directory, taking turns)
#   --cold-args "ARGS": more arguments for this build's `kv bench --cold`
#            (not the base's), e.g. "--aligned-huge": the engine buffer
#            page-aligned in huge pages, read straight into (with --base
#            set to this same build: direct reads against the L1 path)
#   --quick: a short form for CI's smoke run (tiny sizes, 1 round; the
#            figures mean nothing then)
# needs: root, fio, jq
set -euo pipefail

ferry=build/ferry
dir=/var/tmp
rounds=5
parts="retrieve serve io l1"
quick=0
base=""
cold_args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --ferry) ferry=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --parts) parts=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --base) base=$2; shift 2 ;;
    --cold-args) read -r -a cold_args <<<"$2"; shift 2 ;;
    -h | --help) sed -n '2,46p' "$0"; exit 0 ;;
    *) echo "retrieve_vs_fio.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
for tool in fio jq; do
    command -v $tool >/dev/null || { echo "retrieve_vs_fio.sh: $tool is not installed" >&2; exit 2; }
done
[ -x "$ferry" ] || { echo "retrieve_vs_fio.sh: $ferry is not an executable (--ferry PATH)" >&2; exit 2; }
if [ "$(id -u)" != 0 ]; then
    echo "retrieve_vs_fio.sh: needs root to give fio huge-page buffers (hugetlbfs)" >&2
    exit 77
fi

# sizes: the issue's workload, or a toy one for --quick
if [ $quick = 1 ]; then
    rounds=1
    model=(--model tiny --docs 2 --doc-tokens 1024)
    srv_model=(--model tiny)
    l1s="512K 2M"
    l2=8M
    fio_size=16M
    io_size=32M
    io_cfgs="1M:4"
    l1_args=(--model tiny --docs 2 --doc-tokens 1024 --questions 4 --l1 8M)
else
    model=(--docs 8 --doc-tokens 2048)
    srv_model=(--model llama3-8b)
    l1s="256M 1G" # 8 and 32 chunks of 32 MiB
    l2=3G
    fio_size=2G
    io_size=2G
    io_cfgs="8M:8 256K:32"
    l1_args=(--docs 8 --doc-tokens 2048 --questions 32 --l1 1G)
fi

work=$(mktemp -d -p "$dir" ferry-retrieve-vs-fio-XXXXXX)
huge=$(mktemp -d /tmp/ferry-hugetlbfs-XXXXXX)
mounted=0
raised=0 # huge pages this run added (and takes away again)
pages() { cat /proc/sys/vm/nr_hugepages; }
cleanup() {
    if [ -f "$work/raised-pages" ]; then
        raised=$((raised + $(awk '$1 > 0 { s += $1 } END { print s + 0 }' "$work/raised-pages")))
    fi
    rm -rf "$work"
    if [ $mounted = 1 ]; then umount "$huge" || true; fi
    rmdir "$huge" 2>/dev/null || true
    # relative to the count now, not a saved one: another run of this
    # script may have raised (or given back) its own pages meanwhile
    if [ $raised -gt 0 ]; then
        local n=$(($(pages) - raised))
        echo $((n > 0 ? n : 0)) >/proc/sys/vm/nr_hugepages || true
    fi
}
trap cleanup EXIT
# 64 MiB of fio buffers at most (8 MiB x 8, 4 MiB x 16), 2 MiB pages
before=$(pages)
echo $((before + 48)) >/proc/sys/vm/nr_hugepages 2>/dev/null || true
raised=$(($(pages) - before))
raised=$((raised > 0 ? raised : 0))
if [ $raised -lt 40 ]; then
    echo "retrieve_vs_fio.sh: the kernel gave $raised more huge pages of 48 asked:" \
        "no like-for-like fio" >&2
    exit 77
fi
if ! mount -t hugetlbfs none "$huge"; then
    echo "retrieve_vs_fio.sh: cannot mount hugetlbfs on $huge (a container?): no like-for-like fio" >&2
    exit 77
fi
mounted=1
export FERRY_NO_PROGRESS=1
# every fio run finds its 64 MiB of huge pages free: another session's
# copy of this script (an older one restores the count it saved) may have
# taken the pool down meanwhile; what is added here is taken away on exit
ensure_pages() {
    local free n
    free=$(awk '/^HugePages_Free:/ { print $2 }' /proc/meminfo)
    [ "${free:-0}" -ge 40 ] && return 0
    n=$(pages)
    echo $((n + 48 - free)) >/proc/sys/vm/nr_hugepages 2>/dev/null || true
    # (fio often runs in a subshell, $(...): the count goes through a file)
    echo $(($(pages) - n)) >>"$work/raised-pages"
}
fio() { # (a pool taken down while fio maps its buffers fails it: again)
    local out try
    for try in 1 2 3; do
        ensure_pages
        out=$(command fio "$@") || true
        [ "${out:0:1}" = "{" ] && break
        echo "retrieve_vs_fio.sh: fio failed (${out%%$'\n'*}), try $try of 3" >&2
    done
    printf '%s\n' "$out"
}
fio_common=(--direct=1 --ioengine=io_uring --fixedbufs=1 --registerfiles=1
    "--iomem=mmaphuge:$huge/fio" --output-format=json)

load() { cut -d' ' -f1-3 /proc/loadavg; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }'; }
# median and range of the numbers on stdin: "median (min-max)"
stats() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END {
    if (NR == 0) { print "n/a"; exit }
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "%.3f (%.3f-%.3f, %d rounds)", m, v[1], v[NR], NR }'; }
median() { stats | cut -d' ' -f1; }
declare -A got goal
verdict() { # name ratios goal
    local m
    m=$(echo "$2" | median)
    got[$1]="$(echo "$2" | stats)"
    goal[$1]=$3
    printf '  %-34s %-34s goal >= %.2fx: %s\n' "$1" "${got[$1]}" "$3" \
        "$(awk -v m="$m" -v g="$3" 'BEGIN { print (m != "n/a" && m >= g) ? "met" : "NOT met" }')"
}

echo "retrieve_vs_fio.sh: $(date -u '+%F %T') UTC, load $(load), $(nproc) CPUs, dir $dir"
load0=$(load)

# ---- a: the L2-only retrieve against fio reading the same directory ----
declare -A rr rrs g rb gb cpu cpus
fio_read() { # file size bs depth [--readonly] -> GB/s
    fio --name=ref --filename="$1" --rw=read --size="$2" --bs="$3" --iodepth="$4" ${5:-} \
        "${fio_common[@]}" 2>/dev/null | jq -r '.jobs[0].read.bw_bytes / 1e9'
}
# fio reading the slab file ferry reads (its first SIZE bytes, where the
# documents' chunks lie; read-only): the same blocks of the same drive,
# laid out as ferry's writes left them. On a virtual disk a file's speed
# can depend on how it was written (on this VM fio once read a slab ferry
# had filled 5-7% slower than a file it had just written itself; in other
# runs the two matched), so this is the like-for-like reference; the
# fresh file's figure is printed next to it.
slab_read() { # (at most the file's size, in whole 4 MiB reads)
    local n
    n=$(stat -c %s "$1")
    n=$((n / 4194304 * 4194304))
    fio_read "$1" $((n < $(numfmt --from=iec $fio_size) ? n : $(numfmt --from=iec $fio_size))) 4M 16 --readonly
}
mean2() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.4f", (a + b) / 2 }'; }
cold() { # l1 [binary] -> GB/s of one round (its CPU seconds per GB: work/cold-this|base.out)
    # each build its own slab: a base of another slab format neither reads
    # nor writes this one's
    local sub=this extra=("${cold_args[@]}")
    [ -n "${2:-}" ] && sub=base && extra=()
    mkdir -p "$work/$sub"
    "${2:-$ferry}" kv bench "${model[@]}" --l1 "$1" --dir "$work/$sub" --l2 $l2 --cold 1 \
        "${extra[@]}" --json |
        jq -r '.cold_l2_retrieve | "\(.median_gb_per_s) \(.rounds[0].cpu_s / (.rounds[0].bytes / 1e9))"' \
            >"$work/cold-$sub.out"
    cut -d' ' -f1 "$work/cold-$sub.out"
}
if [[ " $parts " == *" retrieve "* ]]; then
    echo
    echo "L2-only retrieve (kv bench --cold, L1 $l1s) against fio read (4 MiB x 16, huge pages):"
    fio --name=ref --filename="$work/fio.bin" --rw=write --size=$fio_size --bs=4M --iodepth=16 \
        "${fio_common[@]}" >/dev/null 2>&1
    for l1 in $l1s; do cold "$l1" >/dev/null; done # the store, filled once (and a warm-up)
    slab="$work/this/ferry-kv-bench-cold/ferry_pslab.bin"
    for ((i = 1; i <= rounds; i++)); do
        # fio before and after the retrieves (their mean is the round's
        # reference: a drive that stalls for a moment shows in both sides)
        line="  round $i (load $(cut -d' ' -f1 /proc/loadavg)):"
        f1=$(fio_read "$work/fio.bin" $fio_size 4M 16)
        s1=$(slab_read "$slab")
        for l1 in $l1s; do # (this build and the base take turns going first)
            if [ -n "$base" ] && ! ((i % 2)); then gb[$l1]=$(cold "$l1" "$base"); fi
            g[$l1]=$(cold "$l1")
            cpu[$l1]=$(cut -d' ' -f2 "$work/cold-this.out")
            if [ -n "$base" ] && ((i % 2)); then gb[$l1]=$(cold "$l1" "$base"); fi
        done
        f2=$(fio_read "$work/fio.bin" $fio_size 4M 16)
        s2=$(slab_read "$slab")
        f=$(mean2 "$f1" "$f2")
        fs=$(mean2 "$s1" "$s2")
        line+=" fio $(printf %.2f "$f1")/$(printf %.2f "$f2") GB/s, on the slab $(printf %.2f "$s1")/$(printf %.2f "$s2")"
        for l1 in $l1s; do
            r=$(ratio "${g[$l1]}" "$f")
            rr[$l1]+="$r "
            rs=$(ratio "${g[$l1]}" "$fs")
            rrs[$l1]+="$rs "
            cpus[$l1]+="${cpu[$l1]} "
            line+=", L1 $l1: $(printf %.2f "${g[$l1]}") GB/s = ${r}x (${rs}x the slab's), $(printf %.3f "${cpu[$l1]}") CPU s/GB"
            if [ -n "$base" ]; then
                r=$(ratio "${gb[$l1]}" "$f")
                rb[$l1]+="$r "
                line+=" (base $(printf %.2f "${gb[$l1]}") = ${r}x)"
            fi
        done
        echo "$line"
    done
    rm -f "$work/fio.bin"
fi

# ---- a2: the same retrieve through a daemon against fio ----
srv_r=""
srv_rs=""
srv_rb=""
if [[ " $parts " == *" serve "* ]]; then
    echo
    srv_l1=${l1s%% *}
    echo "L2-only retrieve through ferry serve (L1 $srv_l1, L2 $l2 in the same directory) against fio read:"
    fio --name=ref --filename="$work/fio.bin" --rw=write --size=$fio_size --bs=4M --iodepth=16 \
        "${fio_common[@]}" >/dev/null 2>&1
    # the daemon's pool in huge pages too (MFD_HUGETLB), as fio's buffers
    # and an in-process L1 are: its size in 2 MiB pages, added for this run
    pool_pages=$(numfmt --from=iec "$srv_l1" | awk '{ printf "%d", int(($1 + 2097151) / 2097152) }')
    # one daemon of this build and, with --base, one of the base build
    # (each its own L2 directory and pool), taking turns in each round
    declare -A spid
    srv_start() { # name binary
        mkdir -p "$work/serve-l2-$1"
        local n
        n=$(pages)
        echo $((n + pool_pages)) >/proc/sys/vm/nr_hugepages 2>/dev/null || true
        echo $(($(pages) - n)) >>"$work/raised-pages"
        "$2" serve --socket "$work/ferry-$1.sock" "${srv_model[@]}" --l1 "$srv_l1" \
            --l2 "$work/serve-l2-$1:$l2" 2>"$work/serve-$1.log" &
        spid[$1]=$!
        for _ in $(seq 300); do
            "$2" serve status --socket "$work/ferry-$1.sock" >/dev/null 2>&1 && break
            sleep 0.1
        done
        if grep -q "is in 4 KiB pages" "$work/serve-$1.log"; then
            echo "  (the $1 daemon's pool is in 4 KiB pages: the kernel gave too few huge pages)"
        else
            echo "  (the $1 daemon's pool is in huge pages)"
        fi
    }
    srv_cold() { # name binary -> GB/s
        "$2" kv bench "${model[@]}" --server "unix:$work/ferry-$1.sock" --server-timeout 30000 \
            --cold 1 --json | jq -r '.cold_l2_retrieve.median_gb_per_s'
    }
    srv_start this "$ferry"
    srv_cold this "$ferry" >/dev/null # the documents stored through it once (and a warm-up)
    if [ -n "$base" ]; then
        srv_start base "$base"
        srv_cold base "$base" >/dev/null
    fi
    for ((i = 1; i <= rounds; i++)); do
        f1=$(fio_read "$work/fio.bin" $fio_size 4M 16)
        s1=$(slab_read "$work/serve-l2-this/ferry_pslab.bin")
        # (this build and the base take turns going first)
        if [ -n "$base" ] && ! ((i % 2)); then gsb=$(srv_cold base "$base"); fi
        gs=$(srv_cold this "$ferry")
        if [ -n "$base" ] && ((i % 2)); then gsb=$(srv_cold base "$base"); fi
        f2=$(fio_read "$work/fio.bin" $fio_size 4M 16)
        s2=$(slab_read "$work/serve-l2-this/ferry_pslab.bin")
        f=$(mean2 "$f1" "$f2")
        r=$(ratio "$gs" "$f")
        srv_r+="$r "
        fs=$(mean2 "$s1" "$s2")
        rs=$(ratio "$gs" "$fs")
        srv_rs+="$rs "
        line=$(printf '  round %d (load %s): fio %.2f/%.2f GB/s, on the slab %.2f/%.2f, through the daemon %.2f GB/s = %sx (%sx the slab'"'"'s)' \
            "$i" "$(cut -d' ' -f1 /proc/loadavg)" "$f1" "$f2" "$s1" "$s2" "$gs" "$r" "$rs")
        if [ -n "$base" ]; then
            rb=$(ratio "$gsb" "$fs")
            srv_rb+="$rb "
            line+=" (base $(printf %.2f "$gsb") = ${rb}x the slab's)"
        fi
        echo "$line"
    done
    for k in "${!spid[@]}"; do kill -TERM "${spid[$k]}"; done
    for k in "${!spid[@]}"; do wait "${spid[$k]}" || true; done
    rm -f "$work/fio.bin"
fi

# ---- b: bench io against fio, write and read ----
declare -A io
if [[ " $parts " == *" io "* ]]; then
    echo
    echo "ferry bench io (uring) against fio (io_uring, huge pages), size $io_size:"
    for ((i = 1; i <= rounds; i++)); do
        for cfg in $io_cfgs; do
            bs=${cfg%:*}
            depth=${cfg#*:}
            # every run starts on a settled drive: the write-back and
            # the freed extents of the run before it otherwise land in the
            # next one's time (sync and 3 s apart, 256 KiB x 32 writes
            # alternating: ferry 2.1-3.1 GB/s, fio 2.0-2.5; back to back,
            # whichever follows a write and delete loses 10-30%)
            settle() { sync; sleep 3; }
            fio_wr() {
                settle
                fw=$(fio --name=ref --filename="$work/fio.bin" --rw=write --size=$io_size --bs="$bs" \
                    --iodepth="$depth" "${fio_common[@]}" 2>/dev/null | jq -r '.jobs[0].write.bw_bytes / 1e9')
                fr=$(fio_read "$work/fio.bin" $io_size "$bs" "$depth")
                rm -f "$work/fio.bin"
            }
            ferry_wr() {
                settle
                out=$("$ferry" bench io --engine uring --size $io_size --chunk "$bs" --depth "$depth" \
                    --dir "$work" --json)
                mw=$(jq -r .write.gb_per_s <<<"$out")
                mr=$(jq -r .read.gb_per_s <<<"$out")
            }
            # ferry between two runs of fio, against their mean, so the
            # reference sits on both sides of it; fio's second run against
            # its first shows how far two neighbours differ here
            fio_wr; fw1=$fw; fr1=$fr; ferry_wr; fio_wr
            cw=$(ratio "$fw" "$fw1")
            cr=$(ratio "$fr" "$fr1")
            fw=$(awk -v a="$fw1" -v b="$fw" 'BEGIN { printf "%.3f", (a + b) / 2 }')
            fr=$(awk -v a="$fr1" -v b="$fr" 'BEGIN { printf "%.3f", (a + b) / 2 }')
            rw=$(ratio "$mw" "$fw")
            rd=$(ratio "$mr" "$fr")
            io[$cfg.w]+="$rw "
            io[$cfg.r]+="$rd "
            io[$cfg.cw]+="$cw "
            io[$cfg.cr]+="$cr "
            printf '  round %d %-7s (load %s): write fio %.2f (mean) ferry %.2f = %sx (fio 2nd/1st %s), read fio %.2f ferry %.2f = %sx (fio 2nd/1st %s)\n' \
                "$i" "$cfg" "$(cut -d' ' -f1 /proc/loadavg)" "$fw" "$mw" "$rw" "$cw" "$fr" "$mr" "$rd" "$cr"
        done
    done
fi

# ---- c: L1 store and retrieve against memcpy ----
l1st=""
l1rt=""
if [[ " $parts " == *" l1 "* ]]; then
    echo
    echo "L1 store and retrieve against memcpy (kv bench's references, no L2):"
    for ((i = 1; i <= rounds; i++)); do
        j=$("$ferry" kv bench "${l1_args[@]}" --json)
        s=$(jq -r '.references.l1_store_ratio' <<<"$j")
        t=$(jq -r '.references.l1_retrieve_ratio' <<<"$j")
        l1st+="$s "
        l1rt+="$t "
        printf '  round %d (load %s): memcpy %.2f GB/s, store %.2f = %.3fx, retrieve %.2f = %.3fx\n' "$i" \
            "$(cut -d' ' -f1 /proc/loadavg)" "$(jq -r .references.memcpy_gb_per_s <<<"$j")" \
            "$(jq -r .references.l1_store_gb_per_s <<<"$j")" "$s" \
            "$(jq -r .references.l1_retrieve_gb_per_s <<<"$j")" "$t"
    done
fi

echo
echo "summary (median (min-max) of the rounds' ratios; load $load0 at the start, $(load) at the end):"
for l1 in $l1s; do
    [ -n "${rrs[$l1]:-}" ] && verdict "L2 retrieve, L1 $l1 / fio, the slab" "${rrs[$l1]}" 0.90
    [ -n "${rr[$l1]:-}" ] && verdict "  (/ fio, a file fio wrote)" "${rr[$l1]}" 0.90
    [ -n "${rb[$l1]:-}" ] && verdict "  (base build, L1 $l1 / fio read)" "${rb[$l1]}" 0.90
    # (not a ratio: CPU seconds per GB, at most)
    [ -n "${cpus[$l1]:-}" ] && printf '  %-34s %-34s goal <= 0.10: %s\n' \
        "  CPU s/GB of that retrieve" "$(echo "${cpus[$l1]}" | stats)" \
        "$(echo "${cpus[$l1]}" | median | awk '{ print ($1 != "n/a" && $1 <= 0.10) ? "met" : "NOT met" }')"
done
[ -n "$srv_rs" ] && verdict "L2 retrieve through serve / fio, slab" "$srv_rs" 0.90
[ -n "$srv_r" ] && verdict "  (/ fio, a file fio wrote)" "$srv_r" 0.90
[ -n "$srv_rb" ] && verdict "  (base build through serve / slab)" "$srv_rb" 0.90
for cfg in $io_cfgs; do
    [ -n "${io[$cfg.w]:-}" ] && verdict "bench io write $cfg / fio" "${io[$cfg.w]}" 0.95
    [ -n "${io[$cfg.r]:-}" ] && verdict "bench io read $cfg / fio" "${io[$cfg.r]}" 0.95
    [ -n "${io[$cfg.cw]:-}" ] && printf '  %-34s %s\n' "  (fio 2nd / 1st, write $cfg)" \
        "$(echo "${io[$cfg.cw]}" | stats)"
    [ -n "${io[$cfg.cr]:-}" ] && printf '  %-34s %s\n' "  (fio 2nd / 1st, read $cfg)" \
        "$(echo "${io[$cfg.cr]}" | stats)"
done
[ -n "$l1st" ] && verdict "L1 store / memcpy" "$l1st" 0.80
[ -n "$l1rt" ] && verdict "L1 retrieve / memcpy" "$l1rt" 0.80
exit 0
