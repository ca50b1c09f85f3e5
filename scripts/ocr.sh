#!/usr/bin/env bash
# The main job: install, bring up the local stack and the stages (the four and jobs), OCR a folder
# (default ../shared/samples), print each image's text and where the result JSON files are.
# The stack and the stages keep running afterwards; stop them with deploy/local/down.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
INPUT="${1:-$ROOT/../shared/samples}"
OUT="${2:-$ROOT/results}"
bash scripts/install.sh
bash deploy/local/up.sh
bash deploy/local/stages.sh start
if [[ $# -eq 0 ]]; then
  # the samples folder holds the images and manifest.json (their true text lines): OCR the images
  mapfile -t FILES < <(find "$INPUT" -maxdepth 1 -type f ! -name manifest.json ! -name '.*' | sort)
  exec .venv/bin/ocrstream submit "${FILES[@]}" --wait --out "$OUT" --name "$(basename "$INPUT")"
fi
exec .venv/bin/ocrstream submit "$INPUT" --wait --out "$OUT"
