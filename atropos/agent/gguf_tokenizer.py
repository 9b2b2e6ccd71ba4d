"""A Hugging Face tokenizer, chat template included, built offline from a GGUF file.

Why not ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``? Under transformers 4.57 it
(1) refuses to run without torch, although reading the tokenizer never touches a tensor, and
(2) for GGUF files whose tokenizer is byte-level BPE under a ``llama`` architecture (SmolLM2) it swaps
the special tokens: its ``GGUFLlamaConverter`` sets ``eos_token`` to the BOS token, so
``eos_token == "<|im_start|>"``, and leaves no pad token. It also drops SmolLM2's digit splitting.

So this module reads the GGUF metadata with the ``gguf`` package and assembles the same tokenizer as the
model's original ``tokenizer.json``: a byte-level BPE with the GGUF's vocabulary and merges, digits split
one by one before the GPT-2 pre-tokenizer regex (llama.cpp's ``smollm`` pre-tokenizer), the control
tokens as special tokens, and the GGUF's ``tokenizer.chat_template``. Its ids match llama.cpp's own
tokenizer (checked against the server's ``/extras/tokenize`` in the tests).

The result is saved with ``save_pretrained`` under
``${ATROPOS_SANDBOX_CACHE:-${XDG_CACHE_HOME:-~/.cache}/atropos-sandbox}/tokenizers/``, and later calls load
that copy (well under a second, no ``gguf`` import). The saved directory is a normal tokenizer directory:
pass it as ``tokenizer_name`` to atroposlib. Nothing here contacts the Hugging Face hub; it works with
``HF_HUB_OFFLINE=1``.

Needs ``transformers`` (atroposlib requires < 5), ``tokenizers``, ``jinja2`` (chat templates) and
``gguf`` (only for the first build).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["build_tokenizer_from_gguf", "cache_root", "load_tokenizer", "saved_tokenizer_dir"]

# Bump when the way the tokenizer is assembled changes, to invalidate saved copies.
_BUILDER_VERSION = 1

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) whose regexes are "each digit alone, then GPT-2".
_DIGIT_SPLIT_GPT2_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r"}
# Plain GPT-2 byte-level pre-tokenization.
_GPT2_PRE = {"gpt-2", "gpt2", "default"}

_GGUF_TOKEN_TYPE_CONTROL = 3
_GGUF_TOKEN_TYPE_USER_DEFINED = 4


def cache_root() -> Path:
    """Where saved tokenizers live (same root as ``scripts/model_server.py``'s cache)."""
    override = os.environ.get("ATROPOS_SANDBOX_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "atropos-sandbox"


def _transformers_major() -> str:
    import transformers

    return transformers.__version__.split(".", 1)[0]


def saved_tokenizer_dir(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory a tokenizer built from ``gguf_path`` is saved to.

    Keyed by the file's name, size and mtime, the builder version and the transformers major version
    (transformers 5 saves a format that 4.x cannot read).
    """
    p = Path(gguf_path).resolve()
    st = p.stat()
    key_src = f"{p.name}|{st.st_size}|{st.st_mtime_ns}|v{_BUILDER_VERSION}|tf{_transformers_major()}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "tokenizers"
    return root / f"{p.stem}-{key}"


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value: str, int/float/bool, or a list of those (decoded like ``ReaderField.contents()``,
    which only newer ``gguf`` releases have)."""
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None:
        return default

    def one(part_index: int, vtype: Any) -> Any:
        part = f.parts[part_index]
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if f.types[0] == GGUFValueType.ARRAY:
        return [one(i, f.types[-1]) for i in f.data]
    return one(f.data[0], f.types[0])


def build_tokenizer_from_gguf(gguf_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Build (without caching) a ``PreTrainedTokenizerFast`` from a GGUF's tokenizer metadata."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(gguf_path), "r")
    tok_model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if tok_model != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer.ggml.model={tok_model!r}; only byte-level BPE ('gpt2') is supported")
    if pre not in _DIGIT_SPLIT_GPT2_PRE | _GPT2_PRE:
        raise ValueError(f"{gguf_path}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}")

    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(_field(reader, "tokenizer.ggml.token_type", []))
    merges_raw: list[str] = list(_field(reader, "tokenizer.ggml.merges", []))
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]

    def tok_at(key: str) -> str | None:
        idx = _field(reader, key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = tok_at("tokenizer.ggml.bos_token_id"), tok_at("tokenizer.ggml.eos_token_id")
    unk, pad = tok_at("tokenizer.ggml.unknown_token_id"), tok_at("tokenizer.ggml.padding_token_id")
    chat_template = _field(reader, "tokenizer.chat_template")
    arch = _field(reader, "general.architecture", "")
    ctx_len = _field(reader, f"{arch}.context_length")

    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_GPT2_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)

    specials = [tokens[i] for i, t in enumerate(token_types) if t == _GGUF_TOKEN_TYPE_CONTROL]
    user_defined = [tokens[i] for i, t in enumerate(token_types) if t == _GGUF_TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if user_defined:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    kwargs: dict[str, Any] = {
        "tokenizer_object": backend,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [t for t in specials if t not in {bos, eos, unk, pad}],
    }
    if ctx_len:
        kwargs["model_max_length"] = int(ctx_len)
    tok = PreTrainedTokenizerFast(**kwargs)
    if chat_template:
        tok.chat_template = str(chat_template)
    return tok


def load_tokenizer(
    gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer (with chat template) of the model in ``gguf_path``; offline, cached on disk.

    The first call builds it from the GGUF and saves it (``save_pretrained``) under ``cache_dir``
    (default: ``<cache_root()>/tokenizers``); later calls load the saved copy. Either way the tokenizer
    returned is the one loaded back from the saved directory, so first and later loads behave alike.
    """
    from transformers import AutoTokenizer

    target = saved_tokenizer_dir(gguf_path, cache_dir)
    if not (target / "tokenizer_config.json").is_file():
        tok = build_tokenizer_from_gguf(gguf_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        try:
            tok.save_pretrained(str(tmp))
            (tmp / "gguf_source.json").write_text(
                json.dumps({"gguf": str(Path(gguf_path).resolve()), "builder_version": _BUILDER_VERSION}) + "\n"
            )
            try:
                os.replace(tmp, target)
            except OSError:
                # Another process saved it first (the target is a non-empty directory): use theirs.
                if not (target / "tokenizer_config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
