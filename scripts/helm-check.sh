#!/usr/bin/env bash
# Check the container files and the Helm chart offline: hadolint on docker/Dockerfile*, helm lint, helm template and kubeconform (strict, Kubernetes JSON schemas)
# for the defaults (plus tests/helm/required-values.yaml) and every deploy/values-*.yaml example.
# Installs its tools first with scripts/k8s-tools.sh (cached). Rendered manifests go to $OUT (default a temp dir).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$(bash scripts/k8s-tools.sh | tail -n 1)"
TOOLS="${OCRSTREAM_TOOLS_DIR:-$HOME/.cache/ocrstream}"
K8S_SCHEMA_VERSION="${K8S_SCHEMA_VERSION:-1.33.0}"
CHART=helm/ocrstream
if [[ -z "${OUT:-}" ]]; then OUT="$(mktemp -d)"; trap 'rm -rf "$OUT"' EXIT; fi
mkdir -p "$OUT"

echo "== hadolint"
"$BIN/hadolint" docker/Dockerfile docker/Dockerfile.gpu

cases=("default:tests/helm/required-values.yaml")
for f in deploy/values-*.yaml; do cases+=("$(basename "$f" .yaml):$f"); done

for c in "${cases[@]}"; do
  name=${c%%:*}; values=${c#*:}
  echo "== $name ($values)"
  "$BIN/helm" lint --strict "$CHART" -f "$values" --kube-version "$K8S_SCHEMA_VERSION"
  "$BIN/helm" template ocrstream "$CHART" -n ocrstream -f "$values" --kube-version "$K8S_SCHEMA_VERSION" \
    >"$OUT/$name.yaml"
  # -strict: no unknown fields; ScaledObject (KEDA CRD) has no schema here and is checked by tests/helm.
  "$BIN/kubeconform" -strict -summary -kubernetes-version "$K8S_SCHEMA_VERSION" \
    -schema-location "$TOOLS/k8s-schemas/{{ .NormalizedKubernetesVersion }}-standalone{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
    -skip ScaledObject "$OUT/$name.yaml"
done

# Every feature switched on at once must still render and validate (HPA, KEDA, DaemonSet are off by default).
echo "== all-features"
"$BIN/helm" template ocrstream "$CHART" -n ocrstream -f tests/helm/required-values.yaml \
  --set ingest.autoscaling.hpa.enabled=true,dedup.autoscaling.hpa.enabled=true,sink.autoscaling.hpa.enabled=true \
  --set sink.autoscaling.hpa.targetMemory=80,commonAnnotations.team=ocr \
  --set api.autoscaling.hpa.enabled=true,api.ingress.enabled=true,api.ingress.className=nginx \
  --set kafkaTls.caSecret=kafka-ca,config.kafka.security_protocol=SASL_SSL \
  --set config.kafka.sasl_mechanism=SCRAM-SHA-512,config.kafka.sasl_username=ocrstream \
  --kube-version "$K8S_SCHEMA_VERSION" >"$OUT/all-features.yaml"
"$BIN/helm" template ocrstream "$CHART" -n ocrstream -f tests/helm/required-values.yaml \
  --set infer.kind=DaemonSet --kube-version "$K8S_SCHEMA_VERSION" >"$OUT/daemonset.yaml"
"$BIN/kubeconform" -strict -summary -kubernetes-version "$K8S_SCHEMA_VERSION" \
  -schema-location "$TOOLS/k8s-schemas/{{ .NormalizedKubernetesVersion }}-standalone{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
  -skip ScaledObject "$OUT/all-features.yaml" "$OUT/daemonset.yaml"

# Values that cannot work must fail at template time (validateValues).
if "$BIN/helm" template ocrstream "$CHART" >/dev/null 2>&1; then
  echo "helm-check: rendering without auth.existingSecret and endpoints should fail" >&2; exit 1
fi
echo "helm-check: ok"
