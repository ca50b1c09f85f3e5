{{/* vim: set filetype=mustache: */}}

{{/* Chart name, truncated to 63 characters. */}}
{{- define "ocrstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name: release name, plus the chart name unless the release name contains it. */}}
{{- define "ocrstream.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects. Usage: include "ocrstream.componentName" (dict "component" "infer" "context" $) */}}
{{- define "ocrstream.componentName" -}}
{{- printf "%s-%s" (include "ocrstream.fullname" .context | trunc 56 | trimSuffix "-") .component -}}
{{- end -}}

{{/* Standard labels. Usage: include "ocrstream.labels" (dict "component" "infer" "context" $); component optional. */}}
{{- define "ocrstream.labels" -}}
{{- $ctx := .context -}}
app.kubernetes.io/name: {{ include "ocrstream.name" $ctx }}
helm.sh/chart: {{ printf "%s-%s" $ctx.Chart.Name $ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ocrstream
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- with $ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels: name, instance and component only (immutable across upgrades). */}}
{{- define "ocrstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ocrstream.name" .context }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* ServiceAccount name of the stages. */}}
{{- define "ocrstream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ocrstream.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference. Usage: include "ocrstream.image" (dict "component" "infer" "context" $) */}}
{{- define "ocrstream.image" -}}
{{- $img := .context.Values.image -}}
{{- $own := dict -}}
{{- if eq .component "infer" -}}{{- $own = .context.Values.infer.image -}}{{- end -}}
{{- $registry := default $img.registry $own.registry -}}
{{- $repository := default $img.repository $own.repository -}}
{{- $tag := default (default .context.Chart.AppVersion $img.tag) $own.tag -}}
{{- $digest := default $img.digest $own.digest -}}
{{- if and $own.repository (not $own.digest) -}}{{- $digest = "" -}}{{- end -}}
{{- $ref := ternary (printf "%s/%s" $registry $repository) $repository (ne $registry "") -}}
{{- if $digest -}}
{{- printf "%s@%s" $ref $digest -}}
{{- else -}}
{{- printf "%s:%s" $ref (toString $tag) -}}
{{- end -}}
{{- end -}}

{{/*
The sections of the settings (nested models of CommonSettings and CacheKeySettings); their fields become
OCRSTREAM_<SECTION>__<FIELD>. Keep in step with services/common/settings.py and services/common/cache/keys.py
(tests/helm/test_chart.py checks every rendered name).
*/}}
{{- define "ocrstream.settingsSections" -}}
kafka s3 redis mysql telemetry topics engine limits decode
{{- end -}}

{{/* A settings value as an env var string: whole numbers without exponent, maps and lists as JSON. */}}
{{- define "ocrstream.envValue" -}}
{{- $v := . -}}
{{- if or (kindIs "map" $v) (kindIs "slice" $v) -}}
{{- toJson $v -}}
{{- else if kindIs "bool" $v -}}
{{- ternary "true" "false" $v -}}
{{- else if and (kindIs "float64" $v) (eq (float64 (int64 $v)) $v) -}}
{{- printf "%d" (int64 $v) -}}
{{- else -}}
{{- toString $v -}}
{{- end -}}
{{- end -}}

{{/*
The merged settings of one stage: `config` deep-merged with `<stage>.config` (the stage wins).
Usage: include "ocrstream.stageConfig" (dict "component" "infer" "context" $) | fromYaml
*/}}
{{- define "ocrstream.stageConfig" -}}
{{- $common := deepCopy .context.Values.config -}}
{{- if eq (toString .component) "webhooks" -}}
{{- /* where callbacks may go is set once, on the door that accepts them; the webhooks stage reads the same */ -}}
{{- range $k := list "webhook_allowed_hosts" "webhook_allow_private" -}}
{{- if hasKey $.context.Values.api.config $k -}}{{- $_ := set $common $k (index $.context.Values.api.config $k) -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if has (toString .component) (list "jobs" "webhooks") -}}
{{- /* stages that compute no cache key read no engine, task or cache setting (CacheKeySettings, services/common/cache/keys.py) */ -}}
{{- range $k := list "engine" "engine_kind" "engine_max_side" "vllm_prompt" "vllm_prompt_template" "openai_prompt" "vlm_dialect" "tasks" "cache_enabled" "cache_scope" -}}
{{- $_ := unset $common $k -}}
{{- end -}}
{{- end -}}
{{- $own := dict -}}
{{- if .component -}}{{- $own = deepCopy (index .context.Values .component).config -}}{{- end -}}
{{- $merged := mustMergeOverwrite $common $own -}}
{{- if and (eq (toString .component) "api") (not .context.Values.webhooks.enabled) -}}
{{- /* no webhooks stage deployed: the door refuses a callback_url rather than accept one nothing delivers */ -}}
{{- $_ := set $merged "webhook_enabled" false -}}
{{- end -}}
{{- toYaml $merged -}}
{{- end -}}

{{/*
Settings as env vars: `OCRSTREAM_<FIELD>`, sections as `OCRSTREAM_<SECTION>__<FIELD>`; null and "" are left out
(the settings default applies). Renders `NAME: "value"` lines (ConfigMap data).
Usage: include "ocrstream.configEnv" (dict "component" "infer" "context" $)
*/}}
{{- define "ocrstream.configEnv" -}}
{{- $cfg := include "ocrstream.stageConfig" . | fromYaml -}}
{{- $sections := splitList " " (include "ocrstream.settingsSections" .) -}}
{{- range $key, $val := $cfg }}
{{- if and (has $key $sections) (kindIs "map" $val) }}
{{- range $sub, $v := $val }}
{{- if and (not (kindIs "invalid" $v)) (ne (toString $v) "") }}
{{ printf "OCRSTREAM_%s__%s" (upper $key) (upper $sub) }}: {{ include "ocrstream.envValue" $v | quote }}
{{- end }}
{{- end }}
{{- else if and (not (kindIs "invalid" $val)) (ne (toString $val) "") }}
{{ printf "OCRSTREAM_%s" (upper $key) }}: {{ include "ocrstream.envValue" $val | quote }}
{{- end }}
{{- end }}
{{- if .context.Values.kafkaTls.caSecret }}
OCRSTREAM_KAFKA__SSL_CAFILE: {{ printf "/etc/ocrstream/kafka-ca/%s" .context.Values.kafkaTls.caKey | quote }}
{{- end }}
{{- end -}}

{{/*
Credentials from auth.existingSecret via secretKeyRef (env list items).
Usage: include "ocrstream.secretEnv" (dict "component" "infer" "context" $)
*/}}
{{- define "ocrstream.secretEnv" -}}
{{- $v := .context.Values -}}
{{- $secret := $v.auth.existingSecret -}}
{{- $keys := $v.auth.secretKeys -}}
{{- if $v.config.kafka.sasl_mechanism }}
- name: OCRSTREAM_KAFKA__SASL_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $secret | quote }}, key: {{ $keys.kafkaSaslPassword | quote }}}
{{- end }}
- name: OCRSTREAM_S3__ACCESS_KEY
  valueFrom:
    secretKeyRef: {name: {{ $secret | quote }}, key: {{ $keys.s3AccessKey | quote }}}
- name: OCRSTREAM_S3__SECRET_KEY
  valueFrom:
    secretKeyRef: {name: {{ $secret | quote }}, key: {{ $keys.s3SecretKey | quote }}}
- name: OCRSTREAM_MYSQL__PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $secret | quote }}, key: {{ $keys.mysqlPassword | quote }}}
{{- if $keys.redisPassword }}
- name: OCRSTREAM_REDIS__PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $secret | quote }}, key: {{ $keys.redisPassword | quote }}}
{{- end }}
{{- if and (eq .component "infer") $keys.openaiApiKey }}
- name: OCRSTREAM_OPENAI_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ $secret | quote }}, key: {{ $keys.openaiApiKey | quote }}}
{{- end }}
{{- end -}}

