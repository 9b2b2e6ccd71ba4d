#!/usr/bin/env bash
# The main job on a fresh Debian/Ubuntu machine (as root), on the embedded default (local backend):
# set up everything (system packages, venv, the real model server: SmolLM2-135M-Instruct on a prebuilt
# llama.cpp, no compiler, fetched while the venv installs and cached under ~/.cache/atropos-sandbox),
# then run the coding environment in Atropos `process` mode for a few groups and print a summary.
# Extra arguments go to the env (e.g. --env.total_steps 5). ATROPOS_MODEL_ENGINE=compiled serves with
# llama-cpp-python built from source instead (scripts/model_server.py; `ensure --engine compiled
# --background` builds it detached).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1

bash scripts/setup.sh --system-only             # python3-venv and the sandbox's packages first
mkdir -p results
model_log="results/model-ensure.log"
engine="${ATROPOS_MODEL_ENGINE:-auto}"
python3 scripts/model_server.py ensure --engine "$engine" >"$model_log" 2>&1 &
model_pid=$!
bash scripts/setup.sh
if ! wait "$model_pid"; then
    echo "[demo] fetching the model server failed; $model_log says:" >&2
    tail -n 40 "$model_log" >&2
    exit 1
fi
port="${ATROPOS_MODEL_PORT:-8090}"
python3 scripts/model_server.py start --port "$port" --engine "$engine"
trap 'python3 scripts/model_server.py stop --port "$port" >/dev/null 2>&1 || true' EXIT

out="results/coding-$(date +%Y%m%d-%H%M%S).jsonl"
.venv/bin/python -m atropos.envs.examples.coding process \
    --openai.base_url "http://127.0.0.1:${port}/v1" \
    --env.total_steps 3 --env.group_size 4 \
    --env.data_path_to_save_groups "$out" "$@"
echo "[demo] rollouts are in $out (and the matching .html)"
