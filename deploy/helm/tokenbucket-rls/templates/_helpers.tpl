{{/* The release's name for its objects: the chart's name alone when the
release is named after it, else release-chart (63 characters at most). */}}
{{- define "rls.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rls.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rls.labels" -}}
{{ include "rls.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rls.rulesConfigMap" -}}
{{- .Values.rules.existingConfigMap | default (printf "%s-rules" (include "rls.fullname" .)) -}}
{{- end -}}

{{- define "rls.adminSecret" -}}
{{- .Values.admin.token.existingSecret | default (printf "%s-admin" (include "rls.fullname" .)) -}}
{{- end -}}

{{- define "rls.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379" (include "rls.fullname" .) -}}
{{- else -}}
{{- .Values.store.redis.url -}}
{{- end -}}
{{- end -}}

{{- define "rls.adminToken" -}}
{{- or .Values.admin.token.create .Values.admin.token.existingSecret -}}
{{- end -}}
