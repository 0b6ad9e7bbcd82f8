#!/usr/bin/env bash
# The prepared GPU run: on a machine with an NVIDIA GPU, build ferry
# (Release), run the gpu-labelled tests, then every benchmark on the cuda
# device, and write ONE JSON report, OUTDIR/gpu-report.json:
#
#   build        cmake Release build (skipped with FERRY_GPU_SH_BUILD=DIR
#                naming a build that already has ferry, and FERRY_GPU_SH_NO_BUILD=1)
#   ctest_gpu    ctest -L gpu (each test skips with 77 where its hardware is absent)
#   py_device    python/tests/test_device.py with FERRY_TEST_DEVICE=cuda:0 (the
#                Python package's CUDA tensors as device buffers, bitwise;
#                skipped where no interpreter has torch with CUDA available)
#   info         ferry info --json
#   bench_io     ferry bench io --engine all --device cuda
#   gds_cufile   ferry bench gds --driver cufile --device cuda
#   gds_cpu      ferry bench gds --driver cpu --device cuda (the bounce path)
#   kv_contig    ferry kv bench --device cuda (engine buffer in device memory, one tensor)
#   kv_paged     ferry kv bench --device cuda --paged 16 (16-token blocks)
#   moe          ferry moe bench --device cuda
#
# The report holds each command's --json output under "steps" (with its exit
# status and wall time), nvidia-smi's GPU name, driver and memory, where
# libcufile came from, and under "skipped" what did not run and why. The
# whole run stays under 8 minutes: each step has a timeout, cut to what is
# left of the budget, and a step with under 10 s left is skipped.
#
# usage: bench/gpu.sh OUTDIR
# exit:  0 every step that ran passed; 1 a step failed (the report says
#        which); 2 usage; 77 no NVIDIA GPU here (nothing is run).
# env:   FERRY_GPU_SH_DEVICE=host  a dry run of the same steps on the host
#                                  device with the cpu driver and short sizes
#        FERRY_GPU_SH_BUILD=DIR    the build directory (default build-gpu in the tree)
#        FERRY_GPU_SH_DIR=DIR      where the benchmarks write (default a new
#                                  directory under /var/tmp, removed at the end)
#        FERRY_GPU_SH_BUDGET=S     seconds for the whole run (default 470)
set -uo pipefail
export LC_ALL=C
if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bench/gpu.sh OUTDIR   (FERRY_GPU_SH_DEVICE=host for a dry run)" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)
device=${FERRY_GPU_SH_DEVICE:-cuda}
case $device in cuda | host) ;; *) echo "bench/gpu.sh: FERRY_GPU_SH_DEVICE=$device: accepted: cuda or host" >&2; exit 2 ;; esac
budget=${FERRY_GPU_SH_BUDGET:-470}
t_start=$(date +%s)
export FERRY_NO_PROGRESS=1
py=$(command -v python3 || true)

# ---- is there a GPU? ----
gpu_name="" gpu_driver="" gpu_mem=""
if [ "$device" = cuda ]; then
  have_libcuda=0
  if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then have_libcuda=1; fi
  for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/lib/wsl/lib; do
    [ -e "$d/libcuda.so.1" ] && have_libcuda=1
  done
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    IFS=',' read -r gpu_name gpu_driver gpu_mem < <(nvidia-smi --query-gpu=name,driver_version,memory.total \
      --format=csv,noheader 2>/dev/null | head -1)
    gpu_name=$(echo "$gpu_name" | sed 's/^ *//;s/ *$//')
    gpu_driver=$(echo "$gpu_driver" | sed 's/^ *//;s/ *$//')
    gpu_mem=$(echo "$gpu_mem" | sed 's/^ *//;s/ *$//')
  fi
  if [ -z "$gpu_name" ] && [ $have_libcuda = 0 ]; then
    echo "bench/gpu.sh: no NVIDIA GPU here (no nvidia-smi listing a GPU, no libcuda.so.1); nothing run."
    echo "  FERRY_GPU_SH_DEVICE=host bench/gpu.sh OUTDIR runs the same steps on the host device."
    exit 77
  fi
