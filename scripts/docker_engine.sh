#!/usr/bin/env bash
# Make sure a Docker engine answers `docker info`.
#
# Idempotent: does nothing when the engine already works. Otherwise installs Debian's docker.io
# (only if dockerd is missing), starts dockerd in the background (log: /var/log/dockerd.log) and waits
# until `docker info` succeeds. Needs root for the install/start path. Non-interactive (CI=true, no stdin).
#
# Environment:
#   DOCKER_ENGINE_TIMEOUT  seconds to wait for the engine (default 60)
#   DOCKERD_LOG            dockerd log file (default /var/log/dockerd.log)
set -euo pipefail

timeout_s="${DOCKER_ENGINE_TIMEOUT:-60}"
log_file="${DOCKERD_LOG:-/var/log/dockerd.log}"

say() { printf '[docker_engine] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

engine_ok() { docker info >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && engine_ok; then
    say "engine already running"
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    die "docker engine not reachable and not root: cannot install/start dockerd (run as root, or start Docker yourself)"
fi

export DEBIAN_FRONTEND=noninteractive
apt_install() {
    # apt-get update once if the package is unknown to the local lists
    if ! apt-cache show "$@" >/dev/null 2>&1; then
        say "apt-get update"
        apt-get update -qq </dev/null
    fi
    say "apt-get install $*"
    apt-get install -y -qq --no-install-recommends "$@" </dev/null >/dev/null \
        || { apt-get update -qq </dev/null && apt-get install -y -qq --no-install-recommends "$@" </dev/null >/dev/null; }
}

if ! command -v dockerd >/dev/null 2>&1; then
    # docker.io brings dockerd, containerd, runc, tini (docker-init) and a docker CLI.
    # iptables is needed for the default bridge network.
    apt_install docker.io iptables
fi
command -v dockerd >/dev/null 2>&1 || die "dockerd still missing after installing docker.io"
command -v docker >/dev/null 2>&1 || die "docker CLI missing"

# A stale pid file from a dead daemon blocks a new start.
pid_file=/var/run/docker.pid
if [[ -f "$pid_file" ]]; then
    old_pid="$(cat "$pid_file" 2>/dev/null || true)"
    if [[ -n "$old_pid" ]] && kill -0 "$old_pid" 2>/dev/null; then
        say "dockerd already running as pid $old_pid; waiting for it"
    else
        say "removing stale $pid_file"
        rm -f "$pid_file"
    fi
fi

if ! [[ -f "$pid_file" ]]; then
    mkdir -p "$(dirname "$log_file")"
    say "starting dockerd (log: $log_file)"
    # setsid + nohup: the daemon must outlive this script and any CI step's process group.
    setsid nohup dockerd >>"$log_file" 2>&1 </dev/null &
    disown || true
fi

deadline=$((SECONDS + timeout_s))
until engine_ok; do
    if ((SECONDS >= deadline)); then
        say "last lines of $log_file:"
        tail -n 20 "$log_file" >&2 || true
        die "docker engine did not answer 'docker info' within ${timeout_s}s"
    fi
    sleep 1
done
say "engine ready ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
