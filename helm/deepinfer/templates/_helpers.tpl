{{/* Names and labels. */}}
{{- define "deepinfer.labels" -}}
app.kubernetes.io/name: deepinfer
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
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

{{/*
Settings as env variables: each camelCase key becomes PREFIX + SNAKE_CASE (maxNumSeqs -> MAX_NUM_SEQS),
the inverse of deepinfer.config.to_camel. null and "" are skipped (the setting's default applies); lists
are joined with commas. Args: dict "prefix" "DEEPINFER_PREFILL_" "settings" <map> "skip" <list of keys>.
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
{{- end }}

{{/* Probes on the internal port: /health for liveness, /ready for readiness (off as soon as a drain starts). */}}
{{- define "deepinfer.probes" -}}
livenessProbe:
  httpGet: {path: /health, port: internal}
  periodSeconds: 10
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /ready, port: internal}
  periodSeconds: 2
  failureThreshold: 2
startupProbe:
  # Model preparation and loading on first start can take minutes; liveness waits for this.
  httpGet: {path: /health, port: internal}
  periodSeconds: 5
  failureThreshold: 120
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
