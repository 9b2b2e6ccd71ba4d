"""A new user's first day with AgentEnv (issue 20): evaluate starts rollouts as training does (the
group step included), all-equal groups are kept (or, when asked to drop them, counted), and
evaluate prints its metrics. Scripted policies on a real local pool."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("atroposlib")

from atropos.envs.agent_env import AgentEnvConfig
from atropos.envs.examples.coding import TASKS, CodingEnv
from atropos.envs.verifier_check import VerifierCheckResult
from tests.scripted_env import CodingPolicy, make_coding_env


def _env(env_cls: type[CodingEnv], tokenizer_dir: str, policy: type = CodingPolicy, **overrides: Any) -> CodingEnv:
    return make_coding_env(tokenizer_dir, policy, env_cls=env_cls, **overrides)


class GroupSetupEnv(CodingEnv):
    """Scores 1 only when the group step's file is in the rollout's slot."""

    async def setup_group_workspace(self, item: Any, *, trajectory_id: str, exec_tool: Any,
                                    lease: Any) -> dict[str, Any]:
        await lease.write_file("from_group_setup.txt", "prepared")
        return {}

    async def verify_and_score_trajectory(self, item: Any, final_response: str, *, trajectory_id: str,
                                          exec_tool: Any, lease: Any,
                                          agent_result: Any) -> tuple[float, dict[str, Any]]:
        r = await lease.call("read_file", {"path": "from_group_setup.txt"})
        return (1.0 if r.ok and r.result["content"] == "prepared" else 0.0), {}


async def test_evaluate_runs_the_group_setup(tokenizer_dir: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    env = _env(GroupSetupEnv, tokenizer_dir, data_dir_to_save_evals=str(tmp_path))
    try:
        await env.evaluate()
        metrics = json.loads((tmp_path / "metrics.json").read_text())["results"]["all"]
        assert metrics["eval/n"] == 3 and metrics["eval/mean_score"] == 1.0, metrics
        assert env.eval_stats["group_setups"] == 3 and env.stats["group_setups"] == 0
        assert env.pool is not None
        for host in env.pool.hosts.values():
            assert await host.client.templates() == []  # each eval item's template went with it
    finally:
        await env.shutdown_sandbox()
    assert "[atropos-sandbox] eval: eval/n=3" in capsys.readouterr().out


async def test_evaluate_prints_metrics_without_an_eval_dir(tokenizer_dir: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    env = _env(CodingEnv, tokenizer_dir)
    try:
        await env.evaluate()
    finally:
        await env.shutdown_sandbox()
    out = capsys.readouterr().out
    assert "eval/n=3" in out and "eval/mean_score=1.000" in out, out


class Cheat(CodingPolicy):
    mode = "cheat"  # every rollout fails the hidden tests: an all-zero group


async def test_an_all_zero_group_is_saved_by_default(tokenizer_dir: str, tmp_path: Path) -> None:
    assert AgentEnvConfig().ensure_scores_are_not_same is False
    out = tmp_path / "groups.jsonl"
    env = _env(CodingEnv, tokenizer_dir, Cheat, data_path_to_save_groups=str(out))
    try:
        group, _ = await env.collect_trajectories(TASKS[0])
        assert group is not None and group["scores"] == [0.0, 0.0]
        await env.handle_send_to_api(group, TASKS[0], do_send_to_api=False)
    finally:
        await env.shutdown_sandbox()
    env.jsonl_writer.close()  # type: ignore[union-attr]
    saved = [json.loads(line) for line in Path(env.config.data_path_to_save_groups or "").read_text().splitlines()]
    assert [g["scores"] for g in saved] == [[0.0, 0.0]]


async def test_dropping_equal_groups_when_asked_is_reported(tokenizer_dir: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "groups.jsonl"
    env = _env(CodingEnv, tokenizer_dir, Cheat, data_path_to_save_groups=str(out), ensure_scores_are_not_same=True)
    try:
        group, _ = await env.collect_trajectories(TASKS[0])
        await env.handle_send_to_api(group, TASKS[0], do_send_to_api=False)
    finally:
        await env.shutdown_sandbox()
    env.print_summary()
    assert env.stats["groups_dropped_same_scores"] == 1
    assert "1 group(s) dropped" in capsys.readouterr().out


async def _check_verifier(env_cls: type[CodingEnv], tokenizer_dir: str) -> list[VerifierCheckResult]:
    """The env's verifier check, run on its own (a slot per reference and stub run)."""
    env = _env(env_cls, tokenizer_dir, slots_per_host=12)
    try:
        return await env.check_verifier()
    finally:
        await env.shutdown_sandbox()


