#!/usr/bin/env bash
# CI stage: the JupyterLab extension as users get it.
#   1. the front end in vram_magic/lab/labextension is the build of labextension/src (rebuilt with npm, compared
#      with what is committed);
#   2. a wheel built from the checkout with no Node.js on PATH (what `pip install git+URL` does) installs in a
#      venv with JupyterLab, no Node.js and nothing of vram_magic before (kept in $VRAM_CI_CACHE), where
#      `jupyter labextension list` says vram-magic is enabled and OK and `jupyter server extension list` says
#      vram_magic.lab is enabled and OK;
#   3. JupyterLab 4 with two notebooks (one holding a 256 MiB tensor, with vram_magic loaded) and Notebook 7, driven
#      in Debian's headless chromium (ci/browser/lab_check.mjs): the status bar, the panel, a shut-down from it,
#      keyboard, contrast in light and dark themes, narrow widths, console errors.
# Screenshots and measures go to ci-artifacts/lab/. Every non-local request of the browser is blocked.
#
# Run from the repository root as `bash ci/lab.sh` with the project's venv at .venv (or PYTHON=...). Needs no stdin.
# VRAM_LAB_SKIP_WHEEL=1 skips step 2 (its venv with JupyterLab takes a minute or two to make, the first time).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
ART=$ROOT/ci-artifacts/lab
START=$(date +%s)

step() { echo "== [$(($(date +%s) - START)) s] $*"; }
fail() { echo "ci/lab.sh: $*" >&2; exit 1; }

[ -x "$PYTHON" ] || fail "no Python at $PYTHON (create the venv first, or set PYTHON)"
VENV_BIN=$(dirname "$PYTHON")
rm -rf "$ART"
mkdir -p "$ART/work" "$ART/screenshots"

step "tools"
source ci/browser/tools.sh
browser_tools
"$PYTHON" - <<'EOF' || "$PYTHON" -m pip install -q -e ".[browser]"
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in ("jupyterlab", "notebook", "jupyter_builder")))
EOF
echo "$(chromium --version 2>/dev/null | head -1), node $(node --version), $("$PYTHON" -c 'import jupyterlab, notebook; print(f"JupyterLab {jupyterlab.__version__}, Notebook {notebook.__version__}")')"

# --- 1. the committed front end is the build of its sources ---------------------------------------------------
step "front end: npm build of labextension/ against the committed vram_magic/lab/labextension"
if ! (cd labextension && node -e 'require.resolve("@jupyter/builder/package.json")' 2>/dev/null) \
    || [ labextension/package-lock.json -nt labextension/node_modules/.package-lock.json ]; then
    (cd labextension && npm ci --no-audit --no-fund --loglevel=error)
fi
(cd labextension && PATH="$VENV_BIN:$PATH" npm run --silent build:prod >"$ART/npm-build.log" 2>&1) \
    || { tail -30 "$ART/npm-build.log"; fail "the front end does not build (log in ${ART#"$ROOT"/}/npm-build.log)"; }
