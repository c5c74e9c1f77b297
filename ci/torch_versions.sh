#!/usr/bin/env bash
# CI stage: the test suite on the oldest PyTorch pyproject.toml admits and on the newest the registry serves,
# beside the pinned CPU build that scripts/test.sh uses. Each runs in its own virtual environment under
# $VRAM_CI_CACHE (reused when it already holds that version). The registry's builds are CUDA builds: they run
# here on the CPU, and their GPU-only tests skip.
#
#   bash ci/torch_versions.sh            # both
#   bash ci/torch_versions.sh floor      # one of: floor, newest
#
# The floor is read from pyproject.toml (torch>=X.Y) and resolved to its newest patch release. transformers 5
# needs torch >= 2.6: on an older torch the Hugging Face tests skip, saying so (tests/conftest.py).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
CACHE=${VRAM_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vram_magic-ci}
START=$(date +%s)
mkdir -p "$CACHE"
step() { echo "== [$(($(date +%s) - START)) s] $*"; }

# This machine's pip may carry a cap on torch (a constraints file); the newest release must be reachable.
export PIP_CONFIG_FILE=/dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

floor=$(sed -n 's/.*"torch>=\([0-9][0-9.]*\).*/\1/p' pyproject.toml | head -1)
[ -n "$floor" ] || { echo "no torch>=X.Y in pyproject.toml" >&2; exit 1; }

versions_of() {  # every release of torch the registry lists, oldest first
    "$PY" -m pip index versions torch 2>/dev/null | sed -n 's/^Available versions: //p' | tr ',' '\n' \
        | tr -d ' ' | grep -E '^[0-9]+\.[0-9]+\.[0-9]+$' | sort -t. -k1,1n -k2,2n -k3,3n
}
all=$(versions_of)
[ -n "$all" ] || { echo "cannot list torch's releases from the registry" >&2; exit 1; }
floor_version=$(echo "$all" | grep -E "^${floor//./\\.}\.[0-9]+$" | tail -1)
newest_version=$(echo "$all" | tail -1)

run_on() {  # name version
    local name=$1 version=$2 venv=$CACHE/venv-torch-$2
    step "torch $version ($name): environment"
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
        rm -rf "$venv"
        "$PY" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
        "$venv/bin/python" -m pip install -q "torch==$version"
    fi
    # the project's own dependencies and test extras, with this torch kept as it is
    "$venv/bin/python" -m pip install -q -e ".[test]" "torch==$version"
    "$venv/bin/python" -c "import torch; print('torch', torch.__version__, '· CUDA build' if torch.version.cuda else '· CPU build')"
    step "torch $version ($name): tests"
    # the notebooks are executed by the suite and the notebook stage with the pinned torch. On the floor the
    # tests marked slow (kernels, compiled code: torch.compile's estimates need 2.9 and skip there) are left
    # out; on the newest everything else runs but the Hugging Face accuracy zoo, which the pinned run covers
    # (the same fake-tensor and compiled paths are run by the estimator's own tests here)
    local select=(--ignore=tests/notebook/test_notebooks.py)
    # The newest runs in two processes as the main suite does (scripts/test.sh); the floor in one (on 2.5.1 each
    # process's end takes minutes of garbage collection, which VRAM_TESTS_EXIT_AFTER_REPORT skips for one process)
    if [ "$name" = floor ]; then
        select+=(-m "not slow")
    else
        select+=(--ignore=tests/estimator/test_hf_models.py -n 2 --dist loadfile)
    fi
    # (VRAM_TESTS_EXIT_AFTER_REPORT: the process ends once pytest has reported; tests/conftest.py says why)
    OMP_NUM_THREADS=$([ "$name" = floor ] && echo "$OMP_NUM_THREADS" || echo 1) \
    VRAM_TESTS_EXIT_AFTER_REPORT=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${select[@]}" tests/
}

want=${1:-all}
if [ "$want" = all ] || [ "$want" = floor ]; then run_on floor "$floor_version"; fi
if [ "$want" = all ] || [ "$want" = newest ]; then run_on newest "$newest_version"; fi
step "done"
