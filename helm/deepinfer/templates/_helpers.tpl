{{/* Names and labels. */}}
{{- define "deepinfer.labels" -}}
app.kubernetes.io/name: deepinfer
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "deepinfer.selector" -}}
app.kubernetes.io/name: deepinfer
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "deepinfer.secretName" -}}
{{- .Values.secrets.existingSecret | default "deepinfer-secrets" -}}
{{- end }}

{{- define "deepinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (printf "%s-deepinfer" .Release.Name) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end }}

{{/* Replicas of a worker role: disaggregation.groups x its side of the P:D ratio. Args: dict "root" "role". */}}
{{- define "deepinfer.workerReplicas" -}}
{{- $d := .root.Values.disaggregation -}}
{{- mul $d.groups (index $d.ratio .role) -}}
{{- end }}

{{/* Gateway processes per pod: gateway.processes, else the whole cores of resources.limits.cpu (else
requests.cpu: "2", 2, "1500m"), 1 to 4. */}}
{{- define "deepinfer.gatewayProcesses" -}}
{{- $gw := .Values.gateway -}}
{{- if $gw.processes -}}
{{- $gw.processes -}}
{{- else -}}
{{- $resources := $gw.resources | default dict -}}
{{- $cpu := dig "limits" "cpu" "" $resources | default (dig "requests" "cpu" "1" $resources) | toString -}}
{{- $cores := 1 -}}
{{- if hasSuffix "m" $cpu -}}
{{- $cores = div (trimSuffix "m" $cpu | atoi) 1000 -}}
{{- else -}}
{{- $cores = $cpu | float64 | floor | int -}}
{{- end -}}
{{- max 1 (min 4 $cores) -}}
{{- end -}}
{{- end }}

{{/*
Settings as env variables: each camelCase key becomes PREFIX + SNAKE_CASE (maxNumSeqs -> MAX_NUM_SEQS), the
inverse of deepinfer.config.to_camel. null and "" are skipped (the setting's default applies); lists are joined
with commas. Args: dict "prefix" "DEEPINFER_PREFILL_" "settings" <map> "skip" <list of keys>.
*/}}
{{- define "deepinfer.settingsEnv" -}}
{{- $prefix := .prefix -}}
{{- $skip := .skip | default list -}}
{{- range $key, $value := .settings }}
{{- if and (not (has $key $skip)) (not (kindIs "invalid" $value)) (ne (toString $value) "") }}
- name: {{ printf "%s%s" $prefix ($key | snakecase | upper) }}
  value: {{ if kindIs "slice" $value }}{{ join "," $value | quote }}{{ else }}{{ toString $value | quote }}{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Env every service gets: common settings, the NATS URL, the secrets. Arg: the root context. */}}
{{- define "deepinfer.commonEnv" -}}
{{- include "deepinfer.settingsEnv" (dict "prefix" "DEEPINFER_" "settings" .Values.common "skip" (list "natsUrl")) }}
{{- if not (or .Values.nats.enabled .Values.common.natsUrl) }}
{{- fail "nats.enabled=false needs common.natsUrl (the URL of your NATS)" }}
{{- end }}
- name: DEEPINFER_NATS_URL
  value: {{ .Values.common.natsUrl | default (printf "nats://%s-nats:4222" .Release.Name) | quote }}
- name: DEEPINFER_NATS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "deepinfer.secretName" . }}
      key: natsToken
- name: DEEPINFER_DATA_PLANE_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "deepinfer.secretName" . }}
      key: dataPlaneSecret
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Probes on the internal port (telemetry/health.py): /health for startup and liveness (200 while the process works,
loading or not), /ready for readiness (off as soon as a drain starts). The startup probe allows ~10 minutes for a
model to load; liveness waits for it.
*/}}
{{- define "deepinfer.probes" -}}
startupProbe:
  httpGet: {path: /health, port: internal}
  periodSeconds: 5
  failureThreshold: 120
livenessProbe:
  httpGet: {path: /health, port: internal}
  periodSeconds: 10
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /ready, port: internal}
  periodSeconds: 2
  failureThreshold: 2
{{- end }}

{{/* Pod-level fields every DeepInfer pod shares. Args: dict "root" "w" (the component's values). */}}
{{- define "deepinfer.podSpec" -}}
serviceAccountName: {{ include "deepinfer.serviceAccountName" .root }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ .w.terminationGracePeriodSeconds }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .w.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .w.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The init step of a model-loading pod: `deepinfer prepare` resolves common.model into the model volume (the
default model's GGUF is converted once; a complete earlier preparation is reused). Args: dict "root" "image".
*/}}
{{- define "deepinfer.prepareModel" -}}
- name: prepare-model
  image: {{ .image | quote }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args: ["prepare"]
  env:
    {{- include "deepinfer.settingsEnv" (dict "prefix" "DEEPINFER_" "settings" .root.Values.common "skip" (list "natsUrl")) | nindent 4 }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model-cache
      mountPath: {{ .root.Values.common.modelCacheDir }}
{{- end }}

{{- define "deepinfer.modelCacheVolume" -}}
- name: model-cache
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "deepinfer.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end }}
