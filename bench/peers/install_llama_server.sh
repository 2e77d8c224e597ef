#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (the C++ OpenAI server, continuous batching with
# --parallel slots) from the llama.cpp sources vendored in the PyPI sdist of
# llama-cpp-python, into ${BLINK_PEERS_DIR:-<repo>/.peers}/llama-server/bin. For
# `blink bench --systems llamaserver`. ~5-8 min on 2 cores, under nice -n 19.
# LLAMA_SERVER_ISA=avx2: an AVX2 + FMA build with AVX512 off, into .../llama-server-avx2/bin
# instead (the AVX2-only proxy of bench/avx2_proxy_1stream.sh on an AVX512 machine).
# LLAMA_SERVER_ISA=avx512: AVX512 with VNNI, VBMI and BF16, no AMX, into .../llama-server-avx512/bin: what
# a native build gives on an AVX512 Xeon or Zen 4 but AMX, built on any x86 machine (it runs only on such
# a CPU): the peer the GPU plan's cpu_host call carries to the lent machine's Xeon host (scripts/gpu_plan.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PEERS="${BLINK_PEERS_DIR:-$PWD/.peers}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC="$PEERS/src"
ISA="${LLAMA_SERVER_ISA:-native}"
case "$ISA" in
  native) DEST="$PEERS/llama-server"; BUILD="$SRC/build-server"; FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) DEST="$PEERS/llama-server-avx2"; BUILD="$SRC/build-server-avx2"
        FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF) ;;
  avx512) DEST="$PEERS/llama-server-avx512"; BUILD="$SRC/build-server-avx512"
        FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
               -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;
  *) echo "LLAMA_SERVER_ISA must be native, avx2 or avx512, not $ISA" >&2; exit 2 ;;
esac
mkdir -p "$SRC" "$DEST/bin"
PIP="$(command -v pip3 || command -v pip)"
[ -f "$SRC/llama_cpp_python-$VERSION.tar.gz" ] || \
  "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
[ -d "$SRC/llama_cpp_python-$VERSION" ] || tar xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
nice -n 19 cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  "${FLAGS[@]}" -DLLAMA_OPENSSL=OFF
nice -n 19 cmake --build "$BUILD" --target llama-server -j "${JOBS:-$(nproc)}"
cp "$BUILD/bin/llama-server" "$DEST/bin/"
if [ "$ISA" != avx512 ] || grep -q avx512_bf16 /proc/cpuinfo; then
  "$DEST/bin/llama-server" --version 2>&1 | head -2
else
  echo "built $DEST/bin/llama-server (AVX512: not run on this CPU)"
fi
