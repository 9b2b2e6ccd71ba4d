"""AgentEnv with a scripted policy (an atroposlib APIServer subclass) on a real local pool.

The policy is deterministic so the assertions can be exact: tool calls really run in the slot,
hidden tests score in the slot, tampering with visible tests does not pay, infrastructure
failures are retried instead of scored, cancellation releases every slot, and tokens/masks
decode back to the conversation with exactly the assistant turns trainable.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("atroposlib")

from openai.types.chat import ChatCompletion

from atropos.agent.tokens import IGNORE
from atropos.envs.agent_env import AgentEnvConfig
from atropos.envs.examples.coding import TASKS, CodingEnv
from atropos.errors import HostUnavailable
from tests.scripted import ScriptedServer, call, reply, server_configs

SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "is_palindrome": "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]\n",
}


class ScriptedPolicy(ScriptedServer):
    """honest: write the right solution, run the visible test, answer. cheat: wrong code + edited test."""

    mode = "honest"

    async def respond(self, messages: list[dict[str, Any]]) -> ChatCompletion:
        task = messages[1]["content"]
        name = next(t["name"] for t in TASKS if f"`{t['name']}(" in task)
        turns = sum(1 for m in messages if m["role"] == "assistant")
        if self.mode == "broken" and turns == 0:
            return reply('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>')
        if turns == 0 or (self.mode == "broken" and turns == 1):
            if self.mode == "cheat":
                return call("write_file", path="solution.py", content=f"def {name}(*a):\n    return None\n")
            return call("write_file", path="solution.py", content=SOLUTIONS[name])
        if turns == 1 or (self.mode == "broken" and turns == 2):
            if self.mode == "cheat":
                return call("write_file", path="test_visible.py", content="print('ok')\n")
            return call("bash", command="python3 test_visible.py")
        return reply("Done: implemented and tested.")


def make_env(tokenizer_dir: str, mode: str = "honest", group_size: int = 2) -> CodingEnv:
    cfg = AgentEnvConfig(tokenizer_name=tokenizer_dir, group_size=group_size, use_wandb=False, wandb_name="t",
                         slots_per_host=4, max_hosts=1, agent_max_steps=5, enabled_toolsets=["shell", "files"],
                         ensure_scores_are_not_same=False, tool_batch_window_ms=5)
    servers = server_configs()
    policy = type("Policy", (ScriptedPolicy,), {"mode": mode})
    env_cls = type("TestCodingEnv", (CodingEnv,), {"server_cls": policy})
    env = env_cls(cfg, servers, slurm=False, testing=False)
    env.index = 0
    return env


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from atropos.agent.model import default_gguf_path, ensure_tokenizer_dir

    if not default_gguf_path().exists():
        pytest.skip("the model file is missing: run `python3 scripts/model_server.py ensure --model-only`")
    return str(ensure_tokenizer_dir())


async def test_honest_group_scores_from_hidden_tests_in_the_slot(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir)
    await env.setup_sandbox()
    try:
        group, backlog = await env.collect_trajectories(TASKS[0])
        assert backlog == [] and group is not None
        assert group["scores"] == [1.0, 1.0]
        for tokens, masks, messages in zip(group["tokens"], group["masks"], group["messages"], strict=True):
            assert len(tokens) == len(masks)
            text = env.tokenizer.decode(tokens)
            assert text == env.tokenizer.apply_chat_template(messages, tokenize=False)
            trained = env.tokenizer.decode([t for t, m in zip(tokens, masks, strict=True) if m != IGNORE])
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            # exactly the assistant turns (each with its end-of-turn token) are trainable
            assert trained == "".join(r + env.tokenizer.eos_token for r in replies)
            tool_outputs = [m["content"] for m in messages if m["role"] == "tool"]
            assert "wrote" in tool_outputs[0] and "ok" in tool_outputs[1]  # the calls really ran
        assert env.pool is not None and env.pool.status().leased == 0
    finally:
        await env.shutdown_sandbox()


async def test_editing_visible_tests_does_not_pass_hidden_ones(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir, mode="cheat")
    await env.setup_sandbox()
    try:
        group, _ = await env.collect_trajectories(TASKS[1])
        assert group is not None
        assert group["scores"] == [0.0, 0.0]
        assert any("test_visible.py" in m["content"] for m in group["messages"][0] if m["role"] == "assistant")
    finally:
        await env.shutdown_sandbox()


async def test_malformed_call_gets_an_error_observation(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir, mode="broken", group_size=1)
    await env.setup_sandbox()
    try:
        group, _ = await env.collect_trajectories(TASKS[0])
        assert group is not None
        tools = [m["content"] for m in group["messages"][0] if m["role"] == "tool"]
        assert "malformed JSON" in tools[0]  # not a silent final answer
        assert group["scores"] == [1.0]
    finally:
        await env.shutdown_sandbox()


async def test_infrastructure_failure_is_retried_not_scored(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir)
    await env.setup_sandbox()
    real = env.rollout
    failed: list[str] = []

    async def flaky(item: Any, lease: Any) -> Any:
        if not failed:
            failed.append(lease.trajectory_id)
            raise HostUnavailable("simulated: the host died mid-rollout")
        return await real(item, lease)

    env.rollout = flaky  # type: ignore[method-assign]
    try:
        group, backlog = await env.collect_trajectories(TASKS[0])
        assert group is not None and backlog == []
        assert group["scores"] == [1.0, 1.0]  # the failed rollout was rerun, not scored 0
        assert env.stats["infra_retries"] == 1
        assert env.pool is not None and env.pool.status().leased == 0
    finally:
        await env.shutdown_sandbox()


async def test_cancellation_releases_every_slot(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir, group_size=3)
    await env.setup_sandbox()
    assert env.pool is not None
    real_chat = env.chat

    async def slow_chat(messages: Any) -> Any:
        await asyncio.sleep(30)
        return await real_chat(messages)

    env.chat = slow_chat  # type: ignore[method-assign]
    try:
        task = asyncio.create_task(env.collect_trajectories(TASKS[0]))
        await asyncio.sleep(1.0)
        assert env.pool.status().leased == 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)
        status = env.pool.status()
        assert status.leased == 0 and status.free == 4
    finally:
        await env.shutdown_sandbox()
