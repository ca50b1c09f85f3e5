"""The Helm chart, checked on `helm template` output: GPU scheduling, probes, env var names equal to the
settings fields, grace periods, the init hook, credentials only through secretKeyRef.

helm comes from scripts/k8s-tools.sh (~/.cache/ocrstream/bin, or OCRSTREAM_TOOLS_DIR/bin, or PATH);
schema validation of the same manifests is scripts/helm-check.sh (kubeconform).
"""

from __future__ import annotations

import os
import shutil
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from services.common.cache.keys import CacheKeySettings
from services.dedup.settings import DedupSettings
from services.infer.settings import InferSettings
from services.api.settings import ApiSettings
from services.ingest.settings import IngestSettings
from services.sink.settings import SinkSettings
from services.jobs.settings import JobsSettings
from services.webhooks.settings import WebhooksSettings
from tests.stack import STRICT_ENV, strict_run

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "ocrstream"
REQUIRED = REPO / "tests" / "helm" / "required-values.yaml"
EXAMPLES = sorted((REPO / "deploy").glob("values-*.yaml"))
STAGES = {"ingest": IngestSettings, "dedup": DedupSettings, "infer": InferSettings, "sink": SinkSettings,
          "jobs": JobsSettings, "webhooks": WebhooksSettings, "api": ApiSettings}
#: The module each component runs (``python -m``): the HTTP door is a package of its own, as the stages are.
MODULES = {s: f"services.{s}" for s in STAGES}
SECRET_FIELDS = {
    "OCRSTREAM_KAFKA__SASL_PASSWORD",
    "OCRSTREAM_S3__ACCESS_KEY",
    "OCRSTREAM_S3__SECRET_KEY",
    "OCRSTREAM_MYSQL__PASSWORD",
    "OCRSTREAM_REDIS__PASSWORD",
    "OCRSTREAM_OPENAI_API_KEY",
}
WORKLOADS = ("Deployment", "DaemonSet")


def _helm() -> str | None:
    tools = Path(os.environ.get("OCRSTREAM_TOOLS_DIR", Path.home() / ".cache" / "ocrstream"))
    cached = tools / "bin" / "helm"
    return str(cached) if cached.is_file() else shutil.which("helm")


