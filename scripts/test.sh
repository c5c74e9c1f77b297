#!/usr/bin/env bash
# Set up (first run only) and run the test suite on CPU (CUDA tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
