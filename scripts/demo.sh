#!/usr/bin/env bash
# Set up a fresh machine (as root) and run the main job on the embedded default (local backend).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
bash scripts/setup.sh
exec .venv/bin/python -m atropos.demo "$@"
