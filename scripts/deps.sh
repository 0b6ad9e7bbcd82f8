#!/usr/bin/env bash
# Install the Debian packages ferry needs, only those that are missing.
# Used by `make run`, `make test` and .ci/run. Needs root (or sudo) when
# something is missing; does nothing when everything is there.
set -euo pipefail
pkgs=(build-essential cmake pkg-config liburing-dev libxxhash-dev libhiredis-dev
      libjansson-dev libcmocka-dev gnuplot-nox fio jq redis-server redis-tools clang
      libclang-rt-14-dev python3-pytest python3-numpy python3-torch
      python3-prometheus-client libmicrohttpd-dev libyaml-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
