#!/usr/bin/env bash
# The main job on a fresh Debian/Ubuntu machine (as root), on the embedded default (local backend):
# set up everything (system packages, venv, the real model server — built once, cached under
# ~/.cache/atropos-sandbox), then run the coding environment in Atropos `process` mode for a few
# groups and print a summary. Extra arguments go to the env (e.g. --env.total_steps 5).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1

bash scripts/setup.sh
python3 scripts/model_server.py ensure          # shows progress while llama.cpp builds (first run only)
port="${ATROPOS_MODEL_PORT:-8090}"
python3 scripts/model_server.py start --port "$port"
trap 'python3 scripts/model_server.py stop --port "$port" >/dev/null 2>&1 || true' EXIT

mkdir -p results
out="results/coding-$(date +%Y%m%d-%H%M%S).jsonl"
.venv/bin/python -m atropos.envs.examples.coding process \
    --openai.base_url "http://127.0.0.1:${port}/v1" \
    --env.total_steps 3 --env.group_size 4 \
    --env.data_path_to_save_groups "$out" "$@"
echo "[demo] rollouts are in $out (and the matching .html)"
