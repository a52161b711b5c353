{{/* Names and labels, as `helm create` makes them. */}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sluice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sluice.image" -}}
{{- $tag := default (printf "%s%s" .Chart.AppVersion .Values.image.tagSuffix) .Values.image.tag }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The Secret holding the API key, or "" when the server runs without one. */}}
{{- define "sluice.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "sluice.fullname" .) }}
{{- end }}
{{- end }}

{{/* Seconds the server may drain after SIGTERM (the server's default is 30). */}}
{{- define "sluice.drainSeconds" -}}
{{- $t := .Values.serve.gracefulShutdownTimeout }}
{{- if kindIs "invalid" $t }}30{{ else }}{{ ceil $t | int }}{{ end }}
{{- end }}

{{/*
Container args after the image's ENTRYPOINT (`sluice serve --host 0.0.0.0`): one flag
per non-null key of .Values.serve (camelCase -> --kebab-case; booleans as
--flag/--no-flag), then the API key, then extraArgs.
*/}}
{{- define "sluice.args" -}}
- --port
- {{ .Values.containerPort | int | quote }}
{{- range $key, $value := .Values.serve }}
{{- $flag := kebabcase $key }}
{{- if kindIs "bool" $value }}
- {{ ternary (printf "--%s" $flag) (printf "--no-%s" $flag) $value }}
{{- else if not (kindIs "invalid" $value) }}
- --{{ $flag }}
{{- if and (kindIs "float64" $value) (eq $value (float64 (int64 $value))) }}
- {{ int64 $value | quote }}
{{- else }}
- {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- if include "sluice.apiKeySecret" . }}
- --api-key
- $(SLUICE_API_KEY)
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | toString | quote }}
{{- end }}
{{- end }}

{{/* The router (router.enabled): its own names (the "-router" suffix survives the 63
character limit) and labels, which never select sluice pods. */}}
{{- define "sluice.router.fullname" -}}
{{- printf "%s-router" (include "sluice.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{- define "sluice.router.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-router" (include "sluice.name" . | trunc 56 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sluice.router.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "sluice.router.selectorLabels" . }}
app.kubernetes.io/component: router
app.kubernetes.io/part-of: {{ include "sluice.name" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "sluice.router.image" -}}
{{- $r := .Values.router.image }}
{{- $tag := default (printf "%s%s" .Chart.AppVersion $r.tagSuffix) $r.tag }}
{{- printf "%s:%s" (default .Values.image.repository $r.repository) $tag }}
{{- end }}

{{/*
Args of `python -m sglang_router.launch_router`: regular mode, the policy, and
Kubernetes service discovery of this release's sluice pods (their selector labels) on
the port they serve, in this namespace only; then the API key, then router.extraArgs.
*/}}
{{- define "sluice.router.args" -}}
- --host
- 0.0.0.0
- --port
- {{ .Values.router.containerPort | int | quote }}
- --policy
- {{ .Values.router.policy }}
- --service-discovery
- --selector
{{- range $line := splitList "\n" (include "sluice.selectorLabels" .) }}
- {{ regexReplaceAll ": " $line "=" | quote }}
{{- end }}
- --service-discovery-port
- {{ .Values.containerPort | int | quote }}
- --service-discovery-namespace
- {{ .Release.Namespace }}
- --prometheus-host
- 0.0.0.0
- --prometheus-port
- {{ .Values.router.metricsPort | int | quote }}
{{- if include "sluice.apiKeySecret" . }}
- --api-key
- $(SLUICE_API_KEY)
{{- end }}
{{- range .Values.router.extraArgs }}
- {{ . | toString | quote }}
{{- end }}
{{- end }}
