#!/usr/bin/env bash
# CI notebook stage: the tutorial notebooks
#   1. execute headless with ipywidgets 7.7 (what Colab ships) in the kernel: every %%vram and %vram_estimate output
#      must be the static report (tests/notebook/test_notebooks.py, the same test the main suite runs with 8.x), and the live
#      view and %vram watch must work in a real kernel (tests/session/test_live_kernel.py);
#   2. execute with the project's own environment, convert to HTML, plainly and with --sanitize-html, and open the
#      pages in headless chromium with every non-local request blocked: every report must be there, its bars drawn
#      to size (plain) or as coloured text bars (sanitized), with no escaped markup. Screenshots go to
#      ci-artifacts/notebooks/. (The browser stage with JupyterLab and Notebook 7 is ci/ui.sh.)
#
# Run from the repository root as `bash ci/notebooks.sh`, with the project's venv at .venv (or PYTHON=...).
# Installs what it needs (Debian chromium, the npm packages in ci/browser/) on a fresh machine; needs no stdin.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
ART=$ROOT/ci-artifacts/notebooks
CACHE=${VRAM_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vram_magic-ci}
START=$(date +%s)

step() { echo "== [$(($(date +%s) - START)) s] $*"; }
fail() { echo "ci/notebooks.sh: $*" >&2; exit 1; }

[ -x "$PYTHON" ] || fail "no Python at $PYTHON (create the venv first, or set PYTHON)"
rm -rf "$ART"
mkdir -p "$ART" "$CACHE"

# --- tools --------------------------------------------------------------------------------------------------
step "system and npm packages"
source ci/browser/tools.sh
browser_tools
CHROMIUM=$(command -v chromium)
echo "$("$CHROMIUM" --version 2>/dev/null | head -1), node $(node --version)"

step "python packages"
"$PYTHON" - <<'EOF' || "$PYTHON" -m pip install -q nbclient nbformat ipykernel nbconvert pytest
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in ("nbclient", "nbformat", "ipykernel", "nbconvert", "pytest")))
EOF

# ipywidgets 7.7 goes into a folder put first on PYTHONPATH (inherited by the kernels the test starts), so the same
# environment runs with Colab's kernel-side widgets without building a second one with torch in it.
IPYW7=$CACHE/ipywidgets-7.7
if [ ! -f "$IPYW7/.complete" ]; then
    rm -rf "$IPYW7"
    "$PYTHON" -m pip install -q --no-deps --target "$IPYW7" \
        "ipywidgets==7.7.*" "widgetsnbextension~=3.6.0" "jupyterlab_widgets~=1.1" "ipython_genutils"
    touch "$IPYW7/.complete"
fi

# The two executions below run side by side, one CPU thread each: two PyTorch processes with a thread per core
# each would oversubscribe the cores, and PyTorch's spinning threads then slow both down many times over.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --- 1. ipywidgets 7.7 ---------------------------------------------------------------------------------------
step "notebooks with ipywidgets $(PYTHONPATH=$IPYW7 "$PYTHON" -c 'import ipywidgets; print(ipywidgets.__version__)') (in the background, log in ${ART#"$ROOT"/}/ipywidgets7.log)"
PYTHONPATH=$IPYW7${PYTHONPATH:+:$PYTHONPATH} VRAM_EXPECT_IPYWIDGETS=7 VRAM_NOTEBOOKS_OUT=$ART/executed-ipywidgets7 \
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/notebook/test_notebooks.py tests/session/test_live_kernel.py \
    -k "not test_notebook_executes or 01_what_fills or 02_measuring or live" \
    >"$ART/ipywidgets7.log" 2>&1 &
IPYW7_TEST=$!

# --- 2. real browser -----------------------------------------------------------------------------------------
step "notebooks with ipywidgets $("$PYTHON" -c 'import ipywidgets; print(ipywidgets.__version__)'), executed for the browser"
SITE=$ART/site
mkdir -p "$SITE" "$ART/work" "$ART/executed"
# The suite's notebook test keeps what it executed when .ci/run asks it to (VRAM_NOTEBOOKS_OUT): reused here
# when every notebook is there, rather than executing all of them a third time.
SUITE_OUT=${VRAM_SUITE_NOTEBOOKS:-$ROOT/ci-artifacts/suite-notebooks}
reuse=1
for nb in notebooks/*.ipynb; do
    [ -f "$SUITE_OUT/$(basename "$nb")" ] && [ "$SUITE_OUT/$(basename "$nb")" -nt "$nb" ] || reuse=0
done
if [ "$reuse" = 1 ]; then
    echo "the suite's executed notebooks, from ${SUITE_OUT#"$ROOT"/}"
    cp "$SUITE_OUT"/*.ipynb "$ART/executed/"
else
    cp notebooks/*.ipynb "$ART/work/"   # executed on a copy: the notebooks write files next to themselves
    (cd "$ART/work" && "$PYTHON" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=300 \
        --ExecutePreprocessor.kernel_name=python3 --output-dir "$ART/executed" --log-level=WARN ./*.ipynb)
fi
for nb in "$ART"/executed/*.ipynb; do
    name=$(basename "${nb%.ipynb}")
    "$PYTHON" -m jupyter nbconvert --to html "$nb" --output "$name" --output-dir "$SITE" --log-level=WARN
    "$PYTHON" -m jupyter nbconvert --to html --sanitize-html "$nb" --output "$name-sanitized" --output-dir "$SITE" \
        --log-level=WARN
done
step "waiting for the ipywidgets 7.7 run"
if ! wait "$IPYW7_TEST"; then
    cat "$ART/ipywidgets7.log"
    fail "the notebooks or the live view failed with ipywidgets 7.7 (log above)"
fi
tail -n 1 "$ART/ipywidgets7.log"
for nb in "$ART"/executed-ipywidgets7/*.ipynb; do
    "$PYTHON" -m jupyter nbconvert --to html "$nb" --output "$(basename "${nb%.ipynb}")-ipywidgets7" \
        --output-dir "$SITE" --log-level=WARN
done

step "chromium"
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PYTHON" -m http.server "$PORT" --bind 127.0.0.1 --directory "$SITE" >"$ART/http.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 50); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/')" 2>/dev/null && break
    sleep 0.1
done
mkdir -p "$ART/screenshots"
pages=()
for page in "$SITE"/*.html; do pages+=("$(basename "$page")"); done
CHROMIUM=$CHROMIUM node ci/browser/check.mjs "http://127.0.0.1:$PORT/" "$ART/screenshots" "${pages[@]}"

step "done; screenshots in ${ART#"$ROOT"/}/screenshots"
