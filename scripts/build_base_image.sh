#!/usr/bin/env bash
# Build the local base image atropos-sandbox-base:bookworm without any image registry.
#
#   debootstrap --variant=minbase bookworm <rootfs> <mirror from this machine's apt sources>
#   (+ security/updates from the same apt sources) -> tar -> docker import
#
# Idempotent and cheap to rerun:
#   * skips everything when the image already exists with the same package-list key;
#   * caches the rootfs tarball under ${XDG_CACHE_HOME:-$HOME/.cache}/atropos-sandbox/, keyed by the
#     suite + package list, so a rerun after `docker rmi` only re-imports it.
# Needs root (debootstrap/chroot) and a running Docker engine (scripts/docker_engine.sh).
#
# Environment:
#   BASE_IMAGE_TAG          image to produce (default atropos-sandbox-base:bookworm)
#   DEBIAN_MIRROR           override the mirror read from apt sources
#   BASE_SECURITY_UPDATES   1 (default): apt-get upgrade from the host's <suite>-updates/-security sources
#   BASE_REFRESH            1: ignore the cached tarball and the existing image
set -euo pipefail

suite=bookworm
tag="${BASE_IMAGE_TAG:-atropos-sandbox-base:${suite}}"
# Runtime needs of the sandbox image: python (server + venv), bwrap (per-call sandbox), tmux (persistent
# terminal), git (agents' tools), procps/util-linux (ps/kill, prlimit/setpriv), libseccomp2 (bwrap filter
# built through ctypes), tini (PID 1), ca-certificates (TLS from the server and slots).
packages=(python3 python3-venv bubblewrap tmux git ca-certificates procps util-linux libseccomp2 tini)
security_updates="${BASE_SECURITY_UPDATES:-1}"
refresh="${BASE_REFRESH:-0}"
# Bump when the way the rootfs is produced changes (invalidates caches/images).
recipe_version=1

start=$SECONDS
say() { printf '[build_base_image +%3ss] %s\n' "$((SECONDS - start))" "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

key="$(printf '%s\n' "recipe=${recipe_version}" "suite=${suite}" "arch=$(dpkg --print-architecture)" \
    "security=${security_updates}" "${packages[@]}" | sha256sum | cut -c1-16)"

command -v docker >/dev/null 2>&1 || die "docker CLI missing (run scripts/docker_engine.sh)"
docker info >/dev/null 2>&1 || die "docker engine not reachable (run scripts/docker_engine.sh)"

if [[ "$refresh" != 1 ]]; then
    existing_key="$(docker image inspect --format '{{ index .Config.Labels "org.atropos.base-key" }}' "$tag" \
        2>/dev/null || true)"
    if [[ "$existing_key" == "$key" ]]; then
        say "image $tag already exists (key $key); nothing to do"
        exit 0
    elif [[ -n "$existing_key" ]]; then
        say "image $tag exists with another key ($existing_key); rebuilding"
    fi
fi

cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}/atropos-sandbox"
tarball="$cache_dir/rootfs-${suite}-${key}.tar.gz"
mkdir -p "$cache_dir"

# --- apt sources of this machine -------------------------------------------------------------------
# Prints "URI SUITE" for every enabled deb entry (one-line .list and deb822 .sources formats).
apt_source_pairs() {
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        awk '$1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while ($i !~ /\]$/ && i < NF) i++; i++ }
                print $i, $(i + 1)
             }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        awk 'function flush(   i, j, nu, ns, u, s) {
                 if (types ~ /(^|[ \t])deb([ \t]|$)/ && enabled !~ /^[ \t]*no/) {
                     nu = split(uris, u, /[ \t]+/); ns = split(suites, s, /[ \t]+/)
                     for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++)
                         if (u[i] != "" && s[j] != "") print u[i], s[j]
                 }
                 types = uris = suites = enabled = ""
             }
             /^[ \t]*#/ { next }
             /^[ \t]*$/ { flush(); next }
             tolower($1) == "types:"   { sub(/^[^:]*:[ \t]*/, ""); types = $0; next }
             tolower($1) == "uris:"    { sub(/^[^:]*:[ \t]*/, ""); uris = $0; next }
             tolower($1) == "suites:"  { sub(/^[^:]*:[ \t]*/, ""); suites = $0; next }
             tolower($1) == "enabled:" { sub(/^[^:]*:[ \t]*/, ""); enabled = tolower($0); next }
             END { flush() }' "$f"
    done
}

