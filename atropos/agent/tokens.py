"""Tokens and masks for training from a finished conversation, with the tokenizer's chat template.

Used when the inference server cannot return token ids (OpenAI-compatible servers such as
llama.cpp); with vLLM/SGLang the env uses atroposlib's ManagedServer instead. Assistant turns are
trainable (their content and end-of-turn token), everything else is masked with -100.

We render the whole conversation once, find the character spans of each assistant reply by
rendering prefixes (the text before a reply is the rendering of the earlier messages with the
generation prompt), and tokenize the full text with offsets: so ``decode(tokens)`` is exactly the
rendered conversation, with no artefacts at turn boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from atropos.errors import ConfigError

IGNORE = -100


@dataclass
class TokenizedTrajectory:
    tokens: list[int]
    masks: list[int]
    text: str
    trainable_spans: list[tuple[int, int]]


def render(tokenizer: Any, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False,
           tools: list[dict[str, Any]] | None = None) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(list(messages), **kwargs)
    if not isinstance(text, str):
        raise ConfigError("apply_chat_template(tokenize=False) did not return text (transformers>=5?)")
    return text


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, Any]], *,
                          tools: list[dict[str, Any]] | None = None) -> TokenizedTrajectory:
    full = render(tokenizer, messages, tools=tools)
    eos = getattr(tokenizer, "eos_token", None) or ""
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools) if i else ""
        upto = render(tokenizer, messages[: i + 1], tools=tools)
        if not full.startswith(upto) or not upto.startswith(before):
            raise ConfigError(
                "the chat template does not render conversations as growing prefixes; "
                "cannot locate assistant turns for masking"
            )
        start, end = len(before), len(upto)
        reply = upto[start:end]
        if eos and eos in reply:  # train the end-of-turn token, not the template's glue after it
            end = start + reply.rindex(eos) + len(eos)
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    tokens = [int(t) for t in enc["input_ids"]]
    masks = []
    for tok, (a, b) in zip(tokens, enc["offset_mapping"], strict=True):
        trainable = any(a >= s and b <= e and b > a for s, e in spans)
        masks.append(tok if trainable else IGNORE)
    return TokenizedTrajectory(tokens=tokens, masks=masks, text=full, trainable_spans=spans)


TOOL_RESPONSE_OPEN = "<tool_response>"
_PROBE = "atropos-probe-7f3a"


def template_wraps_tool_responses(tokenizer: Any) -> bool:
    """Whether the chat template itself wraps a ``tool`` message in ``<tool_response>`` tags.

    Hermes/Qwen-style templates do; plain ChatML ones (SmolLM2) render the role as is. The agent
    wraps tool output by hand only in the second case, so the model never sees the tags twice.
    """
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}, {"role": "tool", "content": _PROBE, "tool_call_id": "c",
                                                     "name": "t"}]
    try:
        text = render(tokenizer, probe)
    except Exception:  # a template that rejects the tool role: the text we send must carry the tags
        return False
    at = text.find(_PROBE)
    return at >= 0 and TOOL_RESPONSE_OPEN in text[max(0, at - 64):at]


def count_prompt_tokens(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> int:
    """Tokens of the prompt the next model turn would see (the conversation plus the generation prompt)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])
