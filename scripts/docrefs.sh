#!/usr/bin/env bash
# docrefs.sh - keep the docs true to the tree: what README.md and docs/*.md
# name must exist, and the public headers' comments name no function that
# is not declared.
#  - paths (src/..., tests/..., bench/..., python/..., tools/..., docs/...,
#    scripts/..., include/..., fuzz/...; in ARCHITECTURE.md also a layer's
#    own paths, kv/op.c, and bare file names, slots.c): a file, directory or
#    glob of the tree (a test's path without .c names its binary)
#  - identifiers ferry_*, ferry__*, FERRY_*: somewhere in the code, tests,
#    tools or the Python package (the two the conventions call gone aside)
#  - test names test_*: a test file or a name in one
#  - flags given to a ferry command, on a code line that runs one (its
#    synopsis continued on lines opening with "[") or in a backticked span
#    that starts with one (`ferry kv bench --l1 2G`, `moe replay --sweep`):
#    in that command's --help; flags given to a bench/ or scripts/ script:
#    in the script
#  - include/ferry.h, include/ferry/*.h: a lowercase ferry_* name in a
#    comment is declared in the headers' code
#
# usage: scripts/docrefs.sh [BUILD]   (default: build; BUILD/ferry answers
# the --help questions)
# exit 0: every reference holds; 1: each stale one listed; 2: no BUILD/ferry
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
ferry="$build/ferry"
if [ ! -x "$ferry" ]; then
    echo "docrefs.sh: no $ferry (build first)" >&2
    exit 2
