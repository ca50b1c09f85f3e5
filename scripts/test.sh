#!/usr/bin/env bash
# The test command: install, bring up the local stack, run every test tier. Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/install.sh
.venv/bin/lint-imports --no-cache  # the import contracts in pyproject.toml (stages independent, schemas alone)
bash scripts/browser.sh
bash scripts/k8s-tools.sh | sed '$d'  # its last line is the tools folder (for helm-check.sh), not news
bash scripts/helm-check.sh
bash deploy/local/up.sh
# a missing stack or helm fails the run here instead of skipping (tests/stack.py strict_run)
export OCRSTREAM_TEST_STRICT=1
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
