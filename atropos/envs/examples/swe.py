"""A SWE-style environment: every task is its own image (a repository at ``/testbed`` with a bug,
its own interpreter env), each rollout's slot has that image as its root, and the reward is
SWE-bench's: the task's FAIL_TO_PASS and PASS_TO_PASS tests, run in the verification phase on a
fresh root of the image holding only the agent's changes to ``/testbed``, the tests and test
settings the image's (``atropos/envs/repo_tests.py``), score 1 only if all pass.

The task images are built here from the project's base image on first use (``swe_tasks.py``; the
Docker engine's, no registry), so the env needs a Docker engine on the machine that runs it and on
the sandbox hosts' (the local backend's is the same machine).

``python -m atropos.envs.examples.swe process --env.total_steps 2 --env.group_size 2``
"""

from __future__ import annotations

import asyncio
from typing import Any

from atropos.envs.agent_env import AgentEnv, AgentEnvConfig, ExecTool
from atropos.envs.examples.common import server_configs, tokenizer_dir
from atropos.envs.examples.swe_tasks import SweTask, task_images
from atropos.envs.repo_tests import RepoTests, run_repo_tests
from atropos.envs.verifier_check import VerifierCheck
from atropos.slots.lease import Lease
from atropos.testing import by_turn, tool_call

__all__ = ["SweEnv", "gold_policy"]


def gold_policy(task: SweTask) -> Any:
    """The reference fix applied with the agent's own tools (``edit_file`` on the repository),
    then the tests run with ``bash`` as an agent would, then the answer."""
    edits = [tool_call("edit_file", path=f"{task.tests.repo_dir}/{e.path}", old_string=e.old, new_string=e.new)
             for e in task.gold]
    return by_turn(*edits, tool_call("bash", command="python -m pytest -q -p no:cacheprovider"),
                   "Fixed: the failing tests pass now.")


class SweEnv(AgentEnv):
    name = "swe"
    system_preamble = (
        "You are a software engineer in a Linux sandbox. The repository is at /testbed (your working "
        "directory), with its own Python environment first on PATH (`python`, `pytest`). Find the bug the "
        "issue describes, fix it in the repository's code (not in its tests), check with `pytest`, and when "
        "done reply with a short summary and no tool call."
    )

    @classmethod
    def config_init(cls) -> tuple[AgentEnvConfig, list[Any]]:
        return AgentEnvConfig(
            tokenizer_name=tokenizer_dir(), group_size=2, use_wandb=False, wandb_name="swe",
            total_steps=2, max_token_length=6144, worker_timeout=1800, agent_max_steps=8,
            agent_max_tokens=384, tool_call_grammar=True, grammar_forced_tool_turns=2,
            enabled_toolsets=["shell", "files"], ensure_scores_are_not_same=False,
        ), server_configs()

    async def setup_agent_env(self) -> None:
        """Build (or find) the task images, then have the pool import them ahead of the first group."""
        self.tasks: list[SweTask] = await asyncio.to_thread(task_images)
        self.index = 0
        if self.pool is not None:
            await self.pool.prepare_images([t.image for t in self.tasks])

    async def get_next_item(self) -> dict[str, Any]:
        task = self.tasks[self.index % len(self.tasks)]
        self.index += 1
        return task.model_dump()

    def eval_items(self) -> list[Any]:
        return [t.model_dump() for t in self.tasks]

    def build_task(self, item: dict[str, Any]) -> str:
        return (f"Issue in the repository at /testbed:\n\n{item['problem_statement']}\n\n"
                "Fix it in the code. The repository's tests run with `pytest` in /testbed.")

    async def verify_and_score_trajectory(self, item: dict[str, Any], final_response: str, *, trajectory_id: str,
                                          exec_tool: ExecTool, lease: Lease, agent_result: Any,
                                          ) -> tuple[float, dict[str, Any]]:
        return await run_repo_tests(lease, RepoTests.model_validate(item["tests"]))

    async def score_trajectory(self, item: dict[str, Any], final_response: str) -> float:
        raise NotImplementedError("scored in the slot by verify_and_score_trajectory")

    def verifier_checks(self) -> list[VerifierCheck]:
        return [VerifierCheck(t.instance_id, t.model_dump(), gold_policy(t)) for t in self.tasks]


if __name__ == "__main__":
    SweEnv.cli()
