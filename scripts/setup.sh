#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine (as root) for atropos-sandbox: system packages and the venv.
# Idempotent and quiet when everything is already there. Usage: bash scripts/setup.sh [--dev | --system-only]
# --system-only: the system packages alone (scripts/demo.sh fetches the model while the venv installs).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*" >&2; }

# gcc, libc6-dev: slotd, the compiled slot supervisor (docs/native-supervisor.md), is built once per machine
APT_PACKAGES=(bubblewrap slirp4netns tmux libseccomp2 git procps util-linux ca-certificates python3 python3-venv gcc libc6-dev)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [[ "$(id -u)" -ne 0 ]]; then
        say "missing system packages: ${missing[*]} (run as root, or: sudo apt-get install ${missing[*]})"
        exit 1
    fi
    say "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Network slots get a private namespace from slirp4netns, run as the slot's own uid: it must open
# /dev/net/tun. udev gives the device mode 0666 on Debian/Ubuntu; machines without udev (VMs,
# containers) leave it 0600. Opening it grants nothing by itself (creating a device needs
# CAP_NET_ADMIN over the network namespace).
if [[ "$(id -u)" -eq 0 && -c /dev/net/tun && "$(stat -c %a /dev/net/tun)" != "666" ]]; then
    say "chmod 0666 /dev/net/tun (the udev default; slots' private networks need it)"
    chmod 0666 /dev/net/tun
fi

[[ "${1:-}" == "--system-only" ]] && exit 0

PY="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
extras="${1:-}"
spec=".[env]"
# the official swebench package grades SWE-bench rows beside our verdicts in the tests (tests/test_swebench.py)
[[ "$extras" == "--dev" ]] && spec=".[dev,env,swebench]"
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)${extras}"
# uv (a package installer on the registry pip uses) installs the same requirements in parallel and
# compiles no bytecode up front: the bulk of a fresh machine's wait for the README's main command
# (benchmarks/README.md, first_reply). ATROPOS_INSTALLER=pip keeps pip alone; if uv cannot be had or
# fails, pip does the install.
install_project() {
    if [[ "${ATROPOS_INSTALLER:-uv}" != "pip" ]]; then
        if [[ -x .venv/bin/uv ]] || .venv/bin/pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then
            .venv/bin/uv pip install -q --python .venv/bin/python -e "$spec" && return 0
            say "uv could not install the project; pip will"
        fi
    fi
    .venv/bin/pip install -q --disable-pip-version-check -e "$spec"
}
if [[ ! -f "$stamp" ]]; then
    say "installing the project into .venv ($spec)"
    install_project
    touch "$stamp"
fi
say "ready: $(.venv/bin/python -c 'import atropos; print("atropos-sandbox", atropos.__version__)')"
