#!/usr/bin/env bash
# layers.sh - check the house's layering from the objects' symbols: no
# layer under src/ references a symbol defined in a layer it may not use
# (docs/ARCHITECTURE.md draws the same picture). Reads the library's object
# files in a CMake build tree, so it checks what was compiled, not what the
# includes say.
#
# usage: scripts/layers.sh [BUILD]   (default: build)
# exit 0: clean; 1: a reference against the layering (each is listed);
# 2: no objects found
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
objs="$build/CMakeFiles/ferry_obj.dir/src"
if [ ! -d "$objs" ]; then
    echo "layers.sh: no objects under $objs (build first)" >&2
    exit 2
fi

# what each layer may use besides itself (below it in the house)
declare -A may=(
    [core]=""
    [device]="core"
    [io]="core device"
    [slab]="core io"
    [pslab]="core io slab"
    [gds]="core device io slab"
    [remote]="core"
    [proto]="core"
    [moe]="core device io"
    [kv]="core device io slab pslab gds remote proto"
    [serve]="core device io slab pslab gds remote proto kv"
)
# inside a layer, rooms (src/<layer>/<room>/) that must not use each other:
# the KV API's two backends, the in-process store and the daemon's client
declare -A apart=([kv/store]="kv/client" [kv/client]="kv/store")

# an object whose source is still there (a build tree keeps the objects of
# files since moved or deleted); $2: its unit (layer or layer/room)
live() {
    [ -e "$1" ] && [ -e "src/$2/$(basename "$1" .o)" ]
}

# every unit: a layer (src/<layer>/) or a room of one (src/<layer>/<room>/)
units=$(cd "$objs" && find . -mindepth 1 -maxdepth 2 -type d | sed 's|^\./||' | sort)

defs=$(mktemp)
trap 'rm -f "$defs"' EXIT
for unit in $units; do
    for o in "$objs/$unit/"*.o; do
        live "$o" "$unit" || continue
        nm -g --defined-only "$o" | awk -v u="$unit" 'NF >= 3 {print $3, u}'
    done
done | sort -u >"$defs"
[ -s "$defs" ] || { echo "layers.sh: no symbols in $objs" >&2; exit 2; }

bad=0
for unit in $units; do
    layer=${unit%%/*}
    if [ -z "${may[$layer]+set}" ]; then
        echo "layers.sh: layer '$layer' is not in the house (add it to this script and ARCHITECTURE.md)"
        bad=1
        continue
    fi
    for o in "$objs/$unit/"*.o; do
        live "$o" "$unit" || continue
        while read -r sym; do
            home=$(awk -v s="$sym" '$1 == s {print $2; exit}' "$defs")
            [ -n "$home" ] || continue # outside the library (libc, hiredis, ...)
            if [ "${home%%/*}" = "$layer" ]; then # the same layer: rooms kept apart
                if [ -n "${apart[$unit]+set}" ] && [ "$home" = "${apart[$unit]}" ]; then
                    echo "layers.sh: $unit/$(basename "$o" .o) uses $sym from $home"
                    bad=1
                fi
                continue
            fi
            case " ${may[$layer]} " in
            *" ${home%%/*} "*) ;;
            *)
                echo "layers.sh: $unit/$(basename "$o" .o) uses $sym from $home"
                bad=1
                ;;
            esac
        done < <(nm -u "$o" | awk '$2 ~ /^ferry/ {print $2}')
    done
done
if [ "$bad" -eq 0 ]; then
    echo "layers.sh: every reference follows the layering ($(cut -d' ' -f2 "$defs" | sort -u | tr '\n' ' '))"
fi
exit "$bad"