HELM = _helm()
HELM_MISSING = "helm not installed: run `bash scripts/k8s-tools.sh`"
if HELM is None and not strict_run():
    pytest.skip(HELM_MISSING, allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _helm_installed():
    """In CI or under scripts/test.sh (which installs helm) a missing helm fails these tests."""
    if HELM is None:
        pytest.fail(f"{HELM_MISSING} (this run requires it: {STRICT_ENV}=1 or CI)", pytrace=False)


def _read_as(monkeypatch, env: dict, settings_cls, secret_value: str = "stub"):
    """``settings_cls()`` in an environment holding only ``env`` (a container's env; a
    ``valueFrom`` entry is given ``secret_value``)."""
    for k in list(os.environ):
        if k.startswith("OCRSTREAM_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v if isinstance(v, str) else secret_value)
    return settings_cls()


def env_names(settings_cls: type[BaseModel]) -> set[str]:
    """Every env var name the settings class reads: OCRSTREAM_<FIELD>, nested models OCRSTREAM_<FIELD>__<SUB>."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    delim = settings_cls.model_config.get("env_nested_delimiter") or "__"

    def walk(model: type[BaseModel], path: str) -> set[str]:
        out: set[str] = set()
        for name, field in model.model_fields.items():
            full = f"{path}{name.upper()}"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out |= walk(ann, full + delim)
            else:
                out.add(full)
        return out

    return walk(settings_cls, prefix)


def render(*values: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    """The chart's manifests for these values files and --set flags."""
    cmd = [HELM, "template", "ocrstream", str(CHART), "--namespace", "ocrstream", "--kube-version", "1.33.0"]
    for v in values:
        cmd += ["-f", str(v)]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


CASES = {"default": (REQUIRED,), **{p.stem: (p,) for p in EXAMPLES}}


@pytest.fixture(scope="module", params=sorted(CASES))
def manifests(request) -> list[dict]:
    return render(*CASES[request.param])


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def container(doc: dict) -> dict:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"values-gpu-cluster.yaml", "values-cpu-small.yaml"}


def test_settings_introspection_knows_nested_and_stage_fields():
    names = env_names(InferSettings)
    assert {"OCRSTREAM_KAFKA__BOOTSTRAP_SERVERS", "OCRSTREAM_S3__SECRET_KEY", "OCRSTREAM_MAX_IN_FLIGHT"} <= names
    assert "OCRSTREAM_KAFKA" not in names and "OCRSTREAM_INGEST_MAX_BATCH" not in names


def test_every_stage_has_one_workload_with_stage_args(manifests):
    stages = {component(w): w for w in workloads(manifests)}
    assert set(stages) == set(STAGES)
    for stage, w in stages.items():
        assert container(w)["args"] == ["python", "-m", MODULES[stage]]


def test_probes_on_every_workload(manifests):
    for w in workloads(manifests):
        c = container(w)
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", component(w)
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", component(w)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["readinessProbe"]["httpGet"]["port"] in ports


def test_infer_startup_probe_allows_minutes_of_model_loading(manifests):
    (infer,) = [w for w in workloads(manifests) if component(w) == "infer"]
    c = container(infer)
    p = c["startupProbe"]
    window = p.get("initialDelaySeconds", 0) + p["periodSeconds"] * p["failureThreshold"]
    gpu = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
    # a GPU model downloads and loads for minutes; RapidOCR's ONNX models load in seconds
    assert window >= (600 if gpu else 120), f"startup window {window}s"


def test_metrics_port_matches_settings(manifests):
    cms = {component(c): c["data"] for c in by_kind(manifests, "ConfigMap")}
    for w in workloads(manifests):
        port = container(w)["ports"][0]["containerPort"]
        # the HTTP door serves /metrics and its probes on its HTTP port
        setting = "OCRSTREAM_HTTP_PORT" if component(w) == "api" else "OCRSTREAM_TELEMETRY__METRICS_PORT"
        assert cms[component(w)][setting] == str(port)


def _stage_env(docs: list[dict], w: dict) -> dict[str, object]:
    """The env a workload's container sees: its ConfigMap (envFrom) then env (values or valueFrom)."""
    cms = {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}
    c = container(w)
    env: dict[str, object] = {}
    for src in c.get("envFrom", []):
        env.update(cms[src["configMapRef"]["name"]])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


def test_env_var_names_are_settings_fields(manifests):
    for w in workloads(manifests):
        stage = component(w)
        valid = env_names(STAGES[stage])
        unknown = set(_stage_env(manifests, w)) - valid
        assert not unknown, f"{stage}: not fields of {STAGES[stage].__name__}: {sorted(unknown)}"
    for job in by_kind(manifests, "Job"):
        unknown = {e["name"] for e in container(job)["env"]} - env_names(CacheKeySettings)
        assert not unknown, f"init job: {sorted(unknown)}"


def test_the_chart_leaves_out_of_keyless_stages_exactly_the_cache_key_settings():
    """jobs and webhooks compute no cache key: the chart drops from their config the settings
    CacheKeySettings adds to CommonSettings, and only those (a new one would fail the env test
    above only when the values set it)."""
    from services.common.settings import CommonSettings
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    listed = re.search(r'has \(toString \.component\) \(list "jobs" "webhooks"\).*?range \$k := list ([^-]*?) -\}\}',
                       helpers, re.S)
    assert listed, "the keyless stages' list is gone from _helpers.tpl"
    assert set(re.findall(r'"(\w+)"', listed.group(1))) == set(CacheKeySettings.model_fields) - set(CommonSettings.model_fields)
    assert not issubclass(STAGES["jobs"], CacheKeySettings) and not issubclass(STAGES["webhooks"], CacheKeySettings)


def test_env_values_parse_as_the_stage_settings(manifests, monkeypatch):
    """The rendered values are accepted by the settings classes (types, literals), secrets stubbed."""
    for w in workloads(manifests):
        stage = component(w)
        s = _read_as(monkeypatch, _stage_env(manifests, w), STAGES[stage])
        assert s.telemetry.metrics_port


def test_credentials_only_from_secret_key_refs(manifests):
    for doc in workloads(manifests) + by_kind(manifests, "Job"):
        env = {e["name"]: e for e in container(doc).get("env", [])}
        for name in SECRET_FIELDS & set(env):
            assert "value" not in env[name], f"{name} is a literal"
            assert env[name]["valueFrom"]["secretKeyRef"]["name"], name
        for name in ("OCRSTREAM_S3__ACCESS_KEY", "OCRSTREAM_S3__SECRET_KEY", "OCRSTREAM_MYSQL__PASSWORD"):
            assert name in env, f"{component(doc)}: {name} missing"
    for cm in by_kind(manifests, "ConfigMap"):
        assert not SECRET_FIELDS & set(cm["data"]), cm["metadata"]["name"]
    assert not by_kind(manifests, "Secret"), "the chart must not hold credentials"


def test_grace_period_exceeds_shutdown_timeout(manifests):
    for w in workloads(manifests):
        shutdown = float(_stage_env(manifests, w).get("OCRSTREAM_SHUTDOWN_TIMEOUT_S", CacheKeySettings.model_fields["shutdown_timeout_s"].default))
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # run_stage drains for shutdown_timeout_s, then stops the consumer and the producer (10 s each)
        assert grace > shutdown + 20, f"{component(w)}: grace {grace}s vs shutdown {shutdown}s"


def test_init_job_is_a_pre_install_pre_upgrade_hook(manifests):
    (job,) = by_kind(manifests, "Job")
    ann = job["metadata"]["annotations"]
    assert set(ann["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in ann["helm.sh/hook-delete-policy"]
    assert container(job)["args"] == ["ocrstream", "init"]
    # a hook runs before the release's ConfigMaps exist: its settings must be inline
    assert "envFrom" not in container(job)


def test_security_context(manifests):
    for doc in workloads(manifests) + by_kind(manifests, "Job"):
        pod = doc["spec"]["template"]["spec"]
        sc = container(doc)["securityContext"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"] for m in container(doc)["volumeMounts"]}
        assert "/tmp" in mounts


def test_selectors_use_name_instance_component_only(manifests):
    keys = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"}
    for doc in manifests:
        sel = doc.get("spec", {}).get("selector")
        if doc["kind"] == "Service":
            assert set(sel) == keys
        elif sel is not None:
            assert set(sel["matchLabels"]) == keys, doc["metadata"]["name"]


@pytest.mark.parametrize("case", ["default", "values-gpu-cluster"])
def test_infer_requests_one_gpu_on_gpu_nodes(case):
    (infer,) = [w for w in workloads(render(*CASES[case])) if component(w) == "infer"]
    res = container(infer)["resources"]
    assert res["requests"]["nvidia.com/gpu"] == 1 and res["limits"]["nvidia.com/gpu"] == 1
    pod = infer["spec"]["template"]["spec"]
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
    # one replica per GPU node: required anti-affinity on the hostname
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"


ENGINE_RESERVE_MIB = {"rapidocr": 2150, "vllm": 12 * 1024, "openai": 512}
"""Memory the engine itself takes in the infer process at its peak, MiB: rapidocr with 2 workers on
2000 px inputs (measured: 2.1 GiB), vLLM's host side (its CPU-side caches and CUDA context), the
openai engine's HTTP clients."""


@pytest.mark.parametrize("case", sorted(CASES))
def test_infer_memory_limit_covers_the_engine_the_pixel_budget_and_the_decoders(case, monkeypatch):
    docs = render(*CASES[case])
    (infer,) = [w for w in workloads(docs) if component(w) == "infer"]
    s = _read_as(monkeypatch, _stage_env(docs, infer), STAGES["infer"])
    limit = container(infer)["resources"]["limits"]["memory"]
    mib = int(limit[:-2]) * (1024 if limit.endswith("Gi") else 1)
    need = ENGINE_RESERVE_MIB[s.engine_kind or s.engine.engine] + s.pixel_budget_mb + s.decode.workers * s.decode.memory_mb
    assert mib >= need, f"{case}: infer memory limit {limit} < {need} MiB"


def test_cpu_small_has_no_gpu():
    docs = render(REPO / "deploy" / "values-cpu-small.yaml")
    for w in workloads(docs):
        res = container(w).get("resources", {})
        assert "nvidia.com/gpu" not in {**res.get("requests", {}), **res.get("limits", {})}


def test_gpu_cluster_kafka_scram_tls():
    docs = render(REPO / "deploy" / "values-gpu-cluster.yaml")
    (w,) = [w for w in workloads(docs) if component(w) == "infer"]
    env = _stage_env(docs, w)
    assert env["OCRSTREAM_KAFKA__SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["OCRSTREAM_KAFKA__SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert env["OCRSTREAM_KAFKA__ACKS"] == "all" and env["OCRSTREAM_KAFKA__ENABLE_IDEMPOTENCE"] == "true"
    assert "secretKeyRef" in env["OCRSTREAM_KAFKA__SASL_PASSWORD"]
    cafile = env["OCRSTREAM_KAFKA__SSL_CAFILE"]
    mounts = {m["name"]: m["mountPath"] for m in container(w)["volumeMounts"]}
    assert cafile.startswith(mounts["kafka-ca"] + "/")
    assert env["OCRSTREAM_ENGINE__ENGINE"] == "vllm"


def test_daemonset_mode():
    docs = render(REQUIRED, sets=("infer.kind=DaemonSet",))
    (ds,) = by_kind(docs, "DaemonSet")
    assert component(ds) == "infer"
    assert "startupProbe" in container(ds)
    assert container(ds)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not [d for d in by_kind(docs, "Deployment") if component(d) == "infer"]


def test_autoscalers_off_by_default_and_render_when_enabled():
    assert not by_kind(render(REQUIRED), "HorizontalPodAutoscaler")
    assert not by_kind(render(REQUIRED), "ScaledObject")
    docs = render(REQUIRED, sets=("ingest.autoscaling.hpa.enabled=true", "infer.autoscaling.keda.enabled=true"))
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"].endswith("-ingest")
    (so,) = by_kind(docs, "ScaledObject")
    topics = InferSettings.model_fields["topics"].default
    assert [t["metadata"]["topic"] for t in so["spec"]["triggers"]] == [topics.infer, topics.infer_interactive]
    for trig in so["spec"]["triggers"]:  # one per lane: the larger lag scales
        assert trig["type"] == "kafka"
        assert trig["metadata"]["consumerGroup"] == InferSettings.model_fields["infer_group_id"].default
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "ocrstream-infer"}
    (infer,) = [d for d in by_kind(docs, "Deployment") if component(d) == "infer"]
    assert "replicas" not in infer["spec"], "KEDA owns the replica count"


@pytest.mark.parametrize(
    "sets, message",
    [
        ((), "auth.existingSecret"),
        (("infer.config.max_batch=16",), "infer.config.max_batch: infer reads a window of pages in flight now"),
        (("infer.terminationGracePeriodSeconds=100",), "terminationGracePeriodSeconds"),
        (("config.s3.secret_key=x",), "config.s3.secret_key"),
        (("infer.kind=DaemonSet", "infer.autoscaling.keda.enabled=true"), "KEDA"),
        (("config.kafka.security_protocol=SASL_SSL",), "sasl_mechanism"),
    ],
)
def test_validate_values_fails_early(sets, message):
    values = [] if not sets else ["-f", str(REQUIRED)]
    cmd = [HELM, "template", "x", str(CHART), *values]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_every_values_key_documented_with_param():
    """Bitnami style: each key of values.yaml has a `## @param` (a documented map covers its keys), and
    each `@param` names a key that exists."""
    text = (CHART / "values.yaml").read_text()
    params = {line.split()[2] for line in text.splitlines() if line.strip().startswith("## @param ")}

    def leaves(node: object, path: str) -> set[str]:
        if isinstance(node, dict) and node and path not in params:
            return set().union(*(leaves(v, f"{path}.{k}" if path else k) for k, v in node.items()))
        return {path}

    keys = leaves(yaml.safe_load(text), "")
    assert not keys - params, f"undocumented: {sorted(keys - params)}"

    def exists(path: str) -> bool:
        node: object = yaml.safe_load(text)
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    assert all(exists(p) for p in params), [p for p in params if not exists(p)]


def _api(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in by_kind(docs, kind) if component(d) == "api"]


def test_api_door_listens_on_all_interfaces_behind_its_service(manifests):
    (w,) = _api(manifests, "Deployment")
    c = container(w)
    env = _stage_env(manifests, w)
    assert env["OCRSTREAM_HTTP_HOST"] == "0.0.0.0"
    (port,) = c["ports"]
    assert port["name"] == "http" and str(port["containerPort"]) == env["OCRSTREAM_HTTP_PORT"] == "8080"
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/readyz")):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    (svc,) = _api(manifests, "Service")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    assert svc["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == "8080"


def test_api_pdb_and_no_ingress_by_default():
    docs = render(REQUIRED)
    (pdb,) = _api(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "api"
    assert not by_kind(docs, "Ingress")


def test_api_ingress_routes_to_the_door_service_with_tls():
    docs = render(REQUIRED, sets=("api.ingress.enabled=true", "api.ingress.className=nginx",
                                  "api.ingress.hosts[0].host=ocr.corp.example",
                                  "api.ingress.hosts[0].paths[0].path=/",
                                  "api.ingress.tls[0].secretName=ocr-tls",
                                  "api.ingress.tls[0].hosts[0]=ocr.corp.example"))
    (ing,) = by_kind(docs, "Ingress")
    (svc,) = _api(docs, "Service")
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == [{"hosts": ["ocr.corp.example"], "secretName": "ocr-tls"}]
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "ocr.corp.example"
    (path,) = rule["http"]["paths"]
    assert path["pathType"] == "Prefix"
    assert path["backend"]["service"] == {"name": svc["metadata"]["name"], "port": {"name": "http"}}


def test_api_can_be_turned_off():
    docs = render(REQUIRED, sets=("api.enabled=false", "api.ingress.enabled=true"))
    assert not [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "api"]


@pytest.mark.parametrize("sets, message", [
    (("api.config.http_host=127.0.0.1",), "api.config.http_host"),
    (("api.terminationGracePeriodSeconds=30",), "api.terminationGracePeriodSeconds"),
    (("api.service.port=0",), "/api/service/port"),  # the values schema
    # what the stages refuse at start (a crash loop) is refused by the schema at install
    (("sink.config.cache_ttl_s=0",), "/sink/config/cache_ttl_s"),
    (("ingest.config.ingest_concurrency=0",), "/ingest/config/ingest_concurrency"),
    (("config.tasks={receipt}",), "/config/tasks"),
    # the door's own settings are typed: a wrong type fails at install, not as a pod crash loop
    (("api.config.auth_required=maybe",), "/api/config/auth_required"),
    (("api.config.rate_limit_per_s=-1",), "/api/config/rate_limit_per_s"),
    (("api.config.rate_limit_burst=0",), "/api/config/rate_limit_burst"),
    (("api.config.quota_per_day=-5",), "/api/config/quota_per_day"),
    (("api.config.http_cors_origins=https://app.example.com",), "/api/config/http_cors_origins"),  # not a list
    (("api.config.http_cors_origins={app.example.com}",), "/api/config/http_cors_origins/0"),  # no scheme
    (("api.config.webhook_allowed_hosts=hooks.example.com",), "/api/config/webhook_allowed_hosts"),  # not a list
    (("api.config.webhook_allow_private=yes",), "/api/config/webhook_allow_private"),
    (("api.config.webhook_secret=whsec_x",), "api.config.webhook_secret: not a value"),
    (("webhooks.config.webhook_secret=whsec_x",), "webhooks.config.webhook_secret: not a value"),
    (("config.webhook_secret=whsec_x",), "config.webhook_secret: not a value"),
    # delivery settings are the webhooks stage's: on the door they would be dropped without a word
    (("api.config.webhook_group_id=mine",), "api.config.webhook_group_id: a setting of the webhooks stage"),
    (("api.config.webhook_timeout_s=3",), "api.config.webhook_timeout_s: a setting of the webhooks stage"),
])
def test_api_values_that_cannot_work_fail_early(sets, message):
    cmd = [HELM, "template", "x", str(CHART), "-f", str(REQUIRED)]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_api_door_is_closed_by_default_keys_rate_limit_no_cors_no_private_callbacks(manifests, monkeypatch):
    """The chart's door (every values case) requires API keys, rate-limits each key, has CORS closed
    and keeps callbacks off private addresses: as rendered, and as ApiSettings reads it."""
    (w,) = _api(manifests, "Deployment")
    env = _stage_env(manifests, w)
    assert env["OCRSTREAM_AUTH_REQUIRED"] == "true"
    assert float(env["OCRSTREAM_RATE_LIMIT_PER_S"]) > 0 and int(env["OCRSTREAM_RATE_LIMIT_BURST"]) >= 1
    assert env.get("OCRSTREAM_HTTP_CORS_ORIGINS", "[]") == "[]"
    assert env.get("OCRSTREAM_WEBHOOK_ALLOW_PRIVATE", "false") == "false"
    s = _read_as(monkeypatch, env, ApiSettings)
    assert s.auth_required is True and s.rate_limit_per_s > 0
    assert s.http_cors_origins == [] and s.webhook_allow_private is False


def test_cache_enabled_reaches_the_door_and_dedup_alike():
    """``config.cache_enabled`` is one setting for every stage: turned off, neither dedup nor the
    HTTP door answers from the cache (the door reads the same variable)."""
    docs = render(REQUIRED, sets=("config.cache_enabled=false",))
    for comp in ("dedup", "api"):
        (w,) = [d for d in workloads(docs) if component(d) == comp]
        assert _stage_env(docs, w)["OCRSTREAM_CACHE_ENABLED"] == "false", comp
    (w,) = [d for d in workloads(render(REQUIRED)) if component(d) == "api"]
    assert _stage_env(render(REQUIRED), w)["OCRSTREAM_CACHE_ENABLED"] == "true"


def test_cache_scope_reaches_the_door_and_dedup_alike():
    """``config.cache_scope`` is one setting for the door (its lookup) and dedup (its claim): were
    they to differ, a scoped door's miss would meet dedup's global entry."""
    docs = render(REQUIRED, sets=("config.cache_scope=key",))
    for comp in ("dedup", "api"):
        (w,) = [d for d in workloads(docs) if component(d) == comp]
        assert _stage_env(docs, w)["OCRSTREAM_CACHE_SCOPE"] == "key", comp


def test_tasks_reach_every_stage_as_one_json_list():
    """``config.tasks`` is read by ingest and the door (who refuse other tasks) and by every stage
    that builds cache keys: one JSON list in each such stage's environment (not in jobs' or webhooks')."""
    docs = render(REQUIRED, sets=("config.tasks={ocr,receipt}",))
    keyed = [w for w in workloads(docs) if component(w) not in ("jobs", "webhooks")]
    assert {component(w) for w in keyed} >= {"api", "ingest", "dedup", "infer", "sink"}
    for w in workloads(docs):
        tasks = _stage_env(docs, w).get("OCRSTREAM_TASKS")
        assert tasks == ('["ocr","receipt"]' if w in keyed else None), component(w)
    (w,) = [d for d in workloads(render(REQUIRED)) if component(d) == "ingest"]
    assert _stage_env(render(REQUIRED), w)["OCRSTREAM_TASKS"] == '["ocr"]'


def test_webhook_hosts_cors_origins_and_the_webhook_secret_reach_the_door_and_the_webhooks_stage(monkeypatch):
    """The README's recipe: allowed callback hosts and CORS origins as lists, the webhook secret from
    a Secret through extraEnvVars; ApiSettings reads them as set, and WebhooksSettings the same
    callback rules and secret."""
    docs = render(REQUIRED, sets=(
        "api.config.webhook_allowed_hosts={hooks.example.com,*.partner.example}",
        "api.config.http_cors_origins={https://app.example.com}",
        "api.extraEnvVars[0].name=OCRSTREAM_WEBHOOK_SECRET",
        "api.extraEnvVars[0].valueFrom.secretKeyRef.name=ocrstream-webhook",
        "api.extraEnvVars[0].valueFrom.secretKeyRef.key=secret"))
    (w,) = _api(docs, "Deployment")
    env = _stage_env(docs, w)
    assert env["OCRSTREAM_WEBHOOK_SECRET"] == {"secretKeyRef": {"name": "ocrstream-webhook", "key": "secret"}}
    s = _read_as(monkeypatch, env, ApiSettings, "whsec_from_the_secret")
    assert s.webhook_allowed_hosts == ["hooks.example.com", "*.partner.example"]
    assert s.http_cors_origins == ["https://app.example.com"]
    assert s.webhook_secret.get_secret_value() == "whsec_from_the_secret"
    # the webhooks stage, which delivers what the door accepted, reads the same rules and secret
    (hooks,) = [d for d in workloads(docs) if component(d) == "webhooks"]
    hooks_env = _stage_env(docs, hooks)
    assert hooks_env["OCRSTREAM_WEBHOOK_SECRET"] == env["OCRSTREAM_WEBHOOK_SECRET"]
    h = _read_as(monkeypatch, hooks_env, WebhooksSettings, "whsec_from_the_secret")
    assert h.webhook_allowed_hosts == s.webhook_allowed_hosts and h.webhook_allow_private is False
    assert h.webhook_secret.get_secret_value() == "whsec_from_the_secret"


def _notes(tmp_path: Path, *sets: str) -> str:
    """NOTES.txt rendered by `helm template` (which skips NOTES.txt itself, and `helm install --dry-run`
    needs a cluster): a copy of the chart holds it as a YAML block scalar in another template."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    body = (CHART / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "notes-check.yaml").write_text(
        "notes: |\n" + "".join("  " + line for line in body.splitlines(keepends=True)))
    cmd = [HELM, "template", "ocrstream", str(chart), "-n", "ocr", "-f", str(REQUIRED),
           "--show-only", "templates/notes-check.yaml"]
    for x in sets:
        cmd += ["--set", x]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["notes"]


def test_notes_say_how_to_create_the_first_api_key_and_turn_webhooks_on(tmp_path):
    text = _notes(tmp_path)
    assert "kubectl -n ocr exec deploy/ocrstream-api -- ocrstream keys create --name my-app" in text
    assert "Webhooks are off: set api.config.webhook_allowed_hosts" in text
    text = _notes(tmp_path / "b", "api.config.auth_required=false", "api.config.webhook_allowed_hosts={hooks.example.com}")
    assert "keys create" not in text
    assert "Webhooks may go to: hooks.example.com (public addresses only" in text


def test_sink_and_dedup_agree_on_the_requests_topic_and_dedup_has_its_changelog():
    """The sink settles keys on the topic dedup reads (ocr.requests); overriding its name in
    `config.topics` reaches both, and dedup gets its changelog's name."""
    docs = render(REQUIRED, sets=("config.topics.requests=team-a.requests", "config.topics.dedup_changelog=team-a.state"))
    env = {component(w): _stage_env(docs, w) for w in workloads(docs) if component(w) in ("dedup", "sink")}
    assert env["dedup"]["OCRSTREAM_TOPICS__REQUESTS"] == env["sink"]["OCRSTREAM_TOPICS__REQUESTS"] == "team-a.requests"
    assert env["dedup"]["OCRSTREAM_TOPICS__DEDUP_CHANGELOG"] == "team-a.state"


def test_a_chart_without_the_webhooks_stage_has_a_door_that_refuses_callbacks(monkeypatch):
    """webhooks.enabled=false: no stage would deliver a callback, so the door's webhook_enabled is
    false (it answers a callback_url 400 instead of accepting one nothing sends)."""
    docs = render(REQUIRED, sets=("webhooks.enabled=false",))
    assert not [d for d in workloads(docs) if component(d) == "webhooks"]
    (w,) = _api(docs, "Deployment")
    assert _read_as(monkeypatch, _stage_env(docs, w), ApiSettings).webhook_enabled is False
    (w,) = _api(render(REQUIRED), "Deployment")
    assert _read_as(monkeypatch, _stage_env(render(REQUIRED), w), ApiSettings).webhook_enabled is True


def test_a_secret_the_webhooks_stage_names_itself_is_not_given_twice():
    docs = render(REQUIRED, sets=(
        "api.extraEnvVars[0].name=OCRSTREAM_WEBHOOK_SECRET", "api.extraEnvVars[0].value=from-api",
        "webhooks.extraEnvVars[0].name=OCRSTREAM_WEBHOOK_SECRET", "webhooks.extraEnvVars[0].value=own"))
    (hooks,) = [d for d in workloads(docs) if component(d) == "webhooks"]
    env = [e for e in container(hooks)["env"] if e["name"] == "OCRSTREAM_WEBHOOK_SECRET"]
    assert env == [{"name": "OCRSTREAM_WEBHOOK_SECRET", "value": "own"}]
