#!/usr/bin/env bash
# Short forms of every benchmark, run by CI to prove they work (figures are
# not judged here; the README's figures come from the full runs it names).
# usage: bench/smoke.sh BUILD_DIR
set -euo pipefail
build=${1:-build}
dir=$(mktemp -d -p /var/tmp ferry-smoke-XXXXXX)
trap 'rm -rf "$dir"' EXIT
run() { echo "+ $*"; "$@"; }
export FERRY_NO_PROGRESS=1

run "$build/ferry" info --dir "$dir"
run "$build/bench_device" --backend host --size 32M --chunk 4M --rounds 1
