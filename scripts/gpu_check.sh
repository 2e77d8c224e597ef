#!/usr/bin/env bash
# The CUDA executors' GPU checks, in one command, for a machine with an NVIDIA
# GPU of compute capability >= 9.0 (the lent H100: nvcc 13, cuda-bindings,
# python3 with torch/numpy/pytest). Installs nothing from the network: wheels
# found in .whl/ are installed offline into a private folder.
#
#   here, with the network, once:   scripts/gpu_check.sh --fetch-wheels
#       (downloads the wheels the GPU image lacks into .whl/, ignored by git;
#        carry `.whl` with the device call)
#   on the GPU machine:             scripts/gpu_check.sh
#       machine/versions -> build (nvcc -rdc + cudadevrt; g++ twin) -> TensorRT probe
#       -> tests: tests/gpu_backend/cuda and tests/gpu_backend/graphs, CPU and `gpu`
#          ones (capture and device launch of the model graphs, cuda / cuda-hostloop /
#          CPU agreement, seeded sampling, 1,000 requests through the frontend,
#          10,000 echo requests)
#       -> bench/cuda_scheduler.py (control plane) -> bench/cuda_graphs.py (Fig. 3 A/B)
# Logs and results go to $OUT when set (the device tool brings them back; at most
# 8 files), else bench/results/. GPU_CHECK_STAGES (default
# "build,trt,tests,bench_sched,bench_graphs") picks stages; GPU_CHECK_PYTEST_ARGS
# adds pytest arguments (e.g. "-m 'not slow'"). Exit status: non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
WHEELS=("gguf==0.19.0")     # imported by gpu_backend.model's loader; missing from the GPU image

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl "$(git rev-parse --git-dir)/info"
    grep -qx '/.whl/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null \
        || echo '/.whl/' >> "$(git rev-parse --git-dir)/info/exclude"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}" \
        && ls -la .whl
    exit $?
fi

OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
STAGES=",${GPU_CHECK_STAGES:-build,trt,tests,bench_sched,bench_graphs},"
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
want() { [[ "$STAGES" == *",$1,"* ]]; }
: > "$LOG"
stage machine nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
stage versions "$PY" -c "import sys, numpy, torch; from importlib.metadata import version as v; \
print(sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda-bindings', \
v('cuda-bindings'), 'cores', __import__('os').cpu_count())"
want build && stage build "$PY" -c "from gpu_backend.cuda import build; print(build.build_device_module()); \
print(build.build_host_twin())"
want trt && stage tensorrt "$PY" -m gpu_backend.graphs.tensorrt
# shellcheck disable=SC2086
want tests && stage tests "$PY" -m pytest -q -p no:cacheprovider tests/gpu_backend/cuda tests/gpu_backend/graphs -rs \
    --junitxml="$OUT_DIR/gpu_check-junit.xml" ${GPU_CHECK_PYTEST_ARGS:-}
want bench_sched && stage bench_sched "$PY" -m bench.cuda_scheduler --machine "${BLINK_MACHINE:-h100}" --out "$OUT_DIR"
want bench_graphs && stage bench_graphs "$PY" -m bench.cuda_graphs --machine "${BLINK_MACHINE:-h100}" --out "$OUT_DIR" \
    ${GPU_CHECK_BENCH_ARGS:-}
echo "gpu_check: $([ $status -eq 0 ] && echo all stages passed || echo SOME STAGE FAILED) (log: $LOG)" | tee -a "$LOG"
exit $status
