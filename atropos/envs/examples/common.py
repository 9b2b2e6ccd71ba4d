"""Settings shared by the example environments: where the model server and its tokenizer are."""

from __future__ import annotations

import os
from typing import Any

from atropos.envs.config import MODEL_NAME_ENV, MODEL_URL_ENV, default_server_configs

__all__ = ["MODEL_NAME_ENV", "MODEL_URL_ENV", "TOKENIZER_ENV", "server_configs", "tokenizer_dir"]

TOKENIZER_ENV = "ATROPOS_TOKENIZER_DIR"


def server_configs() -> list[Any]:
    """The examples' server: the local SmolLM2 llama.cpp server unless the environment says otherwise."""
    return default_server_configs("SmolLM2-135M-Instruct", "http://127.0.0.1:8090/v1", num_max_requests_at_once=8)


def tokenizer_dir() -> str:
    """A local tokenizer directory (never a hub name: runs are offline)."""
    path = os.environ.get(TOKENIZER_ENV)
    if path:
        return path
    from atropos.agent.model import ensure_tokenizer_dir

    return str(ensure_tokenizer_dir())
