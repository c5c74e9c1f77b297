#!/usr/bin/env bash
# Creates .venv (once) with the pinned CPU torch used by tests and CI, and the project with its test extras.
# Re-runs pip only when pyproject.toml changed. Usage: source-free, just `bash scripts/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.vram_magic-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch pinned here (a CPU wheel); pyproject.toml keeps a range for users.
  .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test]"
  echo "$want" > "$stamp"
fi
