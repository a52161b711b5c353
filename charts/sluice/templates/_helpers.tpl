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

{{/*
Prefill/decode disaggregation (pd.enabled): the server runs as two Deployments, one per
role. A role's workload is named <fullname>-<role> (within 63 characters) and its pods
carry app.kubernetes.io/component: <role> on top of the sluice selector labels, which is
how the router's --prefill-selector / --decode-selector tell them apart. role "" is the
single server of the default topology, named and labelled as before.
*/}}
{{- define "sluice.role.fullname" -}}
{{- if .role }}
{{- printf "%s-%s" (include "sluice.fullname" .root | trunc 55 | trimSuffix "-") .role }}
{{- else }}
{{- include "sluice.fullname" .root }}
{{- end }}
{{- end }}

{{- define "sluice.role.selectorLabels" -}}
{{ include "sluice.selectorLabels" .root }}
{{- if .role }}
app.kubernetes.io/component: {{ .role }}
{{- end }}
{{- end }}

{{- define "sluice.role.labels" -}}
{{ include "sluice.labels" .root }}
{{- if .role }}
app.kubernetes.io/component: {{ .role }}
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

{{/*
A PD role's own flags, after sluice.args: the role, the bootstrap port (prefill servers
listen on it; the router tells decode servers each request's port from the prefill
pod's annotation, and both roles get the same number so they cannot disagree), the
transfer backend and timeout when set, then pd.<role>.extraArgs.
*/}}
{{- define "sluice.pd.args" -}}
{{- $pd := .root.Values.pd }}
- --disaggregation-mode
- {{ .role }}
- --disaggregation-bootstrap-port
- {{ $pd.bootstrapPort | int | quote }}
{{- with $pd.transferBackend }}
- --disaggregation-transfer-backend
- {{ . }}
{{- end }}
{{- if not (kindIs "invalid" $pd.timeout) }}
- --disaggregation-timeout
- {{ $pd.timeout | toString | quote }}
{{- end }}
{{- range (get $pd .role).extraArgs }}
- {{ . | toString | quote }}
{{- end }}
{{- end }}

{{/* The router: deployed by router.enabled (data parallelism) and always under
pd.enabled, where it is the only way in. */}}
{{- define "sluice.router.enabled" -}}
{{- if or .Values.router.enabled .Values.pd.enabled }}true{{ end }}
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
Args of `python -m sglang_router.launch_router`: the policy, and Kubernetes service
discovery of this release's sluice pods on the port they serve, in this namespace only.
Regular mode selects the pods by their selector labels. PD mode selects prefill and
decode pods apart by their component label, and registers each pod by its IP: the
router sends a prefill pod's IP to the decode server as the request's bootstrap host,
so every prefill replica is addressed on its own, never through a Service. Then the
API key, then router.extraArgs.
*/}}
{{- define "sluice.router.args" -}}
- --host
- 0.0.0.0
- --port
- {{ .Values.router.containerPort | int | quote }}
- --policy
- {{ .Values.router.policy }}
{{- if .Values.pd.enabled }}
{{- with .Values.router.prefillPolicy }}
- --prefill-policy
- {{ . }}
{{- end }}
{{- with .Values.router.decodePolicy }}
- --decode-policy
- {{ . }}
{{- end }}
- --pd-disaggregation
- --service-discovery
{{- range $role := list "prefill" "decode" }}
- --{{ $role }}-selector
{{- range $line := splitList "\n" (include "sluice.role.selectorLabels" (dict "root" $ "role" $role)) }}
- {{ regexReplaceAll ": " $line "=" | quote }}
{{- end }}
{{- end }}
{{- else }}
- --service-discovery
- --selector
{{- range $line := splitList "\n" (include "sluice.selectorLabels" .) }}
- {{ regexReplaceAll ": " $line "=" | quote }}
{{- end }}
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
