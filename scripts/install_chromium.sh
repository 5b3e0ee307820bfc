#!/usr/bin/env bash
# Installs headless Chromium (Debian's `chromium` package) for tests/test_ui_browser.py,
# only if it is missing. `make browser` runs it, and `make test` runs `make browser` first.
#
# The browser test drives the Chromium at $PERSIST_CHROMIUM (default /usr/bin/chromium)
# through Playwright's Python package (a `dev` dependency in pyproject.toml); Playwright's
# own browser download is never used. Exits non-zero with a clear message when Chromium
# is missing and cannot be installed (no apt-get, not root, or the install failed).
set -euo pipefail

CHROMIUM="${PERSIST_CHROMIUM:-/usr/bin/chromium}"

if [ -x "$CHROMIUM" ]; then
    exit 0
fi

fail() {
    echo "install_chromium.sh: $CHROMIUM is missing and $1." >&2
    echo "  tests/test_ui_browser.py needs a headless Chromium: install Debian's 'chromium'" >&2
    echo "  package (apt-get install -y chromium) or set PERSIST_CHROMIUM to a Chromium or" >&2
    echo "  Chrome binary, then run make test again." >&2
    exit 1
}

if [ "$CHROMIUM" != /usr/bin/chromium ]; then
    fail "PERSIST_CHROMIUM names it explicitly (only /usr/bin/chromium is installed here)"
fi
command -v apt-get >/dev/null 2>&1 || fail "apt-get is not available on this machine"
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        fail "installing it needs root (or password-less sudo)"
    fi
else
    SUDO=()
fi

echo "install_chromium.sh: installing Debian's chromium package (apt-get)..."
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q || fail "'apt-get update' failed"
"${SUDO[@]}" apt-get install -y -q chromium \
    || fail "'apt-get install chromium' failed"
[ -x "$CHROMIUM" ] || fail "the chromium package did not provide it"
"$CHROMIUM" --version
