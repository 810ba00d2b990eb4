#!/usr/bin/env bash
# Tools for the end-to-end tests, all built from package registries (the Go
# module proxy) because release binaries cannot be downloaded here:
#
#   tools.sh ensure      build or reuse kube-controlplane, kubectl and helm;
#                        the last line printed is the folder holding all three
#   tools.sh ensure-node as ensure, plus what a node runs: kubelet, kube-proxy,
#                        kube-scheduler, kube-controller-manager (from the same
#                        module graph as the apiserver) and coredns; the last
#                        line printed is the folder holding all of them
#   tools.sh start DIR [ARG...]
#                        start the control plane in the background, logging to
#                        DIR/controlplane.log, with ARGs added to its command
#                        line; prints the admin kubeconfig path
#   tools.sh stop DIR    stop the control plane started in DIR
#
# Builds are cached under ${XDG_CACHE_HOME:-$HOME/.cache}/kvbank, keyed by what
# goes into them, so a warm `ensure` only hashes a few files.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
controlplane_src="$here/controlplane"
helm_version=v3.22.0
coredns_version=v1.14.7
node_components=(kubelet kube-proxy kube-scheduler kube-controller-manager)
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/kvbank"
ready_timeout_s=120
stop_timeout_s=30

# The machine has 2 cores; more parallel compiles only add memory pressure.
go_build_flags=(-p 2 -trimpath -buildvcs=false)
# The builds' own compile cache (about 4.5 GB of Kubernetes packages), apart from the user's:
# it only speeds builds that share packages, and goes once the node's are all built.
export GOCACHE="$cache_root/go-build"

log() { echo "tools.sh: $*" >&2; }

k8s_version() {
    awk '$1 == "k8s.io/kubernetes" { print $2 }' "$controlplane_src/go.mod"
}

# Stamps the Kubernetes version into the apiserver and kubectl, as the release
# build does and `go build` does not: unstamped, both say v0.0.0-master, and
# helm checks a chart's kubeVersion against what the apiserver says.
k8s_ldflags() {
    local version major minor package flags="-s -w"
    version="$(k8s_version)"
    read -r major minor < <(k8s_major_minor)
    for package in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        flags+=" -X $package.gitVersion=$version -X $package.gitMajor=$major -X $package.gitMinor=$minor"
    done
    echo "$flags"
}

# Stamps helm as its release build does: its version, and the Kubernetes
# version that `helm template` and `helm lint` assume without a cluster (1.20
# unstamped); here the version the tests run against.
helm_ldflags() {
    local major minor package flags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version"
    read -r major minor < <(k8s_major_minor)
    for package in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
        flags+=" -X $package.k8sVersionMajor=$major -X $package.k8sVersionMinor=$minor"
    done
    echo "$flags"
}

k8s_major_minor() {
    local version
    version="$(k8s_version)" # v1.36.3
    version="${version#v}"
    echo "${version%%.*} $(cut -d. -f2 <<<"$version")"
}

# Cache folders are named by a hash of everything that goes into a build (the
# files named, the linker and go flags), so a change gives a new folder; an old
# one is left alone, which keeps switching branches back and forth cheap.
build_hash() {
    local ldflags="$1"
    shift
    { cat "$@" /dev/null; echo "$ldflags ${go_build_flags[*]}"; } | sha256sum | cut -c1-12
}

# build_into TARGET BUILD_FUNCTION: the function writes the binary to $out, a
# temporary path that is then moved onto TARGET, so an interrupted build never
# leaves a truncated binary that a later run would take as done.
build_into() {
    local target="$1" started=$SECONDS out
    shift
    # Left by a run killed mid-build (its compiler may finish after it); we
    # hold the lock, so no live run is writing them.
    rm -rf "$target".partial.*
    [[ -x "$target" ]] && return 0
    command -v go >/dev/null || { log "go is needed to build $(basename "$target")"; return 1; }
    log "building $(basename "$target") (several minutes on 2 cores when cold)"
    mkdir -p "$(dirname "$target")"
    out="$target.partial.$$"
    # 9>&-: the build must not inherit the lock, or a build orphaned by a
    # killed run would hold it until the compiler finishes.
    if ! "$@" 9>&-; then
        rm -rf "$out"
        return 1
    fi
    mv -f "$out" "$target"
    log "built $target in $((SECONDS - started)) s"
}

build_controlplane() {
    (cd "$controlplane_src" && go build "${go_build_flags[@]}" -ldflags="$(k8s_ldflags)" -o "$out" .)
}

# kubectl comes from the same module graph as the apiserver (the go.mod
# `tool` line), so client and server versions always match.
build_kubectl() {
    (cd "$controlplane_src" &&
        go build "${go_build_flags[@]}" -ldflags="$(k8s_ldflags)" -o "$out" k8s.io/kubernetes/cmd/kubectl)
}

# One go build for the four, so the packages they share compile once and the
# links run side by side. $out is a folder here, moved whole onto the target.
build_node_components() {
    local packages=("${node_components[@]/#/k8s.io/kubernetes/cmd/}")
    mkdir -p "$out"
    (cd "$controlplane_src" && go build "${go_build_flags[@]}" -ldflags="$(k8s_ldflags)" -o "$out/" "${packages[@]}")
}

# CoreDNS from its own module graph at a pinned release, as helm is; static
# (no cgo), so its image needs nothing but the binary.
build_coredns() {
    (cd / && CGO_ENABLED=0 GOBIN="$out.d" go install "${go_build_flags[@]}" -ldflags="-s -w" "github.com/coredns/coredns@$coredns_version") &&
        mv "$out.d/coredns" "$out" && rmdir "$out.d"
}

