{{/* Objects every stage has, one define per kind; the files under <stage>/ call them. */}}

{{- define "ocrstream.stage.configmap" -}}
{{- if (index .context.Values .component).enabled }}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "ocrstream.componentName" . }}
  namespace: {{ .context.Release.Namespace | quote }}
  labels:
    {{- include "ocrstream.labels" . | nindent 4 }}
  {{- with .context.Values.commonAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
data:
  {{- include "ocrstream.configEnv" . | trim | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "ocrstream.stage.deployment" -}}
{{- $c := index .context.Values .component -}}
{{- if and $c.enabled (ne (toString $c.kind) "DaemonSet") }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "ocrstream.componentName" . }}
  namespace: {{ .context.Release.Namespace | quote }}
  labels:
    {{- include "ocrstream.labels" . | nindent 4 }}
  {{- with .context.Values.commonAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- $scaled := or (and $c.autoscaling.hpa $c.autoscaling.hpa.enabled) (and $c.autoscaling.keda $c.autoscaling.keda.enabled) }}
  {{- if not $scaled }}
  replicas: {{ $c.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    {{- toYaml $c.updateStrategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "ocrstream.selectorLabels" . | nindent 6 }}
  template:
    {{- include "ocrstream.podTemplate" . | nindent 4 }}
{{- end }}
{{- end -}}

{{- define "ocrstream.stage.service" -}}
{{- if (index .context.Values .component).enabled }}
apiVersion: v1
kind: Service
metadata:
  name: {{ printf "%s-metrics" (include "ocrstream.componentName" .) }}
  namespace: {{ .context.Release.Namespace | quote }}
  labels:
    {{- include "ocrstream.labels" . | nindent 4 }}
  {{- $ann := merge (dict) (default dict .context.Values.metrics.service.annotations) (default dict .context.Values.commonAnnotations) }}
  {{- with $ann }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: ClusterIP
  ports:
    - name: metrics
      port: {{ .context.Values.metrics.service.port }}
      targetPort: metrics
      protocol: TCP
  selector:
    {{- include "ocrstream.selectorLabels" . | nindent 4 }}
{{- end }}
{{- end -}}

{{- define "ocrstream.stage.pdb" -}}
{{- $c := index .context.Values .component -}}
{{- if and $c.enabled $c.pdb.create }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "ocrstream.componentName" . }}
  namespace: {{ .context.Release.Namespace | quote }}
  labels:
    {{- include "ocrstream.labels" . | nindent 4 }}
  {{- with .context.Values.commonAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if ne (toString $c.pdb.minAvailable) "" }}
  minAvailable: {{ $c.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $c.pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "ocrstream.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "ocrstream.stage.hpa" -}}
{{- $c := index .context.Values .component -}}
{{- if and $c.enabled $c.autoscaling.hpa.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "ocrstream.componentName" . }}
  namespace: {{ .context.Release.Namespace | quote }}
  labels:
    {{- include "ocrstream.labels" . | nindent 4 }}
  {{- with .context.Values.commonAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "ocrstream.componentName" . }}
  minReplicas: {{ $c.autoscaling.hpa.minReplicas }}
  maxReplicas: {{ $c.autoscaling.hpa.maxReplicas }}
  metrics:
    {{- with $c.autoscaling.hpa.targetCPU }}
    - type: Resource
      resource:
        name: cpu
        target: {type: Utilization, averageUtilization: {{ . }}}
    {{- end }}
    {{- with $c.autoscaling.hpa.targetMemory }}
    - type: Resource
      resource:
        name: memory
        target: {type: Utilization, averageUtilization: {{ . }}}
    {{- end }}
{{- end }}
{{- end -}}
