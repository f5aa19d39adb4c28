{{/*
The namespace of the driver's namespaced objects: the release's
(helm install -n <namespace>).
*/}}
{{- define "mpnbd.namespace" -}}
{{ .Release.Namespace }}
{{- end }}

{{/*
Labels of every object: pass a dict with "root" (the chart context) and,
optionally, "component".
*/}}
{{- define "mpnbd.labels" -}}
app.kubernetes.io/name: mpnbd
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/*
Pod selector labels of a component: pass a dict with "root" (the chart
context) and "component". Selectors are immutable: a change here makes
helm upgrade fail on the Deployment and the DaemonSets.
*/}}
{{- define "mpnbd.selectorLabels" -}}
app.kubernetes.io/name: mpnbd
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}

{{/* The driver's image: the registry unless the repository names one (the
rule container runtimes use: a first part with a dot or a colon, or
localhost), then the digest if set, else the tag. */}}
{{- define "mpnbd.image" -}}
{{- $repo := .Values.image.repository -}}
{{- $first := first (splitList "/" $repo) -}}
{{- $named := and (gt (len (splitList "/" $repo)) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) -}}
{{- if and .Values.image.registry (not $named) -}}
{{- $repo = printf "%s/%s" (trimSuffix "/" .Values.image.registry) $repo -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{ $repo }}@{{ .Values.image.digest }}
{{- else -}}
{{ $repo }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
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
The environment entry HTTP_ADDRESS of a container that serves HTTP: the
pod's field .Values.httpAddressFrom, the address its endpoints bind to
(mpnbd.httpAddress); nothing when it is empty. Kubernetes expands
$(HTTP_ADDRESS) in args only for variables of the same container: include
this in each one that uses it.
*/}}
{{- define "mpnbd.httpAddressEnv" -}}
{{- with .Values.httpAddressFrom -}}
- name: HTTP_ADDRESS
  valueFrom:
    fieldRef:
      fieldPath: {{ . }}
{{- end }}
{{- end }}

{{/*
The address an HTTP endpoint (--http-endpoint, --metrics-addr) listens on:
pass a dict with "root" (the chart context) and "port". [$(HTTP_ADDRESS)]:PORT
(the brackets for an IPv6 address; Go takes them around IPv4 too) with
.Values.httpAddressFrom, else :PORT, every address of the pod's network.
*/}}
{{- define "mpnbd.httpAddress" -}}
{{- if .root.Values.httpAddressFrom -}}
[$(HTTP_ADDRESS)]:{{ .port }}
{{- else -}}
:{{ .port }}
{{- end -}}
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

{{/*
A PodMonitor for the pods of a component: pass a dict with "root" (the
chart context) and "component" (node, storage-agent), whose pods serve
/metrics on their container port named metrics.
*/}}
{{- define "mpnbd.podMonitor" -}}
{{- $pm := .root.Values.monitoring.podMonitors -}}
apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata:
  name: mpnbd-{{ .component }}
  namespace: {{ include "mpnbd.namespace" .root }}
  labels:
    {{- include "mpnbd.labels" (dict "root" .root "component" .component) | nindent 4 }}
    {{- with $pm.additionalLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "mpnbd.selectorLabels" . | nindent 6 }}
  namespaceSelector:
    matchNames:
      - {{ include "mpnbd.namespace" .root }}
  podMetricsEndpoints:
    - port: metrics
      path: /metrics
      interval: {{ $pm.interval }}
      relabelings:
        {{- include "mpnbd.nodeRelabeling" . | nindent 8 }}
{{- end }}

{{/*
The relabeling that gives every series of a scraped pod the label node,
the node it runs on (the alerts and the dashboard name it).
*/}}
{{- define "mpnbd.nodeRelabeling" -}}
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
  action: replace
{{- end }}

{{/*
What the controller's pods and the chart's hook Job share: the controller's
ServiceAccount, placement, host network and the restricted pod security
context.
*/}}
{{- define "mpnbd.controllerPod" -}}
serviceAccountName: mpnbd-controller
{{- with .Values.controller.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- if .Values.controller.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.controller.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.controller.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.controller.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  seccompProfile:
    type: RuntimeDefault
{{- end }}
