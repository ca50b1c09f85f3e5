#!/usr/bin/env bash
# GPU check: VllmEngine batching throughput on a tiny random Qwen2-VL, batch 1 / 8 / 32.
#
# For one single-GPU machine (H200) with no internet; finishes within 8 minutes (the whole
# script runs under `timeout`, GPU_CHECK_TIMEOUT_S, default 470 s). Steps, each timed:
#   1. GPU and Python present (python3 >= 3.10; the GPU machine has 3.12);
#   2. vLLM importable, else installed offline from a wheel folder into a venv
#      (/tmp/ocrstream-gpu-venv, --system-site-packages so a preinstalled torch is reused);
#   3. a tiny randomly initialised Qwen2-VL checkpoint built locally (bench/gpu/tiny_vlm.py:
#      tokenizer trained here, no download);
#   4. bench/gpu/throughput.py: VllmEngine.start() (load + warm-up), a timeout/abort check,
#      then images/s at batch 1, 8, 32 and the ratios b8/b1, b32/b1 (last line: RESULT {json}).
#
# Preparing the wheels (on a machine with PyPI access; the folder `.whl/` at the repo root,
# git-ignored; or WHEEL_DIR=/path). vLLM pins its own torch, so naming vllm pulls the right one:
#
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#       --abi cp312 --abi abi3 --abi none \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any \
#       -d .whl vllm==0.33.0 torch==2.15.0 pydantic-settings==2.14.1 rapidfuzz==3.14.6
#
# (versions as listed in the package index at the time of writing; if pip reports a conflict,
# drop the torch pin and let vllm choose). Expect several GB (torch + CUDA libraries).
#
# Environment knobs: PYTHON, WHEEL_DIR, GPU_CHECK_TIMEOUT_S, ENFORCE_EAGER (1 = no CUDA graphs,
# default, faster start; 0 = CUDA graphs, closer to production), BATCHES (default 1,8,32).
set -euo pipefail

if [[ -z "${GPU_CHECK_INNER:-}" ]]; then
    export GPU_CHECK_INNER=1
    limit="${GPU_CHECK_TIMEOUT_S:-470}"
    set +e
    timeout --kill-after=15 "$limit" bash "$0" "$@"
    rc=$?
    set -e
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "gpu_check: FAILED: ran past ${limit} s (timeout)" >&2
    fi
    exit "$rc"
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
T0=$SECONDS
step() { echo; echo "=== [$((SECONDS - T0)) s] $*"; }
die() { echo "gpu_check: FAILED: $*" >&2; exit 1; }

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORK="$(mktemp -d /tmp/ocrstream-gpu-check.XXXXXX)"
export HF_HOME="$WORK/hf" VLLM_CACHE_ROOT="$WORK/vllm-cache"

step "1/4 GPU and Python"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader \
        || die "nvidia-smi cannot talk to the driver"
else
    echo "warning: nvidia-smi not found; relying on torch to find the GPU"
fi
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || die "no $PY"
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' || die "$PY is older than 3.10"
"$PY" -c 'import sys; print("python", sys.version.split()[0], sys.executable)'

step "2/4 vLLM"
have_deps() { "$1" -c 'import vllm, torch, transformers, tokenizers, pydantic_settings, rapidfuzz' >/dev/null 2>&1; }
if have_deps "$PY"; then
    echo "vLLM and the project's deps already importable by $PY"
else
    WHEELS=""
    for d in "${WHEEL_DIR:-}" "$ROOT/.whl" "$ROOT/../.whl" "$ROOT/shared/.whl" "$HOME/.whl"; do
        if [[ -n "$d" && -d "$d" ]] && compgen -G "$d/vllm-*.whl" >/dev/null; then WHEELS="$d"; break; fi
    done
    [[ -n "$WHEELS" ]] || die "vLLM is not installed and no wheel folder with vllm-*.whl was found (looked at \$WHEEL_DIR, $ROOT/.whl, $ROOT/../.whl, $ROOT/shared/.whl); see the header of this script"
    echo "installing offline from $WHEELS ($(ls "$WHEELS" | wc -l) files, $(du -sh "$WHEELS" | cut -f1))"
    VENV=/tmp/ocrstream-gpu-venv
    [[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV"
    reqs=(vllm)
    "$VENV/bin/python" -c 'import pydantic_settings' >/dev/null 2>&1 || reqs+=(pydantic-settings)
    "$VENV/bin/python" -c 'import rapidfuzz' >/dev/null 2>&1 || reqs+=(rapidfuzz)
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" "${reqs[@]}" \
        || die "offline pip install of ${reqs[*]} from $WHEELS failed (missing wheels? see the header)"
    PY="$VENV/bin/python"
    have_deps "$PY" || { "$PY" -c 'import vllm, torch, transformers, tokenizers, pydantic_settings, rapidfuzz' || true; die "imports still fail after install"; }
fi
"$PY" - <<'PY' || die "torch sees no CUDA device"
import torch, vllm, transformers
print("vllm", vllm.__version__, "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| transformers", transformers.__version__)
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("device 0:", torch.cuda.get_device_name(0))
PY

step "3/4 tiny random Qwen2-VL checkpoint (local, no download)"
MODEL="$WORK/tiny-qwen2vl"
"$PY" bench/gpu/tiny_vlm.py "$MODEL" | tee "$WORK/tiny.log" || die "building the tiny checkpoint failed"
LOAD_FORMAT="$(sed -n 's/^load_format=//p' "$WORK/tiny.log" | tail -1)"
[[ -n "$LOAD_FORMAT" ]] || die "tiny_vlm.py did not say which load_format to use"
ls -la "$MODEL"

step "4/4 VllmEngine throughput, batches ${BATCHES:-1,8,32} (load_format=$LOAD_FORMAT, enforce_eager=${ENFORCE_EAGER:-1})"
"$PY" bench/gpu/throughput.py --model "$MODEL" --load-format "$LOAD_FORMAT" \
    --batches "${BATCHES:-1,8,32}" --enforce-eager "${ENFORCE_EAGER:-1}" 2>&1 | tee "$WORK/throughput.log" \
    || die "throughput run failed (log: $WORK/throughput.log)"
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then cp "$WORK"/*.log "$OUT"/ 2>/dev/null || true; fi

step "done in $((SECONDS - T0)) s"