# go install with @version ignores any go.mod around it, and can only write
# into a folder (GOBIN), not to a file name.
build_helm() {
    (cd / && GOBIN="$out.d" go install "${go_build_flags[@]}" -ldflags="$(helm_ldflags)" "helm.sh/helm/v3/cmd/helm@$helm_version") &&
        mv "$out.d/helm" "$out" && rmdir "$out.d"
}

ensure() {
    local dir kubectl_dir helm_dir node_dir coredns_dir component with_node="${1:-}"
    local src="$controlplane_src"
    dir="$cache_root/controlplane-$(k8s_version)-$(build_hash "$(k8s_ldflags)" "$src"/go.{mod,sum} "$src"/*.go)"
    # kubectl depends only on the pinned modules, not on main.go; helm only on
    # its own version. Each gets its own folder so neither is rebuilt needlessly.
    kubectl_dir="$cache_root/kubectl-$(k8s_version)-$(build_hash "$(k8s_ldflags)" "$src"/go.{mod,sum})"
    helm_dir="$cache_root/helm-$helm_version-$(build_hash "$(helm_ldflags)")"

    mkdir -p "$cache_root"
    # Two test runs starting together must not build into the same paths.
    exec 9>"$cache_root/.lock"
    flock 9

    build_into "$dir/kube-controlplane" build_controlplane
    build_into "$kubectl_dir/kubectl" build_kubectl
    build_into "$helm_dir/helm" build_helm

    mkdir -p "$dir/bin"
    ln -sfn "../kube-controlplane" "$dir/bin/kube-controlplane"
    ln -sfn "$kubectl_dir/kubectl" "$dir/bin/kubectl"
    ln -sfn "$helm_dir/helm" "$dir/bin/helm"
    if [[ "$with_node" == node ]]; then
        # Like kubectl, the node's components depend only on the pinned modules.
        node_dir="$cache_root/node-$(k8s_version)-$(build_hash "$(k8s_ldflags)" "$src"/go.{mod,sum})"
        coredns_dir="$cache_root/coredns-$coredns_version-$(build_hash "CGO_ENABLED=0 -s -w")"
        build_into "$node_dir/bin" build_node_components
        build_into "$coredns_dir/coredns" build_coredns
        rm -rf "$GOCACHE"
        dir="$dir/node"
        mkdir -p "$dir/bin"
        for component in kube-controlplane kubectl helm; do
            ln -sfn "../../bin/$component" "$dir/bin/$component"
        done
        for component in "${node_components[@]}"; do
            ln -sfn "$node_dir/bin/$component" "$dir/bin/$component"
        done
        ln -sfn "$coredns_dir/coredns" "$dir/bin/coredns"
    fi
    flock -u 9
    echo "$dir/bin"
}

# Only a pid whose command line is our binary is ours to signal: a stale pid
# file may name a process that reused the number.
running_pid() {
    local pid_file="$1/controlplane.pid" pid
    [[ -f "$pid_file" ]] || return 1
    pid="$(cat "$pid_file")"
    [[ -r "/proc/$pid/cmdline" ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q kube-controlplane || return 1
    echo "$pid"
}

start() {
    local dir="$1" bin pid kubeconfig waited=0
    shift
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    kubeconfig="$dir/admin.kubeconfig"
    if running_pid "$dir" >/dev/null; then
        log "already running in $dir"
        echo "$kubeconfig"
        return 0
    fi
    bin="$(ensure | tail -n 1)"
    rm -f "$kubeconfig"
    # setsid: its own session, so a terminal hang-up or Ctrl-C aimed at the
    # caller does not reach it; only `stop` does.
    setsid "$bin/kube-controlplane" -data-dir "$dir/data" -kubeconfig "$kubeconfig" "$@" \
        </dev/null >"$dir/controlplane.log" 2>&1 &
    pid=$!
    echo "$pid" >"$dir/controlplane.pid"
    # The control plane prints "READY <kubeconfig>" once the apiserver answers.
    until grep -q '^READY ' "$dir/controlplane.log"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "control plane exited before it was ready; end of $dir/controlplane.log:"
            tail -n 30 "$dir/controlplane.log" >&2
            return 1
        fi
        if ((waited >= ready_timeout_s * 5)); then
            log "control plane not ready within $ready_timeout_s s; stopping it"
            stop "$dir"
            return 1
        fi
        sleep 0.2
        waited=$((waited + 1))
    done
    echo "$kubeconfig"
}

stop() {
    local dir="$1" pid waited=0
    if ! pid="$(running_pid "$dir")"; then
        rm -f "$dir/controlplane.pid"
        return 0
    fi
    kill -TERM "$pid"
    while kill -0 "$pid" 2>/dev/null; do
        if ((waited >= stop_timeout_s * 5)); then
            log "control plane did not stop within $stop_timeout_s s; killing it"
            kill -KILL "$pid"
            break
        fi
        sleep 0.2
        waited=$((waited + 1))
    done
    rm -f "$dir/controlplane.pid"
}

# Everything runs from main, called on the last line with an exit: bash reads a script as it
# goes, so an edit to this file while an instance runs must not change what that instance does.
main() {
    case "${1:-}" in
    ensure) ensure ;;
    ensure-node) ensure node ;;
    start) start "${2:?usage: tools.sh start DIR [ARG...]}" "${@:3}" ;;
    stop) stop "${2:?usage: tools.sh stop DIR}" ;;
    *)
        echo "usage: tools.sh ensure | ensure-node | start DIR | stop DIR" >&2
        exit 2
        ;;
    esac
}

main "$@"; exit $?
