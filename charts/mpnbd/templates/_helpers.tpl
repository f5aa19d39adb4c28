{{/* The namespace of the driver's namespaced objects. */}}
{{- define "mpnbd.namespace" -}}
{{ .Values.namespace.name }}
{{- end }}

{{/*
Labels of every object: pass a dict with "root" (the chart context) and,
optionally, "component".
*/}}
{{- define "mpnbd.labels" -}}
app.kubernetes.io/name: mpnbd
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Pod selector labels of a component (the name passed). */}}
{{- define "mpnbd.selectorLabels" -}}
app.kubernetes.io/name: mpnbd
app.kubernetes.io/component: {{ . }}
{{- end }}

{{/* The driver's image. */}}
{{- define "mpnbd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Log flags common to our commands. */}}
{{- define "mpnbd.logArgs" -}}
- --log-level={{ .Values.logLevel }}
{{- if ne .Values.logFormat "text" }}
- --log-format={{ .Values.logFormat }}
{{- end }}
{{- end }}

{{/* The restrictive container securityContext of the controller pod. */}}
{{- define "mpnbd.restricted" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/*
Storage address arguments: pass a dict with "from" (a downward API field
path, exposed as $(STORAGE_ADDRESS)) and "list" (literal addresses).
*/}}
{{- define "mpnbd.storageAddressArgs" -}}
{{- if .from }}
- --storage-address=$(STORAGE_ADDRESS)
{{- end }}
{{- with .list }}
- --storage-address={{ join "," . }}
{{- end }}
{{- end }}

{{/*
Environment entries pointing in-cluster clients at .Values.apiServer
instead of the kubernetes Service; nothing when it is not set.
*/}}
{{- define "mpnbd.apiServerEnv" -}}
{{- with .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.apiServer.port | default "443" | quote }}
{{- end }}
{{- end }}
