#!/usr/bin/env bash
# The CUDA executor's GPU checks, in one command, for a machine with an NVIDIA
# GPU of compute capability >= 9.0 (the lent H100: nvcc 13, cuda-bindings,
# python3 with numpy/pytest). Installs nothing from the network: wheels found
# in .whl/ (see docs/cuda.md) are installed offline into a private folder.
#
#   build the device module (nvcc -rdc, cudadevrt) and the CPU twin (g++)
#   -> the cuda tests, CPU ones and those marked gpu (10k requests through the
#      daemon and the frontend included)
#   -> bench/cuda_scheduler.py
# Logs and results go to $OUT when set (the device tool brings them back),
# else bench/results/. Exit status: non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
LOG="$OUT_DIR/gpu_check.log"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/blink-site \
        .whl/*.whl && export PYTHONPATH="/tmp/blink-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BLINK_CACHE_DIR="${BLINK_CACHE_DIR:-/tmp/blink-cache}"
status=0
stage() {   # stage NAME CMD...: run, tee into the log, remember failures
    local name=$1; shift
    echo "=== $name: $*" | tee -a "$LOG"
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
    return 0
}
: > "$LOG"
stage machine nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
stage versions "$PY" -c "import sys, numpy; from importlib.metadata import version as v; \
print(sys.version.split()[0], 'numpy', numpy.__version__, 'cuda-bindings', v('cuda-bindings'))"
stage build "$PY" -c "from gpu_backend.cuda import build; print(build.build_device_module()); print(build.build_host_twin())"
stage tests "$PY" -m pytest -q -p no:cacheprovider tests/gpu_backend/cuda -rs \
    --junitxml="$OUT_DIR/gpu_check-junit.xml"
stage bench "$PY" -m bench.cuda_scheduler --machine "${BLINK_MACHINE:-h100}" --out "$OUT_DIR"
echo "gpu_check: $([ $status -eq 0 ] && echo all stages passed || echo SOME STAGE FAILED) (log: $LOG)" | tee -a "$LOG"
exit $status
