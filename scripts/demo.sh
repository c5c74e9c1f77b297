#!/usr/bin/env bash
# Set up (first run only) and run the headless demo: a training loop split like notebook cells.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m vram_magic demo