async def test_the_verifier_check_shows_reference_1_and_stub_0(tokenizer_dir: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    results = await _check_verifier(CodingEnv, tokenizer_dir)
    assert [r.family for r in results] == [t["name"] for t in TASKS]
    assert all(r.reference_score == 1.0 and r.stub_score == 0.0 for r in results), results
    assert all(r.reference_saw and r.stub_saw for r in results)  # what the verifier reported, per run
    out = capsys.readouterr().out
    assert "verifier check" in out and "all as expected" in out and "reference 1.000  stub 0.000" in out


class YesManEnv(CodingEnv):
    """A broken verifier: every run passes."""

    async def verify_and_score_trajectory(self, item: Any, final_response: str, *, trajectory_id: str,
                                          exec_tool: Any, lease: Any,
                                          agent_result: Any) -> tuple[float, dict[str, Any]]:
        return 1.0, {}


async def test_a_verifier_that_cannot_say_no_is_flagged(tokenizer_dir: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    results = await _check_verifier(YesManEnv, tokenizer_dir)
    assert all(r.stub_score == 1.0 and not r.ok for r in results)
    assert "NOT AS EXPECTED for add" in capsys.readouterr().out


def _no_tool_hints(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no rollout of this group called a tool" in r.getMessage()]


def test_a_run_whose_model_calls_no_tool_says_which_flags_help(tokenizer_dir: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Issue 28 item 3: a small model answers at once; the run says once which flags make it call tools."""
    from atropos.testing import by_turn, run_group

    small = dict(tokenizer_name=tokenizer_dir, group_size=2, slots_per_host=2, max_hosts=1)
    caplog.set_level("WARNING", logger="atropos.envs.agent_env")
    group = run_group(CodingEnv, by_turn("The answer is 42."), TASKS[0], tool_call_grammar=False, **small)
    assert group["scores"] == [0.0, 0.0]
    hints = _no_tool_hints(caplog)
    assert len(hints) == 1 and "--env.tool_call_grammar true --env.grammar_forced_tool_turns" in hints[0]
    caplog.clear()
    run_group(CodingEnv, by_turn("The answer is 42."), TASKS[0], tool_call_grammar=True, **small)
    assert _no_tool_hints(caplog) == []  # the grammar is on: nothing to suggest


def test_the_hidden_test_files_example_scores_through_run_group(tokenizer_dir: str) -> None:
    """Issue 28 item 4: the example env scored by hidden test files; the honest solution passes all."""
    from atropos.envs.examples.coding_pytest import CodingPytestEnv
    from atropos.testing import run_group
    from tests.scripted_env import honest_turn

    def honest(messages: list[dict[str, Any]]) -> str:
        return honest_turn("add", sum(m["role"] == "assistant" for m in messages))

    group = run_group(CodingPytestEnv, honest, TASKS[0], tokenizer_name=tokenizer_dir, group_size=2,
                      slots_per_host=2, max_hosts=1)
    assert group["scores"] == [1.0, 1.0]
    verifier = group["overrides"][0]["score_info"]["verifier"]
    assert verifier == {"tests_passed": 4, "tests_total": 4, "failed": []}
