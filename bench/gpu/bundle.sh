#!/usr/bin/env bash
# Build the offline bundle that bench/gpu_check.sh installs on a GPU machine without a
# package index: vLLM 0.26.0 (trimmed) and the packages in bench/gpu/bundle-requirements.txt,
# installed into one site-packages tree, packed as tar.xz and split into parts small enough to
# carry (default 54 MiB each, two parts), one part per folder:
#
#     .gpu-bundle/1/site.tar.xz.part00   .gpu-bundle/2/site.tar.xz.part01   (+ MANIFEST in each)
#
# Run on a machine with PyPI access (x86-64 Linux, any Python >= 3.10 with pip; builds for
# CPython 3.12). Takes 2-6 minutes on 2 cores (mostly the xz step) and ~1 GB of /tmp.
#
# Why trimmed: the vllm 0.26.0 wheel is 290 MB. For one dense model on one Hopper GPU it needs
# _C_stable_libtorch (custom ops) and _vllm_fa3_C (FlashAttention 3, which vLLM picks on
# compute capability 9.x). Dropped: FlashAttention 2 (305 MB unpacked; Ampere/Ada), the MoE
# kernels (MoE models only), the Rust front end binary vllm-rs (the HTTP server), the
# Blackwell-only fmha_sm100 sources and DeepGEMM's C++ headers (JIT FP8 kernels) and its builds
# for Pythons other than 3.12. vLLM imports each of those inside try/except or only when used.
#
# Usage: bash bench/gpu/bundle.sh [OUT_DIR=.gpu-bundle] [PART_MB=54]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/.gpu-bundle}")"
PART_MB="${2:-54}"
[[ "$PART_MB" =~ ^[1-9][0-9]*$ ]] || { echo "bundle.sh: PART_MB must be a whole number of MiB, not '$PART_MB'" >&2; exit 2; }
# OUT is replaced at the end: refuse anything but an earlier bundle (N/ folders of parts + MANIFEST)
if [[ -e "$OUT" ]]; then
    stray=""
    [[ -d "$OUT" ]] || stray="$OUT"
    while IFS= read -r -d '' f; do
        rel="${f#"$OUT"/}"
        [[ "$rel" =~ ^[0-9]+(/(MANIFEST|site\.tar\.xz\.part[0-9]+))?$ ]] || stray+="$rel "
    done < <(find "$OUT" -mindepth 1 -print0 2>/dev/null)
    if [[ -n "$stray" ]]; then
        echo "bundle.sh: $OUT exists and is not an earlier bundle (it holds: ${stray:0:200}); not replacing it" >&2
        exit 2
    fi
fi
VLLM=vllm==0.26.0
PY="${PYTHON:-python3}"
TMP="$(mktemp -d /tmp/ocrstream-gpu-bundle.XXXXXX)"
trap 'rm -rf -- "$TMP" "${NEW:-}"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do PLAT+=(--platform "${p}_x86_64"); done
PLAT+=(--platform any)

echo "== downloading $VLLM and $(grep -c '==' "$ROOT/bench/gpu/bundle-requirements.txt") packages (no dependencies)"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP/wheels" "$VLLM" -r "$ROOT/bench/gpu/bundle-requirements.txt"

echo "== installing them into one tree"
"$PY" -m pip install -q --no-index --no-deps --no-compile "${PLAT[@]}" --target "$TMP/site" "$TMP"/wheels/*.whl
cd "$TMP/site"
rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
      vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
rm -rf vllm/third_party/fmha_sm100/cutlass vllm/third_party/deep_gemm/include bin
find . -name __pycache__ -prune -exec rm -rf {} +
# direct_url.json records this build's temporary path (and RECORD its hash): drop both
rm -f ./*.dist-info/direct_url.json
# ... and RECORD lists the console scripts removed above (their first line names this Python)
sed -i -e '/\.dist-info\/direct_url\.json,/d' -e '/^\.\.\/\.\.\/bin\//d' ./*.dist-info/RECORD
for f in vllm/_C_stable_libtorch.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so; do
    [[ -f "$f" ]] || { echo "bundle.sh: $VLLM has no $f; this trimming is for vllm 0.26.0" >&2; exit 1; }
done
echo "   $(du -sh . | cut -f1) unpacked"

echo "== packing (xz -9, takes minutes)"
# reproducible with the same tools (GNU tar, xz): the same packages give the same bytes (names
# sorted, times, owners and modes fixed), so a rebuild does not invalidate a part already carried
tar cf - --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --mode=go-w,a+rX . | xz -9 -T2 > "$TMP/site.tar.xz"
sha="$(sha256sum "$TMP/site.tar.xz" | cut -d' ' -f1)"
NEW="$OUT.new.$$"  # assembled beside OUT, then swapped in: a failure leaves the old bundle
rm -rf -- "$NEW"
split -b "${PART_MB}M" -d "$TMP/site.tar.xz" "$TMP/site.tar.xz.part"
i=0
for part in "$TMP"/site.tar.xz.part*; do
    i=$((i + 1))
    mkdir -p "$NEW/$i"
    mv "$part" "$NEW/$i/"
done
manifest="$(printf 'parts=%s\nsha256=%s\nvllm=%s\n' "$i" "$sha" "$VLLM"
            for f in "$NEW"/*/site.tar.xz.part*; do echo "${f##*.}=$(sha256sum < "$f" | cut -d' ' -f1)"; done)"
for d in "$NEW"/*/; do
    echo "$manifest" > "$d/MANIFEST"
done
rm -rf -- "$OUT"
mv -T -- "$NEW" "$OUT"
echo "== $OUT: $i part(s) of at most ${PART_MB} MiB, $(du -sh "$OUT" | cut -f1) in all, sha256 $sha"
ls -la "$OUT"/*
