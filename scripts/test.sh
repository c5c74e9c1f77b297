#!/usr/bin/env bash
# Set up (first run only) and run the test suite on CPU (CUDA tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The suite runs in up to four processes (pytest-xdist; a file's tests stay in one process, so its module fixtures
# are made once and the notebooks run one after another beside the other files), each with one PyTorch thread so
# that they do not oversubscribe the cores. VRAM_TEST_WORKERS=1 runs everything in this one process.
workers=${VRAM_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); echo $((n > 4 ? 4 : n)))}
if [ "$workers" -gt 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
