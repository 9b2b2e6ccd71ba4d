"""The agent loop: ask the model, run the tool calls it makes, feed results back, until it answers."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from atropos.agent.parsing import ParsedCall, parse_hermes, parse_openai
from atropos.tools.executor import AgentToolCall, ToolOutcome

HERMES_SYSTEM = """You are a function calling AI model. You are provided with function signatures within \
<tools></tools> XML tags. You may call one or more functions to assist with the user query. Don't make \
assumptions about what values to plug into functions. Here are the available tools:
<tools>
{tools}
</tools>
For each function call return a json object with function name and arguments within <tool_call></tool_call> \
XML tags as follows:
<tool_call>
{{"name": <function-name>, "arguments": <args-dict>}}
</tool_call>
When you are done, answer without any tool call."""


class AgentConfig(BaseModel):
    max_steps: int = Field(20, ge=1)
    temperature: float = Field(0.7, ge=0)
    max_tokens: int | None = Field(1024, ge=1)
    max_context_tokens: int | None = Field(
        None, ge=1, description="stop before a turn whose prompt tokens + max_tokens would exceed this "
                                "(the trainer's max_token_length); needs a token counter")
    wrap_tool_responses: bool = Field(
        True, description="wrap tool output in <tool_response> tags (off when the chat template adds them)")


class ChatReply(BaseModel):
    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    logprobs: list[float] | None = None


class StepRecord(BaseModel):
    calls: int
    errors: int
    model_s: float
    tools_s: float


Finish = Literal["final", "max_steps", "context_budget"]


class AgentResult(BaseModel):
    messages: list[dict[str, Any]]
    final_response: str
    finish: Finish
    steps: list[StepRecord] = Field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    parse_errors: int = 0
    completion_logprobs: list[list[float] | None] = Field(default_factory=list)

    @property
    def sandbox_seconds(self) -> float:
        return sum(s.tools_s for s in self.steps)


ChatFn = Callable[[list[dict[str, Any]]], Awaitable[ChatReply]]
ToolsFn = Callable[[list[AgentToolCall]], Awaitable[list[ToolOutcome]]]
CountFn = Callable[[list[dict[str, Any]]], int]


def hermes_system_prompt(tool_schemas: list[dict[str, Any]], preamble: str = "") -> str:
    body = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tool_schemas))
    return f"{preamble.strip()}\n\n{body}" if preamble.strip() else body


def assistant_turns(messages: list[dict[str, Any]]) -> int:
    """How many model turns the conversation already holds."""
    return sum(1 for m in messages if m.get("role") == "assistant")


def hermes_text(calls: list[dict[str, Any]]) -> str:
    """OpenAI ``tool_calls`` as the Hermes text a model would have written (one representation for training)."""
    out = []
    for tc in calls:
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = args
        out.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": parsed}) + "\n</tool_call>")
    return "\n".join(out)


def tool_message(call_id: str, name: str, content: str, *, wrap: bool = True) -> dict[str, Any]:
    """A tool result in the tool role. ``wrap=False`` when the chat template adds the
    ``<tool_response>`` tags itself (Hermes/Qwen templates), else the model would see them twice."""
    body = f"<tool_response>\n{content}\n</tool_response>" if wrap else content
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": body}


async def run_agent(chat: ChatFn, run_tools: ToolsFn, messages: list[dict[str, Any]],
                    cfg: AgentConfig, count_tokens: CountFn | None = None) -> AgentResult:
    """Run until the model answers without a tool call, ``max_steps`` model turns, or (with
    ``cfg.max_context_tokens`` and ``count_tokens``) until the next turn would not fit the context
    budget: a sequence longer than the trainer's limit is dropped whole, so it is better to stop."""
    messages = list(messages)
    result = AgentResult(messages=messages, final_response="", finish="max_steps")
    for _ in range(cfg.max_steps):
        if cfg.max_context_tokens is not None and count_tokens is not None:
            if count_tokens(messages) + (cfg.max_tokens or 0) > cfg.max_context_tokens:
                result.finish = "context_budget"
                break
        t0 = time.perf_counter()
        reply = await chat(messages)
        model_s = time.perf_counter() - t0
        if reply.tool_calls:
            text = "\n".join(p for p in (reply.text.strip(), hermes_text(reply.tool_calls)) if p)
            parsed = parse_openai({"content": reply.text, "tool_calls": reply.tool_calls})
        else:
            text = reply.text
            parsed = parse_hermes(text)
        messages.append({"role": "assistant", "content": text})
        result.completion_logprobs.append(reply.logprobs)
        if parsed.is_final:
            result.final_response = parsed.content
            result.finish = "final"
            result.steps.append(StepRecord(calls=0, errors=0, model_s=model_s, tools_s=0.0))
            break
        t1 = time.perf_counter()
        outcomes = await run_tools([_agent_call(c) for c in parsed.calls]) if parsed.calls else []
        tools_s = time.perf_counter() - t1
        for outcome in outcomes:
            messages.append(tool_message(outcome.call_id, outcome.name, outcome.content,
                                         wrap=cfg.wrap_tool_responses))
            result.tool_calls += 1
            result.tool_errors += 0 if outcome.ok else 1
        for error in parsed.errors:
            messages.append(tool_message("invalid", "invalid_tool_call", (
                f"error: {error}. Write calls exactly as "
                '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'), wrap=cfg.wrap_tool_responses))
            result.parse_errors += 1
        result.steps.append(StepRecord(calls=len(outcomes), errors=len(parsed.errors), model_s=model_s,
                                       tools_s=tools_s))
    result.messages = messages
    return result


def _agent_call(call: ParsedCall) -> AgentToolCall:
    return AgentToolCall(id=call.id, name=call.name, arguments=call.arguments)
