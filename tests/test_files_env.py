"""The terminal/files example env: its checker reads the slot's final state; evaluate() logs metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("atroposlib")

from openai.types.chat import ChatCompletion

from atropos.envs.agent_env import AgentEnvConfig
from atropos.envs.examples.files import FilesEnv, make_task
from atropos.testing import ScriptedServer, call, reply, server_configs

SOLVE = {
    "count_lines": "mkdir -p reports && wc -l < data.csv | tr -d ' ' > reports/summary.txt",
    "sum_numbers": "paste -sd+ numbers.txt | bc > total.txt 2>/dev/null || "
                   "python3 -c \"print(sum(int(x) for x in open('numbers.txt')))\" > total.txt",
    "rename_logs": "cd logs && for f in *.log; do mv \"$f\" \"${f%.log}.txt\"; done",
}


class Solver(ScriptedServer):
    wrong = False

    async def respond(self, messages: list[dict[str, Any]]) -> ChatCompletion:
        if any(m["role"] == "tool" for m in messages):
            return reply("done")
        task = messages[1]["content"]
        kind = ("count_lines" if "data.csv" in task else "sum_numbers" if "numbers.txt" in task else "rename_logs")
        command = "echo 0 > total.txt; mkdir -p reports; echo 0 > reports/summary.txt" if self.wrong else SOLVE[kind]
        return call("bash", command=command)


def make_env(tokenizer_dir: str, wrong: bool, eval_dir: Path | None = None) -> FilesEnv:
    cfg = AgentEnvConfig(tokenizer_name=tokenizer_dir, group_size=2, use_wandb=False, wandb_name="f",
                         slots_per_host=6, max_hosts=1, agent_max_steps=3, ensure_scores_are_not_same=False,
                         data_dir_to_save_evals=str(eval_dir) if eval_dir else None)
    servers = server_configs()
    env_cls = type("T", (FilesEnv,), {"server_cls": type("S", (Solver,), {"wrong": wrong})})
    env = env_cls(cfg, servers, slurm=False, testing=False)
    env.rng = random.Random(5)
    return env


@pytest.mark.parametrize("kind", ["count_lines", "sum_numbers", "rename_logs"])
async def test_checker_rewards_the_state_not_the_claim(tokenizer_dir: str, kind: str) -> None:
    item = make_task(kind, random.Random(3))
    for wrong, expected in ((False, 1.0), (True, 0.0)):
        env = make_env(tokenizer_dir, wrong)
        await env.setup_sandbox()
        try:
            group, _ = await env.collect_trajectories(item)
            assert group is not None and group["scores"] == [expected, expected]
        finally:
            await env.shutdown_sandbox()


async def test_evaluate_runs_held_out_items_and_logs(tokenizer_dir: str, tmp_path: Path) -> None:
    env = make_env(tokenizer_dir, wrong=False, eval_dir=tmp_path)
    try:
        await env.evaluate()
        metrics = json.loads((tmp_path / "metrics.json").read_text())
        assert metrics["results"]["all"]["eval/mean_score"] == 1.0
        assert metrics["results"]["all"]["eval/n"] == 3
    finally:
        await env.shutdown_sandbox()
