"""In-process scripted policies: atroposlib ``APIServer`` subclasses whose replies come from code.

Give an env a ``server_cls`` made by :func:`scripted_server` (or subclass :class:`ScriptedServer`
and implement ``respond``) and :func:`server_configs`; its rollouts then run real tool calls in
real slots with no model and no network. For the ManagedServer path (servers that return token
ids) subclass :class:`ScriptedTokenServer` and use :func:`token_server_configs`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from atroposlib.envs.base import APIServerConfig
from atroposlib.envs.server_handling.server_baseline import APIServer
from openai.types.chat import ChatCompletion

from atropos.agent.loop import assistant_turns

__all__ = ["Policy", "ScriptedServer", "ScriptedTokenServer", "answer", "by_turn", "call", "call_text",
           "logprob_of", "reply", "scripted_server", "server_configs", "token_server_configs", "tool_call"]

# A policy maps the conversation so far to the next assistant message: its text (a Hermes
# ``<tool_call>`` block or a final answer; see ``tool_call``/``answer``).
Policy = Callable[[list[dict[str, Any]]], "str | Awaitable[str]"]


def tool_call(name: str, /, **arguments: Any) -> str:
    """The text of one Hermes tool call, as a model would write it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def answer(text: str) -> str:
    """A final answer (no tool call): the rollout ends and is scored."""
    return text


def by_turn(*turns: str) -> Callable[[list[dict[str, Any]]], str]:
    """A policy replying ``turns[k]`` on the k-th assistant turn (the last one again after that)."""
    if not turns:
        raise ValueError("by_turn needs at least one reply")

    def policy(messages: list[dict[str, Any]]) -> str:
        return turns[min(assistant_turns(messages), len(turns) - 1)]

    return policy


def reply(text: str) -> ChatCompletion:
    """A chat completion whose message is ``text``."""
    return ChatCompletion.model_validate({
        "id": "scripted", "object": "chat.completion", "created": int(time.time()), "model": "scripted",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
    })


call_text = tool_call


def call(name: str, **arguments: Any) -> ChatCompletion:
    """A chat completion holding one Hermes tool call."""
    return reply(tool_call(name, **arguments))


def server_configs(model_name: str = "scripted") -> list[APIServerConfig]:
    """Server configs for a scripted ``server_cls`` (the URL is never contacted)."""
    return [APIServerConfig(model_name=model_name, base_url="http://127.0.0.1:9/v1", api_key="x",
                            health_check=False)]


def token_server_configs() -> list[APIServerConfig]:
    """Server configs for a :class:`ScriptedTokenServer` (``server_type`` vllm: the ManagedServer path)."""
    return [APIServerConfig(model_name="scripted", base_url="http://127.0.0.1:9/v1", api_key="x",
                            health_check=False, server_type="vllm")]


class ScriptedServer(APIServer):
    """An inference server answered by ``respond(messages)``; override it, or use :func:`scripted_server`."""

    async def check_server_status_task(self, chat_completion: bool = True) -> None:
        self.server_healthy = True

    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        return await self.respond(kwargs["messages"])

    async def respond(self, messages: list[dict[str, Any]]) -> ChatCompletion:
        raise NotImplementedError


def scripted_server(policy: Policy) -> type[ScriptedServer]:
    """A ``server_cls`` for an env whose every model turn is ``policy(messages)``."""

    class PolicyServer(ScriptedServer):
        async def respond(self, messages: list[dict[str, Any]]) -> ChatCompletion:
            out = policy(messages)
            text = await out if not isinstance(out, str) else out
            return reply(text)

    return PolicyServer


def logprob_of(token: int) -> float:
    """The scripted 'sampling' logprob of a token: distinct per token, so alignment is checkable."""
    return -round(0.01 * (1 + token % 97), 4)


class ScriptedTokenServer(ScriptedServer):
    """Answers like vLLM's /generate (``server_type`` vllm): token ids and logprobs, the path
    atroposlib's ManagedServer takes. The prompt arrives as ``input_ids``; the reply text comes
    from ``respond_text(prompt)`` and is returned as its ids plus the EOS id, as a real server does.
    Set ``tokenizer`` on the subclass. Chat completions are refused: the managed path must not use them."""

    tokenizer: Any = None
    token_calls: list[int]  # set per subclass: prompt lengths seen

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
        ids = [int(t) for t in kwargs["input_ids"]]
        n = int(kwargs.get("n", 1))
        self.token_calls.append(len(ids))
        text = await self.respond_text(self.tokenizer.decode(ids))
        out = [*self.tokenizer.encode(text, add_special_tokens=False), int(self.tokenizer.eos_token_id)]
        return ids, [out] * n, [[logprob_of(t) for t in out]] * n, ["stop"] * n

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        raise AssertionError("a token-id server's rollouts must go through ManagedServer")

    async def respond_text(self, prompt: str) -> str:
        raise NotImplementedError
