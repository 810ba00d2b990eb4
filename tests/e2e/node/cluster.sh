#!/usr/bin/env bash
# A one-node Kubernetes cluster on this machine, where pods really run:
#
#   cluster.sh up DIR     start it, logging under DIR; prints the admin kubeconfig
#   cluster.sh usage DIR  print the commands that reach it and install the chart
#                         from its images (`make cluster-up` runs up, then this)
#   cluster.sh down DIR   stop it and remove what it added to the machine
#
# The control plane (tools.sh) listens on the pod bridge's address; beside it run
# kube-scheduler, kube-controller-manager, containerd (Debian's, with runc and
# the CNI bridge plugin), the kubelet and kube-proxy, and CoreDNS as a pod. The
# node advertises $gpus nvidia.com/gpu as an extended resource, so that pods
# asking for GPUs schedule; nothing here has a GPU, the engine runs on CPU.
#
# All traffic stays on this machine: the bridge's subnet is reachable only from
# the bridge and loopback, pods get no route out (no masquerading, and a
# forwarding guard), and NodePorts open on the bridge's address only.
# One cluster per machine: the bridge, the addresses and /run/kvbank-node are
# fixed, and a lock keeps a second `up` out until `down`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tools="$here/../tools.sh"
node_name=kvbank-node
bridge=kvbank0
node_ip=10.251.0.1
pod_subnet=10.251.0.0/24
dns_ip=10.96.0.10
gpus=4
run_dir=/run/kvbank-node
kubelet_root=/var/lib/kvbank-node/kubelet
# Imported images survive between runs, so a warm start imports nothing.
containerd_root="${XDG_CACHE_HOME:-$HOME/.cache}/kvbank/node-containerd"
guard_chain=KVBANK-NODE-GUARD
ready_timeout_s=180
components=(containerd kube-scheduler kube-controller-manager kubelet kube-proxy)

log() { echo "cluster.sh: $(date -u +%T) $*" >&2; }

# start_component DIR NAME COMMAND...: runs it in its own session, logging to
# DIR/NAME.log; its pid goes to DIR/NAME.pid.
start_component() {
    local dir="$1" name="$2"
    shift 2
    setsid "$@" </dev/null >"$dir/$name.log" 2>&1 &
    echo $! >"$dir/$name.pid"
}

# Only a pid whose command line still names the component is ours to signal.
stop_component() {
    local dir="$1" name="$2" pid waited=0
    [[ -f "$dir/$name.pid" ]] || return 0
    pid="$(cat "$dir/$name.pid")"
    if [[ -r "/proc/$pid/cmdline" ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$name"; then
        kill -TERM "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null && ((waited < 150)); do
            sleep 0.2
            waited=$((waited + 1))
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/$name.pid"
}

# wait_until SECONDS WHAT COMMAND...: polls COMMAND until it succeeds.
wait_until() {
    local limit="$1" what="$2" started=$SECONDS
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS - started >= limit)); then
            log "$what not ready within $limit s"
            return 1
        fi
        sleep 0.5
    done
}

network_up() {
    ip link show "$bridge" >/dev/null 2>&1 || ip link add "$bridge" type bridge
    ip addr replace "$node_ip/24" dev "$bridge"
    ip link set "$bridge" up
    # Pods reach Services through the host: kube-proxy's DNAT, then routing.
    sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1
    iptables -N "$guard_chain" 2>/dev/null || iptables -F "$guard_chain"
    iptables -A "$guard_chain" -d "$pod_subnet" -i "$bridge" -j RETURN
    iptables -A "$guard_chain" -d "$pod_subnet" -i lo -j RETURN
    iptables -A "$guard_chain" -d "$pod_subnet" -j DROP
    iptables -C INPUT -j "$guard_chain" 2>/dev/null || iptables -I INPUT -j "$guard_chain"
    iptables -N "$guard_chain-FWD" 2>/dev/null || iptables -F "$guard_chain-FWD"
    iptables -A "$guard_chain-FWD" -i "$bridge" -o "$bridge" -j RETURN
    iptables -A "$guard_chain-FWD" -j DROP
    iptables -C FORWARD -j "$guard_chain-FWD" 2>/dev/null || iptables -I FORWARD -j "$guard_chain-FWD"
}

network_down() {
    iptables -D INPUT -j "$guard_chain" 2>/dev/null || true
    iptables -D FORWARD -j "$guard_chain-FWD" 2>/dev/null || true
    iptables -F "$guard_chain" 2>/dev/null && iptables -X "$guard_chain" 2>/dev/null || true
    iptables -F "$guard_chain-FWD" 2>/dev/null && iptables -X "$guard_chain-FWD" 2>/dev/null || true
    ip link del "$bridge" 2>/dev/null || true
}

