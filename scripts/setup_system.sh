#!/usr/bin/env bash
# Debian packages some tests use: systemd (systemd-analyze verifies the service
# units), python3-pyverbs (real pyverbs objects in the RDMA tests), pbzip2 and
# stress-ng (the benchmark runner's interferers). Installed
# only when running as root with apt and only when missing; otherwise the tests
# that need them say why they skip.
set -uo pipefail
need=()
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
dpkg -s python3-pyverbs >/dev/null 2>&1 || need+=(python3-pyverbs)
command -v pbzip2 >/dev/null 2>&1 || need+=(pbzip2)
command -v stress-ng >/dev/null 2>&1 || need+=(stress-ng)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: not root or no apt-get; missing ${need[*]} (the tests that need them will skip)" >&2
    exit 0
fi
echo "setup: apt-get install ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
(apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null) \
    || echo "setup: could not install ${need[*]}; the tests that need them will skip" >&2
exit 0