fi
docs=(README.md docs/*.md)
code=(src include tools tests python fuzz bench cmake scripts CMakeLists.txt)
# named on purpose though not in the tree: a file of another repository the
# README fetches, and the forms the conventions say are gone
external="scripts/moe_expert_trace.json ferry_kv_metrics ferry_remote_metrics"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bad=0
stale() {
    echo "docrefs.sh: $*"
    bad=1
}
known() { case " $external " in *" $1 "*) return 0 ;; esac; return 1; }

find src include tools tests python fuzz bench scripts docs -type f | sed 's|.*/||' | sort -u >"$tmp/names"

# -- paths
exists() {
    local p
    for p in "$1" "src/$1" "include/$1"; do
        [ -e "$p" ] || [ -e "$p.c" ] || compgen -G "$p" >/dev/null && return 0
    done
    return 1
}
for f in "${docs[@]}"; do
    grep -noE '(^|[^A-Za-z0-9_./-])(src|tests|bench|python|tools|docs|scripts|include|fuzz)/[A-Za-z0-9_./*-]*[A-Za-z0-9_*]' "$f" |
        sed -E "s|^([0-9]+):[^A-Za-z0-9_.]?|$f:\\1 |"
done | sort -u -k2 >"$tmp/paths"
while read -r where p; do
    known "$p" || exists "$p" || stale "$where: no such path: $p"
done <"$tmp/paths"
# ARCHITECTURE.md's paths are often a layer's own (kv/op.c) or bare (slots.c)
while IFS=: read -r ln t; do
    case "$t" in
    */*) exists "$t" || stale "docs/ARCHITECTURE.md:$ln: no such file: $t" ;;
    *) grep -qxF "$t" "$tmp/names" || stale "docs/ARCHITECTURE.md:$ln: no such file: $t" ;;
    esac
done < <(grep -noE '[A-Za-z0-9_][A-Za-z0-9_/-]*\.(c|h|py|sh|md)\b' docs/ARCHITECTURE.md | sort -t: -k2 -u)

# -- identifiers and test names
grep -rhoE '\b(ferry_[a-z0-9_]*[a-z0-9]|FERRY_[A-Z0-9_]*[A-Z0-9]|test_[a-z0-9_]*[a-z0-9])\b' \
    "${code[@]}" | cat - <(sed 's/\.[a-z]*$//' "$tmp/names") | sort -u >"$tmp/ids"
for f in "${docs[@]}"; do
    while IFS=: read -r ln id; do
        known "$id" || grep -qxF "$id" "$tmp/ids" || stale "$f:$ln: $id is nowhere in the tree"
    done < <(grep -noE '\b(ferry_[a-z0-9_]*[a-z0-9]|FERRY_[A-Z0-9_]*[A-Z0-9]|test_[a-z0-9_]*[a-z0-9])\b' "$f" | sort -t: -k2 -u)
done

# -- the public headers' comments
for h in include/ferry.h include/ferry/*.h; do
    ${CC:-cc} -fpreprocessed -dD -E -P "$h" 2>/dev/null
done | grep -oE '\bferry_[a-z0-9_]*[a-z0-9]\b' | sort -u >"$tmp/hcode"
for h in include/ferry.h include/ferry/*.h; do
    while IFS=: read -r ln id; do
        grep -qxF "$id" "$tmp/hcode" || stale "$h:$ln: a comment names $id, declared nowhere"
    done < <(grep -noE '\bferry_[a-z0-9_]*[a-z0-9]\b' "$h" | sort -t: -k2 -u)
done

# -- flags
awk '
function cmdat(s, anchored,   m, re) {
    re = "(kv bench|bench (io|remote|gds)|slab (check|reset|bench)|moe (gen|replay|sim|bench)|serve status|serve|info)( |$)"
    if (anchored && !match(s, "^[ \t]*(\\$ )?([A-Za-z0-9_.-]*/)?ferry " re)) return ""
    if (!anchored && !match(s, "^(([A-Za-z0-9_.-]*/)?ferry )?" re)) return ""
    m = substr(s, RSTART, RLENGTH); sub(/^.*ferry /, "", m); sub(/^[ \t$]*/, "", m); sub(/ $/, "", m)
    rest = substr(s, RSTART + RLENGTH)
    return m
}
function flags(s, c,   t) {
    while (match(s, /(^|[ [(|,=])--[a-z][a-z0-9-]*/)) {
        t = substr(s, RSTART, RLENGTH); sub(/^[^-]*/, "", t)
        print FILENAME ":" FNR "\t" c "\t" t
        s = substr(s, RSTART + RLENGTH)
    }
}
FNR == 1 { fence = 0; cur = ""; more = 0 }
/^```/ { fence = !fence; cur = ""; next }
{
    line = $0
    if (fence || /^    /) {
        c = cmdat(line, 1)
        if (c != "") { cur = c; flags(rest, cur) }
        else if (cur != "" && (more || line ~ /^[ \t]*\[/)) flags(line, cur)
        else cur = ""
        more = line ~ /\\$/
        next
    }
    cur = ""
    while (match(line, /`[^`]*`/)) {
        span = substr(line, RSTART + 1, RLENGTH - 2); line = substr(line, RSTART + RLENGTH)
        c = cmdat(span, 0)
        if (c != "") flags(rest, c)
    }
}' "${docs[@]}" >"$tmp/flags"
while IFS=$'\t' read -r where cmd flag; do
    [ "$flag" = --help ] && continue
    help="$tmp/help-${cmd// /_}"
    if [ ! -e "$help" ]; then
        # shellcheck disable=SC2086 # the command's words
        "$ferry" $cmd --help >"$help" 2>&1 || stale "$where: ferry $cmd --help failed"
    fi
    grep -qE -- "(^|[^a-z0-9-])$flag([^a-z0-9-]|\$)" "$help" ||
        stale "$where: ferry $cmd has no $flag (ferry $cmd --help)"
done <"$tmp/flags"
# a script's flags, in a backticked span or on a code line that runs it
for f in "${docs[@]}"; do
    # shellcheck disable=SC2016 # backticks, not an expansion
    grep -noE '`(bash )?(bench|scripts)/[A-Za-z0-9_]+\.(sh|py)[^`]*`|^ +(\$ )?(bash )?(bench|scripts)/[A-Za-z0-9_]+\.(sh|py).*' "$f" |
        sed "s|^|$f:|"
done >"$tmp/scripts" || true
while IFS= read -r l; do
    where=${l%%:*}:$(echo "$l" | cut -d: -f2)
    s=$(echo "$l" | grep -oE '(bench|scripts)/[A-Za-z0-9_]+\.(sh|py)' | head -1)
    [ -e "$s" ] || continue # (reported with the paths)
    for flag in $(echo "$l" | grep -oE '(^|[ [(|=])--[a-z][a-z0-9-]*' | sed 's/^[^-]*//'); do
        grep -qE -- "$flag([^a-z0-9-]|\$)" "$s" || stale "$where: $s takes no $flag"
    done
done <"$tmp/scripts"

if [ "$bad" -eq 0 ]; then
    echo "docrefs.sh: every path, name and flag the docs give exists ($(wc -l <"$tmp/flags") flags checked)"
fi
exit "$bad"