write_configs() {
    local dir="$1" pki="$1/data/pki" pause_image="$2"
    mkdir -p "$run_dir/cni" "$dir/config"
    cat >"$run_dir/cni/10-kvbank-node.conflist" <<EOC
{"cniVersion": "1.0.0", "name": "kvbank-node", "plugins": [
  {"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$run_dir/ipam",
            "ranges": [[{"subnet": "$pod_subnet", "rangeStart": "10.251.0.10", "gateway": "$node_ip"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
EOC
    cat >"$dir/config/containerd.toml" <<EOC
version = 2
root = "$containerd_root"
state = "$run_dir/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$run_dir/containerd.sock"
[ttrpc]
  address = "$run_dir/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$run_dir/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_image"
  # This machine's root lacks CAP_SYS_RESOURCE, so no process may lower its oom_score_adj
  # below containerd's; the kubelet asks -998 for the sandbox and critical pods.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$run_dir/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$run_dir/cni"
EOC
    # No host search domains or nameservers leak into pods.
    : >"$dir/config/resolv.conf"
    cat >"$dir/config/kubelet.yaml" <<EOC
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$run_dir/containerd.sock
# This machine mounts cgroup v1 (the kubelet refuses it unless told) and has no systemd.
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
clusterDNS: [$dns_ip]
clusterDomain: cluster.local
resolvConf: $dir/config/resolv.conf
# The disk is shared with other work: never evict or collect images for its sake.
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
EOC
    cat >"$dir/config/kube-proxy.yaml" <<EOC
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $dir/admin.kubeconfig}
hostnameOverride: $node_name
mode: iptables
clusterCIDR: $pod_subnet
bindAddress: $node_ip
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [$node_ip/32]
# Leave the machine's conntrack table settings alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOC
}

# Containers a previous run left (a crash, a kill) would be adopted or fought
# over by the new kubelet; the images stay.
clean_containers() {
    local ctr=(ctr --address "$run_dir/containerd.sock" -n k8s.io) id
    for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
        "${ctr[@]}" tasks kill -s KILL "$id" >/dev/null 2>&1 || true
        "${ctr[@]}" tasks rm -f "$id" >/dev/null 2>&1 || true
    done
    for id in $("${ctr[@]}" containers ls -q 2>/dev/null); do
        "${ctr[@]}" containers rm "$id" >/dev/null 2>&1 || true
    done
}

# Each layout goes in with only the blobs containerd lacks: the packages layer (gigabytes) is
# shared by both kvbank images and by every build of kvbank's own small layer.
import_images() {
    local name layout have blob ctr=(ctr --address "$run_dir/containerd.sock" -n k8s.io)
    while read -r name layout; do
        if [[ -n "$("${ctr[@]}" images ls -q "name==$name")" ]]; then
            share_blobs "$layout"
            continue
        fi
        log "importing $name"
        have="$("${ctr[@]}" content ls -q)"
        (cd "$layout" && {
            echo oci-layout
            echo index.json
            for blob in blobs/sha256/*; do
                grep -qx "sha256:${blob##*/}" <<<"$have" || echo "$blob"
            done
        } | tar -cf - --files-from -) | "${ctr[@]}" images import - >/dev/null
        share_blobs "$layout"
        # Earlier builds of the same image: removed, and their layers (gigabytes each) with
        # them now (--sync), not at containerd's next start, so a rebuilt layer never stands
        # beside the one it replaced.
        "${ctr[@]}" images ls -q | grep "^${name%:*}:" | grep -vx "$name" |
            xargs -r "${ctr[@]}" images rm --sync >/dev/null || true
    done
}

# share_blobs LAYOUT: containerd keeps its own copy of every blob it imports, beside the
# layout's; the layers' copies (gigabytes) become one file, the layout's, under both names.
# Content blobs never change once written, and a name containerd's garbage collector removes
# leaves the layout's. A filesystem without hard links between the two keeps both copies.
share_blobs() {
    local layout="$1" blob ours theirs
    for blob in "$layout"/blobs/sha256/*; do
        [[ -f "$blob" && $(stat -c %s "$blob") -gt 1048576 ]] || continue
        theirs="$containerd_root/io.containerd.content.v1.content/blobs/sha256/${blob##*/}"
        [[ -f "$theirs" && ! "$blob" -ef "$theirs" ]] || continue
        ours="$theirs.layout"
        ln -f "$blob" "$ours" 2>/dev/null && mv -f "$ours" "$theirs" || rm -f "$ours"
    done
}

up() {
    local dir="$1" bin images pause_image kubeconfig started=$SECONDS
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    mkdir -p "$run_dir"
    exec 8>"$run_dir/.lock"
    flock -n 8 || { log "another one-node cluster runs on this machine ($run_dir/.lock)"; return 1; }
    bin="$("$tools" ensure-node | tail -n 1)"
    images="$("$here/images.sh" ensure "$bin/coredns")"
    echo "$images" >"$dir/images"
    pause_image="$(awk '$1 ~ /\/pause:/ { print $1 }' <<<"$images")"
    export PATH="$bin:$PATH"
    log "tools and images ready after $((SECONDS - started)) s"

    network_up
    # The apiserver reaches the kubelet (logs, exec, port-forward) at the node's address,
    # with a client certificate the kubelet checks against the cluster's CA.
    kubeconfig="$("$tools" start "$dir" -address "$node_ip" -- --kubelet-preferred-address-types=InternalIP \
        --kubelet-client-certificate="$dir/data/pki/admin.crt" --kubelet-client-key="$dir/data/pki/admin.key")"
    write_configs "$dir" "$pause_image"

    start_component "$dir" containerd containerd --config "$dir/config/containerd.toml"
    wait_until 30 containerd ctr --address "$run_dir/containerd.sock" version
    clean_containers
    import_images <<<"$images"
    log "containerd ready, images imported, after $((SECONDS - started)) s"

    start_component "$dir" kube-scheduler kube-scheduler --kubeconfig="$kubeconfig" \
        --leader-elect=false --bind-address=127.0.0.1 --secure-port=0
    # The control plane runs the namespace, garbage-collector and service-account
    # controllers itself; this runs all the others (deployments, statefulsets,
    # endpoints, volume binding, the root CA ConfigMap service-account volumes use).
    start_component "$dir" kube-controller-manager kube-controller-manager --kubeconfig="$kubeconfig" \
        --leader-elect=false --bind-address=127.0.0.1 --secure-port=0 \
        --controllers='*,-namespace-controller,-garbage-collector-controller,-serviceaccount-controller' \
        --root-ca-file="$dir/data/pki/ca.crt" --service-account-private-key-file="$dir/data/pki/service-account.key" \
        --use-service-account-credentials=false
    mkdir -p "$kubelet_root"
    start_component "$dir" kubelet kubelet --config="$dir/config/kubelet.yaml" --kubeconfig="$kubeconfig" \
        --root-dir="$kubelet_root" --hostname-override="$node_name" --node-ip="$node_ip"
    start_component "$dir" kube-proxy kube-proxy --config="$dir/config/kube-proxy.yaml"

    wait_until "$ready_timeout_s" "node $node_name" \
        kubectl --kubeconfig="$kubeconfig" wait --for=condition=Ready "node/$node_name" --timeout=5s
    kubectl --kubeconfig="$kubeconfig" patch node "$node_name" --subresource=status --type=json \
        -p "[{\"op\": \"add\", \"path\": \"/status/capacity/nvidia.com~1gpu\", \"value\": \"$gpus\"}]" >/dev/null
    # The kubelet derives allocatable (what the scheduler counts) at its next status update.
    wait_until 60 "$gpus nvidia.com/gpu allocatable" gpus_allocatable "$kubeconfig"
    start_dns "$kubeconfig" "$(awk '$1 ~ /\/coredns:/ { print $1 }' <<<"$images")"
    log "cluster up after $((SECONDS - started)) s"
    echo "$kubeconfig"
}

gpus_allocatable() {
    [[ "$(kubectl --kubeconfig="$1" get node "$node_name" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" == "$gpus" ]]
}

start_dns() {
    local kubeconfig="$1" image="$2"
    sed -e "s|@IMAGE@|$image|" -e "s|@DNS_IP@|$dns_ip|" "$here/coredns.yaml" |
        kubectl --kubeconfig="$kubeconfig" apply -f - >/dev/null
    wait_until "$ready_timeout_s" "CoreDNS" kubectl --kubeconfig="$kubeconfig" -n kube-system \
        rollout status deployment/coredns --timeout=5s
}

# The kubelet's own chains (KUBE-FIREWALL guards 127.0.0.0/8; the canaries detect a flush);
# kube-proxy --cleanup removes kube-proxy's.
kubelet_chains_down() {
    local cmd table
    for cmd in iptables ip6tables; do
        "$cmd" -D INPUT -j KUBE-FIREWALL 2>/dev/null || true
        "$cmd" -D OUTPUT -j KUBE-FIREWALL 2>/dev/null || true
        for table in filter nat mangle; do
            for chain in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do
                "$cmd" -t "$table" -F "$chain" 2>/dev/null && "$cmd" -t "$table" -X "$chain" 2>/dev/null || true
            done
        done
    done
}

# Pods go the way they would on a drained node: with nothing left to recreate them, the
# kubelet stops each sandbox through the CRI, which releases its address and network
# namespace through CNI.
drain() {
    local dir="$1" kubeconfig="$1/admin.kubeconfig"
    [[ -f "$kubeconfig" && -f "$dir/kubelet.pid" ]] || return 0
    stop_component "$dir" kube-controller-manager
    stop_component "$dir" kube-scheduler
    kubectl --kubeconfig="$kubeconfig" delete pods --all --all-namespaces --grace-period=0 --force \
        --timeout=30s >/dev/null 2>&1 || true
    wait_until 60 "the node's containers stopped" no_running_tasks || true
}

no_running_tasks() {
    ! ctr --address "$run_dir/containerd.sock" -n k8s.io tasks ls 2>/dev/null | awk 'NR > 1 { print $3 }' | grep -q RUNNING
}

down() {
    local dir="$1" component mount bin netns
    dir="$(cd "$dir" && pwd)"
    bin="$("$tools" ensure-node | tail -n 1)"
    export PATH="$bin:$PATH"
    drain "$dir"
    for component in kube-proxy kubelet kube-controller-manager kube-scheduler; do
        stop_component "$dir" "$component"
    done
    # What a crash or a timed-out drain left.
    clean_containers
    stop_component "$dir" containerd
    "$tools" stop "$dir"
    "$bin/kube-proxy" --cleanup >/dev/null 2>&1 || true
    kubelet_chains_down
    grep -o " $kubelet_root[^ ]*\| $run_dir[^ ]*" /proc/mounts | sort -r | while read -r mount; do
        umount -l "$mount" 2>/dev/null || true
    done
    # Network namespaces of sandboxes the drain did not stop (only this cluster's CRI makes them).
    for netns in /var/run/netns/cni-*; do
        [[ -e "$netns" ]] && ip netns delete "$(basename "$netns")" 2>/dev/null || true
    done
    network_down
    rm -rf "$kubelet_root" "$run_dir"/{containerd,runc,ipam,cni,opt} "$run_dir"/containerd.sock*
}

# chart_sets DIR: the chart values that run the images `up` imported (never pulled).
chart_sets() {
    local dir="$1" name reference
    while read -r reference _; do
        name="${reference##*/}"
        name="${name%%:*}"
        case "$name" in
        kvbank-operator) echo "operator.image.repository=${reference%:*} operator.image.tag=${reference##*:} operator.image.pullPolicy=Never" ;;
        kvbank) echo "engine.image.repository=${reference%:*} engine.image.tag=${reference##*:} engine.image.pullPolicy=Never" ;;
        kvbank-vllm) echo "engine.vllm.image.repository=${reference%:*} engine.vllm.image.tag=${reference##*:}" ;;
        esac
    done <"$dir/images"
}

