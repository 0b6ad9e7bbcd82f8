#!/usr/bin/env bash
# sizes.sh - keep the house readable: no C file under src/ over 1200
# lines, and no function in src/ or tools/ over 120 lines (from its
# signature's last line to its closing brace, ferry's layout: the opening
# brace of a function alone on its line, the closing one in column 0).
#
# usage: scripts/sizes.sh   exit 0: within both; 1: each excess listed
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
while IFS= read -r f; do
    n=$(wc -l <"$f")
    if [ "$n" -gt 1200 ]; then
        echo "sizes.sh: $f has $n lines (most 1200)"
        bad=1
    fi
done < <(find src -name '*.c' | sort)
if ! awk '
    FNR == 1 { start = 0 }
    /^\{$/ && prev ~ /\)[ \t]*$/ && prev ~ /^[A-Za-z]/ { start = FNR - 1; name = prev; next }
    /^\}/ && start { n = FNR - start + 1
                     if (n > 120) { printf "sizes.sh: %s:%d: %d lines (most 120): %s\n", FILENAME, start, n, name; bad = 1 }
                     start = 0 }
    { prev = $0 }
    END { exit bad }' $(find src tools -name '*.c' | sort); then
    bad=1
fi
exit "$bad"
