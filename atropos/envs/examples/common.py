"""Settings shared by the example environments: where the model server and its tokenizer are."""

from __future__ import annotations

import os
from typing import Any

MODEL_URL_ENV = "ATROPOS_MODEL_URL"
TOKENIZER_ENV = "ATROPOS_TOKENIZER_DIR"
MODEL_NAME_ENV = "ATROPOS_MODEL_NAME"


def server_configs() -> list[Any]:
    """One OpenAI-compatible server, as a LIST (a bare config makes atroposlib ignore --openai.*)."""
    from atroposlib.envs.base import APIServerConfig

    return [APIServerConfig(
        model_name=os.environ.get(MODEL_NAME_ENV, "SmolLM2-135M-Instruct"),
        base_url=os.environ.get(MODEL_URL_ENV, "http://127.0.0.1:8090/v1"),
        api_key="local", server_type="openai", timeout=120, health_check=False, num_max_requests_at_once=8,
    )]


def tokenizer_dir() -> str:
    """A local tokenizer directory (never a hub name: runs are offline)."""
    path = os.environ.get(TOKENIZER_ENV)
    if path:
        return path
    from atropos.agent.model import ensure_tokenizer_dir

    return str(ensure_tokenizer_dir())
