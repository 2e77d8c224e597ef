#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (the C++ OpenAI server, continuous batching with
# --parallel slots) from the llama.cpp sources vendored in the PyPI sdist of
# llama-cpp-python, into ${BLINK_PEERS_DIR:-<repo>/.peers}/llama-server/bin. For
# `blink bench --systems llamaserver`. ~5-8 min on 2 cores, under nice -n 19.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PEERS="${BLINK_PEERS_DIR:-$PWD/.peers}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC="$PEERS/src"
mkdir -p "$SRC" "$PEERS/llama-server/bin"
PIP="$(command -v pip3 || command -v pip)"
[ -f "$SRC/llama_cpp_python-$VERSION.tar.gz" ] || \
  "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
[ -d "$SRC/llama_cpp_python-$VERSION" ] || tar xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
nice -n 19 cmake -S "$LLAMA" -B "$SRC/build-server" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF
nice -n 19 cmake --build "$SRC/build-server" --target llama-server -j "${JOBS:-$(nproc)}"
cp "$SRC/build-server/bin/llama-server" "$PEERS/llama-server/bin/"
"$PEERS/llama-server/bin/llama-server" --version 2>&1 | head -2
