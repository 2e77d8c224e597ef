#!/usr/bin/env bash
# The committed comparison on a 2-core CPU machine (bench/results/2026-11-22-cpu2-interference.*):
# blink vs vLLM CPU vs llama.cpp (llama-cpp-python's server and llama.cpp's own llama-server)
# on SmolLM2-135M-Instruct, isolated and with pbzip2 + a parallel compile on the other core.
#
# Placement: every server process and the load generator on CPU 0 (1 compute thread),
# the interferers on CPU 1. Load: 1, 2, 4, 8 concurrent streams, 128 output tokens each
# (prompts of 64-192 tokens).
#
# It first waits (up to QUIET_WAIT_S, default 40 min) for a 1-minute load average below
# QUIET_LOAD (default 1.0) and records what it saw in the markdown.
# Usage: bench/run_cpu2_interference.sh [extra blink bench flags]
# To measure a fixed commit while others edit the checkout, run it from an exported tree:
#   git archive HEAD | tar -x -C /tmp/snap && cd /tmp/snap && PYTHON=<repo>/.venv/bin/python \
#   PYTHONPATH=/tmp/snap BLINK_PEERS_DIR=<repo>/.peers BLINK_SOURCE_COMMIT=$(git rev-parse --short HEAD) \
#   OUT=<repo>/bench/results bench/run_cpu2_interference.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NAME="${NAME:-2026-11-22-cpu2-interference}"
OUT="${OUT:-bench/results}"
QUIET_LOAD="${QUIET_LOAD:-1.0}"
QUIET_WAIT_S="${QUIET_WAIT_S:-2400}"
SYSTEMS="${SYSTEMS:-blink,vllm,llamacpp,llamaserver}"

waited=0
load=$(cut -d' ' -f1 /proc/loadavg)
while awk -v l="$load" -v q="$QUIET_LOAD" 'BEGIN { exit !(l >= q) }' && [ "$waited" -lt "$QUIET_WAIT_S" ]; do
  sleep 30
  waited=$((waited + 30))
  load=$(cut -d' ' -f1 /proc/loadavg)
done
if awk -v l="$load" -v q="$QUIET_LOAD" 'BEGIN { exit !(l < q) }'; then
  quiet="The run started on a quiet machine (1-minute load average $load < $QUIET_LOAD, after waiting ${waited} s); before each system it waited again until every core was under 15 % busy (at most 15 min in all). Other engineers' tests may still have run during it: levels marked **foreign load** had CPU 1 busy in an isolated sweep, where nothing of this benchmark runs."
else
  quiet="The machine never got quiet: after waiting ${waited} s the 1-minute load average was still $load (>= $QUIET_LOAD); other engineers' tests ran at the same time, so absolute numbers are noisy. Ratios within one system (colocated / isolated) and between systems measured minutes apart are still comparable only roughly."
fi
echo "$quiet" >&2

# 30 s per level plus at most 20 s of drain, 2 warm-up requests: the four systems, both
# conditions and vLLM's start (1.5-4 min of compilation on one core) take about 23 minutes,
# plus the quiet waits.
exec "${PYTHON:-.venv/bin/python}" -m dpu_frontend.cli bench --systems "$SYSTEMS" --preset cpu2 --duration-s "${DURATION_S:-30}" \
  --drain-s "${DRAIN_S:-20}" --warmup-requests 2 --quiet-busy 0.15 --quiet-wait-s 900 \
  --server-cpus 0 --client-cpus 0 --server-threads 1 \
  --interferer "pbzip2:1@1+compile:1@1" --slo "ttft:2000,tpot:200" \
  --out "$OUT" --name "$NAME" --notes "$quiet ${NOTES:-}" "$@"
