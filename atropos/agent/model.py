"""Where the project's real small model (SmolLM2-135M-Instruct GGUF) and its tokenizer live."""

from __future__ import annotations

from pathlib import Path

from atropos.agent.gguf_tokenizer import cache_root, load_tokenizer, saved_tokenizer_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # kept in step with scripts/model_server.py


def default_gguf_path() -> Path:
    return cache_root() / "models" / GGUF_NAME


def ensure_tokenizer_dir(gguf: Path | None = None) -> Path:
    """A saved Hugging Face tokenizer directory for the GGUF (built on first use, offline)."""
    gguf = gguf or default_gguf_path()
    if not gguf.exists():
        raise FileNotFoundError(f"{gguf} is missing: run `python3 scripts/model_server.py ensure` first")
    target = saved_tokenizer_dir(gguf)
    if not (target / "tokenizer_config.json").exists():
        load_tokenizer(gguf)
    return target
