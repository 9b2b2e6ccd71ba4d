"""Scripted policies for env tests: an atroposlib APIServer subclass whose replies come from code.

Subclass ``ScriptedServer`` and implement ``respond(messages) -> ChatCompletion`` (with ``reply`` and
``call``); give the class to an env as ``server_cls``. No network, no model.
"""

from __future__ import annotations

import json
import time
from typing import Any

from atroposlib.envs.base import APIServerConfig
from atroposlib.envs.server_handling.server_baseline import APIServer
from openai.types.chat import ChatCompletion


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
