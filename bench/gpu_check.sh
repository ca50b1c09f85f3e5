#!/usr/bin/env bash
# GPU check: the infer stage's handler with the real vLLM engine on a tiny random Qwen2-VL, in
# micro-batches of 1 and 16 (a barrier after each) and in a window of 256 pages in flight,
# printing images/s and the ratios b16/b1, w256/b1 and w256/b16.
#
# For one single-GPU machine with no internet (on an H200 with the bundle, 2026-11-30: 153 s;
# 161 s with ENFORCE_EAGER=0). Worst case 475 s: the whole script runs under
# `timeout --kill-after=15 $GPU_CHECK_TIMEOUT_S` (default 460 s, capped at 465 s). Steps, each timed:
#   1. GPU and Python present (python3 >= 3.10);
#   2. what is missing (bench/gpu/missing.py, under a second): vLLM, torch, transformers,
#      tokenizers and the infer stage's own dependencies (aiokafka, pydantic-settings, boto3,
#      opentelemetry-sdk, orjson, ...). If anything is missing, it is installed offline from a
#      wheel folder into a venv that also sees this Python's packages; with no wheel folder, or
#      one without vllm, the script stops here (seconds) and says what to provide;
#   3. a tiny randomly initialised Qwen2-VL checkpoint built locally (bench/gpu/tiny_vlm.py:
#      tokenizer trained here, no download);
#   4. bench/gpu/throughput.py: VllmEngine.start() (load + warm-up), a timeout/abort check,
#      then InferHandler over in-memory PNG records in micro-batches of 1 and 16 and a window of
#      256 (only Kafka and S3 are stand-ins) and the ratios, for every task (ocr, doc_parse, table, formula,
#      chart, extract, translate; HunyuanOCR's prompts, extract with four invoice fields,
#      translate into English): pages/s and output tokens/s per task and batch size, one table
#      (bench/gpu/tasks.py), last line RESULT {json}. The default is TASKS=ocr (a window of 256 reads
#      512 pages per task); TASKS=all runs every task.
#
# Providing vLLM, one of:
#   a) a machine image where `python3 -c 'import vllm'` works (then nothing is installed);
#   b) an offline bundle made by bench/gpu/bundle.sh: vllm 0.26.0 (the newest vLLM that pins
#      torch 2.11.0, the torch of this project's GPU machine image), trimmed to what one dense
#      model on a Hopper GPU uses, and the packages that image lacks, as one site-packages tree
#      packed as tar.xz in parts of at most 54 MiB: .gpu-bundle/1/, .gpu-bundle/2/ (git-ignored).
#      The parts are reassembled (sha256 checked), unpacked once per machine to
#      /tmp/ocrstream-gpu-site and put first on PYTHONPATH. Where one call can carry 64 MiB
#      (this workplace's device tool), carry .gpu-bundle/1 in one call and .gpu-bundle/2 with
#      the run in the next, sent at once: the first part stays on the machine only while it is
#      held (30 s after a command there);
#   c) a wheel folder: WHEEL_DIR=/path, or .whl/ at the repo root (git-ignored), holding vllm,
#      the torch it pins and every other missing distribution (step 2 prints the list), made on
#      a machine with PyPI access for CPython 3.12 on x86-64 Linux:
#
#      python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#          --abi cp312 --abi abi3 --abi none $(for t in _2_35 _2_34 _2_31 _2_28 _2_27 _2_26 _2_24 \
#          _2_17 2014 _2_5 1; do echo --platform manylinux${t}_x86_64; done) --platform any \
#          -d .whl vllm==0.26.0 torch==2.11.0 $(python3 bench/gpu/missing.py | grep -v '^vllm\|^torch')
#
#      That is several GB (torch and the CUDA libraries).
#
# Environment knobs: PYTHON, GPU_BUNDLE (default .gpu-bundle), GPU_BUNDLE_SITE (default
# /tmp/ocrstream-gpu-site), WHEEL_DIR, GPU_CHECK_TIMEOUT_S, ENFORCE_EAGER (1 = no CUDA graphs,
# default, faster start; 0 = CUDA graphs, closer to production), BATCHES (default 1,16), WINDOWS (default 256),
# TASKS (default ocr; all, or a comma-separated list such as ocr,extract).
set -euo pipefail

