#!/usr/bin/env bash
# One stream on an AVX512 machine narrowed to AVX2, as a proxy for the AVX2-only machines (issue 21):
# `blink serve` (defaults) from an older revision and from this checkout, both under BLINK_CPU_ISA=avx2
# (float32 activations, the AVX2 kernels), and llama-server built for AVX2 with AVX512 off
# (LLAMA_SERVER_ISA=avx2 bench/peers/install_llama_server.sh), -t 2 -np 16 as bench.servers runs it.
# Each server alone, ROUNDS rounds alternating; per server and round: 2 warm-up chats, then
# bench.tpot_probe's median TPOT over N chats of 128 forced tokens.
#
#   bench/avx2_proxy_1stream.sh [OLD_REV]    (default c7c4a23: the revision of the AVX2 EPYC's own
#                                             side-by-side run, bench/results/2026-11-25-cpu2-epyc-avx2-side-by-side-x8.md)
#   -> lines "ROUND SERVER load LOAD median tpot MS"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"; PY="$REPO/.venv/bin/python"
OLD_REV="${1:-c7c4a23}"; ROUNDS="${ROUNDS:-3}"; N="${N:-10}"; PORT="${PORT:-8123}"
LLAMA="${BLINK_PEERS_DIR:-$REPO/.peers}/llama-server-avx2/bin/llama-server"
[ -x "$LLAMA" ] || { echo "no AVX2 llama-server at $LLAMA: LLAMA_SERVER_ISA=avx2 bench/peers/install_llama_server.sh" >&2; exit 2; }
GGUF="$("$PY" -c 'from dpu_frontend.tokenizer import embedded_gguf_path; print(embedded_gguf_path())')"
OLD="$(mktemp -d /tmp/blink-old-XXXX)"
git worktree add -f --detach "$OLD" "$OLD_REV" > /dev/null
trap 'pkill -f "dpu_frontend.cli serve --port $PORT" || true; pkill -f "$LLAMA" || true; git worktree remove --force "$OLD"' EXIT
ready() {   # blink's /health says READY; llama-server's says ok
    for _ in $(seq 300); do curl -s "localhost:$PORT/health" 2>/dev/null | grep -q -e READY -e '"ok"' && return 0; sleep 1; done
    return 1
}
for round in $(seq "$ROUNDS"); do
    for server in old new llama; do
        case $server in
            old) (cd "$OLD" && BLINK_CPU_ISA=avx2 PYTHONPATH="$OLD" exec "$PY" -m dpu_frontend.cli serve --port "$PORT") > /tmp/avx2-proxy-$server.log 2>&1 & ;;
            new) (cd "$REPO" && BLINK_CPU_ISA=avx2 PYTHONPATH="$REPO" exec "$PY" -m dpu_frontend.cli serve --port "$PORT") > /tmp/avx2-proxy-$server.log 2>&1 & ;;
            llama) "$LLAMA" -m "$GGUF" --host 127.0.0.1 --port "$PORT" --alias SmolLM2-135M-Instruct -t 2 -tb 2 \
                       --parallel 16 -c 65536 --no-webui > /tmp/avx2-proxy-$server.log 2>&1 & ;;
        esac
        pid=$!
        ready || { echo "$server did not get ready (/tmp/avx2-proxy-$server.log)" >&2; exit 1; }
        "$PY" -m bench.tpot_probe "http://localhost:$PORT/v1" 2 > /dev/null
        echo "$round $server load $(cut -d' ' -f1 /proc/loadavg) $("$PY" -m bench.tpot_probe "http://localhost:$PORT/v1" "$N" | tail -1)"
        pkill -f "dpu_frontend.cli serve --port $PORT" || true; kill "$pid" 2> /dev/null || true
        while curl -s "localhost:$PORT/health" > /dev/null 2>&1; do sleep 1; done; sleep 3
    done
done
