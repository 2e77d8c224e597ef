#!/usr/bin/env bash
# Set up (if needed) and serve the embedded default model (SmolLM2-135M-Instruct)
# on http://127.0.0.1:8000 with the CPU executor. Extra arguments go to `blink serve`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
exec .venv/bin/blink serve "$@"
