{{/* Labels of every object: the component's, the chart's, global.labels. */}}
{{- define "kvgpu.labels" -}}
app.kubernetes.io/name: kvgpu
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: kvgpu
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- with .root.Values.global.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The selector labels of a component (stable across upgrades). */}}
{{- define "kvgpu.selector" -}}
app.kubernetes.io/name: kvgpu
app.kubernetes.io/component: {{ . }}
{{- end }}

{{/* metadata.annotations from global.annotations, or nothing. */}}
{{- define "kvgpu.annotations" -}}
{{- with .Values.global.annotations }}
annotations:
{{ toYaml . | indent 2 }}
{{- end }}
{{- end }}

{{/* An image reference from {registry, repository, tag}; dict "image" X "root" $. */}}
{{- define "kvgpu.image" -}}
{{- $reg := .root.Values.global.imageRegistry | default .image.registry -}}
{{- $tag := .image.tag | default .root.Values.global.imageTag | default .root.Chart.AppVersion -}}
{{- if $reg }}{{ printf "%s/%s:%s" $reg .image.repository $tag }}{{ else }}{{ printf "%s:%s" .image.repository $tag }}{{ end -}}
{{- end }}

{{/* The cluster's version without build metadata: v1.36.3+k3s1 -> v1.36.3. */}}
{{- define "kvgpu.kubeVersion" -}}
{{- regexReplaceAll "^(v[0-9]+\\.[0-9]+\\.[0-9]+)(.*)$" .Capabilities.KubeVersion.Version "${1}" -}}
{{- end }}

{{/* kube-scheduler's image: HAMi <= 2.4 (image: REPO, imageTag) or >= 2.5 (image: {registry, repository, tag}). */}}
{{- define "kvgpu.kubeSchedulerImage" -}}
{{- $ks := .Values.scheduler.kubeScheduler -}}
{{- if kindIs "map" $ks.image -}}
{{- $reg := .Values.global.imageRegistry | default $ks.image.registry -}}
{{- $tag := $ks.image.tag | default $ks.imageTag | default (include "kvgpu.kubeVersion" .) -}}
{{- if $reg }}{{ printf "%s/%s:%s" $reg $ks.image.repository $tag }}{{ else }}{{ printf "%s:%s" $ks.image.repository $tag }}{{ end -}}
{{- else -}}
{{- $repo := $ks.image -}}
{{- if .Values.global.imageRegistry }}{{ $repo = printf "%s/%s" .Values.global.imageRegistry (regexReplaceAll "^[^/]+\\.[^/]+/" $repo "") }}{{ end -}}
{{- printf "%s:%s" $repo ($ks.imageTag | default (include "kvgpu.kubeVersion" .)) -}}
{{- end -}}
{{- end }}

{{- define "kvgpu.kubeSchedulerPullPolicy" -}}
{{- $ks := .Values.scheduler.kubeScheduler -}}
{{- if and (kindIs "map" $ks.image) $ks.image.pullPolicy }}{{ $ks.image.pullPolicy }}{{ else }}{{ $ks.imagePullPolicy | default "IfNotPresent" }}{{ end -}}
{{- end }}

{{/* Whether cert-manager issues the certificates (certManager.enabled or HAMi's scheduler.certManager.enabled). */}}
{{- define "kvgpu.certManager" -}}
{{- if or .Values.certManager.enabled (and (hasKey .Values.scheduler "certManager") .Values.scheduler.certManager.enabled) }}true{{ end -}}
{{- end }}

{{/* The namespaces the webhooks never see, sorted: kube-system, the release namespace, webhook.excludeNamespaces, HAMi's whitelistNamespaces. */}}
{{- define "kvgpu.excludedNamespaces" -}}
{{- $ns := list "kube-system" .Release.Namespace -}}
{{- range .Values.webhook.excludeNamespaces }}{{ $ns = append $ns . }}{{ end -}}
{{- with .Values.scheduler.admissionWebhook }}{{ range .whitelistNamespaces }}{{ $ns = append $ns . }}{{ end }}{{ end -}}
{{- $ns | uniq | sortAlpha | toJson -}}
{{- end }}

{{- define "kvgpu.webhookNamespaceSelector" -}}
matchExpressions:
- key: kubernetes.io/metadata.name
  operator: NotIn
  values:
{{- range (include "kvgpu.excludedNamespaces" . | fromJsonArray) }}
  - {{ . }}
{{- end }}
{{- end }}

{{/* metadata.annotations of the webhook configurations: cert-manager's CA injection, or none. */}}
{{- define "kvgpu.webhookAnnotations" -}}
{{- if include "kvgpu.certManager" . }}
annotations:
  cert-manager.io/inject-ca-from: {{ .Release.Namespace }}/kvgpu-webhook
{{- end }}
{{- end }}

{{/* A webhook's clientConfig: the Service kvgpu-webhook, or webhook.url + path; dict "root" $ "path" P. */}}
{{- define "kvgpu.webhookClientConfig" -}}
{{- if .root.Values.webhook.url -}}
url: {{ printf "%s%s" (trimSuffix "/" .root.Values.webhook.url) .path | quote }}
{{- else -}}
service:
  namespace: {{ .root.Release.Namespace }}
  name: kvgpu-webhook
  port: 443
  path: {{ .path }}
{{- end }}
{{- end }}

{{/* The host of a URL (no scheme, port, path; IPv6 brackets removed). */}}
{{- define "kvgpu.urlHost" -}}
{{- $u := urlParse . -}}
{{- regexReplaceAll "^\\[(.*)\\]$" (regexReplaceAll ":[0-9]+$" $u.host "") "${1}" -}}
{{- end }}

