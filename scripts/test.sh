#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine (as root) and run it:
# system packages, venv, Docker engine + sandbox image, then lint, types and pytest.
# In CI (CI=true) the Docker tests must run: a missing engine fails the run instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1

bash scripts/setup.sh --dev
# chromium: the status page test; skopeo + docker-registry: registry references against a registry
# the test serves on loopback (tests/test_image_registry.py)
test_pkgs=()
command -v chromium >/dev/null 2>&1 || test_pkgs+=(chromium)
command -v skopeo >/dev/null 2>&1 || test_pkgs+=(skopeo)
[[ -x /usr/bin/docker-registry ]] || test_pkgs+=(docker-registry)
if ((${#test_pkgs[@]})) && [[ "$(id -u)" -eq 0 ]]; then
    echo "[test] installing ${test_pkgs[*]} (tests only)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${test_pkgs[@]}" >/dev/null
fi
if ! bash scripts/build_image.sh; then
    if [[ "${CI:-}" == "true" ]]; then
        echo "[test] the Docker engine or image could not be set up; CI needs them" >&2
        exit 1
    fi
    echo "[test] Docker unavailable: Docker tests will be skipped" >&2
fi

echo "[test] model server (prebuilt llama.cpp + the model, fetched once, cached under ~/.cache/atropos-sandbox)" >&2
python3 scripts/model_server.py ensure

echo "[test] ruff" >&2
.venv/bin/ruff check atropos tests benchmarks scripts
echo "[test] mypy" >&2
.venv/bin/mypy
# Two workers (pytest-xdist), a test file each at a time: most of the suite waits on sandboxes, engines
# and model replies rather than computing, so two files at once use the 2 cores the one process left idle.
# A module's fixtures (its hosts, pools, clusters) stay in one worker. ATROPOS_TEST_WORKERS=0: one process.
# Files go out longest first (tests/file_order.py, tests/durations.json): --no-loadscope-reorder keeps
# that order (pytest-xdist's own puts the files with most tests first, so the few-test files that take
# minutes ran last, on one worker, while the other waited).
# Every run leaves its per-test times in results/pytest-junit.xml (ignored by git): the table that
# orders the files is rebuilt from a full run's with scripts/test_durations.py.
workers="${ATROPOS_TEST_WORKERS:-2}"
mkdir -p results
junit=(--junitxml=results/pytest-junit.xml)
echo "[test] pytest ($workers workers)" >&2
# whether the suite waits or computes (more workers help only the first): the CPU its processes used
# (those reaped: not the Docker engine's containers), printed beside the wall time when pytest ends
pytest_start=$SECONDS
trap 'echo "[test] pytest wall $((SECONDS - pytest_start)) s; CPU user/system of this shell, then of its reaped children:" >&2; times >&2' EXIT
if [[ "$workers" == "0" ]]; then
    .venv/bin/python -m pytest -q -ra --durations=15 "${junit[@]}" "$@"
else
    .venv/bin/python -m pytest -q -ra --durations=15 "${junit[@]}" -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
