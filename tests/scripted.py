"""Scripted policies for env tests: an atroposlib APIServer subclass whose replies come from code.

Subclass ``ScriptedServer`` and implement ``respond(messages) -> ChatCompletion`` (with ``reply`` and
``call``); give the class to an env as ``server_cls``. For the ManagedServer path (servers that
return token ids), subclass ``ScriptedTokenServer`` with ``respond_text(prompt) -> str`` and use
``token_server_configs()`` (``server_type="vllm"``). No network, no model.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, ClassVar

from atroposlib.envs.base import APIServerConfig
from atroposlib.envs.server_handling.server_baseline import APIServer
from openai.types.chat import ChatCompletion

from atropos.envs.agent_env import AgentEnv


def reply(text: str) -> ChatCompletion:
    return ChatCompletion.model_validate({
        "id": "scripted", "object": "chat.completion", "created": int(time.time()), "model": "scripted",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
    })


def call_text(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def call(name: str, **arguments: Any) -> ChatCompletion:
    return reply(call_text(name, **arguments))


def server_configs() -> list[APIServerConfig]:
    return [APIServerConfig(model_name="scripted", base_url="http://127.0.0.1:9/v1", api_key="x",
                            health_check=False)]


class ScriptedServer(APIServer):
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


class RecordsPoolStatus(AgentEnv):
    """Mixin (list it before the env class): writes the pool's real status (``SlotPool.status()``) as JSON
    to the file named by the environment variable ``pool_status_env`` right before the pool stops."""

    pool_status_env: ClassVar[str]

    async def shutdown_sandbox(self) -> None:
        path = os.environ.get(self.pool_status_env)
        if path and self.pool is not None:
            with open(path, "w") as fh:
                fh.write(self.pool.status().model_dump_json())
        await super().shutdown_sandbox()


def token_server_configs() -> list[APIServerConfig]:
    return [APIServerConfig(model_name="scripted", base_url="http://127.0.0.1:9/v1", api_key="x",
                            health_check=False, server_type="vllm")]