{{/* Further names of the serving certificates as JSON lists: the hosts of webhook.url and of a
non-default scheduler.extenderURL, plus certs.webhookSANs / certs.extenderSANs. */}}
{{- define "kvgpu.webhookSANs" -}}
{{- $s := .Values.certs.webhookSANs | default list -}}
{{- if .Values.webhook.url }}{{ $s = append $s (include "kvgpu.urlHost" .Values.webhook.url) }}{{ end -}}
{{- $s | uniq | toJson -}}
{{- end }}
{{- define "kvgpu.extenderSANs" -}}
{{- $s := .Values.certs.extenderSANs | default list -}}
{{- $h := include "kvgpu.urlHost" (include "kvgpu.extenderURL" .) -}}
{{- if not (has $h (list (printf "kvgpu-operator.%s.svc" .Release.Namespace) (printf "kvgpu-operator.%s.svc.cluster.local" .Release.Namespace))) }}{{ $s = append $s $h }}{{ end -}}
{{- $s | uniq | toJson -}}
{{- end }}

{{/* The operator's ServiceAccount as a user name. */}}
{{- define "kvgpu.operatorUsername" -}}
system:serviceaccount:{{ .Release.Namespace }}:kvgpu-operator
{{- end }}

{{/* The extender URL kube-scheduler calls. */}}
{{- define "kvgpu.extenderURL" -}}
{{- .Values.scheduler.extenderURL | default (printf "https://kvgpu-operator.%s.svc:%v/scheduler" .Release.Namespace .Values.operator.ports.extender) -}}
{{- end }}

{{/* KVGPU_LOG_FORMAT / KVGPU_LOG_LEVEL env entries. */}}
{{- define "kvgpu.logEnv" -}}
{{- if eq .Values.logFormat "json" }}
- {name: KVGPU_LOG_FORMAT, value: json}
{{- else if ne .Values.logFormat "console" }}
{{- fail (printf "logFormat: %q is not one of json, console" .Values.logFormat) }}
{{- end }}
- {name: KVGPU_LOG_LEVEL, value: {{ .Values.logLevel | upper | quote }}}
{{- end }}

{{/* Refuse values kvgpu cannot honour. */}}
{{- define "kvgpu.validate" -}}
{{- $fixed := dict "resourceName" "nvidia.com/gpu" "resourceMem" "nvidia.com/gpumem" "resourceMemPercentage" "nvidia.com/gpumem-percentage" "resourceCores" "nvidia.com/gpucores" "resourcePriority" "nvidia.com/priority" "schedulerName" "kvgpu-scheduler" -}}
{{- range $k, $v := $fixed }}
{{- if ne (get $.Values $k | toString) $v }}
{{- fail (printf "%s: %q is not supported: kvgpu serves the fixed name %q (HAMi's default); leave %s unset" $k (get $.Values $k | toString) $v $k) }}
{{- end }}
{{- end }}
{{- if and .Values.webhook.url (not (hasPrefix "https://" .Values.webhook.url)) }}
{{- fail (printf "webhook.url: %q must be an https:// URL (the API server calls webhooks over TLS)" .Values.webhook.url) }}
{{- end }}
{{- if not (hasPrefix "https://" (include "kvgpu.extenderURL" .)) }}
{{- fail (printf "scheduler.extenderURL: %q must be an https:// URL (the extender serves mutual TLS only)" (include "kvgpu.extenderURL" .)) }}
{{- end }}
{{- if not (has .Values.pool.mode (list "hami-core" "exclusive" "mps")) }}
{{- fail (printf "pool.mode: %q is not one of hami-core, exclusive, mps" .Values.pool.mode) }}
{{- end }}
{{- end }}

{{/* The certificate container (kvgpu certs) of the operator pod: dict "root" $ "name" N "args" (list ...). */}}
{{- define "kvgpu.certsContainer" -}}
{{- $r := .root -}}
name: {{ .name }}
image: {{ include "kvgpu.image" (dict "image" $r.Values.operator.image "root" $r) }}
imagePullPolicy: {{ $r.Values.operator.image.pullPolicy }}
args:
- certs
{{- range .args }}
- {{ . | quote }}
{{- end }}
- --out-dir=/etc/kvgpu/tls
- --webhook-service=kvgpu-webhook
- --extender-service=kvgpu-operator
- --scheduler-client=kvgpu-scheduler
{{- range (include "kvgpu.webhookSANs" $r | fromJsonArray) }}
- --webhook-san={{ . }}
{{- end }}
{{- range (include "kvgpu.extenderSANs" $r | fromJsonArray) }}
- --extender-san={{ . }}
{{- end }}
env:
- name: POD_NAMESPACE
  valueFrom:
    fieldRef: {fieldPath: metadata.namespace}
{{- include "kvgpu.logEnv" $r }}
resources: {{- toYaml $r.Values.certs.resources | nindent 2 }}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities: {drop: [ALL]}
volumeMounts:
- {name: tls, mountPath: /etc/kvgpu/tls}
{{- end }}

{{/* A JSON list of names as more cert-manager dnsNames entries, then ipAddresses (after dnsNames). */}}
{{- define "kvgpu.certManagerSANs" -}}
{{- $dns := list -}}{{- $ips := list -}}
{{- range (. | fromJsonArray) -}}
{{- if or (regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$" .) (contains ":" .) }}{{ $ips = append $ips . }}{{ else }}{{ $dns = append $dns . }}{{ end -}}
{{- end -}}
{{- range $dns }}
- {{ . }}
{{- end }}
{{- if $ips }}
ipAddresses:
{{- range $ips }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
