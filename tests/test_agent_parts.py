"""AgentEnv's small parts without a pool: failure classification, config names, wandb default,
config_init, the context budget, tool-response wrapping and ManagedServer node checks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("atroposlib")

import aiohttp
import httpx
import openai
import tenacity
from atroposlib.envs.base import APIServerConfig

from atropos.agent.errors import InferenceUnavailable, TokenTrackingError, inference_failure, is_infrastructure
from atropos.agent.loop import AgentConfig, ChatReply, run_agent, tool_message
from atropos.agent.managed import ManagedSession, servers_give_token_ids
from atropos.agent.tokens import template_wraps_tool_responses
from atropos.envs.agent_env import AgentEnv
from atropos.envs.config import AgentEnvConfig, wandb_requested
from atropos.errors import HostUnavailable, LeaseError, SlotUnavailable, ToolInputError
from atropos.testing import call_text
from atropos.tools.executor import AgentToolCall, ToolOutcome

REQUEST = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")


def status_error(code: int) -> openai.APIStatusError:
    return openai.APIStatusError(f"status {code}", response=httpx.Response(code, request=REQUEST), body=None)


def retry_error(inner: BaseException) -> tenacity.RetryError:
    attempt = tenacity.Future(3)
    attempt.set_exception(inner)
    return tenacity.RetryError(attempt)


@pytest.mark.parametrize("exc", [
    HostUnavailable("gone"), SlotUnavailable("no slot in 1s"), LeaseError("stale"),
    openai.APIConnectionError(request=REQUEST), openai.APITimeoutError(request=REQUEST), status_error(503),
    status_error(429), httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), asyncio.TimeoutError(),
    aiohttp.ClientConnectionError("reset"), retry_error(openai.APIConnectionError(request=REQUEST)),
    retry_error(retry_error(status_error(500))), InferenceUnavailable("x"),
])
def test_platform_failures_are_infrastructure(exc: BaseException) -> None:
    assert is_infrastructure(exc)


@pytest.mark.parametrize("exc", [
    ValueError("a bug"), KeyError("x"), status_error(400), status_error(401), status_error(404),
    ToolInputError("bad args"), retry_error(status_error(422)), retry_error(ValueError("bug")),
])
def test_bugs_and_client_errors_are_not(exc: BaseException) -> None:
    assert not is_infrastructure(exc)


def test_retry_error_names_the_last_attempt() -> None:
    failure = inference_failure(retry_error(openai.APIConnectionError(request=REQUEST)))
    assert isinstance(failure, InferenceUnavailable) and "retries exhausted" in str(failure)


def test_reference_names_are_aliases_that_survive_the_cli_round_trip() -> None:
    cfg = AgentEnvConfig(tool_pool_mode="nomad", slots_per_container=10, min_containers=2, max_containers=9,
                         sandbox_job_id="sandbox-agent")
    assert (cfg.sandbox_backend, cfg.slots_per_host, cfg.min_hosts, cfg.max_hosts, cfg.nomad_job_id) == (
        "nomad", 10, 2, 9, "sandbox-agent")
    dumped = cfg.model_dump()
    assert dumped["slots_per_container"] is None  # applied, then cleared
    # atroposlib's CLI: defaults dumped, then the flags merged over them
    merged = AgentEnvConfig(**{**AgentEnvConfig().model_dump(), "slots_per_container": 3, "max_containers": 2})
    assert merged.slots_per_host == 3 and merged.max_hosts == 2
    again = AgentEnvConfig(**{**merged.model_dump(), "slots_per_host": 5})
    assert again.slots_per_host == 5  # a later change of our own name is not undone by the old alias
    with pytest.raises(ValueError, match="min_hosts"):
        AgentEnvConfig(min_containers=5, max_containers=2)


def test_wandb_is_requested_only_explicitly(tmp_path: Any) -> None:
    assert not wandb_requested(["process", "--env.total_steps", "2"], default=False)
    assert wandb_requested(["process"], default=True)
    assert wandb_requested(["process", "--env.use_wandb", "true"], default=False)
    assert wandb_requested(["process", "--env.use_wandb=True"], default=False)
    assert not wandb_requested(["serve", "--env.use_wandb", "false"], default=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("env:\n  use_wandb: true\n")
    assert wandb_requested(["process", "--config", str(cfg)], default=False)
    assert not wandb_requested(["process", "--config", str(cfg), "--env.use_wandb", "false"], default=False)


def test_config_init_default_is_a_server_list_and_names_the_run() -> None:
    class Forgetful(AgentEnv):
        name = "forgetful"

    cfg, servers = Forgetful.config_init()
    assert isinstance(cfg, AgentEnvConfig) and cfg.wandb_name == "forgetful" and cfg.use_wandb is False
    assert isinstance(servers, list) and len(servers) == 1 and isinstance(servers[0], APIServerConfig)


def test_token_ids_only_from_vllm_or_sglang_servers() -> None:
    def server(kind: str) -> Any:
        return SimpleNamespace(config=SimpleNamespace(server_type=kind))

    assert servers_give_token_ids([server("vllm"), server("sglang")])
    assert not servers_give_token_ids([server("vllm"), server("openai")])
    assert not servers_give_token_ids([server("trl")]) and not servers_give_token_ids([])


async def test_context_budget_stops_before_a_turn_that_would_not_fit() -> None:
    turns: list[int] = []

    async def chat(messages: list[dict[str, Any]]) -> ChatReply:
        turns.append(len(messages))
        return ChatReply(text=call_text("bash", command="true"))

    async def run_tools(calls: list[AgentToolCall]) -> list[ToolOutcome]:
        return [ToolOutcome(call_id=c.id, name=c.name, ok=True, content="x" * 50) for c in calls]

    def count(messages: list[dict[str, Any]]) -> int:
        return sum(len(m["content"]) for m in messages)  # a character "tokenizer"

    start = [{"role": "user", "content": "u" * 100}]
    cfg = AgentConfig(max_steps=10, max_tokens=50, max_context_tokens=400)
    result = await run_agent(chat, run_tools, start, cfg, count)
    assert result.finish == "context_budget" and len(turns) == 2
    assert count(result.messages) + 50 > 400
    unlimited = await run_agent(chat, run_tools, start, AgentConfig(max_steps=3, max_tokens=50), count)
    assert unlimited.finish == "max_steps"


def test_tool_message_wraps_unless_told_not_to() -> None:
    assert tool_message("c", "bash", "out")["content"] == "<tool_response>\nout\n</tool_response>"
    assert tool_message("c", "bash", "out", wrap=False)["content"] == "out"


def test_template_wrapping_is_detected() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "<|im_end|>": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}")
    assert template_wraps_tool_responses(tok) is False
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
                         "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    assert template_wraps_tool_responses(tok) is True


def test_a_rollout_split_into_two_nodes_is_refused() -> None:
    node = SimpleNamespace(full_text="a", tokens=[1, 2], masked_tokens=[-100, 2], logprobs=[1.0, -0.5])
    managed = SimpleNamespace(get_state=lambda: {"nodes": [node, node]})
    session = ManagedSession(managed, SimpleNamespace(eos_token="<|im_end|>"))
    with pytest.raises(TokenTrackingError, match="expected 1 tracked sequence"):
        session.tracked()
    one = ManagedSession(SimpleNamespace(get_state=lambda: {"nodes": [node]}), SimpleNamespace(eos_token="</s>"))
    tracked = one.tracked()
    assert tracked.tokens == [1, 2] and tracked.masks == [-100, 2] and tracked.logprobs == [1.0, -0.5]
