"""Exact tokens, masks and logprobs from atroposlib's ManagedServer (inference servers that return token ids).

This is the only module that knows ManagedServer's node semantics (atroposlib 0.4.0, see
docs/atroposlib.md), so a change upstream is fixed here and tested here.

One ``ManagedSession`` per rollout, opened inside ``ServerManager.managed_server(tokenizer=...)``.
Each turn is one ``chat_completion(n=1)``; ManagedServer renders the prompt with the chat template
and, when the prompt text starts with the tracked node's text, extends that node (earlier
completions stay trainable, the new tool/user text is masked). At the end exactly one node must
remain: its tokens are the sampled ids, its masks cover every completion, its logprobs are the
server's (1.0 where masked).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from atropos.agent.errors import TokenTrackingError
from atropos.agent.loop import ChatReply
from atropos.agent.tokens import IGNORE

TOKEN_ID_SERVER_TYPES = frozenset({"vllm", "sglang"})  # trl and openai raise NotImplementedError for token ids


def servers_give_token_ids(servers: Iterable[Any]) -> bool:
    """Whether every configured inference server can return token ids (``server_type`` vllm or sglang)."""
    types = [getattr(getattr(s, "config", None), "server_type", None) for s in servers]
    return bool(types) and all(t in TOKEN_ID_SERVER_TYPES for t in types)


@dataclass
class TrackedSequence:
    tokens: list[int]
    masks: list[int]
    logprobs: list[float]


class ManagedSession:
    """A rollout's turns through one ManagedServer context."""

    def __init__(self, managed: Any, tokenizer: Any) -> None:
        self.managed = managed
        self.tokenizer = tokenizer
        self.eos: str = getattr(tokenizer, "eos_token", None) or ""
        self.turns = 0

    def _nodes(self) -> list[Any]:
        return list(self.managed.get_state()["nodes"])

    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> ChatReply:
        completion = await self.managed.chat_completion(messages=messages, n=1, **kwargs)
        self.turns += 1
        choice = completion.choices[0]
        returned = choice.message.content or ""
        nodes = self._nodes()
        if len(nodes) != 1:
            # Extension failed (see tracked()); the text is still the model's answer for the loop.
            return ChatReply(text=self._strip_eos(returned), finish_reason=choice.finish_reason or "stop")
        node = nodes[0]
        out_ids = _trailing_trainable(node.masked_tokens)
        # ManagedServer decodes with skip_special_tokens=True unless its vLLM tool translator is
        # active, so the returned text (and the node's text) lose the EOS the model sampled and any
        # tool tag that is a special token. The next prompt re-renders that EOS as text, the suffix
        # re-tokenises it, and the context holds it twice (reference §3.4). Rebuilding the node's
        # text from the sampled ids makes it hold exactly what its tokens hold.
        raw = self.tokenizer.decode(out_ids, skip_special_tokens=False)
        if not node.full_text.endswith(returned):
            raise TokenTrackingError("ManagedServer's node text does not end with the completion it returned")
        node.full_text = node.full_text[: len(node.full_text) - len(returned)] + raw
        logprobs = [float(x) for x in node.logprobs[len(node.logprobs) - len(out_ids):]] if out_ids else []
        return ChatReply(text=self._strip_eos(raw), finish_reason=choice.finish_reason or "stop", logprobs=logprobs)

    def _strip_eos(self, text: str) -> str:
        # The template adds the end-of-turn token itself when it renders the assistant message.
        return text[: -len(self.eos)] if self.eos and text.endswith(self.eos) else text

    def tracked(self) -> TrackedSequence:
        """The rollout's one sequence; call inside the ``managed_server`` block (state resets on exit)."""
        nodes = self._nodes()
        if len(nodes) != 1:
            raise TokenTrackingError(
                f"expected 1 tracked sequence after {self.turns} turn(s), ManagedServer has {len(nodes)}: the "
                "chat template renders earlier turns differently from the generated text, so a turn started a "
                "new sequence")
        node = nodes[0]
        if not (len(node.tokens) == len(node.masked_tokens) == len(node.logprobs)):
            raise TokenTrackingError("ManagedServer node has tokens, masks and logprobs of different lengths")
        return TrackedSequence(tokens=[int(t) for t in node.tokens], masks=[int(m) for m in node.masked_tokens],
                               logprobs=[float(x) for x in node.logprobs])


def _trailing_trainable(masked: list[int]) -> list[int]:
    """The last completion's ids: the run of unmasked positions at the end of the node (a new
    prompt suffix is always masked and never empty, so the run stops at the completion's start)."""
    i = len(masked)
    while i > 0 and masked[i - 1] != IGNORE:
        i -= 1
    return [int(t) for t in masked[i:]]
