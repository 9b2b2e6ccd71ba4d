"""Parse tool calls out of model output: Hermes ``<tool_call>{json}</tool_call>`` text and OpenAI ``tool_calls``.

A malformed call is never dropped silently (which would turn the turn into a "final answer"): it
becomes a ``ParseError`` that the loop answers with an error observation. Calls written inside a
reasoning block (``<think>…</think>``) are thoughts, not actions, and are not run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class ParseResult:
    calls: list[ParsedCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""  # the text without tool-call blocks and reasoning

    @property
    def is_final(self) -> bool:
        """No call and nothing malformed: the model gave its answer."""
        return not self.calls and not self.errors


def strip_reasoning(text: str) -> str:
    return _THINK.sub("", text)


def _call_from_obj(obj: Any, index: int, call_id: str | None = None) -> ParsedCall | str:
    if not isinstance(obj, dict):
        return f"tool call #{index + 1}: expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call #{index + 1}: missing \"name\""
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            return f"tool call #{index + 1} ({name}): \"arguments\" is a string that is not JSON: {exc}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"tool call #{index + 1} ({name}): \"arguments\" must be an object"
    return ParsedCall(id=call_id or f"call_{index}", name=name, arguments=args)


def parse_hermes(text: str) -> ParseResult:
    """Find every ``<tool_call>`` block outside reasoning blocks, in one left-to-right scan.

    JSON-aware: ``</tool_call>`` or ``<think>`` inside a call's JSON strings is data, not markup.
    """
    visible = text
    result = ParseResult()
    decoder = json.JSONDecoder()
    pieces: list[str] = []
    pos = 0
    index = 0
    while True:
        start = visible.find(OPEN, pos)
        think = visible.find(THINK_OPEN, pos)
        if think >= 0 and (start < 0 or think < start):
            pieces.append(visible[pos:think])  # a thought: skipped whole, calls in it are not run
            close = visible.find(THINK_CLOSE, think)
            pos = len(visible) if close < 0 else close + len(THINK_CLOSE)
            continue
        if start < 0:
            pieces.append(visible[pos:])
            break
        pieces.append(visible[pos:start])
        body = start + len(OPEN)
        while body < len(visible) and visible[body].isspace():
            body += 1
        try:
            obj, end = decoder.raw_decode(visible, body)
        except json.JSONDecodeError as exc:
            close = visible.find(CLOSE, body)
            result.errors.append(f"tool call #{index + 1}: malformed JSON ({exc.msg} at char {exc.pos - body})")
            index += 1
            if close < 0:
                break
            pos = close + len(CLOSE)
            continue
        rest = end
        while rest < len(visible) and visible[rest].isspace():
            rest += 1
        if not visible.startswith(CLOSE, rest):
            result.errors.append(f"tool call #{index + 1}: missing {CLOSE} after the JSON")
            index += 1
            pos = rest
            continue
        call = _call_from_obj(obj, index)
        if isinstance(call, str):
            result.errors.append(call)
        else:
            result.calls.append(call)
        index += 1
        pos = rest + len(CLOSE)
    if CLOSE in "".join(pieces) and not result.calls and not result.errors:
        result.errors.append(f"found {CLOSE} without a matching {OPEN}")
    result.content = "".join(pieces).strip()
    return result


def parse_openai(message: dict[str, Any]) -> ParseResult:
    """From an OpenAI chat message with ``tool_calls`` (arguments are JSON strings there)."""
    result = ParseResult(content=strip_reasoning(str(message.get("content") or "")).strip())
    for i, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            result.errors.append(f"tool call #{i + 1}: expected an object with a \"function\" object")
            continue
        call = _call_from_obj({"name": fn.get("name"), "arguments": fn.get("arguments")}, i, str(tc.get("id") or ""))
        if isinstance(call, str):
            result.errors.append(call)
        else:
            result.calls.append(call)
    if not result.calls and not result.errors:
        hermes = parse_hermes(str(message.get("content") or ""))
        if hermes.calls or hermes.errors:
            return hermes
    return result