changed=$(git status --porcelain -- vram_magic/lab/labextension)
[ -z "$changed" ] || fail "the committed front end is not the build of labextension/src:
$changed
run \`cd labextension && PATH=$VENV_BIN:\$PATH npm run build:prod\` and commit vram_magic/lab/labextension"
echo "the build is identical to the committed files ($(find vram_magic/lab/labextension -type f | wc -l) files, $(du -sk vram_magic/lab/labextension | cut -f1) KiB)"

# --- 2. a wheel, built and installed without Node.js ----------------------------------------------------------
NO_NODE=$ART/no-node-bin  # the venv's tools and the few system ones pip and jupyter call; no node, no npm
mkdir -p "$NO_NODE"
for tool in sh bash env uname git; do
    [ -x "/usr/bin/$tool" ] && ln -sf "/usr/bin/$tool" "$NO_NODE/$tool"
done
if [ "${VRAM_LAB_SKIP_WHEEL:-0}" != 1 ]; then
    step "wheel: built from the checkout with no Node.js on PATH"
    WHEELS=$ART/wheel
    env PATH="$VENV_BIN:$NO_NODE" "$PYTHON" -c 'import shutil, sys; sys.exit(shutil.which("node") is not None)' \
        || fail "node is still on the PATH meant to lack it"
    env PATH="$VENV_BIN:$NO_NODE" "$PYTHON" -m pip wheel -q --no-deps -w "$WHEELS" . >"$ART/wheel.log" 2>&1 \
        || { tail -20 "$ART/wheel.log"; fail "the wheel does not build without Node.js"; }
    WHEEL=$(ls "$WHEELS"/vram_magic-*.whl)
    "$PYTHON" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["share/jupyter/labextensions/vram-magic/package.json", "share/jupyter/labextensions/vram-magic/install.json",
        "share/jupyter/labextensions/vram-magic/static/style.js",
        "etc/jupyter/jupyter_server_config.d/vram_magic.json", "vram_magic/lab/handlers.py"]
missing = [n for n in need if not any(x.endswith(n) for x in names)]
assert not missing, f"the wheel lacks {missing}"
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: {len(names)} files, front end and server config in it")
EOF
    # The venv holds JupyterLab and nothing of vram_magic: made once in the CI cache (a minute), then each run
    # uninstalls the previous wheel, checks nothing of it is left, and installs this one.
    CACHE=${VRAM_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vram_magic-ci}
    FRESH=$CACHE/lab-venv-jupyterlab4
    if [ ! -x "$FRESH/bin/jupyter-lab" ]; then
        step "wheel: a venv with JupyterLab, no Node.js (once, in ${CACHE})"
        rm -rf "$FRESH"
        "$PYTHON" -m venv "$FRESH"
        env PATH="$FRESH/bin:$NO_NODE" "$FRESH/bin/python" -m pip install -q --no-compile "jupyterlab>=4.2,<5" \
            >"$ART/fresh.log" 2>&1 || { tail -20 "$ART/fresh.log"; rm -rf "$FRESH"; fail "installing JupyterLab in a fresh venv failed"; }
    fi
    step "wheel: installed in a venv with JupyterLab and no Node.js"
    "$FRESH/bin/python" -m pip uninstall -q -y vram_magic >/dev/null 2>&1 || true
    for left in share/jupyter/labextensions/vram-magic etc/jupyter/jupyter_server_config.d/vram_magic.json; do
        [ ! -e "$FRESH/$left" ] || fail "$FRESH/$left is left from an earlier install"
    done
    # vram_magic's own dependencies (torch, ...) are not needed to list and load the extension: --no-deps
    env PATH="$FRESH/bin:$NO_NODE" "$FRESH/bin/python" -m pip install -q --no-deps "$WHEEL" >"$ART/fresh.log" 2>&1 \
        || { tail -20 "$ART/fresh.log"; fail "installing the wheel failed"; }
    env -i HOME="$HOME" PATH="$FRESH/bin:$NO_NODE" "$FRESH/bin/jupyter" labextension list >"$ART/labextension-list.txt" 2>&1
    env -i HOME="$HOME" PATH="$FRESH/bin:$NO_NODE" "$FRESH/bin/jupyter" server extension list >"$ART/server-extension-list.txt" 2>&1
    plain() { sed 's/\x1b\[[0-9;]*m//g' "$1"; }
    plain "$ART/labextension-list.txt" | grep -E "vram-magic v[0-9.]+ enabled +OK" \
        || { cat "$ART/labextension-list.txt"; fail "jupyter labextension list does not show vram-magic enabled and OK"; }
    plain "$ART/server-extension-list.txt" | grep -E "vram_magic.lab +enabled" >/dev/null \
        && plain "$ART/server-extension-list.txt" | grep -E "vram_magic.lab +OK" >/dev/null \
        || { cat "$ART/server-extension-list.txt"; fail "jupyter server extension list does not show vram_magic.lab enabled and OK"; }
    echo "jupyter server extension list: vram_magic.lab enabled, OK"
    "$FRESH/bin/python" -m pip uninstall -q -y vram_magic >/dev/null 2>&1 || true
fi

# --- 3. JupyterLab and Notebook 7 -----------------------------------------------------------------------------
SETTINGS=$ART/settings
mkdir -p "$SETTINGS/@jupyterlab/apputils-extension" "$SETTINGS/@jupyterlab/notebook-extension"
echo '{"fetchNews": "false", "checkForUpdates": false}' > "$SETTINGS/@jupyterlab/apputils-extension/notification.jupyterlab-settings"
# every cell in the DOM; a notebook's own kernel started without asking
echo '{"windowingMode": "none", "autoStartDefaultKernel": true}' > "$SETTINGS/@jupyterlab/notebook-extension/tracker.jupyterlab-settings"
"$PYTHON" - "$ART/work" <<'EOF'
import sys
import nbformat
from nbformat.v4 import new_code_cell, new_notebook
folder = sys.argv[1]
big = new_notebook(cells=[new_code_cell("import torch\nheld = torch.ones(64 * 2**20)  # 256 MiB"),
                          new_code_cell("%load_ext vram_magic"),
                          new_code_cell("%%vram -q\nlayer = torch.nn.Linear(1024, 4096)\nout = layer(torch.ones(256, 1024))")])
small = new_notebook(cells=[new_code_cell("x = sum(range(1000))")])
for name, nb in (("big.ipynb", big), ("small.ipynb", small)):
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, f"{folder}/{name}")
EOF

# The front end served is the checkout's build (the venv holds the copy made when it was last installed): a
# labextensions folder first on JUPYTER_PATH links to it, and the browser check looks for its remoteEntry file.
mkdir -p "$ART/jupyter-path/labextensions"
ln -sfn "$ROOT/vram_magic/lab/labextension" "$ART/jupyter-path/labextensions/vram-magic"
REMOTE_ENTRY=$(cd vram_magic/lab/labextension/static && ls remoteEntry.*.js)

PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
step "JupyterLab and Notebook 7 on port $PORT (log in ${ART#"$ROOT"/}/server.log)"
JUPYTER_PATH="$ART/jupyter-path${JUPYTER_PATH:+:$JUPYTER_PATH}" \
JUPYTERLAB_SETTINGS_DIR=$SETTINGS OMP_NUM_THREADS=1 "$PYTHON" -m jupyterlab --allow-root --no-browser \
    --ServerApp.token= --ServerApp.password= --ServerApp.disable_check_xsrf=True --ServerApp.port="$PORT" \
    --ServerApp.ip=127.0.0.1 --ServerApp.root_dir="$ART/work" --LabApp.workspaces_dir="$ART/workspaces" \
    >"$ART/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/api/status')" 2>/dev/null && break
    sleep 0.5
done
grep -q "vram-magic/kernels" "$ART/server.log" || fail "the server did not load vram_magic.lab (see ${ART#"$ROOT"/}/server.log)"

step "JupyterLab and Notebook 7 in chromium"
CHROMIUM=$(command -v chromium) VRAM_REMOTE_ENTRY=$REMOTE_ENTRY node ci/browser/lab_check.mjs "http://127.0.0.1:$PORT" big.ipynb small.ipynb \
    "$ART/screenshots" | tee "$ART/lab_check.log"
kill $SERVER 2>/dev/null || true

step "done in $(($(date +%s) - START)) s; screenshots in ${ART#"$ROOT"/}/screenshots"
