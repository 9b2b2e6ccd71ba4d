"""A search QA environment: the agent answers questions with web_search/web_extract, rewarded when its
final answer matches the ground truth. Offline by default (in-process ToolServer over the built-in
corpus); point ``--env.tool_server_url`` at a ToolServer with a real provider for live search.

Tasks are JSONL rows ``{"question", "answer"}`` (``--env.tasks_path``; default: a small built-in set).

``python -m atropos.envs.examples.search process --env.total_steps 2``
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from atropos.envs.agent_env import AgentEnv, AgentEnvConfig
from atropos.envs.examples.common import server_configs, tokenizer_dir
from atropos.envs.examples.gaia import extract_final_answer, normalize

BUILTIN_TASKS = Path(__file__).with_name("search_tasks") / "train.jsonl"


class SearchEnvConfig(AgentEnvConfig):
    tasks_path: str | None = Field(None, description="JSONL of {question, answer} (default: built-in)")


class SearchEnv(AgentEnv):
    name = "search"
    env_config_cls = SearchEnvConfig
    system_preamble = ("Answer the question. Search before answering, then reply with 'FINAL ANSWER: <answer>' "
                       "and no tool call.")

    @classmethod
    def config_init(cls) -> tuple[SearchEnvConfig, list[Any]]:
        return SearchEnvConfig(
            tokenizer_name=tokenizer_dir(), group_size=4, use_wandb=False, wandb_name="search", total_steps=2,
            max_token_length=4096, worker_timeout=1800, agent_max_steps=4, agent_max_tokens=128,
            tool_call_grammar=True, grammar_forced_tool_turns=1, enabled_toolsets=[],
            tool_server_url="inprocess", ensure_scores_are_not_same=False,
        ), server_configs()

    async def setup(self) -> None:
        await super().setup()
        cfg: SearchEnvConfig = self.config
        path = Path(cfg.tasks_path) if cfg.tasks_path else BUILTIN_TASKS
        self.tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        self.index = 0

    async def get_next_item(self) -> dict[str, Any]:
        item = self.tasks[self.index % len(self.tasks)]
        self.index += 1
        return item

    def build_task(self, item: dict[str, Any]) -> str:
        return str(item["question"])

    async def score_trajectory(self, item: dict[str, Any], final_response: str) -> float:
        return 1.0 if normalize(extract_final_answer(final_response)) == normalize(item["answer"]) else 0.0


if __name__ == "__main__":
    SearchEnv.cli()