mirror="${DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
    mirror="$(apt_source_pairs | awk -v s="$suite" '$2 == s { print $1; exit }')"
fi
[[ -n "$mirror" ]] || die "no '$suite' entry in /etc/apt/sources.list{,.d/*}; set DEBIAN_MIRROR"

# --- rootfs tarball (cached) -----------------------------------------------------------------------
if [[ "$refresh" == 1 || ! -s "$tarball" ]]; then
    [[ "$(id -u)" -eq 0 ]] || die "debootstrap needs root"
    export DEBIAN_FRONTEND=noninteractive
    if ! command -v debootstrap >/dev/null 2>&1; then
        say "installing debootstrap"
        apt-get install -y -qq debootstrap </dev/null >/dev/null \
            || { apt-get update -qq </dev/null && apt-get install -y -qq debootstrap </dev/null >/dev/null; }
    fi

    work="$(mktemp -d /var/tmp/atropos-rootfs.XXXXXX)"
    rootfs="$work/rootfs"
    cleanup() {
        local m
        for m in "$rootfs/proc" "$rootfs/dev/pts"; do
            if mountpoint -q "$m" 2>/dev/null; then umount -l "$m" || true; fi
        done
        rm -rf "$work"
    }
    trap cleanup EXIT

    include="$(IFS=,; echo "${packages[*]}")"
    say "debootstrap --variant=minbase $suite (packages: ${packages[*]})"
    debootstrap --variant=minbase --include="$include" "$suite" "$rootfs" "$mirror" \
        >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
    say "debootstrap done"

    # apt sources inside the image: the same mirrors this machine uses for this suite
    apt_source_pairs | awk -v s="$suite" '$2 == s || $2 == s "-updates" || $2 == s "-security"' \
        | sort -u | awk '{ print "deb", $1, $2, "main" }' >"$rootfs/etc/apt/sources.list"
    [[ -s "$rootfs/etc/apt/sources.list" ]] || echo "deb $mirror $suite main" >"$rootfs/etc/apt/sources.list"

    if [[ "$security_updates" == 1 ]]; then
        say "apt-get upgrade from $(awk '{ print $3 }' "$rootfs/etc/apt/sources.list" | paste -sd' ')"
        mount -t proc proc "$rootfs/proc"
        chroot "$rootfs" /usr/bin/env DEBIAN_FRONTEND=noninteractive sh -c \
            'apt-get update -qq && apt-get -y -qq -o Dpkg::Options::=--force-confold upgrade' \
            </dev/null >"$work/upgrade.log" 2>&1 || { tail -n 30 "$work/upgrade.log" >&2; die "apt-get upgrade failed"; }
        umount "$rootfs/proc"
    fi

    say "trimming rootfs"
    # Keep future apt installs (e.g. in a Dockerfile) lean, as Docker's official Debian images do.
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/atropos-minimal" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
    cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    echo 'APT::Install-Recommends "false";' >"$rootfs/etc/apt/apt.conf.d/99no-recommends"
    find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
    find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
    r="${rootfs:?}"
    rm -rf "$r"/usr/share/man/* "$r"/usr/share/info/* "$r"/usr/share/locale/* "$r"/usr/share/lintian/* \
        "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/* "$r"/var/cache/debconf/*-old "$r"/var/log/* \
        "$r"/tmp/* "$r"/var/tmp/* "${r:?}"/dev/* "$r"/run/*
    find "$rootfs" -name '__pycache__' -type d -prune -exec rm -rf {} + 2>/dev/null || true
    : >"$rootfs/etc/hostname"
    : >"$rootfs/etc/resolv.conf"
    : >"$rootfs/etc/machine-id"

    say "writing $tarball"
    tar -C "$rootfs" --numeric-owner -c . | gzip -1 >"$tarball.part"
    mv "$tarball.part" "$tarball"
    # drop tarballs of other package lists
    find "$cache_dir" -maxdepth 1 -name "rootfs-${suite}-*.tar.gz" ! -name "$(basename "$tarball")" -delete
    cleanup
    trap - EXIT
else
    say "using cached rootfs $tarball"
fi

say "docker import -> $tag"
docker import \
    --change "LABEL org.atropos.base-key=${key}" \
    --change "LABEL org.atropos.base-suite=${suite}" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$tag" <"$tarball" >/dev/null
size="$(docker image inspect --format '{{.Size}}' "$tag")"
say "done: $tag ($((size / 1000000)) MB)"