if [[ -z "${GPU_CHECK_INNER:-}" ]]; then
    export GPU_CHECK_INNER=1
    limit="${GPU_CHECK_TIMEOUT_S:-460}"
    (( limit > 465 )) && limit=465  # + 15 s kill-after = 480 s at most
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
# bundle paths given relative are relative to where the script was started
BUNDLE="$(realpath -m -- "${GPU_BUNDLE:-$ROOT/.gpu-bundle}")"
SITE="$(realpath -m -- "${GPU_BUNDLE_SITE:-/tmp/ocrstream-gpu-site}")"
cd "$ROOT"
T0=$SECONDS
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ocrstream-gpu-check.XXXXXX")"
step() { echo; echo "=== [$((SECONDS - T0)) s] $*"; }
save_logs() { if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then cp "$WORK"/*.log "$OUT"/ 2>/dev/null || true; fi; }
trap save_logs EXIT
trap "exit 143" TERM INT  # so the EXIT trap runs when the timeout stops the script
die() { echo "gpu_check: FAILED after $((SECONDS - T0)) s: $*" >&2; exit 1; }

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
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

step "2/4 vLLM and the infer stage's dependencies"
# The offline bundle (bench/gpu/bundle.sh): parts N/site.tar.xz.partNN, each folder with a
# MANIFEST (parts=, sha256= of the whole, partNN= sha256 of each part). Unpacked once into $SITE
# (stamped with the bundle's sha256 in $SITE/.ocrstream-gpu-bundle), through a temporary folder
# renamed into place.
manifest() { sed -n "s/^$1=//p" "$BUNDLE"/*/MANIFEST 2>/dev/null | tr -d '\r' | sort -u; }
mapfile -t PARTS < <(for f in "$BUNDLE"/*/site.tar.xz.part*; do
    [[ -f "$f" ]] && printf '%s\t%s\n' "$(basename "$f")" "$f"; done | sort | cut -f2-)
if [[ -n "${GPU_BUNDLE:-}" && ${#PARTS[@]} -eq 0 ]]; then
    die "GPU_BUNDLE=$GPU_BUNDLE: no parts there (expected $BUNDLE/1/site.tar.xz.part00, $BUNDLE/2/site.tar.xz.part01, ...)"
fi
if [[ ${#PARTS[@]} -gt 0 ]]; then
    ls "$BUNDLE"/*/MANIFEST >/dev/null 2>&1 || die "$BUNDLE has parts but no MANIFEST; rebuild with bench/gpu/bundle.sh"
    want="$(manifest sha256)"
    nparts="$(manifest parts)"
    [[ -n "$want" && -n "$nparts" ]] && ! grep -qvxE '[0-9a-f]{64}' <<<"$want" && ! grep -qvxE '[1-9][0-9]*' <<<"$nparts" \
        || die "the MANIFEST files under $BUNDLE have no sha256= or parts= line; rebuild with bench/gpu/bundle.sh"
    if [[ $(wc -l <<<"$want") -ne 1 || $(wc -l <<<"$nparts") -ne 1 ]]; then
        die "$BUNDLE holds parts of different builds of the bundle:
$(for m in "$BUNDLE"/*/MANIFEST; do echo "  $(dirname "$m"): $(grep -h '^sha256=' "$m" | tr -d '\r'), $(grep -h '^parts=' "$m" | tr -d '\r')"; done)
Carry every folder of one build (a rebuild from other packages or with other tools has another sha256, and then the
parts already on the machine no longer fit)."
    fi
    case "$BUNDLE/" in "$SITE"/*) die "GPU_BUNDLE_SITE=$SITE holds the bundle itself ($BUNDLE); choose another folder";; esac
    STAMP=.ocrstream-gpu-bundle  # holds the sha256 of the bundle unpacked there
    stamped() { [[ -f "$SITE/$STAMP" ]] && grep -qxE '[0-9a-f]{64}' "$SITE/$STAMP"; }
    if stamped && [[ "$(cat "$SITE/$STAMP")" == "$want" ]]; then
        echo "bundle $want already unpacked in $SITE"
    else
        if [[ -e "$SITE" ]] && ! stamped && [[ -n "$(ls -A "$SITE" 2>/dev/null)" || ! -d "$SITE" ]]; then
            die "$SITE exists, is not empty and is not an unpacked bundle (no $STAMP stamp): not touching it. Set GPU_BUNDLE_SITE to another folder or remove it."
        fi
        names="$(for f in "${PARTS[@]}"; do basename "$f"; done | sort -u)"
        expected="$(for ((i = 0; i < nparts; i++)); do printf 'site.tar.xz.part%02d\n' "$i"; done)"
        if [[ "$names" != "$expected" || ${#PARTS[@]} -ne $nparts ]]; then
            lacking="$(comm -13 <(echo "$names") <(echo "$expected") | tr '\n' ' ')"
            extra="$(comm -23 <(echo "$names") <(echo "$expected") | tr '\n' ' ')"
            die "bundle incomplete or mixed: the MANIFEST says $nparts parts (part00..part$(printf %02d $((nparts - 1)))); found ${#PARTS[@]}:
$(printf '  %s\n' "${PARTS[@]}")${lacking:+
missing: $lacking}${extra:+
unexpected or twice: $extra}
Every .gpu-bundle/N folder must be on this machine. Carried one per call, the next call must come within
the machine's idle window (30 s on this workplace's device tool): a machine handed back loses the parts carried before."
        fi
        for f in "${PARTS[@]}"; do
            part="$(basename "$f")"; part="${part#site.tar.xz.}"
            ps="$(manifest "$part")"
            if [[ -n "$ps" ]]; then
                [[ "$(sha256sum < "$f" | cut -d' ' -f1)" == "$ps" ]] \
                    || die "bundle part $f is damaged (sha256 differs from the MANIFEST): carry that folder again"
            fi
        done
        got="$(cat "${PARTS[@]}" | sha256sum | cut -d' ' -f1)"
        [[ "$got" == "$want" ]] || die "bundle parts do not add up: sha256 $got, MANIFEST says $want; carry the folders again"
        tmp="$SITE.unpacking.$$"
        trap 'rm -rf -- "$tmp"; save_logs' EXIT  # a run killed mid-unpack leaves nothing behind
        rm -rf -- "$tmp" && mkdir -p -- "$tmp" || die "cannot create $tmp"
        if command -v xz >/dev/null 2>&1; then
            cat "${PARTS[@]}" | xz -d -T0 | tar xf - -C "$tmp" || die "unpacking the bundle failed"
        else
            echo "no xz here; unpacking with Python's tarfile (slower)"
            cat "${PARTS[@]}" | "$PY" -c 'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="data")' "$tmp" \
                || die "unpacking the bundle failed"
        fi
        echo "$want" > "$tmp/$STAMP"
        # only an earlier unpacked bundle (stamped) or an empty folder is replaced
        rm -rf -- "$SITE" || die "cannot remove the earlier bundle in $SITE"
        mv -T -- "$tmp" "$SITE" || die "cannot move the unpacked bundle into $SITE"
        trap save_logs EXIT
        echo "bundle unpacked into $SITE ($(du -sh "$SITE" | cut -f1), $((SECONDS - T0)) s so far)"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    BUNDLED=1
fi
MISSING="$("$PY" bench/gpu/missing.py || true)"
if [[ -z "$MISSING" ]]; then
    echo "everything importable by $PY"
else
    echo "missing for $PY: $(echo $MISSING)"
    WHEELS=""
    for d in "${WHEEL_DIR:-}" "$ROOT/.whl" "$ROOT/../.whl" "$ROOT/shared/.whl" "$HOME/.whl"; do
        if [[ -n "$d" && -d "$d" ]] && compgen -G "$d/*.whl" >/dev/null; then WHEELS="$d"; break; fi
    done
    if [[ -z "$WHEELS" && -n "${BUNDLED:-}" ]]; then
        die "missing even with the bundle in $SITE: $(echo $MISSING). The bundle brings vLLM and the packages in
bench/gpu/bundle-requirements.txt; the rest (torch 2.11.0, transformers, tokenizers, numpy, ...) must come with the
machine image, or from a WHEEL_DIR."
    fi
    if [[ -z "$WHEELS" ]]; then
        die "missing: $(echo $MISSING). No wheel folder found (looked at \$WHEEL_DIR, $ROOT/.whl, $ROOT/../.whl, $ROOT/shared/.whl, $HOME/.whl).
Provide vLLM one of three ways: run on a machine image where '$PY -c \"import vllm\"' works, or set WHEEL_DIR to a folder
holding vllm==0.26.0, torch==2.11.0 and the other distributions listed above, or build the offline bundle
(bench/gpu/bundle.sh; see the header of bench/gpu_check.sh)."
    fi
    if grep -q '^vllm' <<<"$MISSING" && ! compgen -G "$WHEELS/vllm-*.whl" >/dev/null; then
        die "vLLM is not installed and $WHEELS holds no vllm-*.whl ($(ls "$WHEELS" | wc -l) files). Put vllm==0.26.0, torch==2.11.0 and
their dependencies there, build the offline bundle (bench/gpu/bundle.sh), or run on a machine image with vllm installed."
    fi
    echo "installing offline from $WHEELS ($(ls "$WHEELS" | wc -l) files, $(du -sh "$WHEELS" | cut -f1))"
    # A venv that also sees $PY's packages. `--system-site-packages` would give the *base*
    # interpreter's, not those of a venv $PY lives in (/opt/torch/.venv on the GPU machine), so
    # a .pth file lists $PY's own site-packages; pip then counts them as installed and fetches
    # only what is missing or pinned to another version (installed into the new venv, first on
    # sys.path).
    VENV="$WORK/venv"
    "$PY" -m venv "$VENV" || die "$PY -m venv failed"
    VSITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        > "$VSITE/zz_parent_site.pth"
    echo "parent site-packages: $(tr '\n' ' ' < "$VSITE/zz_parent_site.pth")"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" $MISSING 2>&1 | tee "$WORK/pip.log" \
        || die "offline pip install of $(echo $MISSING) from $WHEELS failed (a wheel missing? see $WORK/pip.log)"
    PY="$VENV/bin/python"
    STILL="$("$PY" bench/gpu/missing.py || true)"
    [[ -z "$STILL" ]] || die "still missing after the install: $(echo $STILL)"
fi
# vLLM samples top-k/top-p with FlashInfer by default and imports it when the engine starts. The
# bundle leaves FlashInfer out (its wheel, the CUTLASS DSL and cuDNN front end it pulls in do not
# fit the parts), so without it vLLM is told to use its own sampler. A pip install of the `gpu`
# extra (Dockerfile.gpu) brings FlashInfer and keeps vLLM's default.
if ! "$PY" -c 'import flashinfer' >/dev/null 2>&1; then
    export VLLM_USE_FLASHINFER_SAMPLER=0
    echo "flashinfer not importable: VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM's own top-k/top-p sampler)"
fi
"$PY" - <<'PY' || die "vLLM does not import, or torch sees no CUDA device"
import torch, vllm, transformers
print("vllm", vllm.__version__, "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| transformers", transformers.__version__)
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("device 0:", torch.cuda.get_device_name(0))
PY

step "3/4 tiny random Qwen2-VL checkpoint (local, no download)"
MODEL="$WORK/tiny-qwen2vl"
set -o pipefail
"$PY" bench/gpu/tiny_vlm.py "$MODEL" 2>&1 | tee "$WORK/tiny.log" || die "building the tiny checkpoint failed (see above)"
LOAD_FORMAT="$(sed -n 's/^load_format=//p' "$WORK/tiny.log" | tail -1)"
[[ -n "$LOAD_FORMAT" ]] || die "tiny_vlm.py did not say which load_format to use"
ls -la "$MODEL"

step "4/4 InferHandler + VllmEngine throughput, tasks ${TASKS:-ocr}, micro-batches ${BATCHES:-1,16}, windows ${WINDOWS:-256} (load_format=$LOAD_FORMAT, enforce_eager=${ENFORCE_EAGER:-1})"
"$PY" bench/gpu/throughput.py --model "$MODEL" --load-format "$LOAD_FORMAT" --tasks "${TASKS:-ocr}" \
    --batches "${BATCHES:-1,16}" --windows "${WINDOWS:-256}" --enforce-eager "${ENFORCE_EAGER:-1}" 2>&1 | tee "$WORK/throughput.log" \
    || die "throughput run failed (log: $WORK/throughput.log)"

step "done in $((SECONDS - T0)) s"
