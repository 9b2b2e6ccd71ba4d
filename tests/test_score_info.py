"""Issue 28 item 1: why a rollout scored what it did. What ``verify_and_score_trajectory`` returns
beside the score reaches the group's per-rollout ``overrides`` (jsonl, trainer, ``run_group``), the
HTML report, eval ``samples.jsonl``, the run's summary and the metrics (share per verifier error).
A scripted policy on a real local pool: it solves ``add`` and deletes solution.py elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("atroposlib")

from atropos.envs.examples.coding import TASKS
from atropos.testing import make_env, run_group
from tests.score_info_env import ScoreInfoEnv, solve_add_delete_others

REPO = Path(__file__).resolve().parent.parent
SMALL: dict[str, Any] = dict(group_size=2, slots_per_host=3, max_hosts=1, tool_batch_window_ms=5)
ADD, PALINDROME = TASKS[0], TASKS[1]


def _infos(group: Any) -> list[dict[str, Any]]:
    return [o["score_info"] for o in group["overrides"]]


def test_run_group_carries_the_verifier_info_per_rollout(tokenizer_dir: str) -> None:
    solved = run_group(ScoreInfoEnv, solve_add_delete_others, ADD, tokenizer_name=tokenizer_dir, **SMALL)
    assert solved["scores"] == [1.0, 1.0]
    assert _infos(solved) == [{"finish": "final", "verifier": {"hidden_passed": 4, "hidden_total": 4}}] * 2
    failed = run_group(ScoreInfoEnv, solve_add_delete_others, PALINDROME, tokenizer_name=tokenizer_dir, **SMALL)
    assert failed["scores"] == [0.0, 0.0]
    assert [i["verifier"]["verifier_error"] for i in _infos(failed)] == ["no_solution"] * 2


async def test_eval_samples_and_metrics_carry_it(tokenizer_dir: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    env = make_env(ScoreInfoEnv, solve_add_delete_others, tokenizer_name=tokenizer_dir,
                   data_dir_to_save_evals=str(tmp_path), **SMALL)
    try:
        await env.evaluate()  # eval items: add, is_palindrome, fizzbuzz
    finally:
        await env.shutdown_sandbox()
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    errors = sorted(str(s["score_info"]["verifier"].get("verifier_error")) for s in samples)
    assert errors == ["None", "no_solution", "no_solution"], samples
    metrics = json.loads((tmp_path / "metrics.json").read_text())["results"]["all"]
    assert metrics["eval/verifier_error/no_solution"] == pytest.approx(2 / 3)
    assert "eval/verifier_error/no_solution=0.667" in capsys.readouterr().out


async def test_training_metrics_log_the_share_per_verifier_error(tokenizer_dir: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import atroposlib.envs.base as base

    logged: list[dict[str, Any]] = []
    monkeypatch.setattr(base.wandb, "log", lambda metrics, step=None: logged.append(dict(metrics)))
    env = make_env(ScoreInfoEnv, solve_add_delete_others, tokenizer_name=tokenizer_dir, **SMALL)
    try:
        for item in (ADD, PALINDROME):
            group, _ = await env.collect_trajectories(item)
            assert group is not None
        env.config.use_wandb = True  # BaseEnv logs only then (wandb.log is the spy above)
        await env.wandb_log({})
        group, _ = await env.collect_trajectories(ADD)
        await env.wandb_log({})
    finally:
        await env.shutdown_sandbox()
    assert logged[0]["train/verifier_error/no_solution"] == 0.5  # 2 of the 4 rollouts since the start
    assert logged[1]["train/verifier_error/no_solution"] == 0.0  # none of the 2 since the last log


def test_process_run_saves_it_in_the_jsonl_html_and_summary(tokenizer_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "g.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "ATROPOS_MODEL_"))}
    env.update(HF_HUB_OFFLINE="1", ATROPOS_TOKENIZER_DIR=tokenizer_dir, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.score_info_env", "process", "--env.total_steps", "2", "--env.group_size", "2",
         "--env.slots_per_host", "3", "--env.max_hosts", "1", "--env.verifier_check", "false",
         "--env.data_path_to_save_groups", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["scores"] for g in groups] == [[1.0, 1.0], [0.0, 0.0]]  # add, then is_palindrome
    assert [i["verifier"].get("verifier_error") for i in _infos(groups[1])] == ["no_solution"] * 2
    report = (tmp_path / "g.html").read_text()
    assert "id='score-info'" in report and report.count("no_solution") == 2 and "hidden_passed" in report
    assert "[atropos-sandbox] verifier errors (rollouts): no_solution 2/4" in proc.stdout
