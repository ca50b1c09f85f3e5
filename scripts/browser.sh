#!/usr/bin/env bash
# Install Debian's chromium for the web page's browser test (tests/integration/test_web_page.py).
# Idempotent: nothing to do (and no network) when /usr/bin/chromium is there. Playwright drives
# this binary through executable_path; it never downloads a browser of its own.
set -euo pipefail
CHROMIUM=/usr/bin/chromium
if [[ -x "$CHROMIUM" ]]; then
  echo "browser: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
  exit 0
fi
SUDO=()
[[ "$(id -u)" == 0 ]] || SUDO=(sudo)
echo "browser: apt-get install chromium (first time: a minute or two)"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q >/dev/null
"${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium >/dev/null
echo "browser: $("$CHROMIUM" --version)"