{{/* Volumes every ocrstream pod has: /tmp, ~/.cache (model weights, compile caches), the Kafka CA. */}}
{{- define "ocrstream.volumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- if .context.Values.kafkaTls.caSecret }}
- name: kafka-ca
  secret:
    secretName: {{ .context.Values.kafkaTls.caSecret }}
    items:
      - key: {{ .context.Values.kafkaTls.caKey }}
        path: {{ .context.Values.kafkaTls.caKey }}
{{- end }}
{{- if and (eq .component "infer") .context.Values.infer.shmSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .context.Values.infer.shmSizeLimit }}
{{- end }}
{{- end -}}

{{- define "ocrstream.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/ocrstream/.cache
{{- if .context.Values.kafkaTls.caSecret }}
- name: kafka-ca
  mountPath: /etc/ocrstream/kafka-ca
  readOnly: true
{{- end }}
{{- if and (eq .component "infer") .context.Values.infer.shmSizeLimit }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- end -}}

{{/* One probe. Usage: include "ocrstream.probe" (dict "probe" .livenessProbe "path" "/healthz") */}}
{{- define "ocrstream.probe" -}}
httpGet:
  path: {{ .path }}
  port: {{ default "metrics" .port }}
initialDelaySeconds: {{ .probe.initialDelaySeconds }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
successThreshold: 1
{{- end -}}

{{/* Pod template of a stage. Usage: include "ocrstream.podTemplate" (dict "component" "ingest" "context" $) */}}
{{- define "ocrstream.podTemplate" -}}
{{- $ctx := .context -}}
{{- $c := index $ctx.Values .component -}}
{{- $cfg := include "ocrstream.stageConfig" . | fromYaml -}}
{{- /* the HTTP door serves /metrics and the probes on its HTTP port; the stages on telemetry.metrics_port */ -}}
{{- $api := eq .component "api" -}}
{{- $portName := ternary "http" "metrics" $api -}}
{{- $port := ternary (default 8080 $cfg.http_port) $cfg.telemetry.metrics_port $api -}}
{{- $module := printf "services.%s" .component -}}
metadata:
  labels:
    {{- include "ocrstream.labels" . | nindent 4 }}
    {{- with $c.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "ocrstream.configEnv" . | sha256sum }}
    {{- with $c.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "ocrstream.serviceAccountName" $ctx }}
  automountServiceAccountToken: {{ $ctx.Values.serviceAccount.automountServiceAccountToken }}
  {{- with $ctx.Values.image.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  {{- if $ctx.Values.podSecurityContext.enabled }}
  securityContext:
    {{- omit $ctx.Values.podSecurityContext "enabled" | toYaml | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ $c.terminationGracePeriodSeconds }}
  {{- with $c.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $c.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $c.affinity }}
  affinity:
    {{- toYaml $c.affinity | nindent 4 }}
  {{- else if and (eq .component "infer") (eq $c.kind "Deployment") $c.onePerNode }}
  affinity:
    podAntiAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "ocrstream.selectorLabels" . | nindent 14 }}
  {{- else if ne .component "infer" }}
  affinity:
    podAntiAffinity:
      preferredDuringSchedulingIgnoredDuringExecution:
        - weight: 100
          podAffinityTerm:
            topologyKey: kubernetes.io/hostname
            labelSelector:
              matchLabels:
                {{- include "ocrstream.selectorLabels" . | nindent 16 }}
  {{- end }}
  {{- if $c.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml $c.topologySpreadConstraints | nindent 4 }}
  {{- else if ne (toString $c.kind) "DaemonSet" }}
  topologySpreadConstraints:
    - maxSkew: 1
      topologyKey: topology.kubernetes.io/zone
      whenUnsatisfiable: ScheduleAnyway
      labelSelector:
        matchLabels:
          {{- include "ocrstream.selectorLabels" . | nindent 10 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ include "ocrstream.image" . }}
      imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
      args: ["python", "-m", {{ $module | quote }}]
      envFrom:
        - configMapRef:
            name: {{ include "ocrstream.componentName" . }}
      env:
        {{- include "ocrstream.secretEnv" . | trim | nindent 8 }}
        {{- if eq .component "webhooks" }}
        {{- $own := list }}
        {{- range $e := $c.extraEnvVars }}{{- $own = append $own $e.name }}{{- end }}
        {{- range $e := $ctx.Values.api.extraEnvVars }}
        {{- if and (eq $e.name "OCRSTREAM_WEBHOOK_SECRET") (not (has $e.name $own)) }}
        {{- toYaml (list $e) | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- end }}
        {{- with $c.extraEnvVars }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: {{ $portName }}
          containerPort: {{ $port }}
          protocol: TCP
      {{- if $c.startupProbe.enabled }}
      startupProbe:
        {{- include "ocrstream.probe" (dict "probe" $c.startupProbe "path" "/readyz" "port" $portName) | nindent 8 }}
      {{- end }}
      {{- if $c.livenessProbe.enabled }}
      livenessProbe:
        {{- include "ocrstream.probe" (dict "probe" $c.livenessProbe "path" "/healthz" "port" $portName) | nindent 8 }}
      {{- end }}
      {{- if $c.readinessProbe.enabled }}
      readinessProbe:
        {{- include "ocrstream.probe" (dict "probe" $c.readinessProbe "path" "/readyz" "port" $portName) | nindent 8 }}
      {{- end }}
      {{- $res := deepCopy (default dict $c.resources) }}
      {{- if and (eq .component "infer") $c.gpu.enabled }}
      {{- $_ := set $res "requests" (merge (dict $c.gpu.resourceName (int $c.gpu.count)) (default dict $res.requests)) }}
      {{- $_ := set $res "limits" (merge (dict $c.gpu.resourceName (int $c.gpu.count)) (default dict $res.limits)) }}
      {{- end }}
      {{- with $res }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $ctx.Values.containerSecurityContext.enabled }}
      securityContext:
        {{- omit $ctx.Values.containerSecurityContext "enabled" | toYaml | nindent 8 }}
      {{- end }}
      volumeMounts:
        {{- include "ocrstream.volumeMounts" . | nindent 8 }}
  volumes:
    {{- include "ocrstream.volumes" . | nindent 4 }}
{{- end -}}

{{/* Fail early on values that cannot work. */}}
{{- define "ocrstream.validateValues" -}}
{{- $msgs := list -}}
{{- $v := .Values -}}
{{- if not $v.auth.existingSecret -}}
{{- $msgs = append $msgs "auth.existingSecret: name an existing Secret with the credentials (see the README, 'Create the Secret')" -}}
{{- end -}}
{{- if not $v.config.kafka.bootstrap_servers -}}
{{- $msgs = append $msgs "config.kafka.bootstrap_servers: required (host:port of your Kafka brokers)" -}}
{{- end -}}
{{- if not $v.config.s3.endpoint_url -}}
{{- $msgs = append $msgs "config.s3.endpoint_url: required (AWS: https://s3.<region>.amazonaws.com)" -}}
{{- end -}}
{{- if not $v.config.redis.url -}}
{{- $msgs = append $msgs "config.redis.url: required (redis://host:6379/0)" -}}
{{- end -}}
{{- if not $v.config.mysql.host -}}
{{- $msgs = append $msgs "config.mysql.host: required" -}}
{{- end -}}
{{- if and (hasPrefix "SASL" (toString $v.config.kafka.security_protocol)) (not $v.config.kafka.sasl_mechanism) -}}
{{- $msgs = append $msgs (printf "config.kafka.sasl_mechanism: required with security_protocol %s" $v.config.kafka.security_protocol) -}}
{{- end -}}
{{- if and $v.config.kafka.sasl_mechanism (not (hasPrefix "SASL" (toString $v.config.kafka.security_protocol))) -}}
{{- $msgs = append $msgs "config.kafka.sasl_mechanism: set, but security_protocol is not SASL_PLAINTEXT or SASL_SSL" -}}
{{- end -}}
{{- if and $v.config.kafka.sasl_mechanism (not $v.config.kafka.sasl_username) -}}
{{- $msgs = append $msgs "config.kafka.sasl_username: required with sasl_mechanism" -}}
{{- end -}}
{{- if and $v.kafkaTls.caSecret (not (hasSuffix "SSL" (toString $v.config.kafka.security_protocol))) -}}
{{- $msgs = append $msgs "kafkaTls.caSecret: set, but config.kafka.security_protocol is not SSL or SASL_SSL" -}}
{{- end -}}
{{- if not $v.config.telemetry.metrics_port -}}
{{- $msgs = append $msgs "config.telemetry.metrics_port: required (the probes use /healthz and /readyz on it)" -}}
{{- end -}}
{{- range $where, $cfgMap := dict "config" $v.config "api.config" $v.api.config "webhooks.config" $v.webhooks.config -}}
{{- if hasKey $cfgMap "webhook_secret" -}}
{{- $msgs = append $msgs (printf "%s.webhook_secret: not a value; put it in a Secret and pass OCRSTREAM_WEBHOOK_SECRET with api.extraEnvVars valueFrom.secretKeyRef (see the README, 'HTTP door')" $where) -}}
{{- end -}}
{{- end -}}
{{- range $k, $_ := $v.api.config -}}
{{- if and (hasPrefix "webhook_" $k) (not (has $k (list "webhook_enabled" "webhook_allowed_hosts" "webhook_allow_private"))) -}}
{{- $msgs = append $msgs (printf "api.config.%s: a setting of the webhooks stage, which delivers callbacks: set webhooks.config.%s" $k $k) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $v.infer.config "openai_api_key" -}}
{{- $msgs = append $msgs "infer.config.openai_api_key: not a value; it comes from auth.existingSecret (auth.secretKeys.openaiApiKey)" -}}
{{- end -}}
{{- range $path := list "kafka.sasl_password" "kafka.ssl_cafile" "s3.access_key" "s3.secret_key" "mysql.password" "redis.password" -}}
{{- $parts := splitList "." $path -}}
{{- if hasKey (index $v.config (first $parts)) (last $parts) -}}
{{- $msgs = append $msgs (printf "config.%s: not a value; it comes from auth.existingSecret (kafkaTls for the CA)" $path) -}}
{{- end -}}
{{- end -}}
{{- range $stage := list "ingest" "dedup" "infer" "sink" "jobs" "webhooks" "api" -}}
{{- $c := index $v $stage -}}
{{- if $c.enabled -}}
{{- $cfg := include "ocrstream.stageConfig" (dict "component" $stage "context" $) | fromYaml -}}
{{- $shutdown := float64 (default 20 $cfg.shutdown_timeout_s) -}}
{{- if le (float64 $c.terminationGracePeriodSeconds) (addf $shutdown 20) -}}
{{- $msgs = append $msgs (printf "%s.terminationGracePeriodSeconds (%v) must exceed shutdown_timeout_s (%v) + 20 s for the Kafka clients to close" $stage $c.terminationGracePeriodSeconds $shutdown) -}}
{{- end -}}
{{- range $e := $c.extraEnvVars -}}
{{- if not (hasPrefix "OCRSTREAM_" $e.name) -}}
{{- $msgs = append $msgs (printf "%s.extraEnvVars: %s is not an ocrstream setting (OCRSTREAM_*)" $stage $e.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $v.api.enabled -}}
{{- $apiCfg := include "ocrstream.stageConfig" (dict "component" "api" "context" $) | fromYaml -}}
{{- if has (toString $apiCfg.http_host) (list "127.0.0.1" "localhost" "::1") -}}
{{- $msgs = append $msgs (printf "api.config.http_host: %s is not reachable from the Service; use 0.0.0.0" $apiCfg.http_host) -}}
{{- end -}}
{{- end -}}
{{- if not (has $v.infer.kind (list "Deployment" "DaemonSet")) -}}
{{- $msgs = append $msgs (printf "infer.kind: Deployment or DaemonSet, not %v" $v.infer.kind) -}}
{{- end -}}
{{- if and (eq $v.infer.kind "DaemonSet") $v.infer.autoscaling.keda.enabled -}}
{{- $msgs = append $msgs "infer.autoscaling.keda.enabled: KEDA scales Deployments; use infer.kind Deployment" -}}
{{- end -}}
{{- range $old := list "max_batch" "max_wait_ms" -}}
{{- if hasKey $v.infer.config $old -}}
{{- $msgs = append $msgs (printf "infer.config.%s: infer reads a window of pages in flight now, not micro-batches; set infer.config.max_in_flight (or leave it empty: sized from the engine)" $old) -}}
{{- end -}}
{{- end -}}
{{- if and $v.infer.gpu.enabled (eq (toString $v.infer.config.engine_kind) "rapidocr") -}}
{{- $msgs = append $msgs "infer.gpu.enabled with engine_kind rapidocr: the CPU engine does not use the GPU; set infer.gpu.enabled=false" -}}
{{- end -}}
{{- if $msgs -}}
{{- printf "\nVALUES VALIDATION:\n  %s" (join "\n  " $msgs) | fail -}}
{{- end -}}
{{- end -}}