fi

# ---- libcufile: the system's, else the nvidia-cufile Python wheel's ----
cufile=""
if ldconfig -p 2>/dev/null | grep -q 'libcufile\.so\.0 '; then
  cufile=$(ldconfig -p | sed -n 's/.*libcufile\.so\.0 .*=> //p' | head -1)
fi
if [ -z "$cufile" ]; then
  dirs="/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib"
  if [ -n "$py" ]; then
    dirs="$dirs $("$py" - 2>/dev/null <<'EOF'
import os, site, sys
seen = []
try:
    import nvidia
    seen += list(nvidia.__path__)
except Exception:
    pass
for p in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    if p and os.path.isdir(os.path.join(p, "nvidia")):
        seen.append(os.path.join(p, "nvidia"))
print(" ".join(sorted(set(seen))))
EOF
)"
  fi
  for d in $dirs; do
    [ -d "$d" ] || continue
    f=$(find "$d" -maxdepth 5 -name 'libcufile.so.0*' 2>/dev/null | sort | head -1)
    if [ -n "$f" ]; then cufile=$f; break; fi
  done
  if [ -n "$cufile" ]; then
    export LD_LIBRARY_PATH="$(dirname "$cufile")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

# ---- the steps ----
steps_dir="$out/steps"
rm -rf "$steps_dir" && mkdir -p "$steps_dir" || exit 1
work=${FERRY_GPU_SH_DIR:-}
made_work=0
if [ -z "$work" ]; then
  work=$(mktemp -d -p /var/tmp ferry-gpu-XXXXXX) || exit 1
  made_work=1
