"""AgentEnv with scripted policies (atroposlib APIServer subclasses) on a real local pool.

The policies are deterministic so the assertions can be exact: tool calls really run in the slot,
hidden tests score in the slot, tampering with visible tests does not pay, infrastructure failures
(a killed host, a lease timeout, the inference server) are retried or sent back instead of scored,
cancellation releases every slot, and tokens/masks decode back to the conversation with exactly
the assistant turns trainable: from the chat template, or from ManagedServer with logprobs.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("atroposlib")

import httpx
import openai
import tenacity
from openai.types.chat import ChatCompletion

from atropos.agent.tokens import IGNORE, count_prompt_tokens
from atropos.envs.agent_env import PROCESS_MAX_LOST_GROUPS, AgentEnvConfig
from atropos.envs.examples.coding import TASKS, CodingEnv
from atropos.errors import InfrastructureError
from atropos.slots.audit import double_leases
from atropos.testing import ScriptedTokenServer, logprob_of, server_configs, token_server_configs
from tests.scripted_env import CodingPolicy, honest_turn, make_coding_env, task_name

REPO = Path(__file__).resolve().parent.parent


def make_env(tokenizer_dir: str, policy: type = CodingPolicy, servers: list[Any] | None = None,
             **overrides: Any) -> CodingEnv:
    return make_coding_env(tokenizer_dir, policy, servers=servers, **{"agent_max_steps": 5, **overrides})


def mode(name: str) -> type:
    return type(f"Policy_{name}", (CodingPolicy,), {"mode": name})


def check_chat_template_tokens(env: CodingEnv, group: Any) -> None:
    tok = env.tokenizer
    for tokens, masks, messages in zip(group["tokens"], group["masks"], group["messages"], strict=True):
        assert len(tokens) == len(masks)
        assert tok.decode(tokens) == tok.apply_chat_template(messages, tokenize=False)
        trained = tok.decode([t for t, m in zip(tokens, masks, strict=True) if m != IGNORE])
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        # exactly the assistant turns (each with its end-of-turn token) are trainable
        assert trained == "".join(r + tok.eos_token for r in replies)


# -- the basics ------------------------------------------------------------------------------------
async def test_honest_group_scores_from_hidden_tests_in_the_slot(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir)
    await env.setup_sandbox()
    try:
        group, backlog = await env.collect_trajectories(TASKS[0])
        assert backlog == [] and group is not None
        assert group["scores"] == [1.0, 1.0]
        assert "inference_logprobs" not in group  # the chat-template path has no sampled logprobs
        check_chat_template_tokens(env, group)
        for messages in group["messages"]:
            tool_outputs = [m["content"] for m in messages if m["role"] == "tool"]
            assert "wrote" in tool_outputs[0] and "ok" in tool_outputs[1]  # the calls really ran
            # SmolLM2's template renders the tool role as is, so the agent adds the tags (once)
            assert all(t.startswith("<tool_response>\n") and t.count("<tool_response>") == 1 for t in tool_outputs)
        assert env.pool is not None and env.pool.status().leased == 0
    finally:
        await env.shutdown_sandbox()


async def test_editing_visible_tests_does_not_pass_hidden_ones(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir, mode("cheat"))
    await env.setup_sandbox()
    try:
        group, _ = await env.collect_trajectories(TASKS[1])
        assert group is not None
        assert group["scores"] == [0.0, 0.0]
        assert any("test_visible.py" in m["content"] for m in group["messages"][0] if m["role"] == "assistant")
    finally:
        await env.shutdown_sandbox()


async def test_malformed_call_gets_an_error_observation(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir, mode("broken"), group_size=1)
    await env.setup_sandbox()
    try:
        group, _ = await env.collect_trajectories(TASKS[0])
        assert group is not None
        tools = [m["content"] for m in group["messages"][0] if m["role"] == "tool"]
        assert "malformed JSON" in tools[0]  # not a silent final answer
        assert group["scores"] == [1.0]
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


# -- ManagedServer: sampled ids, masks and logprobs ----------------------------------------------------
class ManagedCodingPolicy(ScriptedTokenServer):
    async def respond_text(self, prompt: str) -> str:
        turns = prompt.count("<|im_start|>assistant") - 1  # earlier replies; the last one is the generation prompt
        return honest_turn(task_name(prompt), turns)


async def test_managed_path_takes_sampled_tokens_masks_and_logprobs(tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    policy = type("Managed", (ManagedCodingPolicy,), {"tokenizer": tok, "token_calls": []})
    env = make_env(tokenizer_dir, policy, token_server_configs())
    assert env.managed_tokens and env.server.tool_parser == "hermes"
    await env.setup_sandbox()
    try:
        group, backlog = await env.collect_trajectories(TASKS[0])
        assert backlog == [] and group is not None and group["scores"] == [1.0, 1.0]
        assert len(policy.token_calls) == 6  # 3 turns x 2 rollouts, all through the token-id endpoint
        assert env.stats["token_tracking_fallbacks"] == 0  # each rollout ended as exactly one node
        eos = tok.eos_token
        assert len(group["inference_logprobs"]) == 2
        for tokens, masks, logprobs, messages in zip(group["tokens"], group["masks"], group["inference_logprobs"],
                                                     group["messages"], strict=True):
            assert len(tokens) == len(masks) == len(logprobs)
            for t, m, lp in zip(tokens, masks, logprobs, strict=True):
                # the server's logprob at every sampled position, 1.0 wherever the mask hides the token
                assert (lp == 1.0) if m == IGNORE else (m == t and lp == logprob_of(t))
            decoded = tok.decode(tokens)
            rendered = tok.apply_chat_template(messages, tokenize=False)
            # the sequence ends at the last sampled EOS; the template only adds its newline after it.
            # Equality also proves no EOS is doubled at a turn boundary (reference §3.4).
            assert rendered == decoded + "\n"
            trained = tok.decode([t for t, m in zip(tokens, masks, strict=True) if m != IGNORE])
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            assert len(replies) == 3 and trained == "".join(r + eos for r in replies)
        assert env.pool is not None and env.pool.status().leased == 0
    finally:
        await env.shutdown_sandbox()


# -- infrastructure: a killed host, a lease timeout, the inference server ----------------------------
class SleepyPolicy(CodingPolicy):
    """The first ``sleeps[0]`` first turns run a long command (so a host can be killed under it);
    every later turn is honest."""

    sleeps: list[int]

    async def respond(self, messages: list[dict[str, Any]]) -> ChatCompletion:
        if not any(m["role"] == "assistant" for m in messages) and self.sleeps[0] > 0:
            self.sleeps[0] -= 1
            from atropos.testing import call

            return call("bash", command="sleep 60")
        return await super().respond(messages)


async def kill_hosts_under_rollouts(env: CodingEnv, policy: Any) -> set[str]:
    """Wait until every sleepy first turn is running in its slot, then SIGKILL the hosts."""
    assert env.pool is not None
    for _ in range(600):
        if policy.sleeps[0] == 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # the sleep commands are in flight now
    killed = set(env.pool.hosts)
    for host_id in killed:
        pid = env.pool.backend.pid(host_id)  # type: ignore[attr-defined]
        assert pid is not None
        os.kill(pid, 9)
    return killed


async def test_killed_host_mid_rollout_is_retried_on_a_fresh_slot(tokenizer_dir: str) -> None:
    policy = type("Sleepy", (SleepyPolicy,), {"sleeps": [2]})
    env = make_env(tokenizer_dir, policy, slots_per_host=2, max_hosts=2)
    await env.setup_sandbox()
    assert env.pool is not None
    try:
        task = asyncio.create_task(env.collect_trajectories(TASKS[0]))
        killed = await kill_hosts_under_rollouts(env, policy)
        group, backlog = await asyncio.wait_for(task, 240)
        assert group is not None and backlog == []
        assert group["scores"] == [1.0, 1.0]  # rerun from scratch on a fresh slot, not scored 0
        assert env.stats["infra_retries"] == 2 and env.stats["items_backlogged"] == 0
        for messages in group["messages"]:
            assert "sleep 60" not in json.dumps(messages)  # the kept trajectory is the retried one
        status = env.pool.status()
        assert status.leased == 0 and status.lost_hosts >= 1 and not killed & set(env.pool.hosts)
        retried = [e for e in env.pool.audit.events if e.event == "lease" and e.trajectory_id.endswith("-r1")]
        assert len(retried) == 2 and all(e.host not in killed for e in retried)
        assert double_leases(env.pool.audit.events) == []
    finally:
        await env.shutdown_sandbox()


async def test_killed_host_with_retries_exhausted_goes_to_the_backlog(tokenizer_dir: str) -> None:
    policy = type("Sleepy", (SleepyPolicy,), {"sleeps": [2]})
    env = make_env(tokenizer_dir, policy, slots_per_host=2, max_hosts=2, infra_retries=0)
    await env.setup_sandbox()
    assert env.pool is not None
    try:
        task = asyncio.create_task(env.collect_trajectories(TASKS[0]))
        await kill_hosts_under_rollouts(env, policy)
        group, backlog = await asyncio.wait_for(task, 120)
        assert group is None and backlog == [TASKS[0]]  # back to the backlog, never a score of 0
        assert env.stats["items_backlogged"] == 1 and env.stats["rollouts"] == 0
        assert env.pool.status().leased == 0
        assert double_leases(env.pool.audit.events) == []
    finally:
        await env.shutdown_sandbox()


async def test_lease_timeout_sends_the_item_back(tokenizer_dir: str) -> None:
    # 3 rollouts, 2 slots, 1 host: lease_many times out with SlotUnavailable (not an InfrastructureError)
    env = make_env(tokenizer_dir, group_size=3, slots_per_host=2, max_hosts=1, acquire_timeout_s=1.0)
    await env.setup_sandbox()
    assert env.pool is not None
    try:
        group, backlog = await env.collect_trajectories(TASKS[0])
        assert group is None and backlog == [TASKS[0]]
        assert env.stats["items_backlogged"] == 1 and env.stats["rollouts"] == 0
        status = env.pool.status()
        assert status.leased == 0 and status.waiting == 0
    finally:
        await env.shutdown_sandbox()


def retry_error() -> BaseException:
    """What atroposlib raises once its tenacity retries give up on an unreachable server."""
    attempt = tenacity.Future(3)
    attempt.set_exception(openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1")))
    return tenacity.RetryError(attempt)


class FlakyInference(CodingPolicy):
    """Fails ``failures[0]`` chat calls (for tasks matching ``only``) with ``error()``, then answers."""

    failures: list[int]
    error: Callable[[], BaseException] = staticmethod(retry_error)
    only: str | None = None

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        hit = self.only is None or self.only in kwargs["messages"][1]["content"]
        if hit and self.failures[0] > 0:
            self.failures[0] -= 1
            raise self.error()
        return await super().chat_completion(**kwargs)


def flaky(failures: int, error: Callable[[], BaseException] = retry_error, only: str | None = None) -> type:
    return type("Flaky", (FlakyInference,), {"failures": [failures], "error": staticmethod(error), "only": only})


async def test_inference_failures_are_retried_then_backlogged_and_bugs_raise(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir, flaky(1), infra_retries=1)
    await env.setup_sandbox()
    assert env.pool is not None
    try:
        group, backlog = await env.collect_trajectories(TASKS[0])  # tenacity.RetryError(APIConnectionError)
        assert group is not None and group["scores"] == [1.0, 1.0] and env.stats["infra_retries"] == 1

        server = env.server.servers[0]
        server.failures[0] = 100  # a raw transport error every time: the retry fails too
        server.error = lambda: httpx.ConnectError("connection refused")
        group, backlog = await env.collect_trajectories(TASKS[0])
        assert group is None and backlog == [TASKS[0]] and env.stats["items_backlogged"] == 1

        def bad_request() -> BaseException:
            request = httpx.Request("POST", "http://127.0.0.1:9/v1")
            return openai.BadRequestError("bad request", response=httpx.Response(400, request=request), body=None)

        server.error = bad_request
        with pytest.raises(openai.BadRequestError):  # our request is wrong: raised, not retried forever
            await env.collect_trajectories(TASKS[0])
        assert env.pool.status().leased == 0
    finally:
        await env.shutdown_sandbox()


async def test_process_mode_retries_a_lost_group_in_place_then_gives_up(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir, flaky(2), group_size=1, infra_retries=0)
    env._process_mode = True  # as process_manager sets it: BaseEnv would drop a returned backlog there
    await env.setup_sandbox()
    try:
        group, _ = await env.collect_trajectories(TASKS[0])
        assert group is not None and group["scores"] == [1.0] and env.stats["items_backlogged"] == 2
        env.server.servers[0].failures[0] = 1000
        with pytest.raises(InfrastructureError, match="in a row"):
            await env.collect_trajectories(TASKS[0])
        assert env.stats["items_backlogged"] == 2 + PROCESS_MAX_LOST_GROUPS
    finally:
        await env.shutdown_sandbox()


# -- evaluate ------------------------------------------------------------------------------------------
async def test_evaluate_survives_an_infra_failure_and_keeps_training_stats_apart(tokenizer_dir: str,
                                                                                  tmp_path: Path) -> None:
    env = make_env(tokenizer_dir, flaky(100, only="fizzbuzz"), infra_retries=1,
                   data_dir_to_save_evals=str(tmp_path))
    try:
        await env.evaluate()  # TASKS[:3]: add, is_palindrome, fizzbuzz (whose inference always fails)
        metrics = json.loads((tmp_path / "metrics.json").read_text())["results"]["all"]
        assert metrics["eval/n"] == 2 and metrics["eval/infra_failures"] == 1 and metrics["eval/mean_score"] == 1.0
        assert env.stats["rollouts"] == 0 and env.stats["infra_retries"] == 0  # training metrics untouched
        assert env.eval_stats["rollouts"] == 2 and env.eval_stats["infra_retries"] == 1
    finally:
        await env.shutdown_sandbox()


async def test_evaluate_command_stops_the_pool(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir)
    pids: list[int] = []
    real = env.evaluate

    async def spy(fail: bool) -> None:
        assert env.pool is not None
        pids.extend(env.pool.backend.pid(h) for h in env.pool.hosts)  # type: ignore[attr-defined]
        if fail:
            raise RuntimeError("a bug in evaluate")
        await real()

    env.evaluate = lambda: spy(False)  # type: ignore[method-assign]
    await env._run_evaluate()  # what `python -m env evaluate` runs
    assert env.pool is None
    env.evaluate = lambda: spy(True)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await env._run_evaluate()
    assert env.pool is None and len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- config: CLI flags, reference names, hooks, tool tags, context budget -----------------------------
def test_process_cli_flags_reach_the_pool_and_wandb_stays_off(tokenizer_dir: str, tmp_path: Path) -> None:
    out, status_file = tmp_path / "groups.jsonl", tmp_path / "status.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}  # no WANDB_MODE: we must set it
    env.update(HF_HUB_OFFLINE="1", ATROPOS_TOKENIZER_DIR=tokenizer_dir, ATROPOS_TEST_POOL_STATUS=str(status_file),
               PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripted_env", "process", "--env.total_steps", "1", "--env.group_size", "2",
         "--env.slots_per_host", "3", "--env.max_hosts", "1", "--env.sandbox_backend", "local",
         "--env.data_path_to_save_groups", str(out), "--env.tool_batch_window_ms", "5",
         "--env.verifier_check", "false"],  # its leases would count below
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(status_file.read_text())  # the pool's own status, taken before it stopped
    assert status["backend"] == "local"
    assert [h["slots"] for h in status["hosts"]] == [3] and status["hosts"][0]["free"] == 3
    assert status["leases_total"] == 2 and status["leased"] == 0
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 1 and groups[0]["scores"] == [1.0, 1.0]
    assert not (tmp_path / "wandb").exists()


async def test_reference_config_names_and_setup_agent_env_hook(tokenizer_dir: str) -> None:
    calls: list[int] = []

    class Hooked(CodingEnv):
        server_cls = CodingPolicy

        async def setup_agent_env(self) -> None:
            assert self.pool is not None  # runs after the pool is up
            calls.append(self.pool.status().free)

    cfg = AgentEnvConfig(tokenizer_name=tokenizer_dir, use_wandb=False, tool_pool_mode="local",
                         slots_per_container=3, min_containers=1, max_containers=1, sandbox_job_id="job-x")
    assert (cfg.sandbox_backend, cfg.slots_per_host, cfg.min_hosts, cfg.max_hosts, cfg.nomad_job_id) == (
        "local", 3, 1, 1, "job-x")
    env = Hooked(cfg, server_configs(), slurm=False, testing=False)
    try:
        await env.setup()
        assert env.pool is not None and calls == [3]
        status = env.pool.status()
        assert status.backend == "local" and [h.slots for h in status.hosts] == [3]
        assert env.pool.cfg.max_hosts == 1
    finally:
        await env.shutdown_sandbox()


WRAPPING_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


async def test_tool_output_is_wrapped_only_when_the_template_does_not(tokenizer_dir: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = WRAPPING_TEMPLATE  # Hermes/Qwen style: the template adds <tool_response> itself
    tok.save_pretrained(tmp_path / "tok")
    env = make_env(str(tmp_path / "tok"))
    assert env.wrap_tool_responses is False
    await env.setup_sandbox()
    try:
        group, _ = await env.collect_trajectories(TASKS[0])
        assert group is not None and group["scores"] == [1.0, 1.0]
        check_chat_template_tokens(env, group)
        for tokens, messages in zip(group["tokens"], group["messages"], strict=True):
            tool_outputs = [m["content"] for m in messages if m["role"] == "tool"]
            assert tool_outputs and not any("<tool_response>" in t for t in tool_outputs)
            assert env.tokenizer.decode(tokens).count("<tool_response>") == len(tool_outputs)  # once each
    finally:
        await env.shutdown_sandbox()


async def test_context_budget_stops_the_loop(tokenizer_dir: str) -> None:
    env = make_env(tokenizer_dir)
    first = count_prompt_tokens(env.tokenizer, [{"role": "system", "content": env.system_prompt()},
                                                {"role": "user", "content": env.build_task(TASKS[0])}])
    # room for the first turn only: the second prompt (reply + tool output) does not fit with max_tokens
    env.config.max_token_length = first + env.config.agent_max_tokens + 20
    await env.setup_sandbox()
    try:
        group, _ = await env.collect_trajectories(TASKS[0])
        assert group is not None and env.stats["context_budget_stops"] == 2
        for tokens, messages in zip(group["tokens"], group["messages"], strict=True):
            assert [m["role"] for m in messages].count("assistant") == 1
            assert len(tokens) <= env.config.max_token_length
        assert group["scores"] == [1.0, 1.0]  # the first turn wrote the solution; verification still ran
    finally:
        await env.shutdown_sandbox()