usage() {
    local dir="$1" bin value
    dir="$(cd "$dir" && pwd)"
    [[ -f "$dir/admin.kubeconfig" && -f "$dir/images" ]] || { log "no cluster was brought up in $dir"; return 1; }
    bin="$("$tools" ensure-node | tail -n 1)"
    echo "The one-node cluster is up: node $node_name, $gpus nvidia.com/gpu advertised (engines run on CPU)."
    echo "Its logs are in $dir; kubectl and helm, built for it, in $bin."
    echo
    echo "  export KUBECONFIG=$dir/admin.kubeconfig PATH=$bin:\$PATH"
    echo "  kubectl get nodes"
    echo "  helm install kvbank $(cd "$here/../../.." && pwd)/charts/kvbank -n kvbank-system --create-namespace --wait \\"
    for value in $(chart_sets "$dir"); do
        echo "    --set $value \\"
    done
    echo "    --timeout 6m"
    echo "  kubectl -n kvbank-system get pods"
    echo
    echo "Pools then go in as on any cluster (docs/deploy.md, section 3; tests/e2e/node/test_node_pods.py"
    echo "has pools of the built-in model). Stop it with: make cluster-down"
}

main() {
    case "${1:-}" in
    up) up "${2:?usage: cluster.sh up DIR}" ;;
    usage) usage "${2:?usage: cluster.sh usage DIR}" ;;
    down) down "${2:?usage: cluster.sh down DIR}" ;;
    *)
        echo "usage: cluster.sh up DIR | usage DIR | down DIR" >&2
        exit 2
        ;;
    esac
}

main "$@"; exit $?
