# Sourced by ci/notebooks.sh and ci/ui.sh, from the repository root: Debian's chromium, node and npm, the fonts the
# screenshots are measured in (installed only where missing), and the npm packages of ci/browser (playwright-core),
# installed again when package-lock.json changed.
browser_tools() {
    local missing=()
    command -v chromium >/dev/null || missing+=(chromium)
    command -v node >/dev/null || missing+=(nodejs)
    command -v npm >/dev/null || missing+=(npm)
    dpkg -s fonts-dejavu-core >/dev/null 2>&1 || missing+=(fonts-dejavu-core)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    if ! (cd ci/browser && node -e 'require.resolve("playwright-core")' 2>/dev/null) \
        || [ ci/browser/package-lock.json -nt ci/browser/node_modules/.package-lock.json ]; then
        (cd ci/browser && npm ci --no-audit --no-fund --loglevel=error)
    fi
}
