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
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider)
if [ $# -gt 0 ]; then exec "${PYTEST[@]}" "$@"; fi  # what you asked for, in one process
# The whole run, in two phases (docs/contributing.md#the-whole-run):
# 1. the `exclusive` tests, which stop or freeze a service of the shared stack, alone, first (a
#    restarted Kafka then has few partitions to load);
# 2. every other test on OCRSTREAM_TEST_WORKERS processes (pytest-xdist); a module stays on one
#    worker (--dist loadfile), so its pipeline and fixtures are made once; each worker's session has
#    its own namespace (topics, groups, Redis prefix, bucket).
start=$SECONDS
rc=0
"${PYTEST[@]}" -m exclusive || rc=$?
# 0: passed, 1: some failed; anything else (2: interrupted by Ctrl-C, 3-5: pytest's own errors) stops here
case $rc in 0|1) ;; *) echo "scripts/test.sh: pytest exited $rc; the other tests are not run"; exit $rc ;; esac
"${PYTEST[@]}" -n "${OCRSTREAM_TEST_WORKERS:-2}" --dist loadfile -m "not exclusive" || rc=$((rc ? rc : $?))
echo "scripts/test.sh: both phases of pytest in $((SECONDS - start)) s, exit $rc"
exit $rc
