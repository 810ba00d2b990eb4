#!/usr/bin/env bash
# Checks that the control plane offers what the end-to-end tests rely on:
# cluster-admin through the kubeconfig, CRDs with CEL validation, RBAC,
# service-account tokens (TokenRequest), admission webhooks, garbage
# collection, namespace deletion, and helm.
# Run it after changing main.go or bumping the Kubernetes version.
set -euo pipefail

tools="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tools.sh"
bin="$("$tools" ensure | tail -n 1)"
export PATH="$bin:$PATH"
dir="$(mktemp -d)"
trap '"$tools" stop "$dir"; rm -rf "$dir"' EXIT
started=$SECONDS
KUBECONFIG="$("$tools" start "$dir")"
export KUBECONFIG
echo "ready after $((SECONDS - started)) s"

fail() {
    echo "FAIL: $*" >&2
    exit 1
}
# `kubectl auth can-i` exits 1 when the answer is no; the answer is what we check.
can_i() { kubectl auth can-i "$@" 2>/dev/null || true; }

kubectl version
kubectl get namespaces
[[ "$(can_i '*' '*')" == yes ]] || fail "admin is not cluster-admin"

# A CRD whose CEL rule must reject a violating object with the rule's message.
kubectl apply -f - <<'EOF'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: ranges.smoke.kvbank.test
spec:
  group: smoke.kvbank.test
  names: {kind: Range, plural: ranges}
  scope: Namespaced
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              properties:
                low: {type: integer}
                high: {type: integer}
              x-kubernetes-validations:
                - rule: self.low <= self.high
                  message: low must not exceed high
EOF
kubectl wait --for=condition=Established crd/ranges.smoke.kvbank.test --timeout=30s
range_object() { printf 'apiVersion: smoke.kvbank.test/v1\nkind: Range\nmetadata: {name: %s}\nspec: {low: %s, high: %s}\n' "$@"; }
range_object good 1 2 | kubectl apply -f -
if output="$(range_object bad 3 2 | kubectl apply -f - 2>&1)"; then
    fail "CEL rule did not reject low > high"
fi
grep -q "low must not exceed high" <<<"$output" || fail "rejected without the rule's message: $output"
echo "CEL rule rejected: $output"

# RBAC decides for a service account, both by impersonation and by its token.
kubectl create serviceaccount reader
kubectl create role configmap-reader --verb=get,list --resource=configmaps
kubectl create rolebinding reader --role=configmap-reader --serviceaccount=default:reader
[[ "$(can_i list configmaps --as=system:serviceaccount:default:reader)" == yes ]] || fail "role binding not honored"
[[ "$(can_i list secrets --as=system:serviceaccount:default:reader)" == no ]] || fail "RBAC allows what no role grants"

token="$(kubectl create token reader)"
server="$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')"
# A kubeconfig-free kubectl, so the admin client certificate is not sent too.
as_reader() { kubectl --kubeconfig=/dev/null --server="$server" --certificate-authority="$dir/data/pki/ca.crt" --token="$token" "$@"; }
as_reader auth whoami | grep -q system:serviceaccount:default:reader || fail "token does not authenticate"
as_reader get configmaps >/dev/null
if as_reader get secrets 2>/dev/null; then fail "token user reads secrets"; fi

# ValidatingAdmissionWebhook is on: a webhook nobody serves, with
# failurePolicy Fail, must block the requests it matches.
kubectl apply -f - <<'EOF'
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: smoke-unreachable
webhooks:
  - name: unreachable.smoke.kvbank.test
    clientConfig: {url: "https://127.0.0.1:1/validate"}
    rules:
      - {apiGroups: [smoke.kvbank.test], apiVersions: [v1], operations: [CREATE], resources: [ranges]}
    failurePolicy: Fail
    sideEffects: None
    admissionReviewVersions: [v1]
EOF
if output="$(range_object blocked 1 2 | kubectl apply -f - 2>&1)"; then
    fail "webhook was not called"
fi
grep -q "failed calling webhook" <<<"$output" || fail "unexpected webhook error: $output"
kubectl delete validatingwebhookconfiguration smoke-unreachable

# The in-process controllers: garbage collection of an object owned by a
# deleted custom resource, the default service account of a new namespace,
# and namespace deletion that empties the namespace and finishes.
owner_uid="$(kubectl get range good -o jsonpath='{.metadata.uid}')"
kubectl apply -f - <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: owned-by-good
  ownerReferences:
    - {apiVersion: smoke.kvbank.test/v1, kind: Range, name: good, uid: "$owner_uid"}
EOF
kubectl delete range good
kubectl wait --for=delete configmap/owned-by-good --timeout=60s

kubectl create namespace doomed
kubectl wait --for=create serviceaccount/default -n doomed --timeout=30s
range_object inside 1 2 | kubectl apply -n doomed -f -
kubectl delete namespace doomed --timeout=60s

# helm installs a chart into the cluster.
chart="$dir/chart"
mkdir -p "$chart/templates"
printf 'apiVersion: v2\nname: smoke\nversion: 0.1.0\n' >"$chart/Chart.yaml"
printf 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: smoke}\ndata: {from: helm}\n' >"$chart/templates/configmap.yaml"
helm version
helm install smoke "$chart" --namespace default
[[ "$(kubectl get configmap smoke -o jsonpath='{.data.from}')" == helm ]] || fail "helm release not applied"

echo "smoke: all checks passed"
