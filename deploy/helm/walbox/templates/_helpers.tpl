{{- define "walbox.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "walbox.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "walbox.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "walbox.selectorLabels" -}}
app.kubernetes.io/name: {{ include "walbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "walbox.labels" -}}
{{ include "walbox.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "walbox.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- define "walbox.secretName" -}}
{{- if .Values.secret.name -}}
{{- .Values.secret.name -}}
{{- else if .Values.existingSecret -}}
{{- .Values.existingSecret -}}
{{- else if .Values.secret.create -}}
{{- include "walbox.fullname" . -}}
{{- else -}}
{{- fail "secret.name (or existingSecret: an existing Secret with pg_url) or secret.create is required" -}}
{{- end -}}
{{- end -}}

{{- define "walbox.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "walbox.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* The environment of every walbox container (the Deployment's and the
hook Job's): the Secret's keys, the pod name as application_name, extras. */ -}}
{{- define "walbox.env" -}}
- name: PGAPPNAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- $secret := include "walbox.secretName" . }}
{{- range $variable, $key := .Values.secret.keys }}
{{- if eq $.Values.secret.mount "files" }}
- name: {{ $variable }}_FILE
  value: /etc/walbox/secrets/{{ $key }}
{{- else if eq $.Values.secret.mount "env" }}
- name: {{ $variable }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
{{- else }}
{{- fail "secret.mount must be env or files" }}
{{- end }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "walbox.volumeMounts" -}}
# Siblings under /etc/walbox, none nested in another: the configuration,
# the Secret's files, and the recipes' extraVolumeMounts (/etc/walbox/<name>).
- name: config
  mountPath: /etc/walbox/config
  readOnly: true
{{- if eq .Values.secret.mount "files" }}
- name: secrets
  mountPath: /etc/walbox/secrets
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- /* config: the ConfigMap holding walbox.toml */ -}}
{{- define "walbox.volumes" -}}
- name: config
  configMap:
    name: {{ .configMap }}
{{- if eq .root.Values.secret.mount "files" }}
- name: secrets
  secret:
    secretName: {{ include "walbox.secretName" .root }}
    # 0400: walbox refuses secret files that others can read (with fsGroup
    # the kubelet makes them group-readable, 0440, which it accepts).
    defaultMode: 256
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: 16Mi
{{- with .root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "walbox.hookContainer" -}}
- name: {{ .command }}
  image: {{ include "walbox.image" .root | quote }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args: [{{ .command | quote }}, "--config", "/etc/walbox/config/walbox.toml"{{ if and (eq .command "doctor") .root.Values.doctor.allowWarnings }}, "--allow-warnings"{{ end }}]
  env:
    {{- include "walbox.env" .root | nindent 4 }}
  {{- with .root.Values.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    {{- toYaml .root.Values.resources | nindent 4 }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "walbox.volumeMounts" .root | nindent 4 }}
{{- end -}}

{{- /* walbox.toml: the `config` values. */ -}}
{{- define "walbox.toml" -}}
{{- toToml .Values.config }}
{{- end -}}
