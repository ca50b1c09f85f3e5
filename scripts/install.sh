#!/usr/bin/env bash
# Create .venv and install ocrstream with its test extra (skipped when pyproject.toml is unchanged).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.installed-$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [[ -f "$STAMP" ]]; then
  echo "install: .venv up to date"
  exit 0
fi
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "ocrstream needs Python >= 3.11"'
[[ -x "$VENV/bin/python" ]] || { echo "install: creating $VENV"; "$PY" -m venv "$VENV"; }
echo "install: pip install -e '.[test]' (first time: a few minutes)"
"$VENV/bin/pip" install -q --disable-pip-version-check -U pip
"$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test]"
rm -f "$VENV"/.installed-*
touch "$STAMP"
echo "install: done"