fi
mkdir -p "$work" || exit 1
cleanup() { [ $made_work = 1 ] && rm -rf "$work"; }
trap cleanup EXIT
build=${FERRY_GPU_SH_BUILD:-$root/build-gpu}
case $build in /*) ;; *) build="$PWD/$build" ;; esac
ferry="$build/ferry"
failed=0

skip() { # NAME WHY
  printf '%s\n' "$2" > "$steps_dir/$1.skipped"
  echo "== $1: skipped: $2"
}
# step NAME MAX_S JSON(0|1) CMD...: runs CMD with a timeout of MAX_S cut to
# the budget left; its stdout in steps/NAME.out, stderr in steps/NAME.log
step() {
  local name=$1 max=$2 json=$3
  shift 3
  local left=$((budget - ($(date +%s) - t_start)))
  if [ $left -lt 10 ]; then skip "$name" "out of time: ${left}s of the ${budget}s budget left"; return; fi
  [ $max -gt $((left - 5)) ] && max=$((left - 5))
  echo "== $name (timeout ${max}s): $*"
  local t0 rc
  t0=$(date +%s.%N)
  timeout --kill-after=5 "$max" "$@" > "$steps_dir/$name.out" 2> "$steps_dir/$name.log"
  rc=$?
  echo "$rc $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }') $json $max" \
    > "$steps_dir/$name.rc"
  if [ $rc = 0 ]; then echo "   ok"; else
    failed=1
    echo "   failed: exit $rc$([ $rc = 124 ] && echo ' (timed out)')"; tail -5 "$steps_dir/$name.log" | sed 's/^/   /'
  fi
}

if [ -n "${FERRY_GPU_SH_NO_BUILD:-}" ] && [ -x "$ferry" ]; then
  skip build "FERRY_GPU_SH_NO_BUILD: using $build as it is"
else
  step build 300 0 bash -c "cmake -S '$root' -B '$build' -DCMAKE_BUILD_TYPE=Release >/dev/null && \
    cmake --build '$build' -j $(nproc)"
fi
if [ ! -x "$ferry" ]; then
  for s in ctest_gpu py_device info bench_io gds_cufile gds_cpu kv_contig kv_paged moe; do skip $s "no ferry built"; done
else
  step ctest_gpu 120 0 bash -c "cd '$build' && ctest -L gpu --output-on-failure --timeout 100"
  # the Python package on the device: an interpreter with torch and pytest
  # (Debian's /usr/bin/python3 first: the python3 first on PATH may not see them)
  pyt="" pyt_dev=cuda:0
  [ "$device" = host ] && pyt_dev=host
  for cand in /usr/bin/python3 "$py"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    if "$cand" -c "import torch, pytest, sys; sys.exit(0 if '$device' == 'host' or \
        torch.cuda.is_available() else 1)" >/dev/null 2>&1; then pyt=$cand; break; fi
  done
  if [ -z "$pyt" ]; then
    skip py_device "no python3 with torch, pytest and torch.cuda.is_available()"
  else
    step py_device 120 0 env FERRY_TEST_DEVICE=$pyt_dev FERRY_LIB="$build/libferry.so.0" \
      FERRY_CLI="$ferry" "$pyt" -m pytest -q -p no:cacheprovider "$root/python/tests/test_device.py"
  fi
  step info 20 1 "$ferry" info --json --dir "$work"
  if [ "$device" = cuda ]; then
    io_size=2G gds_size=1G
    kv_args=(--model llama3-8b --docs 8 --doc-tokens 2048 --questions 32 --l1 1G --l2 2G)
    moe_args=()
  else # the dry run: short sizes on the host device
    io_size=128M gds_size=64M
    kv_args=(--model tiny --docs 4 --doc-tokens 2048 --questions 16 --l1 8M --l2 32M)
    moe_args=(--quick)
  fi
  step bench_io 90 1 "$ferry" bench io --engine all --size $io_size --chunk 8M --depth 8 \
    --device "$device" --dir "$work" --json
  if [ "$device" = host ]; then
    step gds_cufile 60 1 "$ferry" bench gds --driver cpu --device host --size $gds_size --chunk 32M \
      --rounds 2 --alloc-ops 200000 --dir "$work" --json
  elif [ -z "$cufile" ]; then
    skip gds_cufile "libcufile.so.0 not found (ldconfig, CUDA lib64, the nvidia-cufile wheel)"
  else
    step gds_cufile 90 1 "$ferry" bench gds --driver cufile --device cuda --size $gds_size \
      --chunk 32M --rounds 3 --dir "$work" --json
  fi
  step gds_cpu 90 1 "$ferry" bench gds --driver cpu --device "$device" --size $gds_size --chunk 32M \
    --rounds 3 --dir "$work" --json
  step kv_contig 120 1 "$ferry" kv bench "${kv_args[@]}" --device "$device" --dir "$work/kv" --create --json
  step kv_paged 120 1 "$ferry" kv bench "${kv_args[@]}" --device "$device" --paged 16 \
    --dir "$work/kvp" --create --json
  step moe 90 1 "$ferry" moe bench ${moe_args[@]+"${moe_args[@]}"} --device "$device" --json
fi

# ---- the report ----
t_end=$(date +%s)
commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo "")
report="$out/gpu-report.json"
export GS_DEVICE="$device" GS_GPU_NAME="$gpu_name" GS_GPU_DRIVER="$gpu_driver" GS_GPU_MEM="$gpu_mem" \
  GS_CUFILE="$cufile" GS_COMMIT="$commit" GS_START="$t_start" GS_END="$t_end" GS_STEPS="$steps_dir" \
  GS_HOST="$(hostname)" GS_BUDGET="$budget"
if [ -n "$py" ]; then
  "$py" - > "$report" <<'EOF'
import json, os, time
e = os.environ
sd = e["GS_STEPS"]
order = ["build", "ctest_gpu", "py_device", "info", "bench_io", "gds_cufile", "gds_cpu", "kv_contig",
         "kv_paged", "moe"]
steps, skipped = {}, []
def tail(path, n=20):
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-n:]
    except OSError:
        return []
for name in order:
    p = os.path.join(sd, name)
    if os.path.exists(p + ".skipped"):
        skipped.append({"step": name, "why": open(p + ".skipped").read().strip()})
        continue
    if not os.path.exists(p + ".rc"):
        continue
    rc, wall, is_json, limit = open(p + ".rc").read().split()
    s = {"exit": int(rc), "wall_s": float(wall or 0), "timeout_s": int(limit)}
    if int(rc) == 124:
        s["timed_out"] = True
    out = open(p + ".out", errors="replace").read()
    if is_json == "1":
        try:
            s["result"] = json.loads(out)
        except ValueError:
            s["stdout_tail"] = out.splitlines()[-20:]
    else:
        s["stdout_tail"] = out.splitlines()[-12:]
    if int(rc) != 0:
        s["stderr_tail"] = tail(p + ".log")
    steps[name] = s
gpu = None
if e.get("GS_GPU_NAME"):
    gpu = {"name": e["GS_GPU_NAME"], "driver": e["GS_GPU_DRIVER"], "memory": e["GS_GPU_MEM"]}
start, end = int(e["GS_START"]), int(e["GS_END"])
print(json.dumps({
    "report": "ferry bench/gpu.sh",
    "device": e["GS_DEVICE"],
    "dry_run": e["GS_DEVICE"] != "cuda",
    "host": e["GS_HOST"],
    "commit": e["GS_COMMIT"],
    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
    "wall_s": end - start,
    "budget_s": int(e["GS_BUDGET"]),
    "gpu": gpu,
    "libcufile": e["GS_CUFILE"] or None,
    "steps": steps,
    "skipped": skipped,
}, indent=1))
EOF
elif command -v jq >/dev/null; then
  # without python: the same object, each step's stdout as JSON where it parses
  {
    for f in "$steps_dir"/*.rc; do
      [ -e "$f" ] || continue
      n=$(basename "$f" .rc)
      read -r rc wall isj limit < "$f"
      if [ "$isj" = 1 ] && jq -e . "$steps_dir/$n.out" >/dev/null 2>&1; then
        jq -c --arg n "$n" --argjson rc "$rc" --argjson w "${wall:-0}" \
          '{($n): {exit: $rc, wall_s: $w, result: .}}' "$steps_dir/$n.out"
      else
        jq -cn --arg n "$n" --argjson rc "$rc" --argjson w "${wall:-0}" \
          --rawfile o "$steps_dir/$n.out" '{($n): {exit: $rc, wall_s: $w, stdout_tail: ($o | split("\n") | .[-12:])}}'
      fi
    done
  } | jq -s --arg dev "$device" --arg gn "$gpu_name" --arg gd "$gpu_driver" --arg gm "$gpu_mem" \
      --arg cf "$cufile" --arg c "$commit" --argjson w $((t_end - t_start)) \
      --argjson sk "$(for f in "$steps_dir"/*.skipped; do [ -e "$f" ] || continue
          jq -cn --arg s "$(basename "$f" .skipped)" --rawfile y "$f" '{step: $s, why: ($y | rtrimstr("\n"))}'
        done | jq -s .)" \
      '{report: "ferry bench/gpu.sh", device: $dev, dry_run: ($dev != "cuda"), commit: $c, wall_s: $w,
        gpu: (if $gn == "" then null else {name: $gn, driver: $gd, memory: $gm} end),
        libcufile: (if $cf == "" then null else $cf end), steps: add, skipped: $sk}' > "$report"
else
  echo "bench/gpu.sh: neither python3 nor jq here: the steps' outputs are in $steps_dir" >&2
  exit 1
fi
echo "report: $report ($((t_end - t_start)) s)"
exit $failed
