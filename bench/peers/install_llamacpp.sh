#!/usr/bin/env bash
# Install llama-cpp-python's OpenAI server (PyPI llama-cpp-python[server]; builds llama.cpp from
# source, ~7 min on 2 cores) into its own venv, ${BLINK_PEERS_DIR:-<repo>/.peers}/llamacpp,
# for `blink bench --systems llamacpp`. Not part of the project's dependencies.
# Runs under nice -n 19: the machine is shared with other builds and tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PEERS="${BLINK_PEERS_DIR:-$PWD/.peers}"
mkdir -p "$PEERS"
[ -x "$PEERS/llamacpp/bin/python" ] || python3.11 -m venv "$PEERS/llamacpp"
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  nice -n 19 "$PEERS/llamacpp/bin/pip" install "llama-cpp-python[server]${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
"$PEERS/llamacpp/bin/python" -c "import importlib.metadata as m; print('llama-cpp-python', m.version('llama_cpp_python'))"
