{{/* Names every template shares. The defaults for release "kvbank" are the operator's own
defaults (kvbank-webhook, kvbank-webhook-tls, kvbank-operator), but the chart always passes
them explicitly. */}}
{{- define "kvbank.fullname" -}}
{{- if contains "kvbank" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvbank" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvbank.operatorName" -}}{{ include "kvbank.fullname" . }}-operator{{- end -}}
{{- define "kvbank.webhookService" -}}{{ include "kvbank.fullname" . }}-webhook{{- end -}}
{{- define "kvbank.webhookSecret" -}}{{ include "kvbank.fullname" . }}-webhook-tls{{- end -}}
{{- define "kvbank.sidecarTokenSecret" -}}
{{- .Values.sidecarToken.existingSecret | default (printf "%s-sidecar-token" (include "kvbank.fullname" .)) -}}
{{- end -}}
{{- define "kvbank.sidecarTokenKey" -}}
{{- if .Values.sidecarToken.existingSecret }}{{ .Values.sidecarToken.existingSecretKey }}{{ else }}token{{ end -}}
{{- end -}}
{{/* Cluster-scoped like the ClusterRole: one release per cluster, since one operator judges
every namespace's pools against cluster-wide CapacityPolicies. */}}
{{- define "kvbank.webhookConfiguration" -}}{{ include "kvbank.operatorName" . }}{{- end -}}

{{- define "kvbank.labels" -}}
app.kubernetes.io/name: kvbank
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvbank.operatorSelector" -}}
app.kubernetes.io/name: kvbank
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* REGISTRY/REPOSITORY:TAG, the tag defaulting to the chart's appVersion. A repository
holding a "/" is a full reference already (ghcr.io/kvbank/kvbank, as earlier values wrote it)
and gets no prefix; so does every one when image.registry is empty. */}}
{{- define "kvbank.image" -}}
{{- $registry := trimSuffix "/" .root.Values.image.registry -}}
{{- if and $registry (not (contains "/" .image.repository)) }}{{ $registry }}/{{ end }}{{ .image.repository }}:{{ .image.tag | default .root.Chart.AppVersion }}
{{- end -}}

{{- define "kvbank.operatorImage" -}}
{{ include "kvbank.image" (dict "root" . "image" .Values.operator.image) }}
{{- end -}}

{{- define "kvbank.engineImage" -}}
{{ include "kvbank.image" (dict "root" . "image" .Values.engine.image) }}
{{- end -}}

{{- define "kvbank.vllmImage" -}}
{{ include "kvbank.image" (dict "root" . "image" .Values.engine.vllm.image) }}
{{- end -}}

{{- define "kvbank.poolTemplate" -}}
{{- $set := dict -}}
{{- range $key, $value := .Values.pools.template -}}
{{- if $value -}}{{- $_ := set $set $key $value -}}{{- end -}}
{{- end -}}
{{- toJson $set -}}
{{- end -}}

{{/* The labels the operator puts on every rank pod (kvbank.operator.render.names). */}}
{{- define "kvbank.rankSelector" -}}
app.kubernetes.io/name: kvbank
app.kubernetes.io/component: rank
app.kubernetes.io/managed-by: kvbank-operator
{{- end -}}

{{- define "kvbank.validate" -}}
{{- $modes := list "self-signed" "cert-manager" -}}
{{- if not (has .Values.certificates.mode $modes) -}}
{{- fail (printf "certificates.mode is %q; use self-signed or cert-manager" .Values.certificates.mode) -}}
{{- end -}}
{{- if not (has .Values.webhook.failurePolicy (list "Fail" "Ignore")) -}}
{{- fail (printf "webhook.failurePolicy is %q; use Fail or Ignore" .Values.webhook.failurePolicy) -}}
{{- end -}}
{{- if and .Values.webhook.url (not (hasPrefix "https://" .Values.webhook.url)) -}}
{{- fail (printf "webhook.url is %q; the apiserver calls webhooks over https://" .Values.webhook.url) -}}
{{- end -}}
{{- if and .Values.sidecarToken.existingSecret (not .Values.sidecarToken.existingSecretKey) -}}
{{- fail "sidecarToken.existingSecretKey is empty; name the key of sidecarToken.existingSecret that holds the token" -}}
{{- end -}}
{{- if and .Values.webhook.url (eq .Values.certificates.mode "cert-manager") -}}
{{- fail "webhook.url (local development) needs certificates.mode self-signed: cert-manager's certificate names only the Service" -}}
{{- end -}}
{{- end -}}

{{/* What the operator does to a pool's objects, in the pool's namespace: a ClusterRole's rules
cluster-wide, a Role's in each of operator.watchNamespaces. */}}
{{- define "kvbank.poolRules" -}}
- apiGroups: [kvbank.dev]
  resources: [modelpools]
  verbs: [get, list, watch, patch]
- apiGroups: [kvbank.dev]
  resources: [modelpools/status]
  verbs: [patch]
# What a pool renders (operator/render/bundle.py), by server-side apply; get, because the
# repair timer reads each one back to put back what vanished or drifted, and because a
# fromConfig pool's config.json is a ConfigMap it names (operator/model_config.py); watch, so
# that an edit of that ConfigMap is judged again (operator/handlers.py).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create, patch, get, list, watch, delete]
# list and delete on Services, and on each of the picker's kinds below: a pool switched back
# to spec.routing.picker: none has the picker's objects it owns deleted (operator/pruning.py).
- apiGroups: [""]
  resources: [services]
  verbs: [create, patch, get, list, delete]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [create, patch, get]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch, get]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [create, patch, get]
# A pool with spec.routing.picker: kvbank (operator/render/picker.py): the picker's Deployment,
# ServiceAccount, Role and RoleBinding, NetworkPolicies, and the InferencePool (where its CRD
# is installed); listed by label and deleted when the pool goes back to picker: none.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [create, patch, get, list, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create, patch, get, list, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create, patch, get, list, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch, get, list, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [create, patch, get, list, delete]
# A pool's copy of the sidecar token (operator/render/token.py) and its sidecar certificate
# (operator/pool_tls.py): created, and the certificate renewed by a whole-object update.
# Never get, list, watch or patch: each of those returns a Secret's data, and patch (as
# server-side apply) would let the operator read every Secret it may patch. An update answers
# with the object the operator itself sent.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, update]
# Whether a pool's weights claim exists and is Bound (its WeightsAvailable condition).
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get]
# The status timer reads a pool's pods (readiness, rank-0 addresses, weights-check failures);
# it writes none: the traffic Service selects by labels the workload controller stamps. get
# and watch only because the picker's Role grants them, and RBAC lets the operator grant
# only what it holds (no escalate or bind verbs).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
