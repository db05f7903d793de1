{{- define "walbox.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "walbox.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "walbox.labels" -}}
{{ include "walbox.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "walbox.secretName" -}}
{{- if .Values.secret.name -}}
{{- .Values.secret.name -}}
{{- else if .Values.secret.create -}}
{{- include "walbox.fullname" . -}}
{{- else -}}
{{- fail "secret.name (an existing Secret with pg_url) or secret.create is required" -}}
{{- end -}}
{{- end -}}

{{- define "walbox.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "walbox.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}
