#!/usr/bin/env bash
# CI browser stage: the display as users see it.
#   1. a Jupyter server with JupyterLab and Notebook 7 (installed into the project's venv if missing) runs
#      ci/browser/display_check.ipynb in headless Debian chromium (ci/browser/ui_check.mjs: live view, %vram watch,
#      the per-rank view of two forked gloo ranks, save and reload, dark theme, 800 px, two untrusted tutorials
#      (02, and 08 whose reports carry the KV cache), Notebook 7), asserting on the DOM;
#   2. the notebook JupyterLab saved is converted by nbconvert to HTML, plainly and with --sanitize-html (a stand-in
#      for viewers that sanitize), and both pages are checked in chromium (ci/browser/check.mjs), the per-rank view
#      in each.
# Screenshots and measures go to ci-artifacts/ui/. Every non-local request of the browser is blocked.
#
# Run from the repository root as `bash ci/ui.sh` with the project's venv at .venv (or PYTHON=...). Needs no stdin.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
ART=$ROOT/ci-artifacts/ui
START=$(date +%s)

step() { echo "== [$(($(date +%s) - START)) s] $*"; }
fail() { echo "ci/ui.sh: $*" >&2; exit 1; }

[ -x "$PYTHON" ] || fail "no Python at $PYTHON (create the venv first, or set PYTHON)"
rm -rf "$ART"
mkdir -p "$ART/work" "$ART/screenshots" "$ART/html"

step "tools"
source ci/browser/tools.sh
browser_tools
# JupyterLab and Notebook 7 go into the project's venv (the kernel is that venv's Python): pyproject's "browser" extra
"$PYTHON" - <<'EOF' || "$PYTHON" -m pip install -q -e ".[browser]"
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in ("jupyterlab", "notebook", "nbconvert")))
EOF
echo "$(chromium --version 2>/dev/null | head -1), node $(node --version), $("$PYTHON" -c 'import jupyterlab, notebook; print(f"JupyterLab {jupyterlab.__version__}, Notebook {notebook.__version__}")')"

# --- the server -----------------------------------------------------------------------------------------------
# A settings folder of its own: the light theme to start with, no news pop-up, every cell kept in the DOM.
SETTINGS=$ART/settings
mkdir -p "$SETTINGS/@jupyterlab/apputils-extension" "$SETTINGS/@jupyterlab/notebook-extension"
echo '{"fetchNews": "false", "checkForUpdates": false}' > "$SETTINGS/@jupyterlab/apputils-extension/notification.jupyterlab-settings"
echo '{"windowingMode": "none"}' > "$SETTINGS/@jupyterlab/notebook-extension/tracker.jupyterlab-settings"
cp ci/browser/display_check.ipynb "$ART/work/"
# a tutorial saved by nbclient carries no signature: JupyterLab treats it as untrusted and sanitizes its HTML
cp notebooks/02_measuring_it.ipynb "$ART/work/untrusted.ipynb"
# and the text-generation tutorial: its reports carry the KV cache, a sixth colour
cp notebooks/08_memory_of_text_generation.ipynb "$ART/work/untrusted-generation.ipynb"

PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
step "JupyterLab and Notebook 7 on port $PORT (log in ${ART#"$ROOT"/}/server.log)"
# one CPU thread per kernel: the browser and the kernel share the machine's cores
JUPYTERLAB_SETTINGS_DIR=$SETTINGS OMP_NUM_THREADS=1 "$PYTHON" -m jupyterlab --allow-root --no-browser \
    --ServerApp.token= --ServerApp.password= --ServerApp.disable_check_xsrf=True --ServerApp.port="$PORT" \
    --ServerApp.ip=127.0.0.1 --ServerApp.root_dir="$ART/work" --LabApp.workspaces_dir="$ART/workspaces" \
    >"$ART/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; [ -n "${HTTP:-}" ] && kill $HTTP 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/api/status')" 2>/dev/null && break
    sleep 0.5
done

step "JupyterLab and Notebook 7 in chromium"
CHROMIUM=$(command -v chromium) node ci/browser/ui_check.mjs "http://127.0.0.1:$PORT" display_check.ipynb \
    "$ART/screenshots" untrusted.ipynb untrusted-generation.ipynb | tee "$ART/ui_check.log"
kill $SERVER 2>/dev/null || true

step "nbconvert HTML, plain and --sanitize-html, in chromium"
"$PYTHON" -m jupyter nbconvert --to html "$ART/work/display_check.ipynb" --output-dir "$ART/html" \
    --output display_check --log-level=WARN
"$PYTHON" -m jupyter nbconvert --to html --sanitize-html "$ART/work/display_check.ipynb" --output-dir "$ART/html" \
    --output display_check-sanitized --log-level=WARN
HTTP_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PYTHON" -m http.server "$HTTP_PORT" --bind 127.0.0.1 --directory "$ART/html" >"$ART/http.log" 2>&1 &
HTTP=$!
for _ in $(seq 50); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$HTTP_PORT/')" 2>/dev/null && break
    sleep 0.1
done
CHROMIUM=$(command -v chromium) VRAM_EXPECT_RANKS=1 node ci/browser/check.mjs "http://127.0.0.1:$HTTP_PORT/" \
    "$ART/screenshots" display_check.html display_check-sanitized.html

step "done in $(($(date +%s) - START)) s; screenshots in ${ART#"$ROOT"/}/screenshots"
